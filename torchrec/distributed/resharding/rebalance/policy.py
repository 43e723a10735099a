#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: when a rebalancing reshard pays.

``RebalancePolicy`` holds the user's knobs; ``PolicyState`` what the policy
remembers between windows (streak of windows over the gain bar, last reshard,
failures, the full replan in the background); ``screen`` decides from the
predicted gain alone whether a candidate is worth a dry run, ``judge_move``
from the dry run's bytes whether the predicted saving over the horizon
exceeds the predicted cost of the move, ``byte_price`` what a byte moved
costs per step (for the search), ``may_replan`` whether TorchRec's full
planner may be started in the background. Every input is identical on every
rank, so every rank decides the same.
"""

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

# Bytes/s a rank's move is assumed to run at before a reshard was measured,
# by device type: gloo over TCP between hosts, and NCCL between GPUs
# (conservative next to NVLink or InfiniBand; the first measured reshard
# replaces it).
DEFAULT_BANDWIDTHS: Dict[str, float] = {
    "cpu": 50.0 * 2**20,
    "cuda": 2.0 * 2**30,
}
DEFAULT_BANDWIDTH: float = DEFAULT_BANDWIDTHS["cpu"]


# A shard's fixed cost per id it reads, whatever its width, in columns of
# that shard (see costs.py): fitted by benchmarks/shard_cost_benchmark.py on
# fbgemm's CPU kernel (fused exact SGD, one thread; widths 8-256: 8.9 ms +
# 63.5 us per column for 512k ids, 140 columns; later runs on the shared
# host fitted up to 190, and 140 predicts a halved shard within 16% at every
# width there). Not calibrated on CUDA yet: there the model keeps pricing
# elements only.
DEFAULT_LOOKUP_COLUMNS: Dict[str, float] = {
    "cpu": 140.0,
    "cuda": 0.0,
}


def default_lookup_columns(device_type: str) -> float:
    """
    Args:
        device_type (str): the model's device type.

    Returns:
        float: a shard's fixed cost per id it reads, in columns.
    """
    return DEFAULT_LOOKUP_COLUMNS.get(device_type, 0.0)


def default_bandwidth(device_type: str) -> float:
    """
    Args:
        device_type (str): the model's device type.

    Returns:
        float: the bytes/s a move is assumed to run at before one was measured.
    """
    return DEFAULT_BANDWIDTHS.get(device_type, DEFAULT_BANDWIDTH)


@dataclass(frozen=True)
class RebalancePolicy:
    """
    When the ``Rebalancer`` reshards.

    Args:
        window (int): steps per measurement window (one all-reduce each).
        min_gain (float): the candidate must cut the predicted step time by
            at least this fraction (0.1: 10%).
        hysteresis (int): in this many consecutive windows.
        min_interval (int): steps from one reshard to the next evaluation.
        move_budget_bytes (Optional[int]): the most bytes any rank may send
            plus receive in one reshard (None: no limit).
        horizon (int): steps over which the predicted saving is counted
            against the move's cost.
        default_bandwidth (Optional[float]): bytes per second a move is
            assumed to run at before a reshard was measured (conservative);
            None: the figure of the model's device type
            (``DEFAULT_BANDWIDTHS``, see :meth:`on_device`).
        backoff (int): after a failed reshard, the next one waits
            ``min_interval * backoff ** failures`` steps; after a full replan
            that failed or found nothing worth it, the next one waits as long.
        full_replan (bool): when the incremental search cannot reach
            ``min_gain`` but splitting shards could, run TorchRec's full
            planner in a process of its own on one rank (never inside a step,
            never in a thread of the training process) and consider its plan
            at a later window.
        split_shards (bool): the per-window search may also split a hot
            table's shards by columns (table-wise to column-wise, one more
            column-wise shard per split) onto the least loaded ranks
            (``splits.search_splits``), for a table hotter than moving whole
            shards can fix; only tables whose user constraints allow
            column-wise sharding (or give no sharding types).
        lookup_columns (Optional[float]): a shard's fixed cost per id it
            reads, in columns (a split pays it once more); None: the figure
            of the model's device type (``DEFAULT_LOOKUP_COLUMNS``, see
            :meth:`on_device`).
    """

    window: int = 50
    min_gain: float = 0.1
    hysteresis: int = 2
    min_interval: int = 200
    move_budget_bytes: Optional[int] = None
    horizon: int = 1000
    default_bandwidth: Optional[float] = None
    backoff: int = 2
    full_replan: bool = True
    split_shards: bool = False
    lookup_columns: Optional[float] = None

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.window, int) or self.window < 1:
            problems.append(f"window must be an integer >= 1, got {self.window!r}")
        if not 0.0 <= self.min_gain < 1.0:
            problems.append(f"min_gain must lie in [0, 1), got {self.min_gain!r}")
        if not isinstance(self.hysteresis, int) or self.hysteresis < 1:
            problems.append(
                f"hysteresis must be an integer >= 1 (windows), got {self.hysteresis!r}"
            )
        if not isinstance(self.min_interval, int) or self.min_interval < 0:
            problems.append(
                f"min_interval must be an integer >= 0, got {self.min_interval!r}"
            )
        if self.move_budget_bytes is not None and self.move_budget_bytes <= 0:
            problems.append(
                f"move_budget_bytes must be positive or None, got {self.move_budget_bytes!r}"
            )
        if not isinstance(self.horizon, int) or self.horizon < 1:
            problems.append(f"horizon must be an integer >= 1, got {self.horizon!r}")
        if self.default_bandwidth is not None and not self.default_bandwidth > 0:
            problems.append(
                f"default_bandwidth must be positive, got {self.default_bandwidth!r}"
            )
        if self.lookup_columns is not None and not self.lookup_columns >= 0:
            problems.append(f"lookup_columns must be >= 0, got {self.lookup_columns!r}")
        if not isinstance(self.backoff, int) or self.backoff < 1:
            problems.append(f"backoff must be an integer >= 1, got {self.backoff!r}")
        if problems:
            raise ValueError("bad RebalancePolicy: " + "; ".join(problems))

    def on_device(self, device_type: str) -> "RebalancePolicy":
        """
        Args:
            device_type (str): the model's device type.

        Returns:
            RebalancePolicy: this policy, its default bandwidth and its
            lookup columns those of the device type unless it names them.
        """
        policy = self
        if policy.default_bandwidth is None:
            policy = replace(policy, default_bandwidth=default_bandwidth(device_type))
        if policy.lookup_columns is None:
            policy = replace(policy, lookup_columns=default_lookup_columns(device_type))
        return policy

    def shard_lookup_columns(self) -> float:
        """A shard's fixed cost per id, in columns (0 if unresolved)."""
        return self.lookup_columns or 0.0

    def assumed_bandwidth(self) -> float:
        """Bytes/s before a reshard was measured (the host's if unresolved)."""
        return self.default_bandwidth or DEFAULT_BANDWIDTH


@dataclass(frozen=True)
class PolicyState:
    """
    What the policy remembers between windows.

    Args:
        streak (int): consecutive windows whose candidate cleared the gain bar.
        last_reshard_step (Optional[int]): step of the last reshard.
        failures (int): failed reshards since the last one that went through.
        blocked_until (int): no evaluation before this step.
        bandwidth (Optional[float]): bytes/s measured on earlier reshards.
        replan_pending (bool): a full replan runs in the background.
        replan_failures (int): full replans in a row that failed or found
            nothing worth a move.
        replan_blocked_until (int): no full replan starts before this step.
    """

    streak: int = 0
    last_reshard_step: Optional[int] = None
    failures: int = 0
    blocked_until: int = 0
    bandwidth: Optional[float] = None
    replan_pending: bool = False
    replan_failures: int = 0
    replan_blocked_until: int = 0


def blocked_reason(
    policy: RebalancePolicy, state: PolicyState, step: int
) -> Optional[str]:
    """Why no candidate is evaluated at ``step``, or None."""
    if step < state.blocked_until:
        what = (
            "backing off after a failed reshard"
            if state.failures
            else ("within min_interval of the last reshard")
        )
        return f"{what} (until step {state.blocked_until})"
    return None


def screen(
    policy: RebalancePolicy, state: PolicyState, gain: float
) -> Tuple[Optional[str], PolicyState]:
    """
    Whether a candidate with predicted relative ``gain`` goes on to a dry run.

    Args:
        policy (RebalancePolicy): the knobs.
        state (PolicyState): the state before this window.
        gain (float): 1 - the candidate's slowest rank cost over the current
            plan's.

    Returns:
        Tuple[Optional[str], PolicyState]: the reason to keep the plan (None:
        go on) and the state after this window.
    """
    if gain < policy.min_gain:
        return (
            f"predicted gain {gain:.1%} below min_gain {policy.min_gain:.1%}",
            replace(state, streak=0),
        )
    streak = state.streak + 1
    state = replace(state, streak=streak)
    if streak < policy.hysteresis:
        return (
            f"predicted gain {gain:.1%} in {streak} of {policy.hysteresis} windows "
            "(hysteresis)",
            state,
        )
    return None, state


def move_seconds(
    policy: RebalancePolicy, state: PolicyState, max_rank_bytes: int
) -> float:
    """Predicted seconds of a move whose busiest rank sends + receives that much."""
    bandwidth = state.bandwidth or policy.assumed_bandwidth()
    return max_rank_bytes / bandwidth


def byte_price(policy: RebalancePolicy, state: PolicyState) -> float:
    """Seconds per step one byte moved costs: its move time over the horizon."""
    bandwidth = state.bandwidth or policy.assumed_bandwidth()
    return 1.0 / (bandwidth * policy.horizon)


def judge_move(
    policy: RebalancePolicy,
    state: PolicyState,
    saving_per_step: float,
    max_rank_bytes: int,
) -> Tuple[Optional[str], float]:
    """
    Whether the move pays: the saving over the horizon must exceed its cost,
    and its bytes fit the budget.

    Args:
        policy (RebalancePolicy): the knobs.
        state (PolicyState): the state (its measured bandwidth).
        saving_per_step (float): predicted seconds saved per step.
        max_rank_bytes (int): the busiest rank's bytes sent + received.

    Returns:
        Tuple[Optional[str], float]: the reason to keep the plan (None: move)
        and the predicted seconds of the move.
    """
    cost = move_seconds(policy, state, max_rank_bytes)
    if (
        policy.move_budget_bytes is not None
        and max_rank_bytes > policy.move_budget_bytes
    ):
        return (
            f"move of {max_rank_bytes} B on the busiest rank over the budget of "
            f"{policy.move_budget_bytes} B",
            cost,
        )
    saving = saving_per_step * policy.horizon
    if saving <= cost:
        return (
            f"saving {saving:.3f} s over {policy.horizon} steps does not exceed "
            f"the move's {cost:.3f} s",
            cost,
        )
    return None, cost


def after_reshard(
    policy: RebalancePolicy, state: PolicyState, step: int
) -> PolicyState:
    """The state after a reshard that went through at ``step``."""
    return replace(
        state,
        streak=0,
        last_reshard_step=step,
        failures=0,
        blocked_until=step + policy.min_interval,
    )


def after_failure(
    policy: RebalancePolicy, state: PolicyState, step: int
) -> PolicyState:
    """The state after a failed or aborted reshard at ``step``: back off."""
    failures = state.failures + 1
    wait = max(policy.min_interval, policy.window) * policy.backoff**failures
    return replace(state, streak=0, failures=failures, blocked_until=step + wait)


def with_bandwidth(
    state: PolicyState, max_rank_bytes: float, seconds: float
) -> PolicyState:
    """The state with the bandwidth of a measured reshard (if it moved bytes)."""
    if max_rank_bytes <= 0 or seconds <= 0:
        return state
    return replace(state, bandwidth=max_rank_bytes / seconds)


def may_replan(
    policy: RebalancePolicy, state: PolicyState, step: int, gain_bound: float
) -> bool:
    """
    Whether a full replan starts now: allowed, none pending, not backing off,
    and splitting shards could reach ``min_gain`` (``gain_bound``, the gain
    if every rank carried the mean load) where moving them cannot.
    """
    return (
        policy.full_replan
        and not state.replan_pending
        and step >= state.replan_blocked_until
        and gain_bound >= policy.min_gain
    )


def after_replan_started(state: PolicyState) -> PolicyState:
    """The state once a full replan runs in the background."""
    return replace(state, replan_pending=True)


def after_replan(
    policy: RebalancePolicy, state: PolicyState, step: int, useful: bool
) -> PolicyState:
    """
    The state once a full replan's result was taken at ``step``: ``useful``
    if it led to a reshard; otherwise (failed, stale, no gain) back off.
    """
    if useful:
        return replace(state, replan_pending=False, replan_failures=0)
    failures = state.replan_failures + 1
    wait = max(policy.min_interval, policy.window) * policy.backoff**failures
    return replace(
        state,
        replan_pending=False,
        replan_failures=failures,
        replan_blocked_until=step + wait,
    )

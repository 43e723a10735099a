#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: a candidate plan from any source (the per-window search's moves, its
split step, the full replan), with its prediction, and the policy's screen
that every candidate passes the same way before the dry run.

The sources differ only in what they are, as data: the one-shot candidate
of a full replan is not held to the hysteresis (which counts consecutive
windows of the per-window search) and neither counts nor breaks its streak.
"""

from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence, Tuple

from torchrec.distributed.resharding.elastic_plan import TableLayout
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.rebalance.costs import Proposal, StepPrediction
from torchrec.distributed.resharding.rebalance.placement import (
    Placement,
    plan_with_layouts,
)
from torchrec.distributed.resharding.rebalance.policy import (
    PolicyState,
    RebalancePolicy,
)
from torchrec.distributed.types import ShardingPlan

SEARCH = "search"
SPLITS = "splits"
FULL_REPLAN = "full replan"


@dataclass(frozen=True)
class Candidate:
    """
    A plan proposed for the model and what it predicts.

    Args:
        source (str): ``SEARCH`` (moves and swaps of whole shards),
            ``SPLITS`` (the search's moves and its column or row splits) or
            ``FULL_REPLAN``.
        plan (Optional[ShardingPlan]): the whole plan; None when it changes
            nothing.
        prediction (StepPrediction): the step time before and after.
        tables (Tuple[str, ...]): keys of the tables it changes, sorted.
        over_memory (Tuple[int, ...]): ranks whose memory it exceeds.
        gain_bound (Optional[float]): the gain if every rank carried the
            mean load (what splitting could reach; per-window sources).
        seconds (float): this rank's seconds to reach it.
    """

    source: str
    plan: Optional[ShardingPlan]
    prediction: StepPrediction
    tables: Tuple[str, ...] = ()
    over_memory: Tuple[int, ...] = ()
    gain_bound: Optional[float] = None
    seconds: float = field(default=0.0, compare=False)

    @property
    def per_window(self) -> bool:
        """Proposed again every window (held to the hysteresis)."""
        return self.source != FULL_REPLAN

    @property
    def decision_source(self) -> str:
        """The source a decision names: the search for both of its steps."""
        return SEARCH if self.source == SPLITS else self.source


@dataclass(frozen=True)
class Screening:
    """
    The policy's verdict on a candidate before its dry run.

    Args:
        reason (Optional[str]): why the plan is kept; None: go on to the dry
            run.
        state (PolicyState): the policy's state after.
        below_bar (bool): refused for its gain (or for changing nothing),
            where splitting might still pay.
    """

    reason: Optional[str]
    state: PolicyState
    below_bar: bool = False


def screen_candidate(
    policy: RebalancePolicy, state: PolicyState, candidate: Candidate
) -> Screening:
    """
    Whether a candidate goes on to its dry run: it fits every rank's memory,
    changes something, gains at least ``min_gain``, and (per-window
    candidates) did so in ``hysteresis`` windows in a row.

    Args:
        policy (RebalancePolicy): the knobs.
        state (PolicyState): the state before this window.
        candidate (Candidate): from any source.

    Returns:
        Screening: the reason to keep the plan (or None) and the state after.
    """
    if candidate.over_memory:
        ranks = list(candidate.over_memory[:8])
        return Screening(f"its plan no longer fits the memory of ranks {ranks}", state)
    gain = candidate.prediction.gain
    reason = None
    if candidate.plan is None or not candidate.tables:
        reason = f"no candidate of the {candidate.source} cuts the slowest rank"
    elif gain < policy.min_gain:
        reason = f"predicted gain {gain:.1%} below min_gain {policy.min_gain:.1%}"
    if reason is not None:
        after = replace(state, streak=0) if candidate.per_window else state
        return Screening(reason, after, below_bar=True)
    if not candidate.per_window:
        return Screening(None, state)
    streak = state.streak + 1
    state = replace(state, streak=streak)
    if streak < policy.hysteresis:
        return Screening(
            f"predicted gain {gain:.1%} in {streak} of {policy.hysteresis} windows "
            "(hysteresis)",
            state,
        )
    return Screening(None, state)


def search_candidate(
    proposal: Proposal,
    plan: ShardingPlan,
    placement: Placement,
    device_of: Callable[[int], str],
    seconds: float = 0.0,
) -> Candidate:
    """
    The per-window search's proposal as a candidate: ``SPLITS`` when its
    split step cut a shard, else ``SEARCH``.

    Args:
        proposal (Proposal): ``costs.propose``'s result.
        plan (ShardingPlan): the current plan.
        placement (Placement): its placement.
        device_of (Callable[[int], str]): the device of a rank's shards.
        seconds (float): this rank's seconds to reach it.

    Returns:
        Candidate: the candidate.
    """
    search = proposal.search
    prediction = proposal.prediction
    bound = None
    if search is not None:
        bound = StepPrediction(
            prediction.measured_step,
            prediction.measured_kernels,
            (search.mean_load,),
        ).gain
    split = proposal.split
    layouts: Mapping[str, TableLayout] = proposal.layouts
    candidate_plan = (
        plan_with_layouts(plan, placement, layouts, device_of, proposal.sharding_types)
        if layouts
        else None
    )
    return Candidate(
        source=SPLITS if split else SEARCH,
        plan=candidate_plan,
        prediction=prediction,
        tables=tuple(sorted(layouts)),
        gain_bound=bound,
        seconds=seconds,
    )


def over_memory(
    before: Sequence[int], after: Sequence[int], capacity: Sequence[float]
) -> Tuple[int, ...]:
    """Ranks that hold more after than before, and more than they can."""
    return tuple(
        r for r in range(len(after)) if after[r] > before[r] and after[r] > capacity[r]
    )


def changed_tables(delta: Mapping[str, Mapping[str, object]]) -> Tuple[str, ...]:
    """Keys of the tables of a plan delta (module path -> table), sorted."""
    return tuple(sorted(TableKey(p, t) for p in delta for t in delta[p]))

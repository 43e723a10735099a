#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
What the Rebalancer decides each window (``RebalanceDecision``, identical
on every rank) and how a reshard's prediction met the step time measured
after it (``ReshardOutcome``).
"""

import statistics
from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

from torchrec.distributed.types import ShardingPlan


@dataclass(frozen=True)
class RebalanceDecision:
    """
    One window's decision, identical on every rank (but ``search_seconds``).

    Args:
        step (int): the step count at the end of the window.
        action (str): ``"reshard"``, ``"keep"`` or ``"failed"``.
        reason (str): why.
        source (str): where the candidate came from: ``"search"`` (the
            incremental search), ``"full replan"`` or ``""`` (none).
        imbalance (float): measured: the slowest rank's embedding seconds
            over the mean.
        kernel_seconds (Tuple[float, ...]): measured kernel seconds per rank
            and step.
        step_seconds (float): measured step time of the window.
        predicted_kernel_seconds (Tuple[float, ...]): per rank, predicted
            under the candidate (with the exchange seconds its row splits
            add).
        predicted_step_seconds (Optional[float]): predicted step time under
            the candidate.
        predicted_gain (float): predicted relative cut of the step time.
        saving_per_step (float): predicted seconds saved per step.
        tables (Tuple[str, ...]): tables the candidate changes.
        max_rank_bytes (Optional[int]): the dry run's busiest rank's bytes
            (sent + received).
        bytes_moved (Optional[int]): the dry run's bytes sent, all ranks.
        move_seconds (Optional[float]): the move's predicted seconds.
        search_seconds (float): this rank's seconds to reach the candidate.
        plan (Optional[ShardingPlan]): the plan resharded to.
        reshard_seconds (Optional[float]): the reshard's seconds (this rank).
        exchange_seconds (Tuple[float, ...]): per rank, the seconds per step
            of communication the candidate's row splits add (priced at the
            measured seconds per byte; empty: none priced).
    """

    step: int
    action: str
    reason: str
    source: str = ""
    imbalance: float = 1.0
    kernel_seconds: Tuple[float, ...] = ()
    step_seconds: float = 0.0
    predicted_kernel_seconds: Tuple[float, ...] = ()
    predicted_step_seconds: Optional[float] = None
    predicted_gain: float = 0.0
    saving_per_step: float = 0.0
    tables: Tuple[str, ...] = ()
    max_rank_bytes: Optional[int] = None
    bytes_moved: Optional[int] = None
    move_seconds: Optional[float] = None
    search_seconds: float = field(default=0.0, compare=False)
    plan: Optional[ShardingPlan] = field(default=None, compare=False, repr=False)
    reshard_seconds: Optional[float] = field(default=None, compare=False)
    exchange_seconds: Tuple[float, ...] = ()

    def line(self) -> str:
        """The decision as one log line."""
        parts = [f"step {self.step}: {self.action.upper()} ({self.reason})"]
        if self.kernel_seconds:
            parts += [
                f"measured imbalance {self.imbalance:.2f}",
                "kernel ms/step per rank "
                + "/".join(f"{1e3 * s:.1f}" for s in self.kernel_seconds),
                f"step {self.step_seconds * 1e3:.1f} ms",
            ]
        if self.predicted_step_seconds is not None:
            parts.append(
                f"{self.source}: predicted step {self.predicted_step_seconds * 1e3:.1f}"
                f" ms (gain {self.predicted_gain:.1%}), slowest rank "
                f"{1e3 * max(self.predicted_kernel_seconds, default=0.0):.1f} ms, "
                f"decided in {self.search_seconds * 1e3:.1f} ms"
            )
        if any(self.exchange_seconds):
            parts.append(
                "row split exchange ms/step per rank "
                + "/".join(f"{1e3 * s:+.2f}" for s in self.exchange_seconds)
            )
        if self.max_rank_bytes is not None:
            parts.append(
                f"moves {self.bytes_moved} B (busiest rank {self.max_rank_bytes} B)"
            )
        if self.move_seconds is not None:
            parts.append(f"move ~{self.move_seconds:.3f} s")
        if self.tables:
            shown = ", ".join(self.tables[:8])
            more = len(self.tables) - 8
            parts.append(f"tables {shown}" + (f" (+{more})" if more > 0 else ""))
        return "; ".join(parts)


@dataclass(frozen=True)
class ReshardOutcome:
    """
    A reshard's prediction against the step time measured after it: in the
    first window, and as the median of the windows until the policy may
    reshard again (``settled_step_seconds``), which a transient of a window
    or two after the reshard (new shards' first steps, a burst on the
    machine) does not move.

    Args:
        step (int): the reshard's step.
        step_seconds_before (float): measured in the window before it.
        predicted_step_seconds (float): predicted for after it.
        measured_step_seconds (float): measured in the first window after it.
        settling_step_seconds (Tuple[float, ...]): measured in each window
            after it, until ``min_interval`` steps past it (the first
            included); what ``with_window`` added.
    """

    step: int
    step_seconds_before: float
    predicted_step_seconds: float
    measured_step_seconds: float
    settling_step_seconds: Tuple[float, ...] = ()

    @property
    def error(self) -> float:
        """Predicted over measured in the first window, minus one."""
        return _error(self.predicted_step_seconds, self.measured_step_seconds)

    @property
    def settled_step_seconds(self) -> float:
        """The median of the windows after it (the first one's, before more)."""
        if not self.settling_step_seconds:
            return self.measured_step_seconds
        return statistics.median(self.settling_step_seconds)

    @property
    def settled_error(self) -> float:
        """Predicted over ``settled_step_seconds``, minus one."""
        return _error(self.predicted_step_seconds, self.settled_step_seconds)

    def with_window(self, step_seconds: float) -> "ReshardOutcome":
        """
        The outcome with one more window's step time measured after it.

        Args:
            step_seconds (float): the window's step time.

        Returns:
            ReshardOutcome: the same, with it in ``settling_step_seconds``.
        """
        return replace(
            self, settling_step_seconds=self.settling_step_seconds + (step_seconds,)
        )


def _error(predicted: float, measured: float) -> float:
    if measured <= 0:
        return 0.0
    return predicted / measured - 1.0

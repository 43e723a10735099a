#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
What a recovery reports (:class:`RecoveryReport`: seconds per phase, bytes
and steps lost per source), and what the training loop's ``on_failure``
hook sees before a recovery moves anything (:class:`Failure`).
"""

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from torch import nn
from torchrec.distributed.resharding.fault.membership import FaultReport, Membership
from torchrec.distributed.resharding.fault.recovery_plan import RecoveryPlan
from torchrec.distributed.resharding.fault.sources import AgreedSources
from torchrec.distributed.resharding.transaction_report import TransactionReport
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import KeyedOptimizer


@dataclass
class RecoveryReport:
    """
    One recovery, as one survivor saw it.

    Args:
        generation (int): the members' generation after it.
        members (Tuple[int, ...]): the survivors' global ranks.
        lost_ranks (Tuple[int, ...]): the ranks lost since the model's group
            (more than one when a rank was lost during the recovery).
        lost_tables (Tuple[str, ...]): tables that lost a shard.
        fault (Optional[FaultReport]): the first sign of the failure (who saw
            it, what, when by its clock).
        reason (str): what this rank saw.
        detected_at (float): when this rank noticed (``time.time()``).
        detect_seconds (float): from the first report's posting to this rank
            noticing (wall clocks of two ranks: 0 for the reporter).
        agree_seconds (float): agreeing on the members (every attempt).
        group_seconds (float): building the survivors' group and env.
        sources_seconds (float): planning and agreeing on the sources.
        restore_seconds (Dict[str, float]): per source used, the seconds its
            bytes took to reach their shards on this rank (a checkpoint's
            read, then the move's exchange).
        move_seconds (float): the recovery move (the engine's transaction).
        first_step_seconds (Optional[float]): from noticing to the end of the
            first step after the recovery.
        bytes_by_source (Dict[str, int]): bytes of the lost shards restored
            from each source, every survivor's (a replica's: the lost
            replicas, which no byte needs to restore).
        steps_lost (Dict[str, int]): per source used, the steps of updates
            its shards lost.
        failure_step (int): the steps completed before the failure.
        attempts (int): recovery attempts (more than one when a rank was
            lost during the recovery).
        plan (Optional[ShardingPlan]): the plan on the survivors.
        move (Optional[TransactionReport]): the move's own report.
    """

    generation: int = 0
    members: Tuple[int, ...] = ()
    lost_ranks: Tuple[int, ...] = ()
    lost_tables: Tuple[str, ...] = ()
    fault: Optional[FaultReport] = None
    reason: str = ""
    detected_at: float = 0.0
    detect_seconds: float = 0.0
    agree_seconds: float = 0.0
    group_seconds: float = 0.0
    sources_seconds: float = 0.0
    restore_seconds: Dict[str, float] = field(default_factory=dict)
    move_seconds: float = 0.0
    first_step_seconds: Optional[float] = None
    bytes_by_source: Dict[str, int] = field(default_factory=dict)
    steps_lost: Dict[str, int] = field(default_factory=dict)
    failure_step: int = 0
    attempts: int = 0
    plan: Optional[ShardingPlan] = None
    move: Optional[TransactionReport] = None

    def timeline(self) -> str:
        """The recovery as one line per phase."""
        rows = [
            f"lost ranks {list(self.lost_ranks)} (tables {list(self.lost_tables)}), "
            f"members {list(self.members)}, {self.attempts} attempt(s)",
            f"  detect   {self.detect_seconds:8.3f} s  ({_short(self.reason)})",
            f"  agree    {self.agree_seconds:8.3f} s",
            f"  group    {self.group_seconds:8.3f} s",
            f"  sources  {self.sources_seconds:8.3f} s",
            f"  move     {self.move_seconds:8.3f} s",
        ]
        for source, seconds in sorted(self.restore_seconds.items()):
            rows.append(
                f"  restore  {seconds:8.3f} s  from {source}: "
                f"{self.bytes_by_source.get(source, 0)} B, "
                f"{self.steps_lost.get(source, 0)} steps lost"
            )
        if self.first_step_seconds is not None:
            rows.append(f"  first step {self.first_step_seconds:6.3f} s after noticing")
        return "\n".join(rows)


def _short(text: str, limit: int = 100) -> str:
    """The first line of ``text``, cut at ``limit`` characters."""
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


@dataclass(frozen=True)
class Failure:
    """
    What ``on_failure`` gets, on every survivor, once the members and the
    sources are agreed and before anything moves (to log it, or save what
    the survivors hold).

    Args:
        membership (Membership): the survivors.
        recovery (RecoveryPlan): the plan on them.
        sources (AgreedSources): where the lost shards come from.
        model (nn.Module): the model, as it was at the failure.
        optimizer (Optional[KeyedOptimizer]): its dense optimizer.
        step (int): the steps this rank completed.
    """

    membership: Membership
    recovery: RecoveryPlan
    sources: AgreedSources
    model: nn.Module
    optimizer: Optional[KeyedOptimizer]
    step: int

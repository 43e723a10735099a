#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
How a job survives a lost rank: the bounds of detection and agreement, the
sources of a lost rank's shards, and the errors every survivor raises alike.
"""

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence, Tuple

from torchrec.distributed.resharding.plan import ReshardError

REPLICA = "replica"
SNAPSHOT = "snapshot"
CHECKPOINT = "checkpoint"
# the sources of a lost rank's shards, best first: what each loses is the
# updates since it (a replica: none)
SOURCES: Tuple[str, ...] = (REPLICA, SNAPSHOT, CHECKPOINT)


class FaultToleranceError(RuntimeError):
    """
    Raised on every survivor, with the same message, when the job cannot go
    on: no rank was lost but a step failed, the job's store is gone, or a
    loss no source covers (:class:`UnrecoverableLossError`). The model is
    left as it was at the failure, and its state can be saved.
    """


class UnrecoverableLossError(FaultToleranceError):
    """
    Raised on every survivor when a lost rank held table shards that no
    configured source (replica, snapshot, checkpoint) holds: the tables are
    named, and nothing is re-initialised.

    Args:
        message (str): what was lost.
        tables (Sequence[str]): the lost tables, "module path:table".
    """

    def __init__(self, message: str, tables: Sequence[str]) -> None:
        super().__init__(message)
        self.tables: Tuple[str, ...] = tuple(tables)


class RankFencedError(FaultToleranceError):
    """
    Raised on a rank the survivors removed from the job (it hung, or came
    too late to the agreement): it must stop, the others went on without it.
    """


@dataclass(frozen=True)
class FaultOptions:
    """
    How a job detects a lost rank and recovers from it.

    Detection: every rank adds to its heartbeat key in the job's store every
    ``heartbeat_interval`` and watches the next member's; a heartbeat that
    stands still for ``heartbeat_timeout`` (a process killed, a host lost, a
    process stopped) and any error of a training step (a collective with the
    dead rank) post the fault, which every rank's watcher sees within one
    interval. A survivor blocked in a collective with the dead rank is freed
    by that collective's error or timeout: ``collective_timeout`` is set on
    the training group (``ProcessGroup.set_timeout``) and on every group the
    recovery builds, so it bounds how long any survivor waits there (on
    NCCL, the watcher also aborts the training group at once).

    Agreement: the survivors check in; as soon as every member not checked
    in has a stale heartbeat (or after ``join_timeout``) the first to check
    in decides the new members, the same for everyone; a rank left out (it
    hung) is fenced.

    Args:
        heartbeat_interval (timedelta): how often a rank beats and watches.
        heartbeat_timeout (timedelta): a heartbeat that does not move for
            this long marks its rank as lost.
        collective_timeout (Optional[timedelta]): the bound of every
            collective of the training group and of the recovered groups
            (None: leave the group's own).
        join_timeout (Optional[timedelta]): how long the agreement waits for
            a member whose heartbeat still moves (default: the collective
            timeout plus the heartbeat timeout: a survivor blocked in a
            collective with the lost rank checks in before it).
        recovery_timeout (timedelta): the bound of each wait of the recovery
            (its agreement, build and exchange): a rank lost during the
            recovery is noticed within it.
        sources (Sequence[str]): the sources of lost shards to use, from
            "replica", "snapshot" and "checkpoint" (best first whatever the
            order).
        snapshot_every (int): steps between buddy snapshots (0: none).
        snapshot_budget_bytes (Optional[int]): the most bytes a rank holds
            for the snapshot of its buddy's shards; shards beyond it are not
            snapshotted (they need another source).
        max_recoveries (int): a job that loses more ranks in a row (a
            recovery interrupted by another loss counts) stops.
        name (str): the namespace of the job's store keys (with the model's
            group's name).
    """

    heartbeat_interval: timedelta = timedelta(milliseconds=200)
    heartbeat_timeout: timedelta = timedelta(seconds=2)
    collective_timeout: Optional[timedelta] = timedelta(seconds=10)
    join_timeout: Optional[timedelta] = None
    recovery_timeout: timedelta = timedelta(seconds=60)
    sources: Tuple[str, ...] = SOURCES
    snapshot_every: int = 0
    snapshot_budget_bytes: Optional[int] = None
    max_recoveries: int = 4
    name: str = "job"

    def __post_init__(self) -> None:
        unknown = [s for s in self.sources if s not in SOURCES]
        if unknown:
            raise ReshardError(
                f"unknown sources {unknown}: choose from {', '.join(SOURCES)}"
            )
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ReshardError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must exceed "
                f"heartbeat_interval ({self.heartbeat_interval})"
            )
        if self.snapshot_every < 0:
            raise ReshardError(
                f"snapshot_every must be >= 0, got {self.snapshot_every}"
            )
        if self.snapshot_every and SNAPSHOT not in self.sources:
            raise ReshardError("snapshot_every is set but 'snapshot' is no source")

    @property
    def join_bound(self) -> timedelta:
        """How long the agreement waits for a member whose heartbeat moves."""
        if self.join_timeout is not None:
            return self.join_timeout
        return (self.collective_timeout or timedelta(seconds=30)) + (
            self.heartbeat_timeout
        )

    def uses(self, source: str) -> bool:
        """Whether ``source`` is one of the configured sources."""
        return source in self.sources

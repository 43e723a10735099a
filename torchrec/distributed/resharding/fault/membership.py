#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Who is still in the job: heartbeats, the fault signal and the survivors'
agreement on the new members, all through the job's key-value store (no
process group: the training group may hold a dead rank).

The store must outlive any worker: a launcher's agent store (torchrun's
c10d rendezvous store, which the workers reuse) or a ``TCPStore`` server of
its own; a store hosted by a worker dies with it, and then every survivor
raises :class:`FaultToleranceError` (see ``docs/faults.md``).

Keys, under ``torchrec_fault/<name>/``::

    hb/<rank>             the rank's heartbeat: a counter it adds to
    left/<rank>           set when the rank leaves of its own accord
    <g>/fault             the first fault report of generation g
    <g>/present           the ranks that checked in ("3,0,7,")
    <g>/arrived           how many checked in (the first coordinates)
    <g>/decision          the members of generation g + 1 (compare-and-set)

Generation 0's members are the training group's ranks; each decision starts
the next generation. Every rank's traffic is O(1) store round trips per
slice of waiting; the coordinator alone reads the list of those present and
the heartbeats of those missing.
"""

import logging
import pickle
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist
from torchrec.distributed.resharding.fault.options import (
    FaultOptions,
    FaultToleranceError,
    RankFencedError,
)

logger: logging.Logger = logging.getLogger(__name__)

PREFIX = "torchrec_fault"
# how often a waiting rank looks at the store
SLICE_S = 0.02


@dataclass(frozen=True)
class FaultReport:
    """
    The first sign of a failure in one generation, the same for everyone.

    Args:
        rank (int): the rank that noticed it first.
        reason (str): what it saw.
        stale (Tuple[int, ...]): ranks whose heartbeat it saw stand still.
        posted_at (float): its wall clock when it posted (``time.time()``).
    """

    rank: int
    reason: str
    stale: Tuple[int, ...] = ()
    posted_at: float = 0.0


@dataclass(frozen=True)
class Membership:
    """
    The members of one generation of the job.

    Args:
        generation (int): its number (0: the training group's ranks).
        members (Tuple[int, ...]): their global ranks, ascending.
        lost (Tuple[int, ...]): the previous generation's members left out.
        fault (Optional[FaultReport]): what ended the previous generation.
    """

    generation: int
    members: Tuple[int, ...]
    lost: Tuple[int, ...] = ()
    fault: Optional[FaultReport] = None


class StoreKeys:
    """The store keys of one job's membership (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.prefix = f"{PREFIX}/{name}"

    def heartbeat(self, rank: int) -> str:
        return f"{self.prefix}/hb/{rank}"

    def left(self, rank: int) -> str:
        return f"{self.prefix}/left/{rank}"

    def of(self, generation: int, what: str) -> str:
        return f"{self.prefix}/{generation}/{what}"


def store_lost(e: BaseException) -> FaultToleranceError:
    """The error every rank raises when the job's store cannot be reached."""
    return FaultToleranceError(
        f"the job's store cannot be reached ({type(e).__name__}: {e}); the job "
        "stops. Host the store outside the workers (a launcher's agent store, "
        "or a TCPStore server of its own) so that it survives a lost rank"
    )


def post_fault(
    store: dist.Store,
    keys: StoreKeys,
    generation: int,
    rank: int,
    reason: str,
    stale: Sequence[int] = (),
) -> FaultReport:
    """
    Posts the fault of ``generation`` unless one is posted; either way
    returns the one that stands (the first), the same for everyone.

    Args:
        store (dist.Store): the job's store.
        keys (StoreKeys): the job's keys.
        generation (int): the generation that fails.
        rank (int): this rank.
        reason (str): what this rank saw.
        stale (Sequence[int]): ranks whose heartbeat this rank saw stop.

    Returns:
        FaultReport: the first report of the generation.
    """
    report = FaultReport(rank, reason, tuple(sorted(stale)), time.time())
    blob = pickle.dumps(report)
    stood = store.compare_set(keys.of(generation, "fault"), "", blob)
    return pickle.loads(stood)


def read_fault(
    store: dist.Store, keys: StoreKeys, generation: int
) -> Optional[FaultReport]:
    """The fault report of ``generation``, if one is posted."""
    key = keys.of(generation, "fault")
    if not store.check([key]):
        return None
    return pickle.loads(store.get(key))


class Staleness:
    """
    Whether heartbeats stand still, by this rank's clock: a counter that has
    not changed for ``timeout_s`` since this rank first saw its value.

    Args:
        timeout_s (float): the heartbeat timeout.
    """

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._seen: Dict[int, Tuple[int, float]] = {}

    def stale(self, rank: int, value: int, now: float) -> bool:
        """
        Args:
            rank (int): whose heartbeat.
            value (int): its counter now.
            now (float): ``time.monotonic()``.

        Returns:
            bool: whether it stood still for the timeout.
        """
        last = self._seen.get(rank)
        if last is None or last[0] != value:
            self._seen[rank] = (value, now)
            return False
        return now - last[1] >= self._timeout_s


def _present(store: dist.Store, keys: StoreKeys, generation: int) -> List[int]:
    text = store.get(keys.of(generation, "present")).decode()
    return sorted({int(r) for r in text.split(",") if r})


def _propose(
    store: dist.Store,
    keys: StoreKeys,
    current: Membership,
    present: Sequence[int],
    fault: Optional[FaultReport],
) -> Membership:
    """Proposes ``present`` as the next members; the first proposal stands."""
    members = tuple(r for r in current.members if r in set(present))
    lost = tuple(r for r in current.members if r not in set(present))
    proposal = Membership(current.generation + 1, members, lost, fault)
    blob = pickle.dumps(proposal)
    stood = store.compare_set(keys.of(current.generation, "decision"), "", blob)
    return pickle.loads(stood)


def _decision(
    store: dist.Store, keys: StoreKeys, generation: int
) -> Optional[Membership]:
    """The decision of ``generation``, if one is posted."""
    key = keys.of(generation, "decision")
    return pickle.loads(store.get(key)) if store.check([key]) else None


def _delete_generation(store: dist.Store, keys: StoreKeys, generation: int) -> None:
    if generation < 0:
        return
    for what in ("fault", "present", "arrived", "decision"):
        store.delete_key(keys.of(generation, what))


@dataclass(frozen=True)
class _CheckIn:
    """
    A rank's check-in to the end of a generation: what the coordinator and
    the ranks awaiting its decision read.

    Args:
        store (dist.Store): the job's store.
        keys (StoreKeys): the job's keys.
        current (Membership): the generation that fails.
        fault (Optional[FaultReport]): the generation's fault report.
        deadline (float): when those missing count as lost
            (``time.monotonic()``).
        options (FaultOptions): the bounds.
    """

    store: dist.Store
    keys: StoreKeys
    current: Membership
    fault: Optional[FaultReport]
    deadline: float
    options: FaultOptions

    def decision(self) -> Optional[Membership]:
        """The generation's decision, if one is posted."""
        return _decision(self.store, self.keys, self.current.generation)

    def present(self) -> List[int]:
        """The ranks that checked in so far."""
        return _present(self.store, self.keys, self.current.generation)

    def propose(self, present: Sequence[int]) -> Membership:
        """Proposes ``present`` as the next members; the first proposal stands."""
        return _propose(self.store, self.keys, self.current, present, self.fault)


def _coordinate(check_in: _CheckIn) -> Membership:
    """
    The first rank to check in: decides once every member that has not
    checked in is known lost (its heartbeat stood still, or the fault's
    reporter saw it stop), or at the deadline.
    """
    store, keys, current = check_in.store, check_in.keys, check_in.current
    staleness = Staleness(check_in.options.heartbeat_timeout.total_seconds())
    fault = check_in.fault
    reported = set(fault.stale) if fault is not None else set()
    size = len(current.members)
    while True:
        decided = check_in.decision()
        if decided is not None:
            return decided
        now = time.monotonic()
        present: List[int] = []
        if int(store.add(keys.of(current.generation, "arrived"), 0)) >= size:
            present = list(current.members)
        else:
            present = check_in.present()
            missing = [r for r in current.members if r not in set(present)]
            lost = [
                r
                for r in missing
                if r in reported
                or staleness.stale(r, int(store.add(keys.heartbeat(r), 0)), now)
            ]
            if len(lost) < len(missing) and now < check_in.deadline:
                time.sleep(SLICE_S)
                continue
        _delete_generation(store, keys, current.generation - 2)
        return check_in.propose(present)


def agree_on_members(
    store: dist.Store,
    keys: StoreKeys,
    rank: int,
    current: Membership,
    options: FaultOptions,
    reason: str,
) -> Membership:
    """
    Ends the current generation: posts its fault (unless one stands), checks
    in, and returns the next generation's members, the same on every rank
    that checks in. Every member that is alive calls it once it noticed the
    fault (by its own error or by the fault's key).

    Args:
        store (dist.Store): the job's store.
        keys (StoreKeys): the job's keys.
        rank (int): this rank's global rank.
        current (Membership): the generation that fails.
        options (FaultOptions): the bounds.
        reason (str): what this rank saw.

    Returns:
        Membership: the next generation (it may have lost no rank).

    Raises:
        RankFencedError: on a rank the others decided without (it came after
            the decision).
        FaultToleranceError: when the job's store cannot be reached.
    """
    generation = current.generation
    try:
        fault = post_fault(store, keys, generation, rank, reason)
        store.append(keys.of(generation, "present"), f"{rank},")
        order = int(store.add(keys.of(generation, "arrived"), 1))
        join_s = options.join_bound.total_seconds()
        deadline = time.monotonic() + join_s
        check_in = _CheckIn(store, keys, current, fault, deadline, options)
        decided = _coordinate(check_in) if order == 1 else _await_decision(check_in)
    except (RuntimeError, OSError) as e:  # DistStoreError, DistNetworkError
        raise store_lost(e) from e
    if rank not in decided.members:
        raise RankFencedError(
            f"rank {rank} was left out of the job at generation "
            f"{decided.generation} (members {list(decided.members)}): it came "
            "to the agreement after the others decided; it must stop"
        )
    logger.info(
        "rank %d: generation %d members %s, lost %s (%s)",
        rank,
        decided.generation,
        list(decided.members),
        list(decided.lost),
        decided.fault.reason if decided.fault is not None else "-",
    )
    return decided


def _await_decision(check_in: _CheckIn) -> Membership:
    """
    A rank that is not the coordinator waits for its decision; past the
    deadline and a grace (the coordinator may be gone) it proposes those
    present itself.
    """
    grace = max(1.0, 5 * check_in.options.heartbeat_interval.total_seconds())
    while time.monotonic() < check_in.deadline + grace:
        decided = check_in.decision()
        if decided is not None:
            return decided
        time.sleep(SLICE_S)
    return check_in.propose(check_in.present())

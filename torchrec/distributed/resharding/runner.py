#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The one transaction runner of live resharding.

Every way of moving tables — a reshard within a process group
(``transaction``), a move onto another set of ranks (``elastic``), an unshard
onto one rank and a shard from one rank (``unshard``) — is a
:class:`Participant`: this rank's part of one transaction. The runner takes
every participant through the same phases, each under
``torch.profiler.record_function`` and timed into the report:

1. **agree**: the participant validates the request and states its local facts
   (:meth:`Participant.prepare`); the ranks agree on the job's store (one
   coordinator merges the facts, :meth:`Participant.merge`, and decides); a bad
   request raises the same :class:`ReshardError` on every rank, a rank that
   does not come :class:`ReshardAbortedError`, before anything is built;
2. **build**: the participant builds what the new layout needs, detached from
   what runs now (:meth:`Participant.build`); the ranks agree again that every
   rank built;
3. **exchange**: on a process group made for the transaction, the one
   executor (``exchange.execute_transfers``) fills the new shards from the old
   ones; then whatever else travels (:meth:`Participant.after_exchange`); a
   barrier: nobody commits before everybody filled;
4. **commit**: the participant swaps the new state in
   (:meth:`Participant.commit`), which does nothing that can fail.

A failure anywhere before the commit calls :meth:`Participant.abort` (the one
abort path) and leaves what runs exactly as it was. A dry run stops after the
first agreement.
"""

import abc
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.resharding.agreement import agree_among_ranks, default_timeout
from torchrec.distributed.resharding.exchange import (
    ExchangeStats,
    execute_transfers,
    PieceIO,
)
from torchrec.distributed.resharding.fields import Field
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import (
    RankPlan,
    ReshardAbortedError,
    ReshardError,
)
from torchrec.distributed.resharding.wire import ExchangeGroup, open_exchange_group

logger: logging.Logger = logging.getLogger(__name__)

PHASES = ("agree", "build", "exchange", "commit")


@dataclass(frozen=True)
class PhaseTimes:
    """
    Wall time of each phase of a transaction on one rank, in seconds.

    Args:
        agree (float): validation and the first agreement.
        build (float): building the new state and the second agreement.
        exchange (float): the exchange group, the fill, what else travels and
            the barrier.
        commit (float): swapping the new state in.
    """

    agree: float = 0.0
    build: float = 0.0
    exchange: float = 0.0
    commit: float = 0.0

    @property
    def total(self) -> float:
        return self.agree + self.build + self.exchange + self.commit


@dataclass(frozen=True)
class ExchangePart:
    """
    What this rank gives the executor.

    Args:
        plan (RankPlan): this rank's sends, receives and local copies, ranks
            numbered as the transaction's participants.
        fields (Mapping[str, Sequence[Field]]): the fields of every planned
            table, the same on every rank.
        io (PieceIO): where pieces are read and written.
    """

    plan: RankPlan
    fields: Mapping[str, Sequence[Field]]
    io: PieceIO


@dataclass(frozen=True)
class Outcome:
    """
    What the runner did on this rank.

    Args:
        phases (PhaseTimes): time per phase.
        exchange (ExchangeStats): what the executor moved (empty for a dry run).
        dry_run (Any): the participant's dry-run report, for a dry run.
    """

    phases: PhaseTimes
    exchange: ExchangeStats
    dry_run: Any = None


@dataclass
class MoveReport:
    """
    What one rank did in a move between groups.

    Args:
        rank (int): global rank.
        role (str): "stayed", "left" or "joined" (or "source" / "destination"
            for :func:`shard_from_rank` / :func:`unshard_model`).
        tables (int): tables moved.
        bytes_sent (int): table bytes this rank sent to other ranks.
        bytes_received (int): table bytes this rank received.
        bytes_received_in_place (int): of ``bytes_received``, the bytes that
            arrived straight in the new kernels' memory (not via a buffer).
        bytes_copied_locally (int): table bytes that stayed on this rank and
            were copied into the new model.
        bytes_kept_in_place (int): table bytes that stayed on this rank in the
            same storage: the new model's kernels took over the old ones'
            memory (nothing copied, see ``storage``).
        bytes_released (int): bytes of departed tables' state given back to
            the OS from storage that kept tables share.
        dense_bytes (int): bytes of dense parameters and buffers broadcast.
        seconds (float): wall time on this rank.
        phases (PhaseTimes): wall time of each phase of the transaction.
    """

    rank: int
    role: str
    tables: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_received_in_place: int = 0
    bytes_copied_locally: int = 0
    bytes_kept_in_place: int = 0
    bytes_released: int = 0
    dense_bytes: int = 0
    seconds: float = 0.0
    phases: PhaseTimes = field(default_factory=PhaseTimes)

    def add_exchange(self, stats: ExchangeStats) -> None:
        self.bytes_sent += stats.bytes_sent
        self.bytes_received += stats.bytes_received
        self.bytes_received_in_place += stats.bytes_received_in_place
        self.bytes_copied_locally += stats.bytes_copied_locally
        self.bytes_kept_in_place += stats.bytes_kept_in_place

    def finish(self, phases: PhaseTimes) -> None:
        self.phases = phases
        self.seconds = phases.total


class Participant(abc.ABC):
    """
    This rank's part of one transaction; subclassed by each kind of move. Every
    rank of :meth:`ranks` runs the same kind with the same request.
    """

    kind: str = "transaction"

    @abc.abstractmethod
    def ranks(self) -> List[int]:
        """The participants' global ranks; their order numbers the transaction."""

    @abc.abstractmethod
    def digest(self) -> int:
        """A digest of the request, equal on every rank for equal requests."""

    @abc.abstractmethod
    def prepare(self) -> Any:
        """
        Validates the request on this rank (raising :class:`ReshardError`)
        and returns the facts the others need (picklable, bounded by this
        rank's own part).
        """

    def merge(self, facts: Sequence[Any]) -> Any:
        """
        Run by the coordinator only: every participant's facts (by index) to
        what everyone needs, as large as the request rather than the world;
        raises :class:`ReshardError` for a request the facts refuse.
        """
        return None

    @abc.abstractmethod
    def agreed(self, merged: Any) -> None:
        """Everyone: takes the merged facts (pure, deterministic)."""

    def dry_run(self) -> Any:
        """What the transaction would do, once agreed (nothing is built)."""
        return None

    @abc.abstractmethod
    def build(self) -> None:
        """Builds the new state, detached from what runs now."""

    def before_exchange(self, group: ExchangeGroup) -> None:
        """Collectives the built state needs before it is filled."""

    @abc.abstractmethod
    def exchange_part(self) -> ExchangePart:
        """This rank's part of the plan, with the fields and the IO."""

    def after_exchange(self, group: ExchangeGroup, stats: ExchangeStats) -> None:
        """What else travels once the shards are filled (e.g. dense state)."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Swaps the new state in; must not fail."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drops what was built; what runs stays as it was."""

    def device(self) -> torch.device:
        """Where the exchange buffers live."""
        return torch.device("cpu")

    def unchanged(self) -> str:
        """What a failed transaction leaves as it was, for the error message."""
        return "the module is unchanged and keeps its old sharding"


class _Clock:
    """Times the phases of one transaction, each under ``record_function``."""

    def __init__(self, kind: str) -> None:
        self._kind = kind
        self.seconds = {phase: 0.0 for phase in PHASES}

    def phase(self, name: str) -> "_Phase":
        return _Phase(self, name)

    def times(self) -> PhaseTimes:
        return PhaseTimes(**self.seconds)


class _Phase:
    def __init__(self, clock: _Clock, name: str) -> None:
        self._clock = clock
        self._name = name
        self._record = record_function(f"## reshard {clock._kind}: {name} ##")
        self._start = 0.0

    def __enter__(self) -> None:
        self._record.__enter__()
        self._start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self._clock.seconds[self._name] += time.perf_counter() - self._start
        self._record.__exit__(*exc)


def _local_error(e: BaseException, what: str) -> str:
    if isinstance(e, ReshardError):
        return str(e)
    return f"{what} failed: {type(e).__name__}: {e}"


def _progress_bar(enabled: bool) -> Optional[Callable[[int, int], None]]:
    """A tqdm bar over the exchange rounds, created on the first round."""
    if not enabled:
        return None
    from tqdm import tqdm

    bar: List[Any] = []

    def on_round(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, desc="resharding", unit="round"))
        bar[0].update(1)
        if done == total:
            bar[0].close()

    return on_round


def run_transaction(
    participant: Participant,
    options: Optional[ReshardOptions] = None,
    dry_run: bool = False,
) -> Outcome:
    """
    Takes this rank's participant through agree, build, exchange and commit.
    Every rank of ``participant.ranks()`` calls it for the same request.

    Args:
        participant (Participant): this rank's part.
        options (Optional[ReshardOptions]): cap, timeout, progress.
        dry_run (bool): stop after the first agreement.

    Returns:
        Outcome: the phase times, what moved, and the dry-run report.

    Raises:
        ReshardError: on every rank, before anything is built, for a bad
            request; or after the build when a rank could not build.
        ReshardAbortedError: on every calling rank, when a rank does not come
            in time or the exchange fails; nothing changed.
    """
    options = options or ReshardOptions()
    timeout = options.exchange_timeout or default_timeout()
    ranks = participant.ranks()
    clock = _Clock(participant.kind)
    digest = participant.digest()

    with clock.phase("agree"):
        facts, error = None, None
        try:
            facts = participant.prepare()
        except Exception as e:  # the base refusing a layout, a bad request, ...
            error = _local_error(e, "validating the request")
        agreement = agree_among_ranks(
            ranks, digest, error, facts, timeout, merge=participant.merge
        )
        participant.agreed(agreement.merged)
    if dry_run:
        return Outcome(clock.times(), ExchangeStats(), participant.dry_run())

    with clock.phase("build"):
        error = None
        try:
            participant.build()
        except Exception as e:
            error = _local_error(e, "building the new sharding")
        try:
            built = agree_among_ranks(ranks, digest, error, None, timeout)
        except BaseException:
            participant.abort()
            raise

    with clock.phase("exchange"):
        stats = _exchange(participant, ranks, built.transaction, timeout, options)

    with clock.phase("commit"):
        participant.commit()
    return Outcome(clock.times(), stats)


def _exchange(
    participant: Participant,
    ranks: Sequence[int],
    transaction: str,
    timeout: timedelta,
    options: ReshardOptions,
) -> ExchangeStats:
    me = dist.get_rank()
    try:
        group = open_exchange_group(ranks, transaction, timeout, participant.device())
    except Exception as e:
        participant.abort()
        if isinstance(e, ReshardAbortedError):
            raise
        raise ReshardAbortedError(
            f"rank {me}: could not connect the ranks of the {participant.kind} "
            f"({type(e).__name__}: {e}); {participant.unchanged()}"
        ) from e
    try:
        participant.before_exchange(group)
        part = participant.exchange_part()
        stats = execute_transfers(
            part.plan,
            part.fields,
            part.io,
            group,
            options.max_inflight_bytes,
            participant.device(),
            _progress_bar(options.progress and ranks[0] == me),
        )
        del part
        participant.after_exchange(group, stats)
        # Nobody commits before everybody filled its new state.
        group.barrier()
    except Exception as e:
        group.close()
        participant.abort()
        raise ReshardAbortedError(
            f"rank {me}: the {participant.kind} failed in the exchange "
            f"({type(e).__name__}: {e}); {participant.unchanged()}"
        ) from e
    group.close()
    return stats

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The one transaction runner of live resharding: it plans, moves and reports.

Every way of moving tables — a reshard within a process group
(``reshard``), a move onto another set of ranks (``elastic``), an unshard
onto one rank and a shard from one rank (``unshard``) — is a
:class:`Participant`: this rank's part of one transaction. A participant
states what it has and what it wants, and how to build, commit and abort; the
runner takes every participant through the same phases, each under
``torch.profiler.record_function`` and timed into the report:

1. **agree**: the participant validates the request and states its local facts
   (:meth:`Participant.prepare`); the ranks agree on the job's store (one
   coordinator merges the facts, :meth:`Participant.merge`, and decides); a bad
   request raises the same :class:`ReshardError` on every rank, a rank that
   does not come :class:`ReshardAbortedError`, before anything is built. Every
   participant then states the same :class:`TransactionLayouts`: the old and
   new layout of every table in the transaction's rank numbering, and the
   fields that travel with it (:meth:`Participant.agreed`). A dry run stops
   here and counts the bytes every rank would send and receive;
2. **build**: on a GPU each rank first checks that the bytes the transaction
   may add fit its free device memory (``device_memory``); the participant
   builds what the new layout needs, detached from what runs now
   (:meth:`Participant.build`); the ranks agree again that every rank built;
3. **exchange**: on the transaction's exchange group (``exchange_group``: connected for
   it, or kept from an earlier transaction of the same ranks when every rank
   kept it, which the build's agreement decides), once this rank's device
   finished the work queued on it, the runner plans this rank's part
   (``transfer_plan.plan_rank_transfers``) and the one executor
   (``exchange.execute_transfers``) fills the participant's new slots from its
   old ones (:meth:`Participant.slots`, read and written by ``slots.slot_io``);
   then whatever else travels (:meth:`Participant.after_exchange`), and
   everything else that can fail before the swap; a barrier: nobody commits
   before everybody filled;
4. **commit**: the participant swaps the new state in
   (:meth:`Participant.commit`), which does nothing that can fail.

A failure anywhere before the commit calls :meth:`Participant.abort` (the one
abort path) and leaves what runs exactly as it was; a failure in the exchange
aborts the exchange group too (never a shutdown that waits for a dead peer).
Every kind of transaction returns one
:class:`~torchrec.distributed.resharding.transaction_report.TransactionReport`.
"""

import abc
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
)

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.resharding.abort_signal import AbortedByPeer, AbortSignal
from torchrec.distributed.resharding.agreement import agree_among_ranks, default_timeout
from torchrec.distributed.resharding.device_memory import (
    check_fits,
    DEFAULT_STAGED_INFLIGHT_BYTES,
    estimate_peak,
    free_device_bytes,
    MemoryWatch,
    NCCL_COMMUNICATOR_BYTES,
    NCCL_PEER_BYTES,
    TablePlacement,
)
from torchrec.distributed.resharding.devices import (
    normalized_device,
    synchronize_device,
)
from torchrec.distributed.resharding.exchange import ExchangeStats, execute_transfers
from torchrec.distributed.resharding.exchange_group import ExchangeGroup
from torchrec.distributed.resharding.exchange_groups import (
    ExchangeGroups,
    kept_exchange_groups,
    same_kept_group,
)
from torchrec.distributed.resharding.fields import Field, piece_cost, TableKey
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import (
    ReshardAbortedError,
    ReshardError,
    TableLayout,
)
from torchrec.distributed.resharding.plan_validation import text_digest
from torchrec.distributed.resharding.slots import LocalSlot, slot_io, SlotKey
from torchrec.distributed.resharding.transaction_report import (
    PhaseTimes,
    TransactionReport,
)
from torchrec.distributed.resharding.transfer_bytes import bytes_per_rank
from torchrec.distributed.resharding.transfer_plan import plan_rank_transfers, RankPlan
from torchrec.distributed.types import ParameterSharding

logger: logging.Logger = logging.getLogger(__name__)

PHASES = ("agree", "build", "exchange", "commit")

FactsT = TypeVar("FactsT")
MergedT = TypeVar("MergedT")
Slots = Mapping[SlotKey, LocalSlot]


def _split_key(key: str) -> Tuple[str, str]:
    """A transaction's key: a ``TableKey``, or a bare table name (path "")."""
    if ":" not in key:
        return "", key
    parsed = TableKey.parse(key)
    return parsed.path, parsed.table


def described(render: Callable[[Any], str], value: Any) -> str:
    """
    A part of a request as canonical text: ``render(value)``, or the value's
    type for a value that is not what it should be (validation reports it).

    Args:
        render (Callable[[Any], str]): the canonical text of a good value.
        value (Any): what the caller passed.

    Returns:
        str: its text, the same on every rank for equal values.
    """
    try:
        return render(value)
    except Exception:  # not what it should be: validation reports it
        return f"?{type(value).__name__}"


@dataclass(frozen=True)
class TransactionLayouts:
    """
    What a transaction moves, stated alike by every participant once the ranks
    agreed.

    Args:
        old (Mapping[str, TableLayout]): "path:table" -> its layout before, in
            the transaction's ranks (positions in :meth:`Participant.ranks`).
        new (Mapping[str, TableLayout]): "path:table" -> its layout after; the
            tables the transaction plans, in order.
        fields (Mapping[str, Sequence[Field]]): the fields that travel with
            each planned table.
        dense_bytes (int): bytes of the dense (replicated) part each rank of
            the new layout receives besides.
        placements (Mapping[str, TablePlacement]): where each planned
            table's new kernel keeps its state on this rank (the device
            memory pre-flight counts by placement; default: the device).
    """

    old: Mapping[str, TableLayout]
    new: Mapping[str, TableLayout]
    fields: Mapping[str, Sequence[Field]]
    dense_bytes: int = 0
    placements: Mapping[str, TablePlacement] = field(default_factory=dict)


class Participant(abc.ABC, Generic[FactsT, MergedT]):
    """
    This rank's part of one transaction; subclassed by each kind of move. Every
    rank of :meth:`ranks` runs the same kind with the same request.
    """

    kind: str = "transaction"
    role: str = "member"

    @abc.abstractmethod
    def ranks(self) -> List[int]:
        """The participants' global ranks; their order numbers the transaction."""

    @abc.abstractmethod
    def request(self) -> List[str]:
        """
        The request as canonical text, equal on every rank for equal requests
        (values validation may refuse go through :func:`described`).
        """

    @abc.abstractmethod
    def prepare(self) -> FactsT:
        """
        Validates the request on this rank (raising :class:`ReshardError`)
        and returns the facts the others need (picklable, bounded by this
        rank's own part).
        """

    def merge(self, facts: Sequence[FactsT]) -> Optional[MergedT]:
        """
        Run by the coordinator only: every participant's facts (by index) to
        what everyone needs, as large as the request rather than the world;
        raises :class:`ReshardError` for a request the facts refuse.
        """
        return None

    @abc.abstractmethod
    def agreed(self, merged: MergedT) -> TransactionLayouts:
        """
        Everyone: takes the merged facts (pure, deterministic) and states
        what the transaction moves, the same on every rank.
        """

    @abc.abstractmethod
    def build(self) -> None:
        """Builds the new state, detached from what runs now."""

    def before_exchange(self, group: ExchangeGroup) -> None:
        """Collectives the built state needs before it is filled."""

    @abc.abstractmethod
    def slots(self) -> Tuple[Slots, Slots]:
        """This rank's old and new shards, keyed by "path:table" and rectangle."""

    def after_exchange(self, group: ExchangeGroup) -> None:
        """
        What else travels once the shards are filled (e.g. dense state), and
        whatever else can fail: the commit cannot.
        """

    @abc.abstractmethod
    def commit(self) -> int:
        """
        Swaps the new state in; must not fail.

        Returns:
            int: bytes of departed tables' state given back to the OS.
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Drops what was built; what runs stays as it was."""

    def deltas(self) -> Optional[Dict[str, Dict[str, ParameterSharding]]]:
        """A reshard's changed tables per module path, for the report."""
        return None

    def device(self) -> torch.device:
        """Where the exchange buffers live (the same type on every rank)."""
        return torch.device("cpu")

    def unchanged(self) -> str:
        """What a failed transaction leaves as it was, for the error message."""
        return "the module is unchanged and keeps its old sharding"

    def state_devices(self) -> List[torch.device]:
        """
        The devices of the state the exchange reads and writes, whose queued
        work must finish first (a pipeline's collectives, an optimizer step on
        another stream): the exchange's device by default; a move between CPU
        and GPU ranks exchanges on the host and reads CUDA kernels.
        """
        return [self.device()]

    def exchange_groups_owner(self) -> Optional[Any]:
        """
        The ``ShardingEnv`` whose kept exchange groups serve the transaction
        (``exchange_groups.kept_exchange_groups``);
        None: a group for this transaction alone.
        """
        return None

    def stages_on_host(self) -> bool:
        """
        Whether the exchange stages data between the host and a GPU (host
        state on a CUDA exchange, CUDA state on a host one): then it is
        capped by default (:func:`inflight_cap`). The same on every rank.
        """
        return False


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
    participant: Participant[Any, Any],
    options: Optional[ReshardOptions] = None,
    dry_run: bool = False,
) -> TransactionReport:
    """
    Takes this rank's participant through agree, build, exchange and commit.
    Every rank of ``participant.ranks()`` calls it for the same request.

    Args:
        participant (Participant): this rank's part.
        options (Optional[ReshardOptions]): cap, timeout, progress.
        dry_run (bool): stop after the first agreement and count the bytes
            every rank would move.

    Returns:
        TransactionReport: what this rank did (what every rank would move).

    Raises:
        ReshardError: on every rank, before anything is built, for a bad
            request; or after the build when a rank could not build.
        ReshardAbortedError: on every calling rank, when a rank does not come
            in time or the exchange fails; nothing changed.
    """
    options = options or ReshardOptions()
    timeout = options.exchange_timeout or default_timeout()
    ranks = participant.ranks()
    kind = f"{participant.kind} dry run" if dry_run else participant.kind
    clock = _Clock(kind)
    digest = text_digest("\n".join([kind, *participant.request()]))

    with clock.phase("agree"):
        facts, error = None, None
        try:
            facts = participant.prepare()
        except Exception as e:  # the base refusing a layout, a bad request, ...
            error = _local_error(e, "validating the request")
        agreement = agree_among_ranks(
            ranks, digest, error, facts, timeout, merge=participant.merge
        )
        layouts = participant.agreed(agreement.merged)
    report = _report(participant, layouts, dry_run)
    if dry_run:
        _count_dry_run(report, layouts, ranks)
        return _finish(report, clock)

    device = normalized_device(participant.device())
    groups, own_groups = _exchange_groups(participant, options)
    cap = inflight_cap(participant, options)
    watch = MemoryWatch(device)
    plan: Optional[RankPlan] = None
    with clock.phase("build"):
        error = None
        try:
            index = list(ranks).index(dist.get_rank())
            plan = plan_rank_transfers(layouts.old, layouts.new, index)
            report.estimated_peak_bytes = _check_device_memory(
                participant, layouts, ranks, device, cap, groups, rank_peers(plan)
            )
            participant.build()
        except Exception as e:
            error = _local_error(e, "building the new sharding")
        watch.sample()
        try:
            # whether every rank kept the same exchange group for these ranks
            built = agree_among_ranks(
                ranks,
                digest,
                error,
                groups.kept_name(ranks, device),
                timeout,
                merge=same_kept_group,
            )
        except BaseException:
            participant.abort()
            raise

    assert plan is not None  # every rank built (the agreement said so)
    with clock.phase("exchange"):
        exchange = _Exchange(participant, ranks, device, timeout, options, cap)
        stats, kept = exchange.run(
            layouts, plan, groups, built.transaction, built.merged
        )
    groups.note_peers(ranks, device, rank_peers(plan))
    _count_exchange(report, stats, kept)
    report.connect_seconds = exchange.connect_seconds
    report.exchange_group = exchange.group_name
    report.communicator_bytes = exchange.communicator_bytes
    report.kept_communicator_bytes = groups.communicator_bytes
    watch.sample()
    report.peak_memory_bytes, report.memory_kind = watch.peak(), watch.kind
    with clock.phase("commit"):
        report.bytes_released = participant.commit()
    if own_groups:
        groups.close(graceful=True)  # made for this transaction alone
    return _finish(report, clock)


def _exchange_groups(
    participant: Participant[Any, Any], options: ReshardOptions
) -> Tuple[ExchangeGroups, bool]:
    """
    Where the transaction finds and keeps its exchange group: those of the
    participant's ``ShardingEnv`` (``exchange_groups.kept_exchange_groups``),
    else its own (closed at its end; the second value says so); groups named
    by the deprecated ``ReshardOptions.exchange_groups`` come first.
    """
    if options.exchange_groups is not None:
        return options.exchange_groups, False
    env = participant.exchange_groups_owner()
    if env is not None:
        return kept_exchange_groups(env), False
    return ExchangeGroups(), True


def inflight_cap(
    participant: Participant[Any, Any], options: ReshardOptions
) -> Optional[int]:
    """
    The exchange's in-flight cap: the options', else, where the exchange
    stages data between the host and a GPU (:meth:`Participant.stages_on_host`,
    the same on every rank), :data:`DEFAULT_STAGED_INFLIGHT_BYTES`: staging
    buffers are pinned host memory or device memory that a whole model's
    bytes in one round would exhaust.

    Args:
        participant (Participant): this rank's part.
        options (ReshardOptions): the options.

    Returns:
        Optional[int]: the cap (None: one round).
    """
    if options.max_inflight_bytes is not None:
        return options.max_inflight_bytes
    if participant.stages_on_host():
        return DEFAULT_STAGED_INFLIGHT_BYTES
    return None


def rank_peers(plan: RankPlan) -> List[int]:
    """The ranks (numbered in the transaction) this rank sends to or receives from."""
    peers = {t.dst_rank for t in plan.sends} | {t.src_rank for t in plan.receives}
    return sorted(peers)


def communicator_budget(
    groups: ExchangeGroups,
    ranks: Sequence[int],
    device: torch.device,
    peers: Sequence[int],
) -> int:
    """
    Device bytes the exchange's communicator may add on this rank: a new
    connect (the last measured connect of as many members, else the margin
    ``NCCL_COMMUNICATOR_BYTES``) unless this rank kept a group for the
    ranks, plus ``NCCL_PEER_BYTES`` for each peer the group has not yet
    exchanged with (NCCL allocates point-to-point buffers on first use).
    Nothing on CPU.
    """
    if device.type != "cuda":
        return 0
    budget = groups.new_peers(ranks, device, peers) * NCCL_PEER_BYTES
    if not groups.kept_name(ranks, device):
        measured = groups.measured_bytes(len(ranks), device)
        budget += NCCL_COMMUNICATOR_BYTES if measured is None else measured
    return budget


def _check_device_memory(
    participant: Participant[Any, Any],
    layouts: TransactionLayouts,
    ranks: Sequence[int],
    device: torch.device,
    cap: Optional[int],
    groups: ExchangeGroups,
    peers: Sequence[int],
) -> int:
    """
    The bound of the device bytes the transaction adds on this rank; on CUDA
    refuses (``ReshardError``) when it does not fit the free memory.
    """
    estimate = estimate_peak(
        layouts.old,
        layouts.new,
        layouts.fields,
        list(ranks).index(dist.get_rank()),
        cap,
        layouts.dense_bytes,
        communicator_budget(groups, ranks, device, peers),
        layouts.placements,
    )
    free = free_device_bytes(device)
    if free is not None:
        check_fits(estimate, free, device, participant.kind)
    return estimate.total


def _post(signal: AbortSignal, error: BaseException) -> None:
    """Posts the transaction's abort key, if the store still answers."""
    try:
        signal.post(f"{type(error).__name__}: {error}")
    except Exception:  # the job's store is gone: nobody to tell
        logger.warning("could not post the abort key", exc_info=True)


def _by_module(keys: Sequence[str]) -> Dict[str, List[str]]:
    """Per module path, the tables of "path:table" keys, in order."""
    out: Dict[str, List[str]] = {}
    for key in keys:
        path, table = _split_key(key)
        out.setdefault(path, []).append(table)
    return out


def _report(
    participant: Participant[Any, Any], layouts: TransactionLayouts, dry_run: bool
) -> TransactionReport:
    """The report of what the agreed transaction plans."""
    return TransactionReport(
        kind=participant.kind,
        rank=dist.get_rank(),
        role=participant.role,
        dry_run=dry_run,
        tables_moved=_by_module(
            [k for k, new in layouts.new.items() if layouts.old[k] != new]
        ),
        tables_rebuilt=_by_module(list(layouts.new)),
        dense_bytes=layouts.dense_bytes,
        deltas=participant.deltas(),
    )


def _count_dry_run(
    report: TransactionReport, layouts: TransactionLayouts, ranks: Sequence[int]
) -> None:
    """The bytes every rank would send and receive, without the transfers."""
    costs = {key: piece_cost(fields) for key, fields in layouts.fields.items()}
    sent, received = bytes_per_rank(layouts.old, layouts.new, costs)
    report.bytes_sent_by_rank = {g: sent.get(i, 0) for i, g in enumerate(ranks)}
    report.bytes_received_by_rank = {g: received.get(i, 0) for i, g in enumerate(ranks)}


def _count_exchange(
    report: TransactionReport, stats: ExchangeStats, kept: Sequence[SlotKey]
) -> None:
    """What the executor moved on this rank, and which shards kept storage."""
    for name in ExchangeStats.__dataclass_fields__:
        setattr(report, name, getattr(stats, name))
    report.tables_kept_in_place = _by_module([key for key, _ in sorted(kept, key=str)])


def _finish(report: TransactionReport, clock: "_Clock") -> TransactionReport:
    report.phases = clock.times()
    logger.info(
        "%s%s rank %d (%s): moved %s, rebuilt %d tables, sent %d B, received %d B "
        "(%d B in place), copied locally %d B, kept in place %d B, released %d B, "
        "dense %d B, peak %d B (%s) in %.3f s (agree %.3f, build %.3f, "
        "exchange %.3f, commit %.3f)",
        report.kind,
        " dry run" if report.dry_run else "",
        report.rank,
        report.role,
        report.tables_moved,
        sum(len(tables) for tables in report.tables_rebuilt.values()),
        report.bytes_sent,
        report.bytes_received,
        report.bytes_received_in_place,
        report.bytes_copied_locally,
        report.bytes_kept_in_place,
        report.bytes_released,
        report.dense_bytes,
        report.peak_memory_bytes,
        report.memory_kind or "-",
        report.seconds,
        report.phases.agree,
        report.phases.build,
        report.phases.exchange,
        report.phases.commit,
    )
    return report


@dataclass
class _Exchange:
    """
    The exchange phase of one transaction on this rank; it records how long
    its group took to connect, the group's name and its communicators' bytes.

    Args:
        participant (Participant): this rank's participant.
        ranks (Sequence[int]): the transaction's global ranks.
        device (torch.device): the exchange's device.
        timeout (timedelta): the bound of every wait.
        options (ReshardOptions): the transaction's options.
        cap (Optional[int]): the in-flight cap, in bytes (None: none).
    """

    participant: Participant[Any, Any]
    ranks: Sequence[int]
    device: torch.device
    timeout: timedelta
    options: ReshardOptions
    cap: Optional[int]
    connect_seconds: float = field(default=0.0, init=False)
    group_name: str = field(default="", init=False)
    communicator_bytes: int = field(default=0, init=False)

    def _synchronize(self) -> None:
        # the state's devices, not only the exchange's: a move between CPU
        # and GPU ranks exchanges on the host, reading CUDA kernels
        for device in self.participant.state_devices():
            synchronize_device(normalized_device(device))

    def _gate(self, signal: AbortSignal) -> None:
        """Every rank is alive and here, right before the group connects
        (an NCCL connect has no timeout of its own)."""
        participant = self.participant
        try:
            signal.arrive(AbortSignal.GATE, self.timeout)
        except Exception as e:
            participant.abort()
            if not isinstance(e, (AbortedByPeer, ReshardAbortedError)):
                _post(signal, e)  # the ranks still at the gate fail at once
            raise ReshardAbortedError(
                f"rank {dist.get_rank()}: not every rank of the {participant.kind} "
                f"reached the exchange ({type(e).__name__}: {e}); "
                f"{participant.unchanged()}"
            ) from e

    def _open(
        self,
        groups: ExchangeGroups,
        transaction: str,
        reuse: str,
        signal: AbortSignal,
    ) -> ExchangeGroup:
        participant = self.participant
        start = time.perf_counter()
        try:
            group = groups.open(
                self.ranks, transaction, self.timeout, self.device, reuse
            )
        except Exception as e:
            participant.abort()
            _post(signal, e)
            if isinstance(e, ReshardAbortedError):
                raise
            raise ReshardAbortedError(
                f"rank {dist.get_rank()}: could not connect the ranks of the "
                f"{participant.kind} ({type(e).__name__}: {e}); "
                f"{participant.unchanged()}"
            ) from e
        if group.name == transaction:
            self.connect_seconds = time.perf_counter() - start
        self.group_name = group.name
        self.communicator_bytes = group.communicator_bytes
        return group.with_signal(signal)

    def run(
        self,
        layouts: TransactionLayouts,
        plan: RankPlan,
        groups: ExchangeGroups,
        transaction: str,
        reuse: str,
    ) -> Tuple[ExchangeStats, List[SlotKey]]:
        """
        Fills the participant's new state on the exchange group; aborts the
        group and the participant on any failure.
        """
        participant, me = self.participant, dist.get_rank()
        index = list(self.ranks).index(me)
        signal = AbortSignal.of(transaction, len(self.ranks), index)
        # The device finished what was queued on it (a pipeline's collectives,
        # an optimizer step on another stream) before the exchange reads or
        # writes the kernels' memory.
        self._synchronize()
        self._gate(signal)
        group = self._open(groups, transaction, reuse, signal)
        try:
            participant.before_exchange(group)
            io = slot_io(*participant.slots(), layouts.fields)
            stats = execute_transfers(
                plan,
                layouts.fields,
                io,
                group,
                self.cap,
                self.device,
                _progress_bar(self.options.progress and self.ranks[0] == me),
            )
            kept = list(io.in_place)
            del io  # nothing of the transaction holds the old slots at the commit
            participant.after_exchange(group)
            # Nobody commits before everybody filled its new state (a store
            # barrier: no collective of the group is left pending on a rank
            # when a peer fails there).
            signal.arrive(AbortSignal.FILLED, self.timeout)
            self._synchronize()
        except Exception as e:
            # the others stop waiting on this rank, NCCL communicators are
            # aborted in an order no watchdog takes for an error of its own
            groups.fail(group, f"{type(e).__name__}: {e}")
            participant.abort()
            raise ReshardAbortedError(
                f"rank {me}: the {participant.kind} failed in the exchange "
                f"({type(e).__name__}: {e}); {participant.unchanged()}"
            ) from e
        return stats, kept

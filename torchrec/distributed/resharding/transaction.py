#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The transaction driver of live resharding. A reshard request (one module, or
every sharded module of a model) is one transaction, in two halves:

**prepare** (:func:`prepare_reshard`) — nothing moves:

1. **validate** every module's delta (pure, see ``plan``) and derive its new
   sharding groups; groups the delta does not touch keep their objects;
2. **build** the groups that change, detached from the module, under the
   reshard's kernel build hooks (``storage``: no initialisation; on CPU the
   tables that stay put keep their storage);
3. **agree** with every other rank, once for the whole request, bounded by the
   exchange timeout: the same request everywhere, no rank failed, and the
   facts (state fields, learning rates) every rank needs;
4. **plan** the transfers between the old and the new rectangles.

**execute** (:meth:`PreparedReshard.execute`):

5. **exchange** on a process group made for this transaction: pieces that stay
   on a rank are copied locally, the others travel by ``all_to_all_single``
   straight into the new kernels' weights and fused optimizer state;
6. **swap**, once every rank of every module filled its new groups: each
   module installs its new groups with its own method; the old kernels are
   retired and their storage released where nobody else can see it.

Until step 6 no module is touched: a bad request raises :class:`ReshardError`
and a failure (a rank missing or dying, a timeout) :class:`ReshardAbortedError`
on every rank, and every module is left exactly as it was.
"""

import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.resharding.exchange import (
    agree,
    Agreement,
    close_exchange_group,
    exchange_pieces,
    Field,
    open_exchange_group,
)
from torchrec.distributed.resharding.groups import (
    build_groups,
    changed_types,
    check_built_layouts,
    infos_for_plan,
    NewGroups,
    old_kernels_of,
    rebuilt_tables,
    retire_kernels,
    wrap_new_lookups,
)
from torchrec.distributed.resharding.install import adapter_for, ShardedModuleAdapter
from torchrec.distributed.resharding.kernel_state import (
    kept_in_place,
    LocalSlot,
    read_piece,
    RowwiseMerges,
    slot_bytes,
    SlotKey,
    target_piece,
    write_piece,
    zero_undelivered_state,
)
from torchrec.distributed.resharding.optimizer_state import (
    apply_table_facts,
    fields_by_table,
    local_table_facts,
    merge_table_facts,
    TableFacts,
)
from torchrec.distributed.resharding.plan import (
    delta_digest,
    layout_from_parameter_sharding,
    MOVABLE_COMPUTE_KERNELS,
    plan_transfers,
    ReshardAbortedError,
    ReshardError,
    ReshardPlan,
    TableLayout,
)
from torchrec.distributed.resharding.storage import (
    KeptStorage,
    next_generation,
    split_kept_tables,
    storage_reuse_supported,
    StorageMode,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv

logger: logging.Logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReshardOptions:
    """
    How a reshard runs; the same for a module (``reshard_module``,
    ``update_shards``) and a model (``DistributedModelParallel.reshard``).

    Args:
        max_inflight_bytes (Optional[int]): cap on a rank's exchange buffers;
            the exchange runs in as many rounds as the cap needs.
        exchange_timeout (Optional[timedelta]): how long a rank waits for the
            others, in the agreement and in the exchange (default: the
            backend's default process-group timeout).
        progress (bool): a progress bar over the exchange rounds on rank 0.
        storage (StorageMode): whether the tables that stay put keep their
            storage (``REUSE``, the default) or are copied (``COPY``).
    """

    max_inflight_bytes: Optional[int] = None
    exchange_timeout: Optional[timedelta] = None
    progress: bool = False
    storage: StorageMode = StorageMode.REUSE


@dataclass
class ReshardReport:
    """
    What one rank did (or, from a dry run, would do) for one module.

    Args:
        rank (int): group-local rank.
        tables_moved (List[str]): tables whose layout changed.
        tables_rebuilt (List[str]): tables whose lookup was rebuilt (moved
            tables plus tables sharing a rebuilt group).
        bytes_sent (int): bytes this rank sent to other ranks.
        bytes_received (int): bytes this rank received from other ranks.
        bytes_copied_locally (int): bytes of pieces that stayed on this rank.
        tables_kept_in_place (List[str]): tables of rebuilt groups that kept
            this rank's storage (nothing copied, see ``storage``).
        bytes_kept_in_place (int): bytes of those tables on this rank.
        bytes_released (int): bytes of departed tables given back to the OS.
        seconds (float): wall time of the reshard on this rank.
    """

    rank: int
    tables_moved: List[str] = field(default_factory=list)
    tables_rebuilt: List[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_locally: int = 0
    tables_kept_in_place: List[str] = field(default_factory=list)
    bytes_kept_in_place: int = 0
    bytes_released: int = 0
    seconds: float = 0.0


@dataclass
class _ModuleReshard:
    """One module's part of a reshard."""

    path: str
    adapter: ShardedModuleAdapter
    delta: Mapping[str, ParameterSharding]
    infos: "OrderedDict[str, List[EmbeddingShardingInfo]]"
    rebuilt_types: List[str]
    tables: List[str]
    old_layouts: Dict[str, TableLayout]
    new_layouts: Dict[str, TableLayout]
    report: ReshardReport
    hooks: Optional[KeptStorage] = None
    groups: Optional[NewGroups] = None
    facts: TableFacts = field(default_factory=TableFacts)
    fields: Mapping[str, List[Field]] = field(default_factory=dict)
    transfers: Optional[ReshardPlan] = None

    def moved_tables(self) -> List[str]:
        return [t for t in self.tables if self.old_layouts[t] != self.new_layouts[t]]


def _check_rebuilt_kernels(
    adapter: ShardedModuleAdapter, tables: Sequence[str]
) -> None:
    plan = adapter.plan()
    for table in tables:
        kernel = plan[table].compute_kernel
        if kernel not in MOVABLE_COMPUTE_KERNELS:
            raise ReshardError(
                f"table '{table}': shares a rebuilt group but its compute kernel "
                f"'{kernel}' cannot be resharded"
            )


def _prepare_module(
    path: str,
    adapter: ShardedModuleAdapter,
    delta: Mapping[str, ParameterSharding],
    env: ShardingEnv,
    device: Optional[torch.device],
    options: ReshardOptions,
    build: bool,
) -> _ModuleReshard:
    pg = env.process_group
    rank, world_size = dist.get_rank(pg), dist.get_world_size(pg)
    changed_layouts = adapter.validate_delta(delta, env, device)
    new_plan = {**adapter.plan(), **delta}
    infos = infos_for_plan(adapter, new_plan)
    rebuilt = changed_types(adapter, infos)
    tables = rebuilt_tables(adapter, infos, rebuilt)
    _check_rebuilt_kernels(adapter, tables)
    new_layouts = {
        t: changed_layouts.get(t)
        or layout_from_parameter_sharding(
            new_plan[t], *adapter.table_shape(t), world_size
        )
        for t in tables
    }
    module = _ModuleReshard(
        path,
        adapter,
        delta,
        infos,
        rebuilt,
        tables,
        adapter.layouts(tables, world_size),
        new_layouts,
        ReshardReport(rank),
    )
    if build and rebuilt:
        reuse = options.storage == StorageMode.REUSE and storage_reuse_supported(device)
        if reuse:
            split_kept_tables(
                infos, rebuilt, set(delta), next_generation(adapter.sharding_infos())
            )
        kept = set(tables) - set(delta)
        module.hooks = KeptStorage(old_kernels_of(adapter, rebuilt), kept, reuse)
        module.groups = build_groups(adapter, infos, rebuilt, env, device, module.hooks)
        check_built_layouts(module.groups, new_layouts, rank)
    return module


def _request_digest(requests: Sequence[Tuple[str, ShardedModuleAdapter, Any]]) -> int:
    parts = []
    for path, _, delta in requests:
        try:
            parts.append(f"{path}={delta_digest(delta)}")
        except Exception:  # not a delta at all: validation reports it
            parts.append(f"{path}?{type(delta).__name__}")
    text = "\n".join(parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _discard(modules: Sequence[_ModuleReshard]) -> None:
    """Drops what a reshard that does not go through built."""
    for module in modules:
        if module.groups is not None:
            retire_kernels(module.groups.new_kernels())
        module.groups = None
        module.hooks = None


def prepare_reshard(
    requests: Sequence[
        Tuple[str, ShardedModuleAdapter, Mapping[str, ParameterSharding]]
    ],
    env: ShardingEnv,
    device: Optional[torch.device] = None,
    options: Optional[ReshardOptions] = None,
    build: bool = True,
) -> "PreparedReshard":
    """
    Validates, builds and agrees on a reshard of one or more modules of one
    process group; nothing moves and no module changes. Every rank calls it
    with the same requests.

    Args:
        requests (Sequence[Tuple[str, ShardedModuleAdapter, Mapping[str, ParameterSharding]]]):
            (module path, module adapter, delta) per module, in the same
            order on every rank.
        env (ShardingEnv): the modules' sharding environment.
        device (Optional[torch.device]): the modules' device.
        options (Optional[ReshardOptions]): how to run.
        build (bool): build the new groups (False for a dry run, which then
            cannot be executed).

    Returns:
        PreparedReshard: the agreed reshard, ready to execute.

    Raises:
        ReshardError: on every rank, for a bad request (naming the module,
            table and reason).
        ReshardAbortedError: on every calling rank, when a rank of the group
            does not join within the exchange timeout.
    """
    options = options or ReshardOptions()
    start = time.perf_counter()
    modules: List[_ModuleReshard] = []
    error: Optional[str] = None
    where = ""
    try:
        for path, adapter, delta in requests:
            where = f"module '{path}': " if path else ""
            modules.append(
                _prepare_module(path, adapter, delta, env, device, options, build)
            )
    except ReshardError as e:
        error = f"{where}{e}"
    except Exception as e:  # the base refusing a layout, out of memory, ...
        error = f"{where}building the new sharding failed: {type(e).__name__}: {e}"
    facts = (
        [local_table_facts(m.adapter.lookups(), m.tables) for m in modules]
        if error is None
        else None
    )
    try:
        agreement = agree(
            env.process_group,
            _request_digest(requests),
            error,
            facts,
            options.exchange_timeout,
        )
    except BaseException:
        _discard(modules)
        raise
    for i, module in enumerate(modules):
        module.facts = merge_table_facts([f[i] for f in agreement.facts])
        module.fields = fields_by_table(module.facts, module.tables)
        module.transfers = plan_transfers(
            module.old_layouts, module.new_layouts, module.tables
        )
    return PreparedReshard(env, device, options, modules, agreement, build, start)


@dataclass
class FilledSlots:
    """
    What :func:`fill_slots` did on one rank.

    Args:
        kept_in_place (List[SlotKey]): new slots whose kernel took over the old
            storage: neither copied nor written.
        bytes_kept_in_place (int): their bytes.
        bytes_copied_locally (int): bytes of pieces copied on this rank.
        bytes_sent (int): bytes sent to other ranks.
        bytes_received (int): bytes received from other ranks.
    """

    kept_in_place: List[SlotKey]
    bytes_kept_in_place: int = 0
    bytes_copied_locally: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


def fill_slots(
    transfers: ReshardPlan,
    fields: Mapping[str, Sequence[Field]],
    old_slots: Mapping[SlotKey, LocalSlot],
    new_slots: Mapping[SlotKey, LocalSlot],
    rank: int,
    group: dist.ProcessGroup,
    device: torch.device,
    max_inflight_bytes: Optional[int],
    on_round: Optional[Callable[[int, int], None]] = None,
) -> FilledSlots:
    """
    Fills new slots from old ones: the pieces that stay on this rank are copied
    locally (unless their new kernel already holds them in the old storage),
    the others go through :func:`exchange_pieces` on ``group``; optimizer
    state no piece delivers is zeroed. The one executor of a reshard within
    a group and of a move between groups.

    Args:
        transfers (ReshardPlan): the transfers, ranks numbered in ``group``.
        fields (Mapping[str, Sequence[Field]]): the fields of every table.
        old_slots (Mapping[SlotKey, LocalSlot]): this rank's old shards.
        new_slots (Mapping[SlotKey, LocalSlot]): this rank's new shards.
        rank (int): this rank in ``group``.
        group (dist.ProcessGroup): the transaction's exchange group.
        device (torch.device): where the exchange buffers live.
        max_inflight_bytes (Optional[int]): cap of the exchange buffers.
        on_round (Optional[Callable[[int, int], None]]): progress per round.

    Returns:
        FilledSlots: what moved, and what was kept in place.
    """
    in_place = set(kept_in_place(old_slots, new_slots))
    filled = FilledSlots(sorted(in_place))
    filled.bytes_kept_in_place = sum(slot_bytes(new_slots[k]) for k in in_place)
    merges = RowwiseMerges()
    with torch.no_grad():
        zero_undelivered_state(new_slots, fields, in_place)
        for transfer in transfers.local_copies(rank):
            if (transfer.table, transfer.dst_rect) in in_place:
                continue  # the new kernel already holds it: same memory
            src = old_slots[(transfer.table, transfer.src_rect)]
            dst = new_slots[(transfer.table, transfer.dst_rect)]
            for f in fields[transfer.table]:
                piece = read_piece(src, transfer, f)
                write_piece(dst, transfer, f, piece, merges)
                filled.bytes_copied_locally += piece.numel() * piece.element_size()
        filled.bytes_sent, filled.bytes_received = exchange_pieces(
            transfers,
            fields,
            rank,
            dist.get_world_size(group),
            group,
            read_piece=lambda t, f: read_piece(old_slots[(t.table, t.src_rect)], t, f),
            write_piece=lambda t, f, data: write_piece(
                new_slots[(t.table, t.dst_rect)], t, f, data, merges
            ),
            device=device,
            max_inflight_bytes=max_inflight_bytes,
            target_piece=lambda t, f: target_piece(
                new_slots[(t.table, t.dst_rect)], t, f
            ),
            on_round=on_round,
        )
        merges.finish()
    return filled


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


class PreparedReshard:
    """
    A reshard that every rank validated and agreed on, with its new groups
    built and its transfers planned; :meth:`execute` moves the data and swaps
    the groups in. Made by :func:`prepare_reshard`.
    """

    def __init__(
        self,
        env: ShardingEnv,
        device: Optional[torch.device],
        options: ReshardOptions,
        modules: List[_ModuleReshard],
        agreement: Agreement,
        built: bool,
        start: float,
    ) -> None:
        self._env = env
        self._device = device
        self._options = options
        self._modules = modules
        self._agreement = agreement
        self._built = built
        self._start = start
        self._executed = False

    @property
    def deltas(self) -> Dict[str, Mapping[str, ParameterSharding]]:
        """Per module path, the changed tables with their new sharding."""
        return {m.path: m.delta for m in self._modules}

    @property
    def tables_moved(self) -> Dict[str, List[str]]:
        """Per module path, the tables whose layout changes."""
        return {m.path: m.moved_tables() for m in self._modules}

    def bytes_per_rank(self) -> Tuple[Dict[int, int], Dict[int, int]]:
        """
        Returns:
            Tuple[Dict[int, int], Dict[int, int]]: per group-local rank, the
            bytes it sends and receives (weights and fused optimizer state).
        """
        world_size = dist.get_world_size(self._env.process_group)
        sent = {r: 0 for r in range(world_size)}
        received = {r: 0 for r in range(world_size)}
        for module in self._modules:
            assert module.transfers is not None
            for transfer in module.transfers.transfers:
                if transfer.is_local:
                    continue
                nbytes = sum(f.nbytes(transfer) for f in module.fields[transfer.table])
                sent[transfer.src_rank] += nbytes
                received[transfer.dst_rank] += nbytes
        return sent, received

    def execute(self) -> Dict[str, ReshardReport]:
        """
        Moves the data and swaps the new groups into every module.

        Returns:
            Dict[str, ReshardReport]: what this rank did, per module path.

        Raises:
            ReshardAbortedError: on every surviving rank when the exchange
                fails; every module keeps its old sharding and state.
        """
        if not self._built or self._executed:
            raise RuntimeError("a dry run, or an executed reshard, cannot execute")
        self._executed = True
        pg = self._env.process_group
        rank = dist.get_rank(pg)
        modules = [m for m in self._modules if m.groups is not None]
        if modules:
            self._exchange(modules, rank)
            for module in modules:
                self._swap(module)
        seconds = time.perf_counter() - self._start
        for module in self._modules:
            module.report.tables_moved = module.moved_tables()
            module.report.tables_rebuilt = list(module.tables)
            module.report.seconds = seconds
            _log(module)
        return {m.path: m.report for m in self._modules}

    def _exchange(self, modules: Sequence[_ModuleReshard], rank: int) -> None:
        pg = self._env.process_group
        timeout = self._options.exchange_timeout
        group = open_exchange_group(pg, self._agreement.transaction, timeout)
        try:
            for module in modules:
                assert module.groups is not None
                wrap_new_lookups(module.adapter, module.groups)
                apply_table_facts(module.groups.new_lookups, module.facts)
                self._fill(module, rank, group)
            # Nobody swaps before everybody filled its new groups.
            dist.barrier(group=group)
        except Exception as e:
            close_exchange_group(group)
            _discard(modules)
            raise ReshardAbortedError(
                f"rank {rank}: the shard exchange failed ({type(e).__name__}: {e}); "
                "every module is unchanged and keeps its old sharding"
            ) from e
        close_exchange_group(group)

    def _fill(
        self, module: _ModuleReshard, rank: int, group: dist.ProcessGroup
    ) -> None:
        """Copies the local pieces and receives the remote ones into the new groups."""
        assert module.groups is not None and module.transfers is not None
        adapter, report, fields = module.adapter, module.report, module.fields
        old_lookups = [
            lookup for t, _, lookup in adapter.groups() if t in module.rebuilt_types
        ]
        old_slots = adapter.local_slots(old_lookups)
        new_slots = adapter.local_slots(module.groups.new_lookups)
        moved = fill_slots(
            module.transfers,
            fields,
            old_slots,
            new_slots,
            rank,
            group,
            self._device or torch.device("cpu"),
            self._options.max_inflight_bytes,
            on_round=_progress_bar(self._options.progress and rank == 0),
        )
        report.tables_kept_in_place += [key[0] for key in moved.kept_in_place]
        report.bytes_kept_in_place += moved.bytes_kept_in_place
        report.bytes_copied_locally += moved.bytes_copied_locally
        report.bytes_sent, report.bytes_received = (
            moved.bytes_sent,
            moved.bytes_received,
        )

    def _swap(self, module: _ModuleReshard) -> None:
        """Installs a module's new groups, retires the old ones, frees memory."""
        groups, hooks = module.groups, module.hooks
        assert groups is not None and hooks is not None
        adapter = module.adapter
        old_lookups = [
            lookup for t, _, lookup in adapter.groups() if t in module.rebuilt_types
        ]
        old_kernels = adapter.kernels(old_lookups)
        adapter.install(groups.infos, groups.shardings, groups.lookups)
        retire_kernels(old_kernels)
        # Nothing of the reshard may hold the old groups when the storage is
        # released: whatever else still references it is somebody else's.
        del old_lookups, old_kernels, groups
        module.groups = None
        module.hooks = None
        module.report.bytes_released = hooks.release(adapter.module)


def _log(module: _ModuleReshard) -> None:
    report = module.report
    logger.info(
        "reshard rank %d%s: moved %s, rebuilt %d tables, sent %d B, received %d B, "
        "copied locally %d B, kept in place %d B, released %d B in %.3f s",
        report.rank,
        f" module '{module.path}'" if module.path else "",
        report.tables_moved,
        len(report.tables_rebuilt),
        report.bytes_sent,
        report.bytes_received,
        report.bytes_copied_locally,
        report.bytes_kept_in_place,
        report.bytes_released,
        report.seconds,
    )


def reshard_module(
    module: nn.Module,
    changed_sharding_params: Mapping[str, ParameterSharding],
    env: ShardingEnv,
    device: Optional[torch.device] = None,
    options: Optional[ReshardOptions] = None,
) -> ReshardReport:
    """
    Reshards a sharded embedding module (``ShardedEmbeddingBagCollection`` or
    ``ShardedEmbeddingCollection``) in place, as one transaction. Every rank of
    the module's process group calls it with the same delta.

    Args:
        module (nn.Module): the sharded module.
        changed_sharding_params (Mapping[str, ParameterSharding]): the new
            ParameterSharding of each table that changes.
        env (ShardingEnv): the module's sharding environment.
        device (Optional[torch.device]): the module's device (default: its own).
        options (Optional[ReshardOptions]): how to run.

    Returns:
        ReshardReport: what this rank did.

    Raises:
        ReshardError: on every rank, before any data moves, for a bad request.
        ReshardAbortedError: on every calling rank when a rank does not join or
            the exchange fails; the module keeps its old sharding and state.
    """
    adapter = adapter_for(module)
    device = device or adapter.device()
    prepared = prepare_reshard(
        [("", adapter, changed_sharding_params)], env, device, options
    )
    return prepared.execute()[""]

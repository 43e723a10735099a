#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A reshard within a process group: one module, or every sharded module of a
model, moved to new shardings as one transaction of the runner (``runner``).

* **agree**: every module's delta is validated (pure, see ``plan``) and its
  new sharding groups derived (groups the delta does not touch keep their
  objects); every rank states the fields, learning rates and step count of the
  tables it holds and its runs of kept shards; the coordinator merges them
  (as large as the tables) and gives the runs their batch keys;
* **build**: the groups that change are built, detached from the module,
  under the transaction's kernel build hooks (``storage``: no initialisation;
  runs of kept shards keep their storage);
* **exchange**: this rank's part of the plan (``plan.plan_rank_transfers``):
  local pieces are copied, the others travel straight into the new kernels'
  weights and fused optimizer state;
* **commit**: each module installs its new groups with its own method; the old
  kernels are retired and their storage released where nobody else can see it.

Until the commit no module is touched: a bad request raises
:class:`ReshardError` and a failure :class:`ReshardAbortedError` on every rank,
and every module is left exactly as it was.
"""

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.resharding.fields import (
    Field,
    merge_table_facts,
    piece_cost,
    TableFacts,
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
from torchrec.distributed.resharding.adapters import adapter_for
from torchrec.distributed.resharding.install import ShardedModuleAdapter
from torchrec.distributed.resharding.kernel_state import (
    batched_kernels,
    keyed_slots,
    slot_io,
)
from torchrec.distributed.resharding.optimizer_state import (
    apply_table_facts,
    local_table_facts,
)
from torchrec.distributed.resharding.options import ReshardOptions, StorageMode
from torchrec.distributed.resharding.plan import (
    bytes_per_rank,
    delta_digest,
    layout_from_parameter_sharding,
    MOVABLE_COMPUTE_KERNELS,
    plan_rank_transfers,
    RankPlan,
    ReshardError,
    TableLayout,
    text_digest,
)
from torchrec.distributed.resharding.runner import (
    ExchangePart,
    Participant,
    PhaseTimes,
    run_transaction,
)
from torchrec.distributed.resharding.storage import (
    batch_keys,
    kept_runs,
    KeptBatchKey,
    KeptGrouping,
    KeptRun,
    KeptStorage,
    key_rebuilt_groups,
    run_facts,
    storage_reuse_supported,
    user_batch_key,
)
from torchrec.distributed.resharding.wire import ExchangeGroup
from torchrec.distributed.types import ParameterSharding, ShardingEnv

logger: logging.Logger = logging.getLogger(__name__)


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
        phases (PhaseTimes): wall time of each phase of the transaction.
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
    phases: PhaseTimes = field(default_factory=PhaseTimes)


@dataclass
class DryRunReport:
    """
    What a reshard would move, computed without building or moving anything.

    Args:
        deltas (Dict[str, Dict[str, ParameterSharding]]): per module path, the
            changed tables with their new sharding.
        bytes_sent (Dict[int, int]): per rank, bytes it would send.
        bytes_received (Dict[int, int]): per rank, bytes it would receive.
        tables_moved (Dict[str, List[str]]): per module path, the tables whose
            layout changes.
        phases (PhaseTimes): the time the dry run took (its agreement).
    """

    deltas: Dict[str, Dict[str, ParameterSharding]]
    bytes_sent: Dict[int, int]
    bytes_received: Dict[int, int]
    tables_moved: Dict[str, List[str]] = field(default_factory=dict)
    phases: PhaseTimes = field(default_factory=PhaseTimes)

    @property
    def tables(self) -> Dict[str, List[str]]:
        return {path: sorted(delta) for path, delta in self.deltas.items()}


def table_key(path: str, table: str) -> str:
    """The name of a module's table within a transaction: "path:table"."""
    return f"{path}:{table}"


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
    runs: List[KeptRun] = field(default_factory=list)
    hooks: Optional[KeptStorage] = None
    groups: Optional[NewGroups] = None

    def key(self, table: str) -> str:
        return table_key(self.path, table)

    def moved_tables(self) -> List[str]:
        return [t for t in self.tables if self.old_layouts[t] != self.new_layouts[t]]

    def old_lookups(self) -> List[nn.Module]:
        return [
            lookup
            for sharding_type, _, lookup in self.adapter.groups()
            if sharding_type in self.rebuilt_types
        ]


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
    return _ModuleReshard(
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


def _request_digest(requests: Sequence[Tuple[str, ShardedModuleAdapter, Any]]) -> int:
    parts = []
    for path, _, delta in requests:
        try:
            parts.append(f"{path}={delta_digest(delta)}")
        except Exception:  # not a delta at all: validation reports it
            parts.append(f"{path}?{type(delta).__name__}")
    return text_digest("\n".join(parts))


@dataclass(frozen=True)
class _RankFacts:
    """What a rank tells the coordinator: its tables' facts and kept runs."""

    tables: TableFacts
    runs: Dict[str, List[List[str]]]


@dataclass(frozen=True)
class _Decision:
    """What every rank gets back: the merged facts and the runs' batch keys."""

    tables: TableFacts
    keys: Dict[str, Dict[str, KeptBatchKey]]


class ModuleReshard(Participant):
    """
    This rank's part of a reshard of one or more modules of one process group,
    each by its delta. Every rank of the group runs it with the same requests.

    Args:
        requests (Sequence[Tuple[str, ShardedModuleAdapter, Mapping[str, ParameterSharding]]]):
            (module path, module adapter, delta) per module, in the same order
            on every rank.
        env (ShardingEnv): the modules' sharding environment.
        device (Optional[torch.device]): the modules' device.
        options (ReshardOptions): how to run.
    """

    kind = "reshard"

    def __init__(
        self,
        requests: Sequence[
            Tuple[str, ShardedModuleAdapter, Mapping[str, ParameterSharding]]
        ],
        env: ShardingEnv,
        device: Optional[torch.device],
        options: ReshardOptions,
    ) -> None:
        self._requests = list(requests)
        self._env = env
        self._device = device
        self._options = options
        self._modules: List[_ModuleReshard] = []
        self._decision: Optional[_Decision] = None
        self._fields: Dict[str, Tuple[Field, ...]] = {}
        self._old: Dict[str, TableLayout] = {}
        self._new: Dict[str, TableLayout] = {}
        self._plan: Optional[RankPlan] = None
        self._kept_in_place: Set[Tuple[str, Any]] = set()

    # ------------------------------------------------------------- the agree

    def ranks(self) -> List[int]:
        return dist.get_process_group_ranks(self._env.process_group)

    def digest(self) -> int:
        return _request_digest(self._requests)

    def _rank(self) -> int:
        return dist.get_rank(self._env.process_group)

    def requests(
        self,
    ) -> List[Tuple[str, ShardedModuleAdapter, Mapping[str, ParameterSharding]]]:
        """The modules and their deltas (validated by :meth:`prepare`)."""
        return self._requests

    def prepare(self) -> _RankFacts:
        where = ""
        for path, adapter, delta in self.requests():
            where = f"module '{path}': " if path else ""
            try:
                self._modules.append(
                    _prepare_module(path, adapter, delta, self._env, self._device)
                )
            except ReshardError as e:
                raise ReshardError(f"{where}{e}") from None
            except Exception as e:  # the base refusing a layout, ...
                raise ReshardError(
                    f"{where}building the new sharding failed: {type(e).__name__}: {e}"
                ) from None
        facts = [
            local_table_facts(m.adapter.lookups(), m.tables).renamed(
                {t: m.key(t) for t in m.tables}
            )
            for m in self._modules
        ]
        runs: Dict[str, List[List[str]]] = {}
        if self._keeps_storage():
            for m in self._modules:
                m.runs = _module_runs(m)
            runs = run_facts([r for m in self._modules for r in m.runs])
        return _RankFacts(merge_table_facts(facts), runs)

    def _keeps_storage(self) -> bool:
        return self._options.storage == StorageMode.REUSE and storage_reuse_supported(
            self._device
        )

    def merge(self, facts: Sequence[_RankFacts]) -> _Decision:
        placements = {m.path: _placements(m, len(facts)) for m in self._modules}
        user_keys = {
            m.path: {
                info.embedding_config.name: user_batch_key(info.fused_params)
                for infos in m.infos.values()
                for info in infos
            }
            for m in self._modules
        }
        keys = batch_keys(
            [(rank, f.runs) for rank, f in enumerate(facts) if f.runs],
            placements,
            user_keys,
        )
        return _Decision(merge_table_facts([f.tables for f in facts]), keys)

    def agreed(self, merged: _Decision) -> None:
        self._decision = merged
        for m in self._modules:
            for t in m.tables:
                key = m.key(t)
                self._fields[key] = merged.tables.fields_of(key)
                self._old[key] = m.old_layouts[t]
                self._new[key] = m.new_layouts[t]

    def dry_run(self) -> DryRunReport:
        costs = {key: piece_cost(f) for key, f in self._fields.items()}
        sent, received = bytes_per_rank(self._old, self._new, costs)
        world_size = len(self.ranks())
        return DryRunReport(
            {m.path: dict(m.delta) for m in self._modules},
            {r: sent.get(r, 0) for r in range(world_size)},
            {r: received.get(r, 0) for r in range(world_size)},
            {m.path: m.moved_tables() for m in self._modules if m.moved_tables()},
        )

    # ------------------------------------------------------------- the build

    def build(self) -> None:
        assert self._decision is not None
        for m in self._modules:
            if not m.rebuilt_types:
                continue
            adapter = m.adapter
            keys = {m.path: self._decision.keys.get(m.path, {})}
            m.hooks = KeptStorage(
                old_kernels_of(adapter, m.rebuilt_types),
                m.runs,
                keys,
                reuse=self._keeps_storage(),
            )
            m.runs = []  # the hooks hold the old kernels until they release
            grouping = KeptGrouping(
                keys, {m.path: {c.name: i.param for c, i in _configs_and_infos(m)}}
            )
            key_rebuilt_groups(m.infos, m.rebuilt_types, grouping)
            m.groups = build_groups(
                adapter, m.infos, m.rebuilt_types, self._env, self._device, m.hooks
            )
            check_built_layouts(m.groups, m.new_layouts, self._rank())

    # ---------------------------------------------------------- the exchange

    def _built(self) -> List[_ModuleReshard]:
        return [m for m in self._modules if m.groups is not None]

    def before_exchange(self, group: ExchangeGroup) -> None:
        assert self._decision is not None
        for m in self._built():
            assert m.groups is not None
            wrap_new_lookups(m.adapter, m.groups)
            apply_table_facts(
                m.groups.new_lookups,
                _module_facts(self._decision.tables, m),
            )

    def exchange_part(self) -> ExchangePart:
        old_slots, new_slots = {}, {}
        for m in self._built():
            assert m.groups is not None
            key = m.key
            old_slots.update(keyed_slots(m.adapter.local_slots(m.old_lookups()), key))
            new_slots.update(
                keyed_slots(m.adapter.local_slots(m.groups.new_lookups), key)
            )
        built = {m.key(t) for m in self._built() for t in m.tables}
        old = {k: v for k, v in self._old.items() if k in built}
        new = {k: v for k, v in self._new.items() if k in built}
        self._plan = plan_rank_transfers(old, new, self._rank())
        fields = {k: self._fields[k] for k in old}
        io = slot_io(old_slots, new_slots, fields)
        self._kept_in_place = set(io.in_place)
        return ExchangePart(self._plan, fields, io)

    # ------------------------------------------------------ commit and abort

    def commit(self) -> None:
        for m in self._built():
            _swap(m)

    def abort(self) -> None:
        for m in self._modules:
            m.runs = []
            if m.groups is not None:
                retire_kernels(m.groups.new_kernels())
            m.groups = None
            m.hooks = None

    def device(self) -> torch.device:
        return self._device or torch.device("cpu")

    def unchanged(self) -> str:
        return "every module is unchanged and keeps its old sharding"

    # ------------------------------------------------------------- reporting

    def reports(self, phases: PhaseTimes) -> Dict[str, ReshardReport]:
        """Per module path, what this rank did."""
        per_table = _bytes_by_table(self._plan, self._fields)
        for m in self._modules:
            report = m.report
            report.tables_moved = m.moved_tables()
            report.tables_rebuilt = list(m.tables)
            keys = {m.key(t): t for t in m.tables}
            for key, (sent, received, copied) in per_table.items():
                if key in keys:
                    report.bytes_sent += sent
                    report.bytes_received += received
                    report.bytes_copied_locally += copied
            for key, rect in sorted(self._kept_in_place, key=str):
                if key in keys:
                    nbytes = piece_cost(self._fields[key]).of(rect)
                    report.tables_kept_in_place.append(keys[key])
                    report.bytes_kept_in_place += nbytes
                    report.bytes_copied_locally -= nbytes  # counted as a local piece
            report.phases = phases
            report.seconds = phases.total
            _log(m)
        return {m.path: m.report for m in self._modules}


def _configs_and_infos(
    m: _ModuleReshard,
) -> List[Tuple[Any, EmbeddingShardingInfo]]:
    return [
        (info.embedding_config, info) for infos in m.infos.values() for info in infos
    ]


def _module_runs(m: _ModuleReshard) -> List[KeptRun]:
    """This rank's runs of kept shards in the module's rebuilt groups."""
    if not m.rebuilt_types:
        return []
    kept = {t for t in m.tables if t not in m.delta}
    groups = {
        (m.path, sharding_type): list(batched_kernels(lookup))
        for sharding_type, _, lookup in m.adapter.groups()
        if sharding_type in m.rebuilt_types
    }
    return kept_runs(groups, {m.path: kept})


def _placements(
    m: _ModuleReshard, world_size: int
) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Each table's sharding type and ranks under the module's new plan."""
    out = {}
    for infos in m.infos.values():
        for info in infos:
            ps = info.param_sharding
            ranks = tuple(ps.ranks) if ps.ranks else tuple(range(world_size))
            out[info.embedding_config.name] = (ps.sharding_type, ranks)
    return out


def _module_facts(facts: TableFacts, m: _ModuleReshard) -> TableFacts:
    """The merged facts of one module's tables, by plain table name."""
    names = {m.key(t): t for t in m.tables}
    return TableFacts(
        {names[k]: f for k, f in facts.fields.items() if k in names},
        {names[k]: lr for k, lr in facts.learning_rates.items() if k in names},
        facts.optimizer_iter,
    )


def _bytes_by_table(
    plan: Optional[RankPlan], fields: Mapping[str, Sequence[Field]]
) -> Dict[str, Tuple[int, int, int]]:
    """Per table, the bytes this rank sent, received and copied locally."""
    out: Dict[str, List[int]] = {}
    if plan is None:
        return {}
    for column, transfers in enumerate((plan.sends, plan.receives, plan.local_copies)):
        for t in transfers:
            counts = out.setdefault(t.table, [0, 0, 0])
            counts[column] += piece_cost(fields[t.table]).of(t.rect)
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def _swap(module: _ModuleReshard) -> None:
    """Installs a module's new groups, retires the old ones, frees memory."""
    groups, hooks = module.groups, module.hooks
    assert groups is not None and hooks is not None
    adapter = module.adapter
    old_lookups = module.old_lookups()
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
        "copied locally %d B, kept in place %d B, released %d B in %.3f s "
        "(agree %.3f, build %.3f, exchange %.3f, commit %.3f)",
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
        report.phases.agree,
        report.phases.build,
        report.phases.exchange,
        report.phases.commit,
    )


def reshard_modules(
    requests: Sequence[
        Tuple[str, ShardedModuleAdapter, Mapping[str, ParameterSharding]]
    ],
    env: ShardingEnv,
    device: Optional[torch.device] = None,
    options: Optional[ReshardOptions] = None,
) -> Tuple[Dict[str, ReshardReport], PhaseTimes]:
    """
    Reshards one or more sharded modules of one process group as one
    transaction. Every rank of the group calls it with the same requests.

    Args:
        requests (Sequence[Tuple[str, ShardedModuleAdapter, Mapping[str, ParameterSharding]]]):
            (module path, module adapter, delta) per module.
        env (ShardingEnv): the modules' sharding environment.
        device (Optional[torch.device]): the modules' device.
        options (Optional[ReshardOptions]): how to run.

    Returns:
        Tuple[Dict[str, ReshardReport], PhaseTimes]: what this rank did per
        module path, and the transaction's phase times.

    Raises:
        ReshardError: on every rank, for a bad request (naming the module,
            table and reason); nothing moved.
        ReshardAbortedError: on every calling rank when a rank does not join
            or the exchange fails; every module keeps its old sharding.
    """
    options = options or ReshardOptions()
    participant = ModuleReshard(requests, env, device, options)
    outcome = run_transaction(participant, options)
    return participant.reports(outcome.phases), outcome.phases


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
    reports, _ = reshard_modules(
        [("", adapter, changed_sharding_params)], env, device, options
    )
    return reports[""]

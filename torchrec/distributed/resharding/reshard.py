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
  runs of kept shards keep their storage, ``kept_grouping``), and the order
  in which each module will list its outputs;
* **exchange**: the runner plans this rank's part; local pieces are copied,
  the others travel straight into the new kernels' weights and fused
  optimizer state;
* **commit**: each module installs its new groups with its own method; the old
  kernels are retired and their storage released where nobody else can see it.

Until the commit no module is touched: a bad request raises
:class:`ReshardError` and a failure :class:`ReshardAbortedError` on every rank,
and every module is left exactly as it was.
"""

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.resharding.device_memory import placement_of
from torchrec.distributed.resharding.devices import normalized_device
from torchrec.distributed.resharding.exchange_group import ExchangeGroup
from torchrec.distributed.resharding.fields import (
    merge_table_facts,
    table_key,
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
from torchrec.distributed.resharding.kept_grouping import (
    direct_output_order,
    KeptBatchKey,
    key_rebuilt_groups,
    user_batch_key,
)
from torchrec.distributed.resharding.kept_step import KeptStorageStep, RunFacts
from torchrec.distributed.resharding.kernel_state import (
    batched_kernels,
    invalidate_caches,
)
from torchrec.distributed.resharding.module_adapters import (
    adapter_for,
    ShardedModuleAdapter,
)
from torchrec.distributed.resharding.optimizer_state import (
    apply_table_facts,
    local_table_facts,
)
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import (
    layout_from_parameter_sharding,
    ReshardError,
    TableLayout,
)
from torchrec.distributed.resharding.plan_validation import (
    delta_digest,
    MOVABLE_COMPUTE_KERNELS,
)
from torchrec.distributed.resharding.runner import (
    described,
    Participant,
    run_transaction,
    Slots,
    TransactionLayouts,
)
from torchrec.distributed.resharding.slots import keyed_slots
from torchrec.distributed.resharding.transaction_report import TransactionReport
from torchrec.distributed.types import ParameterSharding, ShardingEnv


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
    kept: KeptStorageStep = field(default_factory=lambda: KeptStorageStep(False))
    groups: Optional[NewGroups] = None
    output_order: Optional[List[str]] = None

    def key(self, table: str) -> str:
        return table_key(self.path, table)

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
    world_size = dist.get_world_size(env.process_group)
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
    )


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


class ModuleReshard(Participant[_RankFacts, _Decision]):
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
        self._device: Optional[torch.device] = (
            normalized_device(device) if device is not None else None
        )
        self._options = options
        self._modules: List[_ModuleReshard] = []
        self._decision: Optional[_Decision] = None

    # ------------------------------------------------------------- the agree

    def ranks(self) -> List[int]:
        return dist.get_process_group_ranks(self._env.process_group)

    def request(self) -> List[str]:
        return [
            f"{path}={described(lambda d: str(delta_digest(d)), delta)}"
            for path, _, delta in self._requests
        ]

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
        runs: RunFacts = {}
        for m in self._modules:
            m.kept = KeptStorageStep.for_options(self._options, self._device)
            runs.update(_find_module_runs(m))
        return _RankFacts(merge_table_facts(facts), runs)

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
        keys = KeptStorageStep.agree(
            [(rank, f.runs) for rank, f in enumerate(facts) if f.runs],
            placements,
            user_keys,
        )
        return _Decision(merge_table_facts([f.tables for f in facts]), keys)

    def agreed(self, merged: _Decision) -> TransactionLayouts:
        self._decision = merged
        keys = [(m, t, m.key(t)) for m in self._modules for t in m.tables]
        device_type = self.device().type
        placements = {
            m.key(info.embedding_config.name): placement_of(
                info.param_sharding.compute_kernel,
                device_type,
                info.param_sharding.sharding_type,
                info.fused_params,
            )
            for m in self._modules
            for infos in m.infos.values()
            for info in infos
        }
        return TransactionLayouts(
            {key: m.old_layouts[t] for m, t, key in keys},
            {key: m.new_layouts[t] for m, t, key in keys},
            {key: merged.tables.fields_of(key) for _, _, key in keys},
            placements={
                key: placements[key] for _, _, key in keys if key in placements
            },
        )

    def deltas(self) -> Dict[str, Dict[str, ParameterSharding]]:
        return {m.path: dict(m.delta) for m in self._modules}

    # ------------------------------------------------------------- the build

    def build(self) -> None:
        assert self._decision is not None
        for m in self._modules:
            if not m.rebuilt_types:
                continue
            adapter = m.adapter
            keys = {m.path: self._decision.keys.get(m.path, {})}
            hooks, grouping = m.kept.build_hooks(
                old_kernels_of(adapter, m.rebuilt_types),
                keys,
                {m.path: {c.name: i.param for c, i in _configs_and_infos(m)}},
            )
            key_rebuilt_groups(m.infos, m.rebuilt_types, grouping)
            m.groups = build_groups(
                adapter, m.infos, m.rebuilt_types, self._env, self._device, hooks
            )
            check_built_layouts(m.groups, m.new_layouts, self._rank())
            if adapter.positional_output:
                m.output_order = direct_output_order(
                    list(zip(m.groups.shardings, m.groups.infos.values()))
                )

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

    def slots(self) -> Tuple[Slots, Slots]:
        old_slots, new_slots = {}, {}
        for m in self._built():
            assert m.groups is not None
            key = m.key
            old_slots.update(keyed_slots(m.adapter.local_slots(m.old_lookups()), key))
            new_slots.update(
                keyed_slots(m.adapter.local_slots(m.groups.new_lookups), key)
            )
        return old_slots, new_slots

    def after_exchange(self, group: ExchangeGroup) -> None:
        for m in self._built():
            assert m.groups is not None
            invalidate_caches(m.groups.new_lookups)

    # ------------------------------------------------------ commit and abort

    def commit(self) -> int:
        return sum(_swap(m) for m in self._built())

    def abort(self) -> None:
        for m in self._modules:
            m.kept.abort()
            if m.groups is not None:
                retire_kernels(m.groups.new_kernels())
            m.groups = None

    def device(self) -> torch.device:
        return self._device or torch.device("cpu")

    def unchanged(self) -> str:
        return "every module is unchanged and keeps its old sharding"

    def exchange_groups_owner(self) -> Optional[ShardingEnv]:
        return self._env


def _configs_and_infos(
    m: _ModuleReshard,
) -> List[Tuple[Any, EmbeddingShardingInfo]]:
    return [
        (info.embedding_config, info) for infos in m.infos.values() for info in infos
    ]


def _find_module_runs(m: _ModuleReshard) -> RunFacts:
    """This rank's runs of kept shards in the module's rebuilt groups."""
    if not m.rebuilt_types:
        return {}
    kept = {t for t in m.tables if t not in m.delta}
    groups = {
        (m.path, sharding_type): list(batched_kernels(lookup))
        for sharding_type, _, lookup in m.adapter.groups()
        if sharding_type in m.rebuilt_types
    }
    return m.kept.find_runs(groups, {m.path: kept})


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


def _swap(module: _ModuleReshard) -> int:
    """
    Installs a module's new groups, retires the old ones, frees memory; the
    bytes given back to the OS.
    """
    groups = module.groups
    assert groups is not None and module.kept.hooks is not None
    adapter = module.adapter
    old_lookups = module.old_lookups()
    old_kernels = adapter.kernels(old_lookups)
    adapter.install(groups.infos, groups.shardings, groups.lookups, module.output_order)
    retire_kernels(old_kernels)
    # Nothing of the reshard may hold the old groups when the storage is
    # released: whatever else still references it is somebody else's.
    del old_lookups, old_kernels, groups
    module.groups = None
    return module.kept.release([adapter.module])


def reshard_module(
    module: nn.Module,
    changed_sharding_params: Mapping[str, ParameterSharding],
    env: ShardingEnv,
    device: Optional[torch.device] = None,
    options: Optional[ReshardOptions] = None,
) -> TransactionReport:
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
        TransactionReport: what this rank did (the module's path is "").

    Raises:
        ReshardError: on every rank, before any data moves, for a bad request.
        ReshardAbortedError: on every calling rank when a rank does not join or
            the exchange fails; the module keeps its old sharding and state.
    """
    adapter = adapter_for(module)
    options = options or ReshardOptions()
    participant = ModuleReshard(
        [("", adapter, changed_sharding_params)],
        env,
        device or adapter.device(),
        options,
    )
    return run_transaction(participant, options)

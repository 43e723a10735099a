#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Kept storage across a move between groups of ranks.

On a rank that stays, table shards that a move leaves exactly where they are
(the same shards on the same global ranks, the same sharding type and kernel)
need not be copied: the new model's kernels for them are built on the old
kernels' storage, weights and fused optimizer state together, as in a reshard
within one group (``storage``). A fresh build would put a rank's staying and
arriving tables into one kernel, so the move gives the runs of kept shards
batch keys of their own, agreed by every participant (``KernelBuildHooks.
table_fused_params``), at most ``MAX_KERNELS_PER_GROUP`` kernels per sharding
group. Kept pieces are never written during the move, so the old model stays
intact until it is released; then the pages of departed tables go back to the
OS where nobody else references them.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.resharding.install import adapter_for
from torchrec.distributed.resharding.kernel_state import batched_kernels
from torchrec.distributed.resharding.plan import layout_from_parameter_sharding
from torchrec.distributed.resharding.storage import (
    BATCH_KEY,
    KeptStorage,
    MAX_KERNELS_PER_GROUP,
    shard_key,
    ShardKey,
    storage_reuse_supported,
    StorageMode,
)
from torchrec.distributed.resharding.transaction import ReshardOptions
from torchrec.distributed.types import ShardingPlan


@dataclass
class KeptRun:
    """
    Shards of tables whose layout a move leaves as it is, at consecutive
    positions of one old batched kernel of a rank that stays: the new model's
    kernel for them can be built on a view of the old kernel's storage.

    Args:
        path (str): the sharded module's path.
        kernel (nn.Module): the old fbgemm kernel.
        first (int): the position of the first shard in it.
        shards (List[ShardKey]): the shards, in kernel order.
    """

    path: str
    kernel: nn.Module
    first: int
    shards: List[ShardKey]


def _unchanged_tables(
    module: nn.Module,
    path: str,
    old_plan: ShardingPlan,
    new_plan: ShardingPlan,
    old_ranks: Sequence[int],
    new_ranks: Sequence[int],
) -> List[str]:
    """
    Tables of a sharded module that a move leaves exactly where they are: the
    same shards on the same global ranks, the same sharding type and compute
    kernel. Data-parallel tables are left out: building a module broadcasts
    their weights over the new group, which would write into kept storage.
    """
    adapter = adapter_for(module)
    out: List[str] = []
    for config in adapter.configs():
        name = config.name
        old_ps, new_ps = old_plan.plan[path][name], new_plan.plan[path][name]
        if (old_ps.sharding_type, old_ps.compute_kernel) != (
            new_ps.sharding_type,
            new_ps.compute_kernel,
        ):
            continue
        rows, cols = adapter.table_shape(name)
        old = layout_from_parameter_sharding(old_ps, rows, cols, len(old_ranks))
        new = layout_from_parameter_sharding(new_ps, rows, cols, len(new_ranks))
        old = old.remap_ranks(dict(enumerate(old_ranks)))
        new = new.remap_ranks(dict(enumerate(new_ranks)))
        if old == new and not old.replicated:
            out.append(name)
    return out


def kept_runs(
    modules: Mapping[str, nn.Module],
    old_plan: ShardingPlan,
    old_ranks: Sequence[int],
    new_plan: ShardingPlan,
    new_ranks: Sequence[int],
) -> List[KeptRun]:
    """
    On a rank that stays, the runs of kept shards in its old kernels: maximal
    runs of consecutive shards of unchanged tables, at most
    ``MAX_KERNELS_PER_GROUP - 1`` per sharding group (the largest), so that
    a group of the new model has at most ``MAX_KERNELS_PER_GROUP`` kernels.

    Args:
        modules (Mapping[str, nn.Module]): the old model's sharded modules.
        old_plan (ShardingPlan): their plan on the old group.
        old_ranks (Sequence[int]): the old group's global ranks.
        new_plan (ShardingPlan): the plan on the new group.
        new_ranks (Sequence[int]): the new group's global ranks.

    Returns:
        List[KeptRun]: the runs, by module and sharding group.
    """
    out: List[KeptRun] = []
    for path, module in modules.items():
        unchanged = set(
            _unchanged_tables(module, path, old_plan, new_plan, old_ranks, new_ranks)
        )
        if not unchanged:
            continue
        runs: List[KeptRun] = []
        for _, _, lookup in adapter_for(module).groups():
            group_runs: List[Tuple[int, KeptRun]] = []
            for batched in batched_kernels(lookup):
                tables = list(batched.config.embedding_tables)
                position = 0
                while position < len(tables):
                    if tables[position].name not in unchanged:
                        position += 1
                        continue
                    first = position
                    while position < len(tables) and tables[position].name in (
                        unchanged
                    ):
                        position += 1
                    run = tables[first:position]
                    size = sum(t.local_rows * t.local_cols for t in run)
                    shards = [shard_key(t) for t in run]
                    group_runs.append(
                        (size, KeptRun(path, batched.emb_module, first, shards))
                    )
            group_runs.sort(key=lambda x: -x[0])
            runs += [run for _, run in group_runs[: MAX_KERNELS_PER_GROUP - 1]]
        out += runs
    return out


def run_facts(runs: Sequence[KeptRun]) -> Dict[str, List[List[str]]]:
    """
    What the other ranks need of a rank's kept runs: per module, the tables of
    each run (a run's position in its module's list numbers it).
    """
    out: Dict[str, List[List[str]]] = {}
    for run in runs:
        out.setdefault(run.path, []).append([name for name, _ in run.shards])
    return out


def batch_keys(
    union: Sequence[int],
    all_runs: Sequence[Optional[Dict[str, List[List[str]]]]],
    new_plan: ShardingPlan,
    new_ranks: Sequence[int],
) -> Dict[str, Dict[str, str]]:
    """
    The batch key (TorchRec's ``_batch_key`` grouping fused param) of every
    table in a run of kept shards, the same on every rank: the runs it is in
    (rank and number), so the shards of one run get a kernel of their own on
    its rank and the tables of each new rank group alike everywhere. A module's
    sharding group that would get more than ``MAX_KERNELS_PER_GROUP`` kernels
    on a rank gets no keys (one kernel, kept tables copied).

    Returns:
        Dict[str, Dict[str, str]]: module path -> table -> batch key suffix.
    """
    runs: Dict[str, Dict[str, List[str]]] = {}
    for rank, rank_runs in zip(union, all_runs):
        for path, path_runs in sorted((rank_runs or {}).items()):
            for index, tables in enumerate(path_runs):
                for table in tables:
                    ids = runs.setdefault(path, {}).setdefault(table, [])
                    if f"{rank}.{index}" not in ids:
                        ids.append(f"{rank}.{index}")
    keys: Dict[str, Dict[str, str]] = {}
    for path, tables in sorted(runs.items()):
        path_keys = {
            table: f"#move:{path}:{'+'.join(sorted(ids))}"
            for table, ids in tables.items()
        }
        # kernels per (sharding type, new group-local rank)
        kernels: Dict[Tuple[str, int], Set[str]] = {}
        for table, ps in new_plan.plan[path].items():
            for rank in set(ps.ranks or range(len(new_ranks))):
                kernels.setdefault((ps.sharding_type, rank), set()).add(
                    path_keys.get(table, "")
                )
        crowded = {
            sharding_type
            for (sharding_type, _), ks in kernels.items()
            if len(ks) > MAX_KERNELS_PER_GROUP
        }
        keys[path] = {
            table: key
            for table, key in path_keys.items()
            if new_plan.plan[path][table].sharding_type not in crowded
        }
    return keys


class MoveStorage(KeptStorage):
    """
    The kernel build hooks of a model built by a move: kernels skip their
    initialisation (every byte is moved in), tables in runs of kept shards
    get the agreed batch keys, and on a rank that stays the kernel of each such
    run is built on a view of the old kernel's storage (nothing copied, the
    old model unchanged: a move never writes kept pieces). Sharded modules make
    their tables' ShardedTensors from the agreed plan, without a collective
    per table.
    :meth:`KeptStorage.release` afterwards gives back the pages of departed
    tables that nobody references.

    Args:
        weights (Mapping[str, Mapping[str, torch.Tensor]]): module path ->
            table -> its weight in the definition the new model is built from,
            for every table in ``keys``.
        keys (Mapping[str, Mapping[str, str]]): module path -> table -> batch
            key suffix (the same on every rank).
        runs (Sequence[KeptRun]): this rank's runs of kept shards (none on a
            rank that joins).
        old_batched (Sequence[nn.Module]): the old model's batched kernels.
    """

    def __init__(
        self,
        weights: Mapping[str, Mapping[str, torch.Tensor]],
        keys: Mapping[str, Mapping[str, str]],
        runs: Sequence[KeptRun],
        old_batched: Sequence[nn.Module],
    ) -> None:
        super().__init__(old_batched, set(), reuse=bool(runs))
        # each table's parameter in the definition and its batch key: the hook
        # gets the parameter, and table names repeat across modules
        self._keys: List[Tuple[torch.Tensor, str]] = [
            (weights[path][table], key)
            for path, table_keys in keys.items()
            for table, key in table_keys.items()
        ]
        # batch key -> (old kernel, first position, shards) of each kept run
        self._runs: Dict[str, List[Tuple[nn.Module, int, List[ShardKey]]]] = {}
        for run in runs:
            table_keys = keys.get(run.path, {})
            start = 0
            for i in range(1, len(run.shards) + 1):
                key = table_keys.get(run.shards[start][0])
                if i < len(run.shards) and table_keys.get(run.shards[i][0]) == key:
                    continue
                if key is not None:
                    self._runs.setdefault(key, []).append(
                        (run.kernel, run.first + start, run.shards[start:i])
                    )
                start = i

    def table_fused_params(
        self, table: str, param: torch.Tensor, fused_params: Dict[str, Any]
    ) -> Dict[str, Any]:
        key = next((k for p, k in self._keys if p is param), None)
        if key is None:
            return fused_params
        out = dict(fused_params)
        out[BATCH_KEY] = f"{out.get(BATCH_KEY, '')}{key}"
        return out

    def sharded_tensors_from_plan(self) -> bool:
        # the plan is agreed and validated: no collective per table is needed
        return True

    def _kept_run(
        self, config: GroupedEmbeddingConfig, kernel_type: type
    ) -> Optional[Tuple[nn.Module, int, int]]:
        tables = list(config.embedding_tables)
        keys = {str((t.fused_params or {}).get(BATCH_KEY, "")) for t in tables}
        if len(keys) != 1:
            return None
        key = keys.pop().rpartition("#move:")
        shards = [shard_key(t) for t in tables]
        for kernel, first, run in self._runs.get("#move:" + key[2], []):
            if run == shards and type(kernel) is kernel_type:
                return kernel, first, len(shards)
        return None

    def release(self, module: nn.Module) -> int:
        self._runs = {}  # the old kernels must not count as holders
        return super().release(module)


def may_keep_storage(
    model: nn.Module, device: torch.device, options: ReshardOptions
) -> bool:
    """Whether the new model on this rank may take over the old one's storage."""
    return (
        options.storage == StorageMode.REUSE
        and device == model.device
        and storage_reuse_supported(device)
    )


def old_batched(modules: Mapping[str, nn.Module]) -> List[nn.Module]:
    """The batched kernels of sharded modules."""
    return [
        batched
        for module in modules.values()
        for lookup in adapter_for(module).lookups()
        for batched in batched_kernels(lookup)
    ]


def release_kept_storage(hooks: KeptStorage, modules: Mapping[str, nn.Module]) -> int:
    """
    Once the old model is released: gives the pages of departed tables in
    storage that kept tables share back to the OS, where nobody but the new
    model's sharded modules (kernels, fused optimizers, state-dict views)
    references it; what else references it counts as a caller's.

    Args:
        hooks (KeptStorage): the hooks the new model was built under.
        modules (Mapping[str, nn.Module]): the new model's sharded modules.

    Returns:
        int: resident bytes given back.
    """
    return hooks.release(nn.ModuleList(modules.values()))

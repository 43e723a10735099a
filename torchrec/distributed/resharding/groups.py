#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Building the sharding groups of a module after a reshard, detached from the
module: the new sharding infos (grouped by sharding type, in the order the
module's ``__init__`` uses), which groups change, and new shardings and lookups
for those (under the reshard's kernel build hooks). Groups the
reshard does not touch keep their sharding and lookup objects.
"""

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torchrec.distributed.batched_embedding_kernel import (
    kernel_build_hooks,
    KernelBuildHooks,
)
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embeddingbag import table_fused_params
from torchrec.distributed.resharding.kernel_state import batched_kernels, local_slots
from torchrec.distributed.resharding.module_adapters import ShardedModuleAdapter
from torchrec.distributed.resharding.plan import Rect, ReshardError, TableLayout
from torchrec.distributed.resharding.plan_validation import describe_parameter_sharding
from torchrec.distributed.types import ParameterSharding, ShardingEnv


@dataclass
class NewGroups:
    """
    The sharding groups of a module after the reshard, not yet installed.

    Args:
        infos (OrderedDict[str, List[EmbeddingShardingInfo]]): tables per
            sharding type, in group order.
        shardings (List[Any]): a sharding per group (kept or new).
        lookups (List[nn.Module]): a lookup per group (kept or new; new
            data-parallel ones are wrapped once every rank agreed).
        new_lookups (List[nn.Module]): the lookups built for this reshard.
    """

    infos: "OrderedDict[str, List[EmbeddingShardingInfo]]"
    shardings: List[Any]
    lookups: List[nn.Module]
    new_lookups: List[nn.Module]

    def new_kernels(self) -> List[nn.Module]:
        """The batched kernels of the new lookups."""
        return [b for lookup in self.new_lookups for b in batched_kernels(lookup)]


def infos_for_plan(
    adapter: ShardedModuleAdapter, new_plan: Mapping[str, ParameterSharding]
) -> "OrderedDict[str, List[EmbeddingShardingInfo]]":
    """
    The module's sharding infos under a new plan: the same grouping, order and
    fused params as the module's ``__init__`` (sharding types in order of their
    first table, tables in config order; a table's kernel options come from its
    new ParameterSharding). A table whose sharding does not change keeps its
    info object.

    Args:
        adapter (ShardedModuleAdapter): the module.
        new_plan (Mapping[str, ParameterSharding]): every table's new sharding.

    Returns:
        OrderedDict[str, List[EmbeddingShardingInfo]]: tables per sharding type.
    """
    old_infos = {
        info.embedding_config.name: info
        for infos in adapter.sharding_infos().values()
        for info in infos
    }
    grouped: "OrderedDict[str, List[EmbeddingShardingInfo]]" = OrderedDict()
    for config in adapter.configs():
        old = old_infos[config.name]
        ps = new_plan[config.name]
        if ps is old.param_sharding:
            info = old
        else:
            # what the module's __init__ would give the table under ``ps``
            fused_params = table_fused_params(
                copy.deepcopy(adapter.sharder_fused_params()), old.param, ps
            )
            info = EmbeddingShardingInfo(
                embedding_config=copy.deepcopy(old.embedding_config),
                # the module keeps a copy: the caller's plan is the caller's
                param_sharding=copy.deepcopy(ps),
                param=old.param,
                fused_params=fused_params,
            )
        grouped.setdefault(ps.sharding_type, []).append(info)
    return grouped


def _group_signature(infos: Sequence[EmbeddingShardingInfo]) -> List[Tuple[str, str]]:
    return [
        (info.embedding_config.name, describe_parameter_sharding(info.param_sharding))
        for info in infos
    ]


def changed_types(
    adapter: ShardedModuleAdapter,
    new_infos: Mapping[str, Sequence[EmbeddingShardingInfo]],
) -> List[str]:
    """
    Args:
        adapter (ShardedModuleAdapter): the module.
        new_infos (Mapping[str, Sequence[EmbeddingShardingInfo]]): its infos
            after the reshard.

    Returns:
        List[str]: the sharding types whose group gains, loses or changes a
        table (in group order), then those whose group goes away.
    """
    old = {t: _group_signature(infos) for t, infos in adapter.sharding_infos().items()}
    changed = [
        t for t, infos in new_infos.items() if old.get(t) != _group_signature(infos)
    ]
    return changed + [t for t in old if t not in new_infos]


def rebuilt_tables(
    adapter: ShardedModuleAdapter,
    new_infos: Mapping[str, Sequence[EmbeddingShardingInfo]],
    rebuilt_types: Sequence[str],
) -> List[str]:
    """
    Args:
        adapter (ShardedModuleAdapter): the module.
        new_infos (Mapping[str, Sequence[EmbeddingShardingInfo]]): its infos
            after the reshard.
        rebuilt_types (Sequence[str]): sharding types whose group is rebuilt.

    Returns:
        List[str]: every table of a rebuilt group, in config order.
    """
    rebuilt = {
        info.embedding_config.name
        for t in rebuilt_types
        for info in new_infos.get(t, [])
    }
    return [c.name for c in adapter.configs() if c.name in rebuilt]


def old_kernels_of(
    adapter: ShardedModuleAdapter, rebuilt_types: Sequence[str]
) -> List[nn.Module]:
    """The batched kernels of the groups a reshard rebuilds."""
    return [
        batched
        for sharding_type, _, lookup in adapter.groups()
        if sharding_type in rebuilt_types
        for batched in batched_kernels(lookup)
    ]


def build_groups(
    adapter: ShardedModuleAdapter,
    new_infos: "OrderedDict[str, List[EmbeddingShardingInfo]]",
    rebuilt_types: Sequence[str],
    env: ShardingEnv,
    device: Optional[torch.device],
    hooks: KernelBuildHooks,
) -> NewGroups:
    """
    New shardings and lookups for the rebuilt groups, built under the reshard's
    kernel build hooks; the other groups keep theirs.

    Args:
        adapter (ShardedModuleAdapter): the module.
        new_infos (OrderedDict[str, List[EmbeddingShardingInfo]]): its infos
            after the reshard.
        rebuilt_types (Sequence[str]): sharding types whose group is rebuilt.
        env (ShardingEnv): the module's sharding environment.
        device (Optional[torch.device]): the module's device.
        hooks (KernelBuildHooks): the kernel build hooks.

    Returns:
        NewGroups: the groups, not installed.
    """
    current = {t: (sharding, lookup) for t, sharding, lookup in adapter.groups()}
    groups = NewGroups(new_infos, [], [], [])
    with kernel_build_hooks(hooks):
        for sharding_type, infos in new_infos.items():
            if sharding_type not in rebuilt_types:
                sharding, lookup = current[sharding_type]
            else:
                sharding = adapter.create_sharding(infos, env, device)
                lookup = sharding.create_lookup()
                groups.new_lookups.append(lookup)
            groups.shardings.append(sharding)
            groups.lookups.append(lookup)
    return groups


def wrap_new_lookups(adapter: ShardedModuleAdapter, groups: NewGroups) -> None:
    """
    Wraps the new lookups as the module's ``__init__`` does (DDP for data
    parallel). DDP's constructor is a collective: call it only once every rank
    agreed to go ahead.

    Args:
        adapter (ShardedModuleAdapter): the module.
        groups (NewGroups): the new groups; changed in place.

    Returns:
        None
    """
    new_ids = {id(lookup) for lookup in groups.new_lookups}
    for i, (sharding_type, lookup) in enumerate(zip(groups.infos, groups.lookups)):
        if id(lookup) in new_ids:
            groups.lookups[i] = adapter.wrap_lookup(sharding_type, lookup)


def check_built_layouts(
    groups: NewGroups, layouts: Mapping[str, TableLayout], rank: int
) -> None:
    """
    The rebuilt lookups must hold exactly the shards the new plan gives this
    rank; TorchRec's shardings impose rules of their own (e.g. row-wise puts
    the i-th shard on rank i), and a plan they cannot honour is refused here.

    Args:
        groups (NewGroups): the built groups.
        layouts (Mapping[str, TableLayout]): every rebuilt table's new layout.
        rank (int): this rank, group-local.

    Returns:
        None

    Raises:
        ReshardError: naming the table.
    """
    built: Dict[str, List[Rect]] = {}
    for table, rect in local_slots(groups.new_lookups):
        built.setdefault(table, []).append(rect)
    for table, layout in layouts.items():
        expected = sorted(s.rect for s in layout.shards_on(rank))
        if sorted(built.get(table, [])) != expected:
            raise ReshardError(
                f"table '{table}': TorchRec's sharding cannot place its shards as "
                f"requested (rank {rank} would hold {sorted(built.get(table, []))}, "
                f"the plan says {expected})"
            )


def retire_kernels(kernels: Sequence[nn.Module]) -> None:
    """
    Breaks the reference cycles of kernels nobody will use again (the old
    kernels of rebuilt groups after the swap, or new ones of a reshard that
    did not go through), so their memory goes as soon as they are dropped.

    Args:
        kernels (Sequence[nn.Module]): TorchRec batched kernels.

    Returns:
        None
    """
    for kernel in kernels:
        kernel.break_reference_cycles()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: the plan a model recovers to on its survivors.

Every survivor computes the same plan from the old plan and the lost ranks:

* a table-wise, column-wise or table-column-wise shard of a survivor stays
  on it (renumbered in the survivors' group): nothing of it moves;
* a lost shard of those kinds goes to the survivor that holds the fewest
  bytes so far (largest shards first; a survivor without a shard of the
  same table first; ties to the lowest rank), as the rebalancer's placement
  writes shards onto ranks (``rebalance.placement.sharding_for_layout``);
* a row-wise table is split anew over the survivors, as TorchRec splits it
  (its row blocks follow the group size: survivors' rows move among them);
* a data-parallel table stays data-parallel: every survivor holds it.

Table-row-wise and grid tables need whole hosts, and a sharded table of a
dense kernel keeps its optimizer state in its rank's own dense optimizer:
both are refused up front (:func:`check_recoverable`).
"""

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Sequence, Tuple

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.plan import (
    layout_from_parameter_sharding,
    PlacedShard,
    Rect,
    ReshardError,
    TableLayout,
)
from torchrec.distributed.resharding.rebalance.placement import sharding_for_layout
from torchrec.distributed.resharding.whole_plan import (
    module_plan,
    plan_layouts,
    plan_of,
    TableShape,
)
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)

# sharding types whose shards stay on their survivor; a lost one is placed
IN_PLACE_TYPES: Tuple[str, ...] = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
)
RECOVERABLE_TYPES: Tuple[str, ...] = IN_PLACE_TYPES + (
    ShardingType.ROW_WISE.value,
    ShardingType.DATA_PARALLEL.value,
)
# the kernels whose optimizer state lives with the shard (a sharded table of
# a dense kernel is trained by each rank's own dense optimizer: its state is
# on that rank alone, and the dense optimizers of the ranks differ)
FUSED_KERNELS: Tuple[str, ...] = (
    EmbeddingComputeKernel.FUSED.value,
    EmbeddingComputeKernel.FUSED_UVM.value,
    EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
)


@dataclass(frozen=True)
class LostShard:
    """
    A shard a lost rank held (of a table that is not data-parallel).

    Args:
        key (str): its table, "module path:table".
        rect (Rect): the part of the table.
        rank (int): the lost rank's global rank.
    """

    key: str
    rect: Rect
    rank: int


@dataclass(frozen=True)
class RecoveryPlan:
    """
    Where a model's tables go on its survivors.

    Args:
        plan (ShardingPlan): the plan on the survivors' group (its ranks).
        survivors (Tuple[int, ...]): the survivors' global ranks, ascending
            (group rank ``i`` is ``survivors[i]``).
        lost (Tuple[LostShard, ...]): the lost ranks' shards, by table.
        replicated (Tuple[str, ...]): the data-parallel tables (a replica
            of each survives on every survivor).
        new_layouts (Dict[str, TableLayout]): every table's layout under
            ``plan``, in global ranks.
        lost_ranks (Tuple[int, ...]): the old group's ranks not among the
            survivors (global ranks, ascending).
    """

    plan: ShardingPlan
    survivors: Tuple[int, ...]
    lost: Tuple[LostShard, ...]
    replicated: Tuple[str, ...]
    new_layouts: Dict[str, TableLayout]
    lost_ranks: Tuple[int, ...] = ()

    def lost_tables(self) -> List[str]:
        """The tables that lost a shard, in order."""
        return sorted({shard.key for shard in self.lost})


def check_recoverable(plan: ShardingPlan) -> None:
    """
    Refuses, before anything fails, a plan with tables a recovery cannot
    place on any set of survivors.

    Args:
        plan (ShardingPlan): the model's plan.

    Raises:
        ReshardError: naming the module, the table and its sharding type.
    """
    for path in sorted(plan.plan):
        for name, ps in sorted(module_plan(plan, path).items()):
            if ps.sharding_type not in RECOVERABLE_TYPES:
                raise ReshardError(
                    f"module '{path}': table '{name}' is {ps.sharding_type}, which "
                    "needs whole hosts: a job that survives a lost rank shards "
                    f"its tables {', '.join(RECOVERABLE_TYPES)}"
                )
            if (
                ps.sharding_type != ShardingType.DATA_PARALLEL.value
                and ps.compute_kernel not in FUSED_KERNELS
            ):
                raise ReshardError(
                    f"module '{path}': table '{name}' is {ps.sharding_type} with "
                    f"the '{ps.compute_kernel}' kernel, which each rank's own dense "
                    "optimizer trains: its state would be lost with the rank; a job "
                    "that survives a lost rank shards its tables with a fused kernel "
                    f"({', '.join(FUSED_KERNELS)})"
                )


def _generated(
    module: nn.Module,
    shardings: Mapping[str, ParameterSharding],
    size: int,
    device_type: str,
) -> Dict[str, ParameterSharding]:
    """TorchRec's row-wise and data-parallel shardings over ``size`` ranks."""
    generators = {}
    for name, ps in shardings.items():
        if ps.sharding_type == ShardingType.ROW_WISE.value:
            generators[name] = row_wise()
        elif ps.sharding_type == ShardingType.DATA_PARALLEL.value:
            generators[name] = data_parallel()
        else:
            generators[name] = table_wise(rank=0)  # every table needs one
    return dict(
        construct_module_sharding_plan(
            module,
            generators,
            local_size=size,
            world_size=size,
            device_type=device_type,
        )
    )


class _Loads:
    """Bytes each survivor holds as the plan is made."""

    def __init__(self, size: int) -> None:
        self.bytes = [0] * size
        self.tables: List[set] = [set() for _ in range(size)]

    def add(self, rank: int, key: str, nbytes: int) -> None:
        self.bytes[rank] += nbytes
        self.tables[rank].add(key)

    def least_loaded(self, key: str) -> int:
        ranks = range(len(self.bytes))
        free = [r for r in ranks if key not in self.tables[r]] or list(ranks)
        return min(free, key=lambda r: (self.bytes[r], r))


def plan_for_survivors(
    old_plan: ShardingPlan,
    tables: Mapping[str, Sequence[TableShape]],
    old_ranks: Sequence[int],
    survivors: Sequence[int],
    definition: nn.Module,
    element_bytes: Mapping[str, int],
    device_type: str = "cpu",
    device_of: Callable[[int], str] = lambda rank: "cpu",
) -> RecoveryPlan:
    """
    The plan a model recovers to on its survivors (see the module
    docstring); the same on every survivor.

    Args:
        old_plan (ShardingPlan): the model's plan on its group.
        tables (Mapping[str, Sequence[TableShape]]): module path -> tables.
        old_ranks (Sequence[int]): the global rank of each rank of the old
            group.
        survivors (Sequence[int]): the survivors' global ranks (a subset).
        definition (nn.Module): the unsharded model (meta is enough): the
            row-wise and data-parallel shardings come from TorchRec's helpers.
        element_bytes (Mapping[str, int]): table key -> bytes per element
            (to balance the lost shards).
        device_type (str): the device type of the placements.
        device_of (Callable[[int], str]): the device of a survivor's shards,
            by its rank in the survivors' group.

    Returns:
        RecoveryPlan: the plan, the lost shards and the replicated tables.

    Raises:
        ReshardError: for a table of a type a recovery cannot place, or when
            no rank survives.
    """
    check_recoverable(old_plan)
    survivors = sorted(survivors)
    if not survivors:
        raise ReshardError("no rank survives")
    index = {g: i for i, g in enumerate(survivors)}
    old_layouts = plan_layouts(old_plan, tables, list(old_ranks))  # global ranks
    size = len(survivors)
    loads = _Loads(size)
    lost: List[LostShard] = []
    replicated: List[str] = []
    modules: Dict[str, EmbeddingModuleShardingPlan] = {}
    kept: Dict[str, TableLayout] = {}
    for path in sorted(tables):
        shardings = module_plan(old_plan, path)
        generated = _generated(
            definition.get_submodule(path), shardings, size, device_type
        )
        new_module = EmbeddingModuleShardingPlan()
        for name, _, _ in tables[path]:
            key, ps = TableKey(path, name), shardings[name]
            layout = old_layouts[key]
            if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
                replicated.append(key)
                made = generated[name]
                new_module[name] = dataclasses.replace(
                    ps, ranks=made.ranks, sharding_spec=made.sharding_spec
                )
                continue
            lost += [
                LostShard(key, s.rect, s.rank)
                for s in layout.shards
                if s.rank not in index
            ]
            if ps.sharding_type == ShardingType.ROW_WISE.value:
                new_module[name] = _row_wise(
                    ps, generated[name], layout.rows, layout.cols, device_of
                )
                continue
            # in place: the survivors' shards stay, lost ones are placed below
            kept[key] = TableLayout(
                layout.rows,
                layout.cols,
                tuple(
                    PlacedShard(index[s.rank] if s.rank in index else -1, s.rect)
                    for s in layout.shards
                ),
            )
            for s in layout.shards:
                if s.rank in index:
                    loads.add(index[s.rank], key, s.rect.numel * element_bytes[key])
            new_module[name] = ps
        modules[path] = new_module
    _count_row_wise(modules, tables, loads, element_bytes)
    _place_lost(kept, loads, element_bytes)
    for key, layout in kept.items():
        parsed = TableKey.parse(key)
        modules[parsed.path][parsed.table] = sharding_for_layout(
            modules[parsed.path][parsed.table], layout, device_of
        )
    plan = plan_of(modules)
    new_layouts = plan_layouts(plan, tables, survivors)
    return RecoveryPlan(
        plan,
        tuple(survivors),
        tuple(lost),
        tuple(replicated),
        new_layouts,
        tuple(sorted(set(old_ranks) - set(survivors))),
    )


def _row_wise(
    old: ParameterSharding,
    made: ParameterSharding,
    rows: int,
    cols: int,
    device_of: Callable[[int], str],
) -> ParameterSharding:
    """A row-wise table as TorchRec splits it over the survivors, placed on
    their devices, its other settings (kernel, caches) kept."""
    renamed = dataclasses.replace(
        old, ranks=made.ranks, sharding_spec=made.sharding_spec
    )
    size = len(made.ranks or [])
    layout = layout_from_parameter_sharding(renamed, rows, cols, size)
    return sharding_for_layout(renamed, layout, device_of)


def _count_row_wise(
    modules: Mapping[str, EmbeddingModuleShardingPlan],
    tables: Mapping[str, Sequence[TableShape]],
    loads: _Loads,
    element_bytes: Mapping[str, int],
) -> None:
    """Adds the row-wise tables' new blocks to the survivors' loads."""
    for path, shapes in sorted(tables.items()):
        for name, _, cols in shapes:
            ps = modules[path][name]
            if ps.sharding_type != ShardingType.ROW_WISE.value:
                continue
            key = TableKey(path, name)
            for rank, shard in zip(
                ps.ranks or [], ps.sharding_spec.shards
            ):  # pyre-ignore
                loads.add(rank, key, shard.shard_sizes[0] * cols * element_bytes[key])


def _place_lost(
    kept: Dict[str, TableLayout], loads: _Loads, element_bytes: Mapping[str, int]
) -> None:
    """Puts every lost in-place shard (rank -1) on the least loaded survivor."""
    pending = [
        (-(s.rect.numel * element_bytes[key]), key, position)
        for key, layout in kept.items()
        for position, s in enumerate(layout.shards)
        if s.rank < 0
    ]
    for negative_bytes, key, position in sorted(pending):
        layout = kept[key]
        rank = loads.least_loaded(key)
        loads.add(rank, key, -negative_bytes)
        shards = list(layout.shards)
        shards[position] = PlacedShard(rank, shards[position].rect)
        kept[key] = dataclasses.replace(layout, shards=tuple(shards))

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: a model's shards as units of work on ranks, and moves of them.

A ``Placement`` holds every table's layout as the engine reads it from a plan
(``elastic_plan.plan_layouts``, i.e. ``plan.layout_from_parameter_sharding``)
and every shard as a ``ShardUnit``: the elements one id of the table reads in
it (its share of the table's rows times its columns), the bytes its rank
holds for it, and whether a move may put it on another rank. A shard of a
table-wise, column-wise or table-column-wise table may move: it is one
rectangle on one rank, whatever rank. Row-wise, table-row-wise and grid
shards (whose position among the ranks is their row block) and data-parallel
replicas stay. ``moved_layouts`` turns moves into new layouts and
``plan_with_layouts`` into new ``ParameterSharding``s, which the engine then
validates and reshards.
"""

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Mapping, Sequence, Tuple

from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.resharding.elastic_plan import (
    plan_layouts,
    table_key,
    TableShape,
)
from torchrec.distributed.resharding.plan import PlacedShard, TableLayout
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)

# A shard of these types is one rectangle that may sit on any rank.
MOVABLE_TYPES: Tuple[str, ...] = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
)


@dataclass(frozen=True)
class TableInfo:
    """
    One table of a placement.

    Args:
        path (str): the sharded module's path in the plan.
        name (str): the table.
        sharding_type (str): its sharding type.
        layout (TableLayout): its shards on ranks.
        element_bytes (int): bytes a rank holds per element of a shard
            (weights and optimizer state).
    """

    path: str
    name: str
    sharding_type: str
    layout: TableLayout
    element_bytes: int

    @property
    def key(self) -> str:
        return table_key(self.path, self.name)


@dataclass(frozen=True)
class ShardUnit:
    """
    One shard as a unit of work on a rank.

    Args:
        table (int): the table's index in the placement.
        shard (int): the shard's index in the table's layout.
        rank (int): the rank holding it.
        work (float): elements one id of the table reads in this shard, on
            average (rows share times columns; a replica serves its rank's
            share of the ids).
        nbytes (int): bytes the rank holds for it.
        movable (bool): whether a move may put it on another rank.
    """

    table: int
    shard: int
    rank: int
    work: float
    nbytes: int
    movable: bool


@dataclass(frozen=True)
class Placement:
    """
    Every table's shards on the ranks of a process group.

    Args:
        tables (Tuple[TableInfo, ...]): the tables, sorted by key.
        world_size (int): ranks.
        units (Tuple[ShardUnit, ...]): every shard, by table then shard.
    """

    tables: Tuple[TableInfo, ...]
    world_size: int
    units: Tuple[ShardUnit, ...]

    def rank_bytes(self) -> List[int]:
        """Bytes each rank holds for the tables."""
        held = [0] * self.world_size
        for unit in self.units:
            held[unit.rank] += unit.nbytes
        return held

    def layouts(self) -> Dict[str, TableLayout]:
        """Every table's layout, by key."""
        return {t.key: t.layout for t in self.tables}


def shard_units(tables: Sequence[TableInfo], world_size: int) -> Tuple[ShardUnit, ...]:
    """
    Args:
        tables (Sequence[TableInfo]): the tables of a placement.
        world_size (int): ranks.

    Returns:
        Tuple[ShardUnit, ...]: every shard of every table as a unit.
    """
    units = []
    for index, table in enumerate(tables):
        layout = table.layout
        movable = table.sharding_type in MOVABLE_TYPES and not layout.replicated
        for k, shard in enumerate(layout.shards):
            rect = shard.rect
            if layout.replicated:
                work = rect.cols / world_size
            else:
                work = rect.rows / max(layout.rows, 1) * rect.cols
            units.append(
                ShardUnit(
                    index,
                    k,
                    shard.rank,
                    work,
                    rect.numel * table.element_bytes,
                    movable,
                )
            )
    return tuple(units)


def placement_from_tables(tables: Sequence[TableInfo], world_size: int) -> Placement:
    """
    Args:
        tables (Sequence[TableInfo]): the tables (any order).
        world_size (int): ranks.

    Returns:
        Placement: the tables sorted by key, with their units.
    """
    ordered = tuple(sorted(tables, key=lambda t: t.key))
    return Placement(ordered, world_size, shard_units(ordered, world_size))


def module_plan(plan: ShardingPlan, path: str) -> EmbeddingModuleShardingPlan:
    """A module's plan, typed (``ShardingPlan.plan`` holds untyped values)."""
    found = plan.plan[path]
    assert isinstance(found, EmbeddingModuleShardingPlan), type(found)
    return found


def placement_of(
    plan: ShardingPlan,
    tables: Mapping[str, Sequence[TableShape]],
    element_bytes: Mapping[str, int],
    world_size: int,
) -> Placement:
    """
    A plan's placement.

    Args:
        plan (ShardingPlan): the plan (group-local ranks).
        tables (Mapping[str, Sequence[TableShape]]): module path -> its tables
            as (name, rows, columns).
        element_bytes (Mapping[str, int]): table key -> bytes per element.
        world_size (int): ranks.

    Returns:
        Placement: the placement.
    """
    layouts = plan_layouts(plan, tables, list(range(world_size)))
    infos = []
    for path, shapes in tables.items():
        shardings = module_plan(plan, path)
        for name, _, _ in shapes:
            key = table_key(path, name)
            infos.append(
                TableInfo(
                    path,
                    name,
                    shardings[name].sharding_type,
                    layouts[key],
                    element_bytes[key],
                )
            )
    return placement_from_tables(infos, world_size)


def moved_layouts(
    placement: Placement, moves: Sequence[Tuple[int, int]]
) -> Dict[str, TableLayout]:
    """
    The new layouts of the tables that moves change.

    Args:
        placement (Placement): the placement.
        moves (Sequence[Tuple[int, int]]): (unit index, destination rank).

    Returns:
        Dict[str, TableLayout]: table key -> its layout after the moves.
    """
    by_table: Dict[int, Dict[int, int]] = {}
    for index, rank in moves:
        unit = placement.units[index]
        by_table.setdefault(unit.table, {})[unit.shard] = rank
    out = {}
    for t, ranks in sorted(by_table.items()):
        table = placement.tables[t]
        layout = table.layout
        shards = tuple(
            PlacedShard(ranks.get(k, s.rank), s.rect)
            for k, s in enumerate(layout.shards)
        )
        out[table.key] = replace(layout, shards=shards)
    return out


def with_layouts(placement: Placement, layouts: Mapping[str, TableLayout]) -> Placement:
    """The placement with some tables' layouts replaced (by key)."""
    tables = [
        replace(t, layout=layouts[t.key]) if t.key in layouts else t
        for t in placement.tables
    ]
    return placement_from_tables(tables, placement.world_size)


def device_for_rank(device_type: str, rank: int, local_world_size: int) -> str:
    """The device of a rank's shards: its own ``cuda:<local index>`` on GPUs."""
    if device_type == "cuda":
        return f"cuda:{rank % local_world_size}"
    return device_type


def sharding_for_layout(
    sharding: ParameterSharding,
    layout: TableLayout,
    device_of: Callable[[int], str],
) -> ParameterSharding:
    """
    ``sharding`` with the shards (and ranks) of ``layout``, its other settings
    kept; a data-parallel sharding is returned as it is.

    Args:
        sharding (ParameterSharding): the table's sharding.
        layout (TableLayout): the layout it should have (spec order).
        device_of (Callable[[int], str]): the device of a rank's shards.

    Returns:
        ParameterSharding: a new sharding.
    """
    if layout.replicated:
        return sharding
    shards = [
        ShardMetadata(
            shard_offsets=[s.rect.row, s.rect.col],
            shard_sizes=[s.rect.rows, s.rect.cols],
            placement=f"rank:{s.rank}/{device_of(s.rank)}",
        )
        for s in layout.shards
    ]
    return replace(
        sharding,
        ranks=[s.rank for s in layout.shards],
        sharding_spec=EnumerableShardingSpec(shards),
    )


def plan_with_layouts(
    plan: ShardingPlan,
    placement: Placement,
    layouts: Mapping[str, TableLayout],
    device_of: Callable[[int], str],
) -> ShardingPlan:
    """
    A new plan: ``plan`` with the tables of ``layouts`` (by key) laid out
    anew; every other table keeps its ``ParameterSharding`` object, so the
    engine's ``plan_delta`` sees exactly the moved tables. ``plan`` is not
    modified.

    Args:
        plan (ShardingPlan): the current plan.
        placement (Placement): its placement.
        layouts (Mapping[str, TableLayout]): new layouts by table key.
        device_of (Callable[[int], str]): the device of a rank's shards.

    Returns:
        ShardingPlan: the new plan.
    """
    changed: Dict[str, Dict[str, TableLayout]] = {}
    for table in placement.tables:
        if table.key in layouts:
            changed.setdefault(table.path, {})[table.name] = layouts[table.key]
    modules: Dict[str, ModuleShardingPlan] = {}
    for path in plan.plan:
        shardings = module_plan(plan, path)
        new = EmbeddingModuleShardingPlan(shardings)
        for name, layout in changed.get(path, {}).items():
            new[name] = sharding_for_layout(shardings[name], layout, device_of)
        modules[path] = new
    return ShardingPlan(modules)

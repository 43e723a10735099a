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
(``elastic_plan.plan_layouts``) and every shard as a ``ShardUnit``: the
elements one id of the table reads in it, the bytes its rank holds for it,
and whether it may move. A table-wise, column-wise or table-column-wise
shard may: it is one rectangle on any one rank. Row-wise, table-row-wise and
grid shards (whose row block is their position among the ranks) and
data-parallel replicas stay. Moves become layouts (``moved_layouts``) and
``ParameterSharding``s (``plan_with_layouts``) the engine then reshards to.
"""

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.plan import PlacedShard, TableLayout
from torchrec.distributed.resharding.whole_plan import (
    module_plan,
    plan_layouts,
    replace_shardings,
    TableShape,
)
from torchrec.distributed.types import ParameterSharding, ShardingPlan, ShardingType

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

    @cached_property
    def key(self) -> TableKey:
        # built once per table: the per-window search reads it for every
        # table several times (a frozen dataclass keeps it in its __dict__)
        return TableKey(self.path, self.name)


@dataclass(frozen=True)
class ShardUnit:
    """
    One shard as a unit of work on a rank.

    Args:
        table (int): the table's index in the placement.
        shard (int): the shard's index in the table's layout.
        rank (int): the rank holding it.
        work (float): elements one id of the table reads in it, on average
            (its share of the rows times its columns; a replica serves its
            rank's share of the ids).
        nbytes (int): bytes the rank holds for it.
        movable (bool): whether a move may put it on another rank.
        share (float): the share of the table's ids it reads (its rows'
            share; every id of the table for a column-wise shard).
    """

    table: int
    shard: int
    rank: int
    work: float
    nbytes: int
    movable: bool
    share: float = 1.0


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


def placement_from_tables(tables: Sequence[TableInfo], world_size: int) -> Placement:
    """The placement of ``tables`` (any order) over ``world_size`` ranks."""
    ordered = tuple(sorted(tables, key=lambda t: t.key))
    units = []
    for index, table in enumerate(ordered):
        layout = table.layout
        movable = table.sharding_type in MOVABLE_TYPES and not layout.replicated
        for k, shard in enumerate(layout.shards):
            rect = shard.rect
            share = 1 / world_size if layout.replicated else rect.rows / layout.rows
            units.append(
                ShardUnit(
                    index,
                    k,
                    shard.rank,
                    share * rect.cols,
                    rect.numel * table.element_bytes,
                    movable,
                    share,
                )
            )
    return Placement(ordered, world_size, tuple(units))


def placement_of(
    plan: ShardingPlan,
    tables: Mapping[str, Sequence[TableShape]],
    element_bytes: Mapping[str, int],
    world_size: int,
) -> Placement:
    """
    Args:
        plan (ShardingPlan): a plan (group-local ranks).
        tables (Mapping[str, Sequence[TableShape]]): module path -> tables.
        element_bytes (Mapping[str, int]): table key -> bytes per element.
        world_size (int): ranks.

    Returns:
        Placement: the plan's placement.
    """
    layouts = plan_layouts(plan, tables, list(range(world_size)))
    infos = []
    for path, shapes in tables.items():
        shardings = module_plan(plan, path)
        for name, _, _ in shapes:
            key = TableKey(path, name)
            kind = shardings[name].sharding_type
            infos.append(TableInfo(path, name, kind, layouts[key], element_bytes[key]))
    return placement_from_tables(infos, world_size)


def moved_layouts(
    placement: Placement, moves: Sequence[Tuple[int, int]]
) -> Dict[str, TableLayout]:
    """
    Args:
        placement (Placement): the placement.
        moves (Sequence[Tuple[int, int]]): (unit index, destination rank).

    Returns:
        Dict[str, TableLayout]: the layout after the moves of each table
        they change, by key.
    """
    by_table: Dict[int, Dict[int, int]] = {}
    for index, rank in moves:
        unit = placement.units[index]
        by_table.setdefault(unit.table, {})[unit.shard] = rank
    out = {}
    for t, ranks in sorted(by_table.items()):
        table = placement.tables[t]
        shards = table.layout.shards
        moved = tuple(
            PlacedShard(ranks.get(k, s.rank), s.rect) for k, s in enumerate(shards)
        )
        out[table.key] = replace(table.layout, shards=moved)
    return out


def with_layouts(placement: Placement, layouts: Mapping[str, TableLayout]) -> Placement:
    """The placement with some tables' layouts replaced (by key)."""
    tables = [replace(t, layout=layouts.get(t.key, t.layout)) for t in placement.tables]
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
    Args:
        sharding (ParameterSharding): a table's sharding.
        layout (TableLayout): the layout it should have (spec order).
        device_of (Callable[[int], str]): the device of a rank's shards.

    Returns:
        ParameterSharding: ``sharding`` with the shards and ranks of
        ``layout``, its other settings kept (a replicated one as it is).
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
    sharding_types: Optional[Mapping[str, str]] = None,
) -> ShardingPlan:
    """
    Args:
        plan (ShardingPlan): the current plan (not modified).
        placement (Placement): its placement.
        layouts (Mapping[str, TableLayout]): new layouts, by table key.
        device_of (Callable[[int], str]): the device of a rank's shards.
        sharding_types (Optional[Mapping[str, str]]): new sharding types, by
            table key (a split table becomes column-wise).

    Returns:
        ShardingPlan: ``plan`` with the tables of ``layouts`` laid out anew;
        every other table keeps its ``ParameterSharding`` object, so the
        engine's ``plan_delta`` sees exactly the moved tables.
    """
    keys = {(t.path, t.name): t.key for t in placement.tables}

    def laid_out(table: TableKey, sharding: ParameterSharding) -> ParameterSharding:
        key = keys[(table.path, table.table)]  # every table of the plan is placed
        if key in layouts:
            sharding = sharding_for_layout(sharding, layouts[key], device_of)
        if sharding_types and key in sharding_types:
            sharding = replace(sharding, sharding_type=sharding_types[key])
        return sharding

    return replace_shardings(plan, laid_out)

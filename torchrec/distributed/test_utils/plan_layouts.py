#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Test helpers for the pure planner of live resharding: hypothesis strategies
for table layouts of every sharding type (and irregular tilings, replicas,
layouts renumbered into the ranks of an elastic move), and the reference
planner every faster planner is checked against: every new shard intersected
with every distinct old rectangle, straight from the definition.
"""

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import hypothesis.strategies as st
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding.plan import (
    PlacedShard,
    Rect,
    replicated_layout,
    ReshardPlan,
    TableLayout,
    Transfer,
)
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.model_zoo import one_table_ebc as zoo_one_table_ebc
from torchrec.distributed.types import ParameterSharding, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

# (row, col, rows, cols, rank)
ShardTuple = Tuple[int, int, int, int, int]

# Layout kinds: TorchRec's sharding types for embedding bags, plus replicas
# on some ranks only, replicated row blocks and irregular (guillotine) tilings.
LAYOUT_KINDS: Tuple[str, ...] = (
    "TW",
    "CW",
    "TWCW",
    "RW",
    "RW_UNEVEN",
    "TWRW",
    "GRID",
    "DP",
    "PARTIAL_DP",
    "REPLICATED_BLOCKS",
    "TILING",
    "GUILLOTINE",
)


def _cuts(draw: st.DrawFn, n: int, max_inner: int) -> List[int]:
    """0, up to ``max_inner`` distinct inner cuts of [0, n), n."""
    inner = draw(st.sets(st.integers(1, n - 1), max_size=max_inner)) if n > 1 else set()
    return [0] + sorted(inner) + [n]


def _even_blocks(n: int, parts: int) -> List[Tuple[int, int]]:
    """TorchRec's row-wise split: blocks of ceil(n / parts), the last ones short
    or empty."""
    block = -(-n // parts)
    return [
        (min(i * block, n), max(0, min(block, n - i * block))) for i in range(parts)
    ]


@st.composite
def grid_tiling(
    draw: st.DrawFn, rows: int, cols: int, world_size: int
) -> List[ShardTuple]:
    """
    Args:
        rows (int): rows of the table.
        cols (int): columns of the table.
        world_size (int): ranks to place the tiles on.

    Returns:
        List[ShardTuple]: a random grid of tiles (up to 3 inner cuts each
        way) on random ranks, in random order.
    """
    row_cuts, col_cuts = _cuts(draw, rows, 3), _cuts(draw, cols, 3)
    shards = [
        (r0, c0, r1 - r0, c1 - c0, draw(st.integers(0, world_size - 1)))
        for r0, r1 in zip(row_cuts, row_cuts[1:])
        for c0, c1 in zip(col_cuts, col_cuts[1:])
    ]
    return draw(st.permutations(shards))


@dataclass(frozen=True)
class GridTable:
    """
    A random table on a random number of ranks, and grid tilings of it.

    Args:
        world_size (int): the ranks (1 to 4).
        rows (int): rows of the table (1 to 12).
        cols (int): columns of the table (1 to 12).
        tilings (Tuple[List[ShardTuple], ...]): independent grid tilings
            (:func:`grid_tiling`).
    """

    world_size: int
    rows: int
    cols: int
    tilings: Tuple[List[ShardTuple], ...]


@st.composite
def grid_tables(draw: st.DrawFn, tilings: int = 1) -> GridTable:
    """
    Args:
        tilings (int): how many tilings of the table to draw.

    Returns:
        GridTable: a random table and ``tilings`` grid tilings of it.
    """
    world_size = draw(st.integers(1, 4))
    rows, cols = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    return GridTable(
        world_size,
        rows,
        cols,
        tuple(draw(grid_tiling(rows, cols, world_size)) for _ in range(tilings)),
    )


@st.composite
def guillotine_tiling(
    draw: st.DrawFn, rows: int, cols: int, world_size: int, depth: int = 4
) -> List[ShardTuple]:
    """
    Args:
        rows (int): rows of the table.
        cols (int): columns of the table.
        world_size (int): ranks to place the tiles on.
        depth (int): most recursive cuts on a path.

    Returns:
        List[ShardTuple]: an irregular tiling (each rectangle cut across
        either way at a random place, recursively: tiles of many heights that
        do not line up), on random ranks, in random order.
    """
    out: List[ShardTuple] = []

    def split(row: int, col: int, nrows: int, ncols: int, left: int) -> None:
        can_rows, can_cols = nrows > 1, ncols > 1
        if left == 0 or not (can_rows or can_cols) or draw(st.booleans()):
            out.append((row, col, nrows, ncols, draw(st.integers(0, world_size - 1))))
            return
        across_rows = can_rows and (not can_cols or draw(st.booleans()))
        if across_rows:
            cut = draw(st.integers(1, nrows - 1))
            split(row, col, cut, ncols, left - 1)
            split(row + cut, col, nrows - cut, ncols, left - 1)
        else:
            cut = draw(st.integers(1, ncols - 1))
            split(row, col, nrows, cut, left - 1)
            split(row, col + cut, nrows, ncols - cut, left - 1)

    split(0, 0, rows, cols, depth)
    return draw(st.permutations(out))


def layout_of(rows: int, cols: int, shards: Sequence[ShardTuple]) -> TableLayout:
    """A layout from ``(row, col, rows, cols, rank)`` tuples, in that order."""
    return TableLayout(
        rows,
        cols,
        tuple(PlacedShard(rank, Rect(r, c, nr, nc)) for r, c, nr, nc, rank in shards),
    )


@st.composite
def table_layouts(
    draw: st.DrawFn,
    rows: int,
    cols: int,
    world_size: int,
    kind: Optional[str] = None,
) -> TableLayout:
    """
    Args:
        rows (int): rows of the table.
        cols (int): columns of the table.
        world_size (int): size of the group (ranks 0 .. world_size - 1).
        kind (Optional[str]): one of ``LAYOUT_KINDS`` (default: any).

    Returns:
        TableLayout: a layout of that kind, in the shapes TorchRec's planners
        give it (e.g. row-wise blocks of ceil(rows / world) with short or
        empty last shards; grid column blocks split row-wise over a host).
    """
    kind = kind if kind is not None else draw(st.sampled_from(LAYOUT_KINDS))
    ranks = st.integers(0, world_size - 1)
    if kind == "TW":
        return layout_of(rows, cols, [(0, 0, rows, cols, draw(ranks))])
    if kind in ("CW", "TWCW"):
        col_cuts = _cuts(draw, cols, min(cols, world_size) - 1 if kind == "CW" else 3)
        blocks = list(zip(col_cuts, col_cuts[1:]))
        if kind == "CW":  # one block per rank, distinct ranks
            owners = draw(st.permutations(range(world_size)))[: len(blocks)]
        else:  # several blocks per rank
            owners = [draw(ranks) for _ in blocks]
        return layout_of(
            rows,
            cols,
            [(0, c0, rows, c1 - c0, r) for (c0, c1), r in zip(blocks, owners)],
        )
    if kind == "RW":
        return layout_of(
            rows,
            cols,
            [
                (r0, 0, n, cols, i)
                for i, (r0, n) in enumerate(_even_blocks(rows, world_size))
            ],
        )
    if kind == "RW_UNEVEN":
        row_cuts = _cuts(draw, rows, world_size - 1)
        owners = draw(st.permutations(range(world_size)))
        return layout_of(
            rows,
            cols,
            [
                (r0, 0, r1 - r0, cols, r)
                for (r0, r1), r in zip(zip(row_cuts, row_cuts[1:]), owners)
            ],
        )
    if kind == "TWRW":
        local = draw(st.integers(1, world_size))
        host = draw(st.integers(0, world_size // local - 1))
        return layout_of(
            rows,
            cols,
            [
                (r0, 0, n, cols, host * local + i)
                for i, (r0, n) in enumerate(_even_blocks(rows, local))
            ],
        )
    if kind == "GRID":
        local = draw(st.integers(1, world_size))
        hosts = world_size // local
        col_cuts = _cuts(draw, cols, hosts - 1)
        hosts_used = draw(st.permutations(range(hosts)))
        return layout_of(
            rows,
            cols,
            [
                (r0, c0, n, c1 - c0, host * local + i)
                for (c0, c1), host in zip(zip(col_cuts, col_cuts[1:]), hosts_used)
                for i, (r0, n) in enumerate(_even_blocks(rows, local))
            ],
        )
    if kind == "DP":
        return replicated_layout(rows, cols, world_size)
    if kind == "PARTIAL_DP":
        owners = draw(st.lists(ranks, min_size=1, max_size=world_size, unique=True))
        full = Rect(0, 0, rows, cols)
        return TableLayout(
            rows, cols, tuple(PlacedShard(r, full) for r in owners), replicated=True
        )
    if kind == "REPLICATED_BLOCKS":
        row_cuts = _cuts(draw, rows, 3)
        shards = [
            (r0, 0, r1 - r0, cols, r)
            for r0, r1 in zip(row_cuts, row_cuts[1:])
            # a rank may even hold the same block twice
            for r in draw(st.lists(ranks, min_size=1, max_size=4))
        ]
        return layout_of(rows, cols, draw(st.permutations(shards)))
    if kind == "TILING":
        return layout_of(rows, cols, draw(grid_tiling(rows, cols, world_size)))
    if kind == "GUILLOTINE":
        return layout_of(rows, cols, draw(guillotine_tiling(rows, cols, world_size)))
    raise ValueError(f"unknown layout kind {kind}")


@dataclass(frozen=True)
class LayoutScenario:
    """
    Old and new layouts of some tables, in one rank numbering.

    Args:
        old_layouts (Dict[str, TableLayout]): layouts before.
        new_layouts (Dict[str, TableLayout]): layouts after.
        tables (List[str]): the tables to plan, in order.
        ranks (int): size of the rank numbering (every rank is below it).
    """

    old_layouts: Dict[str, TableLayout]
    new_layouts: Dict[str, TableLayout]
    tables: List[str]
    ranks: int


@st.composite
def layout_scenarios(
    draw: st.DrawFn,
    max_world_size: int = 16,
    max_tables: int = 3,
    max_rows: int = 40,
    max_cols: int = 24,
) -> LayoutScenario:
    """
    Args:
        max_world_size (int): largest old and new group (each drawn from 1).
        max_tables (int): most tables.
        max_rows (int): most rows per table.
        max_cols (int): most columns per table.

    Returns:
        LayoutScenario: tables of any kinds before and after; the old and new
        groups differ in size (growing or shrinking) and, half of the time,
        are numbered into the ranks of an elastic move: both groups placed on
        random ranks of a union, in random order.
    """
    old_world = draw(st.integers(1, max_world_size), label="old_world")
    new_world = draw(st.integers(1, max_world_size), label="new_world")
    if draw(st.booleans(), label="remapped"):
        union = draw(st.integers(max(old_world, new_world), old_world + new_world))
        old_ranks = draw(st.permutations(range(union)))[:old_world]
        new_ranks = draw(st.permutations(range(union)))[:new_world]
    else:
        union = max(old_world, new_world)
        old_ranks, new_ranks = list(range(old_world)), list(range(new_world))
    names = [f"t{i}" for i in range(draw(st.integers(1, max_tables)))]
    old_layouts: Dict[str, TableLayout] = {}
    new_layouts: Dict[str, TableLayout] = {}
    for name in names:
        rows = draw(st.integers(1, max_rows), label="rows")
        cols = draw(st.integers(1, max_cols), label="cols")
        old = draw(table_layouts(rows, cols, old_world), label=f"{name} old")
        new = draw(table_layouts(rows, cols, new_world), label=f"{name} new")
        old_layouts[name] = old.remap_ranks(dict(enumerate(old_ranks)))
        new_layouts[name] = new.remap_ranks(dict(enumerate(new_ranks)))
    tables = draw(st.permutations(names))
    return LayoutScenario(old_layouts, new_layouts, list(tables), union)


def reference_table_transfers(
    table: str, old: TableLayout, new: TableLayout
) -> List[Transfer]:
    """
    The transfers of one table by definition: every new shard (spec order)
    against every distinct old rectangle (row-major); a replica on the
    destination is its own source, otherwise the destination's rank modulo
    the number of owners picks one (owners in spec order).

    Args:
        table (str): table name.
        old (TableLayout): layout before.
        new (TableLayout): layout after.

    Returns:
        List[Transfer]: the transfers, in plan order.
    """
    owners: Dict[Rect, List[int]] = {}
    for shard in old.shards:
        owners.setdefault(shard.rect, []).append(shard.rank)
    transfers: List[Transfer] = []
    for dst in new.shards:
        for src_rect in sorted(owners):
            piece = src_rect.intersect(dst.rect)
            if piece is None:
                continue
            held = owners[src_rect]
            src = dst.rank if dst.rank in held else held[dst.rank % len(held)]
            transfers.append(Transfer(table, src, dst.rank, piece, src_rect, dst.rect))
    return transfers


def reference_plan(
    old_layouts: Mapping[str, TableLayout],
    new_layouts: Mapping[str, TableLayout],
    tables: Sequence[str],
) -> ReshardPlan:
    """
    Args:
        old_layouts (Mapping[str, TableLayout]): layouts before.
        new_layouts (Mapping[str, TableLayout]): layouts after.
        tables (Sequence[str]): the tables, in order.

    Returns:
        ReshardPlan: the whole plan from ``reference_table_transfers`` (what
        every rank computed before per-rank planning existed).
    """
    transfers: List[Transfer] = []
    for name in tables:
        transfers.extend(
            reference_table_transfers(name, old_layouts[name], new_layouts[name])
        )
    return ReshardPlan(
        tuple(transfers),
        {n: old_layouts[n] for n in tables},
        {n: new_layouts[n] for n in tables},
    )


# ------------------------------------------- ParameterShardings of one table --

DENSE = EmbeddingComputeKernel.DENSE.value
FUSED = EmbeddingComputeKernel.FUSED.value


def sharding_by_hand(
    sharding_type: str,
    shards: Sequence[ShardTuple],
    kernel: str = DENSE,
    device: str = "cpu",
    ranks: Optional[List[int]] = None,
) -> ParameterSharding:
    """A ParameterSharding built by hand (for uneven and invalid splits)."""
    return ParameterSharding(
        sharding_type=sharding_type,
        compute_kernel=kernel,
        ranks=ranks if ranks is not None else [s[4] for s in shards],
        sharding_spec=EnumerableShardingSpec(
            [
                ShardMetadata(
                    shard_offsets=[row, col],
                    shard_sizes=[rows, cols],
                    placement=f"rank:{rank}/{device}",
                )
                for row, col, rows, cols, rank in shards
            ]
        ),
    )


# The table of the type-pair tests: 10 rows (row-wise splits are uneven:
# 3, 3, 3, 1) and 256 columns (grid sharding needs two 128-column blocks).
TABLE_ROWS, TABLE_COLS = 10, 256
WORLD, LOCAL = 4, 2

# The generators of TorchRec's plan helpers for every sharding type.
TYPE_GENERATORS = {
    "TW": lambda: table_wise(rank=2),
    "CW": lambda: column_wise(ranks=[0, 1, 2, 3]),
    "TWCW": lambda: column_wise(ranks=[3, 1]),
    "RW": lambda: row_wise(),
    "TWRW": lambda: table_row_wise(host_index=1),
    "GRID": lambda: grid_shard(host_indexes=[0, 1]),
    "DP": lambda: data_parallel(),
}


def one_table_ebc(
    rows: int = TABLE_ROWS, cols: int = TABLE_COLS
) -> EmbeddingBagCollection:
    """
    Args:
        rows (int): the table's rows.
        cols (int): the table's embedding dim.

    Returns:
        EmbeddingBagCollection: the zoo's one table ``t``, on the meta device.
    """
    return zoo_one_table_ebc(rows, cols)


def constructed_sharding(
    kind: str, ebc: Optional[EmbeddingBagCollection] = None
) -> ParameterSharding:
    """The ParameterSharding TorchRec's own plan helpers build for ``kind``."""
    plan = construct_module_sharding_plan(
        ebc if ebc is not None else one_table_ebc(),
        {"t": TYPE_GENERATORS[kind]()},
        local_size=LOCAL,
        world_size=WORLD,
        device_type="cpu",
    )
    ps = plan["t"]
    if kind == "TWCW":
        ps.sharding_type = ShardingType.TABLE_COLUMN_WISE.value
    if kind != "DP":
        ps.compute_kernel = DENSE
    return ps

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: the level the window's splits aim for, and which hot tables reach it
by rows.

A hot table can be laid out many ways: column-wise in more shards, row-wise
over a host or the group, a grid of column blocks over hosts. The narrower
the pieces, the lower the busiest rank it loads, and the more it adds to all
ranks together: every column shard receives every id of its table, every
rank of a row group writes the pooled output of the global batch for its
columns, every rank bucketizes its ids for each block spread by rows and
joins the row sharding's collectives. Searching split by split for the
lowest busiest rank takes the widest spread each time: at 1,024 ranks x 100
tables on a Zipf 1.1 load, grids over 256 ranks where 128 left each rank
below the step the rest allowed, and grids for tables a column split fits,
at about three times the column split's total: the mean rank, below which
no plan's slowest rank can go, rose 24% above the level reachable.

``split_level`` finds that level first: the least ``X`` at which every hot
table has a layout whose busiest rank is at most ``X`` and the mean rank,
each such table in its cheapest layout (least added to all ranks) whose
busiest rank is at most ``X``, is at most ``X``. The tables whose cheapest
layout at that level is by rows go to the row split search, which ranks a
split whose ranks stay within the level by what it adds to all ranks; the
rest are left to the column splits. Each layout is priced as the search
prices it (``RowCosts``, ``ColumnShardSeconds``, ``row_split_seconds``),
apart from what else its ranks hold: the moves and splits place it.
"""

import bisect
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from torchrec.distributed.resharding.plan import TableLayout
from torchrec.distributed.resharding.rebalance.exchange_price import (
    block_output_bytes,
    ColumnShardSeconds,
    ExchangePrice,
    others_bytes,
    row_blocks_spread,
    ROW_COLLECTIVES,
    rows_ids_bytes,
    table_exchange,
    TableExchange,
)
from torchrec.distributed.resharding.rebalance.row_splits import (
    grid_blocks,
    host_ranks,
    RowCosts,
)
from torchrec.distributed.resharding.rebalance.splits import ALIGN
from torchrec.distributed.types import ShardingType

# halvings of the interval between the level's bounds (2^-40 of it: far
# below any difference in seconds the search can tell)
LEVEL_STEPS: int = 40


@dataclass(frozen=True)
class LayoutOption:
    """
    One layout a hot table may take, as the level weighs it.

    Args:
        peak (float): seconds per step it puts on its busiest rank, kernel
            and exchange.
        added (float): seconds per step it adds to all ranks together over
            the table's layout now (negative: it saves).
        by_rows (bool): a row layout (row-wise, table-row-wise or grid).
    """

    peak: float
    added: float
    by_rows: bool


@dataclass(frozen=True)
class SplitLevel:
    """
    The level of the window's splits.

    Args:
        level (float): the least slowest rank the hot tables' layouts allow
            (``split_level``), in the loads' seconds.
        by_rows (FrozenSet[int]): the tables whose cheapest layout at that
            level is by rows.
    """

    level: float
    by_rows: FrozenSet[int]


def column_options(
    cols: int,
    shards_now: int,
    ids: float,
    world_size: int,
    seconds_per_element: float,
    lookup_columns: float,
    column: Optional[ColumnShardSeconds],
) -> List[LayoutOption]:
    """
    A table of ``cols`` columns in ``shards_now`` column shards spanning
    every row, as ``k`` column shards of widths that are multiples of
    ``ALIGN`` (``k`` from 1, whole, to ``cols / ALIGN``).

    Args:
        cols (int): its columns.
        shards_now (int): its column shards now (1: whole).
        ids (float): its ids per step over all ranks.
        world_size (int): ranks of the group.
        seconds_per_element (float): the calibrated slope.
        lookup_columns (float): a shard's fixed cost per id, in columns.
        column (Optional[ColumnShardSeconds]): what a column shard of it
            exchanges (``column_shard_seconds``; None: kernels only).

    Returns:
        List[LayoutOption]: one per distinct widest shard.
    """
    per_id = ids * seconds_per_element
    shard = per_column = everyone = 0.0
    if column is not None:
        shard, per_column = column.shard, column.column
        everyone = column.everyone * world_size

    def total(k: int) -> float:
        return (
            per_id * (cols + k * lookup_columns)
            + k * (shard + everyone)
            + (per_column * cols)
        )

    now = total(shards_now)
    out: List[LayoutOption] = []
    widths = set()
    for k in range(1, max(1, cols // ALIGN) + 1):
        width = cols if k == 1 else -(-cols // k // ALIGN) * ALIGN
        if width in widths or width <= 0:
            continue
        widths.add(width)
        count = -(-cols // width)
        peak = per_id * (width + lookup_columns) + shard + per_column * width
        out.append(LayoutOption(peak, total(count) - now, False))
    return out


# A row layout by column block: (first column, columns, the ranks of its
# row blocks in TorchRec's order).
RowGroups = List[Tuple[int, int, Sequence[int]]]


def row_groups(
    cols: int,
    world_size: int,
    local_world_size: int,
    kinds: Sequence[str],
    holders: Sequence[int],
) -> List[RowGroups]:
    """
    The row layouts of TorchRec's a table may take (``kinds``: the row
    sharding types allowed), as column blocks over ranks: table-row-wise
    over one host, row-wise over the group, a grid of ``k`` column blocks
    over ``k`` hosts; on the hosts holding none of the table first (where
    it lands only changes which ranks the moves balance).
    """
    out: List[RowGroups] = []
    hosts: List[List[int]] = []
    if 1 < local_world_size < world_size and world_size % local_world_size == 0:
        held = set(holders)
        hosts = sorted(
            host_ranks(world_size, local_world_size),
            key=lambda ranks: (not held.isdisjoint(ranks), ranks[0]),
        )
    if hosts and ShardingType.TABLE_ROW_WISE.value in kinds:
        out.append([(0, cols, hosts[0])])
    if ShardingType.ROW_WISE.value in kinds:
        out.append([(0, cols, range(world_size))])
    if hosts and ShardingType.GRID_SHARD.value in kinds:
        for k in grid_blocks(cols, len(hosts)):
            width = cols // k
            out.append([(c * width, width, hosts[c]) for c in range(k)])
    return out


def _block_rows(rows: int, ranks: int) -> List[Tuple[int, int]]:
    """
    ``row_blocks(rows, ranks)`` as (rows, how many ranks hold that many):
    the full blocks, the shorter last one, the empty ones after it.
    """
    block = -(-rows // ranks)
    full = rows // block
    left = rows - full * block
    out = [(block, full)]
    if left:
        out.append((left, 1))
    empty = ranks - full - (1 if left else 0)
    if empty:
        out.append((0, empty))
    return out


def _index_rows(rows: int, ranks: int, index: int) -> int:
    """The rows of the ``index``-th block of ``row_blocks(rows, ranks)``."""
    block = -(-rows // ranks)
    return min(block, max(rows - index * block, 0))


def row_options(
    layout: TableLayout,
    shards_now: int,
    ids: float,
    samples: float,
    costs: RowCosts,
    world_size: int,
    local_world_size: int,
    kinds: Sequence[str],
    holders: Sequence[int],
    price: Optional[ExchangePrice],
) -> List[LayoutOption]:
    """
    A table whole or in column shards spanning every row (``layout``, its
    ``shards_now`` shards on ``holders``) spread by rows, each layout of
    ``row_groups``. Its row blocks come in at most three sizes per column
    block, so each layout is priced per size (``blocks_exchange`` and
    ``row_split_seconds`` in closed form), the ranks holding the table now
    one by one: the cost does not grow with the ranks a layout spans.

    Args:
        layout (TableLayout): its layout now.
        shards_now (int): its shards now.
        ids (float): its ids per step over all ranks.
        samples (float): its samples per step over all ranks.
        costs (RowCosts): what its row blocks cost.
        world_size (int): ranks of the group.
        local_world_size (int): ranks per host.
        kinds (Sequence[str]): the row sharding types allowed.
        holders (Sequence[int]): the ranks holding its shards now.
        price (Optional[ExchangePrice]): the exchange's figures (None or
            unpriced: kernels only).

    Returns:
        List[LayoutOption]: one per layout.
    """
    kernel_now = costs.ids * (layout.cols + shards_now * costs.lookup_columns)
    before: Optional[TableExchange] = None
    if price is not None and price.priced:
        before = table_exchange(layout, world_size, ids, samples)
    return [
        _row_option(
            layout,
            groups,
            (ids, samples),
            costs,
            kernel_now,
            world_size,
            before,
            price,
        )
        for groups in row_groups(
            layout.cols, world_size, local_world_size, kinds, holders
        )
    ]


def _row_option(
    layout: TableLayout,
    groups: RowGroups,
    volumes: Tuple[float, float],
    costs: RowCosts,
    kernel_now: float,
    world_size: int,
    before: Optional[TableExchange],
    price: Optional[ExchangePrice],
) -> LayoutOption:
    """
    One row layout's option: its busiest rank (kernel plus the exchange it
    adds there) and what it adds to all ranks, as ``row_split_seconds``
    prices each rank (``before``: the table's exchange now; None: kernels
    only).
    """
    rows = layout.rows
    kernel = 0.0
    for _, width, ranks in groups:
        for count, ranks_of_size in _block_rows(rows, len(ranks)):
            kernel += ranks_of_size * costs.block(count / rows, width)
    if before is None or price is None:
        peak = max(
            0.0,
            *(
                costs.block(count / rows, width)
                for _, width, ranks in groups
                for count, _ in _block_rows(rows, len(ranks))
            ),
        )
        return LayoutOption(peak, kernel - kernel_now, True)
    peak, everyone, holders = _priced_row_layout(
        layout, groups, volumes, costs, world_size, before, price
    )
    added = kernel - kernel_now + everyone * world_size
    added += holders
    return LayoutOption(peak, added, True)


def _priced_row_layout(
    layout: TableLayout,
    groups: RowGroups,
    volumes: Tuple[float, float],
    costs: RowCosts,
    world_size: int,
    before: TableExchange,
    price: ExchangePrice,
) -> Tuple[float, float, float]:
    """
    A row layout's busiest rank (its block's kernel plus the exchange it
    adds there, as ``row_split_seconds`` prices each rank: a rank holding
    the table now against its own bytes before, any other against a rank
    holding none), the seconds it adds to every rank, and the seconds the
    holders' bytes add over that (after, the new holders' over a rank
    holding none; before, the old ones').
    """
    rows = layout.rows
    ids, samples = volumes
    per_byte = price.seconds_per_byte
    others = others_bytes(
        rows * len(groups),
        [width for _, width, _ in groups],
        rows,
        world_size,
        ids,
        samples,
    )
    spread = sum(1 for _, _, ranks in groups if len(ranks) > 1)
    spread -= row_blocks_spread(layout)
    fixed = 0.0
    if spread > 0:
        fixed = (
            price.seconds_per_id * ids / world_size * spread
            + price.seconds_per_collective * ROW_COLLECTIVES
        )
    peak = 0.0
    added_bytes = 0.0
    for _, width, ranks in groups:
        extra = block_output_bytes(len(ranks), width, world_size, samples)
        # the rows each rank holding the table now gets
        kept = {
            r: _index_rows(rows, len(ranks), ranks.index(r))
            for r in before.holders
            if r in ranks
        }
        for count, ranks_of_size in _block_rows(rows, len(ranks)):
            holder = others + rows_ids_bytes(count, rows, world_size, ids) + extra
            added_bytes += ranks_of_size * (holder - others)
            block = costs.block(count / rows, width)
            now = [before.holders[r] for r, got in kept.items() if got == count]
            if len(now) < ranks_of_size:  # a rank holding none of the table now
                now.append(before.others)
            for bytes_now in now:
                peak = max(peak, block + (holder - bytes_now) * per_byte + fixed)
    old_bytes = sum(v - before.others for v in before.holders.values())
    everyone = (others - before.others) * per_byte + fixed
    return peak, everyone, (added_bytes - old_bytes) * per_byte


def split_level(
    total: float, world_size: int, options: Mapping[int, Sequence[LayoutOption]]
) -> SplitLevel:
    """
    The least ``X`` at which every table of ``options`` has a layout whose
    busiest rank is at most ``X`` and the mean rank, each table in its
    cheapest such layout, is at most ``X``.

    Args:
        total (float): the seconds of all ranks together now (the tables
            of ``options`` in their layouts now).
        world_size (int): ranks of the group.
        options (Mapping[int, Sequence[LayoutOption]]): per hot table, the
            layouts it may take (at least one; its layout now among them,
            adding nothing).

    Returns:
        SplitLevel: the level, and the tables whose cheapest layout at it
        is by rows (ties to the column layout).
    """
    # per table, its layouts by peak, and the cheapest among the first i
    peaks: Dict[int, List[float]] = {}
    cheapest: Dict[int, List[Tuple[float, bool]]] = {}
    for t, table in sorted(options.items()):
        ordered = sorted(table, key=lambda o: (o.peak, o.added, o.by_rows))
        peaks[t] = [o.peak for o in ordered]
        best: List[Tuple[float, bool]] = []
        for o in ordered:
            here = (o.added, o.by_rows)
            best.append(here if not best or here < best[-1] else best[-1])
        cheapest[t] = best

    def choice(t: int, x: float) -> Optional[Tuple[float, bool]]:
        i = bisect.bisect_right(peaks[t], x)
        return cheapest[t][i - 1] if i else None

    def feasible(x: float) -> bool:
        added = 0.0
        for t in peaks:
            c = choice(t, x)
            if c is None:
                return False
            added += c[0]
        return (total + added) / world_size <= x

    # no level is below the mean rank with each table in its cheapest
    # layout, nor below any table's least busiest rank
    least = total + sum(c[-1][0] for c in cheapest.values())
    low = max([least / max(world_size, 1)] + [p[0] for p in peaks.values()])
    high = max([low] + [p[-1] for p in peaks.values()])
    while not feasible(high):  # the mean rank above every busiest rank
        high = high * 2 if high > 0 else 1.0
    if feasible(low):
        high = low
    else:
        for _ in range(LEVEL_STEPS):
            middle = (low + high) / 2
            if feasible(middle):
                high = middle
            else:
                low = middle
    chosen = {t: choice(t, high) for t in peaks}
    return SplitLevel(
        high, frozenset(t for t, c in chosen.items() if c is not None and c[1])
    )

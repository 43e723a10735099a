#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: row-wise splits in the per-window search, for a table hotter than
column splits can fix (its width allows only so many 4-column shards).

After the moves, while the slowest rank is above the mean, a table with a
shard on it whose narrowest column shard alone is worth more than the mean
rank (``costs.propose`` picks them; column splits run after, on the rest)
may be spread by rows, in the geometry TorchRec builds
(``sharding_plan.calculate_shard_sizes_and_offsets``; its input dist
bucketizes ids by blocks of ``ceil(rows / n)`` rows, one block per rank in
rank order, trailing ranks empty when rows run out):

* ``TABLE_ROW_WISE`` over the ranks of one host (``local_world_size``
  ranks, the host's ``h * L`` to ``h * L + L - 1``), tried on the hosts
  whose slowest rank is the least loaded;
* ``ROW_WISE`` over every rank of the group (TorchRec shards row-wise
  over the whole sharding environment; a plan cannot name a subset);
* ``GRID_SHARD``: ``k`` column blocks of equal width (a multiple of
  ``ALIGN``), each ``TABLE_ROW_WISE`` over the ranks of its own host, on the
  ``k`` hosts whose slowest rank is the least loaded (TorchRec's
  ``grid_shard(host_indexes)``; shards by column block, then by row block).

The price is the cost model's: a row block reads its share of the table's
ids (``ids x rows share x (cols + lookup_columns)`` elements), and every
rank of the table's row group writes the pooled output of every sample of
the global batch and reads its gradient (``samples x cols`` elements, what
a row-wise table costs more than a whole one: its partial sums are
reduce-scattered), whether its block holds many rows or none; a grid block
pays it for its own columns only. That per-rank part is what keeps a table
worth less than a host of ranks whole, and a table of a high pooling
factor off the whole group (on many ranks it is worth more than the mean
rank). The work outside the kernels a split changes (``exchange``: every
rank's bucketization of its ids, the row sharding's collectives, the ids
each block receives, the reduce-scatter of the pooled output and the
all-gather of its gradient) is priced at the figures the job measured
(``price``) on every rank it changes: the search takes a row split only
where it cuts the slowest rank's kernel plus exchange seconds (ranked by
the ranks it changes; every other rank's share only bars it); the loads
it returns hold both. Given the level the window's splits aim for
(``split_level.split_level``), a split whose loaded ranks stay within it
is ranked by what it adds to all ranks instead: a wider layout lowers no
rank that bounds the step there, and its ranks' fixed costs raise the
mean rank. A candidate is built only where a lower bound of
its peak (the most loaded rank it adds, with the smallest block, less the
most the exchange can save it) falls below the ceiling and the best score
so far: the same splits, without building the whole-group layouts (a
block per rank) that rarely win.

The same rules as moves and column splits: never over a rank's memory (a
rank holds its blocks in place of its old shard), the bytes moved (a rank
keeps the part of its old shard inside its block) priced at
``byte_price`` seconds per step, within ``move_budget`` bytes per rank,
ties to the lowest index (every rank finds the same splits). Only tables
the window has not moved (their bytes counted from the current plan),
whose sharding is table-wise, column-wise or table-column-wise and whose
constraints allow the row sharding type, are split; over hosts only when
the group is whole hosts. A row-wise, table-row-wise or grid table is not
moved or split again by the search (its row block is its rank's
position).
"""

import heapq
from dataclasses import dataclass
from typing import AbstractSet, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.rebalance.exchange_price import (
    Blocks,
    ExchangePrice,
    ID_BYTES,
    row_split_seconds,
)
from torchrec.distributed.resharding.rebalance.placement import MOVABLE_TYPES, Placement
from torchrec.distributed.resharding.rebalance.search import LoadHeaps
from torchrec.distributed.resharding.rebalance.splits import ALIGN
from torchrec.distributed.types import ShardingType

HOSTS: int = 4  # the least loaded hosts tried per table-row-wise split

# the tables a row split may take: those whose shards the search moves whole
ROW_SPLITTABLE_TYPES: Tuple[str, ...] = MOVABLE_TYPES
ROW_TYPES: Tuple[str, ...] = (
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.GRID_SHARD.value,
)


@dataclass(frozen=True)
class RowSplitResult:
    """
    What the row split search found.

    Args:
        layouts (Dict[str, TableLayout]): table key -> its row-wise layout
            (only the tables split).
        sharding_types (Dict[str, str]): table key -> ``row_wise``,
            ``table_row_wise`` or ``grid_shard``.
        loads (Tuple[float, ...]): per rank, the predicted load after.
        slowest_before (float): the slowest rank's load before.
        slowest_after (float): the same after the row splits.
        rank_bytes (Tuple[int, ...]): per rank, bytes sent plus received
            (the window's earlier steps' and the row splits').
        rank_used (Tuple[int, ...]): per rank, bytes of tables it holds
            after.
        exchange_seconds (Tuple[float, ...]): per rank, the seconds per step
            of communication the row splits add (in ``loads``; negative:
            saved).
    """

    layouts: Dict[str, TableLayout]
    sharding_types: Dict[str, str]
    loads: Tuple[float, ...]
    slowest_before: float
    slowest_after: float
    rank_bytes: Tuple[int, ...]
    rank_used: Tuple[int, ...]
    exchange_seconds: Tuple[float, ...] = ()

    @property
    def splits(self) -> int:
        """Tables spread by rows."""
        return len(self.layouts)


def row_blocks(rows: int, count: int) -> List[Tuple[int, int]]:
    """
    TorchRec's row blocks of a table of ``rows`` rows over ``count`` ranks:
    (first row, rows) per rank, ``ceil(rows / count)`` each, the last
    non-empty one shorter, any after it empty.
    """
    block = -(-rows // count)
    out = []
    for i in range(count):
        start = min(i * block, rows)
        out.append((start, min(block, rows - start)))
    return out


def row_wise_layout(rows: int, cols: int, ranks: Sequence[int]) -> TableLayout:
    """The layout of a table spread by rows over ``ranks`` (in that order)."""
    return grid_layout(rows, cols, [ranks])


def grid_layout(rows: int, cols: int, hosts: Sequence[Sequence[int]]) -> TableLayout:
    """
    The layout of a table cut in ``len(hosts)`` column blocks of equal width,
    block ``c`` spread by rows over ``hosts[c]`` (shards by block, then by
    row block: TorchRec's order).
    """
    width = cols // len(hosts)
    shards = tuple(
        PlacedShard(rank, Rect(start, c * width, count, width))
        for c, ranks in enumerate(hosts)
        for rank, (start, count) in zip(ranks, row_blocks(rows, len(ranks)))
    )
    return TableLayout(rows, cols, shards)


def grid_blocks(cols: int, hosts: int, align: int = ALIGN) -> List[int]:
    """
    The column block counts of a grid of a table of ``cols`` columns over at
    most ``hosts`` hosts: at least 2, dividing ``cols`` in widths that are
    multiples of ``align``.
    """
    return [
        k
        for k in range(2, min(hosts, cols // align) + 1)
        if cols % k == 0 and (cols // k) % align == 0
    ]


def host_ranks(world_size: int, local_world_size: int) -> List[List[int]]:
    """Each host's ranks (``local_world_size`` consecutive ranks)."""
    return [
        list(range(h, min(h + local_world_size, world_size)))
        for h in range(0, world_size, local_world_size)
    ]


@dataclass(frozen=True)
class RowCosts:
    """
    What one table costs spread by rows, in seconds per step.

    Args:
        ids (float): one column read by every id of the table (``ids x``
            seconds per element); a row block reads its share of them.
        lookup_columns (float): the fixed cost of a shard per id it reads,
            in columns.
        samples (float): one column of the pooled output of every sample
            (``samples x`` seconds per element), which each rank of a row
            group writes (and reads the gradient of), whatever its block.
    """

    ids: float
    lookup_columns: float
    samples: float

    def block(self, rows_share: float, cols: int) -> float:
        """A block of ``rows_share`` of the rows and ``cols`` columns."""
        return self.ids * rows_share * (cols + self.lookup_columns) + (
            self.samples * cols
        )


Grid = List[List[int]]  # per column block, the ranks of its row blocks
# a row split's outcome (``_RowSplits.outcome``)
Outcome = Tuple[
    float,
    int,
    Dict[int, float],
    Dict[int, int],
    Dict[int, int],
    float,
    Dict[int, float],
    float,
]


class _RowSplits(LoadHeaps):
    """The row split search's mutable state; ``run`` does the work."""

    def __init__(
        self,
        placement: Placement,
        loads: Sequence[float],
        costs: Sequence[float],
        where: Sequence[int],
        used: Sequence[int],
        traffic: Sequence[int],
        capacity: Sequence[float],
        row_costs: Mapping[int, RowCosts],
        allowed: Mapping[int, Tuple[str, ...]],
        byte_price: float,
        move_budget: Optional[int],
        local_world_size: int,
        volumes: Mapping[int, Tuple[float, float]],
        price: ExchangePrice,
        level: float,
    ) -> None:
        super().__init__(loads)
        self.placement = placement
        self.used: List[int] = list(used)
        self.traffic: List[int] = list(traffic)
        self.capacity = capacity
        self.row_costs = row_costs
        self.allowed = allowed
        self.byte_price = byte_price
        self.move_budget = move_budget
        world_size = placement.world_size
        self.world: List[int] = list(range(world_size))
        whole_hosts = 1 < local_world_size < world_size
        self.hosts: List[List[int]] = (
            host_ranks(world_size, local_world_size)
            if whole_hosts and world_size % local_world_size == 0
            else []
        )
        # per table: its shards as (rank, col, cols, bytes, cost); per rank
        # the tables it holds a shard of
        self.shards: Dict[int, List[Tuple[int, int, int, int, float]]] = {}
        self.on: List[Set[int]] = [set() for _ in range(world_size)]
        for unit, rank, cost in zip(placement.units, where, costs):
            if unit.table not in allowed:
                continue
            rect = placement.tables[unit.table].layout.shards[unit.shard].rect
            self.shards.setdefault(unit.table, []).append(
                (rank, rect.col, rect.cols, unit.nbytes, cost)
            )
            self.on[rank].add(unit.table)
        self.layouts: Dict[int, Tuple[str, Grid]] = {}
        self.volumes = volumes
        self.price = price
        self.level = level
        self.exchange: List[float] = [0.0] * world_size
        self.row_blocks: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}

    def blocks_of(self, rows: int, count: int) -> List[Tuple[int, int]]:
        """``row_blocks(rows, count)``, computed once per search."""
        key = (rows, count)
        blocks = self.row_blocks.get(key)
        if blocks is None:
            blocks = self.row_blocks[key] = row_blocks(rows, count)
        return blocks

    def exchange_change(self, t: int, blocks: Blocks) -> Tuple[Dict[int, float], float]:
        """
        Seconds per step table ``t`` laid out as ``blocks`` adds to each
        rank's communication: per rank holding a shard before or after, and
        for every other rank (none without a price or the table's volumes).
        """
        if not self.price.priced or t not in self.volumes:
            return {}, 0.0
        layout = self.placement.tables[t].layout
        ids, samples = self.volumes[t]
        return row_split_seconds(
            layout,
            blocks,
            self.placement.world_size,
            ids,
            samples,
            self.price,
        )

    def most_saved(self, t: int, blocks: int) -> float:
        """
        The most seconds table ``t`` in ``blocks`` column blocks saves the
        exchange of a rank that held none of it: the ids it sent to the
        shards the table had more of.
        """
        fewer = len(self.shards[t]) - blocks
        if fewer <= 0 or t not in self.volumes:
            return 0.0
        ids = self.volumes[t][0] / self.placement.world_size
        return self.price.seconds_per_byte * ids * ID_BYTES * fewer

    def outcome(
        self, t: int, grid: Grid, ceiling: float = float("inf")
    ) -> Optional[Outcome]:
        """
        Table ``t`` laid out as ``grid`` (its column blocks' ranks): (the
        highest load of a rank it changes, the bytes moved, and per rank
        changed its load, its bytes held and its bytes sent plus received
        after, the seconds it adds to every other rank's exchange, per rank
        changed the seconds it adds to its exchange, and the highest load of
        a rank of ``grid``); None where a
        rank's memory or the move budget refuses it, or where a rank that
        held none of the table reaches ``ceiling`` before the exchange, less
        the most the exchange can save such a rank (it starts receiving ids
        and exchanging output; it saves only the ids it no longer sends to
        shards the table had more of than column blocks it gets).
        """
        table = self.placement.tables[t]
        rows, cols = table.layout.rows, table.layout.cols
        element_bytes = table.element_bytes
        price = self.row_costs[t]
        old: Dict[int, Tuple[int, int]] = {}  # rank -> its old shard's columns
        load: Dict[int, float] = {}
        used: Dict[int, int] = {}
        moved: Dict[int, int] = {}
        for rank, col, width, nbytes, cost in self.shards[t]:
            old[rank] = (col, width)
            load[rank] = self.load[rank] - cost
            used[rank] = self.used[rank] - nbytes
            moved[rank] = nbytes  # sent, less what it keeps below
        sent = sum(moved.values())
        width = cols // len(grid)
        block_cost: Dict[int, float] = {}  # rows of a block -> its cost
        blocks: List[Tuple[Tuple[int, int], List[Tuple[int, int]]]] = []
        for c, ranks in enumerate(grid):
            first = c * width
            shards: List[Tuple[int, int]] = []
            blocks.append(((first, width), shards))
            for rank, (_, count) in zip(ranks, self.blocks_of(rows, len(ranks))):
                shards.append((rank, count))
                kept = 0
                if rank in old:  # its old shard spans every row
                    col, old_width = old[rank]
                    overlap = min(col + old_width, first + width) - max(col, first)
                    kept = count * max(overlap, 0) * element_bytes
                block = count * width * element_bytes
                cost = block_cost.get(count)
                if cost is None:
                    cost = block_cost[count] = price.block(count / rows, width)
                load[rank] = load.get(rank, self.load[rank]) + cost
                used[rank] = used.get(rank, self.used[rank]) + block
                moved[rank] = moved.get(rank, 0) - 2 * kept + block
                sent -= kept
        saved = self.most_saved(t, len(grid))
        if any(v - saved >= ceiling for r, v in load.items() if r not in old):
            return None
        exchange, others = self.exchange_change(t, blocks)
        for rank, seconds in exchange.items():
            load[rank] = load.get(rank, self.load[rank]) + seconds
        peak = max(load.values())
        loaded = max(load[rank] for ranks in grid for rank in ranks)
        budget = self.move_budget
        for rank, value in used.items():
            if value > self.used[rank] and value > self.capacity[rank]:
                return None
            if budget is not None and moved[rank] > 0:
                if self.traffic[rank] + moved[rank] > budget:
                    return None
        traffic = {r: self.traffic[r] + v for r, v in moved.items()}
        return peak, sent, load, used, traffic, others, exchange, loaded

    def host_peaks(self) -> List[float]:
        """Per host, its slowest rank's load."""
        load = self.load
        return [max([load[r] for r in ranks]) for ranks in self.hosts]

    def hosts_by_peak(self, peaks: Optional[Sequence[float]] = None) -> List[int]:
        """
        The hosts by their slowest rank's load (``peaks``: ``host_peaks()``,
        computed when not given), the least loaded first.
        """
        if peaks is None:
            peaks = self.host_peaks()
        return [h for _, h in sorted(zip(peaks, range(len(peaks))))]

    def candidates(
        self, t: int, hosts: Optional[Sequence[int]] = None
    ) -> List[Tuple[str, Grid]]:
        """
        (sharding type, grid) of each row split of ``t`` tried (``hosts``:
        ``hosts_by_peak()``, computed when not given).
        """
        out: List[Tuple[str, Grid]] = []
        allowed = self.allowed[t]
        if hosts is None:
            hosts = self.hosts_by_peak()
        if ShardingType.TABLE_ROW_WISE.value in allowed:
            for h in hosts[:HOSTS]:
                out.append((ShardingType.TABLE_ROW_WISE.value, [self.hosts[h]]))
        if ShardingType.ROW_WISE.value in allowed:
            out.append((ShardingType.ROW_WISE.value, [self.world]))
        if ShardingType.GRID_SHARD.value in allowed and hosts:
            cols = self.placement.tables[t].layout.cols
            for k in grid_blocks(cols, len(hosts)):
                grid = [self.hosts[h] for h in hosts[:k]]
                out.append((ShardingType.GRID_SHARD.value, grid))
        return out

    def least_peak(
        self,
        t: int,
        grid: Grid,
        old: AbstractSet[int],
        order: Sequence[int],
        host_peak: Sequence[float],
    ) -> float:
        """
        A lower bound of the highest load ``outcome`` gives a rank that held
        none of table ``t`` (the most loaded such rank of ``grid`` with the
        smallest block, less the most the exchange can save it), or minus
        infinity: what prunes a candidate before its layout is built
        (``old``: the ranks holding the table; ``order``: the ranks by
        load, the highest first; ``host_peak``: ``host_peaks()``).
        """
        top = float("-inf")
        if len(grid) == 1 and len(grid[0]) == len(self.load):  # the whole group
            for rank in order:
                if rank not in old:
                    top = self.load[rank]
                    break
        else:
            for ranks in grid:
                h = ranks[0] // len(ranks)
                host = h < len(self.hosts) and self.hosts[h] is ranks
                if host and old.isdisjoint(ranks):
                    top = max(top, host_peak[h])
                else:
                    for rank in ranks:
                        if rank not in old:
                            top = max(top, self.load[rank])
        if top == float("-inf"):
            return top
        layout = self.placement.tables[t].layout
        # the last of row_blocks(rows, n), the smallest
        n = len(grid[0])
        block = -(-layout.rows // n)
        least = min(block, layout.rows - min((n - 1) * block, layout.rows))
        width = layout.cols // len(grid)
        bound = top + self.row_costs[t].block(least / layout.rows, width)
        bound -= self.most_saved(t, len(grid))
        return bound - abs(bound) * 1e-9  # below any rounding of outcome's sums

    def highest_other(
        self, order: Sequence[int], changed: Mapping[int, float]
    ) -> float:
        """The highest load of a rank outside ``changed`` (``order``: by load)."""
        for rank in order:
            if rank not in changed:
                return self.load[rank]
        return 0.0

    def best(
        self, s: int, ceiling: float
    ) -> Optional[Tuple[float, int, int, str, Grid, Outcome]]:
        """
        (score, table, candidate index, type, grid, outcome) of the best row
        split off ``s``: the least score, the lowest table and candidate
        index among equals. The score is the highest load of a rank the
        split loads (its blocks' ranks) plus its bytes' price: the ranks it
        relieves keep what else they hold whatever the layout, so ranking
        by them ties every layout of a table and took the first (one host's
        eight ranks for a table worth 33 mean ranks, where a grid over 16
        hosts left each rank a quarter of one). Splits whose score is
        within the level (``self.level``, ``split_level``) come first,
        ranked by what they add to all ranks plus their bytes' price. A
        candidate whose ``least_peak`` already reaches the ceiling, or the
        best score so far (the level, once a split within it is found), is
        not built (its score is at least that bound; an equal score loses
        to the lower index, and whole-group ones, the costliest to build,
        are built last).
        """
        best: Optional[Tuple[float, int, int, str, Grid, Outcome]] = None
        world_size = len(self.load)
        order = [r for _, r in sorted(zip([-v for v in self.load], range(world_size)))]
        host_peak = self.host_peaks()
        hosts = self.hosts_by_peak(host_peak)
        holders = {
            t: {rank for rank, _, _, _, _ in self.shards[t]}
            for t in self.on[s]
            if t not in self.layouts
        }
        tried = [
            (len(grid) == 1 and len(grid[0]) == world_size, t, n, kind, grid)
            for t in sorted(holders)
            for n, (kind, grid) in enumerate(self.candidates(t, hosts))
        ]
        level = self.level
        best_key: Optional[Tuple[int, float, int, int]] = None
        for _, t, n, kind, grid in sorted(tried, key=lambda c: c[:3]):
            bound = self.least_peak(t, grid, holders[t], order, host_peak)
            if bound >= ceiling:
                continue
            if best_key is not None and bound > (
                level if best_key[0] == 0 else best_key[1]
            ):
                continue
            result = self.outcome(t, grid, ceiling)
            if result is None:
                continue
            peak, sent, others = result[0], result[1], result[5]
            # ranked by the ranks it loads; the ranks it relieves and every
            # other rank only bar it
            cost = self.byte_price * sent
            score = result[7] + cost
            rest = 0.0
            if others > 0:  # every other rank's bucketization, collectives
                rest = self.highest_other(order, result[2]) + others
            if max(peak, rest) >= ceiling or peak + cost >= ceiling:
                continue
            # within the level, a wider layout lowers no rank that bounds
            # the step: the least added to all ranks wins (``split_level``)
            if score <= level:
                here = (0, self.added(result) + cost, t, n)
            else:
                here = (1, score, t, n)
            if best_key is None or here < best_key:
                best_key = here
                best = (score, t, n, kind, grid, result)
        return best

    def added(self, result: Outcome) -> float:
        """The seconds a split's ``result`` adds to all ranks together."""
        load, others = result[2], result[5]
        change = sum(value - self.load[rank] for rank, value in load.items())
        return change + others * (len(self.load) - len(load))

    def apply(self, t: int, kind: str, grid: Grid, result: Outcome) -> None:
        """Lays table ``t`` out as ``grid`` (of type ``kind``), ``result`` its outcome."""
        _, _, load, used, traffic, others, exchange, _ = result
        for rank in sorted(load):
            self.set_load(rank, load[rank])
            self.used[rank] = used[rank]
            self.traffic[rank] = traffic[rank]
        for rank, seconds in exchange.items():
            self.exchange[rank] += seconds
        if others:
            for rank in range(self.placement.world_size):
                if rank not in load:
                    self.load[rank] += others
                    self.exchange[rank] += others
            self.reset_heaps()
        for rank, _, _, _, _ in self.shards[t]:
            self.on[rank].discard(t)
        self.layouts[t] = (kind, [list(ranks) for ranks in grid])

    def reset_heaps(self) -> None:
        """Rebuilds the load heaps from the loads (after most ranks changed)."""
        self.high = [(-v, r) for r, v in enumerate(self.load)]
        self.low = [(v, r) for r, v in enumerate(self.load)]
        heapq.heapify(self.high)
        heapq.heapify(self.low)

    def run(self, floor: float, min_cut: float, max_splits: int) -> None:
        while len(self.layouts) < max_splits:
            s = self.slowest()
            top = self.load[s]
            if top <= floor:
                break
            best = self.best(s, top * (1.0 - min_cut))
            if best is None:
                break
            _, t, _, kind, grid, result = best
            self.apply(t, kind, grid, result)


def search_row_splits(
    placement: Placement,
    loads: Sequence[float],
    costs: Sequence[float],
    capacity: Sequence[float],
    row_costs: Mapping[int, RowCosts],
    allowed: Mapping[int, Tuple[str, ...]],
    where: Optional[Sequence[int]] = None,
    used: Optional[Sequence[int]] = None,
    traffic: Optional[Sequence[int]] = None,
    byte_price: float = 0.0,
    move_budget: Optional[int] = None,
    local_world_size: Optional[int] = None,
    min_cut: float = 0.005,
    max_splits: Optional[int] = None,
    volumes: Optional[Mapping[int, Tuple[float, float]]] = None,
    price: Optional[ExchangePrice] = None,
    level: float = 0.0,
) -> RowSplitResult:
    """
    Spreads hot tables by rows (over one host's ranks, the whole group, or
    column blocks over hosts) while that cuts the slowest rank.

    Args:
        placement (Placement): the placement before the window's changes.
        loads (Sequence[float]): per rank, its load after the window's
            moves.
        costs (Sequence[float]): per unit of ``placement``, its share of its
            rank's load.
        capacity (Sequence[float]): per rank, the most bytes it may hold.
        row_costs (Mapping[int, RowCosts]): per table index that may be
            split, what its row blocks cost.
        allowed (Mapping[int, Tuple[str, ...]]): per table index that may be
            split (not moved by the window, of a type in
            ``ROW_SPLITTABLE_TYPES``), the row sharding types its
            constraints allow.
        where (Optional[Sequence[int]]): per unit, its rank now (default:
            where it is).
        used (Optional[Sequence[int]]): per rank, bytes of tables it holds
            now (default: the placement's).
        traffic (Optional[Sequence[int]]): per rank, bytes the window's
            earlier steps send plus receive.
        byte_price (float): seconds per step one byte moved costs.
        move_budget (Optional[int]): the most bytes a rank may send plus
            receive (None: no limit).
        local_world_size (Optional[int]): ranks per host (None, the group or
            a group of partial hosts: no table-row-wise or grid split).
        min_cut (float): the least relative cut of the slowest rank a split
            must make.
        max_splits (Optional[int]): the most tables split (default: one per
            host, at least one).
        volumes (Optional[Mapping[int, Tuple[float, float]]]): per table
            index, its ids and samples per step over all ranks (for the
            exchange's bytes; a table without them is priced no exchange).
        price (Optional[ExchangePrice]): the measured figures that price
            the work outside the kernels a split adds (None: not priced).
        level (float): the level the splits aim for (``split_level``): a
            split whose loaded ranks stay within it is ranked by what it
            adds to all ranks, the least first, ahead of any other, ranked
            by its loaded ranks' highest load (0: every split by that).

    Returns:
        RowSplitResult: the split tables' layouts and the loads after.
    """
    world_size = placement.world_size
    if len(placement.units) != len(costs):
        raise ValueError(f"{len(placement.units)} units but {len(costs)} costs")
    if not (len(loads) == len(capacity) == world_size):
        raise ValueError(
            f"{world_size} ranks but {len(loads)} loads, {len(capacity)} capacities"
        )
    for t in allowed:
        kind = placement.tables[t].sharding_type
        if kind not in ROW_SPLITTABLE_TYPES or t not in row_costs:
            raise ValueError(f"table {t} ({kind}) cannot be split by rows")
    lws = local_world_size or world_size
    state = _RowSplits(
        placement,
        loads,
        costs,
        where if where is not None else [u.rank for u in placement.units],
        used if used is not None else placement.rank_bytes(),
        traffic if traffic is not None else [0] * world_size,
        capacity,
        row_costs,
        allowed,
        byte_price,
        move_budget,
        lws,
        volumes or {},
        price or ExchangePrice(),
        level,
    )
    before = max(loads, default=0.0)
    if loads and before > 0:
        mean = sum(loads) / world_size
        limit = max_splits if max_splits is not None else max(1, -(-world_size // lws))
        state.run(mean * (1.0 + 1e-9), min_cut, limit)
    layouts: Dict[str, TableLayout] = {}
    types: Dict[str, str] = {}
    for t, (kind, grid) in sorted(state.layouts.items()):
        table = placement.tables[t]
        layout = table.layout
        layouts[table.key] = grid_layout(layout.rows, layout.cols, grid)
        types[table.key] = kind
    return RowSplitResult(
        layouts=layouts,
        sharding_types=types,
        loads=tuple(state.load),
        slowest_before=before,
        slowest_after=max(state.load, default=0.0),
        rank_bytes=tuple(state.traffic),
        rank_used=tuple(state.used),
        exchange_seconds=tuple(state.exchange),
    )

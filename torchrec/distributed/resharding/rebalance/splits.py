#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: splits of hot shards in the per-window search, for what moving whole
shards cannot fix (a table hotter than the mean rank), and merges of shards
that a rank is better without.

After the moves (``search.search_moves``), while the slowest rank can be
cut, a splittable shard on it is cut by columns: its left part stays, its
right part, as wide as best evens the two ranks, goes to one of the least
loaded ranks (the split that leaves the pair lowest wins). Where no such
rank can take even the narrowest piece (a shard worth about the mean rank,
its half more than any rank's room), the receiver makes room first: it hands
one of its own shards on to a third of the least loaded ranks, whole or the
piece of it that best evens the two, whichever leaves all three lowest
(without it the search stalls with such a shard on the slowest rank, 1.17x
the mean at 64 ranks x 100 tables on a Zipf 1.1 load). A table-wise table
becomes column-wise with two shards, a column-wise one gets one shard more
(``k`` shards become ``2k`` after ``k`` splits). A shard on the slowest rank
may instead be merged into the shard of its table next to it (the columns on
either side) on another rank: the slowest rank sheds its columns and the
fixed cost of a shard, the other takes the columns only, and the table has
one shard fewer (column-wise still, with one shard spanning its columns when
one is left). Each step takes the split or merge that leaves the pair of
ranks lowest. The same rules as moves: never over a rank's memory, never two
shards of a table on one rank, the bytes moved priced at ``byte_price``
seconds per step (a split that does not pay for its bytes is not made),
within ``move_budget`` bytes per rank, ties to the lowest index (every rank
finds the same splits). The geometry is the engine's: column-wise shards
span every row and tile the columns, each ``ALIGN`` columns wide or a
multiple of it (fbgemm's kernels need widths that are multiples of 4).
Row-wise, grid and data-parallel tables, and tables whose user constraints
name no column-wise sharding, are never split. The cost of a shard is its
table's cost per column times its width (an id reads every column of a
column-wise table once) plus the table's fixed cost per shard (``fixed``:
every shard reads every id of the table, whatever its width), which the
receiver of a piece pays anew.

With the exchange priced (``exchange``, per table its
``ColumnShardSeconds``), a shard's holder also pays the ids it receives (per
shard, with its fixed cost) and its columns' output exchanged (per column,
with its cost per column), and every rank pays the ids it sends to one shard
more (a lift of every rank's load, after a merge a drop): a split is taken
only where the slowest rank's kernel plus exchange seconds, the lift
included, fall by the least cut (a rank tied with it rises by the lift and
is cut next; barring that, two tied ranks stalled every priced split); a
split that makes its module's first column-wise table also lifts every rank
by that sharding's own collectives; the proposal is judged whole
(``costs.propose``'s saving holds every rank's lift). Priced so, a piece of
a hot narrow table, whose holder receives every one of its ids, costs about
what its kernel saves (at 1,024 ranks x 1,000 tables the cuts the kernels
alone asked for raised the slowest rank's kernel plus exchange seconds from
26.5 to 33.8 mean ranks).
"""

from dataclasses import dataclass, replace
from typing import AbstractSet, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.rebalance.exchange_price import ColumnShardSeconds
from torchrec.distributed.resharding.rebalance.placement import Placement
from torchrec.distributed.resharding.rebalance.search import LoadHeaps
from torchrec.distributed.types import ShardingType

ALIGN: int = 4  # a split shard's width is a multiple of this
RECEIVERS: int = 8  # the least loaded ranks tried per split
UNPRICED: ColumnShardSeconds = ColumnShardSeconds()

SPLITTABLE_TYPES: Tuple[str, ...] = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
)


@dataclass(frozen=True)
class SplitResult:
    """
    What the split search found.

    Args:
        layouts (Dict[str, TableLayout]): table key -> its layout after the
            splits and merges (only tables changed; shards by column).
        sharding_types (Dict[str, str]): table key -> its sharding type
            after (column-wise for every table split or merged, a table
            merged into one shard too: the user's constraints allow
            column-wise; a table whose shard was only handed on whole keeps
            its type).
        loads (Tuple[float, ...]): per rank, the predicted load after.
        slowest_before (float): the slowest rank's load before.
        slowest_after (float): the same after the splits.
        rank_bytes (Tuple[int, ...]): per rank, bytes sent plus received
            (the moves' and the splits').
        splits (int): shards cut in two (a receiver's piece handed on too).
        merges (int): shards merged into a neighbour.
        exchange_seconds (Tuple[float, ...]): per rank, the seconds per step
            of communication the splits and merges add (in ``loads``;
            negative: saved; empty where the exchange was not priced).
    """

    layouts: Dict[str, TableLayout]
    sharding_types: Dict[str, str]
    loads: Tuple[float, ...]
    slowest_before: float
    slowest_after: float
    rank_bytes: Tuple[int, ...]
    splits: int
    merges: int = 0
    exchange_seconds: Tuple[float, ...] = ()


def split_width(cols: int, align: int = ALIGN) -> Optional[int]:
    """
    The width of the left half when a shard of ``cols`` columns is halved
    (both halves multiples of ``align``, the left the wider), None if it
    cannot be.
    """
    blocks = cols // align
    if cols % align or blocks < 2:
        return None
    return (blocks - blocks // 2) * align


def cut_width(cols: int, gap_cols: float, align: int = ALIGN) -> int:
    """
    The width of the piece cut off a shard of ``cols`` columns (a multiple
    of ``align``, leaving at least ``align``) that best evens two ranks
    whose loads differ by ``gap_cols`` columns' worth of the table.
    """
    blocks = round(gap_cols / 2 / align)
    return max(1, min(blocks, cols // align - 1)) * align


class _Splits(LoadHeaps):
    """The split search's mutable state; ``run`` does the work."""

    def __init__(
        self,
        placement: Placement,
        loads: Sequence[float],
        costs: Sequence[float],
        capacity: Sequence[float],
        byte_price: float,
        move_budget: Optional[int],
        traffic: Sequence[int],
        splittable: AbstractSet[str],
        align: int,
        where: Sequence[int],
        fixed: Sequence[float],
        used: Optional[Sequence[int]],
        exchange: Mapping[int, ColumnShardSeconds],
    ) -> None:
        super().__init__(loads)
        world_size = placement.world_size
        self.placement = placement
        self.capacity = capacity
        self.byte_price = byte_price
        self.move_budget = move_budget
        self.align = align
        self.used: List[int] = [0] * world_size if used is None else list(used)
        self.traffic: List[int] = list(traffic)
        # per table: its shards as [rank, col, cols], its cost per column,
        # bytes per column, the ranks holding a shard
        self.shards: Dict[int, List[List[int]]] = {}
        self.per_col: Dict[int, float] = {}
        self.fixed: Dict[int, float] = {}
        self.bytes_per_col: Dict[int, float] = {}
        self.holders: Dict[int, Set[int]] = {}
        self.on: List[Set[int]] = [set() for _ in range(world_size)]
        rank_of: Dict[Tuple[int, int], int] = {}
        for unit, rank in zip(placement.units, where):
            if used is None:
                self.used[rank] += unit.nbytes
            self.holders.setdefault(unit.table, set()).add(rank)
            rank_of[(unit.table, unit.shard)] = rank
        for t, table in enumerate(placement.tables):
            layout = table.layout
            if (
                table.key not in splittable
                or table.sharding_type not in SPLITTABLE_TYPES
                or layout.replicated
                or any(s.rect.rows != layout.rows for s in layout.shards)
            ):
                continue
            self.shards[t] = [
                [rank_of[(t, k)], s.rect.col, s.rect.cols]
                for k, s in enumerate(layout.shards)
            ]
            self.per_col[t] = 0.0
            self.fixed[t] = fixed[t]
            self.bytes_per_col[t] = layout.rows * table.element_bytes
            for rank, _, _ in self.shards[t]:
                self.on[rank].add(t)
        for unit, cost in zip(placement.units, costs):
            if unit.table in self.per_col:
                self.per_col[unit.table] += (
                    cost - self.fixed[unit.table]
                ) / placement.tables[unit.table].layout.cols
        # the exchange priced: in the loads of the holders (per shard with
        # the fixed cost, per column with the cost per column), and every
        # rank's lift (kept apart: it moves no rank past another)
        self.priced: Dict[int, ColumnShardSeconds] = {
            t: seconds for t, seconds in exchange.items() if t in self.per_col
        }
        for t, seconds in self.priced.items():
            self.per_col[t] += seconds.column
            self.fixed[t] += seconds.shard
        # the modules holding a column-wise table: a split of a table of any
        # other module adds the column-wise sharding's collectives
        column_wise = ShardingType.COLUMN_WISE.value
        self.column_wise_paths: Set[str] = {
            table.path
            for table in placement.tables
            if table.sharding_type == column_wise
        }
        self.exchange: List[float] = [0.0] * world_size
        self.lift = 0.0
        self.split_tables: Set[int] = set()
        self.changed: Set[int] = set()  # tables with a shard handed on whole
        self.merges = 0

    def seconds(self, t: int) -> ColumnShardSeconds:
        """What a column shard of table ``t`` adds outside the kernels (nothing unpriced)."""
        return self.priced.get(t, UNPRICED)

    def split_lift(self, t: int, also: int = -1) -> float:
        """
        What a split of table ``t`` adds to every rank: its ids sent to one
        shard more, and the column-wise sharding's collectives where it
        makes its module's first column-wise table (not where table
        ``also``, split in the same step, makes it).
        """
        seconds = self.seconds(t)
        path = self.placement.tables[t].path
        if path in self.column_wise_paths or (
            also >= 0 and self.placement.tables[also].path == path
        ):
            return seconds.everyone
        return seconds.everyone + seconds.sharding

    def room(self, s: int, d: int, nbytes: int) -> bool:
        """Whether ``d`` can take ``nbytes`` more within memory and the move budget."""
        if self.used[d] + nbytes > self.capacity[d]:
            return False
        budget = self.move_budget
        return budget is None or (
            self.traffic[s] + nbytes <= budget and self.traffic[d] + nbytes <= budget
        )

    def send(self, s: int, d: int, nbytes: int) -> None:
        """Books ``nbytes`` of table state going from ``s`` to ``d``."""
        self.used[s] -= nbytes
        self.used[d] += nbytes
        self.traffic[s] += nbytes
        self.traffic[d] += nbytes

    def best_split(
        self, s: int, receivers: Sequence[int], ceiling: float
    ) -> Optional[Tuple[float, int, int, int, int, int, int, int, int]]:
        """
        The best split off ``s``: (score, table, shard index, receiver, left
        width, and what the receiver hands on to make room: its table,
        index, rank and the width it keeps, -1 each when it hands on none).
        """
        top = self.load[s]
        align = self.align
        best: Optional[Tuple[float, int, int, int, int, int, int, int, int]] = None
        for t in sorted(self.on[s]):
            per_col, fixed = self.per_col[t], self.fixed[t]
            if per_col <= 0:
                continue
            lift = self.split_lift(t)
            for k, (rank, _, cols) in enumerate(self.shards[t]):
                if rank != s or cols < 2 * align or cols % align:
                    continue
                if top - per_col * (cols - align) + lift >= ceiling:
                    continue  # even the widest piece cuts too little
                for d in receivers:
                    if d in self.holders[t]:
                        continue
                    gap = (top - self.load[d] - fixed) / per_col
                    right = cut_width(cols, gap, align)
                    moved = per_col * right
                    after = self.load[d] + moved + fixed
                    nbytes = int(self.bytes_per_col[t] * right)
                    if top - moved + lift >= ceiling:
                        continue
                    handed: Tuple[int, int, int, int] = (-1, -1, -1, -1)
                    extra, total = 0, lift
                    if after + lift >= ceiling:
                        # what a room made must stay at to score the best so far
                        # (with a margin over the sums' rounding: an equal
                        # score may still win on a lower index)
                        limit = float("inf")
                        if best is not None:
                            limit = best[0] - lift - self.byte_price * nbytes
                            limit += abs(best[0]) * 1e-9
                            if top - moved > limit:
                                continue
                        # the receiver makes room: one of its shards goes on
                        room = self.best_room(
                            s, d, t, after, nbytes, receivers, ceiling - lift, limit
                        )
                        if room is None:
                            continue
                        after, extra, handed = room[0], room[1], room[2:6]
                        total += room[6]
                    elif not self.room(s, d, nbytes):
                        continue
                    pair = max(top - moved, after) + total
                    score = pair + self.byte_price * (nbytes + extra)
                    if score >= ceiling:
                        continue
                    candidate = (score, t, k, d, cols - right) + handed
                    if best is None or candidate < best:
                        best = candidate
        return best

    def best_room(
        self,
        s: int,
        d: int,
        t: int,
        after: float,
        nbytes: int,
        receivers: Sequence[int],
        ceiling: float,
        limit: float = float("inf"),
    ) -> Optional[Tuple[float, int, int, int, int, int, float]]:
        """
        What ``d`` hands on to a third rank so that it can take a piece of
        table ``t`` from ``s`` (``nbytes``, leaving it at ``after``): one of
        its shards whole, or the piece of one that best evens the two ranks.
        Returns (the higher of the two ranks after, the bytes handed on,
        the table, the shard's index, the third rank, the width ``d`` keeps,
        0 for the whole shard, and the lift of every rank: the exchange of
        the piece's new shard), the lowest (lift included) first; None if
        nothing gets both ranks under ``ceiling``, or at most ``limit`` (what
        would score no better than the caller's best so far is not looked
        at: where few receivers can take a piece outright, at 64 ranks x
        1,000 tables priced, looking at every room took 50 ms a window).
        """
        best: Optional[Tuple[float, int, int, int, int, int, float]] = None
        capacity, budget, align = self.capacity, self.move_budget, self.align
        for u in sorted(self.on[d]):
            if u == t:
                continue
            per_col, fixed = self.per_col[u], self.fixed[u]
            for j, (rank, _, cols) in enumerate(self.shards[u]):
                if rank != d:
                    continue
                least = after - per_col * cols - fixed
                if least >= ceiling or least > limit:
                    continue  # even the whole shard is too little
                for e in receivers:
                    if e == s or e == d or e in self.holders[u]:
                        continue
                    options = [(cols, per_col * cols + fixed, 0)]
                    if per_col > 0 and cols >= 2 * align and cols % align == 0:
                        gap = (after - self.load[e] - fixed) / per_col
                        piece = cut_width(cols, gap, align)
                        options.append((piece, per_col * piece, cols - piece))
                    for width, shed, kept in options:
                        gained = shed + (fixed if kept else 0.0)
                        lift = self.split_lift(u, also=t) if kept else 0.0
                        higher = max(after - shed, self.load[e] + gained)
                        if higher + lift >= ceiling or higher + lift > limit:
                            continue
                        handed = int(self.bytes_per_col[u] * width)
                        if (
                            self.used[d] + nbytes - handed > capacity[d]
                            or self.used[e] + handed > capacity[e]
                        ):
                            continue
                        if budget is not None and (
                            self.traffic[s] + nbytes > budget
                            or self.traffic[d] + nbytes + handed > budget
                            or self.traffic[e] + handed > budget
                        ):
                            continue
                        candidate = (higher + lift, handed, u, j, e, kept, lift)
                        if best is None or candidate < best:
                            best = candidate
        if best is None:
            return None
        return (best[0] - best[6],) + best[1:]

    def hand_on(self, u: int, j: int, e: int) -> None:
        """Moves shard ``j`` of table ``u`` whole to rank ``e``."""
        shard = self.shards[u][j]
        d, cols = shard[0], shard[2]
        cost = self.per_col[u] * cols + self.fixed[u]
        seconds = self.seconds(u)
        exchange = seconds.column * cols + seconds.shard
        self.exchange[d] -= exchange
        self.exchange[e] += exchange
        shard[0] = e
        self.holders[u].discard(d)
        self.holders[u].add(e)
        self.on[d].discard(u)
        self.on[e].add(u)
        self.send(d, e, int(self.bytes_per_col[u] * cols))
        self.set_load(d, self.load[d] - cost)
        self.set_load(e, self.load[e] + cost)
        self.changed.add(u)

    def best_merge(
        self, s: int, ceiling: float
    ) -> Optional[Tuple[float, int, int, int, int]]:
        """(score, table, shard index, its neighbour's index, receiver) of the best merge."""
        top = self.load[s]
        best: Optional[Tuple[float, int, int, int, int]] = None
        for t in sorted(self.on[s]):
            per_col, fixed = self.per_col[t], self.fixed[t]
            lift = -self.seconds(t).everyone  # every rank sends to one shard less
            shards = self.shards[t]
            for k, (rank, col, cols) in enumerate(shards):
                if rank != s:
                    continue
                moved = per_col * cols
                nbytes = int(self.bytes_per_col[t] * cols)
                for j, (d, other_col, other_cols) in enumerate(shards):
                    if other_col + other_cols != col and other_col != col + cols:
                        continue  # not a neighbour
                    after = self.load[d] + moved + lift
                    if after >= ceiling or top - moved - fixed + lift >= ceiling:
                        continue
                    if not self.room(s, d, nbytes):
                        continue
                    score = max(top - moved - fixed + lift, after)
                    score += self.byte_price * nbytes
                    if score >= ceiling:
                        continue
                    candidate = (score, t, k, j, d)
                    if best is None or candidate < best:
                        best = candidate
        return best

    def merge(self, s: int, t: int, k: int, j: int, d: int) -> None:
        """Merges shard ``k`` of table ``t`` (on ``s``) into its neighbour ``j`` on ``d``."""
        shards = self.shards[t]
        _, col, cols = shards[k]
        _, other_col, other_cols = shards[j]
        moved = self.per_col[t] * cols
        nbytes = int(self.bytes_per_col[t] * cols)
        seconds = self.seconds(t)
        columns = seconds.column * cols
        self.exchange[s] -= columns + seconds.shard
        self.exchange[d] += columns
        self.lift -= seconds.everyone
        shards[j] = [d, min(col, other_col), cols + other_cols]
        del shards[k]
        self.holders[t].discard(s)
        self.on[s].discard(t)
        self.send(s, d, nbytes)
        self.set_load(s, self.load[s] - moved - self.fixed[t])
        self.set_load(d, self.load[d] + moved)
        self.split_tables.add(t)
        self.merges += 1

    def apply(self, s: int, t: int, k: int, d: int, left: int) -> None:
        rank, col, cols = self.shards[t][k]
        right = cols - left
        moved = self.per_col[t] * right
        nbytes = int(self.bytes_per_col[t] * right)
        seconds = self.seconds(t)
        columns = seconds.column * right
        self.lift += self.split_lift(t)
        self.column_wise_paths.add(self.placement.tables[t].path)
        self.exchange[s] -= columns
        self.exchange[d] += columns + seconds.shard
        self.shards[t][k] = [rank, col, left]
        self.shards[t].append([d, col + left, right])
        self.holders[t].add(d)
        self.on[d].add(t)
        self.send(s, d, nbytes)
        self.set_load(s, self.load[s] - moved)
        self.set_load(d, self.load[d] + moved + self.fixed[t])
        self.split_tables.add(t)

    def run(self, floor: float, min_cut: float, max_splits: int) -> int:
        splits = 0
        while splits < max_splits and self.merges < max_splits:
            s = self.slowest()
            top = self.load[s]
            if top <= floor:
                break
            # the lift of every rank is not in the loads; the cut is of the
            # slowest rank's seconds with it
            ceiling = (top + self.lift) * (1.0 - min_cut) - self.lift
            split = self.best_split(s, self.least_loaded(RECEIVERS, s), ceiling)
            merge = self.best_merge(s, ceiling)
            if merge is not None and (split is None or merge[0] < split[0]):
                _, t, k, j, d = merge
                self.merge(s, t, k, j, d)
            elif split is not None:
                _, t, k, d, left, u, j, e, kept = split
                self.apply(s, t, k, d, left)
                splits += 1
                if u >= 0 and kept > 0:
                    self.apply(d, u, j, e, kept)
                    splits += 1
                elif u >= 0:
                    self.hand_on(u, j, e)
            else:
                break
        return splits

    def layouts(self) -> Tuple[Dict[str, TableLayout], Dict[str, str]]:
        layouts: Dict[str, TableLayout] = {}
        types: Dict[str, str] = {}
        for t in sorted(self.split_tables | self.changed):
            table = self.placement.tables[t]
            rows = table.layout.rows
            shards = tuple(
                PlacedShard(rank, Rect(0, col, rows, cols))
                for rank, col, cols in sorted(self.shards[t], key=lambda s: s[1])
            )
            layouts[table.key] = replace(table.layout, shards=shards)
            types[table.key] = (
                ShardingType.COLUMN_WISE.value
                if t in self.split_tables
                else table.sharding_type
            )
        return layouts, types


def search_splits(
    placement: Placement,
    loads: Sequence[float],
    costs: Sequence[float],
    capacity: Sequence[float],
    splittable: AbstractSet[str],
    byte_price: float = 0.0,
    move_budget: Optional[int] = None,
    traffic: Optional[Sequence[int]] = None,
    where: Optional[Sequence[int]] = None,
    min_cut: float = 0.005,
    max_splits: Optional[int] = None,
    align: int = ALIGN,
    fixed: Optional[Sequence[float]] = None,
    used: Optional[Sequence[int]] = None,
    exchange: Optional[Mapping[int, ColumnShardSeconds]] = None,
) -> SplitResult:
    """
    Halves hot shards (by columns) onto the least loaded ranks, or merges a
    shard into its neighbour on another rank, while that cuts the slowest
    rank.

    Args:
        placement (Placement): the placement before the window's moves.
        loads (Sequence[float]): per rank, its load (after the moves).
        costs (Sequence[float]): per unit of ``placement``, its share of its
            rank's load.
        capacity (Sequence[float]): per rank, the most bytes it may hold.
        splittable (AbstractSet[str]): keys of the tables that may be split.
        byte_price (float): seconds per step one byte moved costs.
        move_budget (Optional[int]): the most bytes a rank may send plus
            receive (None: no limit).
        traffic (Optional[Sequence[int]]): per rank, bytes the moves already
            send plus receive.
        where (Optional[Sequence[int]]): per unit, its rank after the moves
            (default: where it is).
        min_cut (float): the least relative cut of the slowest rank a split
            must make.
        max_splits (Optional[int]): the most splits, and the most merges
            (default: one per rank).
        align (int): split widths are multiples of it.
        fixed (Optional[Sequence[float]]): per table of ``placement``, the
            load each of its shards adds whatever its width (default: none).
        used (Optional[Sequence[int]]): per rank, bytes of tables it holds
            before the splits (default: its units' after the moves).
        exchange (Optional[Mapping[int, ColumnShardSeconds]]): per table
            index, what a column shard of it adds outside the kernels
            (None: the exchange not priced).

    Returns:
        SplitResult: the split tables' layouts and the loads after.
    """
    if len(placement.units) != len(costs):
        raise ValueError(f"{len(placement.units)} units but {len(costs)} costs")
    world_size = placement.world_size
    if not (len(loads) == len(capacity) == world_size):
        raise ValueError(
            f"{world_size} ranks but {len(loads)} loads, {len(capacity)} capacities"
        )
    before = max(loads, default=0.0)
    state = _Splits(
        placement,
        loads,
        costs,
        capacity,
        byte_price,
        move_budget,
        traffic if traffic is not None else [0] * world_size,
        splittable,
        align,
        where if where is not None else [u.rank for u in placement.units],
        fixed if fixed is not None else [0.0] * len(placement.tables),
        used,
        exchange or {},
    )
    splits = 0
    if loads and before > 0:
        mean = sum(loads) / world_size
        limit = max_splits if max_splits is not None else world_size
        splits = state.run(mean * (1.0 + 1e-9), min_cut, limit)
    layouts, types = state.layouts()
    lift = state.lift
    loads_after = tuple(v + lift for v in state.load)
    return SplitResult(
        layouts=layouts,
        sharding_types=types,
        loads=loads_after,
        slowest_before=before,
        slowest_after=max(loads_after, default=0.0),
        rank_bytes=tuple(state.traffic),
        splits=splits,
        merges=state.merges,
        exchange_seconds=tuple(v + lift for v in state.exchange) if exchange else (),
    )

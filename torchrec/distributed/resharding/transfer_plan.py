#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Planning the transfers of a reshard, for the whole job or for one rank.

Intersecting the old and the new rectangles of a table gives its transfers:
each non-empty intersection is one piece that travels from its source rank to
its destination rank (or is copied locally when both are the same rank).
``plan_transfers`` builds the whole plan (dry runs, tests);
``plan_rank_transfers`` one rank's part, in the same order, at a cost that
grows with the shards meeting the rank's own. Nothing in this module talks to
other ranks, so every rank computes the identical plan in the identical order,
and the whole module is testable in one process.
"""

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate, islice
from operator import add, attrgetter, lt
from typing import Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

from torchrec.distributed.resharding.plan import (
    Rect,
    ReshardPlan,
    TableLayout,
    Transfer,
)


@dataclass(frozen=True)
class RankPlan:
    """
    One rank's part of a reshard plan, computed without the rest of the plan.

    Args:
        sends (Tuple[Transfer, ...]): pieces the rank sends to other ranks, by
            destination rank, then plan order.
        receives (Tuple[Transfer, ...]): pieces the rank receives from other
            ranks, by source rank, then plan order.
        local_copies (Tuple[Transfer, ...]): pieces that stay on the rank, in
            plan order.
    """

    sends: Tuple[Transfer, ...]
    receives: Tuple[Transfer, ...]
    local_copies: Tuple[Transfer, ...]


_ROW = attrgetter("row")
_ROWS = attrgetter("rows")
_RECT_KEY = attrgetter("row", "col", "rows", "cols")

# (row, col, rows, cols) of a rectangle
RectKey = Tuple[int, int, int, int]


class _RectIndex:
    """
    The distinct rectangles of one layout in row-major order and the shards
    that hold each, with what bounds their row ends from above (the tallest
    rectangle, or a prefix maximum of row ends): the rectangles meeting a
    query are found by two bisections and a scan of the few candidates
    between them, instead of a pass over the whole layout.

    Built from scratch for every plan (nothing is cached on the layouts). When
    the spec order is already row-major with distinct row starts (row- and
    table-wise layouts) or every shard holds the same rectangle (replicas),
    it costs a few passes over the shards and no sort.

    Args:
        layout (TableLayout): the layout to index.
        ranks (List[int]): the rank of each of its shards, in spec order.
    """

    __slots__ = (
        "ranks",
        "rects",
        "starts",
        "tallest",
        "reach",
        "_holders",
        "_slots",
        "_owners",
    )

    def __init__(self, layout: TableLayout, ranks: List[int]) -> None:
        self.ranks: List[int] = ranks
        rects: List[Rect] = [s.rect for s in layout.shards]
        starts: List[int] = [r.row for r in rects]
        # Holders of each distinct rectangle (spec positions, in spec order)
        # and the distinct rectangle of each spec position; None when both
        # are the identity.
        self._holders: Optional[List[Tuple[int, ...]]] = None
        self._slots: Optional[List[int]] = None
        self.tallest: int = 0
        self.reach: Optional[List[int]] = None
        if all(map(lt, starts, islice(starts, 1, None))):
            # Row-major with distinct row starts (so all distinct): a
            # rectangle meeting rows [row, ...) starts after row - tallest.
            self.tallest = max([r.rows for r in rects], default=0)
        else:
            if rects.count(rects[0]) == len(rects):
                self._holders = [tuple(range(len(rects)))]
                self._slots = [0] * len(rects)
                rects = rects[:1]
            else:
                rects, self._holders, self._slots = _group_equal_rects(rects)
            starts = list(map(_ROW, rects))
            self.reach = list(accumulate(map(add, starts, map(_ROWS, rects)), max))
        self.rects: List[Rect] = rects
        self.starts: List[int] = starts
        # Owner ranks (and their set) of the rectangles asked about.
        self._owners: Dict[int, Tuple[Tuple[int, ...], FrozenSet[int]]] = {}

    @property
    def row_major(self) -> bool:
        """The spec order is row-major, with distinct row starts."""
        return self.reach is None

    @property
    def in_spec_order(self) -> bool:
        """Distinct rectangle ``j`` is the shard at spec position ``j``."""
        return self._holders is None

    def holders(self, j: int) -> Tuple[int, ...]:
        """Spec positions of the shards holding distinct rectangle ``j``."""
        return (j,) if self._holders is None else self._holders[j]

    def slot(self, position: int) -> int:
        """The distinct rectangle of the shard at spec ``position``."""
        return position if self._slots is None else self._slots[position]

    def owners(self, j: int) -> Tuple[Tuple[int, ...], FrozenSet[int]]:
        """Ranks holding distinct rectangle ``j`` (spec order) and their set."""
        found = self._owners.get(j)
        if found is None:
            owners = tuple(self.ranks[p] for p in self.holders(j))
            found = self._owners[j] = (owners, frozenset(owners))
        return found

    def source_for(self, j: int, dst_rank: int) -> int:
        """
        The rank that serves distinct rectangle ``j`` to ``dst_rank``: a
        replica already on the destination is copied locally; otherwise the
        destinations are spread over the owners so no single replica serves
        everybody.
        """
        if self._holders is None:
            return self.ranks[j]
        owners, owner_set = self.owners(j)
        if dst_rank in owner_set:
            return dst_rank
        return owners[dst_rank % len(owners)]

    def meeting(self, rect: Rect) -> List[Tuple[int, Rect]]:
        """
        Args:
            rect (Rect): a query rectangle.

        Returns:
            List[Tuple[int, Rect]]: ``(j, piece)`` for every distinct
            rectangle ``j`` with a non-empty intersection ``piece`` with
            ``rect``, in row-major order of the rectangles.
        """
        row, col, rows, cols = _RECT_KEY(rect)
        row_end, col_end = row + rows, col + cols
        if self.reach is None:
            lo = bisect_right(self.starts, row - self.tallest)
        else:
            lo = bisect_right(self.reach, row)
        hi = bisect_left(self.starts, row_end, lo)
        rects = self.rects
        found: List[Tuple[int, Rect]] = []
        for j in range(lo, hi):
            other = rects[j]
            o_row, o_col, o_rows, o_cols = _RECT_KEY(other)
            o_row_end, o_col_end = o_row + o_rows, o_col + o_cols
            top = o_row if o_row > row else row
            bottom = o_row_end if o_row_end < row_end else row_end
            if bottom <= top:
                continue
            left = o_col if o_col > col else col
            right = o_col_end if o_col_end < col_end else col_end
            if right <= left:
                continue
            if (
                top == o_row
                and bottom == o_row_end
                and left == o_col
                and (right == o_col_end)
            ):
                found.append((j, other))
            elif (
                top == row and bottom == row_end and left == col and (right == col_end)
            ):
                found.append((j, rect))
            else:
                found.append((j, Rect(top, left, bottom - top, right - left)))
        return found


def _group_equal_rects(
    rects: List[Rect],
) -> Tuple[List[Rect], List[Tuple[int, ...]], List[int]]:
    """Sorts rectangles row-major and merges equal ones (replicas)."""
    keys: List[RectKey] = list(map(_RECT_KEY, rects))
    order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: spec order
    distinct: List[Rect] = []
    holders: List[List[int]] = []
    slots = [0] * len(keys)
    last: Optional[RectKey] = None
    for position in order:
        key = keys[position]
        if key != last:
            distinct.append(rects[position])
            holders.append([])
            last = key
        holders[-1].append(position)
        slots[position] = len(distinct) - 1
    return distinct, [tuple(h) for h in holders], slots


def _positions(ranks: List[int], rank: int) -> List[int]:
    """Spec positions of the shards ``rank`` holds (a C-speed scan)."""
    found: List[int] = []
    position = -1
    while True:
        try:
            position = ranks.index(rank, position + 1)
        except ValueError:
            return found
        found.append(position)


def _shard_ranks(layout: TableLayout) -> List[int]:
    return [s.rank for s in layout.shards]


def _pieces_into(
    table: str, sources: _RectIndex, new: TableLayout, positions: Iterable[int]
) -> List[Transfer]:
    """
    The transfers into the new shards at spec ``positions`` (ascending), in
    plan order: destination shards in spec order, then source rectangles in
    row-major order.
    """
    transfers: List[Transfer] = []
    shards = new.shards
    src_rects, src_ranks = sources.rects, sources.ranks
    source_for = sources.source_for
    for position in positions:
        dst = shards[position]
        dst_rank, dst_rect = dst.rank, dst.rect
        found = sources.meeting(dst_rect)
        if sources.in_spec_order:
            transfers += [
                Transfer(table, src_ranks[j], dst_rank, piece, src_rects[j], dst_rect)
                for j, piece in found
            ]
        else:
            transfers += [
                Transfer(
                    table,
                    source_for(j, dst_rank),
                    dst_rank,
                    piece,
                    src_rects[j],
                    dst_rect,
                )
                for j, piece in found
            ]
    return transfers


def _pieces_sent(
    table: str,
    sources: _RectIndex,
    destinations: _RectIndex,
    held: List[int],
    rank: int,
) -> List[Transfer]:
    """
    The transfers ``rank`` sends to other ranks from the old shards at spec
    positions ``held``, in plan order.
    """
    transfers: List[Transfer] = []
    # Destination position and source of each, for plan order.
    dst_positions: List[int] = []
    sources_of: List[int] = []
    dst_ranks = destinations.ranks
    for j in sorted({sources.slot(p) for p in held}):
        src_rect = sources.rects[j]
        owners, owner_set = sources.owners(j)
        n = len(owners)
        for k, piece in destinations.meeting(src_rect):
            # Same rule as _RectIndex.source_for, from the sender's side: a
            # destination holding a replica copies it; the others read from
            # the owner their rank picks.
            if n == 1:
                chosen = [q for q in destinations.holders(k) if dst_ranks[q] != rank]
            else:
                chosen = [
                    q
                    for q in destinations.holders(k)
                    if dst_ranks[q] not in owner_set
                    and owners[dst_ranks[q] % n] == rank
                ]
            dst_rect = destinations.rects[k]
            transfers += [
                Transfer(table, rank, dst_ranks[q], piece, src_rect, dst_rect)
                for q in chosen
            ]
            dst_positions += chosen
            sources_of += [j] * len(chosen)
    if all(map(lt, dst_positions, islice(dst_positions, 1, None))):
        return transfers  # one source rectangle, or already in plan order
    order = sorted(
        range(len(transfers)), key=lambda i: (dst_positions[i], sources_of[i])
    )
    return [transfers[i] for i in order]


def _by_peer(transfers: Dict[int, List[Transfer]]) -> Tuple[Transfer, ...]:
    return tuple(t for peer in sorted(transfers) for t in transfers[peer])


def plan_table_transfers(
    table: str, old: TableLayout, new: TableLayout
) -> List[Transfer]:
    """
    Intersects the old and new rectangles of one table.

    Args:
        table (str): table name.
        old (TableLayout): layout before.
        new (TableLayout): layout after.

    Returns:
        List[Transfer]: one transfer per non-empty intersection, by destination
        shard (spec order), then source rectangle (row-major).
    """
    sources = _RectIndex(old, _shard_ranks(old))
    return _pieces_into(table, sources, new, range(len(new.shards)))


def plan_transfers(
    old_layouts: Mapping[str, TableLayout],
    new_layouts: Mapping[str, TableLayout],
    tables: Optional[Iterable[str]] = None,
) -> ReshardPlan:
    """
    Builds the whole plan of a reshard (for dry runs and tests: a rank that
    only needs its own part calls ``plan_rank_transfers``).

    Args:
        old_layouts (Mapping[str, TableLayout]): layouts before.
        new_layouts (Mapping[str, TableLayout]): layouts after.
        tables (Optional[Iterable[str]]): the tables to plan, in order (default:
            the keys of ``new_layouts``).

    Returns:
        ReshardPlan: the plan.
    """
    names = list(new_layouts if tables is None else tables)
    transfers: List[Transfer] = []
    for name in names:
        transfers.extend(
            plan_table_transfers(name, old_layouts[name], new_layouts[name])
        )
    return ReshardPlan(
        tuple(transfers),
        {n: old_layouts[n] for n in names},
        {n: new_layouts[n] for n in names},
    )


def plan_rank_transfers(
    old_layouts: Mapping[str, TableLayout],
    new_layouts: Mapping[str, TableLayout],
    rank: int,
    tables: Optional[Iterable[str]] = None,
) -> RankPlan:
    """
    Plans one rank's part of a reshard: exactly what ``plan_transfers(...)``
    gives ``rank`` (its ``sends``, ``receives`` and ``local_copies``, in the
    same order), at a cost that grows with the shards meeting the rank's own
    shards rather than with the world.

    Args:
        old_layouts (Mapping[str, TableLayout]): layouts before.
        new_layouts (Mapping[str, TableLayout]): layouts after.
        rank (int): the rank to plan for (in the layouts' numbering).
        tables (Optional[Iterable[str]]): the tables to plan, in order (default:
            the keys of ``new_layouts``).

    Returns:
        RankPlan: the rank's sends, receives and local copies.
    """
    sends: Dict[int, List[Transfer]] = {}
    receives: Dict[int, List[Transfer]] = {}
    local_copies: List[Transfer] = []
    for name in list(new_layouts if tables is None else tables):
        old, new = old_layouts[name], new_layouts[name]
        old_ranks, new_ranks = _shard_ranks(old), _shard_ranks(new)
        targets, held = _positions(new_ranks, rank), _positions(old_ranks, rank)
        if not targets and not held:
            continue
        sources = _RectIndex(old, old_ranks)
        for t in _pieces_into(name, sources, new, targets):
            src_rank = t.src_rank
            if src_rank == rank:
                local_copies.append(t)
            elif src_rank in receives:
                receives[src_rank].append(t)
            else:
                receives[src_rank] = [t]
        if held:
            destinations = _RectIndex(new, new_ranks)
            for t in _pieces_sent(name, sources, destinations, held, rank):
                dst_rank = t.dst_rank
                if dst_rank in sends:
                    sends[dst_rank].append(t)
                else:
                    sends[dst_rank] = [t]
    return RankPlan(_by_peer(sends), _by_peer(receives), tuple(local_copies))

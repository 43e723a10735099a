#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The dry run of a reshard: the bytes every rank sends and receives.

``PieceCost`` prices one piece of a table on the wire; ``bytes_per_rank``
sums it over the remote pieces of a reshard without listing them (replicas
counted together in closed form). Pure: nothing in this module talks to
other ranks.
"""

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import DefaultDict, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from torchrec.distributed.resharding.plan import Rect, TableLayout
from torchrec.distributed.resharding.transfer_plan import (
    _RECT_KEY,
    _RectIndex,
    _shard_ranks,
)


@dataclass(frozen=True)
class PieceCost:
    """
    What one piece of a table costs on the wire: ``rect.numel * per_element +
    rect.rows * per_row + per_piece`` bytes.

    Args:
        per_element (int): bytes per element of the weights (plus any state
            with the weights' shape).
        per_row (int): bytes per row of state with one value per row (e.g.
            row-wise Adagrad's momentum).
        per_piece (int): fixed bytes per piece (e.g. a header).
    """

    per_element: int
    per_row: int = 0
    per_piece: int = 0

    def of(self, rect: Rect) -> int:
        """
        Args:
            rect (Rect): a piece.

        Returns:
            int: its bytes.
        """
        return rect.numel * self.per_element + rect.rows * self.per_row + self.per_piece


def bytes_per_rank(
    old_layouts: Mapping[str, TableLayout],
    new_layouts: Mapping[str, TableLayout],
    costs: Mapping[str, PieceCost],
    tables: Optional[Iterable[str]] = None,
) -> Tuple[Dict[int, int], Dict[int, int]]:
    """
    The dry run of a reshard: bytes every rank sends and receives (local
    copies excluded), equal to summing ``costs`` over the remote transfers of
    ``plan_transfers(...)`` but without listing them. New shards that share a
    rectangle (replicas) are counted together, in closed form, so a table
    going to or from a replicated layout costs about its shards, not their
    product.

    Args:
        old_layouts (Mapping[str, TableLayout]): layouts before.
        new_layouts (Mapping[str, TableLayout]): layouts after.
        costs (Mapping[str, PieceCost]): each planned table's bytes per piece.
        tables (Optional[Iterable[str]]): the tables to plan (default: the keys
            of ``new_layouts``).

    Returns:
        Tuple[Dict[int, int], Dict[int, int]]: bytes sent and bytes received
        per rank, for every rank holding a shard of a planned table before or
        after (0 where nothing moves).
    """
    sent: DefaultDict[int, int] = defaultdict(int)
    received: DefaultDict[int, int] = defaultdict(int)
    ranks: Set[int] = set()
    for name in list(new_layouts if tables is None else tables):
        old, new = old_layouts[name], new_layouts[name]
        old_ranks, new_ranks = _shard_ranks(old), _shard_ranks(new)
        ranks.update(old_ranks, new_ranks)
        sources = _RectIndex(old, old_ranks)
        destinations = _RectIndex(new, new_ranks)
        cost = costs[name]
        if sources.row_major and destinations.row_major:
            _count_sweep(sources, destinations, cost, sent, received)
            continue
        for k, dst_rect in enumerate(destinations.rects):
            found = sources.meeting(dst_rect)
            if not found:
                continue
            holders = destinations.holders(k)
            if len(holders) == 1:
                dst_rank = new_ranks[holders[0]]
                _count_one(sources, found, cost, dst_rank, sent, received)
            else:
                pieces = [(j, cost.of(piece)) for j, piece in found]
                dst_ranks = [new_ranks[q] for q in holders]
                _count_replicas(sources, pieces, dst_ranks, sent, received)
    return (
        {r: sent[r] for r in sorted(ranks)},
        {r: received[r] for r in sorted(ranks)},
    )


def _count_sweep(
    sources: _RectIndex,
    destinations: _RectIndex,
    cost: PieceCost,
    sent: DefaultDict[int, int],
    received: DefaultDict[int, int],
) -> None:
    """
    Adds the pieces of a table whose old and new shards are both row-major
    with distinct row starts (e.g. row-wise to row-wise): one sweep down both
    layouts, the same intersections as ``_RectIndex.meeting`` without
    building the pieces.
    """
    per_element, per_row, per_piece = cost.per_element, cost.per_row, cost.per_piece
    src_rects, src_ranks = sources.rects, sources.ranks
    starts, tallest = sources.starts, sources.tallest
    count, first = len(src_rects), 0
    for dst, dst_rank in zip(destinations.rects, destinations.ranks):
        row, col, rows, cols = _RECT_KEY(dst)
        row_end, col_end = row + rows, col + cols
        # Old rectangles that end above this shard end above the next ones.
        while first < count and starts[first] + tallest <= row:
            first += 1
        j = first
        while j < count and starts[j] < row_end:
            src_rank = src_ranks[j]
            if src_rank != dst_rank:
                o_row, o_col, o_rows, o_cols = _RECT_KEY(src_rects[j])
                o_row_end, o_col_end = o_row + o_rows, o_col + o_cols
                top = o_row if o_row > row else row
                bottom = o_row_end if o_row_end < row_end else row_end
                left = o_col if o_col > col else col
                right = o_col_end if o_col_end < col_end else col_end
                if bottom > top and right > left:
                    nbytes = (bottom - top) * (
                        (right - left) * per_element + per_row
                    ) + per_piece
                    sent[src_rank] += nbytes
                    received[dst_rank] += nbytes
            j += 1


def _count_one(
    sources: _RectIndex,
    pieces: List[Tuple[int, Rect]],
    cost: PieceCost,
    dst_rank: int,
    sent: DefaultDict[int, int],
    received: DefaultDict[int, int],
) -> None:
    """Adds the pieces of one destination shard, one by one."""
    src_ranks = sources.ranks if sources.in_spec_order else None
    for j, piece in pieces:
        src_rank = (
            sources.source_for(j, dst_rank) if src_ranks is None else src_ranks[j]
        )
        if src_rank != dst_rank:
            nbytes = cost.of(piece)
            sent[src_rank] += nbytes
            received[dst_rank] += nbytes


def _count_replicas(
    sources: _RectIndex,
    pieces: List[Tuple[int, int]],
    dst_ranks: List[int],
    sent: DefaultDict[int, int],
    received: DefaultDict[int, int],
) -> None:
    """
    Adds the pieces of several destination shards with the same rectangle in
    closed form: each destination receives every piece but those it already
    holds, and a source owned by ``n`` ranks serves the destinations it does
    not own by their rank modulo ``n`` (``_RectIndex.source_for``).
    """
    copies = Counter(dst_ranks)
    total = sum(nbytes for _, nbytes in pieces)
    for dst_rank, count in copies.items():
        received[dst_rank] += count * total
    by_residue: Dict[int, List[int]] = {}
    for j, nbytes in pieces:
        owners, owner_set = sources.owners(j)
        n = len(owners)
        # Destinations that own the piece copy it locally.
        kept = [0] * n if n > 1 else [0]
        for owner in owner_set:
            count = copies.get(owner, 0)
            if count:
                received[owner] -= count * nbytes
                kept[owner % n] += count
        if n == 1:
            sent[owners[0]] += (len(dst_ranks) - kept[0]) * nbytes
            continue
        residues = by_residue.get(n)
        if residues is None:
            residues = by_residue[n] = [0] * n
            for dst_rank, count in copies.items():
                residues[dst_rank % n] += count
        for i, owner in enumerate(owners):
            served = residues[i] - kept[i]
            if served:
                sent[owner] += served * nbytes

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Table layouts and their geometry, the vocabulary every other module of live
resharding plans in.

Every table layout is a set of rectangles ``(rank, row offset, column offset,
rows, columns)`` read from a ``ParameterSharding`` (``layout_from_*``); a
``Transfer`` is one piece that travels from its source rank to its
destination rank (or is copied locally when both are the same rank), and a
``ReshardPlan`` the transfers of a whole reshard. The errors every rank
raises alike live here too. Nothing in this module talks to other ranks.

Planning the transfers is in ``transfer_plan``, counting their bytes in
``transfer_bytes``, and checking a requested sharding (and its digest) in
``plan_validation``.
"""

from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.types import ParameterSharding, ShardingType


class ReshardError(ValueError):
    """
    Raised, identically on every rank, when a reshard request cannot be carried
    out. It is always raised before any data moves, so the module is unchanged.
    """


class ReshardAbortedError(RuntimeError):
    """
    Raised on every surviving rank when the exchange itself fails (a peer
    raising or dying, a timeout). The module is left exactly in its old state:
    its old shards are only released after every rank holds its new ones.
    """


@dataclass(frozen=True, order=True)
class Rect:
    """
    A rectangle of a 2D table in global coordinates.

    Args:
        row (int): first row.
        col (int): first column.
        rows (int): number of rows.
        cols (int): number of columns.
    """

    row: int
    col: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @staticmethod
    def from_shard_metadata(metadata: ShardMetadata) -> "Rect":
        """
        Args:
            metadata (ShardMetadata): a 2D shard.

        Returns:
            Rect: the part of the table it covers.
        """
        (row, col), (rows, cols) = metadata.shard_offsets, metadata.shard_sizes
        return Rect(row, col, rows, cols)

    def intersect(self, other: "Rect") -> Optional["Rect"]:
        """
        Args:
            other (Rect): the rectangle to intersect with.

        Returns:
            Optional[Rect]: the common part, or None when it is empty.
        """
        row = max(self.row, other.row)
        col = max(self.col, other.col)
        row_end = min(self.row + self.rows, other.row + other.rows)
        col_end = min(self.col + self.cols, other.col + other.cols)
        if row_end <= row or col_end <= col:
            return None
        return Rect(row, col, row_end - row, col_end - col)

    def relative_to(self, origin: "Rect") -> "Rect":
        """
        Args:
            origin (Rect): an enclosing rectangle (usually a shard).

        Returns:
            Rect: this rectangle in the coordinates of ``origin``'s local tensor.
        """
        return Rect(self.row - origin.row, self.col - origin.col, self.rows, self.cols)


@dataclass(frozen=True)
class PlacedShard:
    """
    One shard of a table layout.

    Args:
        rank (int): group-local rank that holds the shard.
        rect (Rect): the part of the table it holds.
    """

    rank: int
    rect: Rect


@dataclass(frozen=True)
class TableLayout:
    """
    Where every part of one table lives.

    Args:
        rows (int): rows of the whole table.
        cols (int): columns of the whole table.
        shards (Tuple[PlacedShard, ...]): the shards, in sharding-spec order.
        replicated (bool): every shard holds the whole table (data parallel).
    """

    rows: int
    cols: int
    shards: Tuple[PlacedShard, ...]
    replicated: bool = False

    def shards_on(self, rank: int) -> List[PlacedShard]:
        """
        Args:
            rank (int): a group-local rank.

        Returns:
            List[PlacedShard]: the shards held by ``rank``, in spec order.
        """
        return [shard for shard in self.shards if shard.rank == rank]

    def bytes_on(self, rank: int, element_size: int) -> int:
        return sum(s.rect.numel for s in self.shards_on(rank)) * element_size

    def remap_ranks(self, ranks: Mapping[int, int]) -> "TableLayout":
        """
        Args:
            ranks (Mapping[int, int]): old rank -> new rank, for every rank
                holding a shard (e.g. group-local -> global).

        Returns:
            TableLayout: the same shards, on the mapped ranks.
        """
        return TableLayout(
            self.rows,
            self.cols,
            tuple(PlacedShard(ranks[s.rank], s.rect) for s in self.shards),
            self.replicated,
        )


@dataclass(frozen=True, init=False)
class Transfer:
    """
    One piece of one table that a destination shard needs.

    Args:
        table (str): table name.
        src_rank (int): rank that sends (holds ``src_rect`` before the reshard).
        dst_rank (int): rank that receives (holds ``dst_rect`` afterwards).
        rect (Rect): the piece, in global table coordinates.
        src_rect (Rect): the source shard the piece is cut from.
        dst_rect (Rect): the destination shard the piece is written into.
    """

    table: str
    src_rank: int
    dst_rank: int
    rect: Rect
    src_rect: Rect
    dst_rect: Rect

    def __init__(
        self,
        table: str,
        src_rank: int,
        dst_rank: int,
        rect: Rect,
        src_rect: Rect,
        dst_rect: Rect,
    ) -> None:
        # A rank's part of a plan can hold 10^5 transfers: set the fields in
        # the instance's dict at once rather than through the frozen class's
        # object.__setattr__, a third of the cost. The instance stays frozen.
        fields = self.__dict__
        fields["table"] = table
        fields["src_rank"] = src_rank
        fields["dst_rank"] = dst_rank
        fields["rect"] = rect
        fields["src_rect"] = src_rect
        fields["dst_rect"] = dst_rect

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class ReshardPlan:
    """
    The ordered transfers of a reshard, identical on every rank.

    Args:
        transfers (Tuple[Transfer, ...]): tables in request order, then
            destination shards in spec order, then source pieces in row-major
            order.
        old_layouts (Mapping[str, TableLayout]): layouts before the reshard.
        new_layouts (Mapping[str, TableLayout]): layouts after the reshard.
    """

    transfers: Tuple[Transfer, ...]
    old_layouts: Mapping[str, TableLayout]
    new_layouts: Mapping[str, TableLayout]

    def sends(self, rank: int) -> List[Transfer]:
        """Pieces ``rank`` sends to other ranks, by destination rank then plan order."""
        out = [t for t in self.transfers if t.src_rank == rank and not t.is_local]
        return sorted(out, key=lambda t: t.dst_rank)

    def receives(self, rank: int) -> List[Transfer]:
        """Pieces ``rank`` receives, by source rank then plan order."""
        out = [t for t in self.transfers if t.dst_rank == rank and not t.is_local]
        return sorted(out, key=lambda t: t.src_rank)

    def local_copies(self, rank: int) -> List[Transfer]:
        """Pieces that stay on ``rank`` (copied locally, never sent)."""
        return [t for t in self.transfers if t.dst_rank == rank and t.is_local]

    def moved_elements(self) -> int:
        """Elements (of the weights) that change owner."""
        return sum(t.rect.numel for t in self.transfers if not t.is_local)


def _placement_rank(metadata: ShardMetadata) -> int:
    placement = metadata.placement
    rank = placement.rank() if placement is not None else None
    if rank is None:
        raise ReshardError(f"shard {metadata} has no rank in its placement")
    return rank


def replicated_layout(rows: int, cols: int, world_size: int) -> TableLayout:
    """
    Args:
        rows (int): rows of the table.
        cols (int): columns of the table.
        world_size (int): size of the process group.

    Returns:
        TableLayout: the whole table on every rank (data parallel).
    """
    full = Rect(0, 0, rows, cols)
    return TableLayout(
        rows,
        cols,
        tuple(PlacedShard(rank, full) for rank in range(world_size)),
        replicated=True,
    )


def layout_from_parameter_sharding(
    parameter_sharding: ParameterSharding, rows: int, cols: int, world_size: int
) -> TableLayout:
    """
    Reads a table's rectangles from its ParameterSharding.

    Args:
        parameter_sharding (ParameterSharding): the table's sharding.
        rows (int): rows of the table.
        cols (int): columns of the table.
        world_size (int): size of the process group (data parallel replicates
            the table on every rank).

    Returns:
        TableLayout: the layout.
    """
    if parameter_sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
        return replicated_layout(rows, cols, world_size)
    spec = parameter_sharding.sharding_spec
    assert isinstance(spec, EnumerableShardingSpec)
    return TableLayout(
        rows,
        cols,
        tuple(
            PlacedShard(_placement_rank(m), Rect.from_shard_metadata(m))
            for m in spec.shards
        ),
    )


def layout_from_shards_metadata(
    shards_metadata: Sequence[ShardMetadata], rows: int, cols: int
) -> TableLayout:
    """
    Args:
        shards_metadata (Sequence[ShardMetadata]): global shard metadata, e.g.
            of a ShardedTensor.
        rows (int): rows of the table.
        cols (int): columns of the table.

    Returns:
        TableLayout: the layout.
    """
    return TableLayout(
        rows,
        cols,
        tuple(
            PlacedShard(_placement_rank(m), Rect.from_shard_metadata(m))
            for m in shards_metadata
        ),
    )

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The pure half of live resharding: layouts, transfers and validation.

Every table layout is a set of rectangles ``(rank, row offset, column offset,
rows, columns)`` read from a ``ParameterSharding``.  Intersecting the old and the
new rectangles of a table gives the transfers: each non-empty intersection is one
piece that travels from its source rank to its destination rank (or is copied
locally when both are the same rank).  Nothing in this module talks to other
ranks, so every rank computes the identical plan in the identical order, and the
whole module is testable in one process.
"""

import hashlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torch.distributed._shard.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
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


MOVABLE_SHARDING_TYPES: Tuple[str, ...] = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.GRID_SHARD.value,
    ShardingType.DATA_PARALLEL.value,
)

# ParameterSharding fields a kernel is built with: a reshard that changes one
# rebuilds the table's kernel with it (its state carried over).
KERNEL_OPTIONS: Tuple[str, ...] = (
    "cache_params",
    "enforce_hbm",
    "stochastic_rounding",
    "bounds_check_mode",
    "output_dtype",
    "key_value_params",
)

MOVABLE_COMPUTE_KERNELS: Tuple[str, ...] = (
    EmbeddingComputeKernel.DENSE.value,
    EmbeddingComputeKernel.FUSED.value,
)


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


@dataclass(frozen=True)
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


def _pick_source(owners: Sequence[int], dst_rank: int) -> int:
    # A replica already on the destination is copied locally; otherwise spread
    # destinations over the owners so no single replica serves everybody.
    if dst_rank in owners:
        return dst_rank
    return owners[dst_rank % len(owners)]


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
    owners_by_rect: Dict[Rect, List[int]] = {}
    for shard in old.shards:
        owners_by_rect.setdefault(shard.rect, []).append(shard.rank)
    source_rects = sorted(owners_by_rect)

    transfers: List[Transfer] = []
    for dst in new.shards:
        for src_rect in source_rects:
            piece = src_rect.intersect(dst.rect)
            if piece is None:
                continue
            src_rank = _pick_source(owners_by_rect[src_rect], dst.rank)
            transfers.append(
                Transfer(table, src_rank, dst.rank, piece, src_rect, dst.rect)
            )
    return transfers


def plan_transfers(
    old_layouts: Mapping[str, TableLayout],
    new_layouts: Mapping[str, TableLayout],
    tables: Optional[Iterable[str]] = None,
) -> ReshardPlan:
    """
    Builds the plan of a reshard.

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


def _check_tiling(
    table: str, spec: EnumerableShardingSpec, rows: int, cols: int
) -> None:
    for metadata in spec.shards:
        if len(metadata.shard_offsets) != 2 or len(metadata.shard_sizes) != 2:
            raise ReshardError(f"table '{table}': shard {metadata} is not 2D")
        if min(metadata.shard_sizes) < 0 or min(metadata.shard_offsets) < 0:
            raise ReshardError(f"table '{table}': shard {metadata} has negative size")
    try:
        validate_non_overlapping_shards_metadata(spec.shards)
    except ValueError as e:
        raise ReshardError(f"table '{table}': shards overlap: {e}") from None
    try:
        check_tensor(spec.shards, [rows, cols])
    except ValueError as e:
        raise ReshardError(
            f"table '{table}': shards do not tile the {rows}x{cols} table: {e}"
        ) from None


def _check_shape_matches_type(
    table: str, sharding_type: str, layout: TableLayout
) -> None:
    rects = [s.rect for s in layout.shards]
    if sharding_type == ShardingType.TABLE_WISE.value and len(rects) != 1:
        raise ReshardError(
            f"table '{table}': table_wise sharding needs exactly one shard, "
            f"got {len(rects)}"
        )
    whole_rows = sharding_type in (
        ShardingType.COLUMN_WISE.value,
        ShardingType.TABLE_COLUMN_WISE.value,
    )
    whole_cols = sharding_type in (
        ShardingType.ROW_WISE.value,
        ShardingType.TABLE_ROW_WISE.value,
    )
    if whole_rows and any(r.rows != layout.rows for r in rects):
        raise ReshardError(
            f"table '{table}': {sharding_type} shards must span all "
            f"{layout.rows} rows"
        )
    if whole_cols and any(r.cols != layout.cols for r in rects):
        raise ReshardError(
            f"table '{table}': {sharding_type} shards must span all "
            f"{layout.cols} columns"
        )


def validate_parameter_sharding(
    table: str,
    parameter_sharding: ParameterSharding,
    rows: int,
    cols: int,
    world_size: int,
    device_type: str,
) -> TableLayout:
    """
    Checks that a new ParameterSharding can be moved to, and reads its layout.

    Args:
        table (str): table name (for messages).
        parameter_sharding (ParameterSharding): the requested sharding.
        rows (int): rows of the table.
        cols (int): columns of the table.
        world_size (int): size of the process group.
        device_type (str): device type of the module ("cpu", "cuda", ...).

    Returns:
        TableLayout: the new layout.

    Raises:
        ReshardError: naming the table and the reason.
    """
    if not isinstance(parameter_sharding, ParameterSharding):
        raise ReshardError(
            f"table '{table}': expected a ParameterSharding, "
            f"got {type(parameter_sharding).__name__}"
        )
    sharding_type = parameter_sharding.sharding_type
    if sharding_type not in MOVABLE_SHARDING_TYPES:
        raise ReshardError(
            f"table '{table}': sharding type '{sharding_type}' cannot be resharded "
            f"(movable: {', '.join(MOVABLE_SHARDING_TYPES)})"
        )
    if parameter_sharding.compute_kernel not in MOVABLE_COMPUTE_KERNELS:
        raise ReshardError(
            f"table '{table}': compute kernel '{parameter_sharding.compute_kernel}' "
            f"cannot be resharded (movable: {', '.join(MOVABLE_COMPUTE_KERNELS)})"
        )
    if sharding_type != ShardingType.DATA_PARALLEL.value:
        spec = parameter_sharding.sharding_spec
        if not isinstance(spec, EnumerableShardingSpec) or not spec.shards:
            raise ReshardError(
                f"table '{table}': {sharding_type} needs an EnumerableShardingSpec "
                "with at least one shard"
            )
        for metadata in spec.shards:
            placement = metadata.placement
            rank = placement.rank() if placement is not None else None
            if rank is None or not 0 <= rank < world_size:
                raise ReshardError(
                    f"table '{table}': shard placement {placement} is outside the "
                    f"process group of {world_size} ranks"
                )
            if placement.device().type != device_type:
                raise ReshardError(
                    f"table '{table}': shard placement {placement} is not on the "
                    f"module's device type '{device_type}'"
                )
        _check_tiling(table, spec, rows, cols)
    if parameter_sharding.ranks is not None and any(
        not 0 <= r < world_size for r in parameter_sharding.ranks
    ):
        raise ReshardError(
            f"table '{table}': ranks {parameter_sharding.ranks} are outside the "
            f"process group of {world_size} ranks"
        )
    layout = layout_from_parameter_sharding(parameter_sharding, rows, cols, world_size)
    _check_shape_matches_type(table, sharding_type, layout)
    return layout


def describe_parameter_sharding(parameter_sharding: ParameterSharding) -> str:
    """
    Args:
        parameter_sharding (ParameterSharding): a sharding.

    Returns:
        str: a canonical text of everything that decides where bytes go and
        how the kernel is built, equal on every rank that holds an equal
        ParameterSharding.
    """
    spec = parameter_sharding.sharding_spec
    shards = ""
    if isinstance(spec, EnumerableShardingSpec):
        shards = ";".join(
            f"{list(m.shard_offsets)}+{list(m.shard_sizes)}@{m.placement}"
            for m in spec.shards
        )
    options = "|".join(
        repr(getattr(parameter_sharding, name, None)) for name in KERNEL_OPTIONS
    )
    return (
        f"{parameter_sharding.sharding_type}|{parameter_sharding.compute_kernel}|"
        f"{parameter_sharding.ranks}|{shards}|{options}"
    )


def delta_digest(changed_sharding_params: Mapping[str, ParameterSharding]) -> int:
    """
    Args:
        changed_sharding_params (Mapping[str, ParameterSharding]): a delta.

    Returns:
        int: a 63-bit digest, the same on every rank for the same delta (never
        derived from Python's per-process ``hash``).
    """
    text = "\n".join(
        f"{name}={describe_parameter_sharding(ps) if isinstance(ps, ParameterSharding) else repr(ps)}"
        for name, ps in sorted(changed_sharding_params.items())
    )
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

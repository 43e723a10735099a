#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
One-process tests of the pure half of live resharding: rectangles, layouts,
transfers, validation, the delta digest and the split of an exchange into
rounds. Every expectation is computed independently of the planner (element
owner maps, area sums, pairwise disjointness), never by calling it twice.
"""

import itertools
import os
import subprocess
import sys
import unittest
from typing import Dict, List, Optional, Sequence, Tuple

import hypothesis.strategies as st
import torch
from hypothesis import given, HealthCheck, settings
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding.exchange import (
    Field,
    field_kind,
    FieldKind,
    split_into_rounds,
)
from torchrec.distributed.resharding.plan import (
    delta_digest,
    describe_parameter_sharding,
    layout_from_parameter_sharding,
    layout_from_shards_metadata,
    PlacedShard,
    plan_table_transfers,
    plan_transfers,
    Rect,
    replicated_layout,
    ReshardError,
    ReshardPlan,
    TableLayout,
    Transfer,
    validate_parameter_sharding,
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
from torchrec.distributed.types import ParameterSharding, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

DENSE = EmbeddingComputeKernel.DENSE.value
FUSED = EmbeddingComputeKernel.FUSED.value

# (row, col, rows, cols, rank)
ShardTuple = Tuple[int, int, int, int, int]


def _sharding(
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
RECT, ROWS, SCALAR = FieldKind.RECT, FieldKind.ROWS, FieldKind.SCALAR
ROWS_, COLS_ = 10, 256
WORLD, LOCAL = 4, 2

GENERATORS = {
    "TW": lambda: table_wise(rank=2),
    "CW": lambda: column_wise(ranks=[0, 1, 2, 3]),
    "TWCW": lambda: column_wise(ranks=[3, 1]),
    "RW": lambda: row_wise(),
    "TWRW": lambda: table_row_wise(host_index=1),
    "GRID": lambda: grid_shard(host_indexes=[0, 1]),
    "DP": lambda: data_parallel(),
}


def _ebc(rows: int = ROWS_, cols: int = COLS_) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name="t", embedding_dim=cols, num_embeddings=rows, feature_names=["f"]
            )
        ],
        device=torch.device("meta"),
    )


def _constructed(
    kind: str, ebc: Optional[EmbeddingBagCollection] = None
) -> ParameterSharding:
    """The ParameterSharding TorchRec's own plan helpers build for ``kind``."""
    plan = construct_module_sharding_plan(
        ebc if ebc is not None else _ebc(),
        {"t": GENERATORS[kind]()},
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


def _owner_map(layout: TableLayout, world_size: int) -> torch.Tensor:
    """owned[rank, row, col]: ``rank`` holds the element."""
    owned = torch.zeros(world_size, layout.rows, layout.cols, dtype=torch.bool)
    for s in layout.shards:
        r = s.rect
        owned[s.rank, r.row : r.row + r.rows, r.col : r.col + r.cols] = True
    return owned


def _contains(outer: Rect, inner: Rect) -> bool:
    return (
        outer.row <= inner.row
        and outer.col <= inner.col
        and inner.row + inner.rows <= outer.row + outer.rows
        and inner.col + inner.cols <= outer.col + outer.cols
    )


def _expected_moved(old: TableLayout, new: TableLayout, world_size: int) -> int:
    """Elements of new shards that their new owner did not hold before."""
    owned = _owner_map(old, world_size)
    moved = 0
    for s in new.shards:
        r = s.rect
        held = owned[s.rank, r.row : r.row + r.rows, r.col : r.col + r.cols]
        moved += int((~held).sum())
    return moved


class PlanChecks(unittest.TestCase):
    def check_plan(
        self,
        plan: ReshardPlan,
        table: str,
        old: TableLayout,
        new: TableLayout,
        world_size: int,
    ) -> None:
        """Independent checks of one table of a plan."""
        transfers = [t for t in plan.transfers if t.table == table]
        old_shards = set(old.shards)
        assigned = 0
        for dst in new.shards:
            pieces = [
                t
                for t in transfers
                if t.dst_rank == dst.rank and t.dst_rect == dst.rect
            ]
            assigned += len(pieces)
            # Sum of the areas is the shard's area ...
            self.assertEqual(sum(t.rect.numel for t in pieces), dst.rect.numel, dst)
            for t in pieces:
                self.assertGreater(t.rect.numel, 0, t)
                # ... every piece is inside its source and destination ...
                self.assertTrue(_contains(t.dst_rect, t.rect), t)
                self.assertTrue(_contains(t.src_rect, t.rect), t)
                # ... the source rank held the source rectangle before ...
                self.assertIn(PlacedShard(t.src_rank, t.src_rect), old_shards, t)
            # ... and the pieces are pairwise disjoint: an exact tiling.
            for a, b in itertools.combinations(pieces, 2):
                self.assertIsNone(a.rect.intersect(b.rect), (a, b))
        self.assertEqual(assigned, len(transfers))

        owned = _owner_map(old, world_size)
        for t in transfers:
            # A piece the destination already holds never travels.
            r = t.rect
            already = bool(
                owned[t.dst_rank, r.row : r.row + r.rows, r.col : r.col + r.cols].all()
            )
            self.assertEqual(t.is_local, already, t)

    def check_rank_views(self, plan: ReshardPlan, world_size: int) -> None:
        transfers = list(plan.transfers)
        for rank in range(world_size):
            local = [t for t in transfers if t.src_rank == rank and t.dst_rank == rank]
            self.assertEqual(plan.local_copies(rank), local)
            self.assertTrue(all(t.is_local for t in local))

            receives = plan.receives(rank)
            expected_receives = [
                t for t in transfers if t.dst_rank == rank and t.src_rank != rank
            ]
            self.assertCountEqual(receives, expected_receives)
            src_ranks = [t.src_rank for t in receives]
            self.assertEqual(src_ranks, sorted(src_ranks))
            for src in set(src_ranks):
                # Within one source rank: plan order.
                self.assertEqual(
                    [t for t in receives if t.src_rank == src],
                    [t for t in expected_receives if t.src_rank == src],
                )

            sends = plan.sends(rank)
            expected_sends = [
                t for t in transfers if t.src_rank == rank and t.dst_rank != rank
            ]
            self.assertCountEqual(sends, expected_sends)
            dst_ranks = [t.dst_rank for t in sends]
            self.assertEqual(dst_ranks, sorted(dst_ranks))


class RectTest(unittest.TestCase):
    def test_intersect(self) -> None:
        a = Rect(0, 0, 4, 8)
        self.assertEqual(a.intersect(Rect(2, 4, 4, 8)), Rect(2, 4, 2, 4))
        self.assertEqual(Rect(2, 4, 4, 8).intersect(a), Rect(2, 4, 2, 4))
        self.assertEqual(a.intersect(a), a)
        self.assertEqual(a.intersect(Rect(1, 1, 1, 1)), Rect(1, 1, 1, 1))
        # Touching edges and corners share no element.
        self.assertIsNone(a.intersect(Rect(4, 0, 2, 8)))
        self.assertIsNone(a.intersect(Rect(0, 8, 4, 2)))
        self.assertIsNone(a.intersect(Rect(4, 8, 1, 1)))
        self.assertIsNone(a.intersect(Rect(10, 10, 1, 1)))
        # Empty rectangles intersect nothing.
        self.assertIsNone(a.intersect(Rect(2, 0, 0, 8)))
        self.assertIsNone(a.intersect(Rect(0, 2, 4, 0)))

    def test_relative_to_and_numel(self) -> None:
        shard = Rect(4, 8, 6, 8)
        piece = Rect(5, 10, 2, 3)
        self.assertEqual(piece.relative_to(shard), Rect(1, 2, 2, 3))
        self.assertEqual(shard.relative_to(shard), Rect(0, 0, 6, 8))
        self.assertEqual(piece.numel, 6)
        self.assertEqual(Rect(3, 0, 0, 16).numel, 0)
        # A relative piece indexes the shard's local tensor exactly.
        table = torch.arange(12 * 20).view(12, 20)
        local = table[4:10, 8:16]
        rel = piece.relative_to(shard)
        self.assertTrue(
            torch.equal(
                local[rel.row : rel.row + rel.rows, rel.col : rel.col + rel.cols],
                table[5:7, 10:13],
            )
        )

    def test_rects_sort_row_major(self) -> None:
        rects = [Rect(5, 0, 1, 1), Rect(0, 8, 1, 1), Rect(0, 0, 1, 1)]
        self.assertEqual(
            sorted(rects), [Rect(0, 0, 1, 1), Rect(0, 8, 1, 1), Rect(5, 0, 1, 1)]
        )


class LayoutTest(unittest.TestCase):
    def _layout(self, kind: str) -> TableLayout:
        ps = _constructed(kind)
        return validate_parameter_sharding("t", ps, ROWS_, COLS_, WORLD, "cpu")

    def _shards(self, layout: TableLayout) -> List[Tuple[int, int, int, int, int]]:
        return [
            (s.rect.row, s.rect.col, s.rect.rows, s.rect.cols, s.rank)
            for s in layout.shards
        ]

    def test_table_wise(self) -> None:
        layout = self._layout("TW")
        self.assertEqual(self._shards(layout), [(0, 0, 10, 256, 2)])
        self.assertFalse(layout.replicated)
        self.assertEqual(layout.shards_on(2), [PlacedShard(2, Rect(0, 0, 10, 256))])
        self.assertEqual(layout.shards_on(0), [])
        self.assertEqual(layout.bytes_on(2, 4), 10 * 256 * 4)
        self.assertEqual(layout.bytes_on(1, 4), 0)

    def test_column_wise(self) -> None:
        self.assertEqual(
            self._shards(self._layout("CW")),
            [(0, 64 * i, 10, 64, i) for i in range(4)],
        )

    def test_table_column_wise(self) -> None:
        self.assertEqual(
            self._shards(self._layout("TWCW")),
            [(0, 0, 10, 128, 3), (0, 128, 10, 128, 1)],
        )

    def test_row_wise_uneven(self) -> None:
        layout = self._layout("RW")
        self.assertEqual(
            self._shards(layout),
            [
                (0, 0, 3, 256, 0),
                (3, 0, 3, 256, 1),
                (6, 0, 3, 256, 2),
                (9, 0, 1, 256, 3),
            ],
        )
        self.assertEqual(layout.bytes_on(3, 2), 256 * 2)

    def test_table_row_wise(self) -> None:
        self.assertEqual(
            self._shards(self._layout("TWRW")),
            [(0, 0, 5, 256, 2), (5, 0, 5, 256, 3)],
        )

    def test_grid(self) -> None:
        self.assertEqual(
            self._shards(self._layout("GRID")),
            [
                (0, 0, 5, 128, 0),
                (5, 0, 5, 128, 1),
                (0, 128, 5, 128, 2),
                (5, 128, 5, 128, 3),
            ],
        )

    def test_data_parallel(self) -> None:
        layout = self._layout("DP")
        self.assertTrue(layout.replicated)
        self.assertEqual(
            self._shards(layout), [(0, 0, 10, 256, r) for r in range(WORLD)]
        )
        self.assertEqual(layout, replicated_layout(ROWS_, COLS_, WORLD))
        for rank in range(WORLD):
            self.assertEqual(layout.bytes_on(rank, 4), ROWS_ * COLS_ * 4)

    def test_hand_built_uneven(self) -> None:
        ps = _sharding(
            "grid_shard",
            [(0, 0, 7, 4, 1), (7, 0, 3, 4, 0), (0, 4, 2, 12, 0), (2, 4, 8, 12, 1)],
        )
        layout = layout_from_parameter_sharding(ps, 10, 16, 2)
        self.assertEqual(
            self._shards(layout),
            [(0, 0, 7, 4, 1), (7, 0, 3, 4, 0), (0, 4, 2, 12, 0), (2, 4, 8, 12, 1)],
        )
        self.assertEqual(
            [s.rect for s in layout.shards_on(0)], [Rect(7, 0, 3, 4), Rect(0, 4, 2, 12)]
        )
        self.assertEqual(layout, validate_parameter_sharding("t", ps, 10, 16, 2, "cpu"))

    def test_from_shards_metadata(self) -> None:
        ps = _constructed("GRID")
        from_metadata = layout_from_shards_metadata(
            ps.sharding_spec.shards, ROWS_, COLS_
        )
        self.assertEqual(
            from_metadata, layout_from_parameter_sharding(ps, ROWS_, COLS_, WORLD)
        )
        # The same metadata through a ShardedTensor-style metadata object.
        metadata = ps.sharding_spec.build_metadata(
            torch.Size([ROWS_, COLS_]),
            torch.distributed._shard.sharded_tensor.TensorProperties(),
        )
        self.assertEqual(
            layout_from_shards_metadata(metadata.shards_metadata, ROWS_, COLS_),
            from_metadata,
        )


class TypePairTransferTest(PlanChecks):
    """Every (old type, new type) pair among TW, CW, TWCW, RW, TWRW, GRID, DP."""

    def test_all_type_pairs(self) -> None:
        layouts = {
            kind: validate_parameter_sharding(
                "t", _constructed(kind), ROWS_, COLS_, WORLD, "cpu"
            )
            for kind in GENERATORS
        }
        for old_kind, new_kind in itertools.product(GENERATORS, GENERATORS):
            with self.subTest(old=old_kind, new=new_kind):
                old, new = layouts[old_kind], layouts[new_kind]
                plan = plan_transfers({"t": old}, {"t": new})
                self.check_plan(plan, "t", old, new, WORLD)
                self.check_rank_views(plan, WORLD)
                self.assertEqual(
                    plan.moved_elements(), _expected_moved(old, new, WORLD)
                )
                # Deterministic: the same plan, in the same order, twice.
                self.assertEqual(plan_transfers({"t": old}, {"t": new}), plan)
                if old_kind == new_kind:
                    self.assertEqual(plan.moved_elements(), 0)
                    self.assertTrue(all(t.is_local for t in plan.transfers))

    def test_moved_elements_values(self) -> None:
        def moved(a: str, b: str) -> int:
            old = layout_from_parameter_sharding(_constructed(a), ROWS_, COLS_, WORLD)
            new = layout_from_parameter_sharding(_constructed(b), ROWS_, COLS_, WORLD)
            return plan_transfers({"t": old}, {"t": new}).moved_elements()

        full = ROWS_ * COLS_
        # TW on rank 2 -> CW on 0..3: everything but rank 2's quarter moves.
        self.assertEqual(moved("TW", "CW"), full * 3 // 4)
        # TW on rank 2 -> DP: three ranks receive the whole table.
        self.assertEqual(moved("TW", "DP"), 3 * full)
        # DP -> anything: every destination already holds its replica.
        for kind in GENERATORS:
            self.assertEqual(moved("DP", kind), 0, kind)
        # TWRW (rows 0-4 on 2, 5-9 on 3) -> TW on 2: rows 5-9 move.
        self.assertEqual(moved("TWRW", "TW"), 5 * COLS_)
        # RW (3, 3, 3, 1 rows on 0..3) -> TWRW (5, 5 rows on 2, 3): rows 0-4
        # (rank 2 only had 6-8) and rows 5, 6, 7, 8 (rank 3 only had 9).
        self.assertEqual(moved("RW", "TWRW"), 5 * COLS_ + 4 * COLS_)

    def test_replicated_source_prefers_own_replica(self) -> None:
        old = replicated_layout(ROWS_, COLS_, WORLD)
        for kind in GENERATORS:
            new = layout_from_parameter_sharding(
                _constructed(kind), ROWS_, COLS_, WORLD
            )
            transfers = plan_table_transfers("t", old, new)
            self.assertTrue(transfers)
            for t in transfers:
                self.assertEqual(t.src_rank, t.dst_rank, (kind, t))
        # TW on rank 3 from a replica: one local piece, the whole table.
        tw3 = TableLayout(ROWS_, COLS_, (PlacedShard(3, Rect(0, 0, ROWS_, COLS_)),))
        self.assertEqual(
            plan_table_transfers("t", old, tw3),
            [
                Transfer(
                    "t",
                    3,
                    3,
                    tw3.shards[0].rect,
                    tw3.shards[0].rect,
                    tw3.shards[0].rect,
                )
            ],
        )

    def test_partial_replica_source_is_an_owner(self) -> None:
        # The same rectangle on ranks 0 and 1 only; destinations 2 and 3 must
        # read from one of its owners, and rank 1 from itself.
        full = Rect(0, 0, 4, 8)
        old = TableLayout(4, 8, (PlacedShard(0, full), PlacedShard(1, full)), True)
        new = TableLayout(
            4, 8, tuple(PlacedShard(r, Rect(r, 0, 1, 8)) for r in range(4))
        )
        transfers = plan_table_transfers("t", old, new)
        self.assertEqual(len(transfers), 4)
        for t in transfers:
            self.assertIn(t.src_rank, (0, 1))
            if t.dst_rank in (0, 1):
                self.assertEqual(t.src_rank, t.dst_rank)
        self.assertEqual(transfers, plan_table_transfers("t", old, new))


class OrderingTest(PlanChecks):
    def test_order_tables_dst_shards_then_row_major_sources(self) -> None:
        old = layout_from_parameter_sharding(
            _sharding(
                "grid_shard", [(5, 0, 5, 16, 1), (0, 8, 5, 8, 0), (0, 0, 5, 8, 1)]
            ),
            10,
            16,
            2,
        )
        new = layout_from_parameter_sharding(
            _sharding("row_wise", [(4, 0, 6, 16, 0), (0, 0, 4, 16, 1)]), 10, 16, 2
        )
        tw = layout_from_parameter_sharding(
            _sharding("table_wise", [(0, 0, 10, 16, 0)]), 10, 16, 2
        )
        plan = plan_transfers({"a": old, "b": old}, {"a": new, "b": tw}, ["b", "a"])
        tables = [t.table for t in plan.transfers]
        self.assertEqual(tables, sorted(tables, key=["b", "a"].index))
        self.assertEqual(list(plan.new_layouts), ["b", "a"])
        a = [t for t in plan.transfers if t.table == "a"]
        # First the new shard at row 4 (spec order), then the one at row 0;
        # inside each, the source rectangles in row-major order.
        self.assertEqual(
            [(t.dst_rect.row, t.src_rect.row, t.src_rect.col) for t in a],
            [(4, 0, 0), (4, 0, 8), (4, 5, 0), (0, 0, 0), (0, 0, 8)],
        )
        self.check_plan(plan, "a", old, new, 2)
        self.check_plan(plan, "b", old, tw, 2)
        self.check_rank_views(plan, 2)
        # Receives of rank 0 by source rank: rank 1 only (rank 0's own piece
        # is a local copy).
        self.assertEqual({t.src_rank for t in plan.receives(0)}, {1})
        self.assertEqual(
            plan, plan_transfers({"a": old, "b": old}, {"a": new, "b": tw}, ["b", "a"])
        )

    def test_default_table_order_is_new_layouts_order(self) -> None:
        tw0 = replicated_layout(4, 4, 1)
        plan = plan_transfers({"x": tw0, "y": tw0}, {"y": tw0, "x": tw0})
        self.assertEqual([t.table for t in plan.transfers], ["y", "x"])


class UnevenAndEmptyTest(PlanChecks):
    def test_uneven_rows_and_columns(self) -> None:
        rw = _sharding(
            "row_wise", [(0, 0, 4, 16, 0), (4, 0, 1, 16, 2), (5, 0, 5, 16, 1)]
        )
        cw = _sharding("column_wise", [(0, 0, 10, 4, 1), (0, 4, 10, 12, 2)])
        twcw = _sharding("table_column_wise", [(0, 0, 10, 12, 0), (0, 12, 10, 4, 0)])
        grid = _sharding(
            "grid_shard",
            [(0, 0, 7, 4, 1), (7, 0, 3, 4, 0), (0, 4, 2, 12, 2), (2, 4, 8, 12, 1)],
        )
        shardings = {"rw": rw, "cw": cw, "twcw": twcw, "grid": grid}
        layouts = {
            k: validate_parameter_sharding("t", v, 10, 16, 3, "cpu")
            for k, v in shardings.items()
        }
        for a, b in itertools.product(layouts, layouts):
            with self.subTest(old=a, new=b):
                plan = plan_transfers({"t": layouts[a]}, {"t": layouts[b]})
                self.check_plan(plan, "t", layouts[a], layouts[b], 3)
                self.check_rank_views(plan, 3)
                self.assertEqual(
                    plan.moved_elements(), _expected_moved(layouts[a], layouts[b], 3)
                )
        # rw -> cw by hand: rank 1 gets cols 0-3 of rows 0-4 (from ranks 0, 2)
        # and keeps rows 5-9; rank 2 gets cols 4-15 of rows 0-3 and 5-9 and
        # keeps row 4.
        plan = plan_transfers({"t": layouts["rw"]}, {"t": layouts["cw"]})
        self.assertEqual(plan.moved_elements(), 4 * 4 + 1 * 4 + 4 * 12 + 5 * 12)
        self.assertEqual(
            [(t.src_rank, t.rect) for t in plan.receives(1)],
            [(0, Rect(0, 0, 4, 4)), (2, Rect(4, 0, 1, 4))],
        )
        self.assertEqual(
            [(t.src_rank, t.rect) for t in plan.receives(2)],
            [(0, Rect(0, 4, 4, 12)), (1, Rect(5, 4, 5, 12))],
        )
        self.assertEqual([t.rect for t in plan.local_copies(2)], [Rect(4, 4, 1, 12)])
        self.assertEqual(plan.sends(1), [plan.receives(2)[1]])

    def test_zero_row_shard(self) -> None:
        # Row-wise over 4 ranks of a 3-row table: TorchRec gives rank 3 no rows.
        ps = _constructed("RW", _ebc(rows=3, cols=8))
        sizes = [list(m.shard_sizes) for m in ps.sharding_spec.shards]
        self.assertEqual(sizes, [[1, 8], [1, 8], [1, 8], [0, 8]])
        rw = validate_parameter_sharding("t", ps, 3, 8, WORLD, "cpu")
        self.assertEqual(rw.shards[3], PlacedShard(3, Rect(3, 0, 0, 8)))
        tw = validate_parameter_sharding(
            "t", _sharding("table_wise", [(0, 0, 3, 8, 3)]), 3, 8, WORLD, "cpu"
        )
        for old, new in ((rw, tw), (tw, rw)):
            plan = plan_transfers({"t": old}, {"t": new})
            self.check_plan(plan, "t", old, new, WORLD)
            self.check_rank_views(plan, WORLD)
            # No piece comes from or goes to the empty shard.
            for t in plan.transfers:
                self.assertGreater(t.rect.numel, 0)
                self.assertNotEqual(t.src_rect.rows, 0)
                self.assertNotEqual(t.dst_rect.rows, 0)
            self.assertEqual(plan.moved_elements(), 3 * 8)
        # rw -> tw: rank 3 receives every row from ranks 0, 1, 2 in order.
        plan = plan_transfers({"t": rw}, {"t": tw})
        self.assertEqual([t.src_rank for t in plan.receives(3)], [0, 1, 2])
        self.assertEqual(plan.local_copies(3), [])
        # tw -> rw: the empty shard of rank 3 gets nothing.
        plan = plan_transfers({"t": tw}, {"t": rw})
        self.assertEqual(plan.receives(3), [])
        self.assertEqual(plan.local_copies(3), [])

    def test_zero_size_shard_in_the_middle(self) -> None:
        ps = _sharding(
            "row_wise", [(0, 0, 2, 16, 0), (2, 0, 0, 16, 1), (2, 0, 8, 16, 1)]
        )
        layout = validate_parameter_sharding("t", ps, 10, 16, 2, "cpu")
        tw = layout_from_parameter_sharding(
            _sharding("table_wise", [(0, 0, 10, 16, 0)]), 10, 16, 2
        )
        plan = plan_transfers({"t": tw}, {"t": layout})
        self.check_plan(plan, "t", tw, layout, 2)
        self.assertEqual(plan.moved_elements(), 8 * 16)


# --------------------------------------------------------------------------
# Property test: random tilings of a random table.


@st.composite
def _tiling(draw, rows: int, cols: int, world_size: int) -> List[ShardTuple]:
    def cuts(n: int) -> List[int]:
        inner = draw(st.sets(st.integers(1, n - 1), max_size=3)) if n > 1 else set()
        return [0] + sorted(inner) + [n]

    row_cuts, col_cuts = cuts(rows), cuts(cols)
    shards = [
        (r0, c0, r1 - r0, c1 - c0, draw(st.integers(0, world_size - 1)))
        for r0, r1 in zip(row_cuts, row_cuts[1:])
        for c0, c1 in zip(col_cuts, col_cuts[1:])
    ]
    return draw(st.permutations(shards))


class PropertyTest(PlanChecks):
    # pyre-ignore[56]
    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(data=st.data())
    def test_random_tilings(self, data: st.DataObject) -> None:
        world_size = data.draw(st.integers(1, 4), label="world_size")
        rows = data.draw(st.integers(1, 12), label="rows")
        cols = data.draw(st.integers(1, 12), label="cols")
        old_shards = data.draw(_tiling(rows, cols, world_size), label="old")
        new_shards = data.draw(_tiling(rows, cols, world_size), label="new")
        old = validate_parameter_sharding(
            "t", _sharding("grid_shard", old_shards), rows, cols, world_size, "cpu"
        )
        new = validate_parameter_sharding(
            "t", _sharding("grid_shard", new_shards), rows, cols, world_size, "cpu"
        )
        plan = plan_transfers({"t": old}, {"t": new})
        self.check_plan(plan, "t", old, new, world_size)
        self.check_rank_views(plan, world_size)

        # Elements whose owner changes, from element-wise owner maps.
        owner_before = torch.full((rows, cols), -1)
        owner_after = torch.full((rows, cols), -1)
        for target, shards in ((owner_before, old_shards), (owner_after, new_shards)):
            for r, c, nr, nc, rank in shards:
                target[r : r + nr, c : c + nc] = rank
        changed = int((owner_before != owner_after).sum())
        self.assertEqual(plan.moved_elements(), changed)
        itemsize = 2
        sent = sum(
            t.rect.numel * itemsize for r in range(world_size) for t in plan.sends(r)
        )
        received = sum(
            t.rect.numel * itemsize for r in range(world_size) for t in plan.receives(r)
        )
        self.assertEqual(sent, changed * itemsize)
        self.assertEqual(received, changed * itemsize)
        local = sum(
            t.rect.numel for r in range(world_size) for t in plan.local_copies(r)
        )
        self.assertEqual(local, rows * cols - changed)


# --------------------------------------------------------------------------
# Validation.


class ValidationTest(unittest.TestCase):
    NAME = "my_table"

    def assert_rejected(
        self,
        ps: object,
        reason: str,
        rows: int = 10,
        cols: int = 16,
        world_size: int = 2,
        device_type: str = "cpu",
    ) -> None:
        with self.assertRaises(ReshardError) as ctx:
            validate_parameter_sharding(
                self.NAME, ps, rows, cols, world_size, device_type  # pyre-ignore
            )
        message = str(ctx.exception)
        self.assertIn(f"'{self.NAME}'", message)
        self.assertRegex(message, reason)

    def test_valid_shardings_pass(self) -> None:
        for ps in (
            _sharding("table_wise", [(0, 0, 10, 16, 1)]),
            _sharding("table_wise", [(0, 0, 10, 16, 0)], kernel=FUSED),
            _sharding("column_wise", [(0, 0, 10, 4, 1), (0, 4, 10, 12, 0)]),
            _sharding("row_wise", [(0, 0, 9, 16, 1), (9, 0, 1, 16, 0)]),
            ParameterSharding(
                sharding_type="data_parallel", compute_kernel=DENSE, ranks=None
            ),
        ):
            layout = validate_parameter_sharding(self.NAME, ps, 10, 16, 2, "cpu")
            self.assertEqual((layout.rows, layout.cols), (10, 16))

    def test_gap(self) -> None:
        self.assert_rejected(
            _sharding("row_wise", [(0, 0, 4, 16, 0), (5, 0, 5, 16, 1)]), "tile"
        )

    def test_overlap(self) -> None:
        # EnumerableShardingSpec rejects overlaps at construction: overlap a
        # valid spec afterwards (as a hand-edited plan could).
        ps = _sharding("row_wise", [(0, 0, 5, 16, 0), (5, 0, 5, 16, 1)])
        ps.sharding_spec.shards[0].shard_sizes = [6, 16]
        self.assert_rejected(ps, "overlap")
        ps = _sharding("row_wise", [(0, 0, 5, 16, 0), (5, 0, 5, 16, 1)])
        ps.sharding_spec.shards.append(
            ShardMetadata(
                shard_offsets=[0, 0], shard_sizes=[5, 16], placement="rank:1/cpu"
            )
        )
        self.assert_rejected(ps, "overlap")

    def test_wrong_total_size(self) -> None:
        tw = _sharding("table_wise", [(0, 0, 10, 16, 0)])
        # The shards tile a 10x16 table, not the module's 12x16 / 10x20 one.
        self.assert_rejected(tw, "tile", rows=12)
        self.assert_rejected(tw, "tile", cols=20)
        # Larger than the table.
        self.assert_rejected(_sharding("table_wise", [(0, 0, 11, 16, 0)]), "tile")
        self.assert_rejected(
            _sharding(
                "row_wise", [(0, 0, 5, 16, 0), (5, 0, 5, 16, 1), (10, 0, 1, 16, 1)]
            ),
            "tile",
        )

    def test_rank_out_of_range(self) -> None:
        self.assert_rejected(
            _sharding("table_wise", [(0, 0, 10, 16, 2)]), "outside the process group"
        )
        self.assert_rejected(
            _sharding("column_wise", [(0, 0, 10, 8, 0), (0, 8, 10, 8, 7)]),
            "outside the process group",
        )
        # Valid placements, but an out-of-range rank in ``ranks``.
        self.assert_rejected(
            _sharding("table_wise", [(0, 0, 10, 16, 1)], ranks=[3]),
            "outside the process group",
        )

    def test_wrong_device_type(self) -> None:
        self.assert_rejected(
            _sharding("table_wise", [(0, 0, 10, 16, 0)], device="cuda:0"), "device type"
        )
        self.assert_rejected(
            _sharding("table_wise", [(0, 0, 10, 16, 0)]),
            "device type",
            device_type="cuda",
        )

    def test_unsupported_sharding_type(self) -> None:
        self.assert_rejected(
            _sharding("fancy_wise", [(0, 0, 10, 16, 0)]), "sharding type 'fancy_wise'"
        )

    def test_unsupported_compute_kernel(self) -> None:
        for kernel in (
            EmbeddingComputeKernel.QUANT.value,
            EmbeddingComputeKernel.KEY_VALUE.value,
            EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
        ):
            self.assert_rejected(
                _sharding("table_wise", [(0, 0, 10, 16, 0)], kernel=kernel),
                f"compute kernel '{kernel}'",
            )

    def test_table_wise_with_two_shards(self) -> None:
        self.assert_rejected(
            _sharding("table_wise", [(0, 0, 5, 16, 0), (5, 0, 5, 16, 1)]),
            "exactly one shard",
        )

    def test_column_wise_not_spanning_rows(self) -> None:
        for kind in ("column_wise", "table_column_wise"):
            self.assert_rejected(
                _sharding(kind, [(0, 0, 10, 8, 0), (0, 8, 5, 8, 1), (5, 8, 5, 8, 1)]),
                "span all 10 rows",
            )

    def test_row_wise_not_spanning_columns(self) -> None:
        for kind in ("row_wise", "table_row_wise"):
            self.assert_rejected(
                _sharding(kind, [(0, 0, 5, 16, 0), (5, 0, 5, 8, 1), (5, 8, 5, 8, 1)]),
                "span all 16 columns",
            )

    def test_missing_spec_and_wrong_object(self) -> None:
        self.assert_rejected(
            ParameterSharding(
                sharding_type="table_wise", compute_kernel=DENSE, ranks=[0]
            ),
            "EnumerableShardingSpec",
        )
        self.assert_rejected("table_wise", "ParameterSharding")


# --------------------------------------------------------------------------
# Delta digest.

# Built identically in this process and in a fresh interpreter.
_DELTA_SOURCE = """
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.resharding.plan import delta_digest
from torchrec.distributed.types import ParameterSharding


def build_delta():
    def ps(kind, shards, kernel="fused"):
        return ParameterSharding(
            sharding_type=kind,
            compute_kernel=kernel,
            ranks=[s[4] for s in shards],
            sharding_spec=EnumerableShardingSpec(
                [
                    ShardMetadata([r, c], [nr, nc], f"rank:{k}/cpu")
                    for r, c, nr, nc, k in shards
                ]
            ),
        )

    return {
        "t1": ps("column_wise", [(0, 0, 10, 8, 1), (0, 8, 10, 8, 0)]),
        "t0": ps("table_wise", [(0, 0, 10, 16, 1)]),
        "t2": ParameterSharding(
            sharding_type="data_parallel", compute_kernel="dense", ranks=None
        ),
    }
"""


def _build_delta() -> Dict[str, ParameterSharding]:
    namespace: Dict[str, object] = {}
    exec(_DELTA_SOURCE, namespace)
    return namespace["build_delta"]()  # pyre-ignore


class DeltaDigestTest(unittest.TestCase):
    def test_equal_for_equal_deltas_built_separately(self) -> None:
        a, b = _build_delta(), _build_delta()
        self.assertIsNot(a["t0"], b["t0"])
        self.assertEqual(delta_digest(a), delta_digest(b))
        # Also through TorchRec's own plan construction.
        self.assertEqual(
            delta_digest({"t": _constructed("GRID")}),
            delta_digest({"t": _constructed("GRID")}),
        )

    def test_independent_of_dict_order(self) -> None:
        a = _build_delta()
        reordered = {k: a[k] for k in reversed(list(a))}
        self.assertNotEqual(list(a), list(reordered))
        self.assertEqual(delta_digest(a), delta_digest(reordered))

    def test_different_for_different_deltas(self) -> None:
        base = delta_digest(_build_delta())
        variants = []
        d = _build_delta()
        d["t0"] = _sharding("table_wise", [(0, 0, 10, 16, 0)], kernel=FUSED)
        variants.append(d)  # another rank
        d = _build_delta()
        d["t0"].compute_kernel = DENSE
        variants.append(d)  # another kernel
        d = _build_delta()
        d["t1"] = _sharding("column_wise", [(0, 0, 10, 4, 1), (0, 4, 10, 12, 0)], FUSED)
        variants.append(d)  # other column cuts
        d = _build_delta()
        d["t1"].sharding_type = "table_column_wise"
        variants.append(d)  # another type, same shards
        d = _build_delta()
        del d["t2"]
        variants.append(d)  # a table fewer
        d = _build_delta()
        d["t3"] = d.pop("t2")
        variants.append(d)  # another table name
        digests = [delta_digest(v) for v in variants]
        self.assertNotIn(base, digests)
        self.assertEqual(len(set(digests)), len(digests))
        self.assertNotEqual(delta_digest({}), base)
        for digest in digests + [base]:
            self.assertIsInstance(digest, int)
            self.assertTrue(0 <= digest < 2**63)

    def test_describe_is_canonical(self) -> None:
        a, b = _build_delta(), _build_delta()
        for name in a:
            self.assertEqual(
                describe_parameter_sharding(a[name]),
                describe_parameter_sharding(b[name]),
            )

    def test_stable_across_processes(self) -> None:
        script = _DELTA_SOURCE + "\nprint(delta_digest(build_delta()))\n"
        env = dict(os.environ, PYTHONHASHSEED="12345")
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(
            int(result.stdout.strip().splitlines()[-1]), delta_digest(_build_delta())
        )


# --------------------------------------------------------------------------
# Rounds of the exchange.


def _transfer(
    table: str, src: int, dst: int, rows: int, cols: int, row: int = 0
) -> Transfer:
    rect = Rect(row, 0, rows, cols)
    return Transfer(table, src, dst, rect, rect, rect)


class SplitIntoRoundsTest(unittest.TestCase):
    FIELDS = {
        "a": [Field("weight", RECT, torch.float32)],
        "b": [Field("weight", RECT, torch.float16), Field("sum", ROWS, torch.float32)],
    }

    def size(self, t: Transfer) -> int:
        return sum(
            f.numel(t) * torch.empty((), dtype=f.dtype).element_size()
            for f in self.FIELDS[t.table]
        )

    def check_rounds(
        self, transfers: List[Transfer], rounds: List[List[Transfer]], cap: int
    ) -> None:
        remote = [t for t in transfers if not t.is_local]
        flat = [t for r in rounds for t in r]
        # Every remote transfer, in plan order, as row bands that tile it; no
        # local one.
        i = 0
        for t in remote:
            row = t.rect.row
            while row < t.rect.row + t.rect.rows:
                band = flat[i]
                i += 1
                self.assertEqual(
                    (
                        band.table,
                        band.src_rank,
                        band.dst_rank,
                        band.src_rect,
                        band.dst_rect,
                    ),
                    (t.table, t.src_rank, t.dst_rank, t.src_rect, t.dst_rect),
                )
                self.assertEqual(
                    (band.rect.row, band.rect.col, band.rect.cols),
                    (row, t.rect.col, t.rect.cols),
                )
                row += band.rect.rows
            self.assertEqual(row, t.rect.row + t.rect.rows)
        self.assertEqual(i, len(flat))
        for round_ in rounds:
            self.assertTrue(round_)
            load: Dict[int, int] = {}
            count: Dict[int, int] = {}
            for t in round_:
                for rank in (t.src_rank, t.dst_rank):
                    load[rank] = load.get(rank, 0) + self.size(t)
                    count[rank] = count.get(rank, 0) + 1
            for rank in load:
                # Per rank: within the cap, or a single one-row band larger
                # than it (which then shares the round with nothing else of
                # that rank).
                if load[rank] > cap:
                    self.assertEqual(count[rank], 1, (rank, round_))
                    (band,) = [t for t in round_ if rank in (t.src_rank, t.dst_rank)]
                    self.assertEqual(band.rect.rows, 1)

    def test_none_is_one_round_without_local(self) -> None:
        transfers = [
            _transfer("a", 0, 1, 4, 4),
            _transfer("a", 1, 1, 4, 4, row=4),
            _transfer("b", 1, 0, 2, 4),
            _transfer("b", 2, 2, 2, 4, row=2),
        ]
        self.assertEqual(
            split_into_rounds(transfers, self.FIELDS, None),
            [[transfers[0], transfers[2]]],
        )
        self.assertEqual(split_into_rounds(transfers[1::2], self.FIELDS, None), [])
        self.assertEqual(split_into_rounds([], self.FIELDS, None), [])
        self.assertEqual(split_into_rounds(transfers[1::2], self.FIELDS, 1), [])

    def test_cap_respected_per_rank(self) -> None:
        # 64 bytes each ("a": 4x4 fp32) between different rank pairs.
        transfers = [
            _transfer("a", 0, 1, 4, 4),
            _transfer("a", 2, 3, 4, 4),
            _transfer("a", 0, 2, 4, 4),
            _transfer("a", 1, 1, 4, 4, row=4),  # local: never in a round
            _transfer("a", 3, 1, 4, 4),
        ]
        # Cap 100: 0->1 and 2->3 share a round (disjoint ranks); 0->2 would
        # put 128 bytes on ranks 0 and 2, so it opens a second round, which
        # 3->1 joins (64 bytes on each of its ranks).
        rounds = split_into_rounds(transfers, self.FIELDS, 100)
        self.check_rounds(transfers, rounds, 100)
        self.assertEqual(
            rounds,
            [[transfers[0], transfers[1]], [transfers[2], transfers[4]]],
        )
        rounds = split_into_rounds(transfers, self.FIELDS, 64)
        self.check_rounds(transfers, rounds, 64)
        self.assertEqual(
            rounds, [[transfers[0], transfers[1]], [transfers[2], transfers[4]]]
        )
        # Cap 63: each 64-byte piece is cut into bands of 3 rows and 1 row.
        rounds = split_into_rounds(transfers, self.FIELDS, 63)
        self.check_rounds(transfers, rounds, 63)
        self.assertEqual(
            [t.rect.rows for r in rounds for t in r], [3, 1, 3, 1, 3, 1, 3, 1]
        )
        rounds = split_into_rounds(transfers, self.FIELDS, 10_000)
        self.assertEqual(rounds, [[t for t in transfers if not t.is_local]])

    def test_mixed_fields_sizes(self) -> None:
        # "b": 2x4 fp16 (16 bytes) + 2 fp32 row sums (8 bytes) = 24 bytes.
        t = _transfer("b", 0, 1, 2, 4)
        self.assertEqual(self.size(t), 24)
        transfers = [_transfer("b", 0, 1, 2, 4, row=2 * i) for i in range(5)]
        rounds = split_into_rounds(transfers, self.FIELDS, 48)
        self.check_rounds(transfers, rounds, 48)
        self.assertEqual([len(r) for r in rounds], [2, 2, 1])

    def test_piece_larger_than_cap_is_cut_into_row_bands(self) -> None:
        transfers = [
            _transfer("a", 0, 1, 1, 4),  # 16 bytes
            _transfer("a", 1, 0, 10, 4, row=1),  # 160 bytes > cap: 5 bands of 2 rows
            _transfer("a", 0, 1, 1, 4, row=11),  # 16 bytes
            _transfer("a", 0, 1, 1, 4, row=12),  # 16 bytes
        ]
        rounds = split_into_rounds(transfers, self.FIELDS, 40)
        self.check_rounds(transfers, rounds, 40)
        self.assertEqual(
            [[t.rect.rows for t in r] for r in rounds],
            [[1], [2], [2], [2], [2], [2], [1, 1]],
        )

    def test_row_larger_than_cap_travels_alone(self) -> None:
        transfers = [_transfer("a", 0, 1, 3, 4), _transfer("a", 2, 3, 1, 4)]
        rounds = split_into_rounds(transfers, self.FIELDS, 10)
        self.check_rounds(transfers, rounds, 10)
        self.assertEqual([[t.rect.rows for t in r] for r in rounds], [[1]] * 4)

    # pyre-ignore[56]
    @settings(max_examples=100, deadline=None)
    @given(
        pieces=st.lists(
            st.tuples(
                st.integers(0, 3),
                st.integers(0, 3),
                st.integers(1, 6),
                st.sampled_from(["a", "b"]),
            ),
            max_size=20,
        ),
        cap=st.integers(1, 400),
    )
    def test_random_rounds(
        self, pieces: List[Tuple[int, int, int, str]], cap: int
    ) -> None:
        transfers = [
            _transfer(table, src, dst, rows, 4, row=i * 8)
            for i, (src, dst, rows, table) in enumerate(pieces)
        ]
        rounds = split_into_rounds(transfers, self.FIELDS, cap)
        self.check_rounds(transfers, rounds, cap)
        self.assertEqual(rounds, split_into_rounds(transfers, self.FIELDS, cap))


class FieldKindTest(unittest.TestCase):
    def test_kinds(self) -> None:
        self.assertEqual(field_kind(torch.zeros(3, 4), 3, 4), RECT)
        self.assertEqual(field_kind(torch.zeros(12), 3, 4), RECT)
        self.assertEqual(field_kind(torch.zeros(3), 3, 4), ROWS)
        self.assertEqual(field_kind(torch.zeros(1), 3, 4), SCALAR)
        self.assertEqual(field_kind(torch.zeros(()), 3, 4), SCALAR)
        with self.assertRaises(ReshardError):
            field_kind(torch.zeros(5), 3, 4)
        t = _transfer("a", 0, 1, 3, 4)
        self.assertEqual(Field("w", RECT, torch.float32).numel(t), 12)
        self.assertEqual(Field("s", ROWS, torch.float32).numel(t), 3)
        self.assertEqual(Field("c", SCALAR, torch.float32).numel(t), 1)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of the pure half of live resharding: rectangles, layouts
and the transfers between two layouts. Every expectation is computed
independently of the planner (element owner maps, area sums, pairwise
disjointness), never by calling it twice. Validation and the request digest
are tested in test_plan_validation.py, the rounds of the exchange in
test_exchange.py.
"""

import itertools
import unittest
from typing import Callable, List, Sequence, Tuple

import torch
from hypothesis import given, HealthCheck, settings
from torchrec.distributed.resharding.plan import (
    layout_from_parameter_sharding,
    layout_from_shards_metadata,
    PlacedShard,
    Rect,
    replicated_layout,
    ReshardPlan,
    TableLayout,
    Transfer,
)
from torchrec.distributed.resharding.transfer_plan import (
    plan_table_transfers,
    plan_transfers,
)
from torchrec.distributed.test_utils.plan_layouts import (
    constructed_sharding,
    grid_tables,
    GridTable,
    one_table_ebc,
    sharding_by_hand,
    TABLE_COLS,
    TABLE_ROWS,
    TYPE_GENERATORS,
    WORLD,
)


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
            src_ranks = self.check_by_peer(
                receives, expected_receives, lambda t: t.src_rank
            )
            for src in set(src_ranks):
                # Within one source rank: plan order.
                self.assertEqual(
                    [t for t in receives if t.src_rank == src],
                    [t for t in expected_receives if t.src_rank == src],
                )

            expected_sends = [
                t for t in transfers if t.src_rank == rank and t.dst_rank != rank
            ]
            self.check_by_peer(plan.sends(rank), expected_sends, lambda t: t.dst_rank)

    def check_by_peer(
        self,
        got: Sequence[Transfer],
        expected: Sequence[Transfer],
        peer: Callable[[Transfer], int],
    ) -> List[int]:
        """
        Checks one rank's receives (or sends): the expected transfers, in
        the order of their peer ranks.

        Args:
            got (Sequence[Transfer]): what the plan lists.
            expected (Sequence[Transfer]): the transfers it must list.
            peer (Callable[[Transfer], int]): a transfer's peer rank.

        Returns:
            List[int]: the peer rank of each transfer, in the plan's order.
        """
        self.assertCountEqual(got, expected)
        peers = [peer(t) for t in got]
        self.assertEqual(peers, sorted(peers))
        return peers


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
        ps = constructed_sharding(kind)
        return layout_from_parameter_sharding(ps, TABLE_ROWS, TABLE_COLS, WORLD)

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
        self.assertEqual(layout, replicated_layout(TABLE_ROWS, TABLE_COLS, WORLD))
        for rank in range(WORLD):
            self.assertEqual(layout.bytes_on(rank, 4), TABLE_ROWS * TABLE_COLS * 4)

    def test_hand_built_uneven(self) -> None:
        ps = sharding_by_hand(
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

    def test_from_shards_metadata(self) -> None:
        ps = constructed_sharding("GRID")
        from_metadata = layout_from_shards_metadata(
            ps.sharding_spec.shards, TABLE_ROWS, TABLE_COLS
        )
        self.assertEqual(
            from_metadata,
            layout_from_parameter_sharding(ps, TABLE_ROWS, TABLE_COLS, WORLD),
        )
        # The same metadata through a ShardedTensor-style metadata object.
        metadata = ps.sharding_spec.build_metadata(
            torch.Size([TABLE_ROWS, TABLE_COLS]),
            torch.distributed._shard.sharded_tensor.TensorProperties(),
        )
        self.assertEqual(
            layout_from_shards_metadata(
                metadata.shards_metadata, TABLE_ROWS, TABLE_COLS
            ),
            from_metadata,
        )


class TypePairTransferTest(PlanChecks):
    """Every (old type, new type) pair among TW, CW, TWCW, RW, TWRW, GRID, DP."""

    def test_all_type_pairs(self) -> None:
        layouts = {
            kind: layout_from_parameter_sharding(
                constructed_sharding(kind), TABLE_ROWS, TABLE_COLS, WORLD
            )
            for kind in TYPE_GENERATORS
        }
        for old_kind, new_kind in itertools.product(TYPE_GENERATORS, TYPE_GENERATORS):
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
            old = layout_from_parameter_sharding(
                constructed_sharding(a), TABLE_ROWS, TABLE_COLS, WORLD
            )
            new = layout_from_parameter_sharding(
                constructed_sharding(b), TABLE_ROWS, TABLE_COLS, WORLD
            )
            return plan_transfers({"t": old}, {"t": new}).moved_elements()

        full = TABLE_ROWS * TABLE_COLS
        # TW on rank 2 -> CW on 0..3: everything but rank 2's quarter moves.
        self.assertEqual(moved("TW", "CW"), full * 3 // 4)
        # TW on rank 2 -> DP: three ranks receive the whole table.
        self.assertEqual(moved("TW", "DP"), 3 * full)
        # DP -> anything: every destination already holds its replica.
        for kind in TYPE_GENERATORS:
            self.assertEqual(moved("DP", kind), 0, kind)
        # TWRW (rows 0-4 on 2, 5-9 on 3) -> TW on 2: rows 5-9 move.
        self.assertEqual(moved("TWRW", "TW"), 5 * TABLE_COLS)
        # RW (3, 3, 3, 1 rows on 0..3) -> TWRW (5, 5 rows on 2, 3): rows 0-4
        # (rank 2 only had 6-8) and rows 5, 6, 7, 8 (rank 3 only had 9).
        self.assertEqual(moved("RW", "TWRW"), 5 * TABLE_COLS + 4 * TABLE_COLS)

    def test_replicated_source_prefers_own_replica(self) -> None:
        old = replicated_layout(TABLE_ROWS, TABLE_COLS, WORLD)
        for kind in TYPE_GENERATORS:
            new = layout_from_parameter_sharding(
                constructed_sharding(kind), TABLE_ROWS, TABLE_COLS, WORLD
            )
            transfers = plan_table_transfers("t", old, new)
            self.assertTrue(transfers)
            for t in transfers:
                self.assertEqual(t.src_rank, t.dst_rank, (kind, t))
        # TW on rank 3 from a replica: one local piece, the whole table.
        tw3 = TableLayout(
            TABLE_ROWS,
            TABLE_COLS,
            (PlacedShard(3, Rect(0, 0, TABLE_ROWS, TABLE_COLS)),),
        )
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
            sharding_by_hand(
                "grid_shard", [(5, 0, 5, 16, 1), (0, 8, 5, 8, 0), (0, 0, 5, 8, 1)]
            ),
            10,
            16,
            2,
        )
        new = layout_from_parameter_sharding(
            sharding_by_hand("row_wise", [(4, 0, 6, 16, 0), (0, 0, 4, 16, 1)]),
            10,
            16,
            2,
        )
        tw = layout_from_parameter_sharding(
            sharding_by_hand("table_wise", [(0, 0, 10, 16, 0)]), 10, 16, 2
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
        rw = sharding_by_hand(
            "row_wise", [(0, 0, 4, 16, 0), (4, 0, 1, 16, 2), (5, 0, 5, 16, 1)]
        )
        cw = sharding_by_hand("column_wise", [(0, 0, 10, 4, 1), (0, 4, 10, 12, 2)])
        twcw = sharding_by_hand(
            "table_column_wise", [(0, 0, 10, 12, 0), (0, 12, 10, 4, 0)]
        )
        grid = sharding_by_hand(
            "grid_shard",
            [(0, 0, 7, 4, 1), (7, 0, 3, 4, 0), (0, 4, 2, 12, 2), (2, 4, 8, 12, 1)],
        )
        shardings = {"rw": rw, "cw": cw, "twcw": twcw, "grid": grid}
        layouts = {
            k: layout_from_parameter_sharding(v, 10, 16, 3)
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
        ps = constructed_sharding("RW", one_table_ebc(rows=3, cols=8))
        sizes = [list(m.shard_sizes) for m in ps.sharding_spec.shards]
        self.assertEqual(sizes, [[1, 8], [1, 8], [1, 8], [0, 8]])
        rw = layout_from_parameter_sharding(ps, 3, 8, WORLD)
        self.assertEqual(rw.shards[3], PlacedShard(3, Rect(3, 0, 0, 8)))
        tw = layout_from_parameter_sharding(
            sharding_by_hand("table_wise", [(0, 0, 3, 8, 3)]), 3, 8, WORLD
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
        ps = sharding_by_hand(
            "row_wise", [(0, 0, 2, 16, 0), (2, 0, 0, 16, 1), (2, 0, 8, 16, 1)]
        )
        layout = layout_from_parameter_sharding(ps, 10, 16, 2)
        tw = layout_from_parameter_sharding(
            sharding_by_hand("table_wise", [(0, 0, 10, 16, 0)]), 10, 16, 2
        )
        plan = plan_transfers({"t": tw}, {"t": layout})
        self.check_plan(plan, "t", tw, layout, 2)
        self.assertEqual(plan.moved_elements(), 8 * 16)


# --------------------------------------------------------------------------
# Property test: random tilings of a random table.


class PropertyTest(PlanChecks):
    # pyre-ignore[56]
    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(table=grid_tables(tilings=2))
    def test_random_tilings(self, table: GridTable) -> None:
        world_size, rows, cols = table.world_size, table.rows, table.cols
        old_shards, new_shards = table.tilings
        old = layout_from_parameter_sharding(
            sharding_by_hand("grid_shard", old_shards), rows, cols, world_size
        )
        new = layout_from_parameter_sharding(
            sharding_by_hand("grid_shard", new_shards), rows, cols, world_size
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


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Splits in the per-window search (pure): a table-wise table hotter than moves
can fix becomes column-wise on the least loaded rank, its halves tiling its
columns in widths that are multiples of 4; a column-wise shard halves again
(k shards to 2k); the loads after are the costs moved; no split over a
rank's memory, onto a rank holding the table, of a table not allowed, of a
width that cannot be halved, or one that does not pay for its bytes; the
same inputs give the same splits; the split plan passes the engine's
validation (its geometry) and ``propose`` predicts the split's step time.
"""

import unittest
from typing import Dict, List, Sequence, Tuple

from torchrec.distributed.resharding.elastic_plan import plan_layouts, validate_new_plan
from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.rebalance.placement import (
    placement_from_tables,
    placement_of,
    plan_with_layouts,
    TableInfo,
)
from torchrec.distributed.resharding.rebalance.policy import (
    DEFAULT_LOOKUP_COLUMNS,
    RebalancePolicy,
)
from torchrec.distributed.resharding.rebalance.splits import search_splits, split_width
from torchrec.distributed.test_utils.rebalance_utils import EBC_PATH, hand_plan

ROWS, DIM = 64, 16
BYTES = 8  # per element


def _table(name: str, kind: str, shards: Sequence[Tuple[int, int, int]]) -> TableInfo:
    """A table of ROWS x DIM whose shards are (rank, col, cols)."""
    layout = TableLayout(
        ROWS,
        DIM,
        tuple(PlacedShard(r, Rect(0, c, ROWS, w)) for r, c, w in shards),
    )
    return TableInfo("m", name, kind, layout, BYTES)


def _costs(placement, per_col: Dict[str, float]) -> List[float]:  # pyre-ignore
    """Each unit's cost: its table's cost per column times its columns."""
    return [per_col[placement.tables[u.table].name] * u.work for u in placement.units]


class SplitWidthTest(unittest.TestCase):
    def test_widths_are_multiples_of_four(self) -> None:
        self.assertEqual(split_width(16), 8)
        self.assertEqual(split_width(12), 8)
        self.assertEqual(split_width(8), 4)
        self.assertIsNone(split_width(4))
        self.assertIsNone(split_width(10))


class SearchSplitsTest(unittest.TestCase):
    def _two_ranks(self, capacity: float = 1e12, price: float = 0.0):  # pyre-ignore
        tables = [
            _table("hot", "table_wise", [(0, 0, DIM)]),
            _table("cold", "table_wise", [(1, 0, DIM)]),
        ]
        placement = placement_from_tables(tables, 2)
        costs = _costs(placement, {"hot": 1.0, "cold": 0.125})  # 16 and 2
        loads = [16.0, 2.0]
        return (
            placement,
            costs,
            search_splits(
                placement,
                loads,
                costs,
                [capacity, capacity],
                {"m:hot", "m:cold"},
                byte_price=price,
            ),
        )

    def test_a_hot_table_wise_table_becomes_column_wise(self) -> None:
        _, _, result = self._two_ranks()
        # the hot table's half goes to rank 1, which is then the slowest:
        # half of the cold table comes back
        self.assertEqual(result.splits, 2)
        self.assertEqual(
            result.sharding_types, {"m:hot": "column_wise", "m:cold": "column_wise"}
        )
        shards = {
            key: [(s.rank, s.rect.col, s.rect.cols) for s in layout.shards]
            for key, layout in result.layouts.items()
        }
        self.assertEqual(
            shards, {"m:hot": [(0, 0, 8), (1, 8, 8)], "m:cold": [(1, 0, 8), (0, 8, 8)]}
        )
        self.assertEqual(result.loads, (9.0, 9.0))
        self.assertEqual((result.slowest_before, result.slowest_after), (16.0, 9.0))
        nbytes = 2 * ROWS * 8 * BYTES
        self.assertEqual(result.rank_bytes, (nbytes, nbytes))

    def test_no_split_over_memory_or_when_the_bytes_cost_more(self) -> None:
        # rank 1 holds the cold table: room for it only
        _, _, result = self._two_ranks(capacity=ROWS * DIM * BYTES + 1)
        self.assertEqual(result.splits, 0)
        self.assertEqual(result.layouts, {})
        _, _, result = self._two_ranks(price=1.0)  # 4096 s per step moved
        self.assertEqual(result.splits, 0)

    def test_column_wise_shards_halve_again_and_the_result_repeats(self) -> None:
        tables = [_table("hot", "column_wise", [(0, 0, 8), (1, 8, 8)])]
        tables += [_table(f"c{i}", "table_wise", [(2 + i, 0, DIM)]) for i in range(2)]
        placement = placement_from_tables(tables, 4)
        costs = _costs(placement, {"hot": 1.0, "c0": 0.0625, "c1": 0.0625})
        loads = [8.0, 8.0, 1.0, 1.0]
        args = (placement, loads, costs, [1e12] * 4, {"m:hot"})
        result = search_splits(*args)
        self.assertEqual(result.splits, 2)  # 2 shards -> 4
        shards = result.layouts["m:hot"].shards
        self.assertEqual(
            [(s.rank, s.rect.col, s.rect.cols) for s in shards],
            [(0, 0, 4), (2, 4, 4), (1, 8, 4), (3, 12, 4)],
        )
        self.assertEqual(result.loads, (4.0, 4.0, 5.0, 5.0))
        self.assertEqual(search_splits(*args), result)

    def test_tables_not_allowed_or_too_narrow_stay(self) -> None:
        placement, costs, _ = self._two_ranks()
        result = search_splits(placement, [16.0, 2.0], costs, [1e12] * 2, {"m:cold"})
        self.assertEqual(result.splits, 0)
        narrow = TableLayout(ROWS, 4, (PlacedShard(0, Rect(0, 0, ROWS, 4)),))
        placement = placement_from_tables(
            [TableInfo("m", "hot", "table_wise", narrow, BYTES)], 2
        )
        result = search_splits(placement, [4.0, 0.0], [4.0], [1e12] * 2, {"m:hot"})
        self.assertEqual(result.splits, 0)


class FixedCostTest(unittest.TestCase):
    """Each shard's fixed cost (per id, whatever its width): a split pays it anew."""

    def _hot_and_cold(self, hot_cost: float, cold_cost: float):  # pyre-ignore
        tables = [
            _table("cold", "table_wise", [(1, 0, DIM)]),
            _table("hot", "table_wise", [(0, 0, DIM)]),
        ]
        placement = placement_from_tables(tables, 2)
        costs = [cold_cost if u.table == 0 else hot_cost for u in placement.units]
        return placement, costs

    def test_the_receiver_of_a_piece_pays_the_fixed_cost(self) -> None:
        # hot: 1 per column plus 4 fixed; the piece that evens the ranks
        placement, costs = self._hot_and_cold(DIM + 4.0, 0.0)
        result = search_splits(
            placement, [20.0, 0.0], costs, [1e12] * 2, {"m:hot"}, fixed=[0.0, 4.0]
        )
        shards = result.layouts["m:hot"].shards
        self.assertEqual(
            [(s.rank, s.rect.col, s.rect.cols) for s in shards],
            [(0, 0, 8), (1, 8, 8)],
        )
        self.assertEqual(result.loads, (12.0, 12.0))  # 20 - 8, 0 + 8 + 4

    def test_no_split_when_the_fixed_cost_eats_the_gain(self) -> None:
        placement, costs = self._hot_and_cold(32.0, 20.0)
        args = (placement, [32.0, 20.0], costs, [1e12] * 2, {"m:hot"})
        # by elements only: 2 per column, 4 columns to rank 1 (24 and 28)
        self.assertEqual(search_splits(*args).loads, (24.0, 28.0))
        # 16 of the 32 fixed: any piece leaves rank 1 over 32
        result = search_splits(*args, fixed=[0.0, 16.0])
        self.assertEqual((result.splits, result.layouts), (0, {}))
        self.assertEqual(result.loads, (32.0, 20.0))

    def test_the_policy_takes_the_devices_fixed_cost(self) -> None:
        cpu = RebalancePolicy().on_device("cpu")
        self.assertEqual(cpu.lookup_columns, DEFAULT_LOOKUP_COLUMNS["cpu"])
        self.assertGreater(cpu.shard_lookup_columns(), 0.0)
        mine = RebalancePolicy(lookup_columns=0.0).on_device("cpu")
        self.assertEqual(mine.shard_lookup_columns(), 0.0)
        with self.assertRaises(ValueError):
            RebalancePolicy(lookup_columns=-1.0)


class MergeTest(unittest.TestCase):
    """
    Three ranks: ``cw`` column-wise over ranks 0 and 1 (cold: 0.25 per column
    and 4 fixed per shard), ``a`` table-wise on rank 1 (hot, not splittable),
    ``b`` on rank 2. Rank 1 is the slowest (6 + 10): merging its ``cw`` shard
    into rank 0's sheds 6 and adds 2 there; a split of it onto rank 2 would
    shed a quarter and add the fixed cost there.
    """

    def _search(self, capacity: float = 1e12, price: float = 0.0):  # pyre-ignore
        tables = [
            _table("cw", "column_wise", [(0, 0, 8), (1, 8, 8)]),
            _table("a", "table_wise", [(1, 0, DIM)]),
            _table("b", "table_wise", [(2, 0, DIM)]),
        ]
        placement = placement_from_tables(tables, 3)
        names = [t.name for t in placement.tables]
        cost = {"cw": lambda work: 0.25 * work + 4.0, "a": lambda _: 10.0}
        costs = [
            cost.get(names[u.table], lambda _: 1.0)(u.work) for u in placement.units
        ]
        loads = [6.0, 16.0, 1.0]
        return search_splits(
            placement,
            loads,
            costs,
            [capacity, 1e12, 1e12],
            {"m:cw"},
            byte_price=price,
            fixed=[4.0 if name == "cw" else 0.0 for name in names],
        )

    def test_a_cold_shard_on_the_slowest_rank_merges_into_its_neighbour(
        self,
    ) -> None:
        result = self._search()
        self.assertEqual((result.merges, result.splits), (1, 0))
        shards = result.layouts["m:cw"].shards
        self.assertEqual(
            [(s.rank, s.rect.col, s.rect.cols) for s in shards], [(0, 0, 16)]
        )
        self.assertEqual(result.sharding_types, {"m:cw": "column_wise"})
        self.assertEqual(result.loads, (8.0, 10.0, 1.0))
        nbytes = ROWS * 8 * BYTES
        self.assertEqual(result.rank_bytes, (nbytes, nbytes, 0))
        self.assertEqual(self._search(), result)  # the same on every rank

    def test_memory_and_the_price_of_bytes_bound_merges(self) -> None:
        # rank 0 has room for its own shard only: rank 1's shard cannot go
        # there; half of it is split onto rank 2, the other half then merges
        # into that piece (rank 1 sheds its shard, as a move of it would)
        result = self._search(capacity=ROWS * 8 * BYTES + 1)
        self.assertEqual((result.merges, result.splits), (1, 1))
        self.assertEqual(
            [(s.rank, s.rect.col, s.rect.cols) for s in result.layouts["m:cw"].shards],
            [(0, 0, 8), (2, 8, 8)],
        )
        self.assertEqual(result.loads, (6.0, 10.0, 7.0))
        nbytes = ROWS * 8 * BYTES
        self.assertEqual(result.rank_bytes, (0, nbytes, nbytes))
        result = self._search(price=1.0)
        self.assertEqual((result.merges, result.splits, result.layouts), (0, 0, {}))

    def test_the_merged_plan_is_valid_for_the_engine(self) -> None:
        plan = hand_plan(
            {"t0": ("column_wise", [0, 1]), "t1": ("table_wise", 1)}, 2, ROWS, DIM, 2
        )
        tables = {EBC_PATH: [("t0", ROWS, DIM), ("t1", ROWS, DIM)]}
        element_bytes = {f"{EBC_PATH}:t0": BYTES, f"{EBC_PATH}:t1": BYTES}
        placement = placement_of(plan, tables, element_bytes, 2)
        t1 = [t.name for t in placement.tables].index("t1")
        costs = [10.0 if u.table == t1 else 0.5 * u.work + 1.0 for u in placement.units]
        loads = [0.0, 0.0]
        for unit, cost in zip(placement.units, costs):
            loads[unit.rank] += cost
        result = search_splits(
            placement,
            loads,
            costs,
            [1e12] * 2,
            {f"{EBC_PATH}:t0"},
            fixed=[0.0 if i == t1 else 1.0 for i in range(2)],
        )
        self.assertEqual(result.merges, 1)
        new = plan_with_layouts(
            plan, placement, result.layouts, lambda r: "cpu", result.sharding_types
        )
        validate_new_plan(new, tables, 2, "cpu")
        t0 = new.plan[EBC_PATH]["t0"]  # pyre-ignore[16]
        self.assertEqual((t0.sharding_type, t0.ranks), ("column_wise", [0]))
        self.assertEqual(
            plan_layouts(new, tables, [0, 1])[f"{EBC_PATH}:t0"],
            result.layouts[f"{EBC_PATH}:t0"],
        )


class SplitPlanTest(unittest.TestCase):
    def test_the_split_plan_is_valid_for_the_engine(self) -> None:
        plan = hand_plan(
            {"t0": ("table_wise", 0), "t1": ("table_wise", 1)}, 2, ROWS, DIM, 2
        )
        tables = {EBC_PATH: [("t0", ROWS, DIM), ("t1", ROWS, DIM)]}
        element_bytes = {f"{EBC_PATH}:t0": BYTES, f"{EBC_PATH}:t1": BYTES}
        placement = placement_of(plan, tables, element_bytes, 2)
        costs = [16.0 if u.table == 0 else 2.0 for u in placement.units]
        result = search_splits(
            placement, [16.0, 2.0], costs, [1e12] * 2, {f"{EBC_PATH}:t0"}
        )
        new = plan_with_layouts(
            plan, placement, result.layouts, lambda r: "cpu", result.sharding_types
        )
        validate_new_plan(new, tables, 2, "cpu")
        t0 = new.plan[EBC_PATH]["t0"]  # pyre-ignore[16]
        self.assertEqual((t0.sharding_type, t0.ranks), ("column_wise", [0, 1]))
        self.assertEqual(
            plan_layouts(new, tables, [0, 1])[f"{EBC_PATH}:t0"],
            result.layouts[f"{EBC_PATH}:t0"],
        )
        # the untouched table keeps its sharding object
        self.assertIs(new.plan[EBC_PATH]["t1"], plan.plan[EBC_PATH]["t1"])


class MakeRoomTest(unittest.TestCase):
    """
    Three ranks: ``hot`` (8 columns, 1 per column) alone on rank 0; ``a``
    (not splittable) and ``c`` on rank 1, ``b`` (4, not splittable) on rank
    2. The narrowest piece of ``hot`` (4 columns) fits on no other rank as
    it is (rank 2 would reach 8, rank 1 more): rank 1 first hands on ``c``
    to rank 2, whole or a piece of it, whichever leaves the two lower.
    """

    def _search(  # pyre-ignore
        self, a_per_col: float, c_per_col: float, capacity: float = 1e12
    ):
        hot = TableLayout(ROWS, 8, (PlacedShard(0, Rect(0, 0, ROWS, 8)),))
        tables = [
            TableInfo("m", "hot", "table_wise", hot, BYTES),
            _table("a", "table_wise", [(1, 0, DIM)]),
            _table("b", "table_wise", [(2, 0, DIM)]),
            _table("c", "table_wise", [(1, 0, DIM)]),
        ]
        placement = placement_from_tables(tables, 3)
        per_col = {"hot": 1.0, "a": a_per_col, "b": 0.25, "c": c_per_col}
        costs = _costs(placement, per_col)
        loads = [0.0] * 3
        for unit, cost in zip(placement.units, costs):
            loads[unit.rank] += cost
        args = (placement, loads, costs, [1e12, 1e12, capacity], {"m:hot", "m:c"})
        return search_splits(*args, max_splits=1), search_splits(*args, max_splits=1)

    def _shards(self, result) -> Dict[str, List[Tuple[int, int, int]]]:  # pyre-ignore
        return {
            key: [(s.rank, s.rect.col, s.rect.cols) for s in layout.shards]
            for key, layout in result.layouts.items()
        }

    def test_the_receiver_hands_on_a_shard_whole(self) -> None:
        # rank 1: a 3.5 + c 3, 10.5 with the piece; c whole onto rank 2
        # leaves 7.5 and 7; the piece of c that best evens them (12
        # columns at most) leaves 8.25
        result, again = self._search(0.21875, 0.1875)
        self.assertEqual(
            self._shards(result),
            {"m:hot": [(0, 0, 4), (1, 4, 4)], "m:c": [(2, 0, DIM)]},
        )
        self.assertEqual(
            result.sharding_types, {"m:hot": "column_wise", "m:c": "table_wise"}
        )
        self.assertEqual(result.loads, (4.0, 7.5, 7.0))
        self.assertEqual((result.slowest_before, result.slowest_after), (8.0, 7.5))
        piece, whole_c = ROWS * 4 * BYTES, ROWS * DIM * BYTES
        self.assertEqual(result.rank_bytes, (piece, piece + whole_c, whole_c))
        self.assertEqual(again, result)
        # no room for c on rank 2: nothing is split
        result, _ = self._search(0.21875, 0.1875, capacity=ROWS * DIM * BYTES + 1)
        self.assertEqual((result.splits, result.layouts), (0, {}))

    def test_the_receiver_hands_on_a_piece(self) -> None:
        # rank 1: a 1 + c 4, 9 with the piece; c whole onto rank 2 leaves
        # 5 and 8 (not under rank 0's 8); the piece that evens them (a gap
        # of 20 columns: 8 columns, 2) leaves 7 and 6
        result, again = self._search(0.0625, 0.25)
        self.assertEqual(
            self._shards(result),
            {"m:hot": [(0, 0, 4), (1, 4, 4)], "m:c": [(1, 0, 8), (2, 8, 8)]},
        )
        self.assertEqual(
            result.sharding_types, {"m:hot": "column_wise", "m:c": "column_wise"}
        )
        self.assertEqual(result.loads, (4.0, 7.0, 6.0))
        self.assertEqual(result.splits, 2)
        piece = ROWS * 4 * BYTES
        self.assertEqual(result.rank_bytes, (piece, 3 * piece, 2 * piece))
        self.assertEqual(again, result)

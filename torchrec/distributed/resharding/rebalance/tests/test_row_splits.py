#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Row splits in the per-window search (pure): a table hotter than the mean
rank becomes row-wise over the whole group, table-row-wise over one host's
ranks, or a grid (column blocks, each table-row-wise over a host of its
own), whichever leaves the ranks lowest, each rank of its row group paying
its block's share and the per-rank output of its columns; loads and bytes
by hand; no split over a rank's memory, over the move budget or that does
not pay for its bytes; the same inputs give the same splits; the blocks
are the ones TorchRec's own ``row_wise()``, ``table_row_wise(host)`` and
grid shard sizes give, and the split plan passes the engine's validation.
"""

import unittest
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torchrec.distributed.resharding.elastic_plan import plan_layouts, validate_new_plan
from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.rebalance.costs import Proposal, propose
from torchrec.distributed.resharding.rebalance.placement import (
    Placement,
    placement_from_tables,
    placement_of,
    plan_with_layouts,
    TableInfo,
)
from torchrec.distributed.resharding.rebalance.row_splits import (
    grid_blocks,
    grid_layout,
    row_blocks,
    row_wise_layout,
    RowCosts,
    RowSplitResult,
    search_row_splits,
)
from torchrec.distributed.resharding.rebalance.statistics import LoadStatistics
from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets
from torchrec.distributed.test_utils.rebalance_utils import (
    EBC_PATH,
    rebalance_dlrm,
    window_statistics,
)
from torchrec.distributed.test_utils.reshard_utils import make_plan
from torchrec.distributed.types import ShardingPlan

ROWS, DIM = 64, 16
BYTES = 8  # per element
WHOLE = ROWS * DIM * BYTES
ROW_TYPES: Tuple[str, ...] = ("row_wise", "table_row_wise", "grid_shard")
NO_GRID: Tuple[str, ...] = ("row_wise", "table_row_wise")


def _whole(name: str, rank: int) -> TableInfo:
    layout = TableLayout(ROWS, DIM, (PlacedShard(rank, Rect(0, 0, ROWS, DIM)),))
    return TableInfo("m", name, "table_wise", layout, BYTES)


class RowBlocksTest(unittest.TestCase):
    def test_blocks_are_torchrec_s(self) -> None:
        # ceil(rows / n) each, the last non-empty one shorter, then empty
        self.assertEqual(row_blocks(10, 4), [(0, 3), (3, 3), (6, 3), (9, 1)])
        self.assertEqual(row_blocks(5, 4), [(0, 2), (2, 2), (4, 1), (5, 0)])
        self.assertEqual(row_blocks(64, 2), [(0, 32), (32, 32)])

    def test_grid_blocks_are_multiples_of_four(self) -> None:
        self.assertEqual(grid_blocks(16, 8), [2, 4])
        self.assertEqual(grid_blocks(64, 8), [2, 4, 8])
        self.assertEqual(grid_blocks(48, 16), [2, 3, 4, 6, 12])
        self.assertEqual(grid_blocks(16, 1), [])


class SearchRowSplitsTest(unittest.TestCase):
    """
    Four ranks on two hosts ({0, 1}, {2, 3}): ``hot`` (8: 0.5 per column for
    its rows, 1/32 per column per rank of a row group) alone on rank 0,
    ``a`` (1) on rank 1, ``b`` and ``c`` (``other`` each) on ranks 2 and 3;
    only ``hot`` may be split. Row-wise over the group: each rank +2.5;
    table-row-wise on host 0: ranks 0 and 1 +4.5 (rank 0 first sheds 8); on
    host 1: ranks 2 and 3 +4.5; a grid of two 8-column blocks: each rank
    +2.25.
    """

    def _search(  # pyre-ignore
        self,
        other: float,
        capacity: Optional[List[float]] = None,
        price: float = 0.0,
        budget: Optional[int] = None,
        allowed: Tuple[str, ...] = ROW_TYPES,
    ) -> Tuple[RowSplitResult, RowSplitResult]:
        tables = [_whole("a", 1), _whole("b", 2), _whole("c", 3), _whole("hot", 0)]
        placement = placement_from_tables(tables, 4)
        cost = {"hot": 8.0, "a": 1.0, "b": other, "c": other}
        costs = [cost[placement.tables[u.table].name] for u in placement.units]
        loads = [0.0] * 4
        for unit, c in zip(placement.units, costs):
            loads[unit.rank] += c
        hot = [t.name for t in placement.tables].index("hot")
        args = (
            placement,
            loads,
            costs,
            capacity or [1e12] * 4,
            {hot: RowCosts(0.5, 0.0, 1 / 32)},
            {hot: allowed},
        )
        kwargs = {"byte_price": price, "move_budget": budget, "local_world_size": 2}
        return (
            search_row_splits(*args, **kwargs),  # pyre-ignore[6]
            search_row_splits(*args, **kwargs),  # pyre-ignore[6]
        )

    def _blocks(self, result: RowSplitResult) -> Dict[str, List[Tuple[int, int, int]]]:
        return {
            key: [(s.rank, s.rect.row, s.rect.rows) for s in layout.shards]
            for key, layout in result.layouts.items()
            if all(s.rect.cols == DIM for s in layout.shards)
        }

    def test_row_wise_over_the_group(self) -> None:
        # b = c = 2: the group leaves 2.5, 3.5, 4.5, 4.5; host 0 would
        # leave 4.5 and 5.5, host 1 6.5 and 6.5 (no grid)
        result, again = self._search(2.0, allowed=NO_GRID)
        self.assertEqual(
            self._blocks(result),
            {"m:hot": [(0, 0, 16), (1, 16, 16), (2, 32, 16), (3, 48, 16)]},
        )
        self.assertEqual(result.sharding_types, {"m:hot": "row_wise"})
        self.assertEqual(result.loads, (2.5, 3.5, 4.5, 4.5))
        self.assertEqual((result.slowest_before, result.slowest_after), (8.0, 4.5))
        block = WHOLE // 4  # rank 0 keeps its block, sends the other three
        self.assertEqual(result.rank_bytes, (3 * block, block, block, block))
        self.assertEqual(
            result.rank_used, (block, WHOLE + block, *(2 * (WHOLE + block,)))
        )
        self.assertEqual(again, result)

    def test_table_row_wise_on_a_host(self) -> None:
        # b = c = 4: the group leaves 6.5 on ranks 2 and 3, host 0 leaves
        # 4.5 and 5.5, host 1 8.5, the grid 6.25 on ranks 2 and 3
        result, again = self._search(4.0)
        self.assertEqual(self._blocks(result), {"m:hot": [(0, 0, 32), (1, 32, 32)]})
        self.assertEqual(result.sharding_types, {"m:hot": "table_row_wise"})
        self.assertEqual(result.loads, (4.5, 5.5, 4.0, 4.0))
        half = WHOLE // 2
        self.assertEqual(result.rank_bytes, (half, half, 0, 0))
        self.assertEqual(again, result)

    def test_a_grid_of_column_blocks_on_two_hosts(self) -> None:
        # b = c = 2: the grid leaves 2.25, 3.25, 4.25, 4.25 (the group 4.5);
        # its first block on the least loaded host (1), the second on host 0
        result, again = self._search(2.0)
        self.assertEqual(result.sharding_types, {"m:hot": "grid_shard"})
        self.assertEqual(
            result.layouts, {"m:hot": grid_layout(ROWS, DIM, [[2, 3], [0, 1]])}
        )
        self.assertEqual(
            [(s.rank, s.rect) for s in result.layouts["m:hot"].shards],
            [
                (2, Rect(0, 0, 32, 8)),
                (3, Rect(32, 0, 32, 8)),
                (0, Rect(0, 8, 32, 8)),
                (1, Rect(32, 8, 32, 8)),
            ],
        )
        self.assertEqual(result.loads, (2.25, 3.25, 4.25, 4.25))
        piece = WHOLE // 4  # rank 0 keeps rows 0-31 of columns 8-15
        self.assertEqual(result.rank_bytes, (3 * piece, piece, piece, piece))
        self.assertEqual(again, result)

    def test_the_constraints_choose_the_type(self) -> None:
        result, _ = self._search(2.0, allowed=("table_row_wise",))
        self.assertEqual(result.sharding_types, {"m:hot": "table_row_wise"})
        result, _ = self._search(4.0, allowed=("row_wise",))
        self.assertEqual(result.sharding_types, {"m:hot": "row_wise"})
        self.assertEqual(result.loads, (2.5, 3.5, 6.5, 6.5))

    def test_memory_refuses(self) -> None:
        # rank 2 cannot take a quarter of hot: host 0 instead
        block = WHOLE // 4
        capacity = [1e12, 1e12, float(WHOLE + block - 1), 1e12]
        result, _ = self._search(2.0, capacity=capacity)
        self.assertEqual(result.sharding_types, {"m:hot": "table_row_wise"})
        self.assertEqual(result.loads, (4.5, 5.5, 2.0, 2.0))
        # nor rank 1 half of it: nothing
        capacity[1] = float(WHOLE + 2 * block - 1)
        result, _ = self._search(2.0, capacity=capacity)
        self.assertEqual((result.layouts, result.loads), ({}, (8.0, 1.0, 2.0, 2.0)))

    def test_the_budget_refuses(self) -> None:
        block = WHOLE // 4
        result, _ = self._search(2.0, budget=3 * block - 1)  # rank 0 sends 3
        self.assertEqual(result.sharding_types, {"m:hot": "table_row_wise"})
        result, _ = self._search(2.0, budget=2 * block - 1)  # host 0: 2
        self.assertEqual(result.layouts, {})
        self.assertEqual(result.rank_bytes, (0, 0, 0, 0))

    def test_a_split_must_pay_for_its_bytes(self) -> None:
        # 3 blocks sent at 1e-3 s per byte: 6.1 s more than the 3.5 it cuts
        result, _ = self._search(2.0, price=1e-3)
        self.assertEqual(result.layouts, {})
        # a price that the cut pays for: the same split as for free
        result, _ = self._search(2.0, price=1e-6)
        self.assertEqual(result.sharding_types, {"m:hot": "grid_shard"})

    def test_a_table_worth_less_than_a_rank_s_output_stays(self) -> None:
        # each rank of a row group would pay 1.5: with hot at 2 against
        # ranks of 1.5, no row split cuts the slowest rank
        tables = [_whole("hot", 0), _whole("b", 1)]
        placement = placement_from_tables(tables, 2)
        result = search_row_splits(
            placement,
            [2.0, 1.5],
            [1.5, 2.0],
            [1e12] * 2,
            {1: RowCosts(2.0 / DIM, 0.0, 1.5 / DIM)},
            {1: ROW_TYPES},
        )
        self.assertEqual(result.layouts, {})


def _propose_hot_split(stats: LoadStatistics, placement: Placement) -> Proposal:
    """``propose`` on eight ranks of two hosts, table "hot" splittable."""
    return propose(
        stats,
        placement,
        1e-3,
        [1e12] * 8,
        splittable={"m:hot"},
        row_splittable={"m:hot": ROW_TYPES},
        local_world_size=4,
    )


class ProposeRowSplitTest(unittest.TestCase):
    def _stats(self, ids: Dict[str, float]) -> LoadStatistics:
        # 1e-3 s per element, 16 columns: 31.25 samples per table and step
        # (1/32 s per column of output on each rank of a row group)
        return window_statistics(ids, (8.0,) + (1.0,) * 7, 8.5, 31.25 / 8)

    def test_propose_predicts_the_row_split(self) -> None:
        # eight ranks on two hosts of four: hot (500 ids, 8 s) alone on rank
        # 0, a table of 1 s on each other rank; the mean rank (1.875) is
        # under hot's narrowest column shard (4 columns, 2 s): column splits
        # cannot fix it. The grid (two 8-column blocks, 1 + 0.25 per rank)
        # leaves 1.25 and 2.25 (the group 2.5, a host 3.5)
        tables = [_whole("hot", 0)] + [_whole(f"t{r}", r) for r in range(1, 8)]
        placement = placement_from_tables(tables, 8)
        ids = {"hot": 500.0, **{f"t{r}": 62.5 for r in range(1, 8)}}
        stats = self._stats(ids)
        proposal = _propose_hot_split(stats, placement)
        self.assertEqual(proposal.sharding_types, {"m:hot": "grid_shard"})
        grid = grid_layout(ROWS, DIM, [[4, 5, 6, 7], [0, 1, 2, 3]])
        self.assertEqual(proposal.layouts, {"m:hot": grid})
        self.assertTrue(proposal.split)
        kernels = proposal.prediction.predicted_kernels
        for got, want in zip(kernels, (1.25,) + (2.25,) * 7):
            self.assertAlmostEqual(got, want)
        self.assertAlmostEqual(proposal.prediction.predicted_step, 2.75)
        # the modelled cut: rank 0's 8000 elements to 2250 on ranks 1-7
        self.assertAlmostEqual(proposal.prediction.modelled_saving, 5.75)
        # at 250 ids (4 s, its narrowest shard 1 s, under the mean 1.375)
        # column splits fix it: no row split
        ids["hot"] = 250.0
        stats = replace(self._stats(ids), compute_seconds=(4.0,) + (1.0,) * 7)
        proposal = _propose_hot_split(stats, placement)
        self.assertEqual(proposal.sharding_types, {"m:hot": "column_wise"})
        without = propose(stats, placement, 1e-3, [1e12] * 8)
        self.assertEqual((without.layouts, without.split), ({}, False))


class RowSplitPlanTest(unittest.TestCase):
    def _plans(self, specs: Dict[str, Tuple[str, object]]) -> ShardingPlan:
        ebc = rebalance_dlrm(2, ROWS, DIM, torch.device("meta"))
        module = ebc.model.sparse_arch.embedding_bag_collection
        return ShardingPlan({EBC_PATH: make_plan(module, specs, 4, 2, "fused")})

    def _two_table_wise_tables(self) -> Tuple[Any, ShardingPlan, Placement]:
        """t0 table-wise on rank 0, t1 on rank 2, of 4 ranks."""
        tables = {EBC_PATH: [("t0", ROWS, DIM), ("t1", ROWS, DIM)]}
        element_bytes = {f"{EBC_PATH}:t0": BYTES, f"{EBC_PATH}:t1": BYTES}
        plan = self._plans({"t0": ("table_wise", 0), "t1": ("table_wise", 2)})
        return tables, plan, placement_of(plan, tables, element_bytes, 4)

    def test_the_row_split_plans_are_torchrec_s_and_valid(self) -> None:
        tables, plan, placement = self._two_table_wise_tables()
        key = f"{EBC_PATH}:t0"
        for kind, ranks, reference in (
            ("row_wise", [0, 1, 2, 3], ("row_wise", None)),
            ("table_row_wise", [2, 3], ("table_row_wise", 1)),
        ):
            layout = row_wise_layout(ROWS, DIM, ranks)
            new = plan_with_layouts(
                plan, placement, {key: layout}, lambda r: "cpu", {key: kind}
            )
            validate_new_plan(new, tables, 4, "cpu")
            torchrec_plan = self._plans({"t0": reference, "t1": ("table_wise", 2)})
            self.assertEqual(
                plan_layouts(new, tables, list(range(4)))[key],
                plan_layouts(torchrec_plan, tables, list(range(4)))[key],
            )
            ps = new.plan[EBC_PATH]["t0"]  # pyre-ignore[16]
            expected = torchrec_plan.plan[EBC_PATH]["t0"]  # pyre-ignore[16]
            self.assertEqual((ps.sharding_type, ps.ranks), (kind, expected.ranks))

    def test_the_grid_plan_is_torchrec_s_and_valid(self) -> None:
        # TorchRec's grid shards (8-column blocks on 2 ranks per host), its
        # blocks on hosts 1 then 0 as grid_shard(host_indexes=[1, 0]) puts them
        tables, plan, placement = self._two_table_wise_tables()
        key = f"{EBC_PATH}:t0"
        sizes, offsets = calculate_shard_sizes_and_offsets(
            torch.empty(ROWS, DIM, device="meta"), 4, 2, "grid_shard", 8
        )
        ranks = [host * 2 + r for host in (1, 0) for r in range(2)]
        expected = [
            (rank, Rect(o[0], o[1], z[0], z[1]))
            for rank, z, o in zip(ranks, sizes, offsets)
        ]
        layout = grid_layout(ROWS, DIM, [[2, 3], [0, 1]])
        self.assertEqual([(s.rank, s.rect) for s in layout.shards], expected)
        new = plan_with_layouts(
            plan, placement, {key: layout}, lambda r: "cpu", {key: "grid_shard"}
        )
        validate_new_plan(new, tables, 4, "cpu")
        self.assertEqual(plan_layouts(new, tables, list(range(4)))[key], layout)
        ps = new.plan[EBC_PATH]["t0"]  # pyre-ignore[16]
        self.assertEqual((ps.sharding_type, ps.ranks), ("grid_shard", ranks))


if __name__ == "__main__":
    unittest.main()

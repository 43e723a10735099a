#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Which row split the per-window search takes (pure, loads by hand): a split
is ranked by the ranks it loads, not by the rank it relieves (whose other
tables stay whatever the layout); and a table hot enough for a row split
waits out the window's moves instead of being moved whole (which barred
its row split).
"""

import unittest
from typing import Tuple

from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.rebalance.costs import propose
from torchrec.distributed.resharding.rebalance.placement import (
    Placement,
    placement_from_tables,
    TableInfo,
)
from torchrec.distributed.resharding.rebalance.row_splits import (
    grid_layout,
    RowCosts,
    search_row_splits,
)
from torchrec.distributed.test_utils.rebalance_utils import window_statistics

ROWS, DIM = 64, 16
BYTES = 8  # per element
ROW_TYPES: Tuple[str, ...] = ("row_wise", "table_row_wise", "grid_shard")
# 0.5 s per column over all rows, 1/32 s per column of pooled output on
# each rank of a row group: a block of half the rows and 8 columns costs
# 0.5 x 0.5 x 8 + 8 / 32 = 2.25
HOT = RowCosts(0.5, 0.0, 1 / 32)


def _whole(name: str, rank: int) -> TableInfo:
    layout = TableLayout(ROWS, DIM, (PlacedShard(rank, Rect(0, 0, ROWS, DIM)),))
    return TableInfo("m", name, "table_wise", layout, BYTES)


def _index(placement: Placement, name: str) -> int:
    return [t.name for t in placement.tables].index(name)


class RankedByTheRanksItLoadsTest(unittest.TestCase):
    def test_the_grid_wins_where_the_relieved_rank_ties_every_layout(self) -> None:
        # eight ranks on four hosts of two: hot (8) and big (6, not
        # splittable) on rank 0, a table of 1 on every other rank. Whatever
        # hot becomes, rank 0 keeps big's 6: ranked by the ranks it changes
        # every layout off host 0 scores 6 and the first tried won, one
        # host's two ranks at 4.5 each; ranked by the ranks it loads, a
        # grid of two 8-column blocks on hosts 1 and 2 leaves them 3.25
        # (a grid over all four hosts puts 1.125 on rank 0: 7.125)
        tables = [_whole("hot", 0), _whole("big", 0)]
        tables += [_whole(f"t{r}", r) for r in range(1, 8)]
        placement = placement_from_tables(tables, 8)
        cost = {"hot": 8.0, "big": 6.0}
        costs = [cost.get(placement.tables[u.table].name, 1.0) for u in placement.units]
        loads = [14.0] + [1.0] * 7
        hot = _index(placement, "hot")
        result = search_row_splits(
            placement,
            loads,
            costs,
            [1e12] * 8,
            {hot: HOT},
            {hot: ROW_TYPES},
            local_world_size=2,
        )
        self.assertEqual(result.sharding_types, {"m:hot": "grid_shard"})
        self.assertEqual(
            result.layouts, {"m:hot": grid_layout(ROWS, DIM, [[2, 3], [4, 5]])}
        )
        self.assertEqual(result.loads, (6.0, 1.0) + (3.25,) * 4 + (1.0, 1.0))


class HotTablesWaitOutTheMovesTest(unittest.TestCase):
    def test_a_hot_table_is_split_by_rows_not_moved_whole(self) -> None:
        # eight ranks on two hosts of four: hot (16 s, its narrowest column
        # shard 4 s above the mean rank's 3.2) with x and y (3 s each) on
        # rank 0, 0.5 s on every other rank. Moved whole (rank 0 left at 6,
        # 16.5 on a rank of 0.5, against 19 for moving x), hot was then
        # barred from a row split and only cut by columns; held, the moves
        # take x off rank 0 and hot becomes table-row-wise on host 1 (4 s
        # and 0.5 s of output on each of ranks 4-7: 5, where a grid over
        # both hosts would leave rank 0, y's 3 s still on it, at 5.25)
        tables = [_whole("hot", 0), _whole("x", 0), _whole("y", 0)]
        tables += [_whole(f"t{r}", r) for r in range(1, 8)]
        placement = placement_from_tables(tables, 8)
        ids = {"hot": 1000.0, "x": 187.5, "y": 187.5}
        ids.update({f"t{r}": 31.25 for r in range(1, 8)})
        stats = window_statistics(ids, (22.0,) + (0.5,) * 7, 22.5, 31.25 / 8)
        keys = {f"m:{name}" for name in ids}
        proposal = propose(
            stats,
            placement,
            1e-3,
            [1e12] * 8,
            splittable=keys,
            row_splittable={"m:hot": ROW_TYPES},
            local_world_size=4,
        )
        search = proposal.search
        assert search is not None
        moved = {
            placement.tables[placement.units[i].table].name for i, _ in search.moves
        }
        self.assertNotIn("hot", moved)
        self.assertIn("x", moved)
        self.assertEqual(proposal.sharding_types["m:hot"], "table_row_wise")
        self.assertEqual(
            proposal.layouts["m:hot"], grid_layout(ROWS, DIM, [[4, 5, 6, 7]])
        )

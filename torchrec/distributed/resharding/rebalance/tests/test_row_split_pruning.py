#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The row split search prunes a candidate by a lower bound of its peak
before it builds the candidate's layout: differential against a search
that builds and scores every candidate (the same state, no pruning) on
random placements of hot tables over hosts, priced and not, with and
without a byte price, with and without a level (splits within it ranked by
what they add to all ranks); the two take the same splits and leave the
same loads, bytes and exchange seconds.
"""

import random
import unittest
from typing import Dict, List, Optional, Tuple

from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.rebalance.exchange_price import ExchangePrice
from torchrec.distributed.resharding.rebalance.placement import (
    Placement,
    placement_from_tables,
    TableInfo,
)
from torchrec.distributed.resharding.rebalance.row_splits import (
    _RowSplits,
    Grid,
    Outcome,
    RowCosts,
)

ROW_TYPES: Tuple[str, ...] = ("row_wise", "table_row_wise", "grid_shard")
HOST = 4  # ranks per host


class _Exhaustive(_RowSplits):
    """The search building and scoring every candidate (no bound)."""

    def best(
        self, s: int, ceiling: float
    ) -> Optional[Tuple[float, int, int, str, Grid, Outcome]]:
        best: Optional[Tuple[float, int, int, str, Grid, Outcome]] = None
        best_key: Optional[Tuple[int, float, int, int]] = None
        for t in sorted(self.on[s]):
            if t in self.layouts:
                continue
            for n, (kind, grid) in enumerate(self.candidates(t)):
                result = self.outcome(t, grid, ceiling)
                if result is None:
                    continue
                cost = self.byte_price * result[1]
                score = result[7] + cost
                rest = 0.0
                if result[5] > 0:
                    others = [v for r, v in enumerate(self.load) if r not in result[2]]
                    rest = max(others, default=0.0) + result[5]
                if max(result[0], rest) >= ceiling or result[0] + cost >= ceiling:
                    continue
                if score <= self.level:
                    key = (0, self.added(result) + cost, t, n)
                else:
                    key = (1, score, t, n)
                if best_key is None or key < best_key:
                    best_key = key
                    best = (score, t, n, kind, grid, result)
        return best


def _case(
    seed: int, world_size: int
) -> Tuple[Placement, List[float], List[float], Dict[int, RowCosts], List[float]]:
    """
    Random tables of 16 to 64 columns, whole or in two column shards, on
    random ranks; a few far hotter than the rest.
    """
    rng = random.Random(seed)
    tables = []
    for i in range(3 * world_size):
        cols = rng.choice([16, 32, 64])
        rows = rng.randint(50, 400)
        if cols > 16 and rng.random() < 0.3:
            half = cols // 2
            ranks = rng.sample(range(world_size), 2)
            shards = (
                PlacedShard(ranks[0], Rect(0, 0, rows, half)),
                PlacedShard(ranks[1], Rect(0, half, rows, half)),
            )
            kind = "column_wise"
        else:
            shards = (PlacedShard(rng.randrange(world_size), Rect(0, 0, rows, cols)),)
            kind = "table_wise"
        layout = TableLayout(rows, cols, shards)
        tables.append(TableInfo("m", f"t{i:03d}", kind, layout, 4))
    placement = placement_from_tables(tables, world_size)
    heat = [
        rng.uniform(20.0, 60.0) if rng.random() < 0.15 else rng.uniform(0.1, 2.0)
        for _ in placement.tables
    ]
    costs = []
    for unit in placement.units:
        layout = placement.tables[unit.table].layout
        rect = layout.shards[unit.shard].rect
        costs.append(heat[unit.table] * rect.cols / layout.cols)
    loads = [0.0] * world_size
    for unit, cost in zip(placement.units, costs):
        loads[unit.rank] += cost
    row_costs = {
        t: RowCosts(h / placement.tables[t].layout.cols, 1.0, h / 400.0)
        for t, h in enumerate(heat)
    }
    return placement, loads, costs, row_costs, heat


def _state(
    cls: type,
    seed: int,
    world_size: int,
    price: ExchangePrice,
    byte_price: float,
    capacity: float,
    level: float,
) -> _RowSplits:
    placement, loads, costs, row_costs, heat = _case(seed, world_size)
    mean = sum(loads) / world_size
    allowed = {t: ROW_TYPES for t, h in enumerate(heat) if h > mean}
    state = cls(
        placement,
        loads,
        costs,
        [u.rank for u in placement.units],
        placement.rank_bytes(),
        [0] * world_size,
        [capacity] * world_size,
        {t: row_costs[t] for t in allowed},
        allowed,
        byte_price,
        None,
        HOST,
        {t: (1e6 * heat[t], 1e4) for t in allowed},
        price,
        level * mean,
    )
    state.run(mean * (1.0 + 1e-9), 0.005, world_size // HOST)
    return state


class PruningTest(unittest.TestCase):
    def test_the_same_splits_as_every_candidate_built(self) -> None:
        prices = (
            ExchangePrice(),
            ExchangePrice(8e-11, 30e-6, 1e-10),
            ExchangePrice(1e-7, 1e-3, 1e-8),
        )
        splits = 0
        leveled = 0  # cases the level changed
        for seed in range(12):
            for world_size in (16, 32):
                for price in prices:
                    for byte_price, capacity in ((0.0, 1e12), (1e-6, 2e5)):
                        unleveled: Dict[int, Tuple[str, Grid]] = {}
                        for level in (0.0, 1.5):
                            args = (
                                seed,
                                world_size,
                                price,
                                byte_price,
                                capacity,
                                level,
                            )
                            pruned = _state(_RowSplits, *args)
                            every = _state(_Exhaustive, *args)
                            self.assertEqual(pruned.layouts, every.layouts, args)
                            self.assertEqual(pruned.load, every.load, args)
                            self.assertEqual(pruned.used, every.used, args)
                            self.assertEqual(pruned.traffic, every.traffic, args)
                            self.assertEqual(pruned.exchange, every.exchange, args)
                            splits += len(pruned.layouts)
                            if level == 0.0:
                                unleveled = pruned.layouts
                            elif pruned.layouts != unleveled:
                                leveled += 1
        self.assertGreater(splits, 0)  # the cases split tables
        self.assertGreater(leveled, 0)  # and the level changed some


if __name__ == "__main__":
    unittest.main()

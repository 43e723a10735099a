#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The column split search looks for a room made on a receiver only where it
could score the best split so far (pure): on random placements, priced and
not, the search finds the same splits, merges and loads as the same search
that looks at every room (``_Splits.best_room`` without its limit).
"""

import random
import unittest
from typing import Dict, List, Optional, Sequence, Tuple

from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.rebalance.exchange_price import (
    column_shard_seconds,
    ColumnShardSeconds,
    ExchangePrice,
)
from torchrec.distributed.resharding.rebalance.placement import (
    Placement,
    placement_from_tables,
    TableInfo,
)
from torchrec.distributed.resharding.rebalance.splits import _Splits, ALIGN

ROWS, DIM = 64, 32
BYTES = 8
SAMPLES = 32.0


class _EveryRoom(_Splits):
    """The search, looking at every room a receiver could make."""

    found: int = 0  # rooms found, over every search (the test's coverage)

    def best_room(
        self,
        s: int,
        d: int,
        t: int,
        after: float,
        nbytes: int,
        receivers: Sequence[int],
        ceiling: float,
        limit: float = float("inf"),
    ) -> Optional[Tuple[float, int, int, int, int, int, float]]:
        room = super().best_room(s, d, t, after, nbytes, receivers, ceiling)
        if room is not None:
            _EveryRoom.found += 1
        return room


def _table(name: str, shards: Sequence[Tuple[int, int, int]]) -> TableInfo:
    """A table of ROWS x DIM whose shards are (rank, col, cols)."""
    kind = "table_wise" if len(shards) == 1 else "column_wise"
    layout = TableLayout(
        ROWS, DIM, tuple(PlacedShard(r, Rect(0, c, ROWS, w)) for r, c, w in shards)
    )
    return TableInfo("m", name, kind, layout, BYTES)


def _case(
    rng: random.Random,
) -> Tuple[Placement, List[float], List[float], Dict[int, ColumnShardSeconds], float]:
    """A random placement, its units' costs, the ranks' loads, a price."""
    world = rng.choice([4, 8, 16])
    tables = []
    for i in range(rng.randint(world, 3 * world)):
        rank = rng.randrange(world)
        if rng.random() < 0.6:
            tables.append(_table(f"t{i}", [(rank, 0, DIM)]))
        else:
            width = rng.choice([8, 16, 24])
            other = (rank + rng.randrange(1, world)) % world
            tables.append(
                _table(f"t{i}", [(rank, 0, width), (other, width, DIM - width)])
            )
    placement = placement_from_tables(tables, world)
    per_col = [rng.choice([0.01, 0.05, 0.2, 1.0]) for _ in placement.tables]
    costs = [per_col[u.table] * u.work for u in placement.units]
    loads = [0.0] * world
    for unit, cost in zip(placement.units, costs):
        loads[unit.rank] += cost
    per_byte = rng.choice([0.0, 1e-6, 1e-5])
    ids = [rng.choice([100.0, 1000.0, 5000.0]) for _ in placement.tables]
    exchange = {}
    if per_byte > 0:
        price = ExchangePrice(per_byte)
        exchange = {
            t: column_shard_seconds(world, n, SAMPLES, price) for t, n in enumerate(ids)
        }
    return placement, costs, loads, exchange, rng.choice([0.0, 1e-9])


def _search(
    cls: type,
    placement: Placement,
    costs: Sequence[float],
    loads: Sequence[float],
    exchange: Dict[int, ColumnShardSeconds],
    byte_price: float,
) -> Tuple[object, ...]:
    world = placement.world_size
    state = cls(
        placement,
        loads,
        costs,
        [ROWS * DIM * BYTES * 4.0] * world,  # room for about four tables
        byte_price,
        None,
        [0] * world,
        {t.key for t in placement.tables},
        ALIGN,
        [u.rank for u in placement.units],
        [0.0] * len(placement.tables),
        None,
        exchange,
    )
    splits = state.run(sum(loads) / world * (1.0 + 1e-9), 0.005, world)
    return splits, state.merges, state.layouts(), tuple(state.load), state.lift


class RoomPruningTest(unittest.TestCase):
    def test_same_splits_as_looking_at_every_room(self) -> None:
        rng = random.Random(11)
        _EveryRoom.found = 0
        for case in range(120):
            placement, costs, loads, exchange, byte_price = _case(rng)
            with self.subTest(case=case):
                pruned = _search(_Splits, placement, costs, loads, exchange, byte_price)
                every = _search(
                    _EveryRoom, placement, costs, loads, exchange, byte_price
                )
                self.assertEqual(pruned, every)
        self.assertGreater(_EveryRoom.found, 20)  # rooms made, not only looked at


if __name__ == "__main__":
    unittest.main()

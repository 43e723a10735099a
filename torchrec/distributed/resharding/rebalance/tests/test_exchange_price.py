#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The work outside the kernels a row split adds (pure): each rank's bytes
per step under table-wise, row-wise and grid layouts, by hand; the
calibration's figures; and the row split search, which takes a split only
where the slowest rank's kernel plus priced exchange seconds fall, against
that price computed by hand.
"""

import random
import unittest

from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.rebalance.costs import modelled_saving
from torchrec.distributed.resharding.rebalance.exchange_price import (
    column_shard_seconds,
    exchange_price_of,
    ExchangePrice,
    ROW_COLLECTIVES,
    row_split_seconds,
    table_exchange,
)
from torchrec.distributed.resharding.rebalance.placement import (
    placement_from_tables,
    TableInfo,
)
from torchrec.distributed.resharding.rebalance.row_splits import (
    grid_layout,
    row_wise_layout,
    RowCosts,
    RowSplitResult,
    search_row_splits,
)

ROWS, DIM = 64, 16
IDS, SAMPLES = 1000.0, 32.0


def _whole(rank: int) -> TableLayout:
    return TableLayout(ROWS, DIM, (PlacedShard(rank, Rect(0, 0, ROWS, DIM)),))


class TableExchangeTest(unittest.TestCase):
    def test_table_wise(self) -> None:
        # four ranks; the holder receives 3/4 of the ids (8 bytes each) and
        # sends the output of 3/4 of the samples (16 fp32), receiving their
        # gradients; every other rank sends its quarter of the ids and
        # receives its quarter of the output, sending back its gradient
        got = table_exchange(_whole(2), 4, IDS, SAMPLES)
        holder = IDS * 3 / 4 * 8 + 2 * SAMPLES * 3 / 4 * DIM * 4
        other = IDS / 4 * 8 + 2 * SAMPLES / 4 * DIM * 4
        self.assertEqual(set(got.holders), {2})
        self.assertAlmostEqual(got.of(2), holder)
        for rank in (0, 1, 3):
            self.assertAlmostEqual(got.of(rank), other)

    def test_row_wise_over_the_group(self) -> None:
        # each rank receives 3/4 of its block's quarter of the ids and sends
        # a quarter of its ids to each of the 3 other blocks; reduce-scatters
        # forward and all-gathers backward 3/4 of every sample's output
        got = table_exchange(row_wise_layout(ROWS, DIM, [0, 1, 2, 3]), 4, IDS, SAMPLES)
        each = (IDS / 4 * 3 / 4 + 3 * IDS / 4 / 4) * 8 + 4 * SAMPLES * 3 / 4 * DIM * 4
        for rank in range(4):
            self.assertAlmostEqual(got.of(rank), each)

    def test_grid_over_two_hosts(self) -> None:
        # two 8-column blocks, block 0 over ranks {2, 3}, block 1 over
        # {0, 1}: each rank holds a quarter of the shards (half the rows of
        # one block): it receives 3/4 of half the ids, and sends a quarter
        # of half the ids to each of the 3 shards it does not hold; its
        # block reduce-scatters half of every sample's output between its 2
        # ranks and sends half of its slice (to the other host's samples);
        # it receives a quarter of the samples of the other block
        grid = grid_layout(ROWS, DIM, [[2, 3], [0, 1]])
        got = table_exchange(grid, 4, IDS, SAMPLES)
        ids = (IDS / 2 * 3 / 4 + 3 * IDS / 2 / 4) * 8
        own = 2 * (2 * SAMPLES / 2 + SAMPLES / 2 * 2 / 4) * 8 * 4
        other = 2 * SAMPLES / 4 * 8 * 4
        for rank in range(4):
            self.assertAlmostEqual(got.of(rank), ids + own + other)

    def test_row_split_seconds(self) -> None:
        # table-wise on rank 0 to row-wise over two ranks: each rank
        # exchanges 64 bytes per sample more (half of every sample's 16
        # fp32 reduce-scattered and all-gathered, instead of sent and
        # received once), its ids as many; every rank bucketizes half the
        # ids, and the row sharding runs its collectives
        price = ExchangePrice(1e-4, 0.1, 0.004)
        delta, others = row_split_seconds(
            _whole(0), row_wise_layout(ROWS, DIM, [0, 1]), 2, IDS, SAMPLES, price
        )
        added = 64 * SAMPLES * 1e-4 + IDS / 2 * 0.004 + ROW_COLLECTIVES * 0.1
        self.assertEqual(set(delta), {0, 1})
        for rank in (0, 1):
            self.assertAlmostEqual(delta[rank], added)
        # a rank holding no shard would send its ids and receive its output
        # alike: it pays the bucketization and the collectives only
        self.assertAlmostEqual(others, IDS / 2 * 0.004 + ROW_COLLECTIVES * 0.1)

    def test_no_price_nothing_added(self) -> None:
        layout = row_wise_layout(ROWS, DIM, [0, 1])
        free = ExchangePrice()
        delta, others = row_split_seconds(_whole(0), layout, 2, IDS, SAMPLES, free)
        self.assertEqual((delta, others), ({0: 0.0, 1: 0.0}, 0.0))


class ColumnShardSecondsTest(unittest.TestCase):
    def test_a_column_split_by_hand_and_by_layout(self) -> None:
        # four ranks; 4 of the 16 columns of a table on rank 2 go to rank 1:
        # rank 1 receives 2/4 of the ids (3/4 from the others, less its own
        # quarter it no longer sends) and exchanges its 4 columns' output
        # of 2/4 of the samples both ways; rank 2 exchanges 4 columns less;
        # every rank sends its quarter of the ids to one shard more
        per_byte = 1e-4
        got = column_shard_seconds(4, IDS, SAMPLES, ExchangePrice(per_byte))
        self.assertAlmostEqual(got.shard, IDS * 2 / 4 * 8 * per_byte)
        self.assertAlmostEqual(got.column, 2 * SAMPLES * 2 / 4 * 4 * per_byte)
        self.assertAlmostEqual(got.everyone, IDS / 4 * 8 * per_byte)
        # the same as the layouts' exchange before and after
        split = TableLayout(
            ROWS,
            DIM,
            (
                PlacedShard(2, Rect(0, 0, ROWS, DIM - 4)),
                PlacedShard(1, Rect(0, DIM - 4, ROWS, 4)),
            ),
        )
        before = table_exchange(_whole(2), 4, IDS, SAMPLES)
        after = table_exchange(split, 4, IDS, SAMPLES)
        expected = {
            0: got.everyone,
            1: got.shard + 4 * got.column + got.everyone,
            2: -4 * got.column + got.everyone,
            3: got.everyone,
        }
        for rank, seconds in expected.items():
            self.assertAlmostEqual(
                (after.of(rank) - before.of(rank)) * per_byte, seconds
            )

    def test_figures_are_the_bytes_model_at_any_world(self) -> None:
        # a table whole on one rank, at random worlds and volumes: its holder
        # adds one shard and every column's figure over a rank holding none,
        # and every rank its own ids to the shard and its samples' output
        rng = random.Random(11)
        for _ in range(100):
            world = rng.choice([2, 3, 4, 16, 64, 1024])
            rank = rng.randrange(world)
            ids, samples = rng.uniform(1.0, 1e7), rng.uniform(1.0, 1e6)
            price = ExchangePrice(rng.uniform(1e-11, 1e-8))
            got = column_shard_seconds(world, ids, samples, price)
            model = table_exchange(_whole(rank), world, ids, samples)
            per_byte = price.seconds_per_byte
            holder = (model.of(rank) - model.others) * per_byte
            self.assertAlmostEqual(
                got.shard + DIM * got.column, holder, delta=1e-12 * abs(holder)
            )
            own_output = 2 * samples / world * DIM * 4 * per_byte
            self.assertAlmostEqual(
                got.everyone + own_output,
                model.others * per_byte,
                delta=1e-12 * model.others * per_byte,
            )

    def test_no_price_nothing(self) -> None:
        got = column_shard_seconds(4, IDS, SAMPLES, ExchangePrice(0.0, 0.1, 0.004))
        self.assertEqual((got.shard, got.column, got.everyone), (0.0, 0.0, 0.0))


class ExchangePriceTest(unittest.TestCase):
    def test_figures_of_a_calibration(self) -> None:
        # 1 ms for 100 bytes, 11 ms for 1e6 + 100: 1e-8 s per byte, 1 ms
        # less 1 us per collective; 5 ms for 1e5 ids: 50 ns per id
        price = exchange_price_of(1e-3, 11e-3, 100.0, 1e6 + 100, 5e-3, 1e5)
        self.assertAlmostEqual(price.seconds_per_byte, 1e-8)
        self.assertAlmostEqual(price.seconds_per_collective, 1e-3 - 1e-6)
        self.assertAlmostEqual(price.seconds_per_id, 5e-8)
        self.assertTrue(price.priced)
        self.assertFalse(ExchangePrice().priced)

    def test_noise_hiding_the_slope_gives_the_upper_bound(self) -> None:
        # the large exchange timed faster than the small: its own seconds
        # over its bytes, never zero
        price = exchange_price_of(2e-3, 1e-3, 100.0, 1e6, 0.0, 1e5)
        self.assertAlmostEqual(price.seconds_per_byte, 1e-9)
        self.assertAlmostEqual(price.seconds_per_collective, 2e-3 - 1e-7)


class PricedRowSplitTest(unittest.TestCase):
    """
    Two ranks: ``hot`` (8 s: 0.5 s per column for its rows, 1/32 s per
    column of output on each rank of a row group) alone on rank 0, ``b``
    (1 s) on rank 1. Row-wise over both ranks each rank pays 4 + 0.5:
    loads 4.5 and 5.5 before the exchange's price, which adds to each rank
    (by hand) 64 bytes per sample, the bucketization of half the ids and
    the row sharding's collectives.
    """

    def _search(self, price: ExchangePrice) -> RowSplitResult:
        tables = [
            TableInfo("m", "hot", "table_wise", _whole(0), 8),
            TableInfo("m", "b", "table_wise", _whole(1), 8),
        ]
        placement = placement_from_tables(tables, 2)
        hot = [t.name for t in placement.tables].index("hot")
        costs = [8.0 if u.table == hot else 1.0 for u in placement.units]
        return search_row_splits(
            placement,
            [8.0, 1.0],
            costs,
            [1e12] * 2,
            {hot: RowCosts(0.5, 0.0, 1 / 32)},
            {hot: ("row_wise",)},
            volumes={hot: (IDS, SAMPLES)},
            price=price,
        )

    def _added(self, price: ExchangePrice) -> float:
        return (
            64 * SAMPLES * price.seconds_per_byte
            + IDS / 2 * price.seconds_per_id
            + ROW_COLLECTIVES * price.seconds_per_collective
        )

    def test_a_split_whose_priced_step_is_lower_is_taken(self) -> None:
        price = ExchangePrice(1e-4, 0.0, 0.004)  # 0.2048 + 2 s per rank
        added = self._added(price)
        self.assertLess(5.5 + added, 8.0)
        result = self._search(price)
        self.assertEqual(result.sharding_types, {"m:hot": "row_wise"})
        for got, want in zip(result.loads, (4.5 + added, 5.5 + added)):
            self.assertAlmostEqual(got, want)
        for got in result.exchange_seconds:
            self.assertAlmostEqual(got, added)
        self.assertAlmostEqual(result.slowest_after, 5.5 + added)

    def test_a_split_whose_priced_step_is_not_lower_is_refused(self) -> None:
        price = ExchangePrice(1e-4, 0.1, 0.004)  # 2.5048 s per rank
        self.assertGreaterEqual(5.5 + self._added(price), 8.0)
        result = self._search(price)
        self.assertEqual(result.layouts, {})
        self.assertEqual(result.loads, (8.0, 1.0))
        self.assertEqual(result.exchange_seconds, (0.0, 0.0))
        # unpriced, the kernels alone would take it
        self.assertEqual(
            self._search(ExchangePrice()).sharding_types, {"m:hot": "row_wise"}
        )

    def test_the_saving_is_the_slowest_rank_s_kernel_and_exchange(self) -> None:
        # elements 10 and 4 before; 5 and 6 after at 1 s each, with 0.5
        # and 3 s of exchange: the slowest rank goes from 10 to 9 s
        self.assertEqual(modelled_saving([10, 4], [5, 6], 1.0, [0.5, 3]), 1.0)
        self.assertEqual(modelled_saving([10, 4], [5, 6], 1.0), 4.0)


if __name__ == "__main__":
    unittest.main()

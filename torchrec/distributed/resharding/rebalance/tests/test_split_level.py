#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The level the window's splits aim for (pure): ``split_level`` against every
combination of layouts tried (the least slowest rank over them, and which
tables it lays out by rows), and each layout's price against the exchange
model summed rank by rank over the table's layout before and after.
"""

import itertools
import random
import unittest
from typing import Dict, List, Tuple

from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.rebalance.exchange_price import (
    column_shard_seconds,
    ExchangePrice,
    row_blocks_spread,
    ROW_COLLECTIVES,
    table_exchange,
)
from torchrec.distributed.resharding.rebalance.row_splits import (
    grid_blocks,
    grid_layout,
    row_wise_layout,
    RowCosts,
)
from torchrec.distributed.resharding.rebalance.split_level import (
    column_options,
    LayoutOption,
    row_options,
    split_level,
)

PRICE = ExchangePrice(8e-11, 30e-6, 1e-10)
ROW_TYPES: Tuple[str, ...] = ("row_wise", "table_row_wise", "grid_shard")


def _every_combination(
    total: float, world_size: int, options: Dict[int, List[LayoutOption]]
) -> Tuple[float, Dict[int, bool]]:
    """
    The least slowest rank over every combination of one layout per table
    (its busiest rank, or the mean rank), and each table's layout in the
    combination reaching it that adds the least to all ranks.
    """
    tables = sorted(options)
    combos = []
    for combo in itertools.product(*(options[t] for t in tables)):
        added = sum(o.added for o in combo)
        value = max([(total + added) / world_size] + [o.peak for o in combo])
        combos.append((value, added, combo))
    least = min(value for value, _, _ in combos)
    _, _, combo = min(
        (c for c in combos if c[0] <= least * (1 + 1e-9)), key=lambda c: c[1]
    )
    return least, {t: o.by_rows for t, o in zip(tables, combo)}


class SplitLevelTest(unittest.TestCase):
    def test_the_least_slowest_rank_of_every_combination(self) -> None:
        rng = random.Random(0)
        rows = 0
        for case in range(300):
            world_size = rng.choice([4, 16, 64])
            tables = rng.randint(1, 4)
            options: Dict[int, List[LayoutOption]] = {}
            for t in range(tables):
                # the layout now adds nothing; narrower ones load their
                # busiest rank less and add more to all ranks
                now = rng.uniform(5.0, 50.0)
                table = [LayoutOption(now, 0.0, False)]
                for _ in range(rng.randint(1, 5)):
                    table.append(
                        LayoutOption(
                            rng.uniform(0.5, now),
                            rng.uniform(-1.0, 20.0),
                            rng.random() < 0.5,
                        )
                    )
                options[3 * t + 1] = table
            total = rng.uniform(0.0, 40.0) * world_size
            want, layouts = _every_combination(total, world_size, options)
            got = split_level(total, world_size, options)
            self.assertAlmostEqual(got.level, want, delta=1e-9 * want, msg=case)
            self.assertEqual(
                got.by_rows, frozenset(t for t, r in layouts.items() if r), case
            )
            rows += len(got.by_rows)
        self.assertGreater(rows, 0)  # some tables are laid out by rows

    def test_the_layout_now_where_nothing_lowers_the_step(self) -> None:
        # the mean rank above every layout's busiest rank: nothing to gain,
        # the level is the mean and every table keeps the layout now
        options = {
            0: [LayoutOption(3.0, 0.0, False), LayoutOption(1.0, 2.0, True)],
        }
        got = split_level(40.0, 4, options)
        self.assertEqual(got.level, 10.0)
        self.assertEqual(got.by_rows, frozenset())


def _column_wise(rows: int, cols: int, count: int) -> TableLayout:
    width = cols // count
    return TableLayout(
        rows,
        cols,
        tuple(PlacedShard(r, Rect(0, r * width, rows, width)) for r in range(count)),
    )


def _exchange_seconds(
    layout: TableLayout, world_size: int, ids: float, samples: float
) -> List[float]:
    exchange = table_exchange(layout, world_size, ids, samples)
    return [exchange.of(r) * PRICE.seconds_per_byte for r in range(world_size)]


def _reference_option(
    before: TableLayout,
    after: TableLayout,
    world_size: int,
    volumes: Tuple[float, float],
    costs: RowCosts,
    kernel_before: float,
    price: ExchangePrice,
) -> Tuple[float, float]:
    """
    A row layout's busiest rank and what it adds to all ranks, summed rank
    by rank from each shard's kernel and the bytes model before and after.
    """
    ids, samples = volumes
    old = table_exchange(before, world_size, ids, samples)
    new = table_exchange(after, world_size, ids, samples)
    spread = row_blocks_spread(after) - row_blocks_spread(before)
    fixed = 0.0
    if spread > 0:
        fixed = price.seconds_per_id * ids / world_size * spread
        fixed += price.seconds_per_collective * ROW_COLLECTIVES
    seconds = [
        (new.of(r) - old.of(r)) * price.seconds_per_byte + fixed
        for r in range(world_size)
    ]
    kernels: Dict[int, float] = {}
    for shard in after.shards:
        kernels[shard.rank] = kernels.get(shard.rank, 0.0) + costs.block(
            shard.rect.rows / after.rows, shard.rect.cols
        )
    busiest = max([0.0] + [k + seconds[r] for r, k in kernels.items()])
    return busiest, sum(kernels.values()) - kernel_before + sum(seconds)


class LayoutPriceTest(unittest.TestCase):
    WORLD, ROWS, COLS, IDS, SAMPLES = 16, 1000, 32, 5e5, 4096.0
    SLOPE, LOOKUP = 2e-10, 3.0

    def test_column_layouts_add_what_their_exchange_and_shards_add(self) -> None:
        w, rows, cols, ids = self.WORLD, self.ROWS, self.COLS, self.IDS
        whole = _column_wise(rows, cols, 1)
        before = sum(_exchange_seconds(whole, w, ids, self.SAMPLES))
        options = column_options(
            cols,
            1,
            ids,
            w,
            self.SLOPE,
            self.LOOKUP,
            column_shard_seconds(w, ids, self.SAMPLES, PRICE),
        )
        by_width = {}
        for count in (1, 2, 4, 8):
            after = _column_wise(rows, cols, count)
            exchange = _exchange_seconds(after, w, ids, self.SAMPLES)
            kernel = ids * self.SLOPE * ((cols // count) + self.LOOKUP)
            # one more shard: its fixed cost per id, and its exchange
            added = (count - 1) * ids * self.SLOPE * self.LOOKUP
            added += sum(exchange) - before
            busiest = kernel + max(exchange[r] - exchange[w - 1] for r in range(count))
            by_width[cols // count] = (busiest, added)
        got = {}
        for option in options:
            self.assertFalse(option.by_rows)
            got[round(option.peak, 15)] = option.added
        self.assertEqual(len(options), 5)  # widths 32, 16, 12, 8 and 4
        for width, (busiest, added) in by_width.items():
            match = [o for o in options if abs(o.peak - busiest) <= 1e-12]
            self.assertEqual(len(match), 1, width)
            self.assertAlmostEqual(match[0].added, added, delta=1e-12)

    def test_row_layouts_add_what_their_blocks_and_exchange_add(self) -> None:
        w, rows, cols, ids, samples = (
            self.WORLD,
            self.ROWS,
            self.COLS,
            self.IDS,
            self.SAMPLES,
        )
        costs = RowCosts(ids * self.SLOPE, self.LOOKUP, samples * self.SLOPE)
        whole = _column_wise(rows, cols, 1)  # on rank 0, host 0
        before = _exchange_seconds(whole, w, ids, samples)
        kernel_before = ids * self.SLOPE * (cols + self.LOOKUP)
        options = row_options(
            whole, 1, ids, samples, costs, w, 4, ROW_TYPES, [0], PRICE
        )
        # off host 0 (the table's): table-row-wise on host 1, row-wise over
        # the group, grids of 2 and 4 column blocks on hosts 1, 2, 3, 0
        hosts = [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [0, 1, 2, 3]]
        layouts = [
            (row_wise_layout(rows, cols, hosts[0]), 1),
            (row_wise_layout(rows, cols, list(range(w))), 1),
            (grid_layout(rows, cols, hosts[:2]), 2),
            (grid_layout(rows, cols, hosts), 4),
        ]
        self.assertEqual(len(options), len(layouts))
        for option, (layout, blocks) in zip(options, layouts):
            self.assertTrue(option.by_rows)
            after = _exchange_seconds(layout, w, ids, samples)
            # every rank bucketizes its ids once per column block spread by
            # rows and joins the row sharding's collectives
            fixed = PRICE.seconds_per_id * ids / w * blocks
            fixed += PRICE.seconds_per_collective * ROW_COLLECTIVES
            kernels: Dict[int, float] = {}
            for shard in layout.shards:
                kernels[shard.rank] = costs.block(
                    shard.rect.rows / rows, shard.rect.cols
                )
            added = sum(kernels.values()) - kernel_before
            added += sum(after) - sum(before) + fixed * w
            busiest = max(k + after[r] - before[r] + fixed for r, k in kernels.items())
            self.assertAlmostEqual(option.added, added, delta=1e-12)
            self.assertAlmostEqual(option.peak, busiest, delta=1e-12)

    def test_any_row_layout_priced_as_the_model_summed_rank_by_rank(self) -> None:
        # row layouts are priced per block size, the ranks holding the table
        # now one by one: for random groups, tables (fewer rows than ranks,
        # rows not a multiple of them) and holders (some inside the new
        # layout, some holding two of its column shards), the same as each
        # rank summed from the bytes model
        rng = random.Random(3)
        for case in range(300):
            local = rng.choice([2, 4, 8])
            w = local * rng.choice([2, 4, 8, 16])
            rows = rng.choice([rng.randint(1, w - 1), rng.randint(w, 50 * w)])
            cols = 4 * rng.randint(1, 16)
            count = rng.choice([c for c in (1, 2, 4) if cols % (4 * c) == 0])
            width = cols // count
            holders = rng.sample(range(w), count)
            if count > 1 and rng.random() < 0.3:
                holders[-1] = holders[0]
            before = TableLayout(
                rows,
                cols,
                tuple(
                    PlacedShard(r, Rect(0, i * width, rows, width))
                    for i, r in enumerate(holders)
                ),
            )
            ids, samples = rng.uniform(1e3, 1e7), rng.uniform(1e2, 1e5)
            costs = RowCosts(ids * self.SLOPE, self.LOOKUP, samples * self.SLOPE)
            kernel_before = costs.ids * (cols + count * costs.lookup_columns)
            price = ExchangePrice(rng.uniform(1e-11, 1e-9), 3e-5, 1e-10)
            options = row_options(
                before, count, ids, samples, costs, w, local, ROW_TYPES, holders, price
            )
            # TorchRec's row layouts on the hosts holding none of it first
            held = set(holders)
            hosts = sorted(
                (list(range(h, h + local)) for h in range(0, w, local)),
                key=lambda ranks: (not held.isdisjoint(ranks), ranks[0]),
            )
            layouts = [row_wise_layout(rows, cols, hosts[0])]
            layouts.append(row_wise_layout(rows, cols, list(range(w))))
            for k in grid_blocks(cols, len(hosts)):
                layouts.append(grid_layout(rows, cols, hosts[:k]))
            self.assertEqual(len(options), len(layouts), case)
            for option, after in zip(options, layouts):
                busiest, added = _reference_option(
                    before, after, w, (ids, samples), costs, kernel_before, price
                )
                self.assertTrue(option.by_rows)
                self.assertAlmostEqual(
                    option.peak, busiest, delta=1e-9 * abs(busiest), msg=case
                )
                self.assertAlmostEqual(
                    option.added, added, delta=1e-9 * max(abs(added), busiest), msg=case
                )
            unpriced = row_options(
                before, count, ids, samples, costs, w, local, ROW_TYPES, holders, None
            )
            for option, after in zip(unpriced, layouts):
                kernels = [
                    costs.block(s.rect.rows / rows, s.rect.cols) for s in after.shards
                ]
                self.assertAlmostEqual(
                    option.peak, max(kernels), delta=1e-12 * max(kernels)
                )
                self.assertAlmostEqual(
                    option.added,
                    sum(kernels) - kernel_before,
                    delta=1e-9 * sum(kernels),
                )


if __name__ == "__main__":
    unittest.main()

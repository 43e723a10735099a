#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Column splits priced by their exchange (pure): a piece of a hot table whose
holder would receive more ids than its kernel saves is not cut, a cheaper
one is; and on random placements each rank's exchange of its shards by the per shard and per
column figures is what ``table_exchange`` counts, and the loads and
exchange seconds the search reports equal the kernels moved plus each rank's exchange before
and after, read off the layouts by ``table_exchange`` (not by the
search's own sums); ranks tied at the top do not stall priced splits;
priced, a window makes at most half the group's ranks' worth of column
splits (at least ``PRICED_SPLITS_LEAST``); a split that makes its module's
first column-wise table lifts every rank by that sharding's collectives,
once per module. The random placements make
merges and hand shards on whole to make room, so that every step's
bookkeeping is checked.
"""

import random
import unittest
from typing import Dict, List, Sequence, Tuple

from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.rebalance.costs import (
    _holder_exchange,
    _layout_exchange,
    PRICED_SPLITS_LEAST,
    PRICED_SPLITS_PER_RANKS,
    propose,
)
from torchrec.distributed.resharding.rebalance.exchange_price import (
    column_shard_seconds,
    COLUMN_SHARDING_COLLECTIVES,
    ColumnShardSeconds,
    ExchangePrice,
    median_price,
    row_blocks_spread,
    ROW_COLLECTIVES,
    table_exchange,
)
from torchrec.distributed.resharding.rebalance.placement import (
    Placement,
    placement_from_tables,
    TableInfo,
)
from torchrec.distributed.resharding.rebalance.row_splits import row_blocks
from torchrec.distributed.resharding.rebalance.splits import search_splits, SplitResult
from torchrec.distributed.test_utils.rebalance_utils import window_statistics

ROWS, DIM = 64, 16
BYTES = 8
IDS, SAMPLES = 1000.0, 32.0


def _table(
    name: str, kind: str, shards: Sequence[Tuple[int, int, int]], path: str = "m"
) -> TableInfo:
    """A table of ROWS x DIM whose shards are (rank, col, cols)."""
    layout = TableLayout(
        ROWS, DIM, tuple(PlacedShard(r, Rect(0, c, ROWS, w)) for r, c, w in shards)
    )
    return TableInfo(path, name, kind, layout, BYTES)


def _bytes_seconds(
    placement: Placement,
    layouts: Dict[str, TableLayout],
    ids: Sequence[float],
    per_byte: float,
) -> List[float]:
    """Per rank, the seconds of the bytes the new layouts change (``table_exchange``)."""
    world = placement.world_size
    out = [0.0] * world
    for t, table in enumerate(placement.tables):
        after = layouts.get(table.key)
        if after is None:
            continue
        old = table_exchange(table.layout, world, ids[t], SAMPLES)
        new = table_exchange(after, world, ids[t], SAMPLES)
        for rank in range(world):
            out[rank] += (new.of(rank) - old.of(rank)) * per_byte
    return out


def _exchange(
    placement: Placement, ids: Sequence[float], price: ExchangePrice
) -> Dict[int, ColumnShardSeconds]:
    return {
        t: column_shard_seconds(placement.world_size, ids[t], SAMPLES, price)
        for t in range(len(placement.tables))
    }


def _handed_on_whole(placement: Placement, layouts: Dict[str, TableLayout]) -> int:
    """Shards found on another rank with the same columns after the search."""
    count = 0
    for table in placement.tables:
        after = layouts.get(table.key)
        if after is None:
            continue
        before = {(s.rect.col, s.rect.cols): s.rank for s in table.layout.shards}
        for shard in after.shards:
            rank = before.get((shard.rect.col, shard.rect.cols))
            count += rank is not None and rank != shard.rank
    return count


def _random_layout(rng: random.Random, world: int) -> Tuple[str, TableLayout]:
    """
    A sharding type and a layout of ROWS x DIM over distinct ranks: column
    shards, row-wise blocks, or a grid (column blocks, each row-wise).
    """
    kind = rng.choice(["column_wise", "row_wise", "grid_shard"])
    blocks = 1 if kind == "row_wise" else rng.choice([1, 2, 4])
    spread = 1 if kind == "column_wise" else rng.randint(2, world // blocks)
    ranks = iter(rng.sample(range(world), blocks * spread))
    width = DIM // blocks
    shards = []
    for b in range(blocks):
        for first, rows in row_blocks(ROWS, spread):
            shards.append(PlacedShard(next(ranks), Rect(first, b * width, rows, width)))
    return kind, TableLayout(ROWS, DIM, tuple(shards))


class PricedSplitTest(unittest.TestCase):
    def _search(self, per_byte: float):  # pyre-ignore
        # four ranks: "hot" (16 columns, 1 s per column) alone on rank 0
        tables = [_table("hot", "table_wise", [(0, 0, DIM)])] + [
            _table(f"t{r}", "table_wise", [(r, 0, DIM)]) for r in (1, 2, 3)
        ]
        placement = placement_from_tables(tables, 4)
        costs = [16.0 if u.rank == 0 else 2.0 for u in placement.units]
        price = ExchangePrice(per_byte)
        return search_splits(
            placement,
            [16.0, 2.0, 2.0, 2.0],
            costs,
            [1e12] * 4,
            {t.key for t in tables},
            exchange=_exchange(placement, [IDS] * 4, price),
        )

    def test_a_piece_whose_ids_cost_more_than_it_saves_is_not_cut(self) -> None:
        # its holder would receive 500 ids x 8 bytes at 1e-2 s per byte:
        # 40 s, more than the 16 s the hot rank has
        self.assertEqual(self._search(1e-2).layouts, {})
        self.assertEqual(self._search(0.0).splits > 0, True)

    def test_a_cheap_piece_is_cut_and_its_exchange_reported(self) -> None:
        result = self._search(1e-4)
        self.assertIn("m:hot", result.layouts)
        self.assertEqual(len(result.exchange_seconds), 4)
        self.assertLess(max(result.loads), 16.0)

    def test_ranks_tied_at_the_top_are_cut_in_turn(self) -> None:
        # eight ranks: hot tables whole on ranks 0-3 (16 s each), cold ones
        # on ranks 4-7 (2 s each); every split lifts every rank a little
        # (its ids sent to one shard more), and the hot ranks tied with the
        # one cut are cut in turn, as without a price
        tables = [_table(f"h{r}", "table_wise", [(r, 0, DIM)]) for r in range(4)]
        tables += [_table(f"c{r}", "table_wise", [(r, 0, DIM)]) for r in range(4, 8)]
        placement = placement_from_tables(tables, 8)
        costs = [16.0 if u.rank < 4 else 2.0 for u in placement.units]

        def search(per_byte: float) -> Dict[str, TableLayout]:
            return search_splits(
                placement,
                [16.0] * 4 + [2.0] * 4,
                costs,
                [1e12] * 8,
                {t.key for t in tables},
                exchange=_exchange(placement, [IDS] * 8, ExchangePrice(per_byte)),
            ).layouts

        free = search(0.0)
        self.assertEqual(len(free), 8)  # each hot table halved, and more
        self.assertEqual(search(1e-9), free)


class ExchangeBookkeepingTest(unittest.TestCase):
    def test_loads_and_exchange_match_the_layouts(self) -> None:
        rng = random.Random(7)
        merges = handed = 0
        for case in range(40):
            with self.subTest(case=case):
                result, placement = self._check(rng)
                merges += result.merges
                handed += _handed_on_whole(placement, result.layouts)
        # the bookkeeping of every step is exercised: merges, and shards a
        # receiver hands on whole to make room (27 and 10 when written)
        self.assertGreater(merges, 0)
        self.assertGreater(handed, 0)

    def _check(self, rng: random.Random) -> Tuple[SplitResult, Placement]:
        world = rng.choice([4, 8])
        tables: List[TableInfo] = []
        per_col: List[float] = []
        for i in range(rng.randint(3, 7)):
            rank = rng.randrange(world)
            if rng.random() < 0.5:
                tables.append(_table(f"t{i}", "table_wise", [(rank, 0, DIM)]))
            else:
                other = (rank + 1) % world
                tables.append(
                    _table(f"t{i}", "column_wise", [(rank, 0, 8), (other, 8, 8)])
                )
            per_col.append(rng.choice([0.05, 0.2, 1.0, 3.0]))
        placement = placement_from_tables(tables, world)
        by_name = dict(zip([t.name for t in tables], per_col))
        cols = [by_name[t.name] for t in placement.tables]
        ids = [rng.choice([100.0, IDS, 5000.0]) for _ in placement.tables]
        costs = [cols[u.table] * u.work for u in placement.units]
        loads = [0.0] * world
        for unit, cost in zip(placement.units, costs):
            loads[unit.rank] += cost
        price = ExchangePrice(rng.choice([1e-5, 1e-4, 1e-3]))
        # each rank's exchange of its shards: the per shard and per column
        # figures give what table_exchange counts
        where = [u.rank for u in placement.units]
        samples = [SAMPLES] * len(ids)
        by_figures = _holder_exchange(
            placement, where, ids, samples, price, _exchange(placement, ids, price)
        )
        by_layouts = _holder_exchange(placement, where, ids, samples, price, {})
        for got, expected in zip(by_figures, by_layouts):
            self.assertAlmostEqual(got, expected)
        result = search_splits(
            placement,
            loads,
            costs,
            [1e12] * world,
            {t.key for t in placement.tables},
            exchange=_exchange(placement, ids, price),
        )
        kernel = [0.0] * world
        for t, table in enumerate(placement.tables):
            after = result.layouts.get(table.key)
            if after is None:
                continue
            for shard in table.layout.shards:
                kernel[shard.rank] -= cols[t] * shard.rect.cols
            for shard in after.shards:
                kernel[shard.rank] += cols[t] * shard.rect.cols
        exchange = _bytes_seconds(
            placement, result.layouts, ids, price.seconds_per_byte
        )
        for rank in range(world):
            self.assertAlmostEqual(result.exchange_seconds[rank], exchange[rank])
            self.assertAlmostEqual(
                result.loads[rank], loads[rank] + kernel[rank] + exchange[rank]
            )
        return result, placement


class ColumnShardingCollectivesTest(unittest.TestCase):
    """
    A split that makes its module's first column-wise table lifts every
    rank by the column-wise sharding's collectives, once per module.
    """

    PER_BYTE = 1e-6

    def _search(
        self, tables: List[TableInfo], hot: Sequence[int], collective: float
    ) -> Tuple[SplitResult, Placement, List[float]]:
        # four ranks; the hot ranks hold a table of 16 s, the others 2 s
        placement = placement_from_tables(tables, 4)
        costs = [(1.0 if u.rank in hot else 0.125) * u.work for u in placement.units]
        loads = [0.0] * 4
        for unit, cost in zip(placement.units, costs):
            loads[unit.rank] += cost
        ids = [IDS] * len(placement.tables)
        price = ExchangePrice(self.PER_BYTE, collective)
        result = search_splits(
            placement,
            loads,
            costs,
            [1e12] * 4,
            {t.key for t in placement.tables if t.name.startswith("hot")},
            exchange=_exchange(placement, ids, price),
        )
        return (
            result,
            placement,
            _bytes_seconds(placement, result.layouts, ids, self.PER_BYTE),
        )

    def _whole(self, path: str = "m") -> List[TableInfo]:
        tables = [_table("hot", "table_wise", [(0, 0, DIM)])]
        tables += [
            _table(f"c{r}", "table_wise", [(r, 0, DIM)], path) for r in (1, 2, 3)
        ]
        return tables

    def _assert_lift(
        self, result: SplitResult, bytes_seconds: List[float], lift: float
    ) -> None:
        for rank, seconds in enumerate(bytes_seconds):
            self.assertAlmostEqual(result.exchange_seconds[rank], seconds + lift)

    def test_the_figure_is_the_collectives_at_the_measured_latency(self) -> None:
        figures = column_shard_seconds(4, IDS, SAMPLES, ExchangePrice(0.0, 0.25))
        self.assertEqual(figures.sharding, COLUMN_SHARDING_COLLECTIVES * 0.25)
        self.assertEqual(COLUMN_SHARDING_COLLECTIVES, 5)

    def test_the_first_column_wise_table_pays_them(self) -> None:
        result, _, bytes_seconds = self._search(self._whole(), [0], 0.1)
        self.assertIn("m:hot", result.layouts)
        self._assert_lift(result, bytes_seconds, 5 * 0.1)

    def test_collectives_worth_more_than_the_cut_keep_the_table_whole(self) -> None:
        # the hot rank's 16 s would fall to about 9 s; 5 x 2 s on every
        # rank leaves it higher than before
        result, _, _ = self._search(self._whole(), [0], 2.0)
        self.assertEqual(result.layouts, {})
        self.assertEqual(self._search(self._whole(), [0], 0.0)[0].splits > 0, True)

    def test_only_a_module_already_column_wise_pays_them_no_more(self) -> None:
        for path, lift in (("m", 0.0), ("n", 5 * 0.1)):
            with self.subTest(column_wise_module=path):
                tables = self._whole()
                tables[1] = _table("c1", "column_wise", [(1, 0, 8), (2, 8, 8)], path)
                result, _, bytes_seconds = self._search(tables, [0], 0.1)
                self.assertIn("m:hot", result.layouts)
                self._assert_lift(result, bytes_seconds, lift)

    def test_two_tables_of_one_module_split_pay_them_once(self) -> None:
        tables = [
            _table("hot0", "table_wise", [(0, 0, DIM)]),
            _table("hot1", "table_wise", [(1, 0, DIM)]),
            _table("c2", "table_wise", [(2, 0, DIM)]),
            _table("c3", "table_wise", [(3, 0, DIM)]),
        ]
        result, _, bytes_seconds = self._search(tables, [0, 1], 0.01)
        self.assertEqual(set(result.layouts), {"m:hot0", "m:hot1"})
        self._assert_lift(result, bytes_seconds, 5 * 0.01)


class PricedSplitsPerWindowTest(unittest.TestCase):
    def _propose(self, price: ExchangePrice) -> int:
        # 512 ranks: a hot table whole on each of ranks 0-255 (4 s), a cold
        # one on each of ranks 256-511 (0.4 s); moves cannot help, hot
        # tables cut onto cold ranks can
        world = 512
        tables = [_table(f"t{r:03}", "table_wise", [(r, 0, DIM)]) for r in range(world)]
        placement = placement_from_tables(tables, world)
        ids = [125.0 if r < world // 2 else 12.5 for r in range(world)]
        stats = window_statistics(
            {f"t{r:03}": ids[r] for r in range(world)},
            [n * DIM * 1e-3 for n in ids],
            4.5,
        )
        proposal = propose(
            stats,
            placement,
            1e-3,
            [1e12] * world,
            splittable={t.key for t in tables},
            exchange_price=price,
        )
        assert proposal.splits is not None
        return proposal.splits.splits

    def test_priced_splits_are_capped_per_window(self) -> None:
        cap = max(PRICED_SPLITS_LEAST, 512 // PRICED_SPLITS_PER_RANKS)
        self.assertEqual(cap, 256)
        self.assertGreater(self._propose(ExchangePrice()), cap)
        # a price too small to change any split: only the cap limits them
        self.assertEqual(self._propose(ExchangePrice(1e-15)), cap)


class LayoutExchangeTest(unittest.TestCase):
    def test_column_layouts_priced_in_closed_form_as_blocks_exchange(self) -> None:
        # the prediction prices a column layout without building its blocks:
        # per holder and for every rank, the same seconds as the bytes model
        rng = random.Random(6)
        for _ in range(200):
            world = rng.choice([4, 16, 64, 1024])
            cols = 4 * rng.randint(1, 32)
            cuts = sorted(rng.sample(range(4, cols, 4), rng.randint(0, cols // 4 - 1)))
            edges = [0] + cuts + [cols]
            ranks = rng.sample(range(world), min(len(edges) - 1, world))
            shards = tuple(
                PlacedShard(rank, Rect(0, first, ROWS, last - first))
                for rank, first, last in zip(ranks, edges, edges[1:])
            )
            layout = TableLayout(ROWS, sum(s.rect.cols for s in shards), shards)
            ids, samples = rng.uniform(1e2, 1e7), rng.uniform(1e2, 1e6)
            price = ExchangePrice(rng.uniform(1e-11, 1e-9), 3e-5, 1e-10)
            column = column_shard_seconds(world, ids, samples, price)
            holders, others = _layout_exchange(
                layout, world, ids, samples, price, column
            )
            want = table_exchange(layout, world, ids, samples)
            per_byte = price.seconds_per_byte
            self.assertAlmostEqual(others / (want.others * per_byte), 1.0, delta=1e-9)
            self.assertEqual(set(holders), set(want.holders))
            for rank, seconds in holders.items():
                expected = (want.of(rank) - want.others) * per_byte
                self.assertAlmostEqual(seconds / expected, 1.0, delta=1e-9)

    def test_every_shard_priced_as_the_bytes_model_in_any_layout(self) -> None:
        # one rule prices a shard's exchange for the search and the
        # prediction alike: per rank, over tables of column, row and grid
        # layouts, the sum is the bytes model's; a row layout's every-rank
        # part holds its bucketization and collectives
        rng = random.Random(8)
        for _ in range(60):
            world = rng.choice([8, 16])  # a grid of 4 blocks over 2 ranks each
            price = ExchangePrice(rng.uniform(1e-11, 1e-9), 3e-5, 1e-10)
            per_byte = price.seconds_per_byte
            tables = []
            for i in range(rng.randint(1, 5)):
                kind, layout = _random_layout(rng, world)
                tables.append(TableInfo("m", f"t{i}", kind, layout, BYTES))
            placement = placement_from_tables(tables, world)
            ids = [rng.uniform(1e2, 1e6) for _ in placement.tables]
            samples = [rng.uniform(1e2, 1e4) for _ in placement.tables]
            columns = {
                t: column_shard_seconds(world, ids[t], samples[t], price)
                for t in range(len(placement.tables))
            }
            where = [u.rank for u in placement.units]
            got = _holder_exchange(placement, where, ids, samples, price, columns)
            want = [0.0] * world
            for t, table in enumerate(placement.tables):
                model = table_exchange(table.layout, world, ids[t], samples[t])
                for rank in model.holders:
                    want[rank] += (model.of(rank) - model.others) * per_byte
                holders, others = _layout_exchange(
                    table.layout, world, ids[t], samples[t], price, columns[t]
                )
                every = model.others * per_byte
                spread = row_blocks_spread(table.layout)
                if spread:
                    every += price.seconds_per_id * ids[t] / world * spread
                    every += price.seconds_per_collective * ROW_COLLECTIVES
                self.assertAlmostEqual(others / every, 1.0, delta=1e-9)
                self.assertEqual(set(holders), set(model.holders))
                for rank, seconds in holders.items():
                    expected = (model.of(rank) - model.others) * per_byte
                    self.assertAlmostEqual(seconds / expected, 1.0, delta=1e-9)
            for value, expected in zip(got, want):
                self.assertAlmostEqual(value, expected, delta=1e-9 * max(want))


class MedianPriceTest(unittest.TestCase):
    def test_each_figure_is_the_median_of_the_calibrations(self) -> None:
        usual = ExchangePrice(5e-10, 3e-4, 2e-8)
        # a burst during one calibration: every figure of it far above
        burst = ExchangePrice(5e-8, 4e-3, 2e-6)
        low = ExchangePrice(4e-10, 2e-4, 3e-8)
        self.assertEqual(median_price([usual]), usual)
        self.assertEqual(
            median_price([usual, burst, low]), ExchangePrice(5e-10, 3e-4, 3e-8)
        )
        self.assertEqual(
            median_price([burst, low, usual]), median_price([usual, burst, low])
        )
        # figures taken apart: the median of each, not of one calibration
        mixed = [ExchangePrice(1.0, 6.0, 2.0), ExchangePrice(2.0, 4.0, 3.0)]
        mixed.append(ExchangePrice(3.0, 5.0, 1.0))
        self.assertEqual(median_price(mixed), ExchangePrice(2.0, 5.0, 2.0))
        with self.assertRaisesRegex(ValueError, "at least one calibration"):
            median_price([])


if __name__ == "__main__":
    unittest.main()

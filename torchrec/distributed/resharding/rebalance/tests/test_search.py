#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The incremental search and the placement it works on (pure, one process).

The search: its slowest rank never ends above where it started and, with
every rank a receiver, ends within the bound local search guarantees
(``2 - 2 / (W + 1)`` times the optimum, found by trying every assignment);
the loads it reports are the moves' (recounted independently); it is
deterministic; it keeps every rank within its memory and never puts two
shards of a table on one rank; among equal cuts it moves the fewer bytes, a
move that does not pay for its bytes is not made, and a budget bounds every
rank's bytes; a balanced load moves nothing.

The placement: shards of a real plan (table-wise, column-wise, row-wise,
data-parallel) become units with their work, bytes and movability; moves
become a plan whose delta is exactly the moved tables, whose shards are the
moved layout, on each rank's own device.
"""

import itertools
import random
import unittest
from typing import Dict, List, Sequence, Tuple

import torch
from hypothesis import given, settings, strategies as st
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.resharding.model import plan_delta
from torchrec.distributed.resharding.plan import layout_from_parameter_sharding
from torchrec.distributed.resharding.rebalance.placement import (
    device_for_rank,
    module_plan,
    moved_layouts,
    placement_of,
    plan_with_layouts,
    ShardUnit,
)
from torchrec.distributed.resharding.rebalance.search import search_moves
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    ParameterShardingGenerator,
    row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.reshard_utils import numbered_tables
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

BIG = 1 << 60
PATH = "ebc"
ROWS, DIM = 16, 8


def _units(
    ranks: Sequence[int], nbytes: int = 100, tables: Sequence[int] = ()
) -> List[ShardUnit]:
    return [
        ShardUnit(tables[i] if tables else i, 0, r, 1.0, nbytes, True)
        for i, r in enumerate(ranks)
    ]


def _loads(units: Sequence[ShardUnit], costs: Sequence[float], w: int) -> List[float]:
    loads = [0.0] * w
    for u, c in zip(units, costs):
        loads[u.rank] += c
    return loads


def _optimum(costs: Sequence[float], w: int) -> float:
    """The least slowest rank over every assignment of the units."""
    best = float("inf")
    for assignment in itertools.product(range(w), repeat=len(costs)):
        loads = [0.0] * w
        for rank, cost in zip(assignment, costs):
            loads[rank] += cost
        best = min(best, max(loads))
    return best


class SearchTest(unittest.TestCase):
    @settings(max_examples=80, deadline=None)
    @given(
        w=st.integers(2, 3),
        data=st.data(),
    )
    def test_cuts_the_slowest_rank_within_the_local_search_bound(
        self, w: int, data: st.DataObject
    ) -> None:
        n = data.draw(st.integers(1, 6))
        ranks = data.draw(st.lists(st.integers(0, w - 1), min_size=n, max_size=n))
        costs = data.draw(st.lists(st.floats(0.01, 10.0), min_size=n, max_size=n))
        units = _units(ranks)
        loads = _loads(units, costs, w)
        result = search_moves(loads, units, costs, [BIG] * w, min_cut=0.0)
        self.assertLessEqual(result.slowest_after, max(loads) + 1e-9)
        self.assertLessEqual(
            result.slowest_after, (2 - 2 / (w + 1)) * _optimum(costs, w) + 1e-9
        )
        self.assertGreaterEqual(result.slowest_after, result.lower_bound - 1e-9)
        # the reported loads are those of the moves
        final = list(ranks)
        for i, rank in result.moves:
            final[i] = rank
        moved = _loads(_units(final), costs, w)
        for a, b in zip(moved, result.loads):
            self.assertAlmostEqual(a, b, places=9)
        self.assertEqual(
            [i for i, _ in result.moves], sorted({i for i, _ in result.moves})
        )

    def test_deterministic(self) -> None:
        rng = random.Random(3)
        w = 64
        ranks = [rng.randrange(w // 4) for _ in range(500)]
        costs = [rng.paretovariate(1.5) for _ in ranks]
        units = _units(ranks)
        loads = _loads(units, costs, w)
        first = search_moves(loads, units, costs, [BIG] * w)
        again = search_moves(list(loads), list(units), list(costs), [BIG] * w)
        self.assertEqual(first, again)
        self.assertLess(first.slowest_after, 0.5 * first.slowest_before)

    def test_memory_and_one_shard_of_a_table_per_rank(self) -> None:
        # rank 0 carries three units of 10 s; rank 1 is empty but full of
        # bytes, rank 2 holds another shard of table 0, rank 3 takes one more.
        units = _units([0, 0, 0, 2], nbytes=100, tables=[0, 1, 2, 0])
        costs = [10.0, 10.0, 10.0, 0.001]
        capacity = [BIG, 50, BIG, 200]
        result = search_moves(_loads(units, costs, 4), units, costs, capacity)
        final = [u.rank for u in units]
        for i, rank in result.moves:
            final[i] = rank
        self.assertNotIn(1, final)  # no room on rank 1
        held = [sum(100 for r in final if r == rank) for rank in range(4)]
        for rank in (1, 3):
            self.assertLessEqual(held[rank], capacity[rank])
        by_table: Dict[int, List[int]] = {}
        for u, rank in zip(units, final):
            by_table.setdefault(u.table, []).append(rank)
        for ranks in by_table.values():
            self.assertEqual(len(ranks), len(set(ranks)), by_table)
        self.assertAlmostEqual(result.slowest_after, 10.001, places=6)

    def test_fewer_bytes_among_equal_cuts(self) -> None:
        # rank 0: two equal units, the second one smaller in bytes
        units = [
            ShardUnit(0, 0, 0, 1.0, 1000, True),
            ShardUnit(1, 0, 0, 1.0, 10, True),
        ]
        costs = [1.0, 1.0]
        result = search_moves([2.0, 0.0], units, costs, [BIG, BIG], byte_price=1e-6)
        self.assertEqual(result.moves, ((1, 1),))
        self.assertEqual(result.rank_bytes, (10, 10))

    def test_a_move_that_does_not_pay_is_not_made(self) -> None:
        units = [ShardUnit(0, 0, 0, 1.0, 1000, True)] * 2
        costs = [1.0, 1.0]
        # cutting 1 s costs 1000 B x 2e-3 s/B = 2 s: not worth it
        result = search_moves([2.0, 0.0], units, costs, [BIG, BIG], byte_price=2e-3)
        self.assertEqual(result.moves, ())
        result = search_moves([2.0, 0.0], units, costs, [BIG, BIG], byte_price=1e-4)
        self.assertEqual(len(result.moves), 1)

    def test_budget_bounds_every_ranks_bytes(self) -> None:
        units = _units([0] * 6, nbytes=100)
        costs = [1.0] * 6
        loads = _loads(units, costs, 4)
        free = search_moves(loads, units, costs, [BIG] * 4)
        self.assertGreater(free.max_rank_bytes, 250)
        bounded = search_moves(loads, units, costs, [BIG] * 4, move_budget=250)
        self.assertLessEqual(bounded.max_rank_bytes, 250)
        self.assertEqual(len(bounded.moves), 2)
        self.assertLess(bounded.slowest_after, bounded.slowest_before)

    def test_balanced_load_moves_nothing(self) -> None:
        units = _units([0, 1, 2, 3, 0, 1, 2, 3])
        costs = [1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]
        result = search_moves(_loads(units, costs, 4), units, costs, [BIG] * 4)
        self.assertEqual(result.moves, ())
        self.assertEqual(result.steps, 0)
        self.assertEqual(result.gain, 0.0)

    def test_immovable_units_stay(self) -> None:
        units = [ShardUnit(0, 0, 0, 1.0, 1, False), ShardUnit(1, 0, 0, 1.0, 1, True)]
        result = search_moves([3.0, 0.0], units, [2.0, 1.0], [BIG, BIG])
        self.assertEqual(result.moves, ((1, 1),))
        self.assertEqual(result.lower_bound, 2.0)


def _ebc(n: int) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=numbered_tables(EmbeddingBagConfig, n, [DIM] * n, [ROWS] * n),
        device=torch.device("meta"),
    )


def _plan(specs: List[ParameterShardingGenerator], world_size: int) -> ShardingPlan:
    return ShardingPlan(
        {
            PATH: construct_module_sharding_plan(
                _ebc(len(specs)),
                per_param_sharding={f"t{i}": s for i, s in enumerate(specs)},
                sharder=EmbeddingBagCollectionSharder(),
                local_size=world_size,
                world_size=world_size,
                device_type="cpu",
            )
        }
    )


class PlacementTest(unittest.TestCase):
    def setUp(self) -> None:
        self.plan: ShardingPlan = _plan(
            [table_wise(0), column_wise([1, 2]), row_wise(), data_parallel()], 4
        )
        self.tables: Dict[str, List[Tuple[str, int, int]]] = {
            PATH: [(f"t{i}", ROWS, DIM) for i in range(4)]
        }
        self.placement = placement_of(
            self.plan, self.tables, {f"{PATH}:t{i}": 8 for i in range(4)}, 4
        )

    def test_units_of_a_plan(self) -> None:
        p = self.placement
        self.assertEqual([t.name for t in p.tables], ["t0", "t1", "t2", "t3"])
        by_table: Dict[int, List[ShardUnit]] = {}
        for u in p.units:
            by_table.setdefault(u.table, []).append(u)
        (tw,) = by_table[0]
        self.assertEqual(
            (tw.rank, tw.work, tw.nbytes, tw.movable), (0, DIM, ROWS * DIM * 8, True)
        )
        self.assertEqual(
            [(u.rank, u.work, u.movable) for u in by_table[1]],
            [(1, 4.0, True), (2, 4.0, True)],
        )
        self.assertEqual(
            [u.work for u in by_table[2]], [DIM / 4] * 4
        )  # a row block each
        self.assertFalse(any(u.movable for u in by_table[2] + by_table[3]))
        self.assertEqual(
            [u.work for u in by_table[3]], [DIM / 4] * 4
        )  # a quarter of the ids
        whole, dp, rw = ROWS * DIM * 8, ROWS * DIM * 8, ROWS * DIM * 8 // 4
        self.assertEqual(
            p.rank_bytes(),
            [whole + rw + dp, whole // 2 + rw + dp, whole // 2 + rw + dp, rw + dp],
        )

    def test_moves_become_a_plan_of_exactly_the_moved_tables(self) -> None:
        p = self.placement
        t1_second = next(
            i for i, u in enumerate(p.units) if u.table == 1 and u.shard == 1
        )
        t0 = next(i for i, u in enumerate(p.units) if u.table == 0)
        layouts = moved_layouts(p, [(t0, 3), (t1_second, 0)])
        self.assertEqual(sorted(layouts), [f"{PATH}:t0", f"{PATH}:t1"])
        new = plan_with_layouts(
            self.plan, p, layouts, lambda r: device_for_rank("cpu", r, 4)
        )
        self.assertEqual(sorted(plan_delta(self.plan, new)[PATH]), ["t0", "t1"])
        shardings = module_plan(new, PATH)
        self.assertEqual(shardings["t0"].ranks, [3])
        self.assertEqual(shardings["t1"].ranks, [1, 0])
        for name in ("t0", "t1"):
            self.assertEqual(
                layout_from_parameter_sharding(shardings[name], ROWS, DIM, 4),
                layouts[f"{PATH}:{name}"],
            )
        self.assertIs(shardings["t2"], module_plan(self.plan, PATH)["t2"])
        self.assertEqual(device_for_rank("cuda", 5, 4), "cuda:1")


if __name__ == "__main__":
    unittest.main()

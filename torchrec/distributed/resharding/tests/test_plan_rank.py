#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of per-rank planning and of the dry run: every rank's part
(``plan_rank_transfers``) is exactly its part of the whole plan, order
included (senders and receivers derive their buffer order from it
independently), and the bytes per rank (``bytes_per_rank``) are exactly the
sums over the whole plan's remote transfers. The whole plan itself is checked
against the reference planner of ``test_utils.plan_layouts`` (every new shard
against every old rectangle), on layouts of every sharding type, irregular
tilings and replicas, with groups that grow, shrink or are renumbered into the
ranks of an elastic move.
"""

import itertools
import unittest
from typing import Dict, Mapping, Optional, Sequence

import hypothesis.strategies as st
from hypothesis import given, HealthCheck, settings
from torchrec.distributed.resharding.plan import (
    PlacedShard,
    Rect,
    replicated_layout,
    ReshardPlan,
    TableLayout,
    Transfer,
)
from torchrec.distributed.resharding.transfer_bytes import bytes_per_rank, PieceCost
from torchrec.distributed.resharding.transfer_plan import (
    plan_rank_transfers,
    plan_transfers,
    RankPlan,
)
from torchrec.distributed.test_utils.plan_layouts import (
    LAYOUT_KINDS,
    layout_of,
    layout_scenarios,
    LayoutScenario,
    reference_plan,
    table_layouts,
)

costs_strategy: st.SearchStrategy[PieceCost] = st.builds(
    PieceCost, st.integers(0, 8), st.integers(0, 8), st.integers(0, 64)
)


def _row_wise(rows: int, cols: int, ranks: Sequence[int]) -> TableLayout:
    block = -(-rows // len(ranks))
    return layout_of(
        rows,
        cols,
        [
            (min(i * block, rows), 0, max(0, min(block, rows - i * block)), cols, r)
            for i, r in enumerate(ranks)
        ],
    )


class RankPlanChecks(unittest.TestCase):
    def check_whole_plan(
        self,
        old: Mapping[str, TableLayout],
        new: Mapping[str, TableLayout],
        tables: Sequence[str],
    ) -> ReshardPlan:
        """The whole plan, checked against the reference planner."""
        plan = plan_transfers(old, new, tables)
        self.assertEqual(plan.transfers, reference_plan(old, new, tables).transfers)
        return plan

    def check_rank(
        self,
        plan: ReshardPlan,
        old: Mapping[str, TableLayout],
        new: Mapping[str, TableLayout],
        rank: int,
        tables: Optional[Sequence[str]],
    ) -> RankPlan:
        mine = plan_rank_transfers(old, new, rank, tables)
        self.assertEqual(mine.sends, tuple(plan.sends(rank)), rank)
        self.assertEqual(mine.receives, tuple(plan.receives(rank)), rank)
        self.assertEqual(mine.local_copies, tuple(plan.local_copies(rank)), rank)
        return mine

    def check_bytes(
        self,
        plan: ReshardPlan,
        old: Mapping[str, TableLayout],
        new: Mapping[str, TableLayout],
        costs: Mapping[str, PieceCost],
        tables: Optional[Sequence[str]],
    ) -> None:
        ranks = {
            s.rank
            for layouts in (plan.old_layouts, plan.new_layouts)
            for layout in layouts.values()
            for s in layout.shards
        }
        sent: Dict[int, int] = dict.fromkeys(ranks, 0)
        received: Dict[int, int] = dict.fromkeys(ranks, 0)
        for t in plan.transfers:
            if t.is_local:
                continue
            c = costs[t.table]
            nbytes = (
                t.rect.rows * t.rect.cols * c.per_element
                + t.rect.rows * c.per_row
                + c.per_piece
            )
            sent[t.src_rank] += nbytes
            received[t.dst_rank] += nbytes
        self.assertEqual(bytes_per_rank(old, new, costs, tables), (sent, received))

    def check_scenario(
        self, scenario: LayoutScenario, costs: Mapping[str, PieceCost]
    ) -> None:
        old, new, tables = scenario.old_layouts, scenario.new_layouts, scenario.tables
        plan = self.check_whole_plan(old, new, tables)
        # One rank past the numbering holds nothing and gets nothing.
        for rank in range(scenario.ranks + 1):
            self.check_rank(plan, old, new, rank, tables)
        self.check_bytes(plan, old, new, costs, tables)
        # Default table order: the new layouts' keys.
        default = plan_transfers(old, new)
        for rank in range(scenario.ranks):
            self.check_rank(default, old, new, rank, None)
        self.check_bytes(default, old, new, costs, None)


class PropertyTest(RankPlanChecks):
    # pyre-ignore[56]
    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenario=layout_scenarios(), data=st.data())
    def test_every_rank_and_bytes(
        self, scenario: LayoutScenario, data: st.DataObject
    ) -> None:
        costs = {
            name: data.draw(costs_strategy, label=f"{name} cost")
            for name in scenario.tables
        }
        self.check_scenario(scenario, costs)

    # pyre-ignore[56]
    @settings(
        max_examples=12,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.data())
    def test_every_pair_of_kinds(self, data: st.DataObject) -> None:
        # Every (old kind, new kind) pair in every example, growing or
        # shrinking between 1 and 16 ranks, as one table each.
        old_world = data.draw(st.integers(1, 16), label="old_world")
        new_world = data.draw(st.integers(1, 16), label="new_world")
        old: Dict[str, TableLayout] = {}
        new: Dict[str, TableLayout] = {}
        for a, b in itertools.product(LAYOUT_KINDS, LAYOUT_KINDS):
            rows = data.draw(st.integers(1, 40))
            cols = data.draw(st.integers(1, 24))
            name = f"{a}->{b}"
            old[name] = data.draw(table_layouts(rows, cols, old_world, a), label=a)
            new[name] = data.draw(table_layouts(rows, cols, new_world, b), label=b)
        tables = list(new)
        plan = self.check_whole_plan(old, new, tables)
        for rank in range(max(old_world, new_world)):
            self.check_rank(plan, old, new, rank, tables)
        costs = {name: PieceCost(4, 8, 16) for name in tables}
        self.check_bytes(plan, old, new, costs, tables)


class ExampleTest(RankPlanChecks):
    def test_row_wise_doubling_by_hand(self) -> None:
        # 8 rows on ranks 0, 1 (4 each) -> on ranks 0..3 (2 each).
        old = {"t": _row_wise(8, 2, [0, 1])}
        new = {"t": _row_wise(8, 2, [0, 1, 2, 3])}
        rect = Rect(0, 0, 4, 2), Rect(4, 0, 4, 2)
        dst = [Rect(2 * i, 0, 2, 2) for i in range(4)]
        rank1 = plan_rank_transfers(old, new, 1)
        self.assertEqual(
            rank1,
            RankPlan(
                sends=(
                    Transfer("t", 1, 2, dst[2], rect[1], dst[2]),
                    Transfer("t", 1, 3, dst[3], rect[1], dst[3]),
                ),
                receives=(Transfer("t", 0, 1, dst[1], rect[0], dst[1]),),
                local_copies=(),
            ),
        )
        rank0 = plan_rank_transfers(old, new, 0)
        self.assertEqual(
            rank0.local_copies, (Transfer("t", 0, 0, dst[0], rect[0], dst[0]),)
        )
        self.assertEqual([(t.dst_rank, t.rect) for t in rank0.sends], [(1, dst[1])])
        self.assertEqual(rank0.receives, ())
        self.assertEqual(plan_rank_transfers(old, new, 5), RankPlan((), (), ()))
        sent, received = bytes_per_rank(old, new, {"t": PieceCost(4, 1, 100)})
        piece = 2 * 2 * 4 + 2 + 100
        self.assertEqual(sent, {0: piece, 1: 2 * piece, 2: 0, 3: 0})
        self.assertEqual(received, {0: 0, 1: piece, 2: piece, 3: piece})

    def test_sends_ordered_by_destination_then_plan(self) -> None:
        # Rank 0 holds everything; two tables planned in the order b, a: its
        # sends go by destination rank, and for each destination by table
        # (request order), then destination shard, then source rectangle.
        whole = {n: layout_of(6, 4, [(0, 0, 3, 4, 0), (3, 0, 3, 4, 0)]) for n in "ab"}
        new = {
            "a": layout_of(6, 4, [(0, 0, 6, 2, 2), (0, 2, 6, 2, 1)]),
            "b": layout_of(6, 4, [(2, 0, 4, 4, 1), (0, 0, 2, 4, 2)]),
        }
        plan = self.check_whole_plan(whole, new, ["b", "a"])
        mine = self.check_rank(plan, whole, new, 0, ["b", "a"])
        self.assertEqual(
            [(t.dst_rank, t.table, t.dst_rect.row, t.src_rect.row) for t in mine.sends],
            [
                (1, "b", 2, 0),
                (1, "b", 2, 3),
                (1, "a", 0, 0),
                (1, "a", 0, 3),
                (2, "b", 0, 0),
                (2, "a", 0, 0),
                (2, "a", 0, 3),
            ],
        )
        for rank in (1, 2):
            received = self.check_rank(plan, whole, new, rank, ["b", "a"]).receives
            self.assertEqual({t.src_rank for t in received}, {0})

    def test_table_planned_twice(self) -> None:
        old = {"a": _row_wise(8, 2, [0, 1]), "b": _row_wise(8, 2, [1, 0])}
        new = {"a": _row_wise(8, 2, [1, 0, 2]), "b": _row_wise(8, 2, [2, 1])}
        tables = ["a", "b", "a"]
        plan = self.check_whole_plan(old, new, tables)
        for rank in range(4):
            self.check_rank(plan, old, new, rank, tables)

    def test_replica_owners_and_repeated_owner(self) -> None:
        # Rows 0-3 held by ranks 2, 0 and 2 again (spec order), rows 4-7 by
        # rank 1: a destination outside the owners reads owners[rank % 3].
        old = {
            "t": layout_of(
                8,
                2,
                [(0, 0, 4, 2, 2), (4, 0, 4, 2, 1), (0, 0, 4, 2, 0), (0, 0, 4, 2, 2)],
            )
        }
        new = {"t": layout_of(8, 2, [(0, 0, 8, 2, r) for r in (3, 4, 5, 0)])}
        plan = self.check_whole_plan(old, new, ["t"])
        top = {t.dst_rank: t.src_rank for t in plan.transfers if t.rect.row == 0}
        self.assertEqual(top, {3: 2, 4: 0, 5: 2, 0: 0})
        for rank in range(7):
            self.check_rank(plan, old, new, rank, ["t"])
        self.check_bytes(plan, old, new, {"t": PieceCost(2, 3, 5)}, None)

    def test_replicated_layouts_at_scale(self) -> None:
        # Row-wise -> replicated, replicated -> row-wise and replicated ->
        # replicated, growing and shrinking: the dry run counts replicas in
        # closed form and must still equal the sum over every transfer.
        rows, cols = 1000, 3
        cases = {
            "rw_to_dp": (
                _row_wise(rows, cols, range(16)),
                replicated_layout(rows, cols, 96),
            ),
            "dp_to_rw": (
                replicated_layout(rows, cols, 24),
                _row_wise(rows, cols, range(96)),
            ),
            "dp_grow": (
                replicated_layout(rows, cols, 24),
                replicated_layout(rows, cols, 96),
            ),
            "dp_shrink": (
                replicated_layout(rows, cols, 96),
                replicated_layout(rows, cols, 7),
            ),
            "rw_to_partial": (
                _row_wise(rows, cols, range(0, 64, 3)),
                TableLayout(
                    rows,
                    cols,
                    tuple(
                        PlacedShard(r, Rect(0, 0, rows, cols)) for r in range(90, 5, -4)
                    ),
                    replicated=True,
                ),
            ),
        }
        old = {k: v[0] for k, v in cases.items()}
        new = {k: v[1] for k, v in cases.items()}
        costs = {k: PieceCost(4, 4, 32) for k in cases}
        plan = self.check_whole_plan(old, new, list(cases))
        self.check_bytes(plan, old, new, costs, None)
        for rank in (0, 1, 5, 7, 15, 16, 23, 24, 50, 90, 95, 96):
            self.check_rank(plan, old, new, rank, None)


if __name__ == "__main__":
    unittest.main()

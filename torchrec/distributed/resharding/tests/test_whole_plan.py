#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of the whole-plan operations, each against a reference
written here on a flat view of a plan (table key -> sharding): the delta of
two plans, a plan rebuilt from shardings, chosen anew or with a delta, every
table's layout read from the shards' metadata, and the predicates of an
unchanged table, decided by counting shards.
"""

import unittest
from collections import Counter
from typing import Dict, List, Tuple

from hypothesis import given, settings, strategies as st
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.plan import (
    PlacedShard,
    Rect,
    ReshardError,
    TableLayout,
)
from torchrec.distributed.resharding.whole_plan import (
    module_plan,
    placement_unchanged,
    plan_delta,
    plan_digest,
    plan_layouts,
    plan_of,
    plan_with_delta,
    replace_shardings,
    same_kind,
    sharding_unchanged,
)
from torchrec.distributed.test_utils.plan_layouts import DENSE, FUSED, sharding_by_hand
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)

TW, RW, CW = "table_wise", "row_wise", "column_wise"
ROWS, COLS = 8, 4

# every way a test table may be sharded: (type, kernel, shards)
Shards = Tuple[Tuple[int, int, int, int, int], ...]
CHOICES: List[Tuple[str, str, Shards]] = [
    (TW, DENSE, ((0, 0, ROWS, COLS, 0),)),
    (TW, DENSE, ((0, 0, ROWS, COLS, 1),)),
    (TW, FUSED, ((0, 0, ROWS, COLS, 0),)),
    (RW, DENSE, ((0, 0, 4, COLS, 0), (4, 0, 4, COLS, 1))),
    (RW, DENSE, ((0, 0, 4, COLS, 1), (4, 0, 4, COLS, 0))),
    (CW, DENSE, ((0, 0, ROWS, 2, 0), (0, 2, ROWS, 2, 1))),
]


def _sharding(choice: int) -> ParameterSharding:
    kind, kernel, shards = CHOICES[choice]
    return sharding_by_hand(kind, shards, kernel)


def _flat(plan: ShardingPlan) -> Dict[Tuple[str, str], ParameterSharding]:
    """The reference's view of a plan: (path, table) -> sharding, in order."""
    return {(p, t): ps for p, module in plan.plan.items() for t, ps in module.items()}


def _plan(choices: Dict[str, Dict[str, int]]) -> ShardingPlan:
    return ShardingPlan(
        {
            path: EmbeddingModuleShardingPlan(
                {t: _sharding(c) for t, c in tables.items()}
            )
            for path, tables in choices.items()
        }
    )


# module path -> {table: choice}: two modules of up to three tables
plans_of_choices: st.SearchStrategy[Dict[str, Dict[str, int]]] = st.fixed_dictionaries(
    {
        path: st.dictionaries(
            st.sampled_from(["t0", "t1", "t2"]),
            st.integers(0, len(CHOICES) - 1),
            min_size=1,
        )
        for path in ("sparse.ebc", "ec")
    }
)


def _reference_layout(
    ps: ParameterSharding, rows: int, cols: int, ranks: List[int]
) -> TableLayout:
    """A layout read straight from the shards' metadata, ranks renumbered."""
    spec = ps.sharding_spec
    assert spec is not None
    shards = []
    for shard in spec.shards:  # pyre-ignore[16]
        row, col = shard.shard_offsets
        nrows, ncols = shard.shard_sizes
        rank = shard.placement.rank()
        shards.append(PlacedShard(ranks[rank], Rect(row, col, nrows, ncols)))
    return TableLayout(rows, cols, tuple(shards))


class WholePlanTest(unittest.TestCase):
    @settings(max_examples=40, deadline=None)
    # pyre-ignore[56]
    @given(plans_of_choices, plans_of_choices)
    def test_delta_is_the_tables_whose_sharding_differs(
        self,
        old_choices: Dict[str, Dict[str, int]],
        new_choices: Dict[str, Dict[str, int]],
    ) -> None:
        for path in new_choices:  # the same tables, other shardings
            new_choices[path] = {
                t: new_choices[path].get(t, c) for t, c in old_choices[path].items()
            }
        old, new = _plan(old_choices), _plan(new_choices)
        expected: Dict[str, Dict[str, ParameterSharding]] = {}
        for (path, table), ps in sorted(_flat(new).items()):
            if old_choices[path][table] != new_choices[path][table]:
                expected.setdefault(path, {})[table] = ps
        delta = plan_delta(old, new)
        self.assertEqual(delta, expected)
        self.assertEqual(list(delta), sorted(delta))
        # the delta applied to the old plan gives the new one
        self.assertEqual(_flat(plan_with_delta(old, delta)), _flat(new))
        self.assertEqual(plan_digest(plan_with_delta(old, delta)), plan_digest(new))

    def test_delta_needs_the_same_modules_and_tables(self) -> None:
        old = _plan({"a": {"t0": 0}, "b": {"t0": 0}})
        with self.assertRaisesRegex(ReshardError, "same sharded modules"):
            plan_delta(old, _plan({"a": {"t0": 0}}))
        with self.assertRaisesRegex(ReshardError, "module 'b'.*same tables"):
            plan_delta(old, _plan({"a": {"t0": 0}, "b": {"t1": 0}}))

    @settings(max_examples=30, deadline=None)
    # pyre-ignore[56]
    @given(plans_of_choices, st.integers(0, len(CHOICES) - 1))
    def test_rebuilt_plans_keep_every_other_table_and_the_order(
        self, choices: Dict[str, Dict[str, int]], choice: int
    ) -> None:
        plan = _plan(choices)
        before = _flat(plan)
        moved = TableKey("ec", sorted(choices["ec"])[0])
        new_ps = _sharding(choice)

        def choose(key: TableKey, ps: ParameterSharding) -> ParameterSharding:
            return new_ps if key == moved else ps

        expected = {
            k: new_ps if k == (moved.path, moved.table) else ps
            for k, ps in before.items()
        }
        for rebuilt in (
            replace_shardings(plan, choose),
            plan_with_delta(plan, {moved.path: {moved.table: new_ps}}),
            plan_of({p: dict(m) for p, m in _plan(choices).plan.items()}),
        ):
            for path in rebuilt.plan:
                self.assertIsInstance(
                    module_plan(rebuilt, path), EmbeddingModuleShardingPlan
                )
                self.assertIsNot(rebuilt.plan[path], plan.plan[path])
            self.assertEqual(list(_flat(rebuilt)), list(before))
        for rebuilt in (
            replace_shardings(plan, choose),
            plan_with_delta(plan, {moved.path: {moved.table: new_ps}}),
        ):
            got = _flat(rebuilt)
            self.assertEqual(got, expected)
            for k, ps in got.items():  # the kept tables keep their objects
                if k != (moved.path, moved.table):
                    self.assertIs(ps, before[k])
        self.assertEqual(_flat(plan), before)  # the plan itself is unchanged

    def test_choose_sees_typed_keys(self) -> None:
        plan = _plan({"sparse.ebc": {"t0": 0, "t1": 3}})
        seen: List[TableKey] = []

        def choose(key: TableKey, ps: ParameterSharding) -> ParameterSharding:
            seen.append(key)
            return ps

        replace_shardings(plan, choose)
        self.assertEqual(
            seen, [TableKey("sparse.ebc", "t0"), TableKey("sparse.ebc", "t1")]
        )
        self.assertTrue(all(isinstance(k, TableKey) for k in seen))

    @settings(max_examples=30, deadline=None)
    # pyre-ignore[56]
    @given(plans_of_choices, st.permutations([5, 3]))
    def test_layouts_are_the_shards_metadata_in_transaction_ranks(
        self, choices: Dict[str, Dict[str, int]], ranks: List[int]
    ) -> None:
        plan = _plan(choices)
        tables = {p: [(t, ROWS, COLS) for t in m] for p, m in choices.items()}
        layouts = plan_layouts(plan, tables, ranks)
        expected = {
            f"{path}:{table}": _reference_layout(ps, ROWS, COLS, ranks)
            for (path, table), ps in sorted(_flat(plan).items())
        }
        self.assertEqual(layouts, expected)
        self.assertTrue(all(isinstance(k, TableKey) for k in layouts))
        self.assertEqual(
            [(k.path, k.table) for k in layouts],  # pyre-ignore[16]
            [(p, t) for p in sorted(choices) for t in choices[p]],  # paths sorted
        )


def _layout(shards: Shards) -> TableLayout:
    return TableLayout(
        ROWS,
        COLS,
        tuple(PlacedShard(rank, Rect(r, c, nr, nc)) for r, c, nr, nc, rank in shards),
    )


class UnchangedTableTest(unittest.TestCase):
    def test_every_pair_of_shardings(self) -> None:
        for i, (kind_a, kernel_a, shards_a) in enumerate(CHOICES):
            for j, (kind_b, kernel_b, shards_b) in enumerate(CHOICES):
                a, b = _sharding(i), _sharding(j)
                la, lb = _layout(shards_a), _layout(shards_b)
                kind = (kind_a, kernel_a) == (kind_b, kernel_b)
                where = Counter(
                    (rank, r, c, nr, nc) for r, c, nr, nc, rank in shards_a
                ) == Counter((rank, r, c, nr, nc) for r, c, nr, nc, rank in shards_b)
                exact = kind and tuple(shards_a) == tuple(shards_b)
                with self.subTest(a=i, b=j):
                    self.assertEqual(same_kind(a, b), kind)
                    self.assertEqual(placement_unchanged(a, b, la, lb), kind and where)
                    self.assertEqual(sharding_unchanged(a, b, la, lb), exact)

    def test_the_same_shards_in_another_order(self) -> None:
        a = _sharding(3)
        forward = _layout(CHOICES[3][2])
        backward = _layout(tuple(reversed(CHOICES[3][2])))
        self.assertTrue(placement_unchanged(a, a, forward, backward))
        self.assertFalse(sharding_unchanged(a, a, forward, backward))
        self.assertTrue(sharding_unchanged(a, a, forward, forward))


if __name__ == "__main__":
    unittest.main()

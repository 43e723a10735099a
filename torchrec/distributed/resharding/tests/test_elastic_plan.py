#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of the pure half of a move between groups of ranks: layouts
of a group's plan in global ranks, transfers numbered in the participants'
ranks, and the checks every participant runs on the facts all of them shared.
Expectations are written out by hand from the plans, never computed by the
code under test.
"""

import unittest
from typing import Dict, List, Optional

from torchrec.distributed.resharding.elastic_plan import (
    AgreedMove,
    check_move_agreement,
    MoveFacts,
    plan_digest,
    plan_layouts,
    ranks_digest,
    request_digest,
    tables_digest,
    TableShape,
    validate_new_plan,
    whole_on,
)
from torchrec.distributed.resharding.fields import TableFacts
from torchrec.distributed.resharding.plan import PlacedShard, Rect, ReshardError
from torchrec.distributed.resharding.transfer_plan import plan_transfers
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.model_zoo import numbered_tables
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

TABLES: Dict[str, List[TableShape]] = {"ebc": [("t0", 8, 4), ("t1", 6, 4)]}


def _plan(world_size: int, t0_rank: int) -> ShardingPlan:
    shapes = TABLES["ebc"]  # t0, t1, ...: the zoo's numbered tables
    dims, rows = [cols for _, _, cols in shapes], [rows for _, rows, _ in shapes]
    ebc = EmbeddingBagCollection(
        tables=numbered_tables(EmbeddingBagConfig, len(shapes), dims, rows),
        device="meta",
    )
    module_plan = construct_module_sharding_plan(
        ebc,
        {"t0": table_wise(rank=t0_rank), "t1": row_wise()},
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    return ShardingPlan({"ebc": module_plan})


def _facts(
    rank: int,
    old_ranks: List[int],
    new_ranks: Optional[List[int]],
    model: bool = True,
) -> MoveFacts:
    """What global ``rank`` states: whole values only from a group's first rank."""
    facts = MoveFacts()
    if new_ranks is not None:
        facts.new_group = ranks_digest(new_ranks)
        if rank == new_ranks[0]:
            facts.new_ranks = new_ranks
    if model:
        plan = _plan(len(old_ranks), 1)
        facts.old_group = ranks_digest(old_ranks)
        facts.plan = plan_digest(plan)
        facts.model = tables_digest(TABLES)
        facts.table_facts = {"ebc": TableFacts()}
        if rank == old_ranks[0]:
            facts.old_ranks = old_ranks
            facts.old_plan = plan
            facts.tables = TABLES
            facts.dense = []
    elif new_ranks is not None:
        facts.defined = tables_digest(TABLES)
        facts.defined_text = repr(TABLES)
    return facts


class PlanLayoutsTest(unittest.TestCase):
    def test_group_local_placements_become_transaction_ranks(self) -> None:
        # a group numbered [2, 3] in the transaction: t0 on its rank 1 (3), t1
        # split in rows over both
        layouts = plan_layouts(_plan(2, 1), TABLES, [2, 3])
        self.assertEqual(layouts["ebc:t0"].shards, (PlacedShard(3, Rect(0, 0, 8, 4)),))
        self.assertEqual(
            layouts["ebc:t1"].shards,
            (PlacedShard(2, Rect(0, 0, 3, 4)), PlacedShard(3, Rect(3, 0, 3, 4))),
        )

    def test_whole_on_one_rank(self) -> None:
        layouts = whole_on(TABLES, 5)
        self.assertEqual(layouts["ebc:t1"].shards, (PlacedShard(5, Rect(0, 0, 6, 4)),))


class MoveTransfersTest(unittest.TestCase):
    def test_shrink_numbers_ranks_in_the_union(self) -> None:
        # [0, 1, 2, 3] -> [2, 3]: t0 from rank 1 to rank 3 (the new group's
        # rank 1); t1 rows 0-1 (rank 0), 2-3 (rank 1), 4-5 (rank 2)...
        old = plan_layouts(_plan(4, 1), TABLES, [0, 1, 2, 3])
        new = plan_layouts(_plan(2, 1), TABLES, [2, 3])
        plan = plan_transfers(old, new)
        t0 = [t for t in plan.transfers if t.table == "ebc:t0"]
        self.assertEqual([(t.src_rank, t.dst_rank) for t in t0], [(1, 3)])
        t1 = sorted(
            (t.src_rank, t.dst_rank, t.rect.row, t.rect.rows)
            for t in plan.transfers
            if t.table == "ebc:t1"
        )
        # old t1: 6 rows over 4 ranks in blocks of 2 (0-1, 2-3, 4-5, none);
        # new t1: rows 0-2 on rank 2, rows 3-5 on rank 3
        self.assertEqual(t1, [(0, 2, 0, 2), (1, 2, 2, 1), (1, 3, 3, 1), (2, 3, 4, 2)])

    def test_groups_are_numbered_in_the_union(self) -> None:
        # global [10, 11] -> [12, 13]: in the union [10, 11, 12, 13] they are
        # transaction ranks 0, 1 -> 2, 3: t0 goes 1 -> 3
        old = plan_layouts(_plan(2, 1), TABLES, [0, 1])
        new = plan_layouts(_plan(2, 1), TABLES, [2, 3])
        plan = plan_transfers(old, new)
        self.assertEqual(
            [(t.src_rank, t.dst_rank) for t in plan.transfers if t.table == "ebc:t0"],
            [(1, 3)],
        )
        self.assertEqual(plan.local_copies(1), [])


class CheckMoveAgreementTest(unittest.TestCase):
    def test_shrink_agrees(self) -> None:
        old, new = [0, 1, 2, 3], [0, 1]
        facts = [_facts(r, old, new if r in new else None) for r in old]
        agreed = check_move_agreement(old, facts)
        self.assertIsInstance(agreed, AgreedMove)
        self.assertEqual((agreed.old_ranks, agreed.new_ranks), (old, new))
        self.assertEqual(agreed.tables, TABLES)
        self.assertEqual(agreed.transaction_ranks([1, 3]), [1, 3])

    def test_the_exchange_runs_on_a_device_every_rank_has(self) -> None:
        old, new = [0, 1], [0, 1, 2]
        facts = [_facts(r, old, new, model=r in old) for r in new]
        for f in facts:
            f.device_type = "cuda"
        self.assertEqual(check_move_agreement(new, facts).exchange_device_type, "cuda")
        facts[2].device_type = "cpu"  # a joining rank without a GPU
        self.assertEqual(check_move_agreement(new, facts).exchange_device_type, "cpu")

    def test_grow_agrees_with_joining_ranks(self) -> None:
        old, new = [0, 1], [0, 1, 2, 3]
        facts = [_facts(r, old, new, model=r in old) for r in new]
        agreed = check_move_agreement(new, facts)
        self.assertEqual((agreed.old_ranks, agreed.new_ranks), (old, new))

    def test_only_the_first_ranks_send_whole_values(self) -> None:
        old = [0, 1, 2, 3]
        facts = [_facts(r, old, old) for r in old]
        self.assertIsNotNone(facts[0].old_plan)
        self.assertTrue(all(f.old_plan is None for f in facts[1:]))
        self.assertTrue(all(f.tables is None for f in facts[1:]))

    def test_disagreeing_new_groups_are_refused(self) -> None:
        facts = [_facts(0, [0, 1], [0, 1]), _facts(1, [0, 1], [0, 1, 2])]
        with self.assertRaisesRegex(ReshardError, "different new groups"):
            check_move_agreement([0, 1], facts)

    def test_disagreeing_plans_are_refused(self) -> None:
        facts = [_facts(0, [0, 1], [0, 1]), _facts(1, [0, 1], [0, 1])]
        facts[1].plan = plan_digest(_plan(2, 0))
        with self.assertRaisesRegex(ReshardError, "different model plans"):
            check_move_agreement([0, 1], facts)

    def test_participants_must_be_both_groups(self) -> None:
        facts = [_facts(r, [0, 1], [0, 1]) for r in range(3)]
        with self.assertRaisesRegex(ReshardError, "participants"):
            check_move_agreement([0, 1, 2], facts)

    def test_a_joining_rank_without_env_is_named(self) -> None:
        facts = [_facts(0, [0], [0, 1]), _facts(1, [0], None, model=False)]
        with self.assertRaisesRegex(ReshardError, "rank 1 is in the new group"):
            check_move_agreement([0, 1], facts)

    def test_a_differing_definition_is_named(self) -> None:
        joiner = _facts(1, [0], [0, 1], model=False)
        other = {"ebc": [("t0", 8, 4), ("t1", 7, 4)]}
        joiner.defined = tables_digest(other)
        joiner.defined_text = repr(other)
        with self.assertRaisesRegex(ReshardError, "definition of rank 1"):
            check_move_agreement([0, 1], [_facts(0, [0], [0, 1]), joiner])

    def test_a_model_attached_to_a_pipeline_is_refused(self) -> None:
        facts = [_facts(0, [0, 1], [0]), _facts(1, [0, 1], None)]
        facts[1].pipelined = ["ebc"]
        with self.assertRaisesRegex(ReshardError, "rank 1.*pipeline.detach"):
            check_move_agreement([0, 1], facts)


class ValidateNewPlanTest(unittest.TestCase):
    def test_a_plan_placing_shards_outside_the_group_is_refused(self) -> None:
        with self.assertRaisesRegex(ReshardError, "module 'ebc'"):
            validate_new_plan(_plan(4, 3), TABLES, 2, "cpu")

    def test_a_plan_missing_a_table_is_refused(self) -> None:
        plan = _plan(2, 0)
        del plan.plan["ebc"]["t1"]
        with self.assertRaisesRegex(ReshardError, "t1"):
            validate_new_plan(plan, TABLES, 2, "cpu")

    def test_digest_is_stable_and_distinguishes(self) -> None:
        self.assertEqual(request_digest("move", "a"), request_digest("move", "a"))
        self.assertNotEqual(request_digest("move", "a"), request_digest("move", "b"))
        self.assertGreaterEqual(request_digest("x"), 0)


if __name__ == "__main__":
    unittest.main()

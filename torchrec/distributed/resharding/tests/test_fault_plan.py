#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: the plan on the survivors and the sources of the lost shards, in one
process. The oracle is the old plan's layouts read independently: every
survivor's table-wise and column-wise shard stays on it (renumbered), the
lost ones go to the least loaded survivor, a row-wise table is split by
TorchRec's own helper over the survivors, a data-parallel one stays on
every survivor; a table-row-wise table, and a sharded table of a dense
kernel, are refused. A snapshot is preferred
to a checkpoint, a snapshot of another plan is ignored, checkpoint pieces
are cut by the new owners and the saved shards, a loss no source covers
names its tables, and the old layout with the sources tiles every table.
"""

import unittest
from typing import Dict, List, Tuple

import torch
from torchrec.distributed.resharding.elastic_plan import plan_layouts
from torchrec.distributed.resharding.fault.options import (
    CHECKPOINT,
    REPLICA,
    SNAPSHOT,
    UnrecoverableLossError,
)
from torchrec.distributed.resharding.fault.recovery_plan import (
    plan_for_survivors,
    RecoveryPlan,
)
from torchrec.distributed.resharding.fault.sources import (
    CheckpointRecord,
    choose_sources,
    recovery_old_layouts,
    SnapshotOffer,
    SourceFacts,
)
from torchrec.distributed.resharding.fields import Field, FieldKind, WEIGHT
from torchrec.distributed.resharding.plan import ReshardError
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.reshard_model_utils import (
    model_definition,
    model_plan,
)
from torchrec.distributed.test_utils.reshard_utils import make_plan
from torchrec.distributed.types import ShardingPlan

WORLD = [0, 1, 2, 3]
FIELDS: Tuple[Field, ...] = (
    Field(WEIGHT, FieldKind.RECT, torch.float32),
    Field("momentum1", FieldKind.ROWS, torch.float32),
)


def _tables() -> Dict[str, List[Tuple[str, int, int]]]:
    model = model_definition("cpu")
    return {
        "ebc": [
            (c.name, c.num_embeddings, c.embedding_dim)
            for c in model.ebc.embedding_bag_configs()
        ],
        "ec": [
            (c.name, c.num_embeddings, c.embedding_dim)
            for c in model.ec.embedding_configs()
        ],
    }


def _recover(plan: ShardingPlan, survivors: List[int]) -> RecoveryPlan:
    tables = _tables()
    element_bytes = {
        f"{p}:{n}": 4 for p, shapes in tables.items() for n, _, _ in shapes
    }
    return plan_for_survivors(
        plan, tables, WORLD, survivors, model_definition(), element_bytes
    )


class RecoveryPlanTest(unittest.TestCase):
    def test_survivors_shards_stay_and_lost_ones_are_placed(self) -> None:
        plan = model_plan(4, 0)
        old = plan_layouts(plan, _tables(), WORLD)  # global ranks
        for lost in WORLD:
            survivors = [r for r in WORLD if r != lost]
            recovery = _recover(plan, survivors)
            new = recovery.new_layouts
            self.assertEqual(
                {(s.key, s.rect, s.rank) for s in recovery.lost},
                {
                    (k, s.rect, s.rank)
                    for k, layout in old.items()
                    if not layout.replicated
                    for s in layout.shards
                    if s.rank == lost
                },
            )
            for key in ("ebc:t1", "ebc:t2", "ec:t0"):  # table- and column-wise
                for before in old[key].shards:
                    after = [s for s in new[key].shards if s.rect == before.rect]
                    self.assertEqual(len(after), 1, key)
                    if before.rank != lost:
                        self.assertEqual(after[0].rank, before.rank, key)
                    else:
                        self.assertIn(after[0].rank, survivors, key)
            # row-wise: TorchRec's split over the survivors
            expected = construct_module_sharding_plan(
                model_definition().ebc,
                {"t0": table_wise(0), "t1": table_wise(0), "t2": table_wise(0)}
                | {"t3": row_wise()},
                local_size=3,
                world_size=3,
                device_type="cpu",
            )["t3"]
            got = recovery.plan.plan["ebc"]["t3"]  # pyre-ignore[16]
            self.assertEqual(
                [s.shard_sizes for s in got.sharding_spec.shards],
                [s.shard_sizes for s in expected.sharding_spec.shards],
            )
            self.assertEqual(recovery.replicated, ("ebc:t0",))
            self.assertEqual(
                recovery.plan.plan["ebc"]["t0"].ranks, [0, 1, 2]
            )  # pyre-ignore

    def test_lost_shards_go_to_the_least_loaded_survivor(self) -> None:
        # rank 3 holds two table-wise tables: they go to different survivors
        specs = {
            "ebc": {
                "t0": ("table_wise", 0),
                "t1": ("table_wise", 3),
                "t2": ("table_wise", 3),
                "t3": ("table_wise", 1),
            },
            "ec": {"t0": ("table_wise", 2), "t1": ("table_wise", 0)},
        }
        model = model_definition("cpu")
        plan = ShardingPlan(
            {
                n: make_plan(getattr(model, n), s, 4, 4, "fused")
                for n, s in specs.items()
            }
        )
        recovery = _recover(plan, [0, 1, 2])
        ranks = {
            key: recovery.new_layouts[key].shards[0].rank
            for key in ("ebc:t1", "ebc:t2")
        }
        self.assertEqual(len(set(ranks.values())), 2, ranks)
        self.assertNotIn(0, ranks.values())  # rank 0 holds the most already

    def test_table_row_wise_is_refused(self) -> None:
        model = model_definition("cpu")
        plan = ShardingPlan(
            {
                "ebc": make_plan(
                    model.ebc, {"t1": ("table_row_wise", 0)}, 4, 2, "fused"
                ),
            }
        )
        with self.assertRaisesRegex(ReshardError, "table_row_wise"):
            _recover(plan, [0, 1, 2])

    def test_a_sharded_table_of_a_dense_kernel_is_refused(self) -> None:
        # its optimizer state lives in its rank's own dense optimizer
        plan = model_plan(4, 0, kernel="dense")
        with self.assertRaisesRegex(ReshardError, "'dense' kernel"):
            _recover(plan, [0, 1, 2])


def _facts(
    snapshots: Tuple[SnapshotOffer, ...] = (),
    checkpoint: CheckpointRecord = None,  # pyre-ignore[9]
    step: int = 10,
) -> SourceFacts:
    return SourceFacts(step, 7, snapshots, checkpoint)


class SourcesTest(unittest.TestCase):
    def setUp(self) -> None:
        self.plan = model_plan(4, 0)
        self.recovery = _recover(self.plan, [0, 1, 2])
        self.lost = [(s.key, s.rect) for s in self.recovery.lost]
        fields = tuple((k, FIELDS) for k in sorted({k for k, _ in self.lost}))
        self.snapshot = SnapshotOffer(3, 8, 7, tuple(self.lost), fields)
        # a checkpoint of another plan (rotated): its shards are others
        old = plan_layouts(model_plan(4, 1), _tables(), WORLD)
        saved = tuple(
            sorted({(k, s.rect) for k, layout in old.items() for s in layout.shards})
        )
        all_fields = tuple((k, FIELDS) for k in sorted(old))
        self.checkpoint = CheckpointRecord("ckpt", 6, saved, all_fields)

    def _old_layouts_tile(self, agreed: object) -> None:
        survivors = list(self.recovery.survivors)
        layouts = recovery_old_layouts(
            self.plan, _tables(), WORLD, survivors, agreed  # pyre-ignore[6]
        )
        for key, layout in layouts.items():
            if layout.replicated:
                self.assertEqual(len(layout.shards), 3, key)
                continue
            area = sum(s.rect.numel for s in layout.shards)
            self.assertEqual(area, layout.rows * layout.cols, key)
            for i, a in enumerate(layout.shards):
                for b in layout.shards[i + 1 :]:
                    self.assertIsNone(a.rect.intersect(b.rect), key)

    def test_a_snapshot_is_preferred_to_a_checkpoint(self) -> None:
        facts = [_facts(), _facts((self.snapshot,), self.checkpoint), _facts()]
        agreed = choose_sources(
            self.recovery, facts, (REPLICA, SNAPSHOT, CHECKPOINT), plan=7
        )
        self.assertEqual(agreed.uncovered, ())
        self.assertEqual({p.kind for p in agreed.pieces}, {SNAPSHOT})
        self.assertEqual({p.holder for p in agreed.pieces}, {1})
        self.assertEqual(agreed.steps_lost(), {REPLICA: 0, SNAPSHOT: 2})
        self._old_layouts_tile(agreed)

    def test_a_snapshot_of_another_plan_is_ignored(self) -> None:
        facts = [_facts(checkpoint=self.checkpoint), _facts((self.snapshot,)), _facts()]
        agreed = choose_sources(
            self.recovery, facts, (REPLICA, SNAPSHOT, CHECKPOINT), plan=8
        )
        self.assertEqual({p.kind for p in agreed.pieces}, {CHECKPOINT})
        self.assertEqual(agreed.steps_lost(), {REPLICA: 0, CHECKPOINT: 4})

    def test_checkpoint_pieces_are_cut_by_new_owners_and_saved_shards(self) -> None:
        # rank 1's row-wise block of 4 straddles two blocks of 3
        self.recovery = _recover(self.plan, [0, 2, 3])
        facts = [_facts(checkpoint=self.checkpoint)] * 3
        agreed = choose_sources(self.recovery, facts, (CHECKPOINT,), plan=7)
        by_shard: Dict[object, List[object]] = {}
        for piece in agreed.pieces:
            by_shard.setdefault((piece.key, piece.shard), []).append(piece)
            # each piece within its lost shard, its saved shard, and the
            # new shard of the survivor that reads it
            self.assertEqual(piece.rect.intersect(piece.shard), piece.rect)
            self.assertEqual(piece.rect.intersect(piece.origin), piece.rect)
            owners = [
                s
                for s in self.recovery.new_layouts[piece.key].shards
                if s.rank == piece.holder
            ]
            self.assertTrue(
                any(s.rect.intersect(piece.rect) == piece.rect for s in owners)
            )
        for (key, shard), pieces in by_shard.items():
            self.assertEqual(sum(p.rect.numel for p in pieces), shard.numel, key)
        # row-wise blocks of 4 and 3 ranks do not line up: some shard is cut
        self.assertTrue(any(len(p) > 1 for p in by_shard.values()))
        # a float32 weight per element and momentum per row
        self.assertEqual(
            agreed.bytes_by_source()[CHECKPOINT],
            sum(p.rect.numel * 4 + p.rect.rows * 4 for p in agreed.pieces),
        )
        self._old_layouts_tile(agreed)

    def test_a_loss_no_source_covers_names_its_tables(self) -> None:
        facts = [_facts()] * 3
        agreed = choose_sources(self.recovery, facts, (REPLICA, CHECKPOINT), plan=7)
        self.assertEqual(agreed.uncovered, ("ebc:t3", "ec:t0", "ec:t1"))
        with self.assertRaises(UnrecoverableLossError) as raised:
            agreed.check_covered()
        self.assertEqual(raised.exception.tables, ("ebc:t3", "ec:t0", "ec:t1"))
        self.assertIn("ec:t0", str(raised.exception))


if __name__ == "__main__":
    unittest.main()

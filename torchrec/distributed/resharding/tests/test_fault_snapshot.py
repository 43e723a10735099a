#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The buddy snapshot in one process (a one-rank gloo group, the rank its own
buddy's stand-in): the rows a step touches are exactly the ids of its batch
(the oracle: the batch itself); a full snapshot and then deltas of only the
touched rows, applied to a copy, equal the shards after every step, bit for
bit (weights and fused optimizer state), and a delta is smaller than a full
snapshot; a budget leaves out the shards beyond it. A buddy is always on
another host.
"""

import unittest
from datetime import timedelta
from typing import Dict, Set

import torch
from torchrec.distributed.resharding.fault.options import FaultOptions
from torchrec.distributed.resharding.fault.snapshot import buddy_of, BuddySnapshot
from torchrec.distributed.resharding.fault.sources import SourcePiece
from torchrec.distributed.resharding.model_view import sharded_slots
from torchrec.distributed.test_utils.multi_process_utils import (
    single_rank_process_group,
)
from torchrec.distributed.test_utils.reshard_model_utils import (
    make_dense_optimizer,
    model_batch,
    model_plan,
    sharded_model,
    train_model,
)
from torchrec.distributed.types import ShardingEnv

OPTIONS = FaultOptions(snapshot_every=1, heartbeat_interval=timedelta(seconds=1))
# feature -> (module path, table) of the scenario's model
FEATURES = {
    **{f"f{i}": ("ebc", f"t{i}") for i in range(4)},
}


def _ids(step: int) -> Dict[str, Set[int]]:
    """The ids each table of the pooled module reads at a step."""
    batch = model_batch(step, 0)[0]
    out: Dict[str, Set[int]] = {}
    for feature, values in batch.to_dict().items():
        _, table = FEATURES[feature]
        out.setdefault(f"ebc:{table}", set()).update(values.values().tolist())
    return out


def _copies_equal_slots(
    test: unittest.TestCase, snapshot: BuddySnapshot, model: torch.nn.Module
) -> None:
    slots = sharded_slots(model.module)
    (offer,) = snapshot.offers()
    pieces = [
        SourcePiece(key, rect, rect, "snapshot", 0, rect, offer.step)
        for key, rect in offer.shards
    ]
    copies = snapshot.slots_for(pieces)
    for (key, rect), copy in copies.items():
        for name, tensor in slots[(key, rect)].tensors.items():
            test.assertTrue(torch.equal(copy.tensors[name], tensor), (key, name))


class BuddySnapshotTest(unittest.TestCase):
    def test_touched_rows_travel_and_copies_follow_the_shards(self) -> None:
        with single_rank_process_group() as pg:
            model = sharded_model(ShardingEnv.from_process_group(pg), model_plan(1, 0))
            optimizer = make_dense_optimizer(model)
            snapshot = BuddySnapshot(model, OPTIONS)
            sizes = []
            for step in range(3):
                train_model(model, optimizer, step, 0)
                touched = {
                    key: set(mask.nonzero().flatten().tolist())
                    for (key, rect), mask in snapshot._touched.items()
                    if key.startswith("ebc:")
                }
                # the pooled module's tables are whole on this rank: a row is
                # an id (the data-parallel table is not snapshotted)
                expected = {k: v for k, v in _ids(step).items() if k != "ebc:t0" and v}
                self.assertEqual(
                    {k: v for k, v in touched.items() if v}, expected, step
                )
                payload = snapshot._pack(model, step + 1)
                sizes.append(payload.numel())
                snapshot._apply(payload)  # as the buddy applies it
                _copies_equal_slots(self, snapshot, model)
                for mask in snapshot._touched.values():
                    mask.zero_()
                snapshot._full = False
            self.assertLess(max(sizes[1:]), sizes[0])  # deltas after a full one

            budget = FaultOptions(snapshot_every=1, snapshot_budget_bytes=1 << 12)
            small = BuddySnapshot(model, budget)
            small._apply(small._pack(model, 3))
            (offer,) = small.offers()
            held = sum(
                sum(t.numel() * t.element_size() for t in slot.tensors.values())
                for slot in small.slots_for(
                    [SourcePiece(k, r, r, "snapshot", 0, r, 3) for k, r in offer.shards]
                ).values()
            )
            self.assertLessEqual(held, 1 << 12)
            self.assertLess(len(offer.shards), len(snapshot.offers()[0].shards))
            snapshot.close()
            small.close()


class BuddyTest(unittest.TestCase):
    def test_buddy_is_on_another_host(self) -> None:
        members = list(range(8))
        for rank in members:
            buddy = buddy_of(members, rank, 4)
            assert buddy is not None
            self.assertNotEqual(buddy // 4, rank // 4)
        # every rank is the buddy of exactly one
        self.assertEqual(sorted(buddy_of(members, r, 4) for r in members), members)
        self.assertEqual(buddy_of([0, 1, 2], 2, 4), 0)  # one host: the next
        self.assertIsNone(buddy_of([5], 5, 4))


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The recovery move on its own (3 gloo ranks, the store hosted by the test's
process; ``test_utils.fault_worker``): the ranks train, save a checkpoint,
train one more step, and rank 2 dies. The survivors, told who is left,
build a group of their own, plan the model on it (``recovery_plan``), take
rank 2's shards from the checkpoint (``sources``, ``checkpoint``) and move
(``recovery.recover_model``). A first attempt fails in its exchange (a fault
injected on rank 1): both survivors raise ``ReshardAbortedError`` and the
model is exactly as it was, its shards where they were. The second attempt
gives a model equal, bit for bit, to one built directly on the survivors from
their own state and rank 2's state at the checkpoint, no survivor's shard
changed a byte, tables that stay keep their storage, and both train on alike.
"""

import os
import unittest
from datetime import timedelta
from typing import Any, Dict
from unittest import mock

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.resharding import ReshardAbortedError, ReshardOptions, slots
from torchrec.distributed.resharding.elastic_plan import plan_digest
from torchrec.distributed.resharding.fault.checkpoint import (
    load_pieces,
    save_checkpoint,
)
from torchrec.distributed.resharding.fault.recovery import recover_model
from torchrec.distributed.resharding.fault.recovery_plan import plan_for_survivors
from torchrec.distributed.resharding.fault.sources import choose_sources, SourceFacts
from torchrec.distributed.resharding.model_build import unsharded_definition
from torchrec.distributed.resharding.model_view import sharded_modules, sharded_tables
from torchrec.distributed.test_utils.fault_worker import (
    assert_matches_direct,
    die,
    KILLED,
    load_record,
    local_state,
    LocalState,
    run_job,
    save_record,
    train_step,
)
from torchrec.distributed.test_utils.reshard_model_utils import (
    make_dense_optimizer,
    model_definition,
    model_plan,
    model_sharders,
)
from torchrec.distributed.types import ShardingEnv

WORLD = 3
SURVIVORS = [0, 1]
OPTIONS = ReshardOptions(exchange_timeout=timedelta(seconds=30))


def _same(a: LocalState, b: LocalState) -> bool:
    for key, shards in a.weights.items():
        for (_, x), (_, y) in zip(shards, b.weights[key]):
            if not torch.equal(x, y):
                return False
    return all(torch.equal(x[3], y[3]) for x, y in zip(a.fused, b.fused))


def _raise(*args: Any) -> torch.Tensor:
    raise RuntimeError("injected fault in the recovery's exchange")


def _rank(
    rank: int, world_size: int, store: dist.Store, out_dir: str, args: Any
) -> Dict[str, Any]:
    model = DistributedModelParallel(
        model_definition(),
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=model_plan(WORLD, 0),
        sharders=model_sharders(),
    )
    model.load_state_dict(model_definition("cpu").state_dict())
    optimizer = make_dense_optimizer(model)
    for step in range(2):
        train_step(model, optimizer, step, rank)
    checkpoint = os.path.join(out_dir, "checkpoint")
    record = save_checkpoint(model, checkpoint, 2, dist.group.WORLD)
    save_record(model, optimizer, out_dir, 2)
    train_step(model, optimizer, 2, rank)  # lost for rank 2's shards
    dist.barrier()
    if rank == 2:
        die(store, out_dir, {})
    own = local_state(model, optimizer)
    group = dist.new_group(SURVIVORS, timeout=timedelta(seconds=30))
    env = ShardingEnv.from_process_group(group)
    tables = {p: sharded_tables(m) for p, m in sharded_modules(model.module).items()}
    recovery = plan_for_survivors(
        model.plan,
        tables,
        list(range(WORLD)),
        SURVIVORS,
        unsharded_definition(model),
        {f"{p}:{n}": 4 for p, shapes in tables.items() for n, _, _ in shapes},
    )
    digest = plan_digest(model.plan)
    facts = [SourceFacts(3, digest, (), record)] * len(SURVIVORS)
    sources = choose_sources(recovery, facts, ("replica", "checkpoint"), digest)
    held = sources.held_by(rank)
    fields = {p.key: sources.fields_of(p.key) for p in held}
    source_slots, nbytes, _ = load_pieces(record, held, fields)

    result: Dict[str, Any] = {"checks": [], "read_bytes": nbytes}
    fault = _raise if rank == 1 else slots.read_piece
    try:
        with mock.patch.object(slots, "read_piece", fault):
            recover_model(
                model, recovery, sources, source_slots, env, optimizer,
                make_dense_optimizer, OPTIONS,
            )  # fmt: skip
    except ReshardAbortedError:
        assert _same(own, local_state(model, optimizer)), "a failed recovery changed"
        result["checks"].append("a failed recovery leaves the model as it was")

    new_model, new_optimizer, report = recover_model(
        model, recovery, sources, source_slots, env, optimizer,
        make_dense_optimizer, OPTIONS,
    )  # fmt: skip
    lost = [load_record(out_dir, 2, 2)]
    result["checks"] += assert_matches_direct(
        new_model, new_optimizer, recovery.plan, own, lost, 3
    )
    result["kept_in_place_bytes"] = report.bytes_kept_in_place
    result["steps_lost"] = sources.steps_lost()
    result["status"] = "ok"
    return result


class RecoveryMoveTest(unittest.TestCase):
    def test_survivors_take_a_lost_ranks_shards_from_the_checkpoint(self) -> None:
        job = run_job(_rank, WORLD)
        self.assertFalse(job.failures(), "\n".join(job.failures()))
        self.assertEqual(job.exit_codes[2], KILLED)
        for rank in SURVIVORS:
            result = job.results[rank]
            self.assertEqual(result["status"], "ok", result)
            self.assertEqual(
                result["checks"],
                [
                    "a failed recovery leaves the model as it was",
                    f"equals the model built directly on {SURVIVORS}",
                    "no survivor's own shard changed a byte",
                    "trains on like the model built directly",
                ],
            )
            self.assertEqual(result["steps_lost"], {"replica": 0, "checkpoint": 1})
            self.assertGreater(result["kept_in_place_bytes"], 0)


if __name__ == "__main__":
    unittest.main()

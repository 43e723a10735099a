#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A row split in a running job (2 gloo ranks, ``TrainPipelineSparseDist``):
one narrow table-wise table (16 columns) becomes far hotter than the rest.
On CPU every shard pays a fixed cost per id it reads (about 140 columns'
worth), so its narrowest column shard would cost nearly the whole table:
column splits cannot fix it. With ``split_shards`` the rebalancer makes it
row-wise over both ranks (TorchRec's row blocks: 32 rows each) in the
first window that sees the load, with the same decisions on every rank,
and the run equals, bit for bit (losses, weights, optimizer state), a run
that applies the same plan by hand at the same step.
"""

import unittest
from typing import Any, Iterator, List

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.resharding.model import plan_delta
from torchrec.distributed.resharding.rebalance.placement import module_plan
from torchrec.distributed.resharding.rebalance.policy import RebalancePolicy
from torchrec.distributed.resharding.rebalance.rebalancer import Rebalancer
from torchrec.distributed.test_utils.rebalance_utils import (
    cpu_topology,
    decision_summary,
    EBC_PATH,
    hand_plan,
    loaded_batches,
    rebalance_model,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    ReshardTestBase,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

NUM_TABLES, ROWS, DIM, BATCH = 4, 64, 16, 512
WINDOW, SHIFT_AT, STEPS = 3, 6, 12
UNIFORM, HOT, COLD = 2, 500, 1
START = {
    "t0": ("table_wise", 0),
    "t1": ("table_wise", 1),
    "t2": ("table_wise", 0),
    "t3": ("table_wise", 1),
}


def _same_everywhere(value: Any) -> None:
    values: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), values


def _run_row_split(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        env, device = context.env, context.device
        plan_a = hand_plan(START, NUM_TABLES, ROWS, DIM, world_size)
        shifted = [HOT] + [COLD] * (NUM_TABLES - 1)
        loads = [[UNIFORM] * NUM_TABLES] * SHIFT_AT + [shifted] * (STEPS - SHIFT_AT)
        batches = loaded_batches(loads, rank, ROWS, BATCH)
        policy = RebalancePolicy(
            window=WINDOW,
            min_gain=0.1,
            hysteresis=1,
            min_interval=WINDOW,
            horizon=10**6,
            full_replan=False,
            split_shards=True,
        )

        model, optimizer = rebalance_model(env, device, plan_a, NUM_TABLES, ROWS, DIM)
        pipeline = TrainPipelineSparseDist(model, optimizer, device)
        rebalancer = Rebalancer(model, cpu_topology(world_size), policy, BATCH)
        it: Iterator[Batch] = iter(batches)
        losses = []
        for _ in range(STEPS):
            losses.append(pipeline.progress(it)[0].detach())
            rebalancer.step()
        rebalancer.close()
        if rank == 0:
            print(rebalancer.history_table())
        _same_everywhere(decision_summary(rebalancer.history))

        reshards = [d for d in rebalancer.history if d.action == "reshard"]
        assert len(reshards) >= 1, rebalancer.history_table()
        first = reshards[0]
        assert first.step == SHIFT_AT + WINDOW, rebalancer.history_table()
        assert first.predicted_gain >= 0.1, first
        assert first.plan is not None
        t0 = module_plan(first.plan, EBC_PATH)["t0"]
        assert t0.sharding_type == "row_wise", t0
        assert t0.ranks == [0, 1], t0
        assert "t0" in plan_delta(plan_a, first.plan)[EBC_PATH]
        blocks = [
            (m.shard_offsets, m.shard_sizes)
            for m in t0.sharding_spec.shards  # pyre-ignore[16]
        ]
        assert blocks == [([0, 0], [32, DIM]), ([32, 0], [32, DIM])], blocks

        # The same plans by hand at the same steps: bit-equal.
        by_step = {d.step: d.plan for d in reshards}
        replay, replay_optimizer = rebalance_model(
            env, device, plan_a, NUM_TABLES, ROWS, DIM
        )
        replay_pipeline = TrainPipelineSparseDist(replay, replay_optimizer, device)
        it = iter(batches)
        for step in range(1, STEPS + 1):
            loss = replay_pipeline.progress(it)[0].detach()
            assert torch.equal(loss, losses[step - 1]), (step, loss, losses[step - 1])
            if step in by_step:
                replay.reshard(by_step[step])
        assert replay.plan.plan == model.plan.plan
        assert_state_dicts_equal(model.state_dict(), replay.state_dict())
        assert_optimizer_states_equal(model, replay)


class RebalanceRowSplitTest(ReshardTestBase):
    def test_a_hot_narrow_table_goes_row_wise_and_equals_the_plan_by_hand(
        self,
    ) -> None:
        self.run_ranks(_run_row_split)


if __name__ == "__main__":
    unittest.main()

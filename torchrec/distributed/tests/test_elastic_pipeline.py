#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A move between groups of ranks inside a pipelined training loop (4 gloo
ranks, 4 -> 2). A model still attached to a TrainPipelineSparseDist is refused
on every rank before anything moves (its batches in flight went through the
old group's input dist) and keeps every weight. Run dry and detached, the
model moves; a pipeline built on the moved model then trains exactly as a
model sharded directly on the new group from the state gathered before the
move, trained on the same batches with a plain loop.
"""

import unittest
from typing import Any, Iterator, List

import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.resharding import move_model, ReshardError
from torchrec.distributed.test_utils.reshard_pipeline_utils import (
    dense_optimizer,
    dlrm_batches,
    dlrm_model,
    dlrm_plan,
    DLRM_PLAN_A,
    global_weights_and_state,
    plain_steps,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    load_global_state,
    ReshardTestBase,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.keyed import CombinedOptimizer

WORLD = 4
NEW_RANKS: List[int] = [0, 1]
STEPS = 3


def _pipeline(model: DistributedModelParallel, dense: Any, device: Any) -> Any:
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    return TrainPipelineSparseDist(model, optimizer, device)


def _run_dry(pipeline: Any, it: Iterator[Batch]) -> None:
    """Trains the batches in flight; the data is exhausted."""
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            return


def _run_pipeline_across_move(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        world, device = context.pg, context.device
        new_group = dist.new_group(NEW_RANKS)  # every rank, in the same order
        new_env = (
            ShardingEnv.from_process_group(new_group) if rank in NEW_RANKS else None
        )
        new_plan = dlrm_plan(DLRM_PLAN_A, len(NEW_RANKS))
        model, _ = dlrm_model(
            ShardingEnv.from_process_group(world),
            device,
            dlrm_plan(DLRM_PLAN_A, world_size),
        )
        dense = dense_optimizer(model)
        pipeline = _pipeline(model, dense, device)
        batches = dlrm_batches(2 * STEPS, rank)
        it = iter(batches[:STEPS])
        for _ in range(STEPS - 1):
            pipeline.progress(it)  # one batch stays in flight

        def move() -> Any:
            return move_model(
                model,
                new_plan,
                new_env,
                participants=range(world_size),
                optimizer=dense,
                make_optimizer=dense_optimizer,
            )

        before, _ = global_weights_and_state(model, world)
        try:
            move()
        except ReshardError as e:
            assert "train pipeline" in str(e) and "detach" in str(e), e
        else:
            raise AssertionError("a model attached to a pipeline must be refused")
        after, _ = global_weights_and_state(model, world)
        for key in before:
            assert before[key].equal(after[key]), key

        _run_dry(pipeline, it)
        pipeline.detach()
        weights, opt_state = global_weights_and_state(model, world)
        moved = move()
        assert moved.left == (rank not in NEW_RANKS)
        if new_env is not None:
            reference, ref_optimizer = dlrm_model(new_env, device, new_plan)
            load_global_state(reference, weights, opt_state)
            segment = dlrm_batches(2 * STEPS, NEW_RANKS.index(rank))[STEPS:]
            pipeline = _pipeline(moved.model, moved.optimizer, device)
            it = iter(segment)
            losses = [pipeline.progress(it)[0] for _ in range(STEPS)]
            expected = plain_steps(reference, ref_optimizer, segment)
            for got, want in zip(losses, expected):
                assert got.equal(want), (losses, expected)
            assert_state_dicts_equal(reference.state_dict(), moved.model.state_dict())
            assert_optimizer_states_equal(reference, moved.model)
        dist.barrier()


class ElasticPipelineTest(ReshardTestBase):
    def test_train_pipeline_across_a_move(self) -> None:
        self.run_ranks(_run_pipeline_across_move, world_size=WORLD)


if __name__ == "__main__":
    unittest.main()

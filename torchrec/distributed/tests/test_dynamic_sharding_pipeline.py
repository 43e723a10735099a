#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Training with a pipeline across live reshards: a DLRMTrain model under
DistributedModelParallel (fused Adagrad for the tables, SGD for the dense
part) trains with TrainPipelineSparseDist, which has already run the input
dist of the next batch when ``model.reshard(plan)`` moves tables (one table
moving rank, a table-wise table becoming column-wise, two tables swapping
ranks). The same pipeline goes on, and every step after each reshard equals a
model sharded directly with the new plan from the state gathered right before
the reshard, trained on the same remaining batches with a plain loop: the same
loss, bit for bit, and the same weights and optimizer state. Also with
``detach()`` / ``attach()`` around the reshard, and with TrainPipelineBase.
"""

import unittest
from typing import Any, Iterator, List

import torch
from torchrec.datasets.utils import Batch
from torchrec.distributed.test_utils.reshard_pipeline_utils import (
    dlrm_batches,
    dlrm_model,
    DLRM_MOVES,
    dlrm_plan,
    DLRM_PLAN_A,
    global_weights_and_state,
    plain_steps,
    STEPS_PER_SEGMENT,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    load_global_state,
    ReshardTestBase,
)
from torchrec.distributed.train_pipeline import (
    TrainPipelineBase,
    TrainPipelineSparseDist,
)


def _run_pipeline(
    rank: int, world_size: int, port: str, pipeline_type: str, detach: bool
) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, env, device = context.pg, context.env, context.device
        plans = [dlrm_plan(DLRM_PLAN_A, world_size)] + [
            dlrm_plan(m, world_size) for m in DLRM_MOVES
        ]
        segments = len(plans)
        # TrainPipelineBase of some TorchRec releases (1.1.0) stops when it
        # cannot fetch the batch after the one it trains: give it one more,
        # which those never train and later ones (1.8.0) train last.
        extra = 1 if pipeline_type == "base" else 0
        batches = dlrm_batches(STEPS_PER_SEGMENT * segments + extra, rank)
        model, optimizer = dlrm_model(env, device, plans[0])
        if pipeline_type == "sparse_dist":
            pipeline: Any = TrainPipelineSparseDist(model, optimizer, device)
        else:
            pipeline = TrainPipelineBase(model, optimizer, device)
        it: Iterator[Batch] = iter(batches)

        step = 0
        for segment, plan in enumerate(plans):
            if segment > 0:
                weights, opt_state = global_weights_and_state(model, pg)
                if detach:
                    pipeline.detach()
                model.reshard(plan)
                if detach:
                    pipeline.attach(model)
                reference, ref_optimizer = dlrm_model(env, device, plan)
                load_global_state(reference, weights, opt_state)
            losses = [pipeline.progress(it)[0] for _ in range(STEPS_PER_SEGMENT)]
            if segment > 0:
                expected = plain_steps(
                    reference,
                    ref_optimizer,
                    batches[step : step + STEPS_PER_SEGMENT],
                )
                for got, want in zip(losses, expected):
                    assert torch.equal(got, want), (segment, losses, expected)
                assert_state_dicts_equal(reference.state_dict(), model.state_dict())
                assert_optimizer_states_equal(reference, model)
            step += STEPS_PER_SEGMENT
        tail: List[torch.Tensor] = []
        while True:
            try:
                tail.append(pipeline.progress(it)[0])
            except StopIteration:
                break
            if len(tail) > extra:
                raise AssertionError("a batch was left over or trained twice")
        if tail:
            # the extra batch, trained once, as a plain step trains it
            (want,) = plain_steps(reference, ref_optimizer, batches[step:])
            assert torch.equal(tail[0], want), (tail, want)
            assert_state_dicts_equal(reference.state_dict(), model.state_dict())
            assert_optimizer_states_equal(reference, model)


class ReshardPipelineTest(ReshardTestBase):
    def test_train_pipeline_sparse_dist_across_reshards(self) -> None:
        self.run_ranks(_run_pipeline, pipeline_type="sparse_dist", detach=False)

    def test_train_pipeline_sparse_dist_detach_attach(self) -> None:
        self.run_ranks(_run_pipeline, pipeline_type="sparse_dist", detach=True)

    def test_train_pipeline_base_across_reshards(self) -> None:
        self.run_ranks(_run_pipeline, pipeline_type="base", detach=False)


if __name__ == "__main__":
    unittest.main()

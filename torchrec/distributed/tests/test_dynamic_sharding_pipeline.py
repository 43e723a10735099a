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
from typing import Any, Dict, Iterator, List, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    global_optimizer_state,
    global_weights,
    load_global_state,
    make_plan,
    process_group,
    ReshardTestBase,
    TableSpec,
)
from torchrec.distributed.train_pipeline import (
    TrainPipelineBase,
    TrainPipelineSparseDist,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

EBC_PATH = "model.sparse_arch.embedding_bag_collection"
NUM_TABLES, ROWS, DIM, DENSE_IN, BATCH = 4, 40, 8, 4, 6
PLAN_A: Dict[str, TableSpec] = {
    "t0": ("table_wise", 0),
    "t1": ("table_wise", 1),
    "t2": ("column_wise", [0, 1]),
    "t3": ("row_wise", None),
}
# one table moving rank, a table-wise table becoming column-wise, a swap
MOVES: List[Dict[str, TableSpec]] = [
    {**PLAN_A, "t0": ("table_wise", 1)},
    {**PLAN_A, "t0": ("column_wise", [1, 0])},
    {**PLAN_A, "t0": ("table_wise", 1), "t1": ("table_wise", 0)},
]
STEPS_PER_SEGMENT = 3


def _dlrm(seed: int) -> DLRMTrain:
    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t{i}",
                embedding_dim=DIM,
                num_embeddings=ROWS,
                feature_names=[f"f{i}"],
            )
            for i in range(NUM_TABLES)
        ],
        device=torch.device("cpu"),
    )
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=DENSE_IN,
            dense_arch_layer_sizes=[DIM],
            over_arch_layer_sizes=[4, 1],
        )
    )


def _batches(count: int, rank: int) -> List[Batch]:
    """Different local batches per rank, as in data-parallel training."""
    generator = torch.Generator().manual_seed(100 + rank)
    batches = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (NUM_TABLES * BATCH,), generator=generator)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=generator)
        batches.append(
            Batch(
                dense_features=torch.rand(BATCH, DENSE_IN, generator=generator),
                sparse_features=KeyedJaggedTensor.from_lengths_sync(
                    keys=[f"f{i}" for i in range(NUM_TABLES)],
                    values=values,
                    lengths=lengths,
                ),
                labels=torch.randint(0, 2, (BATCH,), generator=generator),
            )
        )
    return batches


def _plan(specs: Dict[str, TableSpec], world_size: int) -> ShardingPlan:
    ebc = _dlrm(0).model.sparse_arch.embedding_bag_collection
    return ShardingPlan(
        {EBC_PATH: make_plan(ebc, specs, world_size, world_size, "fused")}
    )


def _model(
    env: ShardingEnv, device: torch.device, plan: ShardingPlan
) -> Tuple[DistributedModelParallel, CombinedOptimizer]:
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ADAGRAD,
            "learning_rate": 0.05,
            "eps": 0.01,
        }
    )
    model = DistributedModelParallel(
        _dlrm(0), env=env, device=device, plan=plan, sharders=[sharder]
    )
    model.load_state_dict(_dlrm(0).state_dict())
    dense = _dense_optimizer(model)
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def _dense_optimizer(model: torch.nn.Module) -> KeyedOptimizerWrapper:
    """SGD for the parameters the fused optimizer does not update."""
    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )


def _state(model: DistributedModelParallel, pg: Any) -> Tuple[Any, Any]:
    shapes = {
        f"{EBC_PATH}.embedding_bags.t{i}.weight": (ROWS, DIM) for i in range(NUM_TABLES)
    }
    return global_weights(model, pg), global_optimizer_state(model, pg, shapes)


def _plain_steps(
    model: DistributedModelParallel, optimizer: Any, batches: List[Batch]
) -> List[torch.Tensor]:
    """The reference: a plain loop, in the pipeline's order of operations."""
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _run_pipeline(
    rank: int, world_size: int, port: str, pipeline_type: str, detach: bool
) -> None:
    with process_group(rank, world_size, port) as (pg, device):
        env = ShardingEnv.from_process_group(pg)
        plans = [_plan(PLAN_A, world_size)] + [_plan(m, world_size) for m in MOVES]
        segments = len(plans)
        # TrainPipelineBase stops when it cannot fetch the batch after the one
        # it trains: give it one more, which it never trains.
        extra = 1 if pipeline_type == "base" else 0
        batches = _batches(STEPS_PER_SEGMENT * segments + extra, rank)
        model, optimizer = _model(env, device, plans[0])
        if pipeline_type == "sparse_dist":
            pipeline: Any = TrainPipelineSparseDist(model, optimizer, device)
        else:
            pipeline = TrainPipelineBase(model, optimizer, device)
        it: Iterator[Batch] = iter(batches)

        step = 0
        for segment, plan in enumerate(plans):
            if segment > 0:
                weights, opt_state = _state(model, pg)
                if detach:
                    pipeline.detach()
                model.reshard(plan)
                if detach:
                    pipeline.attach(model)
                reference, ref_optimizer = _model(env, device, plan)
                load_global_state(reference, weights, opt_state)
            losses = [pipeline.progress(it)[0] for _ in range(STEPS_PER_SEGMENT)]
            if segment > 0:
                expected = _plain_steps(
                    reference,
                    ref_optimizer,
                    batches[step : step + STEPS_PER_SEGMENT],
                )
                for got, want in zip(losses, expected):
                    assert torch.equal(got, want), (segment, losses, expected)
                assert_state_dicts_equal(reference.state_dict(), model.state_dict())
                assert_optimizer_states_equal(reference, model)
            step += STEPS_PER_SEGMENT
        try:
            pipeline.progress(it)
        except StopIteration:
            pass  # every batch trained exactly once
        else:
            raise AssertionError("a batch was left over or trained twice")


class ReshardPipelineTest(ReshardTestBase):
    def test_train_pipeline_sparse_dist_across_reshards(self) -> None:
        self.run_ranks(_run_pipeline, pipeline_type="sparse_dist", detach=False)

    def test_train_pipeline_sparse_dist_detach_attach(self) -> None:
        self.run_ranks(_run_pipeline, pipeline_type="sparse_dist", detach=True)

    def test_train_pipeline_base_across_reshards(self) -> None:
        self.run_ranks(_run_pipeline, pipeline_type="base", detach=False)


if __name__ == "__main__":
    unittest.main()

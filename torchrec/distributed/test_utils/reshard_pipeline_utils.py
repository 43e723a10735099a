#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The pipeline scenario of the reshard tests: a DLRM trained through
TrainPipelineSparseDist, its plans and moves, batches, dense optimizer, and
the reference (a plain loop in the pipeline's order of operations).
"""

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.test_utils.model_zoo import equal_tables_dlrm
from torchrec.distributed.test_utils.reshard_utils import (
    global_optimizer_state,
    global_weights,
    make_plan,
    TableSpec,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRMTrain
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

DLRM_EBC_PATH = "model.sparse_arch.embedding_bag_collection"
DLRM_TABLES, DLRM_ROWS, DLRM_DIM, DLRM_DENSE_IN, DLRM_BATCH = 4, 40, 8, 4, 6
DLRM_PLAN_A: Dict[str, TableSpec] = {
    "t0": ("table_wise", 0),
    "t1": ("table_wise", 1),
    "t2": ("column_wise", [0, 1]),
    "t3": ("row_wise", None),
}
# one table moving rank, a table-wise table becoming column-wise, a swap
DLRM_MOVES: List[Dict[str, TableSpec]] = [
    {**DLRM_PLAN_A, "t0": ("table_wise", 1)},
    {**DLRM_PLAN_A, "t0": ("column_wise", [1, 0])},
    {**DLRM_PLAN_A, "t0": ("table_wise", 1), "t1": ("table_wise", 0)},
]
STEPS_PER_SEGMENT = 3


def dlrm(seed: int) -> DLRMTrain:
    """A DLRMTrain of DLRM_TABLES tables, its dense layers seeded with ``seed``."""
    return equal_tables_dlrm(
        DLRM_TABLES,
        DLRM_ROWS,
        DLRM_DIM,
        DLRM_DENSE_IN,
        [4, 1],
        torch.device("cpu"),
        seed=seed,
    )


def dlrm_batches(count: int, rank: int) -> List[Batch]:
    """Different local batches per rank, as in data-parallel training."""
    generator = torch.Generator().manual_seed(100 + rank)
    batches = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (DLRM_TABLES * DLRM_BATCH,), generator=generator)
        values = torch.randint(0, DLRM_ROWS, (int(lengths.sum()),), generator=generator)
        batches.append(
            Batch(
                dense_features=torch.rand(
                    DLRM_BATCH, DLRM_DENSE_IN, generator=generator
                ),
                sparse_features=KeyedJaggedTensor.from_lengths_sync(
                    keys=[f"f{i}" for i in range(DLRM_TABLES)],
                    values=values,
                    lengths=lengths,
                ),
                labels=torch.randint(0, 2, (DLRM_BATCH,), generator=generator),
            )
        )
    return batches


def dlrm_plan(specs: Dict[str, TableSpec], world_size: int) -> ShardingPlan:
    """A ShardingPlan of the DLRM's embedding bag collection from a table spec."""
    ebc = dlrm(0).model.sparse_arch.embedding_bag_collection
    return ShardingPlan(
        {DLRM_EBC_PATH: make_plan(ebc, specs, world_size, world_size, "fused")}
    )


def dlrm_model(
    env: ShardingEnv, device: torch.device, plan: ShardingPlan
) -> Tuple[DistributedModelParallel, CombinedOptimizer]:
    """The DLRM sharded under ``plan`` (fused Adagrad), the unsharded weights
    loaded; with its combined optimizer (fused and dense SGD)."""
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ADAGRAD,
            "learning_rate": 0.05,
            "eps": 0.01,
        }
    )
    model = DistributedModelParallel(
        dlrm(0), env=env, device=device, plan=plan, sharders=[sharder]
    )
    model.load_state_dict(dlrm(0).state_dict())
    dense = dense_optimizer(model)
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def dense_optimizer(model: torch.nn.Module) -> KeyedOptimizerWrapper:
    """SGD for the parameters the fused optimizer does not update."""
    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )


def plain_steps(
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


def global_weights_and_state(
    model: DistributedModelParallel, pg: dist.ProcessGroup
) -> Tuple[Dict[str, torch.Tensor], Dict[Tuple[str, str], torch.Tensor]]:
    """The model's global weights and fused optimizer state (plain collectives)."""
    return global_weights(model, pg), global_optimizer_state(model, pg)

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Test helpers for the rebalancer: a DLRM whose tables get a controlled load
(ids per sample per table, changing at a given step), the topology and
constraints of the planner that made its first plan, and the model with its
optimizer.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Topology,
)
from torchrec.distributed.test_utils.model_zoo import equal_tables_dlrm
from torchrec.distributed.test_utils.reshard_utils import make_plan
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ShardingEnv,
    ShardingPlan,
)
from torchrec.models.dlrm import DLRMTrain
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

EBC_PATH = "model.sparse_arch.embedding_bag_collection"
DENSE_IN = 4


def rebalance_dlrm(
    num_tables: int, rows: int, dim: int, device: torch.device, seed: int = 0
) -> DLRMTrain:
    """
    Args:
        num_tables (int): number of tables ``t<i>``, read by features ``f<i>``.
        rows (int): rows of each table.
        dim (int): embedding dimension.
        device (torch.device): the device ("meta" for the planner).
        seed (int): the seed of every weight.

    Returns:
        DLRMTrain: the zoo's small equal-tables DLRM.
    """
    return equal_tables_dlrm(num_tables, rows, dim, DENSE_IN, [4, 1], device, seed)


def loaded_batches(
    loads: Sequence[Sequence[int]],
    rank: int,
    rows: int,
    batch_size: int,
    seed: int = 0,
) -> List[Batch]:
    """
    One batch per entry of ``loads``: table ``i`` gets between 0 and
    ``2 * loads[step][i]`` ids per sample (mean ``loads[step][i]``), different
    on every rank.
    """
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    batches = []
    for per_table in loads:
        lengths = torch.cat(
            [
                torch.randint(0, 2 * p + 1, (batch_size,), generator=gen)
                for p in per_table
            ]
        )
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
        dense = torch.rand(batch_size, DENSE_IN, generator=gen)
        batches.append(
            Batch(
                dense_features=dense,
                sparse_features=KeyedJaggedTensor.from_lengths_sync(
                    keys=[f"f{i}" for i in range(len(per_table))],
                    values=values,
                    lengths=lengths,
                ),
                labels=torch.randint(0, 2, (batch_size,), generator=gen),
            )
        )
    return batches


def rebalance_sharder() -> EmbeddingBagCollectionSharder:
    """Fused exact Adagrad for the tables."""
    return EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ADAGRAD,
            "learning_rate": 0.05,
            "eps": 0.01,
        }
    )


def cpu_topology(world_size: int, ddr_cap: Optional[int] = None) -> Topology:
    """One host of ``world_size`` CPU ranks (``ddr_cap`` bytes each)."""
    if ddr_cap is None:
        return Topology(
            world_size=world_size, compute_device="cpu", local_world_size=world_size
        )
    return Topology(
        world_size=world_size,
        compute_device="cpu",
        local_world_size=world_size,
        ddr_cap=ddr_cap,
    )


def table_wise_constraints(
    pooling: Sequence[float],
) -> Dict[str, ParameterConstraints]:
    """Table-wise fused tables ``t<i>`` with the declared ``pooling``."""
    return {
        f"t{i}": ParameterConstraints(
            sharding_types=["table_wise"],
            compute_kernels=["fused"],
            pooling_factors=[float(p)],
        )
        for i, p in enumerate(pooling)
    }


def table_wise_planner(
    world_size: int, batch_size: int, pooling: Sequence[float]
) -> EmbeddingShardingPlanner:
    """A planner for table-wise fused tables with the declared ``pooling``."""
    return EmbeddingShardingPlanner(
        topology=cpu_topology(world_size),
        batch_size=batch_size,
        constraints=table_wise_constraints(pooling),
        stats=[],
        debug=False,
    )


def planned(
    planner: EmbeddingShardingPlanner, num_tables: int, rows: int, dim: int
) -> ShardingPlan:
    """The planner's plan for the DLRM (planned in this process)."""
    meta = rebalance_dlrm(num_tables, rows, dim, torch.device("meta"))
    return planner.plan(meta, [rebalance_sharder()])


def hand_plan(
    specs: Dict[str, Tuple[str, object]],
    num_tables: int,
    rows: int,
    dim: int,
    world_size: int,
) -> ShardingPlan:
    """The DLRM's plan with each table sharded as ``specs`` says, fused."""
    ebc = rebalance_dlrm(num_tables, rows, dim, torch.device("meta"))
    module = ebc.model.sparse_arch.embedding_bag_collection
    return ShardingPlan(
        {EBC_PATH: make_plan(module, specs, world_size, world_size, "fused")}
    )


def tables_on(plan: ShardingPlan, rank: int) -> List[int]:
    """Indices of the table-wise tables the plan puts on ``rank``."""
    shardings = plan.plan[EBC_PATH]
    assert isinstance(shardings, EmbeddingModuleShardingPlan)
    return sorted(int(t[1:]) for t, ps in shardings.items() if ps.ranks == [rank])


def rebalance_model(
    env: ShardingEnv,
    device: torch.device,
    plan: ShardingPlan,
    num_tables: int,
    rows: int,
    dim: int,
) -> Tuple[DistributedModelParallel, CombinedOptimizer]:
    """The DLRM sharded with ``plan`` from seed 0, with fused + SGD optimizers."""
    model = DistributedModelParallel(
        rebalance_dlrm(num_tables, rows, dim, torch.device("cpu")),
        env=env,
        device=device,
        plan=plan,
        sharders=[rebalance_sharder()],
    )
    model.load_state_dict(
        rebalance_dlrm(num_tables, rows, dim, torch.device("cpu")).state_dict()
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def decision_summary(decisions: Sequence[object]) -> List[Dict[str, object]]:
    """The fields of decisions every rank must agree on (no timings)."""
    keys = (
        "step",
        "action",
        "reason",
        "source",
        "kernel_seconds",
        "predicted_kernel_seconds",
        "predicted_step_seconds",
        "predicted_gain",
        "tables",
        "max_rank_bytes",
        "bytes_moved",
    )
    summary = []
    for d in decisions:
        row = {k: getattr(d, k) for k in keys}
        summary.append(row)
    return summary

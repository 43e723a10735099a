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
optimizer; and the statistics of one window for the pure search's tests.
"""

from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Topology,
)
from torchrec.distributed.resharding.rebalance.rebalancer import Rebalancer
from torchrec.distributed.resharding.rebalance.statistics import (
    LoadStatistics,
    TableLoad,
)
from torchrec.distributed.test_utils.model_zoo import equal_tables_dlrm
from torchrec.distributed.test_utils.multi_process_utils import (
    single_rank_process_group,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    make_plan,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
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
# What the old module rebalance/load.py gives of rebalance/statistics.py.
LOAD_STATISTICS_NAMES: Tuple[str, ...] = (
    "RANK_FIELDS",
    "FeatureSlot",
    "TableLoad",
    "LoadStatistics",
    "feature_slots",
    "statistics_from_vector",
)
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


# Four table-wise tables, alternating between ranks 0 and 1.
ALTERNATING_TABLE_WISE: Dict[str, Tuple[str, object]] = {
    "t0": ("table_wise", 0),
    "t1": ("table_wise", 1),
    "t2": ("table_wise", 0),
    "t3": ("table_wise", 1),
}


@contextmanager
def one_rank_rebalance_model(
    num_tables: int, rows: int, dim: int, batch_size: int
) -> Iterator[Tuple[DistributedModelParallel, EmbeddingShardingPlanner]]:
    """
    The DLRM on a one-rank gloo group, as its table-wise planner plans it
    for a uniform load.

    Args:
        num_tables (int): number of tables.
        rows (int): rows of each table.
        dim (int): embedding dimension.
        batch_size (int): the planner's batch size.

    Returns:
        Iterator[Tuple[DistributedModelParallel, EmbeddingShardingPlanner]]:
        the model and the planner, while the group lives.
    """
    with single_rank_process_group() as pg:
        env = ShardingEnv.from_process_group(pg)
        planner = table_wise_planner(1, batch_size, [1.0] * num_tables)
        plan = planned(planner, num_tables, rows, dim)
        model, _ = rebalance_model(
            env, torch.device("cpu"), plan, num_tables, rows, dim
        )
        yield model, planner


def dlrm_train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch
) -> torch.Tensor:
    """
    One training step of the DLRM without a pipeline.

    Returns:
        torch.Tensor: the step's loss, detached.
    """
    optimizer.zero_grad()
    loss, _ = model(batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train_rebalanced(
    pipeline: TrainPipelineSparseDist,
    rebalancer: Rebalancer,
    batches: Sequence[Batch],
) -> List[torch.Tensor]:
    """
    Trains on every batch through ``pipeline``, a rebalancer step after each,
    then closes the rebalancer.

    Returns:
        List[torch.Tensor]: the loss of every step, detached.
    """
    it: Iterator[Batch] = iter(batches)
    losses = []
    for _ in batches:
        losses.append(pipeline.progress(it)[0].detach())
        rebalancer.step()
    rebalancer.close()
    return losses


def window_statistics(
    ids: Mapping[str, float],
    compute_seconds: Sequence[float],
    step_seconds: float,
    samples_per_rank_step: float = 1.0,
    path: str = "m",
) -> LoadStatistics:
    """
    A window of ten steps as every rank would measure it, for the pure
    search's tests: one feature per table (named as the table, one id per
    sample), no seconds in the input or output dist.

    Args:
        ids (Mapping[str, float]): table name -> ids per step over all ranks.
        compute_seconds (Sequence[float]): per rank, kernel seconds per step.
        step_seconds (float): every rank's step.
        samples_per_rank_step (float): every table's samples per rank and step.
        path (str): the module holding the tables.

    Returns:
        LoadStatistics: the window, its tables sorted by name.
    """
    world_size = len(compute_seconds)
    return LoadStatistics(
        steps=10,
        tables=tuple(
            TableLoad(path, name, (name,), (1.0,), (samples_per_rank_step,), n)
            for name, n in sorted(ids.items())
        ),
        compute_seconds=tuple(compute_seconds),
        input_dist_seconds=(0.0,) * world_size,
        output_dist_seconds=(0.0,) * world_size,
        step_seconds=(step_seconds,) * world_size,
    )


def same_everywhere(value: Any) -> None:
    """Asserts that every rank of the default group passes an equal ``value``."""
    values: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), values


def assert_replays_by_hand(
    model: DistributedModelParallel,
    losses: Sequence[torch.Tensor],
    reshards: Sequence[Any],
    start: ShardingPlan,
    batches: Sequence[Batch],
    env: ShardingEnv,
    shape: Tuple[int, int, int],
) -> None:
    """
    A rebalanced run equals, bit for bit, the same plans applied by hand at
    the same steps: a new model from ``start`` trains on ``batches`` with the
    pipeline and reshards to each decision's plan after its step; every loss,
    the final plan, the weights and the optimizer state must be equal.

    Args:
        model (DistributedModelParallel): the rebalanced model, after its run.
        losses (Sequence[torch.Tensor]): its loss at every step (from 1).
        reshards (Sequence[RebalanceDecision]): its reshard decisions.
        start (ShardingPlan): the plan it started from.
        batches (Sequence[Batch]): this rank's batches of the run.
        env (ShardingEnv): the run's environment.
        shape (Tuple[int, int, int]): the DLRM's tables, rows and dimension.
    """
    by_step = {d.step: d.plan for d in reshards}
    replay, replay_optimizer = rebalance_model(env, model.device, start, *shape)
    pipeline = TrainPipelineSparseDist(replay, replay_optimizer, model.device)
    it = iter(batches)
    for step in range(1, len(losses) + 1):
        loss = pipeline.progress(it)[0].detach()
        assert torch.equal(loss, losses[step - 1]), (step, loss, losses[step - 1])
        if step in by_step:
            replay.reshard(by_step[step])
    assert replay.plan.plan == model.plan.plan
    assert_state_dicts_equal(model.state_dict(), replay.state_dict())
    assert_optimizer_states_equal(model, replay)

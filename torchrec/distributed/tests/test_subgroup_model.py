#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A model on a sub-group of the world: ``DistributedModelParallel`` over the
groups [0, 1], [2, 3] (at the same time) and then [0, 1, 2] of a 4-rank gloo
world, ranks outside the group idle. Every rank creates every group (and the
intra-/cross-node groups table-row-wise and grid sharding need) up front, in
the same order.

A model of an EmbeddingBagCollection (table-wise, column-wise, row-wise,
data-parallel, table-row-wise and grid tables) and a Linear under DDP is
trained a few steps on each group and must match a plain single-process
computation of the same model on the same batches: every rank's loss at every
step, and the final weights. DMP averages every gradient over the group
(DDP for the dense part and data-parallel tables, the output dists' backward
for sharded tables), so the reference steps on the mean of the group's losses;
both use SGD at the same rate (fused ``EXACT_SGD`` for sharded tables).

After each phase every rank of the world joins a collective on the default
group and on a group created afterwards (``dist.new_group`` must stay in step
on every rank: a group created on some ranks only makes this hang).

Hosts: the world is 2 hosts x 2 ranks (LOCAL_WORLD_SIZE=2), or 4 hosts x 1
rank. A host of a sub-group is a block of ``get_local_size(group size)``
consecutive group ranks, what TorchRec's planner assumes for any sharding
environment: with 2 ranks per host, [0, 1] and [2, 3] are each one host and
[0, 1, 2] (which straddles two hosts unevenly) is one host of 3 ranks; with 1
rank per host, every rank of a sub-group is a host of its own.
"""

import unittest
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.comm import get_local_size, new_intra_and_cross_node_pgs
from torchrec.distributed.embedding_sharding import shards_on_global_ranks
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.model_zoo import numbered_tables
from torchrec.distributed.test_utils.multi_process_utils import (
    BoundedMultiProcessContext,
    global_weights,
    MultiRankTestBase,
)
from torchrec.distributed.test_utils.reshard_utils import DENSE, FUSED
from torchrec.distributed.types import (
    EnumerableShardingSpec,
    ShardingEnv,
    ShardingPlan,
    ShardingType,
    ShardMetadata,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

WORLD_SIZE: int = 4
# Run one after the other; the groups of a phase run at the same time.
PHASES: Tuple[Tuple[Tuple[int, ...], ...], ...] = (((0, 1), (2, 3)), ((0, 1, 2),))
GROUPS: Tuple[Tuple[int, ...], ...] = tuple(g for phase in PHASES for g in phase)
TIMEOUT: timedelta = timedelta(seconds=60)
LEARNING_RATE: float = 0.1
STEPS: int = 3
BATCH_SIZE: int = 4
NUM_TABLES: int = 6
TABLES: List[EmbeddingBagConfig] = numbered_tables(
    EmbeddingBagConfig,
    NUM_TABLES,
    # The grid table is cut in two column blocks (of TorchRec's minimum 128).
    [256 if i == 5 else 8 for i in range(NUM_TABLES)],
    [13 + 2 * i for i in range(NUM_TABLES)],
)


class _Model(nn.Module):
    """An EBC and a Linear over the pooled embeddings (read by key)."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(tables=TABLES, device=torch.device("cpu"))
        self.dense = nn.Linear(sum(t.embedding_dim for t in TABLES), 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(features).to_dict()
        return self.dense(torch.cat([pooled[k] for k in sorted(pooled)], dim=1))


def _model() -> _Model:
    torch.manual_seed(0)
    return _Model()


def _batch(step: int, group_rank: int) -> Tuple[KeyedJaggedTensor, torch.Tensor]:
    """The local batch of a group rank at a step, and its regression targets."""
    gen = torch.Generator().manual_seed(1000 * step + group_rank)
    lengths = torch.randint(0, 4, (NUM_TABLES, BATCH_SIZE), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, t.num_embeddings, (int(lengths[i].sum()),), generator=gen)
            for i, t in enumerate(TABLES)
        ]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(NUM_TABLES)],
        values=values,
        lengths=lengths.flatten(),
    )
    return kjt, torch.randn(BATCH_SIZE, 1, generator=gen)


def _loss(model: nn.Module, step: int, group_rank: int) -> torch.Tensor:
    features, targets = _batch(step, group_rank)
    return ((model(features) - targets) ** 2).sum()


def _reference(group_size: int) -> Tuple[List[List[float]], Dict[str, torch.Tensor]]:
    """
    The unsharded model trained in this process on the group's batches.

    Returns:
        Tuple[List[List[float]], Dict[str, torch.Tensor]]: every group rank's
        loss at every step, and the final state dict.
    """
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for step in range(STEPS):
        per_rank = [_loss(model, step, r) for r in range(group_size)]
        optimizer.zero_grad()
        (sum(per_rank) / group_size).backward()
        optimizer.step()
        losses.append([loss.item() for loss in per_rank])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _plan(group_size: int, kernel: str) -> ShardingPlan:
    """
    Group-local placements of every sharding type (hosts as in the env), the
    sharded tables on ``kernel``.
    """
    hosts = group_size // get_local_size(group_size)
    last = group_size - 1
    specs = {
        "t0": table_wise(rank=last),
        "t1": column_wise(ranks=[last, 0]),
        "t2": row_wise(),
        "t3": data_parallel(),
        "t4": table_row_wise(host_index=hosts - 1),
        "t5": grid_shard(host_indexes=[hosts - 1, 0]),
    }
    module_plan = construct_module_sharding_plan(
        _model().sparse,
        specs,
        local_size=get_local_size(group_size),
        world_size=group_size,
        device_type="cpu",
    )
    for ps in module_plan.values():
        if ps.sharding_type != ShardingType.DATA_PARALLEL.value:
            ps.compute_kernel = kernel
    return ShardingPlan({"sparse": module_plan})


def _sharder() -> EmbeddingBagCollectionSharder:
    return EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_SGD,
            "learning_rate": LEARNING_RATE,
        }
    )


def _check_env(env: ShardingEnv, ranks: Sequence[int], pg: dist.ProcessGroup) -> None:
    """The device mesh is the group; plan placements translate to its ranks."""
    mesh = env.device_mesh
    assert mesh is not None
    assert mesh.mesh.tolist() == list(ranks), mesh
    assert mesh.get_group() is pg
    shards = [
        ShardMetadata([0, 0], [4, 8], f"rank:{r}/cpu") for r in range(len(ranks))
    ] + [ShardMetadata([0, 0], [4, 8], f"rank:{r}/cuda:{r}") for r in range(len(ranks))]
    placed = [str(s.placement) for s in shards_on_global_ranks(shards, env)]
    # An accelerator index follows the global rank (LOCAL_WORLD_SIZE per host).
    local = get_local_size(WORLD_SIZE)
    assert placed == [f"rank:{g}/cpu" for g in ranks] + [
        f"rank:{g}/cuda:{g % local}" for g in ranks
    ], placed


def _check_placements(
    dmp: DistributedModelParallel, ranks: Sequence[int], group_size: int
) -> None:
    """
    The model's plan keeps group-local ranks; its ShardedTensors name the
    same shards on the global ranks, and this rank holds exactly its own.
    """
    plan = dmp.plan.plan["sparse"]
    state = dmp.state_dict()
    for table, ps in plan.items():  # pyre-ignore[16]
        assert all(0 <= r < group_size for r in ps.ranks), (table, ps.ranks)
        if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
            assert isinstance(
                state[f"sparse.embedding_bags.{table}.weight"], torch.Tensor
            )
            continue
        assert isinstance(ps.sharding_spec, EnumerableShardingSpec)
        expected = sorted(
            (tuple(s.shard_offsets), tuple(s.shard_sizes), ranks[s.placement.rank()])
            for s in ps.sharding_spec.shards
        )
        value = state[f"sparse.embedding_bags.{table}.weight"]
        assert isinstance(value, ShardedTensor), (table, type(value))
        actual = sorted(
            (tuple(s.shard_offsets), tuple(s.shard_sizes), s.placement.rank())
            for s in value.metadata().shards_metadata
        )
        assert actual == expected, (table, actual, expected)
        for shard in value.local_shards():
            assert shard.metadata.placement.rank() == dist.get_rank(), table


def _check_refused_without_node_pgs(pg: dist.ProcessGroup, plan: ShardingPlan) -> None:
    """Table-row-wise and grid sharding on a sub-group whose environment lacks
    the node groups refuse with a clear error (before any collective)."""
    try:
        DistributedModelParallel(
            _model(),
            env=ShardingEnv.from_process_group(pg),
            device=torch.device("cpu"),
            plan=plan,
            sharders=[_sharder()],
        )
    except ValueError as error:
        assert "new_intra_and_cross_node_pgs" in str(error), error
    else:
        raise AssertionError("sharded table-row-wise without node groups")


def _train_on_group(
    ranks: Sequence[int],
    pg: dist.ProcessGroup,
    node_pgs: Tuple[dist.ProcessGroup, dist.ProcessGroup],
    plan: Optional[ShardingPlan],
) -> None:
    """One member of ``ranks``: DMP on the group, trained and checked."""
    group_size = len(ranks)
    group_rank = dist.get_rank(pg)
    assert ranks[group_rank] == dist.get_rank()
    env = ShardingEnv.from_process_group(pg, node_pgs=node_pgs)
    _check_env(env, ranks, pg)

    if plan is not None:
        _check_refused_without_node_pgs(pg, plan)
    unsharded = _model()
    dmp = DistributedModelParallel(
        _model(),
        env=env,
        device=torch.device("cpu"),
        plan=plan,
        sharders=[_sharder()],
    )
    # Sharding on CPU does not copy the unsharded weights: load them.
    dmp.load_state_dict(unsharded.state_dict())
    if plan is None:
        # The planner ran on group rank 0 and every member got the same plan.
        plans: List[Any] = [None] * group_size
        dist.all_gather_object(plans, str(dmp.plan), group=pg)
        assert all(p == plans[0] for p in plans), plans
    _check_placements(dmp, ranks, group_size)

    dense_optimizer = torch.optim.SGD(
        [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())],
        lr=LEARNING_RATE,
    )
    expected_losses, expected_state = _reference(group_size)
    for step in range(STEPS):
        loss = _loss(dmp, step, group_rank)
        dense_optimizer.zero_grad()
        loss.backward()  # the fused tables step here
        dense_optimizer.step()
        torch.testing.assert_close(
            loss.item(),
            expected_losses[step][group_rank],
            rtol=1e-6,
            atol=1e-6,
            msg=lambda m: f"rank {dist.get_rank()} step {step}: {m}",
        )

    weights = global_weights(dmp, pg)
    assert set(weights) == set(expected_state), (set(weights), set(expected_state))
    for key, value in expected_state.items():
        torch.testing.assert_close(
            weights[key],
            value,
            rtol=1e-6,
            atol=1e-6,
            msg=lambda m: f"rank {dist.get_rank()} {key}: {m}",
        )


def _check_world_usable(timeout: timedelta) -> None:
    """Every rank of the world joins collectives on the default group and on a
    group created now: torch's group counter is in step on every rank."""
    expected = float(sum(range(1, WORLD_SIZE + 1)))
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    assert value.item() == expected, value
    group = dist.new_group(list(range(WORLD_SIZE)), timeout=timeout)
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value, group=group)
    assert value.item() == expected, value
    dist.destroy_process_group(group)


def _run_subgroups(
    rank: int, world_size: int, port: str, local_size: int, kernel: Optional[str]
) -> None:
    """
    Every rank of the world: creates the groups, trains on each group it is a
    member of (a plan with sharded tables on ``kernel``, or the planner's plan
    if None) and joins the world-wide collectives after each phase.
    """
    with BoundedMultiProcessContext(
        rank, world_size, port, local_size=local_size, timeout_s=TIMEOUT.seconds
    ):
        # Every rank creates every group, in the same order.
        pgs = {ranks: dist.new_group(list(ranks), timeout=TIMEOUT) for ranks in GROUPS}
        node_pgs = {
            ranks: new_intra_and_cross_node_pgs(list(ranks), timeout=TIMEOUT)
            for ranks in GROUPS
        }
        for phase in PHASES:
            for ranks in phase:
                if rank in ranks:
                    plan = None if kernel is None else _plan(len(ranks), kernel)
                    _train_on_group(ranks, pgs[ranks], node_pgs[ranks], plan)
            _check_world_usable(TIMEOUT)


class SubgroupModelTest(MultiRankTestBase):
    def test_dmp_on_subgroups_fused_two_hosts_of_two(self) -> None:
        self.run_ranks(_run_subgroups, WORLD_SIZE, local_size=2, kernel=FUSED)

    def test_dmp_on_subgroups_dense_one_rank_per_host(self) -> None:
        self.run_ranks(_run_subgroups, WORLD_SIZE, local_size=1, kernel=DENSE)

    def test_dmp_planner_on_subgroups(self) -> None:
        self.run_ranks(_run_subgroups, WORLD_SIZE, local_size=2, kernel=None)


if __name__ == "__main__":
    unittest.main()

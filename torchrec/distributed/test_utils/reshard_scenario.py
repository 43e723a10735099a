#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The one set-up of the differential resharding tests, on one rank: a process
group, an unsharded module (by default an ``EmbeddingBagCollection`` of
tables ``t0..tN`` with deterministic weights), its sharder, the sharding
environment, and the module plans, batches and sharded modules a test makes
from them (``reshard_utils`` builds each), with the global state the oracle
compares.
"""

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.test_utils.reshard_utils import (
    BoundedMultiProcessContext,
    FUSED,
    global_optimizer_state,
    global_weights,
    load_global_state,
    make_batches,
    make_ebc,
    make_plan,
    make_sharder,
    shard,
    TableSpec,
    train_step,
    TW_CW_RW,
)
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingEnv
from torchrec.modules.embedding_configs import DataType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class ReshardScenario:
    """
    One rank's set-up of a differential resharding test.

    Args:
        pg (dist.ProcessGroup): the process group.
        device (torch.device): this rank's device.
        env (ShardingEnv): the sharding environment over ``pg``.
        ebc (nn.Module): the unsharded module (an EmbeddingBagCollection or
            an EmbeddingCollection).
        sharder (Any): its sharder.
        kernel (str): the compute kernel of the non data-parallel tables.
        local_size (int): ranks per host.
    """

    pg: dist.ProcessGroup
    device: torch.device
    env: ShardingEnv
    ebc: nn.Module
    sharder: Any
    kernel: str
    local_size: int

    @property
    def rows(self) -> List[int]:
        """Rows of every table."""
        configs = (
            self.ebc.embedding_bag_configs()
            if hasattr(self.ebc, "embedding_bag_configs")
            else self.ebc.embedding_configs()
        )
        return [c.num_embeddings for c in configs]

    def plan(self, specs: Mapping[str, TableSpec]) -> EmbeddingModuleShardingPlan:
        """The module plan of ``specs`` (see ``reshard_utils.make_plan``)."""
        return make_plan(
            self.ebc,
            specs,
            self.env.world_size,
            self.local_size,
            self.kernel,
            self.device.type,
        )

    def plans(
        self, specs: Sequence[Mapping[str, TableSpec]]
    ) -> List[EmbeddingModuleShardingPlan]:
        """The module plan of each of ``specs``."""
        return [self.plan(s) for s in specs]

    def batches(
        self, count: int, seed: int, batch_size: int = 4
    ) -> List[KeyedJaggedTensor]:
        """Deterministic batches over every table, the same on every rank."""
        return make_batches(len(self.rows), self.rows, count, batch_size, seed)

    def shard(self, plan: EmbeddingModuleShardingPlan) -> nn.Module:
        """The module sharded directly under ``plan``, with its weights."""
        return shard(self.ebc, self.sharder, plan, self.env, self.device)

    def twins(
        self,
        plan: EmbeddingModuleShardingPlan,
        batches: Sequence[KeyedJaggedTensor] = (),
    ) -> Tuple[nn.Module, nn.Module]:
        """
        Two modules sharded directly under ``plan``, the one a test reshards
        and its reference, each trained on ``batches``.

        Args:
            plan (EmbeddingModuleShardingPlan): the plan of both.
            batches (Sequence[KeyedJaggedTensor]): the steps both train on.

        Returns:
            Tuple[nn.Module, nn.Module]: the module and the reference.
        """
        module = self.shard(plan)
        reference = self.shard(plan)
        for batch in batches:
            train_step(module, batch)
            train_step(reference, batch)
        return module, reference

    def global_state(
        self, module: nn.Module
    ) -> Tuple[Dict[str, torch.Tensor], Dict[Tuple[str, str], torch.Tensor]]:
        """A sharded module's full weights and fused optimizer state, gathered."""
        return global_weights(module, self.pg), global_optimizer_state(module, self.pg)

    def reference(
        self,
        plan: EmbeddingModuleShardingPlan,
        state: Tuple[Dict[str, torch.Tensor], Dict[Tuple[str, str], torch.Tensor]],
    ) -> nn.Module:
        """The oracle: a module sharded directly under ``plan``, loaded with
        ``state`` (:meth:`global_state`)."""
        reference = self.shard(plan)
        load_global_state(reference, *state)
        return reference


# Four tables under plan A, then plan B: a table-wise table moves rank, a
# column-wise one becomes table-wise, a row-wise one column-wise, one stays.
MIXED_PLAN_A: Dict[str, TableSpec] = {**TW_CW_RW, "t3": ("table_wise", 0)}
MIXED_PLAN_B: Dict[str, TableSpec] = {
    "t0": ("table_wise", 1),
    "t1": ("table_wise", 0),
    "t2": ("column_wise", [1, 0]),
    "t3": ("table_wise", 0),
}


@contextlib.contextmanager
def reshard_scenario(
    rank: int,
    world_size: int,
    port: str,
    num_tables: int = 0,
    optimizer: Optional[str] = "rowwise_adagrad",
    kernel: str = FUSED,
    dims: Optional[Sequence[int]] = None,
    rows: Optional[Sequence[int]] = None,
    data_type: DataType = DataType.FP32,
    timeout_s: float = 120.0,
    unsharded: Optional[nn.Module] = None,
    sharder: Optional[Any] = None,
) -> Iterator[ReshardScenario]:
    """
    Args:
        rank (int): this rank.
        world_size (int): the world size.
        port (str): the rendezvous port.
        num_tables (int): tables ``t0..tN`` (features ``f0..fN``).
        optimizer (Optional[str]): the fused optimizer (``reshard_utils``'s
            names), for the fused kernel.
        kernel (str): the compute kernel.
        dims (Optional[Sequence[int]]): the tables' dims.
        rows (Optional[Sequence[int]]): the tables' rows.
        data_type (DataType): the tables' data type.
        timeout_s (float): timeout of every collective.
        unsharded (Optional[nn.Module]): the unsharded module, instead of
            ``num_tables`` tables.
        sharder (Optional[Any]): its sharder, instead of an EBC sharder with
            ``optimizer``.

    Returns:
        Iterator[ReshardScenario]: the set-up, while the process group lives.
    """
    with BoundedMultiProcessContext(
        rank, world_size, port, timeout_s=timeout_s
    ) as context:
        pg, device = context.pg, context.device
        yield ReshardScenario(
            pg=pg,
            device=device,
            env=ShardingEnv(world_size, rank, pg),
            ebc=(
                unsharded
                if unsharded is not None
                else make_ebc(num_tables, data_type, dims=dims, rows=rows)
            ),
            sharder=(
                sharder
                if sharder is not None
                else make_sharder(optimizer if kernel == FUSED else None)
            ),
            kernel=kernel,
            local_size=world_size,
        )

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The one set-up of the differential resharding tests, on one rank: a process
group, an ``EmbeddingBagCollection`` of tables ``t0..tN`` with deterministic
weights, its sharder, the sharding environment, and the module plans, batches
and sharded modules a test makes from them (``reshard_utils`` builds each).
"""

import contextlib
from dataclasses import dataclass
from typing import Iterator, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.test_utils.reshard_utils import (
    FUSED,
    make_batches,
    make_ebc,
    make_plan,
    make_sharder,
    process_group,
    shard,
    TableSpec,
)
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingEnv
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class ReshardScenario:
    """
    One rank's set-up of a differential resharding test.

    Args:
        pg (dist.ProcessGroup): the process group.
        device (torch.device): this rank's device.
        env (ShardingEnv): the sharding environment over ``pg``.
        ebc (EmbeddingBagCollection): the unsharded module.
        sharder (EmbeddingBagCollectionSharder): its sharder.
        kernel (str): the compute kernel of the non data-parallel tables.
        local_size (int): ranks per host.
    """

    pg: dist.ProcessGroup
    device: torch.device
    env: ShardingEnv
    ebc: EmbeddingBagCollection
    sharder: EmbeddingBagCollectionSharder
    kernel: str
    local_size: int

    @property
    def rows(self) -> List[int]:
        """Rows of every table."""
        return [c.num_embeddings for c in self.ebc.embedding_bag_configs()]

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

    def shard(self, plan: EmbeddingModuleShardingPlan) -> ShardedEmbeddingBagCollection:
        """The module sharded directly under ``plan``, with its weights."""
        return shard(self.ebc, self.sharder, plan, self.env, self.device)


@contextlib.contextmanager
def reshard_scenario(
    rank: int,
    world_size: int,
    port: str,
    num_tables: int,
    optimizer: Optional[str] = "rowwise_adagrad",
    kernel: str = FUSED,
    dims: Optional[Sequence[int]] = None,
    rows: Optional[Sequence[int]] = None,
    data_type: DataType = DataType.FP32,
    timeout_s: float = 120.0,
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

    Returns:
        Iterator[ReshardScenario]: the set-up, while the process group lives.
    """
    with process_group(rank, world_size, port, timeout_s=timeout_s) as (pg, device):
        yield ReshardScenario(
            pg=pg,
            device=device,
            env=ShardingEnv(world_size, rank, pg),
            ebc=make_ebc(num_tables, data_type, dims=dims, rows=rows),
            sharder=make_sharder(optimizer if kernel == FUSED else None),
            kernel=kernel,
            local_size=world_size,
        )

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Broadcasts on a sub-group name their source as a rank of the group: the
initialisation of data-parallel tables (``reset_parameters``) and
``invoke_on_rank_and_broadcast_result`` (how ``collective_plan`` shares the
planner's plan). Four ranks in the groups [0, 1] and [2, 3]; the second group
does not hold global rank 0.
"""

import unittest
from datetime import timedelta
from typing import Any, List, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.collective_utils import invoke_on_rank_and_broadcast_result
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    table_wise,
)
from torchrec.distributed.test_utils.model_zoo import make_ebc
from torchrec.distributed.test_utils.multi_process_utils import (
    BoundedMultiProcessContext,
    MultiRankTestBase,
)
from torchrec.distributed.types import ShardingEnv

TIMEOUT: timedelta = timedelta(seconds=60)
GROUPS: Tuple[Tuple[int, ...], ...] = ((0, 1), (2, 3))


def _broadcast_on_subgroup(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=TIMEOUT.seconds):
        pgs = [dist.new_group(list(ranks), timeout=TIMEOUT) for ranks in GROUPS]
        ranks = next(g for g in GROUPS if rank in g)
        pg = pgs[GROUPS.index(ranks)]

        # group rank 0 computes, every member gets its result
        result = invoke_on_rank_and_broadcast_result(pg, 0, dist.get_rank)
        assert result == ranks[0], (result, ranks)

        # every member starts from other weights; data-parallel tables then
        # hold those of group rank 0
        ebc = make_ebc(2, dims=[4, 4], rows=[6, 6], seed=rank)
        plan = construct_module_sharding_plan(
            ebc,
            {"t0": data_parallel(), "t1": table_wise(rank=1)},
            local_size=len(ranks),
            world_size=len(ranks),
            device_type="cpu",
        )
        sharded = EmbeddingBagCollectionSharder().shard(
            ebc, plan, ShardingEnv.from_process_group(pg), torch.device("cpu")
        )
        sharded.reset_parameters()
        weight = sharded.state_dict()["embedding_bags.t0.weight"]
        gathered: List[Any] = [None] * len(ranks)
        dist.all_gather_object(gathered, weight.detach().clone(), group=pg)
        for other in gathered:
            assert torch.equal(other, gathered[0]), gathered


class SubgroupBroadcastTest(MultiRankTestBase):
    def test_broadcast_sources_are_group_ranks(self) -> None:
        self.run_ranks(_broadcast_on_subgroup, 4)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Table-row-wise sharding on a sub-group of the world takes its intra- and
cross-node groups from the sharding environment: every rank creates them up
front with ``new_intra_and_cross_node_pgs`` (as with ``dist.new_group``), the
members pass theirs as ``ShardingEnv(node_pgs=...)`` and
``intra_and_cross_node_pg(env=...)`` returns them; an environment over a
sub-group without them is refused before any group is created. Two ranks,
each in a group of its own. (test_subgroup_model.py trains a whole model on
larger sub-groups.)
"""

import unittest
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.comm import (
    intra_and_cross_node_pg,
    new_intra_and_cross_node_pgs,
)
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    table_row_wise,
)
from torchrec.distributed.test_utils.model_zoo import make_ebc
from torchrec.distributed.test_utils.multi_process_utils import (
    BoundedMultiProcessContext,
    MultiRankTestBase,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

TIMEOUT: timedelta = timedelta(seconds=60)


def _node_groups_on_subgroup(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=TIMEOUT.seconds):
        groups = [[r] for r in range(world_size)]
        pgs = [dist.new_group(g, timeout=TIMEOUT) for g in groups]
        node_pgs = [new_intra_and_cross_node_pgs(g, timeout=TIMEOUT) for g in groups]
        for r, (intra, cross) in enumerate(node_pgs):
            member = r == rank
            assert (intra != dist.GroupMember.NON_GROUP_MEMBER) == member
            assert (cross != dist.GroupMember.NON_GROUP_MEMBER) == member
        pg = pgs[rank]

        ebc = make_ebc(1, dims=[8], rows=[12])
        plan = construct_module_sharding_plan(
            ebc,
            {"t0": table_row_wise(host_index=0)},
            local_size=1,
            world_size=1,
            device_type="cpu",
        )
        sharder = EmbeddingBagCollectionSharder()
        try:
            sharder.shard(
                ebc, plan, ShardingEnv.from_process_group(pg), torch.device("cpu")
            )
        except ValueError as error:
            assert "new_intra_and_cross_node_pgs" in str(error), error
        else:
            raise AssertionError("table-row-wise on a sub-group without node groups")

        env = ShardingEnv.from_process_group(pg, node_pgs=node_pgs[rank])
        assert intra_and_cross_node_pg(env=env) == node_pgs[rank]
        sharded = sharder.shard(ebc, plan, env, torch.device("cpu"))
        sharded.load_state_dict(ebc.state_dict())
        weight = sharded.state_dict()["embedding_bags.t0.weight"]
        assert isinstance(weight, ShardedTensor)
        assert all(
            m.placement.rank() == rank for m in weight.metadata().shards_metadata
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0"], values=torch.tensor([0, 5, 11]), lengths=torch.tensor([2, 1])
        )
        torch.testing.assert_close(
            sharded(kjt).wait().values(), ebc(kjt).values().detach()
        )
        # The world's own groups were not touched: a collective on it works.
        value = torch.tensor([1.0])
        dist.all_reduce(value)
        assert value.item() == world_size


class SubgroupNodeGroupsTest(MultiRankTestBase):
    def test_table_row_wise_takes_node_groups_from_the_env(self) -> None:
        self.run_ranks(_node_groups_on_subgroup, 2)


if __name__ == "__main__":
    unittest.main()

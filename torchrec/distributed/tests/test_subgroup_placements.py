#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
An EmbeddingBagCollection sharded on a sub-group of the world: plans keep
group-local ranks, the ShardedTensors of its state dict place every shard on
the global rank of its group rank (``shards_on_global_ranks``), and the module
trains. Two ranks, each in a group of its own: on rank 1 group rank 0 is
global rank 1.
"""

import unittest
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embedding_sharding import shards_on_global_ranks
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.model_zoo import make_ebc
from torchrec.distributed.test_utils.multi_process_utils import (
    alone_on_subgroups,
    MultiRankTestBase,
)
from torchrec.distributed.types import ShardingEnv, ShardMetadata
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

TIMEOUT: timedelta = timedelta(seconds=60)


def _placements_on_subgroup(rank: int, world_size: int, port: str) -> None:
    with alone_on_subgroups(rank, world_size, port, TIMEOUT) as env:

        shards = [ShardMetadata([0, 0], [4, 8], "rank:0/cpu")]
        placed = shards_on_global_ranks(shards, env)
        assert [str(s.placement) for s in placed] == [f"rank:{rank}/cpu"], placed
        assert str(shards[0].placement) == "rank:0/cpu"  # the caller's, unchanged
        world = ShardingEnv.from_process_group(dist.group.WORLD)
        assert shards_on_global_ranks(shards, world) == shards

        ebc = make_ebc(3, dims=[8] * 3, rows=[10 + i for i in range(3)])
        plan = construct_module_sharding_plan(
            ebc,
            {
                "t0": table_wise(rank=0),
                "t1": column_wise(ranks=[0, 0]),
                "t2": row_wise(),
            },
            local_size=1,
            world_size=1,
            device_type="cpu",
        )
        sharded = EmbeddingBagCollectionSharder().shard(
            ebc, plan, env, torch.device("cpu")
        )
        sharded.load_state_dict(ebc.state_dict())
        assert all(r == 0 for ps in plan.values() for r in ps.ranks or [])
        for key, value in sharded.state_dict().items():
            assert isinstance(value, ShardedTensor), (key, type(value))
            for meta in value.metadata().shards_metadata:
                assert meta.placement is not None
                assert meta.placement.rank() == rank, (key, meta)
            for shard in value.local_shards():
                row, col = shard.metadata.shard_offsets
                rows, cols = shard.metadata.shard_sizes
                want = ebc.state_dict()[key][row : row + rows, col : col + cols]
                assert torch.equal(shard.tensor, want), key

        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "f1", "f2"],
            values=torch.tensor([0, 1, 2, 3, 4, 5]),
            lengths=torch.tensor([1, 1, 2, 0, 1, 1]),
        )
        out = sharded(kjt).wait()
        want = ebc(kjt)
        torch.testing.assert_close(out.values(), want.values().detach())


class SubgroupPlacementsTest(MultiRankTestBase):
    def test_sharded_tensors_place_shards_on_global_ranks(self) -> None:
        self.run_ranks(_placements_on_subgroup, 2)


if __name__ == "__main__":
    unittest.main()

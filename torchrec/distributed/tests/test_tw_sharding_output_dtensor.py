#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""Table-wise sharding honours ``ShardingEnv.output_dtensor``.

With ``output_dtensor`` set on the environment, every table of a sharded
EmbeddingBagCollection shows up in its state dict as a DTensor whose local
part is the rank's shard, table-wise tables included, also next to
column-wise and row-wise tables in the same module.
"""

import copy
import unittest
from typing import List

import torch
from torch.distributed.tensor import DTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.model_zoo import numbered_tables
from torchrec.distributed.test_utils.multi_process import MultiProcessContext
from torchrec.distributed.test_utils.multi_process_utils import NcclOrGlooTestBase
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

WORLD_SIZE: int = 2
TABLES: List[EmbeddingBagConfig] = numbered_tables(
    EmbeddingBagConfig, 4, [8] * 4, [10 + 2 * i for i in range(4)]
)


def _batch() -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 3, (2 * len(TABLES),), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, t.num_embeddings, (int(n),), generator=gen)
            for t, n in zip([t for t in TABLES for _ in range(2)], lengths.tolist())
        ]
    )
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f for t in TABLES for f in t.feature_names],
        values=values,
        lengths=lengths,
    )


def _dtensor_rank(rank: int, world_size: int, backend: str) -> None:
    """One rank: shard with output_dtensor, check every table's local part,
    fill the tables through the state dict and compare a forward pass."""
    with MultiProcessContext(rank, world_size, backend) as ctx:
        assert ctx.pg is not None
        torch.manual_seed(0)
        ref = EmbeddingBagCollection(tables=TABLES, device=torch.device("cpu"))
        plan = construct_module_sharding_plan(
            ref,
            {
                "t0": table_wise(rank=0),
                "t1": table_wise(rank=1),
                "t2": column_wise(ranks=[0, 1]),
                "t3": row_wise(),
            },
            local_size=world_size,
            world_size=world_size,
            device_type=ctx.device.type,
        )
        env = ShardingEnv(world_size, rank, ctx.pg, output_dtensor=True)
        sharded = EmbeddingBagCollectionSharder().shard(
            copy.deepcopy(ref), plan, env, ctx.device
        )

        state = sharded.state_dict()
        want = ref.state_dict()
        for t in TABLES:
            key = f"embedding_bags.{t.name}.weight"
            value = state[key]
            assert isinstance(value, DTensor), (key, type(value))
            assert tuple(value.shape) == (t.num_embeddings, t.embedding_dim), key
            wrapper = value._local_tensor
            shards = list(zip(wrapper.local_shards(), wrapper.local_offsets()))
            expected_shards = [
                meta
                for meta in plan[t.name].sharding_spec.shards
                if meta.placement.rank() == rank
            ]
            assert [tuple(o) for _, o in shards] == [
                tuple(m.shard_offsets) for m in expected_shards
            ], (rank, key)
            # the local shards are views of the live table: fill them
            for (tensor, (row, col)), meta in zip(shards, expected_shards):
                rows, cols = meta.shard_sizes
                assert tuple(tensor.shape) == (rows, cols), (rank, key)
                with torch.no_grad():
                    tensor.copy_(want[key][row : row + rows, col : col + cols])

        out = sharded(_batch().to(ctx.device)).wait()
        expected = ref(_batch())
        assert out.keys() == expected.keys()
        torch.testing.assert_close(out.values().cpu(), expected.values().detach())


class TableWiseOutputDTensorTest(NcclOrGlooTestBase):
    """ShardingEnv.output_dtensor covers table-wise tables."""

    def test_tw_tables_are_dtensors_of_their_shards(self) -> None:
        self.run_on_ranks(_dtensor_rank, WORLD_SIZE)


if __name__ == "__main__":
    unittest.main()

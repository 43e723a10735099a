#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""Health of the upstream base on this stack (torch 2.13, fbgemm-gpu 1.8).

Shards an EmbeddingBagCollection table-wise, column-wise, row-wise and
data-parallel over 2 gloo ranks, with dense and with fused kernels, runs
forward and backward plus one SGD step, and compares outputs and updated
weights with the unsharded module. With fused kernels this needs the fused
optimizer to read its learning rate through fbgemm 1.8's get_learning_rate().
"""

import copy
import unittest
from typing import Dict, List

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.model_zoo import numbered_tables
from torchrec.distributed.test_utils.multi_process import MultiProcessContext
from torchrec.distributed.test_utils.multi_process_utils import NcclOrGlooTestBase
from torchrec.distributed.test_utils.sgd_reference import (
    averaged_sgd_step,
    BATCH_SIZE,
    LEARNING_RATE,
    random_batch,
)
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

WORLD_SIZE: int = 2
TABLES: List[EmbeddingBagConfig] = numbered_tables(
    EmbeddingBagConfig, 4, [8] * 4, [16 + 3 * i for i in range(4)]
)


def _batch(seed: int) -> KeyedJaggedTensor:
    """A deterministic local batch (one per rank) over all features."""
    return random_batch(TABLES, 1000 + seed)


def _loss_weights(seed: int) -> torch.Tensor:
    """Per-output weights so that every embedding gets a distinct gradient."""
    gen = torch.Generator().manual_seed(2000 + seed)
    return torch.randn(BATCH_SIZE, sum(t.embedding_dim for t in TABLES), generator=gen)


def _expected_weights(
    ref: EmbeddingBagCollection, world_size: int
) -> Dict[str, torch.Tensor]:
    """Weights after one SGD step of the sharded module (every table sees the
    gradient of every rank's batch averaged over the ranks)."""
    return averaged_sgd_step(
        ref,
        lambda src: (ref(_batch(src)).values() * _loss_weights(src)).sum(),
        world_size,
    )


def _check_state(
    state: Dict[str, object], expected: Dict[str, torch.Tensor], rank: int
) -> None:
    """Compare every local shard of the sharded state dict with the expected
    global tensors."""
    assert set(state) == set(expected), (sorted(state), sorted(expected))
    for name, value in state.items():
        want = expected[name]
        if isinstance(value, ShardedTensor):
            assert list(value.size()) == list(want.size()), name
            for shard in value.local_shards():
                rows, cols = shard.metadata.shard_offsets
                nrows, ncols = shard.metadata.shard_sizes
                piece = want[rows : rows + nrows, cols : cols + ncols]
                torch.testing.assert_close(
                    shard.tensor, piece, msg=f"rank {rank} {name} {rows},{cols}"
                )
        else:
            assert isinstance(value, torch.Tensor), (name, type(value))
            torch.testing.assert_close(value, want, msg=f"rank {rank} {name}")


def _health_rank(rank: int, world_size: int, kernel: str, backend: str) -> None:
    """One rank: shard, compare forward, backward + SGD step, compare weights."""
    torch.set_num_threads(1)
    with MultiProcessContext(rank, world_size, backend) as ctx:
        device = ctx.device
        torch.manual_seed(0)
        ref = EmbeddingBagCollection(tables=TABLES, device=torch.device("cpu"))
        fused = kernel == EmbeddingComputeKernel.FUSED.value
        sharder = EmbeddingBagCollectionSharder(
            fused_params=(
                {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LEARNING_RATE}
                if fused
                else None
            )
        )
        plan = construct_module_sharding_plan(
            ref,
            {
                "t0": table_wise(rank=1),
                "t1": column_wise(ranks=[0, 1]),
                "t2": row_wise(),
                "t3": data_parallel(),
            },
            local_size=world_size,
            world_size=world_size,
            device_type=device.type,
        )
        dp_tables = [
            name
            for name, ps in plan.items()
            if ps.sharding_type == ShardingType.DATA_PARALLEL.value
        ]
        for name, ps in plan.items():
            if name not in dp_tables:
                ps.compute_kernel = kernel
        assert ctx.pg is not None
        sharded = sharder.shard(
            copy.deepcopy(ref), plan, ShardingEnv.from_process_group(ctx.pg), device
        )
        # On CPU, shard() does not copy the weights: load them explicitly.
        sharded.load_state_dict(ref.state_dict())

        kjt = _batch(rank).to(device)
        out = sharded(kjt).wait()
        want = ref(_batch(rank))
        assert out.keys() == want.keys(), (out.keys(), want.keys())
        torch.testing.assert_close(out.values().cpu(), want.values().detach())

        loss = (out.values() * _loss_weights(rank).to(device)).sum()
        loss.backward()  # the fused kernel applies its SGD step here
        dense = [p for p in sharded.parameters() if p.grad is not None]
        assert dense, "no parameter received a gradient"
        torch.optim.SGD(dense, lr=LEARNING_RATE).step()

        expected = _expected_weights(ref, world_size)
        state = {k: v for k, v in sharded.state_dict().items()}
        _check_state(state, expected, rank)


class BaseHealthTest(NcclOrGlooTestBase):
    """The base release shards and trains correctly on this stack."""

    def _run(self, kernel: str) -> None:
        self.run_on_ranks(_health_rank, WORLD_SIZE, kernel=kernel)

    def test_tw_cw_rw_dp_dense(self) -> None:
        self._run(EmbeddingComputeKernel.DENSE.value)

    def test_tw_cw_rw_dp_fused(self) -> None:
        self._run(EmbeddingComputeKernel.FUSED.value)


if __name__ == "__main__":
    unittest.main()

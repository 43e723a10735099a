#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
``has_pending_backward()`` of sharded embedding modules: a forward that
builds an autograd graph through the module's lookups leaves it pending until
backward runs through it or the graph is freed; a forward without grad leaves
nothing pending. For EmbeddingBagCollection (dense and fused kernels) and
EmbeddingCollection, sharded on a process group of one rank.
"""

import gc
import unittest
from typing import Any, Callable

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    table_wise,
)
from torchrec.distributed.test_utils.multi_process_utils import (
    single_rank_process_group,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

FUSED_PARAMS = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}


def _batch() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"],
        values=torch.tensor([0, 1, 2, 3, 4]),
        lengths=torch.tensor([2, 1, 1, 1]),
    )


def _shard(unsharded: nn.Module, sharder: Any, kernel: str) -> nn.Module:
    plan = construct_module_sharding_plan(
        unsharded,
        {"t0": table_wise(rank=0), "t1": table_wise(rank=0)},
        local_size=1,
        world_size=1,
        device_type="cpu",
    )
    for ps in plan.values():
        ps.compute_kernel = kernel
    pg = torch.distributed.group.WORLD
    assert pg is not None
    return sharder.shard(
        unsharded, plan, ShardingEnv.from_process_group(pg), torch.device("cpu")
    )


def _sharded(
    collection: Callable[..., nn.Module],
    config: Callable[..., Any],
    sharder: Callable[..., Any],
    kernel: str,
) -> nn.Module:
    """
    Two 8 x 4 tables ``t0``, ``t1`` (features ``f0``, ``f1``), table-wise on
    the one rank with ``kernel``.

    Args:
        collection (Callable[..., nn.Module]): EmbeddingBagCollection or
            EmbeddingCollection.
        config (Callable[..., Any]): its table config class.
        sharder (Callable[..., Any]): its sharder class.
        kernel (str): the compute kernel.

    Returns:
        nn.Module: the sharded module.
    """
    unsharded = collection(
        tables=[
            config(
                name=f"t{i}", embedding_dim=4, num_embeddings=8, feature_names=[f"f{i}"]
            )
            for i in range(2)
        ],
        device=torch.device("cpu"),
    )
    return _shard(unsharded, sharder(fused_params=FUSED_PARAMS), kernel)


def _ebc(kernel: str) -> nn.Module:
    return _sharded(
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingBagCollectionSharder,
        kernel,
    )


def _ec(kernel: str) -> nn.Module:
    return _sharded(
        EmbeddingCollection, EmbeddingConfig, EmbeddingCollectionSharder, kernel
    )


def _loss(output: Any) -> torch.Tensor:
    if isinstance(output, dict):
        return sum(jt.values().sum() for jt in output.values())
    return output.values().sum()


class PendingBackwardTest(unittest.TestCase):
    def _check(self, build: Callable[[], nn.Module]) -> None:
        with single_rank_process_group():
            module = build()
            self.assertFalse(module.has_pending_backward())

            loss = _loss(module(_batch()).wait())
            self.assertTrue(module.has_pending_backward())
            loss.backward()
            self.assertFalse(module.has_pending_backward())

            loss = _loss(module(_batch()).wait())
            self.assertTrue(module.has_pending_backward())
            del loss  # the graph goes without a backward
            gc.collect()  # (TorchRec's awaitables hold some in cycles)
            self.assertFalse(module.has_pending_backward())

            with torch.no_grad():
                module(_batch()).wait()
            self.assertFalse(module.has_pending_backward())

    def test_ebc_fused(self) -> None:
        self._check(lambda: _ebc(EmbeddingComputeKernel.FUSED.value))

    def test_ebc_dense(self) -> None:
        self._check(lambda: _ebc(EmbeddingComputeKernel.DENSE.value))

    def test_ec_fused(self) -> None:
        self._check(lambda: _ec(EmbeddingComputeKernel.FUSED.value))


if __name__ == "__main__":
    unittest.main()

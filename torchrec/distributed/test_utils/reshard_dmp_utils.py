#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The model scenario of the DistributedModelParallel reshard tests: a sparse
arch of two EmbeddingBagCollections (pooled) and an EmbeddingCollection
(sequence), its plans, batches and training step.
"""

from typing import Any, Dict, List, Tuple

import torch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.test_utils.model_zoo import (  # noqa: F401
    sparse_arch,
    SparseArch,
)
from torchrec.distributed.test_utils.reshard_utils import (
    make_batches,
    make_plan,
    TableSpec,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

SPARSE_ARCH_MODULES = ("sparse_a", "sparse_b", "seq")


def module_configs(model: SparseArch, name: str) -> List[Any]:
    """The table configs of the model's module ``name``."""
    module = getattr(model, name)
    if isinstance(module, EmbeddingCollection):
        return module.embedding_configs()
    return module.embedding_bag_configs()


def module_prefix(model: SparseArch, name: str) -> str:
    """The state-dict prefix of the tables of the model's module ``name``."""
    module = getattr(model, name)
    return "embeddings" if isinstance(module, EmbeddingCollection) else "embedding_bags"


def sparse_arch_plan(
    model: SparseArch, specs: Dict[str, Dict[str, TableSpec]], world_size: int
) -> ShardingPlan:
    """A ShardingPlan of the model from a table spec per module (fused kernels)."""
    return ShardingPlan(
        {
            name: make_plan(
                getattr(model, name), specs[name], world_size, world_size, "fused"
            )
            for name in SPARSE_ARCH_MODULES
        }
    )


def sparse_arch_batches(
    model: SparseArch, count: int
) -> List[Tuple[KeyedJaggedTensor, ...]]:
    """``count`` batches: one KeyedJaggedTensor per module, seeded."""
    per_module = [
        make_batches(
            len(module_configs(model, name)),
            [c.num_embeddings for c in module_configs(model, name)],
            count,
            4,
            seed=7 + i,
        )
        for i, name in enumerate(SPARSE_ARCH_MODULES)
    ]
    return list(zip(*per_module))


def sparse_arch_step(
    model: DistributedModelParallel, batch: Tuple[KeyedJaggedTensor, ...]
) -> torch.Tensor:
    """One training step (loss: sum of squared outputs); the outputs."""
    out = model(batch)
    (out**2).sum().backward()
    return out.detach()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The reference of the health tests' training: deterministic local batches of
a module's tables, and the weights one SGD step of the sharded module must
reach, computed on the unsharded module (every rank's gradient averaged over
the ranks, as TorchRec's collectives divide gradients by the world size and
all-reduce data-parallel tables, as DDP does).
"""

from typing import Callable, Dict, List, Sequence

import torch
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

LEARNING_RATE: float = 0.1
BATCH_SIZE: int = 4


def random_batch(
    tables: Sequence[BaseEmbeddingConfig], seed: int, batch_size: int = BATCH_SIZE
) -> KeyedJaggedTensor:
    """
    A deterministic local batch: 0 to 3 ids per sample of each table's one
    feature.

    Args:
        tables (Sequence[BaseEmbeddingConfig]): the tables, one feature each.
        seed (int): the batch's seed.
        batch_size (int): samples.

    Returns:
        KeyedJaggedTensor: the batch, by table.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths: List[torch.Tensor] = []
    values: List[torch.Tensor] = []
    for table in tables:
        lens = torch.randint(0, 4, (batch_size,), generator=gen)
        lengths.append(lens)
        values.append(
            torch.randint(0, table.num_embeddings, (int(lens.sum()),), generator=gen)
        )
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f for table in tables for f in table.feature_names],
        values=torch.cat(values),
        lengths=torch.cat(lengths),
    )


def averaged_sgd_step(
    module: nn.Module,
    loss_of_rank: Callable[[int], torch.Tensor],
    world_size: int,
    learning_rate: float = LEARNING_RATE,
) -> Dict[str, torch.Tensor]:
    """
    The weights after one SGD step of ``module`` sharded over ``world_size``
    ranks: the gradients of every rank's loss averaged over the ranks, times
    the learning rate.

    Args:
        module (nn.Module): the unsharded module, with the weights before.
        loss_of_rank (Callable[[int], torch.Tensor]): rank ``r``'s loss of
            ``module`` (on its local batch).
        world_size (int): the ranks.
        learning_rate (float): the step's learning rate.

    Returns:
        Dict[str, torch.Tensor]: the weights after, by parameter name.
    """
    params = dict(module.named_parameters())
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    for src in range(world_size):
        grads = torch.autograd.grad(loss_of_rank(src), list(params.values()))
        for name, grad in zip(params, grads):
            total[name] += grad
    return {
        name: param.detach() - learning_rate * total[name] / world_size
        for name, param in params.items()
    }

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
EmbeddingCollection-specific test helpers for live resharding; the generic
ones (plans, global state gathered with collectives, comparisons) are in
``reshard_utils`` and work on a ShardedEmbeddingCollection as they are.
"""

from typing import Dict, Optional

import torch
from torchrec.distributed.embedding import (
    EmbeddingCollectionSharder,
    ShardedEmbeddingCollection,
)
from torchrec.distributed.test_utils.model_zoo import make_ec  # noqa: F401
from torchrec.distributed.test_utils.reshard_utils import fused_params
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor


def make_ec_sharder(
    optimizer: Optional[str], output_dtensor: bool = False
) -> EmbeddingCollectionSharder:
    """
    Args:
        optimizer (Optional[str]): fused optimizer name (see
            ``reshard_utils.OPTIMIZERS``), or None.
        output_dtensor (bool): ask for DTensor state dicts through the
            ``output_dtensor`` fused param (TorchRec 1.1.0's EC switch) rather
            than through ``ShardingEnv.output_dtensor``.

    Returns:
        EmbeddingCollectionSharder: the sharder.
    """
    fused = fused_params(optimizer)
    if output_dtensor:
        fused["output_dtensor"] = True
    return EmbeddingCollectionSharder(fused_params=fused or None)


def ec_train_step(
    module: ShardedEmbeddingCollection,
    batch: KeyedJaggedTensor,
    dense_optimizer: Optional[torch.optim.Optimizer] = None,
) -> Dict[str, JaggedTensor]:
    """
    One forward/backward (the fused optimizer steps inside backward).

    Returns:
        Dict[str, JaggedTensor]: the sequence embeddings of the forward, detached.
    """
    out: Dict[str, JaggedTensor] = module(batch).wait()
    loss = sum((jt.values().float() ** 2).sum() for jt in out.values())
    # pyre-ignore[16]
    loss.backward()
    if dense_optimizer is not None:
        dense_optimizer.step()
        dense_optimizer.zero_grad()
    return {
        name: JaggedTensor(
            values=jt.values().detach(),
            lengths=jt.lengths().detach(),
            weights=None,
        )
        for name, jt in out.items()
    }


def assert_ec_outputs_equal(
    a: Dict[str, JaggedTensor], b: Dict[str, JaggedTensor]
) -> None:
    """
    Same features, same lengths and values per feature, bit for bit. The order
    of the features follows the module's kernels, which a reshard that keeps
    the storage of unchanged tables groups apart from the others (README, "No
    side effects, and memory"): outputs are compared by key, as for an
    EmbeddingBagCollection's ``KeyedTensor``.
    """
    assert sorted(a.keys()) == sorted(b.keys()), (list(a.keys()), list(b.keys()))
    for name in a:
        x, y = a[name], b[name]
        assert torch.equal(x.lengths(), y.lengths()), name
        assert x.values().dtype == y.values().dtype, name
        assert torch.equal(x.values(), y.values()), (name, x.values(), y.values())

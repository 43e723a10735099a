#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The module surgery of live resharding, one adapter per kind of sharded
embedding module, each in the module named as upstream's module type
(``embeddingbag``: ``ShardedEmbeddingBagCollection``; ``embedding``:
``ShardedEmbeddingCollection``) over the abstract adapter (``base``). This
module is their registry: :func:`adapter_for` finds a module's adapter, so a
third module type plugs in with its adapter module and one entry here.
"""

from typing import List, Tuple, Type

from torch import nn
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.resharding.module_adapters.base import ShardedModuleAdapter
from torchrec.distributed.resharding.module_adapters.embedding import (
    EmbeddingCollectionAdapter,
)
from torchrec.distributed.resharding.module_adapters.embeddingbag import (
    EmbeddingBagCollectionAdapter,
)
from torchrec.distributed.resharding.plan import ReshardError


def _registry() -> List[Tuple[Type[nn.Module], Type[ShardedModuleAdapter]]]:
    """(sharded module type, its adapter) of every module live resharding moves."""
    return [
        (ShardedEmbeddingBagCollection, EmbeddingBagCollectionAdapter),
        (ShardedEmbeddingCollection, EmbeddingCollectionAdapter),
    ]


__all__ = [
    "adapter_for",
    "EmbeddingBagCollectionAdapter",
    "EmbeddingCollectionAdapter",
    "ShardedModuleAdapter",
]


def adapter_for(module: nn.Module) -> ShardedModuleAdapter:
    """
    Args:
        module (nn.Module): a sharded embedding module.

    Returns:
        ShardedModuleAdapter: its adapter.

    Raises:
        ReshardError: for a module live resharding cannot move.
    """
    for module_type, adapter_type in _registry():
        if isinstance(module, module_type):
            return adapter_type(module)
    raise ReshardError(f"a module of type {type(module).__name__} cannot be resharded")

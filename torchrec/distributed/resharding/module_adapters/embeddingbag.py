#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Module surgery for ``ShardedEmbeddingBagCollection`` (pooled embeddings,
upstream's ``torchrec.distributed.embeddingbag``): how its groups are read
and built; it installs them with its own ``_install_sharding_groups``.
"""

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.resharding.module_adapters.base import ShardedModuleAdapter


class EmbeddingBagCollectionAdapter(ShardedModuleAdapter):
    """Module surgery for ``ShardedEmbeddingBagCollection``."""

    def configs(self) -> Sequence[Any]:
        return self.module._embedding_bag_configs

    def groups(self) -> List[Tuple[str, Any, nn.Module]]:
        m = self.module
        return list(zip(m._sharding_types, m._embedding_shardings, m._lookups))

    def sharding_factory(
        self, infos: List[EmbeddingShardingInfo]
    ) -> Callable[..., Any]:
        from torchrec.distributed.embeddingbag import create_embedding_bag_sharding

        return functools.partial(create_embedding_bag_sharding, permute_embeddings=True)

    # the pooled output, a KeyedTensor, is read by position too
    positional_output: bool = True

    def set_output_order(self, order: Optional[List[str]]) -> None:
        if order is not None:
            self.module._set_output_key_order(order)

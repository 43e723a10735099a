#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Module surgery for ``ShardedEmbeddingCollection`` (sequence embeddings,
upstream's ``torchrec.distributed.embedding``): how its groups are read and
built. The reshard itself
is the generic transaction (``reshard``); the module installs the new
groups with its own ``_install_sharding_groups``.
"""

import functools
from typing import Any, Callable, List, Sequence, Tuple

from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.resharding.module_adapters.base import ShardedModuleAdapter


class EmbeddingCollectionAdapter(ShardedModuleAdapter):
    """Module surgery for ``ShardedEmbeddingCollection``."""

    def configs(self) -> Sequence[Any]:
        return self.module._embedding_configs

    def groups(self) -> List[Tuple[str, Any, nn.Module]]:
        m = self.module
        return [
            (sharding_type, sharding, lookup)
            for (sharding_type, sharding), lookup in zip(
                m._sharding_type_to_sharding.items(), m._lookups
            )
        ]

    def sharding_factory(
        self, infos: List[EmbeddingShardingInfo]
    ) -> Callable[..., Any]:
        from torchrec.distributed.embedding import create_embedding_sharding

        # a group holds the tables of one sharding type
        sharding_type = infos[0].param_sharding.sharding_type
        return functools.partial(create_embedding_sharding, sharding_type)

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
Module surgery for live resharding of ``ShardedEmbeddingCollection``
(sequence embeddings).

The reshard itself (validate, agree, build, plan, exchange) is the generic one
in ``install``; this module only says how an EC's groups are built and how the
new ones are swapped in: ``_sharding_type_to_sharding`` (an ordered dict keyed
by sharding type), lookups, output dists, the per-sharding embedding names,
the column-wise local dim and output permutation, the input dists (rebuilt on
the next forward), the combined fused optimizer and the state-dict views.
"""

from collections import OrderedDict
from typing import Any, cast, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.resharding.install import (
    _Groups,
    rebuild_fused_optimizer,
    reshard_sharded_module,
    ReshardReport,
    ShardedModuleAdapter,
)
from torchrec.distributed.sharding.dp_sequence_sharding import (
    DpSequenceEmbeddingSharding,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType


class EmbeddingCollectionAdapter(ShardedModuleAdapter):
    """Module surgery for ``ShardedEmbeddingCollection``."""

    param_prefix = "embeddings."

    def configs(self) -> Sequence[Any]:
        return self.module._embedding_configs

    def groups(self) -> List[Tuple[str, Any, nn.Module, nn.Module]]:
        m = self.module
        return [
            (sharding_type, sharding, lookup, output_dist)
            for (sharding_type, sharding), lookup, output_dist in zip(
                m._sharding_type_to_sharding.items(), m._lookups, m._output_dists
            )
        ]

    def create_sharding(
        self,
        infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device],
    ) -> Any:
        from torchrec.distributed.embedding import create_embedding_sharding

        return create_embedding_sharding(
            sharding_type=infos[0].param_sharding.sharding_type,
            sharding_infos=infos,
            env=env,
            device=device,
            qcomm_codecs_registry=self.module.qcomm_codecs_registry,
        )

    def is_data_parallel(self, sharding: Any) -> bool:
        return isinstance(sharding, DpSequenceEmbeddingSharding)

    def swap(
        self, groups: _Groups, changed_sharding_params: Mapping[str, ParameterSharding]
    ) -> None:
        module = self.module
        module.sharding_type_to_sharding_infos = groups.infos
        module._sharding_type_to_sharding = OrderedDict(
            zip(groups.infos.keys(), groups.shardings)
        )
        module._lookups = groups.lookups
        for table, ps in changed_sharding_params.items():
            module.module_sharding_plan[table] = ps

        module._output_dists = groups.kept_output_dists
        module._update_output_dist()

        # What the output awaitable and compute() read, as __init__ builds it.
        module._embedding_names_per_sharding = [
            sharding.embedding_names()
            for sharding in module._sharding_type_to_sharding.values()
        ]
        module._local_embedding_dim = module._embedding_dim
        module._features_to_permute_indices = {}
        cw = module._sharding_type_to_sharding.get(ShardingType.COLUMN_WISE.value)
        if cw is not None:
            # CW partition must be the same for all CW sharded tables.
            module._local_embedding_dim = cast(
                ShardMetadata, cw.embedding_shard_metadata()[0]
            ).shard_sizes[1]
            module._generate_permute_indices_per_feature(
                module._embedding_configs, module.module_sharding_plan
            )

        # Input dists, feature splits and order are rebuilt on the next forward.
        module._input_dists = []
        module._feature_splits = []
        module._features_order = []
        module._has_uninitialized_input_dist = True
        module._inverse_indices_permute_per_sharding = None

        rebuild_fused_optimizer(module, groups.new_lookups, self.param_prefix)
        module._initialize_torch_state(skip_registering=True)


def reshard_embedding_collection(
    module: nn.Module,
    changed_sharding_params: Mapping[str, ParameterSharding],
    env: ShardingEnv,
    device: Optional[torch.device] = None,
    max_inflight_bytes: Optional[int] = None,
) -> ReshardReport:
    """
    Reshards a ``ShardedEmbeddingCollection`` in place (see
    :func:`torchrec.distributed.resharding.install.reshard_sharded_module`).

    Args:
        module (ShardedEmbeddingCollection): the module.
        changed_sharding_params (Mapping[str, ParameterSharding]): the new
            ParameterSharding of each table that changes; the same on every rank.
        env (ShardingEnv): the module's sharding environment.
        device (Optional[torch.device]): the module's device.
        max_inflight_bytes (Optional[int]): cap on the exchange buffers per rank.

    Returns:
        ReshardReport: what this rank did.

    Raises:
        ReshardError: on every rank, before any data moves, for a bad request.
    """
    return reshard_sharded_module(
        EmbeddingCollectionAdapter(module),
        changed_sharding_params,
        env,
        device,
        max_inflight_bytes,
    )

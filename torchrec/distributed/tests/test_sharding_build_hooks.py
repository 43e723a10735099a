#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Sharding build hooks (2 gloo ranks): ``table_fused_params`` decides which
tables share a batched kernel (through their ``_batch_key``), and
``sharded_tensors_from_metadata`` turns on upstream's own switch,
``_construct_sharded_tensor_from_metadata``, for the modules built under the
hooks only: a ``ShardedEmbeddingBagCollection`` then makes its ShardedTensors
from its plan (no gather), with the same state dict for a plan that lists
every table's shards in rank order. Without hooks nothing changes, and nothing
global changes while they are in effect.
"""

import os
import unittest
from typing import Any, Dict, List
from unittest import mock

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed import global_settings
from torchrec.distributed.embedding_types import (
    sharding_build_hooks,
    ShardingBuildHooks,
)
from torchrec.distributed.resharding.kernel_state import batched_kernels
from torchrec.distributed.test_utils.reshard_utils import (
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    make_ebc,
    make_plan,
    make_sharder,
    ReshardTestBase,
    shard,
)

# every table-wise table on rank 0; t4 column-wise, t5 row-wise (both with
# their shards listed in rank order)
SPECS: Dict[str, Any] = {
    "t0": ("table_wise", 0),
    "t1": ("table_wise", 0),
    "t2": ("table_wise", 0),
    "t3": ("table_wise", 0),
    "t4": ("column_wise", [0, 1]),
    "t5": ("row_wise", None),
}

# the process-wide switch upstream reads for every module (torchrec 1.1.0; on
# 1.8.0 modules always make their ShardedTensors from the plan)
_ENV = "TORCHREC_CONSTRUCT_SHARDED_TENSOR_FROM_METADATA"
_UPSTREAM_SWITCH: bool = hasattr(
    global_settings, "construct_sharded_tensor_from_metadata_enabled"
)


class _Hooks(ShardingBuildHooks):
    """Gives t0 and t2 a batch key of their own; ShardedTensors from the plan."""

    def __init__(self) -> None:
        self.seen: List[str] = []

    def table_fused_params(
        self, table: str, param: torch.Tensor, fused_params: Dict[str, Any]
    ) -> Dict[str, Any]:
        self.seen.append(table)
        if table not in ("t0", "t2"):
            return fused_params
        return {**fused_params, "_batch_key": "apart"}

    def sharded_tensors_from_metadata(self) -> bool:
        return True


def _kernel_tables(module: nn.Module) -> List[List[str]]:
    return sorted(
        [t.name for t in batched.config.embedding_tables]
        for lookup in module._lookups
        for batched in batched_kernels(lookup)
    )


def _run_hooks(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        env, device = context.env, context.device
        ebc = make_ebc(6, dims=[8] * 6)
        plan = make_plan(ebc, SPECS, world_size, world_size, "fused")
        sharder = make_sharder("rowwise_adagrad")
        environ = dict(os.environ)

        hooks = _Hooks()
        gather = mock.patch.object(
            ShardedTensor,
            "_init_from_local_shards",
            side_effect=ShardedTensor._init_from_local_shards,
        )
        with gather as gathered, sharding_build_hooks(hooks):
            hooked = shard(ebc, sharder, plan, env, device)
        hooked_gathers = gathered.call_count
        assert sorted(hooks.seen) == sorted(SPECS), hooks.seen
        # nothing global changed: no environment variable, and the module
        # built afterwards (below) is built as without hooks
        assert dict(os.environ) == environ and _ENV not in os.environ
        with gather as gathered:
            plain = shard(ebc, sharder, plan, env, device)
        plain_gathers = gathered.call_count

        # t0 and t2 get a kernel of their own; nothing else changes
        if rank == 0:
            assert ["t0", "t1", "t2", "t3"] in _kernel_tables(plain)
            assert ["t0", "t2"] in _kernel_tables(hooked)
            assert ["t1", "t3"] in _kernel_tables(hooked)
        else:
            assert _kernel_tables(plain) == _kernel_tables(hooked)
        if _UPSTREAM_SWITCH:
            # the hooks feed upstream's own switch, of the module built under
            # them only: it makes its ShardedTensors without a gather
            assert not global_settings.construct_sharded_tensor_from_metadata_enabled()
            assert hooked._construct_sharded_tensor_from_metadata is True
            assert plain._construct_sharded_tensor_from_metadata is False
            assert hooked_gathers == 0, hooked_gathers
            assert plain_gathers == len(SPECS), plain_gathers  # one per table
        else:
            # no switch: every module makes its ShardedTensors from the plan
            assert not hasattr(plain, "_construct_sharded_tensor_from_metadata")
            assert hooked_gathers == plain_gathers == 0
        # the same state dict, shard metadata in the same order
        assert_state_dicts_equal(plain.state_dict(), hooked.state_dict())


class ShardingBuildHooksTest(ReshardTestBase):
    def test_table_fused_params_and_sharded_tensors_from_metadata(self) -> None:
        self.run_ranks(_run_hooks, world_size=2)


if __name__ == "__main__":
    unittest.main()

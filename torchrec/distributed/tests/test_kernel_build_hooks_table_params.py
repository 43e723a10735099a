#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Kernel build hooks that reach the sharded modules (2 gloo ranks):
``table_fused_params`` decides which tables share a batched kernel (through
their ``_batch_key``), and ``sharded_tensors_from_plan`` makes a
``ShardedEmbeddingBagCollection``'s ShardedTensors from its plan, where that
gives the same state dict as gathering every rank's shards. Without hooks
nothing changes.
"""

import unittest
from typing import Any, Dict, List

import torch
from torch import nn
from torchrec.distributed.batched_embedding_kernel import (
    kernel_build_hooks,
    KernelBuildHooks,
)
from torchrec.distributed.resharding.kernel_state import batched_kernels
from torchrec.distributed.test_utils.reshard_utils import (
    assert_state_dicts_equal,
    make_ebc,
    make_plan,
    make_sharder,
    process_group,
    ReshardTestBase,
    shard,
)
from torchrec.distributed.types import ShardingEnv

# every table-wise table on rank 0; t4 column-wise with its shards listed
# against rank order, t5 row-wise
SPECS: Dict[str, Any] = {
    "t0": ("table_wise", 0),
    "t1": ("table_wise", 0),
    "t2": ("table_wise", 0),
    "t3": ("table_wise", 0),
    "t4": ("column_wise", [1, 0]),
    "t5": ("row_wise", None),
}


class _Hooks(KernelBuildHooks):
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

    def sharded_tensors_from_plan(self) -> bool:
        return True


def _kernel_tables(module: nn.Module) -> List[List[str]]:
    return sorted(
        [t.name for t in batched.config.embedding_tables]
        for lookup in module._lookups
        for batched in batched_kernels(lookup)
    )


def _run_hooks(rank: int, world_size: int, port: str) -> None:
    with process_group(rank, world_size, port) as (pg, device):
        env = ShardingEnv.from_process_group(pg)
        ebc = make_ebc(6, dims=[8] * 6)
        plan = make_plan(ebc, SPECS, world_size, world_size, "fused")
        sharder = make_sharder("rowwise_adagrad")

        plain = shard(ebc, sharder, plan, env, device)
        hooks = _Hooks()
        with kernel_build_hooks(hooks):
            hooked = shard(ebc, sharder, plan, env, device)
        assert sorted(hooks.seen) == sorted(SPECS), hooks.seen

        # t0 and t2 get a kernel of their own; nothing else changes
        if rank == 0:
            assert ["t0", "t1", "t2", "t3"] in _kernel_tables(plain)
            assert ["t0", "t2"] in _kernel_tables(hooked)
            assert ["t1", "t3"] in _kernel_tables(hooked)
        else:
            assert _kernel_tables(plain) == _kernel_tables(hooked)
        # the same state dict, shard metadata in the same order: t4's from the
        # gathered shards (listed against rank order), the others' from the plan
        assert hooked._sharded_tensors_from_plan
        assert not plain._sharded_tensors_from_plan
        assert_state_dicts_equal(plain.state_dict(), hooked.state_dict())


class KernelBuildHooksTest(ReshardTestBase):
    def test_table_fused_params_and_sharded_tensors_from_plan(self) -> None:
        self.run_ranks(_run_hooks, world_size=2)


if __name__ == "__main__":
    unittest.main()

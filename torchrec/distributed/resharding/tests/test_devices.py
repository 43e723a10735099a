#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Devices right everywhere, in one process: a rank's new shards must be placed
on its own ``cuda:<index>`` (validation, for a reshard and for a move's new
plan); a move exchanges on its participants' device when they all have one of
the same type, else on the host, whose buffers for CUDA tensors are pinned
(and never given back with madvise); dense tensors are broadcast in buffers
on the exchange group's device; the seed API's new shards of a rank that held
none live where it received, never on a device of another rank's placement.
"""

import unittest
from types import SimpleNamespace
from typing import Any, List

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import (
    ShardedTensor,
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding.elastic_plan import (
    DenseSpec,
    exchange_device_type,
    validate_new_plan,
)
from torchrec.distributed.resharding.exchange import broadcast_dense
from torchrec.distributed.resharding.memory import pinned_staging
from torchrec.distributed.resharding.plan import ReshardError
from torchrec.distributed.resharding.plan_validation import validate_parameter_sharding
from torchrec.distributed.sharding.dynamic_sharding import _new_shard_device
from torchrec.distributed.test_utils.plan_layouts import sharding_by_hand
from torchrec.distributed.types import ShardingPlan

FUSED = EmbeddingComputeKernel.FUSED.value
CUDA0 = torch.device("cuda", 0)


def _cw_on_gpus(devices: List[str]) -> Any:
    """Two column shards of a 10x16 table on ranks 0 and 1, on ``devices``."""
    ps = sharding_by_hand(
        "column_wise", [(0, 0, 10, 8, 0), (0, 8, 10, 8, 1)], kernel=FUSED
    )
    for metadata, device in zip(ps.sharding_spec.shards, devices):
        metadata.placement = torch.distributed._remote_device(device)
    return ps


class PlacementIndexTest(unittest.TestCase):
    def test_a_ranks_shard_must_be_on_its_own_device(self) -> None:
        ps = _cw_on_gpus(["rank:0/cuda:0", "rank:1/cuda:1"])
        for rank in (0, 1):
            validate_parameter_sharding("t", ps, 10, 16, 2, "cuda", rank, rank)
        with self.assertRaisesRegex(
            ReshardError, r"table 't'.*rank:1/cuda:1 is not on rank 1's device cuda:0"
        ):
            validate_parameter_sharding("t", ps, 10, 16, 2, "cuda", 1, 0)
        # a placement kept from another rank (a relabelled plan gone wrong)
        swapped = _cw_on_gpus(["rank:0/cuda:1", "rank:1/cuda:0"])
        with self.assertRaisesRegex(ReshardError, "not on rank 0's device cuda:0"):
            validate_parameter_sharding("t", swapped, 10, 16, 2, "cuda", 0, 0)
        # without a rank (or on CPU) only the device type is checked
        validate_parameter_sharding("t", swapped, 10, 16, 2, "cuda")

    def test_a_moves_new_plan_is_checked_on_the_ranks_device(self) -> None:
        plan = ShardingPlan(
            {"ebc": {"t": _cw_on_gpus(["rank:0/cuda:1", "rank:1/cuda:1"])}}
        )
        tables = {"ebc": [("t", 10, 16)]}
        validate_new_plan(plan, tables, 2, "cuda", 1, 1)
        with self.assertRaisesRegex(ReshardError, "module 'ebc': table 't'.*cuda:0"):
            validate_new_plan(plan, tables, 2, "cuda", 0, 0)


class ExchangeDeviceTest(unittest.TestCase):
    def test_a_move_exchanges_on_the_device_only_when_every_rank_has_one(
        self,
    ) -> None:
        self.assertEqual(exchange_device_type(["cuda", "cuda", "cuda"]), "cuda")
        self.assertEqual(exchange_device_type(["cuda", "cpu"]), "cpu")
        self.assertEqual(exchange_device_type(["cpu", "cpu"]), "cpu")

    def test_host_buffers_for_cuda_tensors_are_pinned(self) -> None:
        cpu = torch.device("cpu")
        self.assertTrue(pinned_staging(cpu, [cpu, CUDA0]))
        self.assertFalse(pinned_staging(cpu, [cpu]))
        self.assertFalse(pinned_staging(CUDA0, [CUDA0]))  # NCCL: on the GPU
        self.assertFalse(pinned_staging(cpu, []))

    def test_dense_tensors_travel_in_buffers_on_the_groups_device(self) -> None:
        seen: List[torch.device] = []
        group = SimpleNamespace(
            device=torch.device("meta"),
            broadcast=lambda buffer, src: seen.append(buffer.device),
        )
        source = {"a": torch.ones(2, 3), "b": torch.zeros(4)}
        specs = [
            DenseSpec("a", (2, 3), torch.float32),
            DenseSpec("b", (4,), torch.float32),
        ]
        sent = broadcast_dense(specs, source, None, 0, group)  # pyre-ignore[6]
        self.assertEqual(sent, 40)
        self.assertEqual(seen, [torch.device("meta")])


class SeedApiDeviceTest(unittest.TestCase):
    def test_a_rank_without_shards_allocates_where_it_received(self) -> None:
        # a two-rank world in this process (no communication): rank 0 holds
        # no shard of a table placed on rank 1's GPU
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        try:
            metadata = ShardedTensorMetadata(
                [ShardMetadata([0, 0], [4, 3], "rank:1/cuda:1")],
                torch.Size([4, 3]),
                TensorProperties(dtype=torch.float32),
            )
            value = ShardedTensor._init_from_local_shards_and_global_metadata(
                [], metadata
            )
            here = torch.device("cpu")
            self.assertEqual(_new_shard_device(value, here), here)
        finally:
            dist.destroy_process_group()
        plain = torch.zeros(2, device="meta")
        self.assertEqual(_new_shard_device(plain, torch.device("cpu")).type, "meta")


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
ShardingEnv on a sub-group of the world: its device mesh is the group itself
(the group's global ranks, the group object), and building it creates no
process group, so torch's group counter stays in step on every rank. Two
ranks, each in a group of its own: on rank 1 group rank 0 is global rank 1.
"""

import unittest
from datetime import timedelta

import torch
import torch.distributed as dist
from torchrec.distributed.test_utils.multi_process_utils import (
    alone_on_subgroups,
    MultiRankTestBase,
)
from torchrec.distributed.types import ShardingEnv

TIMEOUT: timedelta = timedelta(seconds=30)


def _device_mesh_on_subgroup(rank: int, world_size: int, port: str) -> None:
    with alone_on_subgroups(rank, world_size, port, TIMEOUT) as env:
        pg = env.process_group
        mesh = env.device_mesh
        assert mesh is not None
        assert mesh.mesh.tolist() == [rank], mesh
        assert mesh.get_group() is pg
        assert mesh.size() == 1
        # A group created now, by every rank, works on every rank.
        group = dist.new_group(list(range(world_size)), timeout=TIMEOUT)
        value = torch.tensor([1.0])
        dist.all_reduce(value, group=group)
        assert value.item() == world_size, value
        # On the default group the mesh is the whole world, as before.
        world_mesh = ShardingEnv.from_process_group(dist.group.WORLD).device_mesh
        assert world_mesh is not None
        assert world_mesh.mesh.tolist() == list(range(world_size)), world_mesh


class SubgroupDeviceMeshTest(MultiRankTestBase):
    def test_device_mesh_is_the_group(self) -> None:
        self.run_ranks(_device_mesh_on_subgroup, 2)


if __name__ == "__main__":
    unittest.main()

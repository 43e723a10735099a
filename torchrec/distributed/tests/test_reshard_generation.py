#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The reshard generation of sharded embedding modules: every reshard that
installs new sharding groups increments it, for whoever keeps state derived
from the old groups (a train pipeline's input dists in flight); an empty
request and a refused one leave it as it is. For an EmbeddingBagCollection
and an EmbeddingCollection on 2 gloo ranks.
"""

import unittest
from typing import Any, Dict

from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.resharding import ReshardError
from torchrec.distributed.test_utils.reshard_ec_utils import make_ec, make_ec_sharder
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import (
    delta,
    make_ebc,
    make_sharder,
    ReshardTestBase,
    TableSpec,
)

FUSED: str = "fused"
PLAN_A: Dict[str, TableSpec] = {"t0": ("table_wise", 0), "t1": ("table_wise", 1)}
PLAN_B: Dict[str, TableSpec] = {"t0": ("table_wise", 1), "t1": ("table_wise", 1)}


def _generations(rank: int, world_size: int, port: str, kind: str) -> None:
    unsharded: nn.Module
    sharder: Any
    if kind == "ebc":
        unsharded, sharder = make_ebc(2), make_sharder("sgd")
    else:
        unsharded, sharder = make_ec(2), make_ec_sharder("sgd")
    with reshard_scenario(
        rank, world_size, port, unsharded=unsharded, sharder=sharder
    ) as scenario:
        env, device = scenario.env, scenario.device
        plan_a, plan_b = scenario.plans([PLAN_A, PLAN_B])
        if isinstance(sharder, EmbeddingCollectionSharder):
            module = sharder.shard(unsharded, plan_a, env, device)
        else:
            module = scenario.shard(plan_a)
        assert module.reshard_generation == 0

        sharder.reshard(module, delta(plan_a, plan_b), env, device)
        assert module.reshard_generation == 1
        sharder.reshard(module, {}, env, device)  # changes nothing
        assert module.reshard_generation == 1
        try:
            sharder.reshard(module, {"no_such_table": plan_b["t0"]}, env, device)
        except ReshardError:
            pass
        else:
            raise AssertionError("a request for an unknown table went through")
        assert module.reshard_generation == 1
        sharder.reshard(module, delta(plan_b, plan_a), env, device)
        assert module.reshard_generation == 2


class ReshardGenerationTest(ReshardTestBase):
    def test_ebc_generation(self) -> None:
        self.run_ranks(_generations, 2, kind="ebc")

    def test_ec_generation(self) -> None:
        self.run_ranks(_generations, 2, kind="ec")


if __name__ == "__main__":
    unittest.main()

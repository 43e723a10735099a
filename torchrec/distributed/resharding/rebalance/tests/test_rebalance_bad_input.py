#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The Rebalancer's refusals that need a model (one rank, in this process): a
move budget below the smallest shard of the model, a topology of another
size, something else than a topology (a planner: its settings are given as
arguments, never read from it), a policy of another type, a state factor
below one.
"""

import unittest

from torchrec.distributed.planner import Topology
from torchrec.distributed.resharding.rebalance.policy import RebalancePolicy
from torchrec.distributed.resharding.rebalance.rebalancer import Rebalancer
from torchrec.distributed.test_utils.rebalance_utils import (
    cpu_topology,
    one_rank_rebalance_model,
)

NUM_TABLES, ROWS, DIM, BATCH = 3, 32, 8, 5


class RebalancerBadInputTest(unittest.TestCase):
    def test_rebalancer_refuses_bad_budget_and_topology(self) -> None:
        with one_rank_rebalance_model(NUM_TABLES, ROWS, DIM, BATCH) as (
            model,
            planner,
        ):
            smallest = ROWS * DIM * 4
            topology = cpu_topology(1)
            with self.assertRaisesRegex(ValueError, "below the smallest shard"):
                Rebalancer(
                    model, topology, RebalancePolicy(move_budget_bytes=smallest - 1)
                )
            Rebalancer(
                model, topology, RebalancePolicy(move_budget_bytes=smallest)
            ).close()
            with self.assertRaisesRegex(ValueError, "topology has 2 ranks"):
                Rebalancer(model, Topology(world_size=2, compute_device="cpu"))
            with self.assertRaisesRegex(ValueError, "must be a planner Topology"):
                Rebalancer(model, planner)  # pyre-ignore[6]
            with self.assertRaisesRegex(ValueError, "must be a RebalancePolicy"):
                Rebalancer(model, topology, {"window": 5})  # pyre-ignore[6]
            with self.assertRaisesRegex(ValueError, "state_factor must be >= 1"):
                Rebalancer(model, topology, state_factor=0.5)


if __name__ == "__main__":
    unittest.main()

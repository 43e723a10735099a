#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The window's statistics live in ``rebalance.statistics``; ``rebalance.load``
still gives the same objects under the old names. A reduced vector becomes
per-table pooling factors and per-rank times, and its digest tells two
vectors apart.
"""

import unittest

from torchrec.distributed.resharding.rebalance import load, statistics
from torchrec.distributed.resharding.rebalance.statistics import (
    feature_slots,
    RANK_FIELDS,
    statistics_from_vector,
)
from torchrec.distributed.test_utils.rebalance_utils import LOAD_STATISTICS_NAMES

MODULES = [("m", [("t0", ["f0"]), ("t1", ["f1", "f2"])])]


def _vector(ids: float, world: int = 2, steps: float = 4.0) -> list:
    slots = feature_slots(MODULES)
    samples = 32.0 * steps * world
    vector = [ids * samples * (i + 1) for i in range(len(slots))]
    vector += [samples] * len(slots)
    for name in RANK_FIELDS:
        vector += [
            steps if name == "steps" else 0.01 * steps * (r + 1) for r in range(world)
        ]
    return vector


class StatisticsModuleTest(unittest.TestCase):
    def test_the_old_module_gives_the_same_objects(self) -> None:
        for name in LOAD_STATISTICS_NAMES:
            self.assertIs(getattr(load, name), getattr(statistics, name), name)

    def test_a_reduced_vector_becomes_statistics(self) -> None:
        slots = feature_slots(MODULES)
        self.assertEqual(
            [(s.path, s.feature, s.tables) for s in slots],
            [("m", "f0", ("t0",)), ("m", "f1", ("t1",)), ("m", "f2", ("t1",))],
        )
        stats = statistics_from_vector(_vector(2.0), slots, MODULES, 2)
        self.assertEqual(stats.steps, 4)
        self.assertEqual(stats.table("m", "t0").pooling_factors, (2.0,))
        self.assertEqual(stats.table("m", "t1").pooling_factors, (4.0, 6.0))
        self.assertEqual([round(x, 12) for x in stats.compute_seconds], [0.01, 0.02])
        again = statistics_from_vector(_vector(2.0), slots, MODULES, 2)
        other = statistics_from_vector(_vector(3.0), slots, MODULES, 2)
        self.assertEqual(stats.digest(), again.digest())
        self.assertNotEqual(stats.digest(), other.digest())

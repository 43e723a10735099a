#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The plan deltas TorchRec's reshard API takes (``output_sharding_plan_delta_single``,
``output_sharding_plans_delta`` in ``sharding/dynamic_sharding.py``), against
plans built by TorchRec's own plan helpers and differences written out by hand.
"""

import unittest

from torchrec.distributed.sharding.dynamic_sharding import (
    output_sharding_plan_delta_single,
    output_sharding_plans_delta,
)
from torchrec.distributed.test_utils.reshard_utils import make_ebc, make_plan, TW_CW_RW
from torchrec.distributed.types import EmbeddingModuleShardingPlan

WORLD_SIZE = 4


def _mib(elements: int) -> float:
    """The data volume TorchRec's reshard API reports: MiB at 4 bytes each."""
    return elements * 4 / (1024 * 1024)


def _plan(specs: dict) -> EmbeddingModuleShardingPlan:  # pyre-ignore[24]
    return make_plan(make_ebc(3), specs, WORLD_SIZE, WORLD_SIZE, "fused")


# rows of t0, t1, t2 in make_ebc(3): 24, 27, 30; 16 columns each
A = dict(TW_CW_RW)


class PlanDeltaTest(unittest.TestCase):
    def test_same_plan_has_an_empty_delta(self) -> None:
        volume, delta = output_sharding_plan_delta_single(
            _plan(A), _plan(A), return_data_volume=True
        )
        self.assertEqual(dict(delta), {})
        self.assertEqual(volume, 0.0)

    def test_table_wise_move(self) -> None:
        old, new = _plan(A), _plan({**A, "t0": ("table_wise", 3)})
        volume, delta = output_sharding_plan_delta_single(
            old, new, return_data_volume=True
        )
        self.assertIsInstance(delta, EmbeddingModuleShardingPlan)
        self.assertEqual(list(delta), ["t0"])
        self.assertEqual(delta["t0"], new["t0"])
        self.assertIsNot(delta["t0"], new["t0"])  # a copy: the caller's plan stays
        self.assertEqual(volume, _mib(24 * 16))
        # without return_data_volume the volume is 0
        self.assertEqual(output_sharding_plan_delta_single(old, new)[0], 0.0)

    def test_column_wise_shards_swap_ranks(self) -> None:
        old, new = _plan(A), _plan({**A, "t1": ("column_wise", [1, 0])})
        volume, delta = output_sharding_plan_delta_single(
            old, new, return_data_volume=True
        )
        self.assertEqual(list(delta), ["t1"])
        self.assertEqual(volume, _mib(27 * 16))  # every shard of t1

    def test_type_change_and_kernel_change(self) -> None:
        old = _plan(A)
        new = _plan({**A, "t2": ("table_wise", 1)})
        _, delta = output_sharding_plan_delta_single(old, new)
        self.assertEqual(list(delta), ["t2"])
        dense = make_plan(make_ebc(3), A, WORLD_SIZE, WORLD_SIZE, "dense")
        _, delta = output_sharding_plan_delta_single(old, dense)
        self.assertEqual(sorted(delta), ["t0", "t1", "t2"])

    def test_different_tables_are_refused(self) -> None:
        old = _plan(A)
        new = _plan({"t0": ("table_wise", 0), "t1": ("table_wise", 1)})
        with self.assertRaisesRegex(ValueError, "different tables"):
            output_sharding_plan_delta_single(old, new)

    def test_plans_delta_covers_every_module(self) -> None:
        old = {"a": _plan(A), "b": _plan(A)}
        new = {"a": _plan({**A, "t0": ("table_wise", 2)}), "b": _plan(A)}
        deltas = output_sharding_plans_delta(old, new, return_data_volume=True)
        self.assertEqual(sorted(deltas), ["a", "b"])
        self.assertEqual(deltas["a"][0], _mib(24 * 16))
        self.assertEqual(list(deltas["a"][1]), ["t0"])
        self.assertEqual(deltas["b"], (0.0, EmbeddingModuleShardingPlan()))
        with self.assertRaisesRegex(ValueError, "different modules"):
            output_sharding_plans_delta(old, {"a": new["a"]})


if __name__ == "__main__":
    unittest.main()

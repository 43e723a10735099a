#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
CombinedOptimizer.set_optimizers(): the optimizers a CombinedOptimizer
combines are replaced in place, so that whoever holds it (a model-level
CombinedOptimizer) sees the new ones, with the constructor's checks.
"""

import unittest
from typing import Dict

import torch
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper


def _sgd(names: Dict[str, float]) -> KeyedOptimizerWrapper:
    """A keyed SGD over one parameter per name, each filled with its value."""
    params = {
        name: torch.nn.Parameter(torch.full((2,), value))
        for name, value in names.items()
    }
    return KeyedOptimizerWrapper(
        params, lambda p: torch.optim.SGD(p, lr=1.0)  # pyre-ignore[6]
    )


class SetOptimizersTest(unittest.TestCase):
    def test_replaces_the_optimizers_in_place(self) -> None:
        inner = CombinedOptimizer([("m", _sgd({"a": 1.0, "b": 2.0}))])
        outer = CombinedOptimizer([inner])
        new = _sgd({"c": 3.0})
        inner.set_optimizers([("m", new)])
        self.assertEqual(list(inner.params), ["m.c"])
        # the holder sees the new optimizer: keys, params and steps
        self.assertEqual(list(outer.params), ["m.c"])
        self.assertEqual(len(outer.param_groups), 1)
        param = new.params["c"]
        param.grad = torch.ones_like(param)
        outer.step()
        self.assertTrue(torch.equal(param.detach(), torch.full((2,), 2.0)))

    def test_plain_keyed_optimizers_get_an_empty_key(self) -> None:
        combined = CombinedOptimizer([])
        combined.set_optimizers([_sgd({"a": 1.0}), ("k", _sgd({"b": 2.0}))])
        self.assertEqual(list(combined.params), ["a", "k.b"])
        self.assertEqual([key for key, _ in combined.optimizers], ["", "k"])

    def test_duplicate_keys_are_refused_and_nothing_changes(self) -> None:
        combined = CombinedOptimizer([_sgd({"a": 1.0})])
        with self.assertRaisesRegex(ValueError, "Duplicate param key a"):
            combined.set_optimizers([_sgd({"a": 1.0}), _sgd({"a": 2.0})])
        self.assertEqual(list(combined.params), ["a"])
        self.assertEqual(len(combined.optimizers), 1)

    def test_constructor_uses_the_same_checks(self) -> None:
        with self.assertRaisesRegex(ValueError, "Duplicate param key k.a"):
            CombinedOptimizer([("k", _sgd({"a": 1.0})), ("k", _sgd({"a": 2.0}))])


if __name__ == "__main__":
    unittest.main()

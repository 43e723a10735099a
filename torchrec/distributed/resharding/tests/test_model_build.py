#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
``model_build.module_tree`` puts modules at their dotted paths under empty
parents (what the planner's definition of a model and the replan process's
rebuilt definition are made of); a lone module at "" is the model itself.
"""

import unittest

from torch import nn
from torchrec.distributed.resharding.model_build import module_tree


class ModuleTreeTest(unittest.TestCase):
    def test_modules_stand_at_their_paths_under_empty_parents(self) -> None:
        modules = {
            "model.sparse.ebc": nn.Linear(1, 1),
            "model.sparse.ec": nn.Linear(2, 2),
            "other": nn.Linear(3, 3),
        }
        tree = module_tree(modules)
        for path, module in modules.items():
            self.assertIs(tree.get_submodule(path), module)
        self.assertEqual(
            [name for name, _ in tree.named_modules()],
            [
                "",
                "model",
                "model.sparse",
                "model.sparse.ebc",
                "model.sparse.ec",
                "other",
            ],
        )
        for parent in ("model", "model.sparse"):
            self.assertIs(type(tree.get_submodule(parent)), nn.Module)
            self.assertEqual(list(tree.get_submodule(parent).parameters(False)), [])

    def test_a_module_at_the_root_is_the_model(self) -> None:
        module = nn.Linear(1, 1)
        self.assertIs(module_tree({"": module}), module)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Modules renamed for what they hold keep their old names for a release: an
import of the old name warns (``DeprecationWarning``, naming the new
module) and gives the very objects of the new one.
"""

import ast
import importlib
import sys
import unittest
from pathlib import Path
from typing import Dict, Tuple

#: old module -> (new module, the names the old one still gives)
RENAMED: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "transaction": ("reshard", ("ModuleReshard", "reshard_module", "ReshardOptions")),
    "adapters": (
        "module_adapters",
        (
            "adapter_for",
            "EmbeddingBagCollectionAdapter",
            "EmbeddingCollectionAdapter",
            "ShardedModuleAdapter",
        ),
    ),
    "install": (
        "module_adapters",
        ("EmbeddingBagCollectionAdapter", "ShardedModuleAdapter"),
    ),
    "install_ec": ("module_adapters", ("EmbeddingCollectionAdapter",)),
    "wire": (
        "exchange_group",
        ("ExchangeGroup", "Message", "open_exchange_group"),
    ),
}

PACKAGE = "torchrec.distributed.resharding"


class DeprecatedModuleNamesTest(unittest.TestCase):
    def test_an_old_name_warns_and_gives_the_new_modules_objects(self) -> None:
        for old, (new, names) in RENAMED.items():
            with self.subTest(old=old):
                sys.modules.pop(f"{PACKAGE}.{old}", None)
                with self.assertWarnsRegex(DeprecationWarning, f"{PACKAGE}.{new}"):
                    shim = importlib.import_module(f"{PACKAGE}.{old}")
                target = importlib.import_module(f"{PACKAGE}.{new}")
                for name in names:
                    self.assertIs(getattr(shim, name), getattr(target, name), name)

    def test_no_module_of_the_fork_imports_an_old_name(self) -> None:
        root = Path(importlib.import_module("torchrec.distributed").__file__).parent
        shims = {root / "resharding" / f"{old}.py" for old in RENAMED}
        olds = {f"{PACKAGE}.{old}" for old in RENAMED}
        found = []
        for path in sorted(root.rglob("*.py")):
            if path in shims:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    named = {f"{node.module}.{a.name}" for a in node.names}
                    if node.module in olds or named & olds:
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
                elif isinstance(node, ast.Import):
                    if {a.name for a in node.names} & olds:
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
        self.assertEqual(found, [])


if __name__ == "__main__":
    unittest.main()

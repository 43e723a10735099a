#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Each adapter creates a group's sharding with its module's own TorchRec
function: ``create_sharding`` (written once, in the base) calls it with the
group's tables, environment, device and the module's codecs, plus what the
module type needs (the EC's sharding type, the EBC's permuted embeddings).
TorchRec's functions are replaced by recording doubles here: the calls are
compared with the ones each module type must make.
"""

import unittest
from types import SimpleNamespace
from typing import Any, Dict, List
from unittest import mock

import torch
from torch import nn
from torchrec.distributed.resharding.module_adapters import (
    EmbeddingBagCollectionAdapter,
    EmbeddingCollectionAdapter,
)


def _module(codecs: Dict[str, Any]) -> nn.Module:
    """A stand-in for a sharded module: all the call reads is its codecs."""
    module = nn.Module()
    module.qcomm_codecs_registry = codecs  # pyre-ignore[16]
    return module


def _infos(sharding_type: str) -> List[Any]:
    """A group's sharding infos, as far as the adapters read them."""
    return [
        SimpleNamespace(param_sharding=SimpleNamespace(sharding_type=sharding_type))
    ] * 2


class CreateShardingTest(unittest.TestCase):
    def test_each_adapter_calls_its_modules_torchrec_function(self) -> None:
        codecs = {"codec": "of this module"}
        device = torch.device("cpu")
        cases = [
            (
                EmbeddingBagCollectionAdapter,
                "torchrec.distributed.embeddingbag.create_embedding_bag_sharding",
                (),
                {"permute_embeddings": True},
            ),
            (
                EmbeddingCollectionAdapter,
                "torchrec.distributed.embedding.create_embedding_sharding",
                ("column_wise",),
                {},
            ),
        ]
        for adapter, function, args, kwargs in cases:
            with self.subTest(adapter=adapter.__name__):
                module, infos, env = _module(codecs), _infos("column_wise"), object()
                with mock.patch(function, autospec=True) as create:
                    sharding = adapter(module).create_sharding(
                        infos, env, device  # pyre-ignore[6]
                    )
                self.assertIs(sharding, create.return_value)
                create.assert_called_once_with(
                    *args,
                    sharding_infos=infos,
                    env=env,
                    device=device,
                    qcomm_codecs_registry=codecs,
                    **kwargs,
                )


if __name__ == "__main__":
    unittest.main()

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
from typing import Any, List
from unittest import mock

import torch
from torch import nn
from torchrec.distributed.resharding.module_adapters import (
    EmbeddingBagCollectionAdapter,
    EmbeddingCollectionAdapter,
)


def _module() -> nn.Module:
    """A stand-in for a sharded module: all the call reads is its codecs."""
    module = nn.Module()
    module.qcomm_codecs_registry = {"codec": "of this module"}  # pyre-ignore[16]
    return module


def _infos(sharding_type: str) -> List[Any]:
    """A group's sharding infos, as far as the adapters read them."""
    return [
        SimpleNamespace(param_sharding=SimpleNamespace(sharding_type=sharding_type))
    ] * 2


class CreateShardingTest(unittest.TestCase):
    def test_the_ebc_adapter_calls_torchrecs_ebc_function(self) -> None:
        module, infos, env = _module(), _infos("row_wise"), object()
        device = torch.device("cpu")
        with mock.patch(
            "torchrec.distributed.embeddingbag.create_embedding_bag_sharding",
            autospec=True,
            return_value="sharding",
        ) as create:
            sharding = EmbeddingBagCollectionAdapter(module).create_sharding(
                infos, env, device  # pyre-ignore[6]
            )
        self.assertEqual(sharding, "sharding")
        create.assert_called_once_with(
            sharding_infos=infos,
            env=env,
            device=device,
            permute_embeddings=True,
            qcomm_codecs_registry={"codec": "of this module"},
        )

    def test_the_ec_adapter_calls_torchrecs_ec_function(self) -> None:
        module, infos, env = _module(), _infos("column_wise"), object()
        with mock.patch(
            "torchrec.distributed.embedding.create_embedding_sharding",
            autospec=True,
            return_value="sharding",
        ) as create:
            sharding = EmbeddingCollectionAdapter(module).create_sharding(
                infos, env, None  # pyre-ignore[6]
            )
        self.assertEqual(sharding, "sharding")
        create.assert_called_once_with(
            "column_wise",
            sharding_infos=infos,
            env=env,
            device=None,
            qcomm_codecs_registry={"codec": "of this module"},
        )


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of ``storage``: the batch keys that split a rebuilt group
into kernels of kept and of changed tables, and the cap on kernels per group.
(The release of pages itself is tested in test_memory.py.)
"""

import unittest
from typing import Dict, List, Optional

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.resharding.storage import (
    BATCH_KEY,
    MAX_KERNELS_PER_GROUP,
    split_kept_tables,
)
from torchrec.distributed.types import ParameterSharding
from torchrec.modules.embedding_configs import EmbeddingBagConfig


def _info(name: str, batch_key: Optional[str] = None) -> EmbeddingShardingInfo:
    config = EmbeddingBagConfig(
        name=name, embedding_dim=4, num_embeddings=8, feature_names=[f"f_{name}"]
    )
    fused = {"learning_rate": 0.1}
    if batch_key is not None:
        fused[BATCH_KEY] = batch_key
    return EmbeddingShardingInfo(
        embedding_config=config,
        param_sharding=ParameterSharding(
            sharding_type="table_wise", compute_kernel="fused", ranks=[0]
        ),
        param=torch.empty(0),
        fused_params=fused,
    )


def _keys(infos: List[EmbeddingShardingInfo]) -> Dict[str, Optional[str]]:
    return {
        i.embedding_config.name: (i.fused_params or {}).get(BATCH_KEY) for i in infos
    }


class SplitKeptTablesTest(unittest.TestCase):
    def test_changed_tables_get_the_generation_key_and_kept_ones_keep_theirs(
        self,
    ) -> None:
        kept = _info("a")
        mine = _info("b", "user")
        infos = {"table_wise": [kept, _info("c"), mine, _info("d", "user#reshard2")]}
        split_kept_tables(infos, ["table_wise"], {"c", "d"}, generation=3)
        self.assertEqual(
            _keys(infos["table_wise"]),
            {"a": None, "b": "user", "c": "#reshard3", "d": "user#reshard3"},
        )
        # kept tables keep the very info object the module holds
        self.assertIs(infos["table_wise"][0], kept)
        self.assertIs(infos["table_wise"][2], mine)
        self.assertEqual(infos["table_wise"][1].fused_params["learning_rate"], 0.1)

    def test_groups_not_rebuilt_are_left_alone(self) -> None:
        infos = {"table_wise": [_info("a")], "row_wise": [_info("b")]}
        split_kept_tables(infos, ["table_wise"], {"a", "b"}, generation=1)
        self.assertEqual(_keys(infos["row_wise"]), {"b": None})
        self.assertEqual(_keys(infos["table_wise"]), {"a": "#reshard1"})

    def test_too_many_kernels_merge_into_one_per_user_key(self) -> None:
        names = [f"t{i}" for i in range(MAX_KERNELS_PER_GROUP + 1)]
        # one table per earlier generation: as many keys as the cap allows
        infos = {
            "table_wise": [_info(names[0])]
            + [
                _info(n, f"#reshard{g}")
                for g, n in enumerate(names[1:MAX_KERNELS_PER_GROUP], start=1)
            ]
            + [_info(names[-1]), _info("u0", "user"), _info("u1", "user#reshard1")]
        }
        split_kept_tables(infos, ["table_wise"], {names[-1]}, generation=9)
        self.assertEqual(
            set(_keys(infos["table_wise"]).values()), {"#reshard9", "user#reshard9"}
        )

    def test_within_the_cap_nothing_merges(self) -> None:
        infos = {"table_wise": [_info("a"), _info("b", "#reshard1"), _info("c")]}
        split_kept_tables(infos, ["table_wise"], {"c"}, generation=2)
        self.assertEqual(
            _keys(infos["table_wise"]),
            {"a": None, "b": "#reshard1", "c": "#reshard2"},
        )


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The ``output_dtensor`` fused param (a request for DTensor state dicts) never
reaches fbgemm: group_tables() drops it from the arguments of every group's
TBE, so a fused kernel of a table carrying it builds, and table-wise sharding
leaves the sharding infos it is given as they are.
"""

import unittest
from typing import Any, Dict

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag
from torchrec.distributed.embeddingbag import create_sharding_infos_by_sharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    table_wise,
)
from torchrec.distributed.test_utils.model_zoo import numbered_tables
from torchrec.distributed.test_utils.multi_process_utils import (
    grouped_config,
    single_rank_process_group,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

FUSED_PARAMS: Dict[str, Any] = {
    "optimizer": EmbOptimType.EXACT_SGD,
    "learning_rate": 0.1,
    "output_dtensor": True,
}


class TbeFusedParamsTest(unittest.TestCase):
    def test_group_tables_keeps_output_dtensor_out_of_the_tbe_arguments(
        self,
    ) -> None:
        config = grouped_config(["a", "b"], FUSED_PARAMS)
        assert config.fused_params is not None
        self.assertNotIn("output_dtensor", config.fused_params)
        self.assertEqual(config.fused_params["learning_rate"], 0.1)
        # what every sharding type but table-wise used to hand to fbgemm
        with single_rank_process_group():
            kernel = BatchedFusedEmbeddingBag(config, device=torch.device("cpu"))
        self.assertEqual(len(kernel.split_embedding_weights()), 2)

    def test_table_wise_sharding_leaves_its_infos_unchanged(self) -> None:
        ebc = EmbeddingBagCollection(
            tables=numbered_tables(EmbeddingBagConfig, 1, [4], [8]),
            device=torch.device("meta"),
        )
        with single_rank_process_group():
            plan = construct_module_sharding_plan(
                ebc,
                {"t0": table_wise(rank=1)},
                local_size=2,
                world_size=2,
                device_type="cpu",
            )
            (infos,) = create_sharding_infos_by_sharding(
                ebc, dict(plan), "embedding_bags.", dict(FUSED_PARAMS)
            ).values()
            before = [dict(info.fused_params or {}) for info in infos]
            TwPooledEmbeddingSharding(
                infos, ShardingEnv(world_size=2, rank=0), torch.device("cpu")
            )
        # A rebuild of the table (under any sharding type) still sees the flag.
        self.assertTrue(all(b["output_dtensor"] for b in before))
        self.assertEqual([info.fused_params for info in infos], before)


if __name__ == "__main__":
    unittest.main()

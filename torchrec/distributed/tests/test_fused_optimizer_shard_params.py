#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Building a fused batched kernel leaves no cyclic garbage: its
EmbeddingFusedOptimizer (one per kernel, one per table) must not define a
class per call, since every class is part of a reference cycle that only
Python's cycle collector frees.
"""

import gc
import unittest
from typing import List

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.batched_embedding_kernel import (
    BatchedFusedEmbeddingBag,
    ShardParams,
)
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.test_utils.multi_process_utils import (
    grouped_config,
    single_rank_process_group,
)


def _fused_config(names: List[str]) -> GroupedEmbeddingConfig:
    """One fused (row-wise Adagrad) kernel's worth of whole 8 x 4 tables."""
    return grouped_config(
        names,
        {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1},
    )


class FusedOptimizerShardParamsTest(unittest.TestCase):
    def test_building_fused_kernels_leaves_no_cyclic_garbage(self) -> None:
        config = _fused_config(["a", "b", "c"])
        with single_rank_process_group():
            gc.collect()
            gc.disable()
            try:
                kernels = [
                    BatchedFusedEmbeddingBag(config, device=torch.device("cpu"))
                    for _ in range(3)
                ]
                # The kernels are alive: nothing they made may be garbage yet.
                garbage = gc.collect()
            finally:
                gc.enable()
        self.assertEqual(len(kernels), 3)
        self.assertEqual(garbage, 0, "building fused kernels left cyclic garbage")

    def test_shard_params_is_one_module_level_class(self) -> None:
        self.assertEqual(
            ShardParams.__qualname__, "ShardParams", "defined inside a function"
        )
        self.assertEqual(ShardParams.__module__, BatchedFusedEmbeddingBag.__module__)


if __name__ == "__main__":
    unittest.main()

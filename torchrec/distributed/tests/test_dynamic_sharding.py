#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Multi-process tests of live resharding of ShardedEmbeddingBagCollection.

Every case compares a module sharded under plan A and resharded in place to
plan B (m2) with the same weights and optimizer state sharded directly under
plan B (m1): state dicts, fused optimizer state, forward outputs and one more
training step must be identical, bit for bit. The reference state is gathered
from m2 before the reshard with plain collectives (see
``torchrec.distributed.test_utils.reshard_utils``), independent of the code
under test. Gloo on CPU here; NCCL when there are enough GPUs.
"""

import unittest
from typing import Any, List

import hypothesis.strategies as st
import torch
from hypothesis import given
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.test_utils.reshard_utils import (
    multi_process_settings,
    ReshardTestBase,
)
from torchrec.modules.embedding_configs import DataType

FUSED = EmbeddingComputeKernel.FUSED.value
DENSE = EmbeddingComputeKernel.DENSE.value


def _ranks_strategy(world_size: int, count: int) -> st.SearchStrategy[List[int]]:
    return st.lists(st.integers(0, world_size - 1), min_size=count, max_size=count)


class DynamicShardingTest(ReshardTestBase):
    # pyre-ignore[56]
    @multi_process_settings(max_examples=6)
    @given(
        world_size=st.sampled_from([2, 4]),
        num_tables=st.sampled_from([2, 3, 4]),
        data_type=st.sampled_from([DataType.FP32, DataType.FP16]),
        data=st.data(),
    )
    def test_dynamic_sharding_ebc_tw(
        self, world_size: int, num_tables: int, data_type: DataType, data: Any
    ) -> None:
        old = data.draw(_ranks_strategy(world_size, num_tables), label="old ranks")
        new = data.draw(_ranks_strategy(world_size, num_tables), label="new ranks")
        kernel = data.draw(st.sampled_from([FUSED, DENSE]), label="kernel")
        plans = [
            {f"t{i}": ("table_wise", r) for i, r in enumerate(ranks)}
            for ranks in (old, new)
        ]
        self.run_matches_direct(
            world_size, plans=plans, data_type=data_type, kernel=kernel, steps_before=0
        )

    def test_dynamic_sharding_ebc_tw_after_training(self) -> None:
        plans = [
            {"t0": ("table_wise", 0), "t1": ("table_wise", 0), "t2": ("table_wise", 1)},
            {"t0": ("table_wise", 1), "t1": ("table_wise", 0), "t2": ("table_wise", 0)},
        ]
        for optimizer in ("sgd", "adagrad", "rowwise_adagrad"):
            self.run_matches_direct(2, plans=plans, optimizer=optimizer, steps_before=3)

    def test_dynamic_sharding_ebc_tw_chain_back_to_original(self) -> None:
        a = {"t0": ("table_wise", 0), "t1": ("table_wise", 1), "t2": ("table_wise", 0)}
        b = {"t0": ("table_wise", 1), "t1": ("table_wise", 0), "t2": ("table_wise", 1)}
        c = {"t0": ("table_wise", 1), "t1": ("table_wise", 1), "t2": ("table_wise", 1)}
        self.run_matches_direct(2, plans=[a, b, c, a], steps_before=2)

    def test_dynamic_sharding_ebc_tw_bf16_and_empty_delta(self) -> None:
        a = {"t0": ("table_wise", 0), "t1": ("table_wise", 1)}
        b = {"t0": ("table_wise", 1), "t1": ("table_wise", 0)}
        # fbgemm's CPU kernels have no BF16 forward: compare the moved state only.
        on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
        self.run_matches_direct(
            2,
            plans=[a, a, b, b],
            data_type=DataType.BF16,
            steps_before=1 if on_gpu else 0,
            run_forward=on_gpu,
        )


if __name__ == "__main__":
    unittest.main()

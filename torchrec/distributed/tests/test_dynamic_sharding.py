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
from typing import Any, Dict, List, Optional, Sequence

import hypothesis.strategies as st
import torch
from hypothesis import given
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_same_training,
    assert_state_dicts_equal,
    delta,
    global_optimizer_state,
    global_weights,
    load_global_state,
    make_batches,
    make_ebc,
    make_plan,
    make_sharder,
    multi_process_settings,
    process_group,
    ReshardTestBase,
    shard,
    TableSpec,
    train_step,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import DataType

FUSED = EmbeddingComputeKernel.FUSED.value
DENSE = EmbeddingComputeKernel.DENSE.value


def _run_reshard_case(
    rank: int,
    world_size: int,
    port: str,
    plans: List[Dict[str, TableSpec]],
    data_type: DataType = DataType.FP32,
    kernel: str = FUSED,
    optimizer: Optional[str] = "rowwise_adagrad",
    steps_before: int = 2,
    local_size: Optional[int] = None,
    dims: Optional[Sequence[int]] = None,
    output_dtensor: bool = False,
    run_forward: bool = True,
    train_each_step: bool = False,
) -> None:
    """
    Shards under ``plans[0]``, trains ``steps_before`` steps, reshards through
    ``plans[1:]`` in order, and checks the result against a module sharded
    directly with ``plans[-1]``. With ``run_forward=False`` (kernels that cannot
    run on this backend) only the state is compared; with ``train_each_step``
    every step of the chain is also followed by a compared training step.
    """
    with process_group(rank, world_size, port, local_size) as (pg, device):
        num_tables = len(plans[0])
        ebc = make_ebc(num_tables, data_type, dims=dims)
        rows = [c.num_embeddings for c in ebc.embedding_bag_configs()]
        shapes = {
            f"embedding_bags.{c.name}.weight": (c.num_embeddings, c.embedding_dim)
            for c in ebc.embedding_bag_configs()
        }
        sharder = make_sharder(optimizer if kernel == FUSED else None)
        env = ShardingEnv(world_size, rank, pg, output_dtensor=output_dtensor)
        module_plans = [
            make_plan(ebc, p, world_size, local_size or world_size, kernel, device.type)
            for p in plans
        ]
        batches = make_batches(num_tables, rows, steps_before + 2, 4, seed=1)

        m2 = shard(ebc, sharder, module_plans[0], env, device)
        before = torch.optim.SGD(m2.parameters(), lr=0.05) if kernel == DENSE else None
        for batch in batches[:steps_before]:
            train_step(m2, batch.to(device), before)

        # Each step of a chain is checked against the state just before it:
        # row-wise optimizer state of joined columns is averaged, so a chain
        # that joins and splits columns again is not expected to round-trip.
        for old, new in zip(module_plans, module_plans[1:]):
            weights = global_weights(m2, pg)
            opt_state = global_optimizer_state(m2, pg, shapes)
            result = sharder.reshard(m2, delta(old, new), env, device)
            assert result is m2

            m1 = shard(ebc, sharder, new, env, device)
            load_global_state(m1, weights, opt_state)
            assert_state_dicts_equal(m1.state_dict(), m2.state_dict())
            assert_optimizer_states_equal(m1, m2)
            assert m1.module_sharding_plan == m2.module_sharding_plan
            if train_each_step and run_forward:
                assert_same_training(m1, m2, batches[-1:], kernel, device)

        if run_forward:
            assert_same_training(m1, m2, batches[steps_before:], kernel, device)


def _ranks_strategy(world_size: int, count: int) -> st.SearchStrategy[List[int]]:
    return st.lists(st.integers(0, world_size - 1), min_size=count, max_size=count)


class DynamicShardingTest(ReshardTestBase):
    def _run(self, world_size: int, **kwargs: Any) -> None:
        self.run_ranks(
            _run_reshard_case,
            world_size,
            **kwargs,
        )

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
        self._run(
            world_size, plans=plans, data_type=data_type, kernel=kernel, steps_before=0
        )

    def test_dynamic_sharding_ebc_tw_after_training(self) -> None:
        plans = [
            {"t0": ("table_wise", 0), "t1": ("table_wise", 0), "t2": ("table_wise", 1)},
            {"t0": ("table_wise", 1), "t1": ("table_wise", 0), "t2": ("table_wise", 0)},
        ]
        for optimizer in ("sgd", "adagrad", "rowwise_adagrad"):
            self._run(2, plans=plans, optimizer=optimizer, steps_before=3)

    def test_dynamic_sharding_ebc_tw_chain_back_to_original(self) -> None:
        a = {"t0": ("table_wise", 0), "t1": ("table_wise", 1), "t2": ("table_wise", 0)}
        b = {"t0": ("table_wise", 1), "t1": ("table_wise", 0), "t2": ("table_wise", 1)}
        c = {"t0": ("table_wise", 1), "t1": ("table_wise", 1), "t2": ("table_wise", 1)}
        self._run(2, plans=[a, b, c, a], steps_before=2)

    def test_dynamic_sharding_ebc_tw_bf16_and_empty_delta(self) -> None:
        a = {"t0": ("table_wise", 0), "t1": ("table_wise", 1)}
        b = {"t0": ("table_wise", 1), "t1": ("table_wise", 0)}
        # fbgemm's CPU kernels have no BF16 forward: compare the moved state only.
        on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
        self._run(
            2,
            plans=[a, a, b, b],
            data_type=DataType.BF16,
            steps_before=1 if on_gpu else 0,
            run_forward=on_gpu,
        )


if __name__ == "__main__":
    unittest.main()

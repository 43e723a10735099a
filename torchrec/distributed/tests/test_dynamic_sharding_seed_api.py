#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Multi-process tests of the state-dict level seed API in
``torchrec.distributed.sharding.dynamic_sharding``: ``shards_all_to_all``
followed by ``update_state_dict_post_resharding`` must turn the state dict of
a module sharded under plan A into, for the changed tables, exactly the state
dict of the same weights sharded directly under plan B. The pieces each rank
should receive are computed here from the plans' shard metadata and the
unsharded weights, independently of the resharding planner.
"""

import os
import unittest
from typing import Dict, List, Tuple

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.dynamic_sharding import (
    shards_all_to_all,
    update_state_dict_post_resharding,
)
from torchrec.distributed.test_utils.multi_process import MultiProcessTestBase
from torchrec.distributed.test_utils.reshard_utils import (
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    delta,
    make_ebc,
    make_plan,
    make_sharder,
    shard,
    TableSpec,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_configs import DataType

FUSED = EmbeddingComputeKernel.FUSED.value
DENSE = EmbeddingComputeKernel.DENSE.value

extend = ShardedEmbeddingBagCollection.extend_shard_name

# (name, plan A, plan B, data type, kernel)
Case = Tuple[str, Dict[str, TableSpec], Dict[str, TableSpec], DataType, str]

CASES: List[Case] = [
    (
        "tw",
        {"t0": ("table_wise", 0), "t1": ("table_wise", 1), "t2": ("table_wise", 0)},
        {"t0": ("table_wise", 1), "t1": ("table_wise", 1), "t2": ("table_wise", 1)},
        DataType.FP32,
        DENSE,
    ),
    (
        "tw_swap_fused",
        {"t0": ("table_wise", 0), "t1": ("table_wise", 1), "t2": ("table_wise", 1)},
        {"t0": ("table_wise", 1), "t1": ("table_wise", 0), "t2": ("table_wise", 1)},
        DataType.FP32,
        FUSED,
    ),
    (
        "cw_rw_to_tw_cw",
        {
            "t0": ("column_wise", [0, 1]),
            "t1": ("row_wise", None),
            "t2": ("table_wise", 0),
        },
        {
            "t0": ("table_wise", 1),
            "t1": ("column_wise", [1, 0]),
            "t2": ("table_wise", 0),
        },
        DataType.FP32,
        DENSE,
    ),
    (
        "uneven_rw_and_cw_fp16",
        {
            "t0": ("custom", ("row_wise", [(0, 0, 20, 16, 0), (20, 0, 4, 16, 1)])),
            "t1": ("table_wise", 1),
            "t2": ("column_wise", [1, 0]),
        },
        {
            "t0": ("column_wise", [1, 0]),
            "t1": (
                "custom",
                ("column_wise", [(0, 0, 27, 4, 0), (0, 4, 27, 12, 1)]),
            ),
            "t2": ("custom", ("row_wise", [(0, 0, 25, 16, 0), (25, 0, 5, 16, 1)])),
        },
        DataType.FP16,
        FUSED,
    ),
]


def _expected_receives(
    rank: int,
    world_size: int,
    old_plan: Dict[str, ParameterSharding],
    new_plan: Dict[str, ParameterSharding],
    changed: Dict[str, ParameterSharding],
    weights: Dict[str, torch.Tensor],
) -> Tuple[List[str], List[torch.Tensor]]:
    """
    What ``rank`` must receive from the other ranks: by source rank, then
    table (delta order), then its new shards (spec order), then the source
    shards (row-major), read straight from the unsharded weights.
    """
    names: List[str] = []
    pieces: List[torch.Tensor] = []
    for src in range(world_size):
        if src == rank:
            continue
        for table in changed:
            weight = weights[extend(table)]
            old_shards = sorted(
                (
                    m
                    for m in old_plan[table].sharding_spec.shards
                    if m.placement.rank() == src
                ),
                key=lambda m: tuple(m.shard_offsets),
            )
            for new in new_plan[table].sharding_spec.shards:
                if new.placement.rank() != rank:
                    continue
                for old in old_shards:
                    lo = [
                        max(a, b) for a, b in zip(old.shard_offsets, new.shard_offsets)
                    ]
                    hi = [
                        min(a + s, b + t)
                        for a, s, b, t in zip(
                            old.shard_offsets,
                            old.shard_sizes,
                            new.shard_offsets,
                            new.shard_sizes,
                        )
                    ]
                    if hi[0] <= lo[0] or hi[1] <= lo[1]:
                        continue
                    names.append(table)
                    pieces.append(weight[lo[0] : hi[0], lo[1] : hi[1]].reshape(-1))
    return names, pieces


def _run_seed_api(rank: int, world_size: int, port: str, cases: List[Case]) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, device = context.pg, context.device
        env = ShardingEnv(world_size, rank, pg)
        for case_name, plan_a, plan_b, data_type, kernel in cases:
            ebc = make_ebc(len(plan_a), data_type)
            weights = {k: v.detach().clone() for k, v in ebc.state_dict().items()}
            sharder = make_sharder("sgd" if kernel == FUSED else None)
            module_a = make_plan(
                ebc, plan_a, world_size, world_size, kernel, device.type
            )
            module_b = make_plan(
                ebc, plan_b, world_size, world_size, kernel, device.type
            )
            changed = delta(module_a, module_b)
            assert changed, case_name

            m_a = shard(ebc, sharder, module_a, env, device)
            state_dict = m_a.state_dict()
            before = dict(state_dict)

            names, output = shards_all_to_all(
                m_a,
                state_dict,
                device,
                changed,
                env,
                extend_shard_name=ShardedEmbeddingBagCollection.extend_shard_name,
            )
            expected_names, expected_pieces = _expected_receives(
                rank, world_size, module_a, module_b, changed, weights
            )
            # Only pieces from other ranks, ordered by source rank.
            assert names == expected_names, (case_name, rank, names, expected_names)
            expected_output = (
                torch.cat(expected_pieces).to(device)
                if expected_pieces
                else torch.empty(0, dtype=output.dtype, device=device)
            )
            assert output.numel() == expected_output.numel(), case_name
            if expected_pieces:
                assert output.dtype == expected_output.dtype, (case_name, output.dtype)
                assert torch.equal(output, expected_output), case_name

            result = update_state_dict_post_resharding(
                state_dict,
                names,
                output,
                changed,
                rank,
                extend_shard_name=ShardedEmbeddingBagCollection.extend_shard_name,
            )
            assert result is state_dict, case_name

            m_b = shard(ebc, sharder, module_b, env, device)
            reference = m_b.state_dict()
            assert list(result.keys()) == list(reference.keys()), case_name
            for key in result:
                table = key.split(".")[1]
                if table in changed:
                    assert isinstance(result[key], ShardedTensor), (case_name, key)
                    assert_state_dicts_equal({key: result[key]}, {key: reference[key]})
                else:
                    # Unchanged tables are left alone.
                    assert result[key] is before[key], (case_name, key)

        # An empty delta moves nothing and changes nothing.
        ebc = make_ebc(2)
        plan = make_plan(
            ebc,
            {"t0": ("table_wise", 0), "t1": ("table_wise", 1)},
            world_size,
            world_size,
            DENSE,
            device.type,
        )
        module = shard(ebc, make_sharder(None), plan, env, device)
        state_dict = module.state_dict()
        before = dict(state_dict)
        names, output = shards_all_to_all(
            module, state_dict, device, {}, env, extend_shard_name=extend
        )
        assert names == [], names
        assert isinstance(output, torch.Tensor) and output.numel() == 0, output
        result = update_state_dict_post_resharding(
            state_dict, names, output, {}, rank, extend_shard_name=extend
        )
        assert result is state_dict
        assert all(result[k] is before[k] for k in before)
        assert list(result) == list(before)


class DynamicShardingSeedApiTest(MultiProcessTestBase):
    def _run(self, cases: List[Case], world_size: int = 2) -> None:
        self._run_multi_process_test(
            callable=_run_seed_api,
            world_size=world_size,
            port=os.environ["MASTER_PORT"],
            cases=cases,
        )

    def test_seed_api_table_wise(self) -> None:
        self._run([c for c in CASES if c[0].startswith("tw")])

    def test_seed_api_column_and_row_wise(self) -> None:
        self._run([c for c in CASES if not c[0].startswith("tw")])


if __name__ == "__main__":
    unittest.main()

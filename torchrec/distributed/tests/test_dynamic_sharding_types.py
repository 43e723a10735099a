#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Resharding between every EBC sharding type (TW, CW, TWCW, RW, TWRW, GRID, DP),
with type changes, shard-count changes, several tables changing in different
ways at once, DTensor state dicts, and the groups a reshard must not touch.
Each case is checked against a module sharded directly with the new plan (see
``reshard_utils.assert_reshard_matches_direct``).
"""

import unittest
from typing import Any, Dict, List, Optional

import hypothesis.strategies as st
from hypothesis import given
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.test_utils.reshard_utils import (
    BoundedMultiProcessContext,
    make_batches,
    make_ebc,
    make_plan,
    make_sharder,
    multi_process_settings,
    ReshardTestBase,
    shard,
    TableSpec,
    TW_CW_RW,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import DataType

FUSED = EmbeddingComputeKernel.FUSED.value
DENSE = EmbeddingComputeKernel.DENSE.value

SHARDING_TYPES: List[str] = [
    "table_wise",
    "column_wise",
    "table_column_wise",
    "row_wise",
    "table_row_wise",
    "grid_shard",
    "data_parallel",
]
DIM = 16


@st.composite
def table_specs(
    draw: Any, sharding_type: str, world_size: int, local_size: int
) -> TableSpec:
    """A random valid sharding of one DIM-wide table of the given type."""
    hosts = world_size // local_size
    if sharding_type == "table_wise":
        return ("table_wise", draw(st.integers(0, world_size - 1)))
    if sharding_type == "column_wise":
        count = draw(st.sampled_from([1, 2, 4]))
        ranks = draw(
            st.lists(st.integers(0, world_size - 1), min_size=count, max_size=count)
        )
        return ("column_wise", ranks)
    if sharding_type == "table_column_wise":
        host = draw(st.integers(0, hosts - 1))
        count = draw(st.sampled_from([1, 2]))
        ranks = draw(
            st.lists(
                st.integers(host * local_size, (host + 1) * local_size - 1),
                min_size=count,
                max_size=count,
            )
        )
        return ("table_column_wise", ranks)
    if sharding_type == "table_row_wise":
        return ("table_row_wise", draw(st.integers(0, hosts - 1)))
    if sharding_type == "grid_shard":
        # TorchRec's grid generator cuts columns in blocks of at least 128, so
        # a DIM-wide table spans one host (rows split over its ranks).
        return ("grid_shard", [draw(st.integers(0, hosts - 1))])
    return (sharding_type, None)


@st.composite
def plan_pairs(
    draw: Any, world_size: int, local_size: int, num_tables: int
) -> List[Dict[str, TableSpec]]:
    old: Dict[str, TableSpec] = {}
    new: Dict[str, TableSpec] = {}
    for i in range(num_tables):
        old_type = draw(st.sampled_from(SHARDING_TYPES), label=f"t{i} old type")
        new_type = draw(st.sampled_from(SHARDING_TYPES), label=f"t{i} new type")
        old[f"t{i}"] = draw(table_specs(old_type, world_size, local_size))
        new[f"t{i}"] = draw(table_specs(new_type, world_size, local_size))
    return [old, new]


def _run_untouched_groups_kept(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, device = context.pg, context.device
        ebc = make_ebc(4, dims=[DIM] * 4)
        sharder = make_sharder("rowwise_adagrad")
        env = ShardingEnv.from_process_group(pg)
        specs = {
            "t0": ("table_wise", 0),
            "t1": ("table_wise", 1),
            "t2": ("column_wise", [0, 1]),
            "t3": ("row_wise", None),
        }
        module = shard(
            ebc,
            sharder,
            make_plan(ebc, specs, world_size, world_size, FUSED),
            env,
            device,
        )
        batch = make_batches(
            4, [c.num_embeddings for c in ebc.embedding_bag_configs()], 1, 4, seed=2
        )[0]
        module(batch).wait()  # builds the input dists
        types = list(module._sharding_types)
        kept = {
            t: (
                module._lookups[i],
                module._output_dists[i],
                module._embedding_shardings[i],
                module._input_dists[i],
            )
            for i, t in enumerate(types)
        }
        untouched_ptrs = {
            name: module.embedding_bags[name].weight.data_ptr()
            for name in ("t2", "t3")
            if module.embedding_bags[name].weight.numel() > 0
        }
        new_plan = make_plan(
            ebc, {**specs, "t0": ("table_wise", 1)}, world_size, world_size, FUSED
        )
        sharder.reshard(module, {"t0": new_plan["t0"]}, env, device)

        assert module._sharding_types == types
        for i, t in enumerate(module._sharding_types):
            lookup, output_dist, sharding, input_dist = kept[t]
            same = (
                module._lookups[i] is lookup
                and module._output_dists[i] is output_dist
                and module._embedding_shardings[i] is sharding
                and module._input_dists[i] is input_dist
            )
            assert same == (t != "table_wise"), (t, same)
        for name, ptr in untouched_ptrs.items():
            assert module.embedding_bags[name].weight.data_ptr() == ptr, name


class DynamicShardingTypesTest(ReshardTestBase):
    # pyre-ignore[56]
    @multi_process_settings(max_examples=6)
    @given(
        plans=plan_pairs(world_size=2, local_size=2, num_tables=3),
        data_type=st.sampled_from([DataType.FP32, DataType.FP16]),
        optimizer=st.sampled_from([None, "sgd", "adagrad", "rowwise_adagrad"]),
    )
    def test_reshard_any_type_to_any_type_ws2(
        self,
        plans: List[Dict[str, TableSpec]],
        data_type: DataType,
        optimizer: Optional[str],
    ) -> None:
        self.run_matches_direct(
            2,
            plans=plans,
            data_type=data_type,
            kernel=DENSE if optimizer is None else FUSED,
            optimizer=optimizer,
            dims=[DIM] * 3,
        )

    # pyre-ignore[56]
    @multi_process_settings(max_examples=2)
    @given(
        plans=plan_pairs(world_size=4, local_size=2, num_tables=3),
        data_type=st.sampled_from([DataType.FP32, DataType.FP16]),
    )
    def test_reshard_any_type_to_any_type_ws4_local2(
        self, plans: List[Dict[str, TableSpec]], data_type: DataType
    ) -> None:
        self.run_matches_direct(
            4,
            plans=plans,
            data_type=data_type,
            optimizer="rowwise_adagrad",
            local_size=2,
            dims=[DIM] * 3,
        )

    def test_reshard_every_type_change_in_one_call(self) -> None:
        # Seven tables, each changing type differently, in one delta; then back.
        a = {
            **TW_CW_RW,
            "t3": ("data_parallel", None),
            "t4": ("table_row_wise", 0),
            "t5": ("grid_shard", [0]),
            "t6": ("table_column_wise", [1, 0]),
        }
        b = {
            "t0": ("row_wise", None),
            "t1": ("table_wise", 1),
            "t2": ("column_wise", [1, 0, 1, 1]),
            "t3": ("table_wise", 0),
            "t4": ("data_parallel", None),
            "t5": ("table_column_wise", [0, 1]),
            "t6": ("grid_shard", [0]),
        }
        self.run_matches_direct(
            2, plans=[a, b, a], optimizer="rowwise_adagrad", dims=[DIM] * 7
        )
        self.run_matches_direct(2, plans=[a, b], optimizer="adagrad", dims=[DIM] * 7)

    def test_reshard_all_type_pairs(self) -> None:
        # Table i has type (i + k) % 7 under plan P_k. The chain
        # P0 -> P1 -> P3 -> P6 -> P3 -> P1 -> P0 shifts every table's type by
        # 1, 2, 3, 4, 5 and 6 in turn, so the seven tables go through all 42
        # (old type, new type) pairs with old != new; every step is compared
        # with a directly sharded module, then trained one step and compared.
        # Once with ShardedTensor and once with DTensor state dicts.
        per_type: Dict[str, TableSpec] = {
            "table_wise": ("table_wise", 1),
            "column_wise": ("column_wise", [1, 0]),
            "table_column_wise": ("table_column_wise", [0, 1]),
            "row_wise": ("row_wise", None),
            "table_row_wise": ("table_row_wise", 0),
            "grid_shard": ("grid_shard", [0]),
            "data_parallel": ("data_parallel", None),
        }

        def plan(k: int) -> Dict[str, TableSpec]:
            return {f"t{i}": per_type[SHARDING_TYPES[(i + k) % 7]] for i in range(7)}

        for output_dtensor in (False, True):
            self.run_matches_direct(
                2,
                plans=[plan(k) for k in (0, 1, 3, 6, 3, 1, 0)],
                optimizer="rowwise_adagrad",
                dims=[DIM] * 7,
                steps_before=1,
                train_each_step=True,
                output_dtensor=output_dtensor,
            )

    def test_reshard_same_type_to_other_ranks_ws4_local2(self) -> None:
        # The diagonal of the type matrix on two hosts: every type moves to
        # other ranks (other host, other column order) without changing type.
        a = {
            "t0": ("table_wise", 0),
            "t1": ("column_wise", [0, 1]),
            "t2": ("table_column_wise", [0, 1]),
            "t3": ("table_row_wise", 0),
            "t4": ("grid_shard", [0]),
            "t5": ("row_wise", None),
        }
        b = {
            "t0": ("table_wise", 3),
            "t1": ("column_wise", [3, 2, 1, 0]),
            "t2": ("table_column_wise", [3, 2]),
            "t3": ("table_row_wise", 1),
            "t4": ("grid_shard", [1]),
            "t5": ("row_wise", None),
        }
        self.run_matches_direct(
            4,
            plans=[a, b],
            optimizer="rowwise_adagrad",
            local_size=2,
            dims=[DIM] * 6,
        )

    def test_reshard_unequal_column_widths(self) -> None:
        a = {"t0": ("custom", ("column_wise", [(0, 0, 24, 4, 0), (0, 4, 24, 12, 1)]))}
        b = {"t0": ("custom", ("column_wise", [(0, 0, 24, 12, 1), (0, 12, 24, 4, 0)]))}
        self.run_matches_direct(
            2, plans=[a, b, a], optimizer="rowwise_adagrad", dims=[DIM]
        )

    def test_reshard_arbitrary_row_splits(self) -> None:
        # TorchRec's row-wise input dist buckets ids in equal blocks, so only
        # the state can be compared for arbitrary row splits like these.
        a = {"t0": ("custom", ("row_wise", [(0, 0, 20, 16, 0), (20, 0, 4, 16, 1)]))}
        b = {"t0": ("custom", ("row_wise", [(0, 0, 5, 16, 0), (5, 0, 19, 16, 1)]))}
        self.run_matches_direct(
            2,
            plans=[a, b],
            optimizer="rowwise_adagrad",
            dims=[DIM],
            steps_before=0,
            run_forward=False,
        )

    def test_reshard_dtensor_state_dict(self) -> None:
        a = dict(TW_CW_RW)
        b = {
            "t0": ("column_wise", [1, 0]),
            "t1": ("table_wise", 1),
            "t2": ("table_wise", 0),
        }
        self.run_matches_direct(
            2, plans=[a, b], output_dtensor=True, optimizer="adagrad", dims=[DIM] * 3
        )

    def test_untouched_groups_keep_their_lookups(self) -> None:
        self.run_ranks(
            _run_untouched_groups_kept,
            2,
        )


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Model-level resharding: a DistributedModelParallel model with two EBCs and an
EC, trained under plan A, resharded with ``DistributedModelParallel.reshard``
to plan B and trained on, must be bit-equal (weights, fused optimizer state,
outputs) to the same state sharded directly with plan B and trained the same
way. The dry run's byte counts must equal what the exchange really moved.
"""

import unittest
from typing import Any, Dict, List

import hypothesis.strategies as st
import torch
import torch.distributed as dist
from hypothesis import given
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.resharding import dry_run, plan_delta, ReshardOptions
from torchrec.distributed.test_utils.reshard_dmp_utils import (
    sparse_arch,
    sparse_arch_batches,
    sparse_arch_plan,
    sparse_arch_step,
)
from torchrec.distributed.test_utils.reshard_ec_utils import make_ec_sharder
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    global_optimizer_state,
    global_weights,
    load_global_state,
    make_sharder,
    multi_process_settings,
    ReshardTestBase,
    TableSpec,
    TW_CW_RW,
)


def _run_model_reshard(
    rank: int,
    world_size: int,
    port: str,
    plan_specs: List[Dict[str, Dict[str, TableSpec]]],
    steps_before: int,
    steps_after: int,
    optimizer: str,
) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, env, device = context.pg, context.env, context.device
        sharders = [make_sharder(optimizer), make_ec_sharder(optimizer)]
        unsharded = sparse_arch()
        plans = [sparse_arch_plan(unsharded, specs, world_size) for specs in plan_specs]
        batches = sparse_arch_batches(unsharded, steps_before + steps_after)

        model = DistributedModelParallel(
            sparse_arch(), env=env, device=device, plan=plans[0], sharders=sharders
        )
        model.load_state_dict(unsharded.state_dict())
        fused_before = model.fused_optimizer
        for batch in batches[:steps_before]:
            sparse_arch_step(model, batch)

        for new_plan in plans[1:]:
            weights = global_weights(model, pg)
            opt_state = global_optimizer_state(model, pg)
            expected = dry_run(model, new_plan)
            assert expected.deltas == plan_delta(model.plan, new_plan)

            report = model.reshard(new_plan, ReshardOptions(progress=True))

            moved: List[Any] = [None] * world_size
            dist.all_gather_object(
                moved, (report.bytes_sent, report.bytes_received), group=pg
            )
            assert [m[0] for m in moved] == [
                expected.bytes_sent_by_rank[r] for r in range(world_size)
            ]
            assert [m[1] for m in moved] == [
                expected.bytes_received_by_rank[r] for r in range(world_size)
            ]
            assert set(report.deltas or {}) == set(expected.deltas or {})
            for path, delta in expected.deltas.items():
                assert model.plan.plan[path] == new_plan.plan[path]

            reference = DistributedModelParallel(
                sparse_arch(), env=env, device=device, plan=new_plan, sharders=sharders
            )
            load_global_state(reference, weights, opt_state)
            assert_state_dicts_equal(reference.state_dict(), model.state_dict())
            assert_optimizer_states_equal(reference, model)

        # The model's own fused optimizer object follows the moved state.
        assert model.fused_optimizer is fused_before
        for batch in batches[steps_before:]:
            assert torch.equal(
                sparse_arch_step(model, batch), sparse_arch_step(reference, batch)
            )
        assert_state_dicts_equal(reference.state_dict(), model.state_dict())
        assert_optimizer_states_equal(reference, model)


PLAN_A = {
    "sparse_a": dict(TW_CW_RW),
    "sparse_b": {"t0": ("table_wise", 1), "t1": ("data_parallel", None)},
    "seq": {"t0": ("table_wise", 0), "t1": ("row_wise", None)},
}
PLAN_B = {
    "sparse_a": {
        "t0": ("table_wise", 1),
        "t1": ("table_wise", 0),
        "t2": ("row_wise", None),
    },
    "sparse_b": {"t0": ("column_wise", [0, 1]), "t1": ("table_wise", 0)},
    "seq": {"t0": ("column_wise", [1, 0]), "t1": ("table_wise", 1)},
}

SIMPLE_TYPES = ["table_wise", "column_wise", "row_wise", "data_parallel"]
# fbgemm's CPU dense kernel cannot run the unpooled lookups of data-parallel
# EC tables, so EC plans here use the fused types only.
SEQUENCE_TYPES = ["table_wise", "column_wise", "row_wise"]


@st.composite
def _module_specs(
    draw: Any, num_tables: int, world_size: int, types: List[str] = SIMPLE_TYPES
) -> Dict[str, TableSpec]:
    specs: Dict[str, TableSpec] = {}
    for i in range(num_tables):
        kind = draw(st.sampled_from(types))
        arg: Any = None
        if kind == "table_wise":
            arg = draw(st.integers(0, world_size - 1))
        elif kind == "column_wise":
            arg = draw(st.lists(st.integers(0, world_size - 1), min_size=2, max_size=2))
        specs[f"t{i}"] = (kind, arg)
    return specs


class DynamicShardingModelTest(ReshardTestBase):
    def _run(self, **kwargs: Any) -> None:
        self.run_ranks(
            _run_model_reshard,
            2,
            **kwargs,
        )

    def test_dmp_reshard_to_new_plan_and_back(self) -> None:
        self._run(
            plan_specs=[PLAN_A, PLAN_B, PLAN_A],
            steps_before=2,
            steps_after=2,
            optimizer="adagrad",
        )

    # pyre-ignore[56]
    @multi_process_settings(max_examples=3)
    @given(
        a=st.fixed_dictionaries(
            {
                "sparse_a": _module_specs(3, 2),
                "sparse_b": _module_specs(2, 2),
                "seq": _module_specs(2, 2, SEQUENCE_TYPES),
            }
        ),
        b=st.fixed_dictionaries(
            {
                "sparse_a": _module_specs(3, 2),
                "sparse_b": _module_specs(2, 2),
                "seq": _module_specs(2, 2, SEQUENCE_TYPES),
            }
        ),
        steps_before=st.integers(0, 3),
        steps_after=st.integers(1, 2),
        optimizer=st.sampled_from(["sgd", "adagrad", "rowwise_adagrad"]),
    )
    def test_dmp_reshard_random_plans(
        self,
        a: Dict[str, Dict[str, TableSpec]],
        b: Dict[str, Dict[str, TableSpec]],
        steps_before: int,
        steps_after: int,
        optimizer: str,
    ) -> None:
        self._run(
            plan_specs=[a, b],
            steps_before=steps_before,
            steps_after=steps_after,
            optimizer=optimizer,
        )


if __name__ == "__main__":
    unittest.main()

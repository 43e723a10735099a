#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A ShardedEmbeddingBagCollection installs new sharding groups after
construction. Under plan A, trained, the module gets the groups of plan B
built detached from it (``resharding.groups``: the sharding infos of plan B,
the groups that change, new shardings and lookups for those) and installs
them through its own ``_install_sharding_groups`` (``resharding.module_adapters``'s
adapter); the global state gathered before is then loaded. It must equal, bit
for bit, the same state sharded directly with plan B: state dict, fused
optimizer state, module plan, outputs and training; groups plan B does not
touch keep their lookups. No data is exchanged here: that is the next step.
"""

import unittest
from typing import Dict

import torch
from torchrec.distributed.batched_embedding_kernel import KernelBuildHooks
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding.groups import (
    build_groups,
    changed_types,
    check_built_layouts,
    infos_for_plan,
    rebuilt_tables,
    wrap_new_lookups,
)
from torchrec.distributed.resharding.module_adapters import (
    EmbeddingBagCollectionAdapter,
)
from torchrec.distributed.resharding.plan import layout_from_parameter_sharding
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_same_training,
    assert_state_dicts_equal,
    delta,
    load_global_state,
    ReshardTestBase,
    TableSpec,
    train_step,
    TW_CW_RW,
)

FUSED: str = EmbeddingComputeKernel.FUSED.value
DENSE: str = EmbeddingComputeKernel.DENSE.value
PLAN_A: Dict[str, TableSpec] = {**TW_CW_RW, "t3": ("data_parallel", None)}
PLAN_B: Dict[str, TableSpec] = {
    "t0": ("table_wise", 1),  # moves
    "t1": ("column_wise", [0, 1]),  # its group stays as it is
    "t2": ("table_wise", 0),  # changes type: joins t0's group
    "t3": ("data_parallel", None),
}


def _install_case(rank: int, world_size: int, port: str, kernel: str) -> None:
    with reshard_scenario(
        rank, world_size, port, len(PLAN_A), kernel=kernel
    ) as scenario:
        env, device = scenario.env, scenario.device
        plan_a, plan_b = scenario.plan(PLAN_A), scenario.plan(PLAN_B)
        batches = scenario.batches(4, seed=3)

        module = scenario.shard(plan_a)
        dense = (
            torch.optim.SGD(module.parameters(), lr=0.05) if kernel == DENSE else None
        )
        for batch in batches[:2]:
            train_step(module, batch.to(device), dense)
        state = scenario.global_state(module)
        combined = module.fused_optimizer

        adapter = EmbeddingBagCollectionAdapter(module)
        new_plan = {**module.module_sharding_plan, **delta(plan_a, plan_b)}
        infos = infos_for_plan(adapter, new_plan)
        types = changed_types(adapter, infos)
        assert "column_wise" not in types and "row_wise" in types, types
        assert rebuilt_tables(adapter, infos, types) == ["t0", "t2"]
        kept = {t: lookup for t, _, lookup in adapter.groups() if t not in types}
        groups = build_groups(adapter, infos, types, env, device, KernelBuildHooks())
        wrap_new_lookups(adapter, groups)
        new_layouts = {
            t: layout_from_parameter_sharding(
                plan_b[t], *adapter.table_shape(t), world_size
            )
            for t in ("t0", "t2")
        }
        check_built_layouts(groups, new_layouts, rank)
        adapter.install(groups.infos, groups.shardings, groups.lookups)
        load_global_state(module, *state)

        assert [t for t, _, _ in adapter.groups()] == list(infos)
        for sharding_type, _, lookup in adapter.groups():
            if sharding_type in kept:
                assert lookup is kept[sharding_type], sharding_type
        assert module.fused_optimizer is combined  # updated in place
        assert module.module_sharding_plan == plan_b

        reference = scenario.reference(plan_b, state)
        assert_state_dicts_equal(reference.state_dict(), module.state_dict())
        assert_optimizer_states_equal(reference, module)
        assert_same_training(reference, module, batches[2:], kernel, device)


class InstallShardingGroupsTest(ReshardTestBase):
    def test_install_new_groups_fused(self) -> None:
        self.run_ranks(_install_case, 2, kernel=FUSED)

    def test_install_new_groups_dense(self) -> None:
        self.run_ranks(_install_case, 2, kernel=DENSE)


if __name__ == "__main__":
    unittest.main()

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
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_same_training,
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    delta,
    global_optimizer_state,
    global_weights,
    load_global_state,
    make_batches,
    make_ebc,
    make_plan,
    make_sharder,
    ReshardTestBase,
    shard,
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
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, env, device = context.pg, context.env, context.device
        ebc = make_ebc(len(PLAN_A))
        rows = [c.num_embeddings for c in ebc.embedding_bag_configs()]
        sharder = make_sharder("rowwise_adagrad" if kernel == FUSED else None)
        plan_a = make_plan(ebc, PLAN_A, world_size, world_size, kernel, device.type)
        plan_b = make_plan(ebc, PLAN_B, world_size, world_size, kernel, device.type)
        batches = make_batches(len(PLAN_A), rows, 4, 4, seed=3)

        module = shard(ebc, sharder, plan_a, env, device)
        dense = (
            torch.optim.SGD(module.parameters(), lr=0.05) if kernel == DENSE else None
        )
        for batch in batches[:2]:
            train_step(module, batch.to(device), dense)
        weights = global_weights(module, pg)
        optimizer_state = global_optimizer_state(module, pg)
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
        load_global_state(module, weights, optimizer_state)

        assert [t for t, _, _ in adapter.groups()] == list(infos)
        for sharding_type, _, lookup in adapter.groups():
            if sharding_type in kept:
                assert lookup is kept[sharding_type], sharding_type
        assert module.fused_optimizer is combined  # updated in place
        assert module.module_sharding_plan == plan_b

        reference = shard(ebc, sharder, plan_b, env, device)
        load_global_state(reference, weights, optimizer_state)
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

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Multi-process tests of live resharding of ShardedEmbeddingCollection
(sequence embeddings), for every sharding type an EC has (TW, CW, RW, DP),
type changes, fused optimizers with state and the dense kernel.

Every case compares a module sharded under plan A, trained, and resharded in
place to plan B (m2) with the same weights and optimizer state sharded
directly under plan B (m1): state dicts, fused optimizer state, forward
outputs (every feature's JaggedTensor) and one more training step must be
identical, bit for bit. The reference state is gathered from m2 before the
reshard with plain collectives (``reshard_utils``), independent of the code
under test. Gloo on CPU here; NCCL when there are enough GPUs.

fbgemm-gpu-cpu 1.8's dense TBE returns one row per bag instead of one per id
when it runs unpooled (sequence) on CPU, so a sequence lookup with the dense
kernel (every data-parallel table, and the "dense" compute kernel) cannot run
forward there: on CPU such plans are only resharded and their state compared;
the weights and optimizer state they hold come from training under a plan the
CPU can run (see ``_runs_forward``).
"""

import os
import unittest
from typing import Any, Dict, List, Optional

import hypothesis.strategies as st
import torch
from hypothesis import given, HealthCheck, settings, Verbosity
from torch.distributed._tensor import DTensor
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding import ReshardError
from torchrec.distributed.test_utils.multi_process import MultiProcessTestBase
from torchrec.distributed.test_utils.reshard_ec_utils import (
    assert_ec_outputs_equal,
    ec_train_step,
    make_ec,
    make_ec_sharder,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    make_batches,
    make_plan,
    reshard_with_reference,
    shard,
    TableSpec,
    TW_CW_RW,
)
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import DataType

FUSED = EmbeddingComputeKernel.FUSED.value
DENSE = EmbeddingComputeKernel.DENSE.value
DIM = 16
EC_SHARDING_TYPES: List[str] = [
    "table_wise",
    "column_wise",
    "row_wise",
    "data_parallel",
]


def _runs_forward(specs: Dict[str, TableSpec], kernel: str, world_size: int) -> bool:
    """Whether an EC sharded with ``specs`` can run forward on this machine."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return True
    return kernel == FUSED and all(k != "data_parallel" for k, _ in specs.values())


def _run_ec_reshard_case(
    rank: int,
    world_size: int,
    port: str,
    plans: List[Dict[str, TableSpec]],
    data_type: DataType = DataType.FP32,
    kernel: str = FUSED,
    optimizer: Optional[str] = "rowwise_adagrad",
    steps_before: int = 2,
    output_dtensor: str = "",
) -> None:
    """
    Shards an EC under ``plans[0]``, trains ``steps_before`` steps, reshards
    through ``plans[1:]`` in order (each step checked against a module sharded
    directly with its plan), then trains both one more step and compares.
    Training before or after is skipped where the plan cannot run forward on
    this machine (see ``_runs_forward``). ``output_dtensor`` asks for DTensor
    state dicts through the environment ("env") or the fused params
    ("fused_param"); every sharded table's state is then checked to be one.
    """
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, device = context.pg, context.device
        num_tables = len(plans[0])
        ec = make_ec(num_tables, data_type, dim=DIM)
        rows = [c.num_embeddings for c in ec.embedding_configs()]
        sharder = make_ec_sharder(
            optimizer if kernel == FUSED else None,
            output_dtensor=output_dtensor == "fused_param",
        )
        env = ShardingEnv(world_size, rank, pg, output_dtensor=output_dtensor == "env")
        module_plans = [
            make_plan(ec, p, world_size, world_size, kernel, device.type)  # pyre-ignore
            for p in plans
        ]
        batches = make_batches(num_tables, rows, steps_before + 2, 4, seed=1)

        m2 = shard(ec, sharder, module_plans[0], env, device)  # pyre-ignore[6]
        before = torch.optim.SGD(m2.parameters(), lr=0.05) if kernel == DENSE else None
        if not _runs_forward(plans[0], kernel, world_size):
            steps_before = 0
        for batch in batches[:steps_before]:
            ec_train_step(m2, batch.to(device), before)

        for old, new in zip(module_plans, module_plans[1:]):
            m1 = reshard_with_reference(
                ec, sharder, m2, old, new, env, device, pg  # pyre-ignore[6]
            )
            if output_dtensor:
                _assert_dtensor_state(m1, new)
                _assert_dtensor_state(m2, new)
            assert_state_dicts_equal(m1.state_dict(), m2.state_dict())
            assert_optimizer_states_equal(m1, m2)
            assert m1.module_sharding_plan == m2.module_sharding_plan
            assert list(m1._sharding_type_to_sharding) == list(
                m2._sharding_type_to_sharding
            )

        if not _runs_forward(plans[-1], kernel, world_size):
            return
        dense_opts = [None, None]
        if kernel == DENSE:
            dense_opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (m1, m2)]
        for batch in batches[-2:]:
            out1 = ec_train_step(m1, batch.to(device), dense_opts[0])
            out2 = ec_train_step(m2, batch.to(device), dense_opts[1])
            assert_ec_outputs_equal(out1, out2)
        assert_state_dicts_equal(m1.state_dict(), m2.state_dict())
        assert_optimizer_states_equal(m1, m2)


def _assert_dtensor_state(module: torch.nn.Module, plan: Dict[str, Any]) -> None:
    """Every table's state-dict value is a DTensor of the table's full shape,
    except data-parallel tables' (plain tensors)."""
    for key, value in module.state_dict().items():
        table = key.split(".")[1]
        if plan[table].sharding_type == ShardingType.DATA_PARALLEL.value:
            assert type(value) is torch.Tensor, (key, type(value))
        else:
            assert isinstance(value, DTensor), (key, type(value))
            config = module._table_name_to_config[table]
            assert tuple(value.size()) == (
                config.num_embeddings,
                config.embedding_dim,
            ), (key, value.size())


def _run_ec_untouched_groups_kept(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, device = context.pg, context.device
        ec = make_ec(3, dim=DIM)
        sharder = make_ec_sharder("rowwise_adagrad")
        env = ShardingEnv.from_process_group(pg)
        specs = dict(TW_CW_RW)
        plan = make_plan(ec, specs, world_size, world_size, FUSED)  # pyre-ignore[6]
        module = shard(ec, sharder, plan, env, device)  # pyre-ignore[6]
        kept = {
            t: (module._lookups[i], module._output_dists[i], sharding)
            for i, (t, sharding) in enumerate(module._sharding_type_to_sharding.items())
        }
        new_plan = make_plan(  # pyre-ignore[6]
            ec, {**specs, "t0": ("table_wise", 1)}, world_size, world_size, FUSED
        )
        sharder.reshard(module, {"t0": new_plan["t0"]}, env, device)
        assert list(module._sharding_type_to_sharding) == list(kept)
        for i, (t, sharding) in enumerate(module._sharding_type_to_sharding.items()):
            lookup, output_dist, old_sharding = kept[t]
            same = (
                module._lookups[i] is lookup
                and module._output_dists[i] is output_dist
                and sharding is old_sharding
            )
            assert same == (t != "table_wise"), (t, same)

        # An empty delta changes nothing; a bad one raises on every rank.
        sharder.reshard(module, {}, env, device)
        try:
            sharder.reshard(module, {"nope": new_plan["t0"]}, env, device)
        except ReshardError as e:
            assert "nope" in str(e), e
        else:
            raise AssertionError("an unknown table must be refused")


@st.composite
def _ec_plan(draw: Any, world_size: int, num_tables: int) -> Dict[str, TableSpec]:
    # All column-wise tables of an EC must have the same shard width.
    cw_shards = draw(st.sampled_from([2, 4]))
    plan: Dict[str, TableSpec] = {}
    for i in range(num_tables):
        kind = draw(st.sampled_from(EC_SHARDING_TYPES), label=f"t{i} type")
        if kind == "table_wise":
            plan[f"t{i}"] = (kind, draw(st.integers(0, world_size - 1)))
        elif kind == "column_wise":
            ranks = draw(
                st.lists(
                    st.integers(0, world_size - 1),
                    min_size=cw_shards,
                    max_size=cw_shards,
                )
            )
            plan[f"t{i}"] = (kind, ranks)
        else:
            plan[f"t{i}"] = (kind, None)
    return plan


class DynamicShardingECTest(MultiProcessTestBase):
    def _run(self, world_size: int = 2, **kwargs: Any) -> None:
        self._run_multi_process_test(
            callable=_run_ec_reshard_case,
            world_size=world_size,
            port=os.environ["MASTER_PORT"],
            **kwargs,
        )

    def test_reshard_ec_every_type_change(self) -> None:
        # Trained under w, then every table changes sharding type at every
        # step, through every EC type (DP included) and back to a plan that
        # runs forward everywhere.
        w = {**TW_CW_RW, "t3": ("table_wise", 1)}
        a = {**w, "t3": ("data_parallel", None)}
        b = {
            "t0": ("column_wise", [1, 1]),
            "t1": ("row_wise", None),
            "t2": ("data_parallel", None),
            "t3": ("table_wise", 1),
        }
        c = {
            "t0": ("row_wise", None),
            "t1": ("table_wise", 0),
            "t2": ("column_wise", [1, 0]),
            "t3": ("column_wise", [0, 0]),
        }
        for optimizer in ("rowwise_adagrad", "adagrad", "sgd"):
            self._run(plans=[w, a, b, c], optimizer=optimizer, steps_before=2)

    def test_reshard_ec_dense_kernel_chain_back(self) -> None:
        a = dict(TW_CW_RW)
        b = {
            "t0": ("row_wise", None),
            "t1": ("table_wise", 1),
            "t2": ("column_wise", [1, 0]),
        }
        self._run(plans=[a, b, a], kernel=DENSE, optimizer=None, steps_before=2)

    def test_reshard_ec_tw_fp16_chain(self) -> None:
        a = {"t0": ("table_wise", 0), "t1": ("table_wise", 1), "t2": ("table_wise", 0)}
        b = {"t0": ("table_wise", 1), "t1": ("table_wise", 0), "t2": ("table_wise", 0)}
        c = {
            "t0": ("column_wise", [0, 1]),
            "t1": ("table_wise", 0),
            "t2": ("row_wise", None),
        }
        self._run(plans=[a, b, c, a], data_type=DataType.FP16, steps_before=1)

    def test_reshard_ec_dtensor_type_changes(self) -> None:
        # DTensor state dicts (ShardingEnv.output_dtensor): trained under w,
        # then every table changes type at every step (TW->CW, CW->RW,
        # RW->TW, TW->DP, then CW->RW, RW->TW, TW->CW, DP->CW), and back.
        w = {**TW_CW_RW, "t3": ("table_wise", 1)}
        a = {
            "t0": ("column_wise", [0, 1]),
            "t1": ("row_wise", None),
            "t2": ("table_wise", 0),
            "t3": ("data_parallel", None),
        }
        b = {
            "t0": ("row_wise", None),
            "t1": ("table_wise", 1),
            "t2": ("column_wise", [1, 0]),
            "t3": ("column_wise", [0, 1]),
        }
        self._run(plans=[w, a, b, w], output_dtensor="env", steps_before=2)

    def test_reshard_ec_dtensor_from_fused_param(self) -> None:
        # The same through the EC's fused-param switch, with the changes the
        # case above lacks: DP->TW, RW->DP, TW->RW, DP->RW, CW->TW.
        x0 = {
            "t0": ("data_parallel", None),
            "t1": ("row_wise", None),
            "t2": ("table_wise", 0),
            "t3": ("column_wise", [0, 1]),
        }
        x1 = {
            "t0": ("table_wise", 1),
            "t1": ("data_parallel", None),
            "t2": ("row_wise", None),
            "t3": ("column_wise", [1, 0]),
        }
        x2 = {
            "t0": ("column_wise", [0, 1]),
            "t1": ("row_wise", None),
            "t2": ("table_wise", 0),
            "t3": ("table_wise", 1),
        }
        self._run(plans=[x0, x1, x2], output_dtensor="fused_param", optimizer="adagrad")

    def test_reshard_ec_untouched_groups_keep_their_lookups(self) -> None:
        self._run_multi_process_test(
            callable=_run_ec_untouched_groups_kept,
            world_size=2,
            port=os.environ["MASTER_PORT"],
        )

    # pyre-ignore[56]
    @settings(
        verbosity=Verbosity.verbose,
        max_examples=4,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(
        old=_ec_plan(world_size=2, num_tables=3),
        new=_ec_plan(world_size=2, num_tables=3),
        optimizer=st.sampled_from([None, "sgd", "adagrad", "rowwise_adagrad"]),
        steps_before=st.integers(0, 2),
    )
    def test_reshard_ec_random_plans(
        self,
        old: Dict[str, TableSpec],
        new: Dict[str, TableSpec],
        optimizer: Optional[str],
        steps_before: int,
    ) -> None:
        self._run(
            plans=[old, new],
            kernel=DENSE if optimizer is None else FUSED,
            optimizer=optimizer,
            steps_before=steps_before,
        )


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Bad resharding requests: every rank raises the same ReshardError naming the
table and the reason, before any data moves; the module is unchanged and keeps
training exactly like an untouched copy. A process-group timeout guarantees
that a mistake here fails instead of hanging.
"""

import copy
import unittest
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding import ReshardError
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    ReshardTestBase,
    train_step,
)
from torchrec.distributed.types import ParameterSharding

PLAN_A = {
    "t0": ("table_wise", 0),
    "t1": ("table_wise", 1),
    "t2": ("column_wise", [0, 1]),
}
PLAN_B = {"t0": ("table_wise", 1), "t1": ("table_wise", 0), "t2": ("table_wise", 0)}


def _moved(
    plan: Dict[str, ParameterSharding], table: str, **changes: Any
) -> ParameterSharding:
    ps = copy.deepcopy(plan[table])
    for key, value in changes.items():
        setattr(ps, key, value)
    return ps


def _shrunk_first_shard(ps: ParameterSharding) -> ParameterSharding:
    ps = copy.deepcopy(ps)
    spec = ps.sharding_spec
    assert isinstance(spec, EnumerableShardingSpec)
    spec.shards[0].shard_sizes = [
        spec.shards[0].shard_sizes[0] - 1,
        spec.shards[0].shard_sizes[1],
    ]
    return ps


def _rank_outside(ps: ParameterSharding) -> ParameterSharding:
    ps = copy.deepcopy(ps)
    spec = ps.sharding_spec
    assert isinstance(spec, EnumerableShardingSpec)
    spec.shards[0].placement = torch.distributed._remote_device("rank:7/cpu")
    ps.ranks = [7]
    return ps


def _overlapping(ps: ParameterSharding) -> ParameterSharding:
    ps = copy.deepcopy(ps)
    spec = ps.sharding_spec
    assert isinstance(spec, EnumerableShardingSpec)
    spec.shards[1].shard_offsets = [0, spec.shards[1].shard_offsets[1] - 4]
    return ps


def _bad_deltas(
    plan_a: Dict[str, ParameterSharding],
    plan_b: Dict[str, ParameterSharding],
    plan_rw_reversed: Dict[str, ParameterSharding],
    rank: int,
) -> Dict[str, Dict[str, Any]]:
    """Per case: the delta this rank passes and the words the error must contain."""
    return {
        "row_wise_shards_not_in_rank_order": {
            "delta": {"t1": plan_rw_reversed["t1"]},
            "words": ["t1", "cannot place its shards as requested"],
        },
        "unknown_table": {
            "delta": {"t0": plan_b["t0"], "no_such_table": plan_b["t1"]},
            "words": ["no_such_table", "not in this module"],
        },
        "rank_out_of_range": {
            "delta": {"t0": _rank_outside(plan_b["t0"])},
            "words": ["t0", "outside the process group"],
        },
        "shards_do_not_tile": {
            "delta": {"t1": _shrunk_first_shard(plan_b["t1"])},
            "words": ["t1", "do not tile"],
        },
        "shards_overlap": {
            "delta": {"t2": _overlapping(plan_a["t2"])},
            "words": ["t2", "overlap"],
        },
        "unsupported_kernel": {
            "delta": {
                "t0": _moved(
                    plan_b,
                    "t0",
                    compute_kernel=EmbeddingComputeKernel.KEY_VALUE.value,
                )
            },
            "words": ["t0", "compute kernel 'key_value'"],
        },
        "unsupported_sharding_type": {
            "delta": {"t0": _moved(plan_b, "t0", sharding_type="table_wise_striped")},
            "words": ["t0", "sharding type 'table_wise_striped'"],
        },
        "ranks_disagree": {
            "delta": {"t0": plan_b["t0"]} if rank == 0 else {"t1": plan_b["t1"]},
            "words": ["different resharding requests"],
        },
        "ranks_disagree_one_invalid": {
            "delta": (
                {"t0": plan_b["t0"]}
                if rank == 0
                else {"t0": _rank_outside(plan_b["t0"])}
            ),
            "words": ["different resharding requests"],
        },
    }


def _run_bad_input_cases(rank: int, world_size: int, port: str, kernel: str) -> None:
    with reshard_scenario(
        rank, world_size, port, 3, kernel=kernel, timeout_s=60
    ) as scenario:
        pg, device, env = scenario.pg, scenario.device, scenario.env
        sharder = scenario.sharder
        plan_a = scenario.plan(PLAN_A)
        plan_b = scenario.plan(PLAN_B)
        # TorchRec's row-wise sharding puts the i-th shard on rank i.
        reversed_rw = ("row_wise", [(0, 0, 5, 16, 1), (5, 0, 22, 16, 0)])
        plan_rw_reversed = scenario.plan({"t1": ("custom", reversed_rw)})
        batches = scenario.batches(3, seed=3)

        module, reference = scenario.twins(plan_a, batches[:1])

        for name, case in _bad_deltas(plan_a, plan_b, plan_rw_reversed, rank).items():
            message = ""
            try:
                sharder.reshard(module, case["delta"], env, device)
            except ReshardError as e:
                message = str(e)
            messages: List[Any] = [None] * world_size
            dist.all_gather_object(messages, message, group=pg)
            assert message, f"{name}: no ReshardError on rank {rank}"
            assert len(set(messages)) == 1, f"{name}: ranks disagree: {messages}"
            for word in case["words"]:
                assert word in message, f"{name}: {word!r} not in {message!r}"
            assert_state_dicts_equal(reference.state_dict(), module.state_dict())
            assert_optimizer_states_equal(reference, module)

        # The module keeps training exactly like the untouched copy.
        dense = [None, None]
        if kernel == "dense":
            dense = [
                torch.optim.SGD(m.parameters(), lr=0.05) for m in (module, reference)
            ]
        for batch in batches[1:]:
            out = train_step(module, batch, dense[0])
            ref = train_step(reference, batch, dense[1])
            assert torch.equal(out, ref)
        assert_state_dicts_equal(reference.state_dict(), module.state_dict())

        # And a good request still works afterwards.
        sharder.reshard(module, {"t0": plan_b["t0"]}, env, device)
        assert module.module_sharding_plan["t0"] == plan_b["t0"]


class DynamicShardingBadInputTest(ReshardTestBase):
    def test_bad_input_fused(self) -> None:
        self.run_ranks(
            _run_bad_input_cases,
            2,
            kernel="fused",
        )

    def test_bad_input_dense(self) -> None:
        self.run_ranks(
            _run_bad_input_cases,
            2,
            kernel="dense",
        )


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
Faults during the shard exchange: a rank raising in the middle of it, and a
rank stalling past the exchange timeout. Every rank must raise
ReshardAbortedError, nothing may hang, and the module must keep training under
its old plan, bit-equal to an untouched copy; a later reshard must still work.
"""

import time
import unittest
import weakref
from datetime import timedelta
from typing import Any, List

import torch
import torch.distributed as dist
from torchrec.distributed.resharding import install, ReshardAbortedError
from torchrec.distributed.resharding.plan import Transfer
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    delta,
    make_batches,
    make_ebc,
    make_plan,
    make_sharder,
    process_group,
    ReshardTestBase,
    shard,
    train_step,
)
from torchrec.distributed.types import ShardingEnv

# t3 stays put in the rebuilt table-wise group: on CPU its new kernel shares
# the old kernel's storage, which an aborted reshard must leave intact.
PLAN_A = {
    "t0": ("table_wise", 0),
    "t1": ("column_wise", [0, 1]),
    "t2": ("row_wise", None),
    "t3": ("table_wise", 0),
}
PLAN_B = {
    "t0": ("table_wise", 1),
    "t1": ("table_wise", 0),
    "t2": ("column_wise", [1, 0]),
    "t3": ("table_wise", 0),
}
EXCHANGE_TIMEOUT = timedelta(seconds=5)


def _raise_on_second_piece() -> Any:
    seen: List[Transfer] = []

    def hook(transfer: Transfer) -> None:
        seen.append(transfer)
        if len(seen) == 2:
            raise RuntimeError("injected fault in the middle of the exchange")

    return hook


def _stall_past_timeout(transfer: Transfer) -> None:
    time.sleep(EXCHANGE_TIMEOUT.total_seconds() * 1.6)


def _run_fault_case(rank: int, world_size: int, port: str, fault: str) -> None:
    with process_group(rank, world_size, port, timeout_s=90) as (pg, device):
        ebc = make_ebc(4)
        rows = [c.num_embeddings for c in ebc.embedding_bag_configs()]
        sharder = make_sharder("rowwise_adagrad")
        env = ShardingEnv.from_process_group(pg)
        plan_a = make_plan(ebc, PLAN_A, world_size, world_size, "fused")
        plan_b = make_plan(ebc, PLAN_B, world_size, world_size, "fused")
        batches = make_batches(4, rows, 4, 4, seed=5)

        module = shard(ebc, sharder, plan_a, env, device)
        reference = shard(ebc, sharder, plan_a, env, device)
        for batch in batches[:2]:
            train_step(module, batch)
            train_step(reference, batch)

        if rank == 1:
            install._exchange_fault_hook = (
                _raise_on_second_piece() if fault == "raise" else _stall_past_timeout
            )
        outcome = "no error"
        try:
            install.reshard_embedding_bag_collection(
                module,
                delta(plan_a, plan_b),
                env,
                device,
                max_inflight_bytes=1024,  # several rounds: fail mid-way
                exchange_timeout=EXCHANGE_TIMEOUT,
            )
        except ReshardAbortedError as e:
            outcome = "aborted"
            assert "module is unchanged" in str(e)
        finally:
            install._exchange_fault_hook = None
        outcomes: List[Any] = [None] * world_size
        dist.all_gather_object(outcomes, outcome, group=pg)
        assert outcomes == ["aborted"] * world_size, outcomes

        # The old module is intact and trains on exactly like the untouched copy.
        assert module.module_sharding_plan == reference.module_sharding_plan
        assert_state_dicts_equal(reference.state_dict(), module.state_dict())
        assert_optimizer_states_equal(reference, module)
        out = train_step(module, batches[2])
        ref = train_step(reference, batches[2])
        assert torch.equal(out, ref)
        assert_state_dicts_equal(reference.state_dict(), module.state_dict())

        # And the next reshard goes through.
        sharder.reshard(module, delta(plan_a, plan_b), env, device)
        sharder.reshard(reference, delta(plan_a, plan_b), env, device)
        assert_state_dicts_equal(reference.state_dict(), module.state_dict())
        assert torch.equal(
            train_step(module, batches[3]), train_step(reference, batches[3])
        )


def _run_stale_exchange_group(rank: int, world_size: int, port: str) -> None:
    """A cached exchange group made for a group that is gone (whose id a new
    group reuses) is not handed out."""
    with process_group(rank, world_size, port) as (pg, _):
        gone = dist.new_group(ranks=list(range(world_size)))
        key = (id(pg), None)
        install._exchange_groups[key] = (weakref.ref(gone), gone)
        try:
            group = install._exchange_group(pg, None)
            assert group is not gone
            assert install._exchange_groups[key][0]() is pg
            assert install._exchange_group(pg, None) is group  # cached now
            out = torch.zeros(world_size)
            dist.all_to_all_single(
                out, torch.full((world_size,), rank + 1.0), group=group
            )
            assert out.tolist() == [r + 1.0 for r in range(world_size)]
        finally:
            install._exchange_groups.pop(key, None)


class DynamicShardingFaultTest(ReshardTestBase):
    def test_stale_exchange_group_is_not_reused(self) -> None:
        self.run_ranks(_run_stale_exchange_group, 2)

    def test_rank_raises_mid_exchange(self) -> None:
        self.run_ranks(
            _run_fault_case,
            2,
            fault="raise",
        )

    def test_rank_times_out_mid_exchange(self) -> None:
        self.run_ranks(
            _run_fault_case,
            2,
            fault="timeout",
        )


if __name__ == "__main__":
    unittest.main()

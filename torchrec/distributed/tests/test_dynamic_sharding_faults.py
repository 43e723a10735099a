#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Faults during the shard exchange: a rank raising in the middle of it, and a
rank stalling past the exchange timeout. Every rank must raise
ReshardAbortedError, nothing may hang, and the module must keep training under
its old plan, bit-equal to an untouched copy; a later reshard must still work.
"""

import time
import unittest
from datetime import timedelta
from typing import Any, Callable, List, Tuple
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torchrec.distributed.resharding import (
    exchange_group,
    exchange_groups,
    reshard_module,
    ReshardAbortedError,
    ReshardOptions,
    slots,
)
from torchrec.distributed.resharding.exchange_group import ExchangeGroup
from torchrec.distributed.resharding.exchange_groups import kept_exchange_groups
from torchrec.distributed.resharding.fields import Field
from torchrec.distributed.resharding.plan import Transfer
from torchrec.distributed.resharding.slots import LocalSlot, read_piece
from torchrec.distributed.test_utils.reshard_scenario import (
    MIXED_PLAN_A,
    MIXED_PLAN_B,
    reshard_scenario,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    delta,
    ReshardTestBase,
    train_step,
)

EXCHANGE_TIMEOUT = timedelta(seconds=5)


def _faulty_read_piece(fault: str) -> Callable[..., torch.Tensor]:
    """``read_piece`` that raises on the second piece, or stalls past the timeout."""
    seen: List[Transfer] = []

    def faulty(slot: LocalSlot, transfer: Transfer, f: Field) -> torch.Tensor:
        seen.append(transfer)
        if fault == "raise" and len(seen) == 2:
            raise RuntimeError("injected fault in the middle of the exchange")
        if fault == "timeout" and len(seen) == 1:
            time.sleep(EXCHANGE_TIMEOUT.total_seconds() * 1.6)
        return read_piece(slot, transfer, f)

    return faulty


def _run_fault_case(rank: int, world_size: int, port: str, fault: str) -> None:
    with reshard_scenario(rank, world_size, port, 4, timeout_s=90) as scenario:
        pg, device, env = scenario.pg, scenario.device, scenario.env
        sharder = scenario.sharder
        # t3 stays put in the rebuilt table-wise group: on CPU its new kernel
        # shares the old kernel's storage, which an aborted reshard must leave
        # intact.
        plan_a = scenario.plan(MIXED_PLAN_A)
        plan_b = scenario.plan(MIXED_PLAN_B)
        batches = scenario.batches(4, seed=5)

        module, reference = scenario.twins(plan_a, batches[:2])

        faulty = _faulty_read_piece(fault) if rank == 1 else read_piece
        outcome = "no error"
        try:
            with mock.patch.object(slots, "read_piece", faulty):
                reshard_module(
                    module,
                    delta(plan_a, plan_b),
                    env,
                    device,
                    ReshardOptions(
                        max_inflight_bytes=1024,  # several rounds: fail mid-way
                        exchange_timeout=EXCHANGE_TIMEOUT,
                    ),
                )
        except ReshardAbortedError as e:
            outcome = "aborted"
            assert "module is unchanged" in str(e)
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


def _registry() -> Tuple[int, int, int]:
    world = c10d._world
    return len(world.pg_map), len(world.pg_names), world.group_count


def _run_exchange_group_per_reshard(rank: int, world_size: int, port: str) -> None:
    """Without ``ReshardOptions.exchange_groups`` the module's ShardingEnv
    keeps the exchange group (``exchange_groups.kept_exchange_groups``):
    three reshards connect one group, the same on every rank, which stays
    open for the next and is never registered in torch.distributed (nothing
    is cached for the process or keyed by a group's id)."""
    with reshard_scenario(rank, world_size, port, 4) as scenario:
        pg, device, env = scenario.pg, scenario.device, scenario.env
        plan_a = scenario.plan(MIXED_PLAN_A)
        plan_b = scenario.plan(MIXED_PLAN_B)
        module = scenario.shard(plan_a)
        registry = _registry()
        opened: List[str] = []
        closed: List[str] = []
        open_group = exchange_group.open_exchange_group
        close_group = ExchangeGroup.close

        def recording_open(*args: Any, **kwargs: Any) -> ExchangeGroup:
            group = open_group(*args, **kwargs)
            opened.append(group.name)
            return group

        def recording_close(group: ExchangeGroup) -> None:
            closed.append(group.name)
            close_group(group)

        with (
            mock.patch.object(exchange_groups, "open_exchange_group", recording_open),
            mock.patch.object(ExchangeGroup, "close", recording_close),
        ):
            for old, new in ((plan_a, plan_b), (plan_b, plan_a), (plan_a, plan_b)):
                reshard_module(module, delta(old, new), env, device)
                assert closed == [], closed
                assert _registry() == registry, (_registry(), registry)
        assert len(opened) == 1, opened
        ranks = dist.get_process_group_ranks(pg)
        assert kept_exchange_groups(env).kept_name(ranks, device) == opened[0]
        names: List[Any] = [None] * world_size
        dist.all_gather_object(names, opened, group=pg)
        assert all(n == opened for n in names), names


class DynamicShardingFaultTest(ReshardTestBase):
    def test_the_env_keeps_one_exchange_group_for_every_reshard(self) -> None:
        self.run_ranks(_run_exchange_group_per_reshard, 2)

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

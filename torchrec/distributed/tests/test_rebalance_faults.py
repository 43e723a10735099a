#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The rebalancer's bad input and faults (2 gloo ranks), each leaving training
on the current plan with nothing lost: a planner that finds no feasible plan
(logged as the decision, training goes on); ranks whose statistics differ
(the same ``RebalanceError`` on every rank); a reshard that aborts (a rank
does not join: every rank records the failure, the weights and the plan are
unchanged, the policy backs off, and the next attempt after the back-off
goes through).
"""

import unittest
from dataclasses import replace
from datetime import timedelta
from typing import Any, List

import torch
import torch.distributed as dist
from torchrec.distributed.planner import Topology
from torchrec.distributed.resharding.plan import ReshardAbortedError
from torchrec.distributed.resharding.policy import RebalancePolicy
from torchrec.distributed.resharding.rebalancer import RebalanceError, Rebalancer
from torchrec.distributed.resharding.transaction import ReshardOptions
from torchrec.distributed.test_utils.rebalance_utils import (
    decision_summary,
    loaded_batches,
    planned,
    rebalance_model,
    table_wise_planner,
    tables_on,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_state_dicts_equal,
    global_weights,
    process_group,
    ReshardTestBase,
)
from torchrec.distributed.types import ShardingEnv

NUM_TABLES, ROWS, DIM, BATCH = 4, 32, 8, 6


def _same_everywhere(value: Any) -> None:
    values: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), values


def _train(model: Any, optimizer: Any, batch: Any) -> None:
    optimizer.zero_grad()
    loss, _ = model(batch)
    loss.backward()
    optimizer.step()


def _run_faults(rank: int, world_size: int, port: str) -> None:
    with process_group(rank, world_size, port) as (pg, device):
        env = ShardingEnv.from_process_group(pg)
        planner = table_wise_planner(world_size, BATCH, [2] * NUM_TABLES)
        plan = planned(planner, NUM_TABLES, ROWS, DIM)
        hot = set(tables_on(plan, 0))
        loads = [[12 if i in hot else 1 for i in range(NUM_TABLES)]] * 40
        batches = iter(loaded_batches(loads, rank, ROWS, BATCH))
        model, optimizer = rebalance_model(env, device, plan, NUM_TABLES, ROWS, DIM)

        # 1. No feasible plan: the decision says so, training goes on.
        tiny = Topology(world_size=world_size, compute_device="cpu", ddr_cap=1024)
        stuck = Rebalancer(
            model, tiny, RebalancePolicy(window=2, hysteresis=1), batch_size=BATCH
        )
        for _ in range(2):
            _train(model, optimizer, next(batches))
            decision = stuck.step()
        assert decision is not None and decision.action == "keep", decision
        assert "no feasible plan" in decision.reason, decision.reason
        _same_everywhere(decision_summary([decision]))
        stuck.close()
        assert model.plan.plan == plan.plan

        # 2. Statistics that differ between ranks: the same error everywhere.
        guard = Rebalancer(model, planner, RebalancePolicy(window=2, hysteresis=1))
        for _ in range(2):
            _train(model, optimizer, next(batches))
            guard.monitor.end_step()
        if rank == 1:
            guard.monitor.end_step()  # one step more than the others
        try:
            guard.monitor.collect(pg)
        except ValueError as e:
            assert "different numbers of steps" in str(e)
        else:
            raise AssertionError("different step counts went unnoticed")
        stats = guard.monitor.collect(pg)  # an empty window, equal everywhere
        if rank == 1:
            stats = replace(stats, steps=stats.steps + 1)
        try:
            guard._agree_on_proposal(stats)
        except RebalanceError as e:
            assert "statistics differ" in str(e)
        else:
            raise AssertionError("differing statistics went unnoticed")
        guard.close()
        assert model.plan.plan == plan.plan

        # 3. A reshard that aborts: rank 1 never joins.
        policy = RebalancePolicy(
            window=2, hysteresis=1, min_interval=2, backoff=2, horizon=10**6
        )
        rebalancer = Rebalancer(
            model,
            planner,
            policy,
            options=ReshardOptions(exchange_timeout=timedelta(seconds=4)),
        )
        if rank == 1:

            def never_joins(new_plan: Any, options: Any = None) -> Any:
                raise ReshardAbortedError("rank 1 does not join (injected)")

            model.reshard = never_joins  # this model object only
        _train(model, optimizer, next(batches))
        assert rebalancer.step() is None
        _train(model, optimizer, next(batches))
        before = global_weights(model, pg)
        state = model.state_dict()
        decision = rebalancer.step()  # step 2: the reshard aborts
        assert decision is not None and decision.action == "failed", decision
        after = global_weights(model, pg)
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]), key
        assert_state_dicts_equal(state, model.state_dict())
        assert model.plan.plan == plan.plan
        assert rebalancer.state.failures == 1
        assert rebalancer.state.blocked_until == 2 + 2 * 2, rebalancer.state
        _same_everywhere(
            (decision.action, decision.step, rebalancer.state, decision.tables)
        )
        if rank == 1:
            del model.reshard
        # Training goes on; the policy backs off until step 6, then reshards.
        for _ in range(2):
            _train(model, optimizer, next(batches))
            decision = rebalancer.step()
        assert decision is not None and decision.action == "keep", decision
        assert "backing off" in decision.reason, decision.reason
        _train(model, optimizer, next(batches))
        assert rebalancer.step() is None
        _train(model, optimizer, next(batches))
        decision = rebalancer.step()
        assert (
            decision is not None and decision.action == "reshard"
        ), rebalancer.history_table()
        assert rebalancer.state.failures == 0
        assert model.plan.plan == decision.plan.plan  # pyre-ignore[16]
        rebalancer.close()


class RebalanceFaultsTest(ReshardTestBase):
    def test_no_plan_differing_statistics_and_aborted_reshard(self) -> None:
        self.run_ranks(_run_faults)


if __name__ == "__main__":
    unittest.main()

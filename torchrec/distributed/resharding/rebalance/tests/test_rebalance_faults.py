#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The rebalancer's faults (2 gloo ranks), each leaving training on the current
plan with nothing lost and every rank deciding the same.

A DLRM of 4 tables, t0 and t1 on rank 0, t2 and t3 on rank 1. With t0 alone
hot no move of whole tables pays, but splitting could: the full replan runs
in a background thread of rank 0:

1. it fails: the next window says so on every rank, the policy backs off;
2. it is slow: windows go on (their ``step()`` returns while it still runs)
   and say it runs; once it finishes, the next window takes its plan, the
   ranks agree on it and reshard to it;
3. its plan no longer fits a rank's memory: refused, training goes on.

Then: ranks that decide from different settings, and ranks that counted
different steps, keep the plan and back off on every rank; with t0 and t1
hot the search moves one, and a reshard that aborts (rank 1 does not join)
leaves every weight as it was, backs off, and goes through afterwards.
"""

import threading
import time
import unittest
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import ReshardAbortedError
from torchrec.distributed.resharding.rebalance.placement import module_plan
from torchrec.distributed.resharding.rebalance.policy import RebalancePolicy
from torchrec.distributed.resharding.rebalance.rebalancer import (
    RebalanceDecision,
    Rebalancer,
)
from torchrec.distributed.resharding.rebalance.replan import ReplanRequest
from torchrec.distributed.test_utils.rebalance_utils import (
    cpu_topology,
    decision_summary,
    dlrm_train_step,
    hand_plan,
    loaded_batches,
    rebalance_model,
    same_everywhere,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    global_weights,
    ReshardTestBase,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan

NUM_TABLES, ROWS, DIM, BATCH = 4, 64, 16, 64
HOT, COLD = 5000, 1
WINDOW = 2
START = {
    "t0": ("table_wise", 0),
    "t1": ("table_wise", 0),
    "t2": ("table_wise", 1),
    "t3": ("table_wise", 1),
}
TABLE_BYTES = ROWS * DIM * 4 * 2  # weights and optimizer state (state_factor 2)


def _wait(what: Callable[[], bool], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "waited too long"
        time.sleep(0.01)


class _Job:
    """The model, its optimizer and its batches (t0 hot, or t0 and t1)."""

    def __init__(self, rank: int, env: ShardingEnv, device: torch.device) -> None:
        self.plan: ShardingPlan = hand_plan(START, NUM_TABLES, ROWS, DIM, 2)
        self.model, self.optimizer = rebalance_model(
            env, device, self.plan, NUM_TABLES, ROWS, DIM
        )
        one_hot = [[HOT, COLD, COLD, COLD]] * 60
        two_hot = [[HOT, HOT, COLD, COLD]] * 40
        self.batches: Iterator[Any] = iter(
            loaded_batches(one_hot + two_hot, rank, ROWS, BATCH)
        )
        self.one_hot_left = len(one_hot)

    def train_step(self) -> None:
        dlrm_train_step(self.model, self.optimizer, next(self.batches))
        self.one_hot_left -= 1

    def train(self, rebalancer: Rebalancer) -> Optional[RebalanceDecision]:
        """One step and the rebalancer's call after it."""
        self.train_step()
        return rebalancer.step()

    def window(self, rebalancer: Rebalancer) -> RebalanceDecision:
        decision = None
        for _ in range(WINDOW):
            decision = self.train(rebalancer)
        assert decision is not None
        same_everywhere(decision_summary([decision]))
        return decision


def _rebalancer(
    job: _Job,
    replanner: Callable[[ReplanRequest], ShardingPlan],
    min_gain: float = 0.05,
    ddr_cap: Optional[int] = None,
    options: Optional[ReshardOptions] = None,
) -> Rebalancer:
    return Rebalancer(
        job.model,
        cpu_topology(2, ddr_cap),
        RebalancePolicy(
            window=WINDOW,
            min_gain=min_gain,
            hysteresis=1,
            min_interval=WINDOW,
            backoff=2,
            horizon=10**6,
            # the injected replans split 16-column tables, which pays only
            # priced by elements (on CPU an id costs a shard far more than
            # 16 columns): these tests are about the replan's faults
            lookup_columns=0.0,
        ),
        batch_size=BATCH,
        options=options,
        replanner=replanner,
    )


def _failed_replan(job: _Job, rank: int) -> None:
    def fails(request: ReplanRequest) -> ShardingPlan:
        raise PlannerError("no feasible plan (injected)")

    rebalancer = _rebalancer(job, fails)
    decision = job.window(rebalancer)
    assert "full replan started" in decision.reason, decision
    if rank == 0:
        _wait(lambda: rebalancer.replan_ready)
    dist.barrier()
    decision = job.window(rebalancer)
    assert decision.action == "keep", decision
    assert "failed: PlannerError: no feasible plan (injected)" in decision.reason
    assert rebalancer.state.replan_failures == 1
    assert rebalancer.state.replan_blocked_until == decision.step + WINDOW * 2
    decision = job.window(rebalancer)  # backing off: no new replan
    assert "full replan started" not in decision.reason, decision
    rebalancer.close()
    assert job.model.plan.plan == job.plan.plan


def _slow_replan(job: _Job, rank: int) -> None:
    release, returned = threading.Event(), threading.Event()
    split = hand_plan(
        {**START, "t0": ("column_wise", [0, 1])}, NUM_TABLES, ROWS, DIM, 2
    )

    def slow(request: ReplanRequest) -> ShardingPlan:
        release.wait(120)
        returned.set()
        return split

    rebalancer = _rebalancer(job, slow)
    decision = job.window(rebalancer)
    assert "full replan started" in decision.reason, decision
    for _ in range(2):  # the windows go on while it runs
        decision = job.window(rebalancer)
        assert not returned.is_set()
        assert "a full replan runs in the background" in decision.reason, decision
    release.set()
    if rank == 0:
        _wait(lambda: rebalancer.replan_ready)
    dist.barrier()
    decision = job.window(rebalancer)
    assert decision.source == "full replan", decision
    assert decision.action == "reshard", rebalancer.history_table()
    assert decision.tables == ("model.sparse_arch.embedding_bag_collection:t0",)
    t0 = module_plan(job.model.plan, "model.sparse_arch.embedding_bag_collection")["t0"]
    assert (t0.sharding_type, t0.ranks) == ("column_wise", [0, 1]), t0
    assert rebalancer.state.replan_failures == 0
    job.window(rebalancer)  # trains on under the new plan
    rebalancer.close()
    job.model.reshard(job.plan)  # back to the start for the next phases


def _replan_that_no_longer_fits(job: _Job, rank: int) -> None:
    piled = hand_plan({t: ("table_wise", 1) for t in START}, NUM_TABLES, ROWS, DIM, 2)
    rebalancer = _rebalancer(
        job, lambda request: piled, ddr_cap=2 * TABLE_BYTES + TABLE_BYTES // 2
    )
    job.window(rebalancer)
    if rank == 0:
        _wait(lambda: rebalancer.replan_ready)
    dist.barrier()
    decision = job.window(rebalancer)
    assert "no longer fits the memory of ranks [1]" in decision.reason, decision
    assert decision.action == "keep"
    rebalancer.close()
    assert job.model.plan.plan == job.plan.plan


def _ranks_that_disagree(job: _Job, rank: int) -> None:
    # different settings: every rank sees the digests differ
    rebalancer = _rebalancer(job, lambda r: job.plan, min_gain=0.05 + 0.1 * rank)
    decision = job.window(rebalancer)
    assert "decide from different plans, policy states or settings" in (
        decision.reason
    ), decision
    assert rebalancer.state.failures == 1
    rebalancer.close()
    # different step counts: every rank reads it from the reduced counters
    rebalancer = _rebalancer(job, lambda r: job.plan)
    job.train(rebalancer)
    if rank == 1:
        rebalancer.monitor.end_step()  # one step more than the others
    decision = job.train(rebalancer)
    assert decision is not None and "load statistics differ" in decision.reason
    assert rebalancer.state.failures == 1
    same_everywhere((decision.action, decision.reason, rebalancer.state))
    rebalancer.close()
    assert job.model.plan.plan == job.plan.plan


def _aborted_reshard(job: _Job, rank: int, pg: dist.ProcessGroup) -> None:
    while job.one_hot_left > 0:  # on to the load with t0 and t1 hot
        job.train_step()
    rebalancer = _rebalancer(
        job,
        lambda r: job.plan,
        options=ReshardOptions(exchange_timeout=timedelta(seconds=4)),
    )
    if rank == 1:

        def never_joins(new_plan: Any, options: Any = None) -> Any:
            raise ReshardAbortedError("rank 1 does not join (injected)")

        job.model.reshard = never_joins  # this model object only
    job.train(rebalancer)
    job.train_step()
    before = global_weights(job.model, pg)
    state = job.model.state_dict()
    decision = rebalancer.step()  # the search moves a hot table: aborts
    assert decision is not None and decision.action == "failed", decision
    assert decision.source == "search", decision
    after = global_weights(job.model, pg)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert_state_dicts_equal(state, job.model.state_dict())
    assert job.model.plan.plan == job.plan.plan
    assert rebalancer.state.failures == 1
    same_everywhere((decision.action, decision.step, rebalancer.state))
    if rank == 1:
        del job.model.reshard
    assert rebalancer.state.blocked_until == decision.step + 2 * WINDOW
    decision = job.window(rebalancer)
    assert "backing off" in decision.reason, decision
    decision = job.window(rebalancer)  # the back-off is over
    assert decision.action == "reshard", rebalancer.history_table()
    assert rebalancer.state.failures == 0
    assert decision.plan is not None
    assert job.model.plan.plan == decision.plan.plan
    rebalancer.close()


def _run_faults(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, device = context.pg, context.device
        job = _Job(rank, ShardingEnv.from_process_group(pg), device)
        _failed_replan(job, rank)
        _slow_replan(job, rank)
        _replan_that_no_longer_fits(job, rank)
        _ranks_that_disagree(job, rank)
        _aborted_reshard(job, rank, pg)


class RebalanceFaultsTest(ReshardTestBase):
    def test_replan_faults_disagreement_and_aborted_reshard(self) -> None:
        self.run_ranks(_run_faults)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The full replan in a process of its own: a request survives its trip as
plain data (the plan both ways, and the planner given the rebuilt request
plans what it plans for the original); the child's plan equals TorchRec's
planner run here on the same request; while the child plans, the training
process runs no function of ``torchrec.distributed.planner`` (seen by a
profiler hooked on every thread, which does see the planner when it runs in
a thread instead); the child runs at the lowest priority (nice 19, and
SCHED_IDLE on Linux), reports a failed replan as an error, is killed by
``close`` while it plans, and exits by itself when its parent is SIGKILLed.
"""

import os
import signal
import subprocess
import sys
import threading
import time
import unittest
from types import FrameType
from typing import Any, Callable, List, Optional, Set, Union

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.resharding.rebalance.replan import (
    BackgroundReplanner,
    full_replan,
    NON_REPLICATED_TYPES,
    ReplanRequest,
    ReplanResult,
    ThreadReplanner,
)
from torchrec.distributed.resharding.rebalance.replan_process import (
    job_from_request,
    plan_from_data,
    plan_to_data,
    ProcessReplanner,
    request_from_job,
)
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

PATH = "sparse.ebc"
ROWS, DIM, BATCH = 1000, 32, 64
PLANNER_DIR: str = os.sep + os.path.join("torchrec", "distributed", "planner") + os.sep


def _skeleton(num_tables: int) -> torch.nn.Module:
    root = torch.nn.Module()
    root.sparse = torch.nn.Module()
    root.sparse.ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t{i}",
                embedding_dim=DIM,
                num_embeddings=ROWS,
                feature_names=[f"f{i}"],
            )
            for i in range(num_tables)
        ],
        device=torch.device("meta"),
    )
    return root


def _request(num_tables: int, world: int, step: int = 10) -> ReplanRequest:
    """Tables round-robin table-wise (t0 column-wise), a heavy-tailed load."""
    skeleton = _skeleton(num_tables)
    per_param = {f"t{i}": table_wise(i % world) for i in range(1, num_tables)}
    per_param["t0"] = column_wise(ranks=[0, 1])
    current = ShardingPlan(
        {
            PATH: construct_module_sharding_plan(
                skeleton.sparse.ebc,
                per_param_sharding=per_param,
                sharder=EmbeddingBagCollectionSharder(),
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
        }
    )
    constraints = {
        f"t{i}": ParameterConstraints(
            sharding_types=list(NON_REPLICATED_TYPES),
            compute_kernels=["fused"],
            pooling_factors=[64.0 / (i + 1)],
            num_poolings=[1.0],
        )
        for i in range(num_tables)
    }
    return ReplanRequest(
        step=step,
        definition=skeleton,
        sharders=(EmbeddingBagCollectionSharder(),),
        topology=Topology(
            world_size=world, compute_device="cpu", local_world_size=world
        ),
        batch_size=BATCH,
        constraints=constraints,
        current=current,
        tables={PATH: [(f"t{i}", ROWS, DIM) for i in range(num_tables)]},
        element_bytes={f"{PATH}:t{i}": 4 for i in range(num_tables)},
        device_type="cpu",
    )


def fails(request: ReplanRequest) -> ShardingPlan:
    """A replanner without a feasible plan (importable by the child)."""
    raise PlannerError("no feasible plan (injected)")


def sleeps(request: ReplanRequest) -> ShardingPlan:
    """A replanner that plans for ten minutes (importable by the child)."""
    time.sleep(600)
    return request.current


def _wait(what: Callable[[], bool], seconds: float = 300.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "waited too long"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """The process runs (a zombie that no one reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class _PlannerCalls:
    """
    Functions of torchrec.distributed.planner entered: on threads started
    after ``watch_threads``, and on this one after ``watch_this_thread``.
    """

    def __init__(self) -> None:
        self.planner: Set[str] = set()
        self.calls: int = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            self.calls += 1
            if PLANNER_DIR in frame.f_code.co_filename:
                self.planner.add(frame.f_code.co_qualname)

    def watch_threads(self) -> None:
        threading.setprofile(self)

    def watch_this_thread(self) -> None:
        sys.setprofile(self)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # pyre-ignore[6]


def _train_while(
    replanner: Union[ProcessReplanner, ThreadReplanner], request: ReplanRequest
) -> _PlannerCalls:
    """
    Steps of a small model, polling the replanner, until it is ready: the
    planner functions this process enters from the moment ``start`` returns
    (``start`` reads the request, the Topology's properties included).
    """
    x, w = torch.randn(64, 64), torch.randn(64, 64, requires_grad=True)
    seen = _PlannerCalls()
    seen.watch_threads()
    try:
        replanner.start(request)
        seen.watch_this_thread()
        deadline = time.monotonic() + 300
        while not replanner.ready():
            assert time.monotonic() < deadline, "the replan never finished"
            (x @ w).relu().sum().backward()
            time.sleep(0.002)
    finally:
        seen.stop()
    return seen


class PlainDataTest(unittest.TestCase):
    def test_a_plan_and_a_request_survive_the_trip_as_plain_data(self) -> None:
        request = _request(6, 2)
        plan = request.current
        self.assertEqual(plan_from_data(plan_to_data(plan)).plan, plan.plan)
        rebuilt = request_from_job(job_from_request(request))
        self.assertEqual(dict(rebuilt.constraints), dict(request.constraints))
        self.assertEqual(rebuilt.current.plan, plan.plan)
        self.assertEqual(
            [d.storage for d in rebuilt.topology.devices],
            [d.storage for d in request.topology.devices],
        )
        self.assertEqual(
            full_replan(rebuilt).plan, full_replan(request).plan
        )  # the planner sees the same problem


class ProcessReplannerTest(unittest.TestCase):
    def test_the_child_plans_while_this_process_runs_no_planner_code(self) -> None:
        request = _request(24, 4)
        expected = full_replan(request)  # TorchRec's planner, here
        replanner = ProcessReplanner()
        try:
            seen = _train_while(replanner, request)
            pid = replanner.pid
            assert pid is not None
            self.assertEqual(os.getpriority(os.PRIO_PROCESS, pid), 19)
            if hasattr(os, "SCHED_IDLE"):
                self.assertEqual(os.sched_getscheduler(pid), os.SCHED_IDLE)
            self.assertGreater(seen.calls, 0)  # the profiler was on
            self.assertEqual(seen.planner, set())
            result = replanner.take()
            assert isinstance(result, ReplanResult)
            self.assertIsNone(result.error)
            assert result.plan is not None
            self.assertEqual(plan_to_data(result.plan), plan_to_data(expected))
            self.assertEqual(result.plan.plan, expected.plan)
            self.assertEqual(result.step, request.step)
            self.assertFalse(replanner.busy)
            # the child is kept: a second replan goes to the same process
            seen = _train_while(replanner, _request(24, 4, step=20))
            self.assertEqual(replanner.pid, pid)
            self.assertEqual(seen.planner, set())
            second = replanner.take()
            assert second is not None and second.plan is not None
            self.assertEqual((second.step, second.plan.plan), (20, expected.plan))
        finally:
            replanner.close()
        self.assertFalse(_alive(pid))

    def test_the_profiler_sees_the_planner_in_a_thread(self) -> None:
        seen = _train_while(ThreadReplanner(full_replan), _request(8, 2))
        self.assertIn("EmbeddingShardingPlanner.plan", seen.planner)

    def test_a_failed_replan_comes_back_as_an_error(self) -> None:
        replanner = ProcessReplanner(fails)
        try:
            replanner.start(_request(4, 2))
            self.assertTrue(replanner.busy)
            with self.assertRaisesRegex(RuntimeError, "runs already"):
                replanner.start(_request(4, 2))
            _wait(replanner.ready)
            result = replanner.take()
            assert result is not None
            self.assertIsNone(result.plan)
            self.assertEqual(result.error, "PlannerError: no feasible plan (injected)")
            self.assertIsNone(replanner.take())
        finally:
            replanner.close()

    def test_close_kills_a_child_that_plans(self) -> None:
        replanner = ProcessReplanner(sleeps)
        replanner.start(_request(4, 2))
        pid = replanner.pid
        assert pid is not None
        time.sleep(0.5)
        self.assertFalse(replanner.ready())
        replanner.close()
        self.assertFalse(_alive(pid))

    def test_a_replanner_the_child_cannot_import_is_refused(self) -> None:
        with self.assertRaisesRegex(ValueError, "importable by name"):
            ProcessReplanner(lambda request: request.current)

    def test_the_thread_replanner_is_deprecated(self) -> None:
        with self.assertWarns(DeprecationWarning):
            BackgroundReplanner(fails)


_ORPHAN_PARENT = """
import os, signal, sys, time
from torchrec.distributed.resharding.rebalance.replan_process import ProcessReplanner
from torchrec.distributed.resharding.rebalance.tests.test_replan_process import (
    _request, sleeps,
)
replanner = ProcessReplanner(sleeps)
replanner.start(_request(4, 2))
print(replanner.pid, flush=True)
time.sleep(1)
os.kill(os.getpid(), signal.SIGKILL)
"""


class OrphanTest(unittest.TestCase):
    def test_the_child_exits_when_its_parent_is_killed(self) -> None:
        parent = subprocess.run(
            [sys.executable, "-c", _ORPHAN_PARENT],
            stdout=subprocess.PIPE,
            timeout=300,
        )
        self.assertEqual(parent.returncode, -signal.SIGKILL)
        pid = int(parent.stdout.split()[0])
        _wait(lambda: not _alive(pid), seconds=120)

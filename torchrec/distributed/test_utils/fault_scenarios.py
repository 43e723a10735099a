#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Training jobs under a ``FaultTolerance`` that lose ranks at chosen points
(``fault_worker`` launches them and holds the oracle).

Each rank trains the model of ``reshard_model_utils`` (pooled and sequence
embeddings: data-parallel, table-wise, column-wise, row-wise tables, a dense
layer) with ``FaultTolerance.step``. A :class:`Scenario` names the losses
(:class:`Event`): a rank dies (``os._exit``) or hangs in the forward, the
backward (a hook on the dense gradient), the optimizer step, while sending
a snapshot, in the exchange of a reshard every rank starts, or in the
exchange of the recovery of an earlier loss. Every rank records its own
state when a snapshot or a checkpoint is taken; at each recovery the
survivors record what they hold (``on_failure``) and afterwards check the
recovered model with ``fault_worker.assert_matches_direct``. A loss no
source covers must stop every survivor with the lost tables named, and its
state must save.
"""

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.resharding import slots
from torchrec.distributed.resharding.fault import (
    Failure,
    FaultOptions,
    FaultTolerance,
    FaultToleranceError,
    RankFencedError,
    RecoveryReport,
    UnrecoverableLossError,
)
from torchrec.distributed.resharding.fault.recovery import Recovery
from torchrec.distributed.resharding.fault.snapshot import BuddySnapshot
from torchrec.distributed.test_utils.fault_worker import (
    assert_matches_direct,
    die,
    JobResult,
    killed_at,
    load_record,
    local_state,
    LocalState,
    run_job,
    save_record,
    STORE_PREFIX,
)
from torchrec.distributed.test_utils.reshard_model_utils import (
    make_dense_optimizer,
    model_batch,
    model_definition,
    model_plan,
    model_sharders,
)
from torchrec.distributed.test_utils.reshard_utils import make_plan, TableSpec
from torchrec.distributed.types import ShardingEnv, ShardingPlan

# where a rank dies or hangs
POINTS = ("forward", "backward", "optimizer", "snapshot", "reshard", "recovery")


@dataclass(frozen=True)
class Event:
    """
    A rank lost at a chosen point.

    Args:
        step (int): the step it happens in (the steps the job completed
            before it; for "snapshot": the snapshot after that many steps).
        rank (int): the global rank that dies (or hangs).
        point (str): where (:data:`POINTS`; "recovery": in the exchange of
            the recovery that follows an earlier loss).
        hang_s (float): hang this long instead of dying (0: die).
    """

    step: int
    rank: int
    point: str
    hang_s: float = 0.0


@dataclass(frozen=True)
class Scenario:
    """
    One job.

    Args:
        world_size (int): ranks at the start.
        steps (int): training steps the survivors complete in all.
        events (Tuple[Event, ...]): the losses.
        sources (Tuple[str, ...]): the configured sources.
        snapshot_every (int): steps between buddy snapshots.
        checkpoint_every (int): steps between checkpoints (0: none).
        collective_timeout_s (float): the training groups' timeout.
        plan_specs (Optional[Dict[str, Dict[str, TableSpec]]]): the plan's
            specs per module (default: ``model_specs(world_size, 0)``).
    """

    world_size: int
    steps: int
    events: Tuple[Event, ...]
    sources: Tuple[str, ...] = ("replica", "checkpoint")
    snapshot_every: int = 0
    checkpoint_every: int = 0
    collective_timeout_s: float = 5.0
    plan_specs: Optional[Dict[str, Dict[str, TableSpec]]] = None

    def options(self) -> FaultOptions:
        return FaultOptions(
            heartbeat_interval=timedelta(milliseconds=100),
            heartbeat_timeout=timedelta(seconds=1.5),
            collective_timeout=timedelta(seconds=self.collective_timeout_s),
            recovery_timeout=timedelta(seconds=30),
            sources=self.sources,
            snapshot_every=self.snapshot_every,
        )

    def plan(self) -> ShardingPlan:
        """The plan the job starts with."""
        if self.plan_specs is None:
            return model_plan(self.world_size, 0)
        model = model_definition("cpu")
        return ShardingPlan(
            {
                name: make_plan(
                    getattr(model, name),
                    specs,
                    self.world_size,
                    self.world_size,
                    "fused",
                )
                for name, specs in self.plan_specs.items()
            }
        )


# the plan of the job whose first lost rank holds only data-parallel replicas
REPLICA_SPECS: Dict[str, Dict[str, TableSpec]] = {
    "ebc": {
        "t0": ("data_parallel", None),
        "t1": ("table_wise", 0),
        "t2": ("column_wise", [1, 0]),
        "t3": ("table_wise", 1),
    },
    "ec": {"t0": ("table_wise", 2), "t1": ("table_wise", 0)},
}
# the hung job: its training groups' timeout, and how long its rank hangs
HUNG_COLLECTIVE_TIMEOUT_S: float = 3.0
HANG_S: float = 20.0

# The jobs the fault tests check and the fault matrix times, by name:
#   forward: rank 3 dies in the forward of step 3 (4 -> 3), rank 1 in the
#     backward of step 7 (3 -> 2); checkpoints after steps 2, 4, 6
#   optimizer: a snapshot after every step; rank 2 dies in the optimizer step
#     of step 3, rank 0 while sending the snapshot after step 6
#   replica: rank 3 holds only replicas (4 -> 3); rank 1 dies in the
#     exchange of a reshard every rank starts (3 -> 2)
#   hung: rank 2 hangs in the forward of step 2, rank 3 dies during the
#     recovery from it (4 -> 2)
FAULT_JOBS: Dict[str, Scenario] = {
    "forward": Scenario(
        4, 9, (Event(3, 3, "forward"), Event(7, 1, "backward")), checkpoint_every=2
    ),
    "optimizer": Scenario(
        world_size=4,
        steps=9,
        events=(Event(3, 2, "optimizer"), Event(6, 0, "snapshot")),
        sources=("replica", "snapshot"),
        snapshot_every=1,
    ),
    "replica": Scenario(
        4,
        8,
        (Event(2, 3, "forward"), Event(5, 1, "reshard")),
        checkpoint_every=2,
        plan_specs=REPLICA_SPECS,
    ),
    "hung": Scenario(
        4,
        5,
        (Event(2, 2, "forward", hang_s=HANG_S), Event(2, 3, "recovery")),
        checkpoint_every=1,
        collective_timeout_s=HUNG_COLLECTIVE_TIMEOUT_S,
    ),
}


class _Rank:
    """One rank's part of a scenario."""

    def __init__(
        self, rank: int, scenario: Scenario, out_dir: str, store: dist.Store
    ) -> None:
        self.rank = rank
        self.scenario = scenario
        self.out_dir = out_dir
        self.store = store
        self.result: Dict[str, Any] = {"checks": [], "recoveries": []}
        self.own: Optional[LocalState] = None
        self.events: List[Event] = [e for e in scenario.events if e.rank == rank]
        self.reshard_steps = {e.step for e in scenario.events if e.point == "reshard"}

    # ------------------------------------------------------------- faults

    def _lose(self, event: Event) -> None:
        if not event.hang_s:
            die(self.store, self.out_dir, self.result)
        # hung: the watcher thread still beats, the training thread sleeps
        self.store.set(f"{STORE_PREFIX}/killed/{self.rank}", repr(time.time()))
        self.result["hung_s"] = event.hang_s
        time.sleep(event.hang_s)

    def _event(self, step: int, point: str) -> Optional[Event]:
        for event in self.events:
            if event.step == step and event.point == point:
                return event
        return None

    def step_fn(self, step: int) -> Callable[[nn.Module, Any], torch.Tensor]:
        def run(model: nn.Module, optimizer: Any) -> torch.Tensor:
            index = list(self.ft.members).index(self.rank)
            if (event := self._event(step, "forward")) is not None:
                self._lose(event)
            if step in self.reshard_steps:
                self._reshard(model, self._event(step, "reshard"))
            optimizer.zero_grad()
            out = model(model_batch(step, index))
            handle = None
            if (event := self._event(step, "backward")) is not None:
                handle = model.module.dense.weight.register_hook(
                    lambda grad, e=event: self._lose(e)
                )
            (out**2).sum().backward()
            if handle is not None:
                handle.remove()
            if (event := self._event(step, "optimizer")) is not None:
                self._lose(event)
            optimizer.step()
            return out.detach()

        return run

    def _reshard(self, model: nn.Module, event: Optional[Event]) -> None:
        """A reshard every rank starts; a victim dies in its exchange."""
        new_plan = model_plan(len(self.ft.members), 1)
        if event is None:
            model.reshard(new_plan)
            return

        def die_in_exchange(*args: Any) -> torch.Tensor:
            self._lose(event)
            return slots.read_piece(*args)

        with mock.patch.object(slots, "read_piece", die_in_exchange):
            model.reshard(new_plan)

    def _patch_recovery_and_snapshot(self) -> None:
        """Victims of the recovery's exchange and of a snapshot."""
        for event in self.events:
            if event.point == "recovery":
                original = Recovery.after_exchange

                def in_recovery(participant: Any, group: Any, e: Event = event) -> None:
                    self._lose(e)
                    original(participant, group)

                mock.patch.object(Recovery, "after_exchange", in_recovery).start()
            elif event.point == "snapshot":
                pack = BuddySnapshot._pack

                def in_snapshot(
                    snapshot: Any, model: Any, step: int, e: Event = event
                ) -> torch.Tensor:
                    if step == e.step:
                        self._lose(e)
                    return pack(snapshot, model, step)

                mock.patch.object(BuddySnapshot, "_pack", in_snapshot).start()

    # ------------------------------------------------------------ oracle

    def on_failure(self, failure: Failure) -> None:
        self.own = local_state(failure.model, failure.optimizer)

    def check_recovered(self, report: RecoveryReport, step: int) -> None:
        own = self.own
        assert own is not None, "on_failure was not called"
        assert report.plan is not None
        lost = [
            load_record(self.out_dir, rank, report.failure_step - steps)
            for rank in report.lost_ranks
            for source, steps in report.steps_lost.items()
            if source != "replica"
        ]
        checks = assert_matches_direct(
            self.ft.model, self.ft.optimizer, report.plan, own, lost, step
        )
        count = len(self.result["recoveries"])
        self.result["checks"] += [f"recovery {count}: {check}" for check in checks]
        self.own = None

    # ---------------------------------------------------------------- run

    def run(self) -> None:
        scenario = self.scenario
        model = DistributedModelParallel(
            model_definition(),
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=torch.device("cpu"),
            plan=scenario.plan(),
            sharders=model_sharders(),
        )
        model.load_state_dict(model_definition("cpu").state_dict())
        self.ft = FaultTolerance(
            model,
            make_dense_optimizer(model),
            make_dense_optimizer,
            scenario.options(),
            on_failure=self.on_failure,
        )
        self._patch_recovery_and_snapshot()
        checkpoints = os.path.join(self.out_dir, "checkpoints")
        while self.ft.steps < scenario.steps:
            step = self.ft.steps
            recoveries = len(self.ft.reports)
            try:
                self.ft.step(self.step_fn(step))
            except UnrecoverableLossError as e:
                self._stop_cleanly(e, checkpoints)
                return
            if len(self.ft.reports) > recoveries:  # recovered in this step
                report = self.ft.reports[-1]
                self.result["recoveries"].append(_report_json(report, self.store))
                self.check_recovered(report, step)
                continue
            done = self.ft.steps
            if scenario.snapshot_every and done % scenario.snapshot_every == 0:
                save_record(self.ft.model, self.ft.optimizer, self.out_dir, done)
            if scenario.checkpoint_every and done % scenario.checkpoint_every == 0:
                self.ft.save_checkpoint(os.path.join(checkpoints, str(done)))
                save_record(self.ft.model, self.ft.optimizer, self.out_dir, done)
        self.result["members"] = list(self.ft.members)
        self.result["steps"] = self.ft.steps
        for i, report in enumerate(self.ft.reports):
            self.result["recoveries"][i]["first_step_s"] = report.first_step_seconds
        self.ft.close()

    def _stop_cleanly(self, error: UnrecoverableLossError, checkpoints: str) -> None:
        """A loss no source covers: named on every survivor; state savable."""
        self.result["stopped"] = {"tables": list(error.tables), "message": str(error)}
        record = self.ft.save_checkpoint(os.path.join(checkpoints, "survivors"))
        self.result["saved_shards"] = [
            [key, [rect.row, rect.col, rect.rows, rect.cols]]
            for key, rect in record.shards
        ]
        self.result["checks"].append("stopped, the lost tables named, the state saved")


def _report_json(report: RecoveryReport, store: dist.Store) -> Dict[str, Any]:
    kills = [killed_at(store, rank) for rank in report.lost_ranks]
    kills = [k for k in kills if k is not None]
    first_kill = min(kills) if kills else None
    return {
        "members": list(report.members),
        "lost_ranks": list(report.lost_ranks),
        "lost_tables": list(report.lost_tables),
        "reason": report.reason,
        "fault": report.fault.reason if report.fault is not None else None,
        "attempts": report.attempts,
        "detect_after_kill_s": (
            report.detected_at - first_kill if first_kill is not None else None
        ),
        "detect_s": report.detect_seconds,
        "agree_s": report.agree_seconds,
        "group_s": report.group_seconds,
        "sources_s": report.sources_seconds,
        "move_s": report.move_seconds,
        "restore_s": report.restore_seconds,
        "bytes_by_source": report.bytes_by_source,
        "steps_lost": report.steps_lost,
        "failure_step": report.failure_step,
        "kept_in_place_bytes": report.move.bytes_kept_in_place if report.move else 0,
        "killed_at": first_kill,
    }


def scenario_rank(
    rank: int, world_size: int, store: dist.Store, out_dir: str, scenario: Scenario
) -> Dict[str, Any]:
    """A rank of a scenario's job (``fault_worker.run_job``)."""
    worker = _Rank(rank, scenario, out_dir, store)
    try:
        worker.run()
        worker.result["status"] = "ok"
    except RankFencedError as e:
        worker.result.update(status="fenced", error=str(e))
    except FaultToleranceError as e:
        worker.result.update(status="stopped", error=str(e))
    return worker.result


def run_scenario(scenario: Scenario, deadline_s: float = 240.0) -> JobResult:
    """Runs a scenario's job and returns every rank's result."""
    return run_job(
        scenario_rank,
        scenario.world_size,
        scenario,
        scenario.collective_timeout_s,
        deadline_s,
    )

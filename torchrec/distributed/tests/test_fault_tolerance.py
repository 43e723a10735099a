#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Jobs that lose ranks and go on (gloo, 4 ranks, the store hosted by the
test's process as a launcher's agent hosts it; ``test_utils.fault_worker``):
a rank killed (``os._exit``) in the forward, the backward or the optimizer
step, 4 -> 3 and then 3 -> 2, with the lost shards from the last checkpoint
or a buddy's snapshot, and a rank whose tables are all replicated. After
each recovery every survivor checks, bit for bit, that the recovered model
(weights, fused and dense optimizer state) equals one built directly on the
survivors under the recovery's plan from the survivors' own state and the
lost ranks' recorded state of the source's step (recorded by the ranks
themselves with ``torch.save``, not by the code under test), that no
survivor's own shard changed a byte, and that both train on alike; the
survivors then finish the job. The steps lost are what each source loses:
a replica none, a snapshot or checkpoint the steps since it.
"""

import json
import unittest
from typing import Any, Dict, List, Sequence

from torchrec.distributed.test_utils.fault_scenarios import (
    Event,
    FAULT_JOBS,
    run_scenario,
    Scenario,
)
from torchrec.distributed.test_utils.fault_worker import JobResult, KILLED

# a recovery costs the detection (the heartbeat timeout, 1 s here), the
# agreement and a model build: far within this on a loaded 2-core machine
RECOVERY_BOUND_S = 20.0


def _survivors(job: JobResult, lost: Sequence[int]) -> Dict[int, Dict[str, Any]]:
    assert not job.failures(), "\n".join(job.failures())
    for rank in lost:
        assert job.exit_codes[rank] == KILLED, (rank, job.exit_codes)
    return {r: res for r, res in job.results.items() if r not in lost}


def _assert_recoveries(
    test: unittest.TestCase,
    survivors: Dict[int, Dict[str, Any]],
    expected: List[Dict[str, Any]],
    steps: int,
) -> None:
    """Every survivor recovered as expected, checked its model, finished."""
    for rank, result in survivors.items():
        test.assertEqual(result["status"], "ok", result)
        test.assertEqual(result["steps"], steps)
        recoveries = result["recoveries"]
        test.assertEqual(len(recoveries), len(expected), recoveries)
        for got, want in zip(recoveries, expected):
            for key, value in want.items():
                test.assertEqual(got[key], value, (rank, key, got))
            test.assertLess(got["detect_after_kill_s"], RECOVERY_BOUND_S, got)
        checks = result["checks"]
        for i, want in enumerate(expected, 1):
            for check in (
                f"equals the model built directly on {want['members']}",
                "no survivor's own shard changed a byte",
                "trains on like the model built directly",
            ):
                test.assertIn(f"recovery {i}: {check}", checks)
    # the same verdict everywhere
    verdicts = {
        tuple(tuple(r["members"]) for r in res["recoveries"])
        for res in survivors.values()
    }
    test.assertEqual(len(verdicts), 1, verdicts)


def _expect(
    members: List[int], lost: List[int], steps_lost: Dict[str, int], **facts: Any
) -> Dict[str, Any]:
    """
    Args:
        members (List[int]): the survivors a recovery agrees on.
        lost (List[int]): the ranks it lost.
        steps_lost (Dict[str, int]): the steps each source it used lost.
        **facts (Any): more of what the recovery reports.

    Returns:
        Dict[str, Any]: what the recovery reports, as ``_assert_recoveries``
        expects it.
    """
    return {"members": members, "lost_ranks": lost, **facts, "steps_lost": steps_lost}


class FaultToleranceTest(unittest.TestCase):
    def _check_job(
        self, name: str, lost: Sequence[int], expected: List[Dict[str, Any]]
    ) -> Dict[int, Dict[str, Any]]:
        """Runs the fault job ``name``; its survivors recovered as expected."""
        scenario = FAULT_JOBS[name]
        survivors = _survivors(run_scenario(scenario), lost)
        _assert_recoveries(self, survivors, expected, steps=scenario.steps)
        return survivors

    def test_checkpoint_source_forward_then_backward(self) -> None:
        # rank 3 dies in the forward of step 3 (4 -> 3), rank 1 in the
        # backward of step 7 (3 -> 2); checkpoints after steps 2, 4, 6
        checkpoint = {"replica": 0, "checkpoint": 1}
        self._check_job(
            "forward",
            [1, 3],
            [
                _expect([0, 1, 2], [3], checkpoint, failure_step=3),
                _expect([0, 2], [1], checkpoint, failure_step=7),
            ],
        )

    def test_snapshot_source_optimizer_then_during_snapshot(self) -> None:
        # a snapshot after every step; rank 2 dies in the optimizer step of
        # step 3 (the survivors finish it: its shards lose that step), rank 0
        # while sending the snapshot after step 6 (its buddy keeps step 5's)
        snapshot = {"replica": 0, "snapshot": 1}
        self._check_job(
            "optimizer",
            [0, 2],
            [
                _expect([0, 1, 3], [2], snapshot, failure_step=4),
                _expect([1, 3], [0], snapshot, failure_step=6),
            ],
        )

    def test_replica_covers_a_rank_of_replicas_then_a_kill_during_a_reshard(
        self,
    ) -> None:
        # rank 3 holds only data-parallel replicas: nothing is lost (4 -> 3);
        # then every rank starts a reshard and rank 1 dies in its exchange:
        # the reshard aborts, the model is as it was, the checkpoint after
        # step 4 covers rank 1's shards (3 -> 2)
        survivors = self._check_job(
            "replica",
            [1, 3],
            [
                _expect([0, 1, 2], [3], {"replica": 0}, lost_tables=[]),
                _expect([0, 2], [1], {"replica": 0, "checkpoint": 1}, failure_step=5),
            ],
        )
        for result in survivors.values():
            self.assertIn("ReshardAbortedError", result["recoveries"][1]["reason"])

    def test_a_loss_no_source_covers_stops_every_survivor_cleanly(self) -> None:
        # only replicas are configured: rank 3's table-wise and row-wise
        # shards have no other copy
        scenario = Scenario(
            world_size=4,
            steps=6,
            events=(Event(2, 3, "forward"),),
            sources=("replica",),
        )
        job = run_scenario(scenario)
        survivors = _survivors(job, [3])
        stops = {json.dumps(r["stopped"], sort_keys=True) for r in survivors.values()}
        self.assertEqual(len(stops), 1, stops)  # the same on every survivor
        for rank, result in survivors.items():
            self.assertEqual(result["status"], "ok", result)
            self.assertEqual(result["stopped"]["tables"], ["ebc:t3", "ec:t0", "ec:t1"])
            self.assertIn("ec:t0", result["stopped"]["message"])
            # the survivors' state is saved; nothing of rank 3's is invented
            saved = {(k, tuple(r)) for k, r in result["saved_shards"]}
            self.assertIn(("ebc:t1", (0, 0, 27, 16)), saved)  # rank 0's table
            self.assertNotIn(("ec:t0", (0, 0, 24, 16)), saved)  # rank 3's


if __name__ == "__main__":
    unittest.main()

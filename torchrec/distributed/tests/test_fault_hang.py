#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A hung rank and a second loss during the recovery (4 gloo ranks, the store
hosted by the test's process; ``test_utils.fault_scenarios``).

Rank 2 hangs in the forward of step 2: its watcher thread still beats, so
only its absence tells it apart. The others wait in the forward's
collective until its timeout (the training group's, which
``FaultOptions.collective_timeout`` bounds), agree without rank 2 at the
join timeout, and start recovering onto [0, 1, 3]; rank 3 dies in that
recovery's exchange: the recovery fails on ranks 0 and 1 with the model as
it was, they agree again (rank 3's heartbeat stopped) and recover onto
[0, 1], rank 2's and rank 3's shards from the checkpoint, equal bit for bit
to a model built directly on them, and train on. When rank 2 wakes, it
finds itself fenced and stops.
"""

import unittest

from torchrec.distributed.test_utils.fault_scenarios import (
    FAULT_JOBS,
    HUNG_COLLECTIVE_TIMEOUT_S,
    run_scenario,
)
from torchrec.distributed.test_utils.fault_worker import KILLED

SLACK_S = 10.0


class HungRankTest(unittest.TestCase):
    def test_hung_rank_fenced_and_a_second_loss_during_the_recovery(self) -> None:
        scenario = FAULT_JOBS["hung"]
        job = run_scenario(scenario)
        self.assertFalse(job.failures(), "\n".join(job.failures()))
        self.assertEqual(job.exit_codes[3], KILLED)
        self.assertEqual(job.results[2]["status"], "fenced", job.results[2])
        self.assertIn("left out", job.results[2]["error"])
        join_s = (
            HUNG_COLLECTIVE_TIMEOUT_S + scenario.options().heartbeat_timeout.seconds
        )
        for rank in (0, 1):
            result = job.results[rank]
            self.assertEqual(result["status"], "ok", result)
            self.assertEqual(result["steps"], 5)
            (recovery,) = result["recoveries"]
            self.assertEqual(recovery["members"], [0, 1])
            self.assertEqual(recovery["lost_ranks"], [2, 3])
            self.assertEqual(recovery["attempts"], 2)
            self.assertEqual(recovery["steps_lost"], {"replica": 0, "checkpoint": 0})
            # the hang is noticed at the collective's timeout, not later
            self.assertLess(
                recovery["detect_after_kill_s"], HUNG_COLLECTIVE_TIMEOUT_S + SLACK_S
            )
            self.assertGreaterEqual(recovery["agree_s"], join_s - 0.5)
            for check in (
                "equals the model built directly on [0, 1]",
                "no survivor's own shard changed a byte",
                "trains on like the model built directly",
            ):
                self.assertIn(f"recovery 1: {check}", result["checks"])


if __name__ == "__main__":
    unittest.main()

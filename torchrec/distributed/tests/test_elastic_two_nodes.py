#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Across hosts: two torchrun agents on this machine as two nodes
(``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on 127.0.0.1), so that
TorchRec sees 2 hosts x 2 local ranks, run the scenario of
``elastic_drain_worker``: table-row-wise and grid tables reshard across the
hosts exactly; a drain the sharding cannot build is refused on every rank;
host 1 is drained (its ranks hand their shards to host 0's ranks, find their
model released and exit with code 0) while host 0 trains on exactly like a
model built directly on its ranks, and reshards once more.

Each worker writes what it checked into a result file; the test asserts that
both agents and all four workers exit with code 0 and that each rank reports
its part. The job has a hard deadline (agents stopped, workers exit on their
own), so the test cannot hang.
"""

import os
import tempfile
import unittest
from typing import List

from torchrec.distributed.test_utils.elastic_drain_worker import (
    HOST0,
    HOST1,
    job_failures,
    launch_two_nodes,
    read_results,
    STEPS,
    WORKER_MODULE,
)

JOB_TIMEOUT_S = 300.0  # the whole job, both agents
WORKER_DEADLINE_S = 240.0  # a worker still running then exits with code 3

HOST0_CHECKS: List[str] = [
    "reshard A->B on 2 hosts: state equals plan B sharded directly",
    "reshard A->B on 2 hosts: trains like plan B sharded directly",
    "drain without node groups: refused on every rank, nothing lost",
    "drain: the old model was released",
    "drain: state equals plan C built directly on host 0",
    f"drain: host 0 trains {STEPS} steps like plan C built directly",
    "host 0 reshard C->D: trains like plan D built directly",
]
HOST1_CHECKS: List[str] = HOST0_CHECKS[:4]


def _tail(path: str, lines: int = 60) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


class ElasticTwoNodesTest(unittest.TestCase):
    def test_drain_host_while_the_other_trains_on(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            logs = [os.path.join(tmp, f"node{n}.log") for n in range(2)]
            outputs = [open(path, "wb") for path in logs]
            try:
                runs = launch_two_nodes(
                    [
                        "-m",
                        WORKER_MODULE,
                        "--result-dir",
                        tmp,
                        "--deadline-s",
                        str(WORKER_DEADLINE_S),
                    ],
                    timeout_s=JOB_TIMEOUT_S,
                    outputs=outputs,
                    cwd=tmp,
                )
            finally:
                for output in outputs:
                    output.close()
            results = read_results(tmp)
            output_tails = "\n".join(
                f"--- node {n}'s agent and workers:\n{_tail(path)}"
                for n, path in enumerate(logs)
            )
            failures = job_failures(runs, results)
            self.assertEqual(failures, [], "\n".join(failures) + "\n" + output_tails)

            self.assertEqual([run.returncode for run in runs], [0, 0], output_tails)
            # each host, its ranks, whether they left, their role in the move,
            # what they moved, what they checked
            hosts = [
                (1, HOST1, True, "left", "bytes_sent", HOST1_CHECKS),
                (0, HOST0, False, "stayed", "bytes_received", HOST0_CHECKS),
            ]
            for node, ranks, left, role, moved, checks in hosts:
                for rank in ranks:
                    result = results[rank]
                    self.assertEqual(result["node"], node, result)
                    self.assertIs(result["left"], left, result)
                    self.assertEqual(result["move"]["role"], role, result)
                    self.assertGreater(result["move"][moved], 0, result)
                    self.assertEqual(result["checks"], checks, result)
            for rank in HOST0:
                result = results[rank]
                self.assertTrue(result["exact_after_drain"], result)
                self.assertEqual(len(result["losses_after_drain"]), STEPS, result)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Draining a host of a running TorchRec job: two torchrun nodes on this machine.

Starts two torchrun agents on the loopback address as two nodes of 2 ranks
(``--nnodes 2 --nproc-per-node 2``, c10d rendezvous; node 0 hosts the store),
each running this script as its workers (gloo on CPU), and prints what
happens:

1. the model trains on both hosts (table-row-wise and grid tables spanning
   them);
2. it reshards live within the 4 ranks, tables crossing the hosts, and is
   checked against a model sharded directly with the new plan;
3. host 1 is drained: ``move_model`` moves the model onto host 0's ranks;
   host 1's ranks hand over their shards, release their model and exit 0;
4. host 0 trains on, on its own ranks, exactly like a model built directly
   there from the state before the drain, and reshards within host 0.

The scenario is ``torchrec.distributed.test_utils.elastic_drain_worker`` (the one
``test_elastic_two_nodes`` runs). Run it with ``bash scripts/drain_demo.sh``
(which sets up ``.venv``) or ``python examples/drain_node_demo.py``.

Exit status: 0 when every rank passed its checks and both agents exited 0,
1 otherwise.
"""

import argparse
import os
import sys
import tempfile
from typing import List, Optional, Sequence

from torchrec.distributed.test_utils import elastic_drain_worker as scenario


def _worker(argv: Sequence[str]) -> int:
    """Under torchrun: one rank of the job."""
    return scenario.main(argv)


def _launch(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="the whole job's deadline (s)"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show torch's and torchrec's warnings from the workers",
    )
    parser.add_argument(
        "--result-dir", help="keep the ranks' result files here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    result_dir = args.result_dir or tempfile.mkdtemp(prefix="drain-demo-")
    os.makedirs(result_dir, exist_ok=True)
    worker_args: List[str] = [
        os.path.abspath(__file__),
        "--result-dir",
        result_dir,
        "--deadline-s",
        str(max(30.0, args.timeout - 30.0)),
    ] + (["--verbose"] if args.verbose else [])

    print("Draining a host: 2 torchrun nodes x 2 ranks on 127.0.0.1 (gloo, CPU)")
    for name in ("A", "B", "C", "D"):
        print(f"  plan {scenario.describe(name)}")

    def started(run: scenario.AgentRun) -> None:
        role = "hosts the store, trains on" if run.node == 0 else "is drained"
        print(f"[launcher] node {run.node} ({role}): {' '.join(run.command)}")

    sys.stdout.flush()
    # without --verbose, no C++ warnings either (e.g. torchelastic's last agent
    # closing the rendezvous after the store's host has gone)
    env = {} if args.verbose else {"TORCH_CPP_LOG_LEVEL": "ERROR"}
    runs = scenario.launch_two_nodes(
        worker_args, args.timeout, on_start=started, env=env
    )
    results = scenario.read_results(result_dir)

    print("\nsummary:")
    for run in runs:
        when = "-" if run.seconds is None else f"{run.seconds:.2f}s"
        print(f"  node {run.node}'s agent: exit code {run.returncode} at {when}")
    for rank in range(scenario.WORLD):
        result = results.get(rank)
        if result is None:
            print(f"  rank {rank}: no result")
            continue
        role = "left (drained)" if result["left"] else "trained on"
        exited = result["exit_time"] - runs[0].launched_at
        print(
            f"  rank {rank} (host {result['node']}): {result['status']}, {role}, "
            f"{len(result['checks'])} checks passed, done at {exited:.2f}s"
        )
    print(
        "  (an agent whose workers are done waits in torchelastic's exit barrier "
        "for the other agent, up to 300 s)"
    )
    failures = scenario.job_failures(runs, results)
    if failures:
        print("\nRESULT: FAILED")
        for failure in failures:
            print(f"  {failure}")
        return 1
    print(
        "\nRESULT: exact. Host 1's ranks handed their shards over and exited 0; "
        "host 0 trained on exactly like a model built directly on its ranks "
        f"(results in {result_dir})."
    )
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return _worker(argv)
    return _launch(argv)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The failure-injection matrix of ``FaultTolerance``: where a rank is lost x
the source of its shards, and for each recovery whether the survivors
recovered, whether the recovered model equals (bit for bit) the model built
directly on the survivors from the same source state and trains on equal to
it, and the seconds of each phase.

The jobs are the fault-tolerance tests' own scenarios
(``torchrec.distributed.test_utils.fault_scenarios``: 4 gloo ranks on CPU, an
EBC and an EC under ``DistributedModelParallel``, a heartbeat timeout of
1.5 s, a collective timeout of 5 s, 3 s for the hung rank), run here one
after the other, each in processes of its own; the checks are the ones the
tests assert (each survivor compares with its own reference). ``detect`` is
from the loss (the kill, or the start of the hang) to this rank noticing it;
``agree`` waits for the dead rank's heartbeat to stand still (the heartbeat
timeout) or, for a hung rank, for the join timeout; ``first step`` is from
noticing to the end of the first step on the survivors. Seconds are the
medians over the survivors of a recovery.

Example::

    python benchmarks/fault_matrix.py                 # every row (~5 min)
    python benchmarks/fault_matrix.py --rows forward,optimizer
"""

import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from common import benchmark_parser, fmt, save_results
from torchrec.distributed.test_utils.fault_scenarios import (
    FAULT_JOBS,
    run_scenario,
    Scenario,
)
from torchrec.distributed.test_utils.fault_worker import JobResult

CHECKS: Tuple[str, ...] = (
    "equals the model built directly on",
    "no survivor's own shard changed a byte",
    "trains on like the model built directly",
)

# name -> (the job, what each of its recoveries is: where the rank was lost)
JOBS: Dict[str, Tuple[Scenario, Tuple[str, ...]]] = {
    "forward": (FAULT_JOBS["forward"], ("forward (4 -> 3)", "backward (3 -> 2)")),
    "optimizer": (
        FAULT_JOBS["optimizer"],
        ("optimizer step (4 -> 3)", "during a snapshot (3 -> 2)"),
    ),
    "replica": (
        FAULT_JOBS["replica"],
        ("a rank of replicas only (4 -> 3)", "during a reshard (3 -> 2)"),
    ),
    "hung": (
        FAULT_JOBS["hung"],
        ("hung, and a second loss during its recovery (4 -> 2)",),
    ),
}

PHASES: Tuple[Tuple[str, str], ...] = (
    ("detect", "detect_after_kill_s"),
    ("agree", "agree_s"),
    ("group", "group_s"),
    ("move", "move_s"),
    ("first step", "first_step_s"),
)


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def matrix_rows(
    name: str, points: Sequence[str], job: JobResult, seconds: float
) -> List[Dict[str, Any]]:
    """
    One row per recovery of a job: where, sources used, the verdicts and the
    seconds of each phase (median over the survivors).

    Args:
        name (str): the job's name.
        points (Sequence[str]): what each recovery is.
        job (JobResult): every rank's result.
        seconds (float): the job's wall time.

    Returns:
        List[Dict[str, Any]]: the rows.
    """
    survivors = {r: res for r, res in job.results.items() if res.get("status") == "ok"}
    rows = []
    for i, point in enumerate(points):
        reports = [
            res["recoveries"][i]
            for res in survivors.values()
            if len(res["recoveries"]) > i
        ]
        exact = bool(reports) and all(
            any(c.startswith(f"recovery {i + 1}: {check}") for c in res["checks"])
            for res in survivors.values()
            for check in CHECKS
        )
        first = reports[0] if reports else {}
        row: Dict[str, Any] = {
            "job": name,
            "lost": point,
            "members": first.get("members"),
            "restored_from": ", ".join(
                f"{s} {b / 1024:.0f} KiB"
                for s, b in sorted(first.get("bytes_by_source", {}).items())
                if b
            )
            or "nothing lost",
            "sources": ", ".join(
                f"{s} ({n} lost)"
                for s, n in sorted(first.get("steps_lost", {}).items())
            ),
            "recovered": len(reports) == len(survivors) and not job.failures(),
            "bit_equal": exact,
            "job_seconds": seconds,
        }
        for label, key in PHASES:
            row[label] = _median([r.get(key) for r in reports])
        rows.append(row)
    return rows


def print_table(rows: List[Dict[str, Any]]) -> None:
    """The matrix as a Markdown table."""
    head = ["lost in", "members", "restored from", "steps lost by source"]
    head += ["recovered", "bit-equal"]
    head += [f"{label} s" for label, _ in PHASES]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for row in rows:
        cells = [
            row["lost"],
            str(row["members"]),
            row["restored_from"],
            row["sources"],
            "yes" if row["recovered"] else "NO",
            "yes" if row["bit_equal"] else "NO",
        ]
        cells += [fmt(row[label], ".2f") for label, _ in PHASES]
        print("| " + " | ".join(cells) + " |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = benchmark_parser(__doc__.split("\n\n")[1])
    p.add_argument(
        "--rows",
        default=",".join(JOBS),
        help=f"the jobs to run, comma-separated (of {', '.join(JOBS)})",
    )
    args = p.parse_args(argv)
    names = [n for n in args.rows.split(",") if n]
    unknown = sorted(set(names) - set(JOBS))
    if unknown:
        p.error(f"unknown jobs {unknown}; choose from {list(JOBS)}")
    rows: List[Dict[str, Any]] = []
    for name in names:
        scenario, points = JOBS[name]
        print(f"[fault_matrix] {name}: {', '.join(points)}", flush=True)
        start = time.monotonic()
        job = run_scenario(scenario)
        rows += matrix_rows(name, points, job, time.monotonic() - start)
        for failure in job.failures():
            print(f"[fault_matrix]   {failure}", flush=True)
    print()
    print_table(rows)
    save_results(args.out_dir, "fault_matrix", {"rows": rows})
    return 0 if all(r["recovered"] and r["bit_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The transaction runner with a participant that records what it is asked to
do, on a one-rank job: the phases in order, each timed and under
``record_function``; a dry run stops after the agreement; a failure in any
phase before the commit calls the one abort path and raises the phase's error
type; nothing is committed then.
"""

import unittest
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.profiler import profile, ProfilerActivity
from torchrec.distributed.resharding.exchange import ExchangeStats
from torchrec.distributed.resharding.fields import Field, FieldKind
from torchrec.distributed.resharding.plan import (
    RankPlan,
    Rect,
    ReshardAbortedError,
    ReshardError,
    Transfer,
)
from torchrec.distributed.resharding.runner import (
    ExchangePart,
    Participant,
    PHASES,
    run_transaction,
)
from torchrec.distributed.test_utils.multi_process_utils import (
    single_rank_process_group,
)

WEIGHT = Field("weight", FieldKind.RECT, torch.float32)


class _CopyIO:
    """Pieces from one tensor into another (a local copy)."""

    def __init__(self) -> None:
        self.old = torch.arange(12, dtype=torch.float32).view(3, 4)
        self.new = torch.zeros(3, 4)
        self.finished = False

    def resolve(self, t: Transfer, f: Field) -> torch.Tensor:
        return self.old

    def target(self, t: Transfer, f: Field) -> Optional[torch.Tensor]:
        return self.new

    def commit(self, t: Transfer, f: Field, data: torch.Tensor) -> None:
        self.new.copy_(data.view(3, 4))

    def kept(self, t: Transfer) -> bool:
        return False

    def finish(self) -> None:
        self.finished = True


class _Recorder(Participant):
    kind = "recorded"

    def __init__(self, fail: Optional[str] = None) -> None:
        self.calls: List[str] = []
        self.fail = fail
        self.io = _CopyIO()

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.fail == name:
            raise RuntimeError(f"injected in {name}")

    def ranks(self) -> List[int]:
        return [dist.get_rank()]

    def digest(self) -> int:
        return 7

    def prepare(self) -> Any:
        self._call("prepare")
        return {"facts": 1}

    def merge(self, facts: Sequence[Any]) -> Any:
        self.calls.append("merge")
        return [f["facts"] for f in facts]

    def agreed(self, merged: Any) -> None:
        self.calls.append(f"agreed {merged}")

    def dry_run(self) -> Any:
        self.calls.append("dry_run")
        return "dry"

    def build(self) -> None:
        self._call("build")

    def before_exchange(self, group: dist.ProcessGroup) -> None:
        self._call("before_exchange")

    def exchange_part(self) -> ExchangePart:
        self._call("exchange_part")
        whole = Rect(0, 0, 3, 4)
        local = Transfer("t", 0, 0, whole, whole, whole)
        return ExchangePart(RankPlan((), (), (local,)), {"t": (WEIGHT,)}, self.io)

    def after_exchange(self, group: dist.ProcessGroup, stats: ExchangeStats) -> None:
        self._call("after_exchange")

    def commit(self) -> None:
        self.calls.append("commit")

    def abort(self) -> None:
        self.calls.append("abort")


class RunnerTest(unittest.TestCase):
    def test_phases_in_order_timed_and_profiled(self) -> None:
        with single_rank_process_group():
            participant = _Recorder()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                outcome = run_transaction(participant)
            self.assertEqual(
                participant.calls,
                [
                    "prepare",
                    "merge",
                    "agreed [1]",
                    "build",
                    "before_exchange",
                    "exchange_part",
                    "after_exchange",
                    "commit",
                ],
            )
            self.assertTrue(torch.equal(participant.io.new, participant.io.old))
            self.assertTrue(participant.io.finished)
            self.assertEqual(outcome.exchange.bytes_copied_locally, 48)
            phases = outcome.phases
            self.assertTrue(all(getattr(phases, p) > 0 for p in PHASES))
            self.assertAlmostEqual(
                phases.total, sum(getattr(phases, p) for p in PHASES)
            )
            names = {e.name for e in prof.events()}
            for phase in PHASES:
                self.assertIn(f"## reshard recorded: {phase} ##", names)

    def test_dry_run_stops_after_the_agreement(self) -> None:
        with single_rank_process_group():
            participant = _Recorder()
            outcome = run_transaction(participant, dry_run=True)
            self.assertEqual(outcome.dry_run, "dry")
            self.assertEqual(
                participant.calls, ["prepare", "merge", "agreed [1]", "dry_run"]
            )
            self.assertEqual(outcome.phases.build, 0.0)

    def test_a_failure_before_the_commit_aborts(self) -> None:
        expected = {
            "prepare": ReshardError,
            "build": ReshardError,
            "before_exchange": ReshardAbortedError,
            "exchange_part": ReshardAbortedError,
            "after_exchange": ReshardAbortedError,
        }
        with single_rank_process_group():
            for phase, error in expected.items():
                participant = _Recorder(fail=phase)
                with self.assertRaises(error) as raised:
                    run_transaction(participant)
                self.assertIn(f"injected in {phase}", str(raised.exception))
                self.assertNotIn("commit", participant.calls)
                # nothing was built when validation failed: nothing to abort
                self.assertEqual(
                    participant.calls.count("abort"), 0 if phase == "prepare" else 1
                )


if __name__ == "__main__":
    unittest.main()

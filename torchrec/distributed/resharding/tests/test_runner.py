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
``record_function``; the runner plans the participant's layouts and fills its
new slots from its old ones (row-wise state joined from column pieces
included) and reports what moved; a dry run stops after the agreement; a
failure in any phase before the commit calls the one abort path and raises
the phase's error type; nothing is committed then.
"""

import unittest
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.profiler import profile, ProfilerActivity
from torchrec.distributed.resharding.fields import FieldKind
from torchrec.distributed.resharding.plan import (
    PlacedShard,
    Rect,
    ReshardAbortedError,
    ReshardError,
    TableLayout,
)
from torchrec.distributed.resharding.runner import (
    Participant,
    PHASES,
    run_transaction,
    Slots,
    TransactionLayouts,
)
from torchrec.distributed.resharding.slots import LocalSlot
from torchrec.distributed.test_utils.multi_process_utils import (
    single_rank_process_group,
)
from torchrec.distributed.test_utils.transaction_doubles import SUM, WEIGHT

WHOLE = Rect(0, 0, 3, 4)
HALVES = (Rect(0, 0, 3, 2), Rect(0, 2, 3, 2))


class _Recorder(Participant[Any, Any]):
    """
    A table of one rank joined from two column shards into one: its weight
    is copied, its row-wise state ("sum") merged from the two halves.
    """

    kind = "recorded"

    def __init__(self, fail: Optional[str] = None) -> None:
        self.calls: List[str] = []
        self.fail = fail
        self.old = torch.arange(12, dtype=torch.float32).view(3, 4)
        self.sums = (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 4.0, 5.0]))
        self.new = torch.zeros(3, 4)
        self.new_sum = torch.zeros(3)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.fail == name:
            raise RuntimeError(f"injected in {name}")

    def ranks(self) -> List[int]:
        return [dist.get_rank()]

    def request(self) -> List[str]:
        return ["7"]

    def prepare(self) -> Any:
        self._call("prepare")
        return {"facts": 1}

    def merge(self, facts: Sequence[Any]) -> Any:
        self.calls.append("merge")
        return [f["facts"] for f in facts]

    def agreed(self, merged: Any) -> TransactionLayouts:
        self.calls.append(f"agreed {merged}")
        halves = tuple(PlacedShard(0, r) for r in HALVES)
        whole = (PlacedShard(0, WHOLE),)
        return TransactionLayouts(
            {"t": TableLayout(3, 4, halves)},
            {"t": TableLayout(3, 4, whole)},
            {"t": (WEIGHT, SUM)},
        )

    def build(self) -> None:
        self._call("build")

    def before_exchange(self, group: dist.ProcessGroup) -> None:
        self._call("before_exchange")

    def slots(self) -> Tuple[Slots, Slots]:
        self._call("slots")
        old = {
            ("t", r): LocalSlot(
                "t",
                r,
                {"weight": self.old[:, r.col : r.col + r.cols], "sum": s},
                {"sum": FieldKind.ROWS},
            )
            for r, s in zip(HALVES, self.sums)
        }
        tensors = {"weight": self.new, "sum": self.new_sum}
        new = LocalSlot("t", WHOLE, tensors, {"sum": FieldKind.ROWS})
        return old, {("t", WHOLE): new}

    def after_exchange(self, group: dist.ProcessGroup) -> None:
        self._call("after_exchange")

    def commit(self) -> int:
        self.calls.append("commit")
        return 0

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
                    "slots",
                    "after_exchange",
                    "commit",
                ],
            )
            self.assertTrue(torch.equal(participant.new, participant.old))
            # row-wise state joined from column pieces lands when the IO finishes
            expected_sum = (participant.sums[0] + participant.sums[1]) / 2
            self.assertTrue(torch.equal(participant.new_sum, expected_sum))
            # the weight (48 B) and each half's row-wise state (12 B each)
            self.assertEqual(outcome.bytes_copied_locally, 48 + 2 * 12)
            self.assertEqual(outcome.tables_rebuilt, {"": ["t"]})
            self.assertEqual(outcome.tables_moved, {"": ["t"]})
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
            self.assertTrue(outcome.dry_run)
            self.assertEqual(participant.calls, ["prepare", "merge", "agreed [1]"])
            me = dist.get_rank()
            self.assertEqual(outcome.bytes_sent_by_rank, {me: 0})
            self.assertEqual(outcome.bytes_received_by_rank, {me: 0})
            self.assertEqual(outcome.bytes_copied_locally, 0)
            self.assertEqual(outcome.phases.build, 0.0)

    def test_a_failure_before_the_commit_aborts(self) -> None:
        expected = {
            "prepare": ReshardError,
            "build": ReshardError,
            "before_exchange": ReshardAbortedError,
            "slots": ReshardAbortedError,
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

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Candidates from every source, one judge (pure): the search's moves, its
split step and the full replan each hand the policy a ``Candidate``; the
same prediction gets the same verdict and the same reason whatever its
source (over memory, no change, below ``min_gain``), and the only
difference between the sources is data (a full replan's one-shot candidate
is not held to the hysteresis). The search's real proposals are labelled
by what they did: moves only, or splits.
"""

import unittest
from typing import Dict, List

from torchrec.distributed.resharding.rebalance.candidates import (
    Candidate,
    FULL_REPLAN,
    over_memory,
    screen_candidate,
    SEARCH,
    search_candidate,
    SPLITS,
)
from torchrec.distributed.resharding.rebalance.costs import propose, StepPrediction
from torchrec.distributed.resharding.rebalance.placement import placement_of
from torchrec.distributed.resharding.rebalance.policy import (
    PolicyState,
    RebalancePolicy,
)
from torchrec.distributed.resharding.rebalance.statistics import (
    LoadStatistics,
    TableLoad,
)
from torchrec.distributed.test_utils.rebalance_utils import EBC_PATH, hand_plan
from torchrec.distributed.types import ShardingPlan

ROWS, DIM = 64, 16
SOURCES = (SEARCH, SPLITS, FULL_REPLAN)
POLICY = RebalancePolicy(window=10, min_gain=0.1, hysteresis=2)


def _prediction(slowest_after: float) -> StepPrediction:
    """A 10 ms step whose slowest rank (8 ms) becomes ``slowest_after``."""
    return StepPrediction(0.010, (0.008, 0.002), (slowest_after, 0.004))


def _plan() -> ShardingPlan:
    return hand_plan(
        {"t0": ("table_wise", 0), "t1": ("table_wise", 1)}, 2, ROWS, DIM, 2
    )


def _candidates(**fields: object) -> Dict[str, Candidate]:
    """The same candidate from each source."""
    base: Dict[str, object] = {
        "plan": _plan(),
        "prediction": _prediction(0.0079),
        "tables": (f"{EBC_PATH}:t0",),
    }
    base.update(fields)
    return {s: Candidate(source=s, **base) for s in SOURCES}  # pyre-ignore[6]


class ScreenCandidateTest(unittest.TestCase):
    def test_the_same_prediction_is_refused_alike_from_every_source(self) -> None:
        state = PolicyState(streak=1)
        verdicts = {
            s: screen_candidate(POLICY, state, c) for s, c in _candidates().items()
        }
        reasons = {v.reason for v in verdicts.values()}
        self.assertEqual(reasons, {"predicted gain 1.0% below min_gain 10.0%"})
        self.assertTrue(all(v.below_bar for v in verdicts.values()))
        # the per-window sources' streak breaks; a full replan leaves it be
        self.assertEqual(verdicts[SEARCH].state, PolicyState(streak=0))
        self.assertEqual(verdicts[SPLITS].state, PolicyState(streak=0))
        self.assertEqual(verdicts[FULL_REPLAN].state, state)

    def test_over_memory_and_no_change_are_refused_alike(self) -> None:
        over = {
            s: screen_candidate(POLICY, PolicyState(), c)
            for s, c in _candidates(
                prediction=_prediction(0.004), over_memory=(1,)
            ).items()
        }
        self.assertEqual(
            {v.reason for v in over.values()},
            {"its plan no longer fits the memory of ranks [1]"},
        )
        self.assertFalse(any(v.below_bar for v in over.values()))
        empty = _candidates(plan=None, tables=())
        for source, candidate in empty.items():
            verdict = screen_candidate(POLICY, PolicyState(), candidate)
            self.assertEqual(
                verdict.reason,
                f"no candidate of the {source} cuts the slowest rank",
            )
            self.assertTrue(verdict.below_bar)

    def test_a_gain_over_the_bar_passes_after_the_hysteresis(self) -> None:
        candidates = _candidates(prediction=_prediction(0.004))  # gain 40%
        first = {
            s: screen_candidate(POLICY, PolicyState(), c) for s, c in candidates.items()
        }
        hysteresis = "predicted gain 40.0% in 1 of 2 windows (hysteresis)"
        self.assertEqual(first[SEARCH].reason, hysteresis)
        self.assertEqual(first[SPLITS].reason, hysteresis)
        self.assertIsNone(first[FULL_REPLAN].reason)
        for source in (SEARCH, SPLITS):
            second = screen_candidate(POLICY, first[source].state, candidates[source])
            self.assertIsNone(second.reason)
            self.assertEqual(second.state.streak, 2)

    def test_over_memory_counts_ranks_that_grow_past_their_capacity(self) -> None:
        self.assertEqual(over_memory([10, 50], [30, 40], [20, 20]), (0,))
        self.assertEqual(over_memory([10, 50], [10, 60], [20, 20]), (1,))
        self.assertEqual(over_memory([10, 10], [15, 5], [20, 20]), ())


def _stats(ids: List[float], kernels: List[float]) -> LoadStatistics:
    tables = tuple(
        TableLoad(EBC_PATH, f"t{i}", (f"f{i}",), (1.0,), (8.0,), n)
        for i, n in enumerate(ids)
    )
    n = len(kernels)
    return LoadStatistics(
        steps=10,
        tables=tables,
        compute_seconds=tuple(kernels),
        input_dist_seconds=(0.0,) * n,
        output_dist_seconds=(0.0,) * n,
        step_seconds=tuple(k + 0.002 for k in kernels),
    )


class SearchCandidateTest(unittest.TestCase):
    def test_the_search_labels_its_candidate_by_what_it_did(self) -> None:
        plan = _plan()
        tables = {EBC_PATH: [("t0", ROWS, DIM), ("t1", ROWS, DIM)]}
        element_bytes = {f"{EBC_PATH}:t0": 8, f"{EBC_PATH}:t1": 8}
        placement = placement_of(plan, tables, element_bytes, 2)
        # t0 is 8 times as hot as t1: no move of a whole table helps
        stats = _stats([800.0, 100.0], [0.016, 0.002])
        slope = 0.016 / (800.0 * DIM)
        out = {}
        for splittable in (None, {f"{EBC_PATH}:t0"}):
            proposal = propose(
                stats, placement, slope, [1e12] * 2, 0.0, None, splittable
            )
            out[splittable is not None] = search_candidate(
                proposal, plan, placement, lambda r: "cpu"
            )
        moves, split = out[False], out[True]
        self.assertEqual((moves.source, moves.plan, moves.tables), (SEARCH, None, ()))
        self.assertEqual(split.source, SPLITS)
        self.assertEqual(split.decision_source, SEARCH)
        self.assertIn(f"{EBC_PATH}:t0", split.tables)
        assert split.plan is not None
        t0 = split.plan.plan[EBC_PATH]["t0"]  # pyre-ignore[16]
        self.assertEqual(t0.sharding_type, "column_wise")
        self.assertEqual(split.gain_bound, moves.gain_bound)
        assert split.gain_bound is not None
        self.assertGreater(split.prediction.gain, POLICY.min_gain)
        # the same judge for both
        self.assertIn(
            "no candidate of the search",
            screen_candidate(POLICY, PolicyState(), moves).reason or "",
        )
        self.assertIsNone(screen_candidate(POLICY, PolicyState(streak=1), split).reason)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The rebalancing policy (pure): nonsense values are refused with a message
naming each; the gain bar and the hysteresis; the move must pay over the
horizon at the measured (or default) bandwidth and fit the budget; a
reshard blocks evaluation for ``min_interval`` steps and a failure backs off
exponentially; a byte moved costs its move time over the horizon; a full
replan starts only when allowed, none runs, splitting could reach the gain
and no back-off holds it, and one that led nowhere backs off exponentially.
"""

import unittest

from torchrec.distributed.resharding.rebalance.decisions import ReshardOutcome
from torchrec.distributed.resharding.rebalance.policy import (
    after_failure,
    after_replan,
    after_replan_started,
    after_reshard,
    blocked_reason,
    byte_price,
    DEFAULT_BANDWIDTH,
    DEFAULT_BANDWIDTHS,
    judge_move,
    may_replan,
    PolicyState,
    RebalancePolicy,
    screen,
    with_bandwidth,
)


class RebalancePolicyTest(unittest.TestCase):
    def test_nonsense_values_are_refused(self) -> None:
        cases = {
            "window": dict(window=-1),
            "min_gain": dict(min_gain=1.5),
            "hysteresis": dict(hysteresis=0),
            "min_interval": dict(min_interval=-5),
            "move_budget_bytes": dict(move_budget_bytes=0),
            "horizon": dict(horizon=0),
            "default_bandwidth": dict(default_bandwidth=0.0),
            "backoff": dict(backoff=0),
        }
        for name, kwargs in cases.items():
            with self.assertRaisesRegex(ValueError, f"bad RebalancePolicy: {name}"):
                RebalancePolicy(**kwargs)  # pyre-ignore[6]
        with self.assertRaisesRegex(ValueError, "window.*; horizon"):
            RebalancePolicy(window=0, horizon=-1)

    def test_gain_bar_and_hysteresis(self) -> None:
        policy = RebalancePolicy(min_gain=0.2, hysteresis=2)
        state = PolicyState()
        reason, state = screen(policy, state, 0.1)
        self.assertIn("below min_gain", reason or "")
        self.assertEqual(state.streak, 0)
        reason, state = screen(policy, state, 0.3)
        self.assertIn("1 of 2 windows", reason or "")
        reason, state = screen(policy, state, 0.3)
        self.assertIsNone(reason)
        self.assertEqual(state.streak, 2)
        # one window under the bar starts the streak again
        _, state = screen(policy, state, 0.0)
        reason, state = screen(policy, state, 0.3)
        self.assertIsNotNone(reason)

    def test_move_must_pay_over_the_horizon(self) -> None:
        policy = RebalancePolicy(horizon=100)
        state = PolicyState()
        mib = 2**20
        # 50 MiB at the default 50 MiB/s: 1 s; saving 5 ms/step x 100 = 0.5 s
        reason, cost = judge_move(policy, state, 0.005, 50 * mib)
        self.assertAlmostEqual(cost, 50 * mib / DEFAULT_BANDWIDTH)
        self.assertIn("does not exceed", reason or "")
        # measured 500 MiB/s: 0.1 s, pays
        fast = with_bandwidth(state, 500 * mib, 1.0)
        reason, cost = judge_move(policy, fast, 0.005, 50 * mib)
        self.assertIsNone(reason)
        self.assertAlmostEqual(cost, 0.1)
        # a reshard that moved nothing measures nothing
        self.assertIsNone(with_bandwidth(state, 0, 1.0).bandwidth)

    def test_budget(self) -> None:
        policy = RebalancePolicy(move_budget_bytes=1000, horizon=10**9)
        reason, _ = judge_move(policy, PolicyState(), 1.0, 1001)
        self.assertIn("over the budget of 1000 B", reason or "")
        reason, _ = judge_move(policy, PolicyState(), 1.0, 1000)
        self.assertIsNone(reason)

    def test_interval_and_backoff(self) -> None:
        policy = RebalancePolicy(window=10, min_interval=50, backoff=2)
        state = after_reshard(policy, PolicyState(streak=3), step=100)
        self.assertEqual((state.streak, state.last_reshard_step), (0, 100))
        self.assertIn("min_interval", blocked_reason(policy, state, 149) or "")
        self.assertIsNone(blocked_reason(policy, state, 150))
        state = after_failure(policy, state, step=200)
        self.assertEqual(state.blocked_until, 200 + 50 * 2)
        self.assertIn("backing off", blocked_reason(policy, state, 250) or "")
        state = after_failure(policy, state, step=300)
        self.assertEqual(state.blocked_until, 300 + 50 * 4)
        state = after_reshard(policy, state, step=600)
        self.assertEqual(state.failures, 0)

    def test_the_assumed_bandwidth_is_the_devices(self) -> None:
        cuda = RebalancePolicy().on_device("cuda")
        self.assertEqual(cuda.default_bandwidth, DEFAULT_BANDWIDTHS["cuda"])
        self.assertEqual(
            RebalancePolicy().on_device("cpu").default_bandwidth, DEFAULT_BANDWIDTH
        )
        self.assertGreater(DEFAULT_BANDWIDTHS["cuda"], DEFAULT_BANDWIDTH)
        mine = RebalancePolicy(default_bandwidth=123.0)
        self.assertEqual(mine.on_device("cuda").default_bandwidth, 123.0)
        self.assertAlmostEqual(
            byte_price(cuda, PolicyState()),
            1 / (DEFAULT_BANDWIDTHS["cuda"] * cuda.horizon),
        )

    def test_byte_price(self) -> None:
        policy = RebalancePolicy(horizon=1000)
        self.assertAlmostEqual(
            byte_price(policy, PolicyState()), 1 / (DEFAULT_BANDWIDTH * 1000)
        )
        fast = with_bandwidth(PolicyState(), 4e9, 1.0)
        self.assertAlmostEqual(byte_price(policy, fast), 1 / 4e12)

    def test_full_replan_gate_and_backoff(self) -> None:
        policy = RebalancePolicy(window=10, min_gain=0.1, min_interval=50, backoff=2)
        state = PolicyState()
        self.assertFalse(may_replan(policy, state, 0, gain_bound=0.05))
        self.assertTrue(may_replan(policy, state, 0, gain_bound=0.2))
        off = RebalancePolicy(full_replan=False)
        self.assertFalse(may_replan(off, state, 0, gain_bound=0.9))
        state = after_replan_started(state)
        self.assertFalse(may_replan(policy, state, 10, gain_bound=0.9))
        state = after_replan(policy, state, step=100, useful=False)
        self.assertFalse(state.replan_pending)
        self.assertEqual(state.replan_blocked_until, 100 + 50 * 2)
        self.assertFalse(may_replan(policy, state, 199, gain_bound=0.9))
        self.assertTrue(may_replan(policy, state, 200, gain_bound=0.9))
        state = after_replan(policy, after_replan_started(state), 200, False)
        self.assertEqual(state.replan_blocked_until, 200 + 50 * 4)
        state = after_replan(policy, after_replan_started(state), 400, True)
        self.assertEqual((state.replan_failures, state.replan_pending), (0, False))


class ReshardOutcomeTest(unittest.TestCase):
    def test_settled_on_the_median_of_the_windows_after(self) -> None:
        # predicted 80 ms; the first window after measures a transient 100 ms,
        # the next ones 96, 70, 74 and 70: the first window's error is -20%,
        # the settled one's (median 74 ms) +8.1%
        outcome = ReshardOutcome(60, 93.0, 80.0, 100.0, (100.0,))
        self.assertAlmostEqual(outcome.error, -0.2)
        self.assertEqual(outcome.settled_step_seconds, 100.0)
        for seconds in (96.0, 70.0, 74.0, 70.0):
            outcome = outcome.with_window(seconds)
        self.assertEqual(outcome.settling_step_seconds, (100.0, 96.0, 70.0, 74.0, 70.0))
        self.assertEqual(outcome.measured_step_seconds, 100.0)
        self.assertAlmostEqual(outcome.error, -0.2)
        self.assertEqual(outcome.settled_step_seconds, 74.0)
        self.assertAlmostEqual(outcome.settled_error, 80.0 / 74.0 - 1.0)
        # an even count: the mean of the middle two
        self.assertEqual(outcome.with_window(72.0).settled_step_seconds, 73.0)

    def test_without_settling_windows_the_first_window(self) -> None:
        outcome = ReshardOutcome(60, 93.0, 80.0, 100.0)
        self.assertEqual(outcome.settled_step_seconds, 100.0)
        self.assertAlmostEqual(outcome.settled_error, -0.2)
        self.assertEqual(ReshardOutcome(60, 93.0, 80.0, 0.0).settled_error, 0.0)


if __name__ == "__main__":
    unittest.main()

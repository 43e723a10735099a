#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The survivors' agreement and the watchers, driven by thread participants,
each with its own client connection to one local ``TCPStore`` (the oracle
is who was made to die, hang or stay): every survivor gets the same members;
a dead rank (its heartbeat stands still) is left out within the heartbeat
timeout, not the join timeout; a hung rank (its heartbeat moves, it never
checks in) is left out at the join timeout and fenced when it comes; a lost
coordinator is replaced after the join timeout; a watcher posts the fault
when the member it watches stops beating, and every watcher sees it; a rank
that leaves of its own accord is not taken as lost; a lost store raises
``FaultToleranceError``.
"""

import dataclasses
import threading
import time
import unittest
from datetime import timedelta
from typing import Dict, List

import torch.distributed as dist
from torchrec.distributed.resharding.fault.detector import FaultDetector, successor
from torchrec.distributed.resharding.fault.membership import (
    agree_on_members,
    Membership,
    read_fault,
    StoreKeys,
)
from torchrec.distributed.resharding.fault.options import (
    FaultOptions,
    FaultToleranceError,
    RankFencedError,
)
from torchrec.distributed.test_utils.store_participants import (
    local_store_clients,
    run_participants,
)

SIZE = 8
OPTIONS = FaultOptions(
    heartbeat_interval=timedelta(milliseconds=50),
    heartbeat_timeout=timedelta(milliseconds=500),
    join_timeout=timedelta(seconds=30),
)
# the watchers: a heartbeat timeout well above a thread's delays on a loaded
# machine (a false "lost" would fail the test)
WATCH = FaultOptions(
    heartbeat_interval=timedelta(milliseconds=100),
    heartbeat_timeout=timedelta(seconds=1.5),
)
SLACK_S = 3.0
BOUND = timedelta(seconds=60)


class _Beating:
    """Heartbeats of some ranks, from one thread, until stopped."""

    def __init__(self, store: object, keys: StoreKeys, ranks: List[int]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store, keys, ranks))
        self._thread.start()

    def _run(self, store: object, keys: StoreKeys, ranks: List[int]) -> None:
        while not self._stop.wait(0.02):
            for rank in ranks:
                store.add(keys.heartbeat(rank), 1)  # pyre-ignore[16]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class MembershipTest(unittest.TestCase):
    def _agree(
        self,
        callers: List[int],
        options: FaultOptions = OPTIONS,
        beating: List[int] = (),  # pyre-ignore[9]
        dead: List[int] = (),  # pyre-ignore[9]
    ) -> Dict[int, object]:
        keys = StoreKeys(f"test-{time.monotonic_ns()}")
        current = Membership(0, tuple(range(SIZE)))
        with local_store_clients(SIZE + 1) as (_, clients):
            for rank in list(dead) + list(beating):
                clients[SIZE].add(keys.heartbeat(rank), 1)
            beat = _Beating(clients[SIZE], keys, list(beating)) if beating else None
            try:
                outcomes = run_participants(
                    callers,
                    lambda r: agree_on_members(
                        clients[r], keys, r, current, options, f"rank {r} saw it"
                    ),
                    BOUND,
                )
            finally:
                if beat is not None:
                    beat.stop()
        return outcomes  # pyre-ignore[7]

    def test_everyone_present_no_one_lost(self) -> None:
        outcomes = self._agree(list(range(SIZE)))
        decided = {o.value for o in outcomes.values()}  # pyre-ignore[16]
        self.assertEqual(len(decided), 1, decided)
        (membership,) = decided
        self.assertEqual(membership.members, tuple(range(SIZE)))
        self.assertEqual(membership.lost, ())
        self.assertEqual(membership.generation, 1)

    def test_dead_rank_left_out_within_the_heartbeat_timeout(self) -> None:
        callers = [r for r in range(SIZE) if r != 5]
        outcomes = self._agree(callers, dead=[5])
        decided = {o.value for o in outcomes.values()}  # pyre-ignore[16]
        self.assertEqual(len(decided), 1, decided)
        (membership,) = decided
        self.assertEqual(membership.members, tuple(callers))
        self.assertEqual(membership.lost, (5,))
        slowest = max(o.seconds for o in outcomes.values())  # pyre-ignore[16]
        # the heartbeat timeout, not the join timeout (30 s)
        self.assertLess(slowest, OPTIONS.heartbeat_timeout.total_seconds() + SLACK_S)

    def test_hung_rank_left_out_at_the_join_timeout_and_fenced(self) -> None:
        options = dataclasses.replace(OPTIONS, join_timeout=timedelta(seconds=1.5))
        keys = StoreKeys("hung")
        current = Membership(0, tuple(range(SIZE)))
        callers = [r for r in range(SIZE) if r != 3]
        with local_store_clients(SIZE + 1) as (_, clients):
            clients[SIZE].add(keys.heartbeat(3), 1)
            beat = _Beating(clients[SIZE], keys, [3])
            try:
                outcomes = run_participants(
                    callers,
                    lambda r: agree_on_members(
                        clients[r], keys, r, current, options, "a collective failed"
                    ),
                    BOUND,
                )
                late = run_participants(
                    [3],
                    lambda r: agree_on_members(
                        clients[r], keys, r, current, options, "woke up"
                    ),
                    BOUND,
                )
            finally:
                beat.stop()
        decided = {o.value for o in outcomes.values()}  # pyre-ignore[16]
        self.assertEqual(len(decided), 1, decided)
        (membership,) = decided
        self.assertEqual(membership.lost, (3,))
        fastest = min(o.seconds for o in outcomes.values())  # pyre-ignore[16]
        self.assertGreaterEqual(fastest, options.join_bound.total_seconds() - 0.1)
        self.assertIsInstance(late[3].error, RankFencedError)

    def test_lost_coordinator_replaced_after_the_join_timeout(self) -> None:
        options = dataclasses.replace(OPTIONS, join_timeout=timedelta(seconds=1))
        keys = StoreKeys("coordinator")
        current = Membership(0, tuple(range(SIZE)))
        with local_store_clients(SIZE) as (_, clients):
            # rank 0 checks in first (so it coordinates) and dies
            clients[0].append(keys.of(0, "present"), "0,")
            clients[0].add(keys.of(0, "arrived"), 1)
            outcomes = run_participants(
                list(range(1, SIZE)),
                lambda r: agree_on_members(
                    clients[r], keys, r, current, options, "rank 0 is gone"
                ),
                BOUND,
            )
        decided = {o.value for o in outcomes.values()}  # pyre-ignore[16]
        self.assertEqual(len(decided), 1, decided)
        slowest = max(o.seconds for o in outcomes.values())  # pyre-ignore[16]
        self.assertLess(slowest, options.join_bound.total_seconds() + 1 + SLACK_S)

    def test_lost_store_raises_fault_tolerance_error(self) -> None:
        keys = StoreKeys("store")
        current = Membership(0, (0, 1))
        host = dist.TCPStore(
            "127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False
        )
        client = dist.TCPStore(
            "127.0.0.1", host.port, None, False, timedelta(seconds=5)
        )
        del host  # the store's host is gone
        with self.assertRaises(FaultToleranceError):
            agree_on_members(client, keys, 0, current, OPTIONS, "store gone")


class DetectorTest(unittest.TestCase):
    def test_successor_is_a_ring(self) -> None:
        self.assertEqual(successor([0, 2, 5], 0), 2)
        self.assertEqual(successor([0, 2, 5], 5), 0)
        self.assertIsNone(successor([4], 4))

    def test_watcher_posts_the_fault_of_a_stopped_heartbeat_and_all_see_it(
        self,
    ) -> None:
        keys = StoreKeys("watch")
        members = [0, 1, 2, 3]
        with local_store_clients(len(members) + 1) as (_, clients):
            detectors = [FaultDetector(clients[r], keys, r, WATCH) for r in members]
            for d in detectors:
                d.watch(0, members)
            time.sleep(0.3)
            # rank 3 leaves of its own accord: nobody takes it as lost
            detectors[3].leave()
            time.sleep(WATCH.heartbeat_timeout.total_seconds() * 2)
            self.assertIsNone(read_fault(clients[4], keys, 0))
            self.assertFalse(any(d.fault_seen for d in detectors[:3]))
            stopped = time.monotonic()
            detectors[1].stop()  # rank 1 dies: rank 0 watches it
            deadline = stopped + WATCH.heartbeat_timeout.total_seconds() + SLACK_S
            while time.monotonic() < deadline and not (
                detectors[0].fault_seen and detectors[2].fault_seen
            ):
                time.sleep(0.02)
            seen_after = time.monotonic() - stopped
            for d in detectors:
                d.stop()
            fault = read_fault(clients[4], keys, 0)
        self.assertTrue(detectors[0].fault_seen and detectors[2].fault_seen)
        # not before the timeout (less the interval its last beat may have
        # come before the stop, and one of the watcher's)
        interval = WATCH.heartbeat_interval.total_seconds()
        self.assertGreaterEqual(
            seen_after, WATCH.heartbeat_timeout.total_seconds() - 2 * interval
        )
        assert fault is not None
        self.assertEqual((fault.rank, fault.stale), (0, (1,)))


if __name__ == "__main__":
    unittest.main()

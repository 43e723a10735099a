#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The store agreement driven by 64 thread participants, each with its own
client connection to one local ``TCPStore``: every participant gets the same
merged facts or raises the same error; a participant that never comes (the
coordinator too) makes every other raise ``ReshardAbortedError`` within the
timeout, naming it; attempts follow one another (after an abort and after a
success) and leave no keys of old attempts; nobody returns before every
participant read the decision; each participant's round trips do not grow
with the number of participants.
"""

import itertools
import time
import unittest
from datetime import timedelta
from typing import Any, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

from torchrec.distributed.resharding.agreement import (
    agree_among_ranks,
    agree_on_store,
    Agreement,
)
from torchrec.distributed.resharding.plan import ReshardAbortedError, ReshardError
from torchrec.distributed.test_utils.multi_process_utils import (
    single_rank_process_group,
)
from torchrec.distributed.test_utils.store_participants import (
    CountingStore,
    local_store_clients,
    Outcome,
    run_participants,
    StoreTraffic,
)

SIZE = 64
# Where no timing is asserted: long enough for any load on the machine.
GENEROUS = timedelta(seconds=60)
# Where an abort is awaited: every present participant posts well within it.
SHORT = timedelta(seconds=2)
# An abort must come within SHORT plus this.
SLACK_S = 4.0
BOUND = timedelta(seconds=120)
# open 2, post 3 (+1 last, +6 first: clean attempt - 2), decide 2-3, close 1,
# delete the post 1, read barrier 2, leave barrier 1-2
MAX_ROUND_TRIPS = 20


def table_facts(index: int) -> Dict[str, Any]:
    """Participant ``index`` holds tables t<index>..t<index+2> and a step count."""
    return {
        "tables": {f"t{(index + k) % SIZE}": (index, k) for k in range(3)},
        "iter": 100 + index,
    }


def union(all_facts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The first participant that holds a table wins; the highest step count."""
    tables: Dict[str, Any] = {}
    for facts in all_facts:
        for name, fact in facts["tables"].items():
            tables.setdefault(name, fact)
    return {"tables": tables, "iter": max(f["iter"] for f in all_facts)}


def expected_union() -> Dict[str, Any]:
    # From the definition of table_facts: table t<j> is first held by the
    # lowest index i with j in {i, i+1, i+2} (mod SIZE), as its k = j - i.
    tables = {}
    for j in range(SIZE):
        i = 0 if j < 3 else j - 2
        tables[f"t{j}"] = (i, (j - i) % SIZE)
    return {"tables": tables, "iter": 100 + SIZE - 1}


def _refuse_to_load() -> None:
    raise RuntimeError("no such class here")


class Unreadable:
    """Pickles, but cannot be unpickled (as a class only its rank has)."""

    def __reduce__(self) -> Any:
        return (_refuse_to_load, ())


class AgreementTest(unittest.TestCase):
    clients: ClassVar[List[Any]]
    _contexts: ClassVar[Any]
    _bases: ClassVar[Iterator[int]]

    @classmethod
    def setUpClass(cls) -> None:
        cls._contexts = local_store_clients(SIZE)
        cls.host, cls.clients = cls._contexts.__enter__()
        cls._bases = itertools.count(1000, 1000)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._contexts.__exit__(None, None, None)

    def participants(self) -> List[int]:
        """Fresh global ranks (so a fresh rendezvous), not in index order."""
        base = next(self._bases)
        return [base + (7 * i) % SIZE for i in range(SIZE)]

    def agree(
        self,
        participants: Sequence[int],
        timeout: timedelta,
        present: Optional[Sequence[int]] = None,
        digest: Any = lambda i: 42,
        error: Any = lambda i: None,
        facts: Any = table_facts,
        merge: Any = union,
        stores: Optional[Sequence[Any]] = None,
    ) -> Dict[int, Outcome]:
        stores = stores or self.clients
        present = range(len(participants)) if present is None else present
        return run_participants(
            list(present),
            lambda i: agree_on_store(
                stores[i],
                i,
                participants,
                digest(i),
                error(i),
                facts(i),
                timeout,
                merge,
            ),
            BOUND,
        )

    def assert_same_error(
        self, outcomes: Dict[int, Outcome], kind: type, message: str
    ) -> None:
        for index, outcome in outcomes.items():
            self.assertIsInstance(outcome.error, kind, (index, outcome))
            self.assertEqual(str(outcome.error), message, index)

    def assert_agreed(self, outcomes: Dict[int, Outcome], merged: Any) -> Agreement:
        agreements = []
        for index, outcome in outcomes.items():
            self.assertIsNone(outcome.error, index)
            agreements.append(outcome.value)
        self.assertEqual(agreements[0].merged, merged)
        for agreement in agreements:
            self.assertEqual(agreement, agreements[0])
        return agreements[0]

    def assert_aborted_naming(
        self, outcomes: Dict[int, Outcome], missing: List[int], timeout: timedelta
    ) -> None:
        messages = {str(o.error) for o in outcomes.values()}
        self.assertEqual(len(messages), 1, messages)
        # Nobody can decide to abort before a whole timeout after the first
        # participant came; nobody waits much longer than its own timeout.
        first = min(o.started for o in outcomes.values())
        for index, outcome in outcomes.items():
            self.assertIsInstance(outcome.error, ReshardAbortedError, index)
            self.assertIn(f"ranks {missing} did not join", str(outcome.error))
            self.assertGreaterEqual(
                outcome.finished - first, timeout.total_seconds() * 0.99, index
            )
            self.assertLess(outcome.seconds, timeout.total_seconds() + SLACK_S, index)

    def test_success_merges_everywhere(self) -> None:
        calls: List[int] = []

        def counted_union(all_facts: List[Dict[str, Any]]) -> Dict[str, Any]:
            calls.append(len(all_facts))
            return union(all_facts)

        participants = self.participants()
        outcomes = self.agree(participants, GENEROUS, merge=counted_union)
        agreement = self.assert_agreed(outcomes, expected_union())
        self.assertEqual(calls, [SIZE])  # by the coordinator alone, once
        self.assertIsInstance(agreement.transaction, str)

    def test_without_merge_every_participants_facts_by_index(self) -> None:
        outcomes = self.agree(self.participants(), GENEROUS, merge=None)
        self.assert_agreed(outcomes, [table_facts(i) for i in range(SIZE)])

    def test_one_error_same_everywhere(self) -> None:
        errors = {17: "table t3 has no rows", 40: "table t9 is unknown"}
        outcomes = self.agree(self.participants(), GENEROUS, error=errors.get)
        self.assert_same_error(
            outcomes, ReshardError, "table t3 has no rows (reported by rank 17)"
        )

    def test_merge_error_same_everywhere(self) -> None:
        def refuse(all_facts: List[Dict[str, Any]]) -> Any:
            raise ReshardError("tables t1 and t2 disagree on their dimension")

        outcomes = self.agree(self.participants(), GENEROUS, merge=refuse)
        self.assert_same_error(
            outcomes, ReshardError, "tables t1 and t2 disagree on their dimension"
        )

    def test_unpicklable_facts_same_error_everywhere(self) -> None:
        outcomes = self.agree(
            self.participants(),
            GENEROUS,
            facts=lambda i: (lambda: i) if i == 5 else table_facts(i),
        )
        messages = {str(o.error) for o in outcomes.values()}
        self.assertEqual(len(messages), 1, messages)
        (message,) = messages
        self.assertIn("cannot be pickled", message)
        self.assertIn("(reported by rank 5)", message)
        for outcome in outcomes.values():
            self.assertIsInstance(outcome.error, ReshardError)

    def test_unreadable_facts_same_error_everywhere(self) -> None:
        outcomes = self.agree(
            self.participants(),
            GENEROUS,
            facts=lambda i: Unreadable() if i == 44 else table_facts(i),
        )
        self.assert_same_error(
            outcomes,
            ReshardError,
            "the ranks' facts cannot be read (RuntimeError: no such class here)",
        )

    def test_different_digests_same_error_everywhere(self) -> None:
        def digest(i: int) -> int:
            return 1 if i < 10 else (3 if i == 50 else 2)

        outcomes = self.agree(self.participants(), GENEROUS, digest=digest)
        groups = [list(range(10)), [i for i in range(10, SIZE) if i != 50], [50]]
        self.assert_same_error(
            outcomes,
            ReshardError,
            "ranks passed different resharding requests (every rank must pass "
            f"the same delta); ranks grouped by request: {sorted(groups)}",
        )

    def test_one_missing_aborts_within_timeout_naming_it(self) -> None:
        participants = self.participants()
        present = [i for i in range(SIZE) if i != 23]
        outcomes = self.agree(participants, SHORT, present=present)
        self.assert_aborted_naming(outcomes, [participants[23]], SHORT)

    def test_coordinator_missing_aborts_within_timeout_naming_it(self) -> None:
        participants = self.participants()
        outcomes = self.agree(participants, SHORT, present=range(1, SIZE))
        self.assert_aborted_naming(outcomes, [participants[0]], SHORT)

    def test_next_attempt_after_abort_rejoins_the_missing(self) -> None:
        participants = self.participants()
        present = [i for i in range(SIZE) if i != 23]
        aborted = self.agree(participants, SHORT, present=present)
        self.assert_aborted_naming(aborted, [participants[23]], SHORT)
        # 23 only comes now: it joins the others at their next attempt.
        outcomes = self.agree(participants, GENEROUS)
        self.assert_agreed(outcomes, expected_union())

    def test_attempts_in_a_row_are_distinct_transactions(self) -> None:
        participants = self.participants()
        first = self.assert_agreed(self.agree(participants, GENEROUS), expected_union())
        second = self.assert_agreed(
            self.agree(participants, GENEROUS, digest=lambda i: 7, merge=None),
            [table_facts(i) for i in range(SIZE)],
        )
        self.assertNotEqual(first.transaction, second.transaction)

    def test_old_attempts_leave_no_keys(self) -> None:
        participants = self.participants()
        counts = []
        for attempt in range(6):
            if attempt == 1:
                present = [i for i in range(SIZE) if i != 9]
                outcomes = self.agree(participants, SHORT, present=present)
                self.assert_aborted_naming(outcomes, [participants[9]], SHORT)
            else:
                outcomes = self.agree(participants, GENEROUS)
                self.assert_agreed(outcomes, expected_union())
            counts.append(self.host.num_keys())
        # Once two attempts are past, each new attempt deletes what the one
        # two before it left: the count stays put.
        self.assertEqual(counts[3:], [counts[3]] * 3, counts)
        # No participant's facts stay behind after a decision was read.
        self.assertLess(counts[5] - counts[0], SIZE // 2, counts)

    def agree_with_one_slow_call(
        self, method: str, key_suffix: str
    ) -> Tuple[Dict[int, Outcome], float]:
        """
        Every participant agrees; participant 30's one store call ``method``
        on a key ending in ``key_suffix`` is 1.5 s late.

        Args:
            method (str): the store method delayed.
            key_suffix (str): the end of the key it is delayed on.

        Returns:
            Tuple[Dict[int, Outcome], float]: the outcomes (agreed on the
            union), and when the late call returned.
        """
        slow = 30
        delay_s = 1.5
        done_at: List[float] = []

        def slow_call(called: str, keys: Sequence[str]) -> float:
            if called == method and keys[0].endswith(key_suffix):
                done_at.append(time.perf_counter() + delay_s)
                return delay_s
            return 0.0

        stores = list(self.clients)
        stores[slow] = CountingStore(
            self.clients[slow], StoreTraffic(), delay=slow_call
        )
        outcomes = self.agree(self.participants(), GENEROUS, stores=stores)
        self.assert_agreed(outcomes, expected_union())
        self.assertEqual(len(done_at), 1)
        return outcomes, done_at[0]

    def test_nobody_returns_before_everyone_read_the_decision(self) -> None:
        outcomes, read_at = self.agree_with_one_slow_call("get", "/decision")
        for index, outcome in outcomes.items():
            self.assertGreaterEqual(outcome.finished, read_at, index)

    def test_the_coordinator_returns_after_the_others_are_done(self) -> None:
        # The coordinator hosts the job's store whenever it takes part: it must
        # not return (and let its process exit) while another participant
        # still waits on the store.
        outcomes, left_at = self.agree_with_one_slow_call("add", "/left")
        self.assertGreaterEqual(outcomes[0].finished, left_at)

    def test_round_trips_do_not_grow_with_participants(self) -> None:
        def traffic(size: int) -> List[StoreTraffic]:
            counted = [StoreTraffic() for _ in range(size)]
            stores = [CountingStore(c, t) for c, t in zip(self.clients, counted)]
            base = next(self._bases)
            outcomes = self.agree(
                [base + i for i in range(size)],
                GENEROUS,
                facts=lambda i: {"tables": {}, "iter": i},
                merge=lambda f: max(x["iter"] for x in f),
                stores=stores,
            )
            for outcome in outcomes.values():
                self.assertIsNone(outcome.error)
                self.assertEqual(outcome.value.merged, size - 1)
            return counted

        small, large = traffic(8), traffic(SIZE)
        # A fixed number of round trips each (the coordinator's one multi_get
        # reads every post), whatever the number of participants.
        for counted in (small, large):
            self.assertLessEqual(max(t.calls for t in counted), MAX_ROUND_TRIPS)
        # Bytes: the others' do not grow either.
        others_small = max(t.bytes for t in small[1:])
        for t in large[1:]:
            self.assertLessEqual(t.bytes, others_small + 64)


class AgreeAmongRanksTest(unittest.TestCase):
    def test_on_the_default_store_as_this_rank(self) -> None:
        with single_rank_process_group():
            for _ in range(3):
                agreement = agree_among_ranks(
                    [0], 5, None, table_facts(0), GENEROUS, merge=union
                )
                self.assertEqual(agreement.merged, union([table_facts(0)]))
            with self.assertRaisesRegex(ReshardError, r"^bad \(reported by rank 0\)$"):
                agree_among_ranks([0], 5, "bad", table_facts(0), GENEROUS)
            # the default timeout of the default group's backend
            self.assertEqual(agree_among_ranks([0], 5, None, 1).merged, [1])


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A failure in the exchange reaches every rank in seconds, and every wait is
bounded, connects included (``abort_signal.AbortSignal``):

* the store protocol, its participants threads on one store: the gate (a
  store barrier) opens once every rank arrived and fails, naming how many
  came, when one never does (a rank that died after the build's agreement);
  a posted abort key ends a barrier at once; only the first post counts;
  acknowledgements are counted;
* an exchange group's waits poll completion, never give a work a timeout of
  its own, end at the abort key within ``ABORT_POLL_SECONDS``, and at the
  exchange timeout otherwise; a failing rank posts the key and aborts, an
  aborted rank acknowledges after its abort;
* four gloo ranks: one fails right before the barrier while the others wait
  in it; every survivor raises ReshardAbortedError within seconds of the
  failure (the exchange timeout is 60 s; without the key, a survivor that is
  no ring neighbour of the failed rank waits it out), the module unchanged;
* two processes, one SIGKILLed right after the build's agreement: the other
  raises ReshardAbortedError at the gate within the exchange timeout, lives
  on, and no ``exception_dump`` key is on the job's store.
"""

import contextlib
import dataclasses
import threading
import time
import unittest
from datetime import timedelta
from typing import Any, Callable, List, Optional
from unittest import mock

import torch
import torch.distributed as dist
from torchrec.distributed.resharding import reshard_module, ReshardAbortedError
from torchrec.distributed.resharding.abort_signal import (
    ABORT_POLL_SECONDS,
    AbortedByPeer,
    AbortSignal,
)
from torchrec.distributed.resharding.exchange_group import ExchangeGroup
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.reshard import ModuleReshard
from torchrec.distributed.test_utils.killed_rank import assert_survivor_aborted_in_time
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import (
    assert_state_dicts_equal,
    delta,
    ReshardTestBase,
)
from torchrec.distributed.test_utils.transaction_doubles import RecordingBackend


def _in_threads(size: int, run: Callable[[int], Any]) -> List[Any]:
    """``run(rank)`` for every rank in a thread of its own; each one's result
    or exception."""
    results: List[Any] = [None] * size

    def target(rank: int) -> None:
        try:
            results[rank] = run(rank)
        except BaseException as e:  # the test inspects it
            results[rank] = e

    threads = [threading.Thread(target=target, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def _signals(size: int) -> List[AbortSignal]:
    store = dist.HashStore()
    return [AbortSignal(store, size, rank) for rank in range(size)]


class StoreProtocolTest(unittest.TestCase):
    def test_the_gate_opens_when_every_rank_arrived(self) -> None:
        signals = _signals(4)

        def arrive(rank: int) -> float:
            time.sleep(0.05 * rank)
            signals[rank].arrive(AbortSignal.GATE, timedelta(seconds=10))
            return time.monotonic()

        results = _in_threads(4, arrive)
        self.assertTrue(all(isinstance(r, float) for r in results), results)
        self.assertLess(max(results) - min(results), 0.5)

    def test_a_rank_that_never_comes_fails_the_others_in_time(self) -> None:
        signals = _signals(4)
        start = time.monotonic()
        results = _in_threads(
            4,
            lambda rank: (
                None
                if rank == 2
                else signals[rank].arrive(AbortSignal.GATE, timedelta(seconds=1))
            ),
        )
        for rank in (0, 1, 3):
            # timed out itself, or woken by the first rank that timed out
            self.assertIsInstance(results[rank], (ReshardAbortedError, AbortedByPeer))
            self.assertIn("of 4 ranks reached the gate barrier", str(results[rank]))
        self.assertLess(time.monotonic() - start, 5)

    def test_an_abort_key_ends_the_gate_at_once(self) -> None:
        signals = _signals(3)

        def run(rank: int) -> Optional[float]:
            if rank == 2:
                time.sleep(0.3)
                self.assertTrue(signals[2].post("RuntimeError: injected"))
                return None
            start = time.monotonic()
            with self.assertRaisesRegex(AbortedByPeer, "rank 2: .*injected"):
                signals[rank].arrive(AbortSignal.GATE, timedelta(seconds=30))
            return time.monotonic() - start

        results = _in_threads(3, run)
        for rank in (0, 1):
            self.assertLess(results[rank], 0.3 + 3 * ABORT_POLL_SECONDS)

    def test_the_first_post_wins_and_acknowledgements_count(self) -> None:
        a, b, c = _signals(3)
        self.assertIsNone(a.reason())
        self.assertTrue(b.post("first"))
        self.assertFalse(a.post("second"))
        self.assertEqual(c.reason(), "rank 1: first")
        self.assertFalse(b.await_acknowledgements(0.05))
        a.acknowledge()
        c.acknowledge()
        self.assertTrue(b.await_acknowledgements(1.0))


def _pending_pair() -> List[Any]:
    """Two gloo backends of one group in this process (threads connect)."""
    store = dist.HashStore()
    backends: List[Any] = [None, None]

    def connect(rank: int) -> None:
        backends[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))

    _in_threads(2, connect)
    return backends


class WaitTest(unittest.TestCase):
    def _group(self, backend: Any, signal: AbortSignal, seconds: float) -> Any:
        return ExchangeGroup(
            RecordingBackend(backend, []),
            0,
            2,
            timedelta(seconds=seconds),
            torch.device("cpu"),
            owned=True,
            name="t",
            signal=signal,
        )

    def test_a_wait_ends_at_the_abort_key_and_at_the_timeout(self) -> None:
        backend, _ = _pending_pair()  # its peer never joins the barrier
        signal, other = _signals(2)
        group = self._group(backend, signal, 30)
        threading.Timer(0.2, lambda: other.post("injected")).start()
        start = time.monotonic()
        with self.assertRaisesRegex(AbortedByPeer, "rank 1: injected"):
            group.barrier()
        self.assertLess(time.monotonic() - start, 0.2 + 3 * ABORT_POLL_SECONDS)
        # the work was polled, never given a timeout of its own
        log = group.backend.log
        self.assertEqual(log[0][0], "allreduce")
        self.assertEqual({name for name, _, _ in log[1:]}, {"work.is_completed"})

        backend, _ = _pending_pair()
        group = self._group(backend, _signals(2)[0], 0.5)
        start = time.monotonic()
        with self.assertRaisesRegex(TimeoutError, "did not complete within"):
            group.barrier()
        self.assertLess(time.monotonic() - start, 3)

    def test_nccl_works_are_polled_then_waited_for_without_a_timeout(self) -> None:
        # what the group does on CUDA, shown with a real gloo collective
        sender, receiver = _pending_pair()
        group = dataclasses.replace(
            self._group(sender, _signals(2)[0], 30), device=torch.device("cuda", 0)
        )
        peer = receiver.allreduce([torch.ones(2)], dist.AllreduceOptions())
        work = group.backend.allreduce([torch.ones(2)], dist.AllreduceOptions())
        group.wait([work])
        self.assertTrue(peer.wait())
        waits = [args for name, args, _ in group.backend.log if name == "work.wait"]
        self.assertEqual(waits, [()])

    def test_the_failing_rank_posts_and_aborts_an_aborted_one_acknowledges(
        self,
    ) -> None:
        backend, peer = _pending_pair()
        mine, theirs = _signals(2)
        group = self._group(backend, mine, 30)
        other = ExchangeGroup(
            RecordingBackend(peer, []),
            1,
            2,
            timedelta(seconds=30),
            torch.device("cpu"),
            owned=True,
            name="t",
            signal=theirs,
        )
        group.fail("RuntimeError: injected")
        self.assertEqual(group.backend.calls, ["abort"])
        self.assertEqual(theirs.reason(), "rank 0: RuntimeError: injected")
        with self.assertRaises(AbortedByPeer):
            other.raise_if_aborted()
        other.fail("AbortedByPeer: rank 0: RuntimeError: injected")
        self.assertEqual(other.backend.calls, ["abort"])
        self.assertTrue(mine.await_acknowledgements(0.1))


# every table moves to the next rank: each rank sends and receives
FOUR_RANKS_A = {f"t{i}": ("table_wise", i) for i in range(4)}
FOUR_RANKS_B = {f"t{i}": ("table_wise", (i + 1) % 4) for i in range(4)}
EXCHANGE_TIMEOUT = timedelta(seconds=60)
FAILING_RANK = 3


def _run_survivors_abort_in_seconds(rank: int, world_size: int, port: str) -> None:
    with reshard_scenario(rank, world_size, port, 4, timeout_s=120) as s:
        a, b = s.plan(FOUR_RANKS_A), s.plan(FOUR_RANKS_B)
        module, reference = s.shard(a), s.shard(a)
        store = dist.PrefixStore("test_abort_signal/", s.pg.get_group_store())
        options = ReshardOptions(exchange_timeout=EXCHANGE_TIMEOUT)

        def failing(*args: Any, **kwargs: Any) -> None:
            store.set("failed_at", repr(time.time()))
            raise RuntimeError("injected right before the barrier")

        fault = (
            mock.patch.object(ModuleReshard, "after_exchange", failing)
            if rank == FAILING_RANK
            else contextlib.nullcontext()
        )
        try:
            with fault:
                reshard_module(module, delta(a, b), s.env, s.device, options)
        except ReshardAbortedError as e:
            raised_at = time.time()
            assert "module is unchanged" in str(e), e
            if rank == FAILING_RANK:
                # The failed rank holds its error, and with it the exchange
                # group, while the others wait: gloo's connections stay open,
                # so only the abort key tells them (without it the ranks
                # waiting on this one in the barrier wait the timeout out).
                survivors = [f"seconds/{r}" for r in range(world_size) if r != rank]
                store.wait(survivors, timedelta(seconds=90))
        else:
            raise AssertionError("the reshard must fail on every rank")
        failed_at = float(store.get("failed_at").decode())
        seconds = raised_at - failed_at
        store.set(f"seconds/{rank}", repr(seconds))
        # within seconds, far from the 60 s exchange timeout
        assert seconds < 10.0, (rank, seconds)
        assert_state_dicts_equal(module.state_dict(), reference.state_dict())
        dist.barrier(group=s.pg)
        if rank == 0:
            times = [
                float(store.get(f"seconds/{r}").decode()) for r in range(world_size)
            ]
            print(
                "survivors raised ReshardAbortedError "
                + ", ".join(f"rank {r}: {t:.2f} s" for r, t in enumerate(times))
                + f" after rank {FAILING_RANK} failed (exchange timeout "
                f"{EXCHANGE_TIMEOUT.total_seconds():.0f} s)"
            )
        # the next reshard goes through
        reshard_module(module, delta(a, b), s.env, s.device, options)
        reshard_module(reference, delta(a, b), s.env, s.device, options)
        assert_state_dicts_equal(module.state_dict(), reference.state_dict())


class SurvivorsTest(ReshardTestBase):
    def test_survivors_abort_within_seconds_of_a_failure(self) -> None:
        self.run_ranks(_run_survivors_abort_in_seconds, world_size=4)


class KilledRankTest(unittest.TestCase):
    def test_a_rank_killed_after_the_build_agreement_fails_the_others_in_time(
        self,
    ) -> None:
        # gloo here; NCCL where the machine has two GPUs (there
        # test_dynamic_sharding_gpu runs it too)
        survivor = assert_survivor_aborted_in_time(
            timeout_s=5.0, alive_s=1.0, slack_s=10.0
        )
        self.assertIn("module is unchanged", survivor.error)


if __name__ == "__main__":
    unittest.main()

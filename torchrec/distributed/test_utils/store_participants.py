#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Simulated participants of a store protocol: threads, each with its own client
connection to one local ``TCPStore``, started together and joined within a
bound (a protocol that hangs fails the caller instead of hanging it), and a
store proxy that counts every participant's round trips and bytes.
"""

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch.distributed as dist

LOCALHOST = "127.0.0.1"


@contextlib.contextmanager
def local_store_clients(
    count: int, timeout: timedelta = timedelta(seconds=120)
) -> Iterator[Tuple[dist.TCPStore, List[dist.TCPStore]]]:
    """
    A ``TCPStore`` on a free local port and ``count`` client connections to
    it, connected in parallel.

    Args:
        count (int): how many clients.
        timeout (timedelta): the stores' default timeout (their ``get`` and
            ``multi_get`` wait that long for a missing key).

    Returns:
        Iterator[Tuple[dist.TCPStore, List[dist.TCPStore]]]: the host's store
        and the clients.
    """
    host = dist.TCPStore(LOCALHOST, 0, None, True, timeout, wait_for_workers=False)

    def connect(_: int) -> dist.TCPStore:
        return dist.TCPStore(LOCALHOST, host.port, None, False, timeout)

    with ThreadPoolExecutor(max_workers=min(count, 64) or 1) as pool:
        clients = list(pool.map(connect, range(count)))
    try:
        yield host, clients
    finally:
        del clients
        del host


@dataclass
class StoreTraffic:
    """
    One participant's traffic through the store.

    Args:
        calls (int): store calls, each one round trip.
        bytes_sent (int): bytes of the values it set, appended or proposed.
        bytes_received (int): bytes of the values it got back.
    """

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def bytes(self) -> int:
        """Bytes both ways."""
        return self.bytes_sent + self.bytes_received


def _nbytes(value: Union[str, bytes]) -> int:
    return len(value.encode() if isinstance(value, str) else value)


class CountingStore:
    """
    A store with the methods of ``torch.distributed.Store`` that forwards every
    call to ``store`` and counts it in ``traffic``. One per participant (it is
    not shared between threads).

    Args:
        store (dist.Store): the store it forwards to.
        traffic (StoreTraffic): where it counts.
        delay (Optional[Callable[[str, Sequence[str]], float]]): seconds to
            sleep before a call, given the method's name and its keys (to
            make one participant slow at one step); default none.
    """

    def __init__(
        self,
        store: dist.Store,
        traffic: StoreTraffic,
        delay: Optional[Callable[[str, Sequence[str]], float]] = None,
    ) -> None:
        self._store = store
        self.traffic = traffic
        self._delay = delay

    def _call(self, method: str, keys: Sequence[str], sent: int = 0) -> None:
        if self._delay is not None:
            seconds = self._delay(method, keys)
            if seconds > 0:
                time.sleep(seconds)
        self.traffic.calls += 1
        self.traffic.bytes_sent += sent

    def _received(self, value: Union[str, bytes]) -> Any:
        self.traffic.bytes_received += _nbytes(value)
        return value

    def set(self, key: str, value: Union[str, bytes]) -> None:
        self._call("set", [key], _nbytes(value))
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        self._call("get", [key])
        return self._received(self._store.get(key))

    def multi_get(self, keys: Sequence[str]) -> List[bytes]:
        self._call("multi_get", keys)
        return [self._received(v) for v in self._store.multi_get(list(keys))]

    def multi_set(
        self, keys: Sequence[str], values: Sequence[Union[str, bytes]]
    ) -> None:
        self._call("multi_set", keys, sum(_nbytes(v) for v in values))
        self._store.multi_set(list(keys), list(values))

    def append(self, key: str, value: Union[str, bytes]) -> None:
        self._call("append", [key], _nbytes(value))
        self._store.append(key, value)

    def add(self, key: str, amount: int) -> int:
        self._call("add", [key])
        return self._store.add(key, amount)

    def compare_set(
        self, key: str, expected: Union[str, bytes], desired: Union[str, bytes]
    ) -> bytes:
        self._call("compare_set", [key], _nbytes(expected) + _nbytes(desired))
        return self._received(self._store.compare_set(key, expected, desired))

    def check(self, keys: Sequence[str]) -> bool:
        self._call("check", keys)
        return self._store.check(list(keys))

    def wait(self, keys: Sequence[str], timeout: Optional[timedelta] = None) -> None:
        self._call("wait", keys)
        if timeout is None:
            self._store.wait(list(keys))
        else:
            self._store.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        self._call("delete_key", [key])
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        self._call("num_keys", [])
        return self._store.num_keys()


@dataclass(frozen=True)
class Outcome:
    """
    What one participant's call did.

    Args:
        value (Any): what it returned (None if it raised).
        error (Optional[BaseException]): what it raised, if anything.
        started (float): ``time.perf_counter()`` when it was called.
        finished (float): ``time.perf_counter()`` when it returned or raised.
    """

    value: Any
    error: Optional[BaseException]
    started: float
    finished: float

    @property
    def seconds(self) -> float:
        """How long the call took."""
        return self.finished - self.started


def run_participants(
    indices: Sequence[int], call: Callable[[int], Any], bound: timedelta
) -> Dict[int, Outcome]:
    """
    Calls ``call(index)`` for every index on its own thread, all released at
    once, and waits for them.

    Args:
        indices (Sequence[int]): the participants that take part (the others
            of a protocol are absent).
        call (Callable[[int], Any]): one participant's part.
        bound (timedelta): how long all of them may take together.

    Returns:
        Dict[int, Outcome]: each participant's outcome.

    Raises:
        AssertionError: when a participant is still running after ``bound``
            (it is left behind, on a daemon thread).
    """
    outcomes: Dict[int, Outcome] = {}
    start = threading.Barrier(len(indices))

    def participant(index: int) -> None:
        start.wait()
        began = time.perf_counter()
        try:
            value, error = call(index), None
        except BaseException as e:  # the outcome under test
            value, error = None, e
        outcomes[index] = Outcome(value, error, began, time.perf_counter())

    threads = [
        threading.Thread(target=participant, args=(i,), daemon=True) for i in indices
    ]
    for thread in threads:
        thread.start()
    deadline = time.perf_counter() + bound.total_seconds()
    for thread in threads:
        thread.join(max(0.0, deadline - time.perf_counter()))
    stuck = [i for i, t in zip(indices, threads) if t.is_alive()]
    if stuck:
        raise AssertionError(f"participants {stuck} still running after {bound}")
    return outcomes

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A rank's watcher: one small thread that, every heartbeat interval, adds to
the rank's heartbeat, looks for the generation's fault key and watches the
next member's heartbeat (a ring: each rank watches one other, so a rank's
traffic does not grow with the job). A heartbeat that stands still for the
heartbeat timeout posts the fault. The thread does three store round trips
per interval on a connection of its own (``Store.clone``), so a wait of the
training thread on the store never blocks it, and nothing CPU-heavy: the
training thread keeps the interpreter.

The training thread asks :meth:`FaultDetector.fault_seen` between steps;
on NCCL, ``on_fault`` aborts the training group's communicators at once, so
a survivor blocked in a collective with the dead rank is freed (gloo has no
abort: its collectives end at their own timeout, which ``FaultOptions``
bounds).
"""

import logging
import threading
import time
from typing import Callable, Optional, Sequence, Tuple

import torch.distributed as dist
from torchrec.distributed.resharding.fault.membership import (
    post_fault,
    read_fault,
    Staleness,
    StoreKeys,
)
from torchrec.distributed.resharding.fault.options import FaultOptions

logger: logging.Logger = logging.getLogger(__name__)


def successor(members: Sequence[int], rank: int) -> Optional[int]:
    """
    The member ``rank`` watches: the next one in ascending order, the first
    after the last (none when alone).

    Args:
        members (Sequence[int]): the generation's members, ascending.
        rank (int): a member.

    Returns:
        Optional[int]: the watched member.
    """
    if len(members) < 2:
        return None
    index = list(members).index(rank)
    return members[(index + 1) % len(members)]


class FaultDetector:
    """
    This rank's heartbeat and watcher (see the module docstring).

    Args:
        store (dist.Store): the job's store (the thread uses a clone).
        keys (StoreKeys): the job's keys.
        rank (int): this rank's global rank.
        options (FaultOptions): interval and timeout.
        on_fault (Optional[Callable[[], None]]): called once per generation,
            from the thread, when the fault is seen (e.g. an NCCL abort).
    """

    def __init__(
        self,
        store: dist.Store,
        keys: StoreKeys,
        rank: int,
        options: FaultOptions,
        on_fault: Optional[Callable[[], None]] = None,
    ) -> None:
        self._store: dist.Store = store.clone()
        self._keys = keys
        self._rank = rank
        self._options = options
        self._on_fault = on_fault
        self._lock = threading.Lock()
        self._generation = 0
        self._members: Tuple[int, ...] = (rank,)
        self._fault = threading.Event()
        self._store_error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # the first beat, before anyone may watch it
        self._store.add(keys.heartbeat(rank), 1)

    def watch(self, generation: int, members: Sequence[int]) -> None:
        """
        Watches a generation (from the training thread): clears the fault
        seen in the previous one and starts the thread on first use.

        Args:
            generation (int): the generation.
            members (Sequence[int]): its members, ascending.
        """
        with self._lock:
            self._generation = generation
            self._members = tuple(members)
            self._fault.clear()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"torchrec-fault-watch-{self._rank}", daemon=True
            )
            self._thread.start()

    @property
    def fault_seen(self) -> bool:
        """Whether the watched generation's fault is posted."""
        return self._fault.is_set()

    @property
    def store_error(self) -> Optional[BaseException]:
        """The error of the store, if the thread could not reach it."""
        return self._store_error

    def leave(self) -> None:
        """
        Says this rank leaves the job of its own accord (its heartbeat will
        stop: nobody takes it as lost), and stops the thread.
        """
        self._store.set(self._keys.left(self._rank), "1")
        self.stop()

    def stop(self) -> None:
        """Stops the thread (within one interval)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5 * self._options.heartbeat_interval.total_seconds())

    def _run(self) -> None:
        interval = self._options.heartbeat_interval.total_seconds()
        staleness = Staleness(self._options.heartbeat_timeout.total_seconds())
        watching: Tuple[int, Optional[int]] = (-1, None)
        while not self._stop.wait(interval):
            with self._lock:
                generation, members = self._generation, self._members
            watched = successor(members, self._rank)
            if (generation, watched) != watching:
                watching = (generation, watched)
                staleness = Staleness(self._options.heartbeat_timeout.total_seconds())
            try:
                self._tick(generation, watched, staleness)
            except Exception as e:  # the store is gone: the training thread stops
                self._store_error = e
                self._fault.set()
                return

    def _tick(
        self, generation: int, watched: Optional[int], staleness: Staleness
    ) -> None:
        store, keys = self._store, self._keys
        store.add(keys.heartbeat(self._rank), 1)
        if self._fault.is_set():
            return
        fault = read_fault(store, keys, generation)
        if fault is None and watched is not None:
            beat = int(store.add(keys.heartbeat(watched), 0))
            # 0: it has not started watching yet
            if (
                beat > 0
                and staleness.stale(watched, beat, time.monotonic())
                and not store.check([keys.left(watched)])
            ):
                fault = post_fault(
                    store,
                    keys,
                    generation,
                    self._rank,
                    f"the heartbeat of rank {watched} stopped",
                    [watched],
                )
        if fault is None:
            return
        with self._lock:
            current = generation == self._generation
        if current:
            logger.warning(
                "rank %d: fault in generation %d: %s (rank %d)",
                self._rank,
                generation,
                fault.reason,
                fault.rank,
            )
            self._fault.set()
            if self._on_fault is not None:
                try:
                    self._on_fault()
                except Exception:
                    logger.exception("rank %d: on_fault failed", self._rank)

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A rank SIGKILLed right after a reshard's build agreement, before the exchange
group connects, in processes of their own (a test harness that expects every
rank to finish cannot lose one). The survivors must raise
``ReshardAbortedError`` within the exchange timeout (the store gate before
the connect: an NCCL connect has no timeout of its own), stay alive for
seconds afterwards, and find no ``exception_dump`` key on the job's store
(NCCL's watchdog posts it before it tears processes down). NCCL where the
machine has a GPU per rank, gloo otherwise.
"""

import contextlib
import multiprocessing
import os
import queue
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Optional
from unittest import mock

import torch.distributed as dist
from torchrec.distributed.resharding import reshard_module, ReshardAbortedError
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.runner import _Exchange
from torchrec.distributed.test_utils.multi_process_utils import free_port
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import delta

# every table moves to the next rank
_KILLED_PLAN_A = {"t0": ("table_wise", 0), "t1": ("table_wise", 1)}
_KILLED_PLAN_B = {"t0": ("table_wise", 1), "t1": ("table_wise", 0)}
# NCCL's dump signal on timeout waits this long (the default is 15 s)
DUMP_WAIT_MS = "500"


@dataclass(frozen=True)
class SurvivorOutcome:
    """What a surviving rank saw."""

    rank: int
    error: str
    seconds: float
    dump_key: bool


def root_store(store: dist.Store) -> dist.Store:
    """The store under every prefix (where NCCL posts ``exception_dump``)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _die(*args: Any, **kwargs: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _rank(
    rank: int,
    world_size: int,
    port: str,
    timeout_s: float,
    alive_s: float,
    results: "multiprocessing.Queue[Any]",
) -> None:
    os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] = DUMP_WAIT_MS
    victim = rank == world_size - 1
    with reshard_scenario(rank, world_size, port, 2, timeout_s=60) as s:
        a, b = s.plan(_KILLED_PLAN_A), s.plan(_KILLED_PLAN_B)
        module = s.shard(a)
        options = ReshardOptions(exchange_timeout=timedelta(seconds=timeout_s))
        start = time.monotonic()
        error = "no error"
        # the exchange phase starts right after the build's agreement
        fault = mock.patch.object(_Exchange, "run", _die)
        with fault if victim else contextlib.nullcontext():
            try:
                reshard_module(module, delta(a, b), s.env, s.device, options)
            except ReshardAbortedError as e:
                error = str(e)
        seconds = time.monotonic() - start
        time.sleep(alive_s)  # the process lives on
        store = root_store(s.pg.get_group_store())
        results.put(
            SurvivorOutcome(rank, error, seconds, store.check(["exception_dump"]))
        )
    results.close()
    results.join_thread()  # flushed before the exit below
    os._exit(0)  # a peer is gone: no teardown that could wait for it


def run_killed_after_agreement(
    world_size: int = 2, timeout_s: float = 5.0, alive_s: float = 5.0
) -> List[Optional[SurvivorOutcome]]:
    """
    Runs the reshard on ``world_size`` processes, the last one killed right
    after the build's agreement.

    Args:
        world_size (int): ranks.
        timeout_s (float): the exchange timeout.
        alive_s (float): how long a survivor lives on after its error.

    Returns:
        List[Optional[SurvivorOutcome]]: by rank (None for the killed rank);
        raises AssertionError when the killed rank did not die by SIGKILL or
        a survivor did not exit cleanly.
    """
    context = multiprocessing.get_context("spawn")
    results: "multiprocessing.Queue[Any]" = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_rank, args=(r, world_size, port, timeout_s, alive_s, results)
        )
        for r in range(world_size)
    ]
    for p in processes:
        p.start()
    deadline = time.monotonic() + 180
    outcomes: List[Optional[SurvivorOutcome]] = [None] * world_size
    for _ in range(world_size - 1):
        try:
            outcome = results.get(timeout=max(1.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        outcomes[outcome.rank] = outcome
    for p in processes:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in processes]
    assert codes[-1] == -signal.SIGKILL, codes
    assert all(code == 0 for code in codes[:-1]), codes
    return outcomes


def assert_survivor_aborted_in_time(
    timeout_s: float, alive_s: float, slack_s: float, world_size: int = 2
) -> SurvivorOutcome:
    """
    Runs :func:`run_killed_after_agreement` and checks rank 0, a survivor:
    its error says that all ranks but the killed one reached the gate
    barrier, it came within the exchange timeout plus ``slack_s``, and no
    exception dump was posted.

    Args:
        timeout_s (float): the exchange timeout.
        alive_s (float): how long a survivor lives on after its error.
        slack_s (float): how much later than the timeout the error may come.
        world_size (int): ranks.

    Returns:
        SurvivorOutcome: rank 0's outcome, for further checks.
    """
    survivor = run_killed_after_agreement(world_size, timeout_s, alive_s)[0]
    assert survivor is not None
    reached = f"{world_size - 1} of {world_size} ranks reached the gate barrier"
    assert reached in survivor.error, survivor.error
    assert survivor.seconds < timeout_s + slack_s, survivor.seconds
    assert not survivor.dump_key, survivor
    return survivor

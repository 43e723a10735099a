#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
How the ranks of one transaction tell each other it failed, through the
job's store and not through the exchange group (which may be the thing that
hangs): the first rank that fails posts the transaction's abort key; the
others see it within :data:`ABORT_POLL_SECONDS` while they wait, abort their
own communicators and acknowledge; the failed rank then aborts its own. The
same keys make the liveness gate every member passes right before a group
connects (``ncclCommInitRank`` has no timeout of its own).
"""

from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from torchrec.distributed.resharding.agreement import job_store
from torchrec.distributed.resharding.plan import ReshardAbortedError

# the job's store keys of exchange groups: f"{STORE_PREFIX}/{transaction}/"
STORE_PREFIX = "torchrec_reshard_exchange"

# A rank waiting on an exchange looks for the transaction's abort key this
# often (one store round trip each time): a failure elsewhere reaches it
# within about this long, not after the exchange timeout.
ABORT_POLL_SECONDS: float = 0.2

# The rank that posts the abort key of an NCCL exchange waits this long at
# most for the other ranks to abort their own communicators before it aborts
# its own (see :class:`AbortSignal`).
ABORT_GRACE_SECONDS: float = 5.0


class AbortedByPeer(Exception):
    """Another rank of the transaction failed and posted its abort key."""


class AbortSignal:
    """
    One transaction's keys on the job's store, under
    ``{STORE_PREFIX}/{transaction}/signal/``: the abort key and the store
    barriers around the exchange.

    The first rank that fails in the exchange posts the abort key
    (:meth:`post`); every rank waiting on the exchange looks for it between
    short waits (:meth:`reason`) and fails at once, instead of waiting out
    the exchange timeout on a peer that will never come. On NCCL the order
    matters: a rank that sees the key aborts its own communicator first
    (which stops its watchdog), then acknowledges; the rank that posted
    aborts its own communicator once every other rank acknowledged (or after
    :data:`ABORT_GRACE_SECONDS`), so that no communicator sees a peer's abort
    as an error of its own, which NCCL's watchdog would answer by tearing the
    process down.

    The barriers (:meth:`arrive`) run on the store, not on the group: the
    gate right before the group connects (a rank that died after the build's
    agreement, or never comes, fails the others within the exchange timeout
    instead of leaving them in an NCCL connect no timeout bounds), and the
    barrier after the fill (a rank waiting there holds no collective of the
    group that a failed peer would leave pending). A waiting rank blocks in
    one ``store.wait``; the last rank to arrive opens the barrier, and the
    abort key closes every barrier not yet open, so waiters wake at once.

    Args:
        store (dist.Store): the transaction's keys (a ``PrefixStore``).
        size (int): the transaction's ranks.
        rank (int): this rank among them.
    """

    ABORT = "abort"
    ACKNOWLEDGED = "acknowledged"
    GATE = "gate"
    FILLED = "filled"
    _OPEN = b"open"

    def __init__(self, store: dist.Store, size: int, rank: int) -> None:
        self._store = store
        self.size = size
        self.rank = rank

    @staticmethod
    def of(transaction: str, size: int, rank: int) -> "AbortSignal":
        """
        Args:
            transaction (str): the agreement's transaction name.
            size (int): the transaction's ranks.
            rank (int): this rank among them.

        Returns:
            AbortSignal: the transaction's keys on the job's store.
        """
        prefix = f"{STORE_PREFIX}/{transaction}/signal/"
        return AbortSignal(dist.PrefixStore(prefix, job_store()), size, rank)

    def reason(self) -> Optional[str]:
        """
        Returns:
            Optional[str]: the abort key's text, None while nobody posted it.
        """
        if not self._store.check([self.ABORT]):
            return None
        return self._store.get(self.ABORT).decode(errors="replace")

    def post(self, reason: str) -> bool:
        """
        Posts the abort key unless another rank did first, and closes the
        barriers not yet open.

        Args:
            reason (str): what failed, for the others' errors.

        Returns:
            bool: whether this rank posted it, now or before (else another
            rank had).
        """
        mine = f"rank {self.rank}: "
        text = mine + reason
        posted = self._store.compare_set(self.ABORT, "", text)
        for barrier in (self.GATE, self.FILLED):
            self._store.compare_set(f"{barrier}/all", "", text)
        return posted.startswith(mine.encode())

    def acknowledge(self) -> None:
        """Tells the rank that posted the key that this rank aborted."""
        if self._store.add(self.ACKNOWLEDGED, 1) >= self.size - 1:
            self._store.set(f"{self.ACKNOWLEDGED}/all", self._OPEN)

    def await_acknowledgements(self, seconds: float) -> bool:
        """
        Waits (at most ``seconds``) until every other rank acknowledged.

        Returns:
            bool: whether all did.
        """
        if self.size < 2:
            return True
        try:
            self._store.wait(
                [f"{self.ACKNOWLEDGED}/all"], timedelta(seconds=max(seconds, 1e-3))
            )
        except dist.DistStoreError:
            return False
        return True

    def arrive(self, barrier: str, timeout: timedelta) -> None:
        """
        Arrives at a barrier (:data:`GATE`, :data:`FILLED`) and waits until
        every rank did, or a rank posted the abort key, at most ``timeout``.

        Args:
            barrier (str): which barrier.
            timeout (timedelta): the exchange timeout.

        Returns:
            None

        Raises:
            AbortedByPeer: a rank posted the abort key.
            ReshardAbortedError: not every rank arrived within ``timeout``
                (this rank then posts the abort key).
        """
        done = f"{barrier}/all"
        if self._store.add(barrier, 1) >= self.size:
            self._store.compare_set(done, "", self._OPEN)
        try:
            self._store.wait([done], timeout)
        except dist.DistStoreError:
            arrived = self._store.add(barrier, 0)
            message = (
                f"{arrived} of {self.size} ranks reached the {barrier} barrier "
                f"of the exchange within {timeout}"
            )
            self.post(message)
            raise ReshardAbortedError(message)
        value = self._store.get(done)
        if value != self._OPEN:
            raise AbortedByPeer(value.decode(errors="replace"))

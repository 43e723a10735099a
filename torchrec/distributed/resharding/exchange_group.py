#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The ranks of one transaction, connected for its exchange.

A transaction moves its bytes on a group of its own, so that a failed exchange
never leaves stray messages on the groups training uses. Only its members make
it, once they agreed: :func:`open_exchange_group` builds a backend with
``torch.distributed``'s public classes (``ProcessGroupGloo``,
``ProcessGroupNCCL``) on a ``PrefixStore`` of the job's store named for the
transaction. Nothing else in the job sees it: no registry of
``torch.distributed`` is written, the job's group counter is not touched, and
the names of two transactions never meet in the store (``new_group`` with local
synchronization names a group by its ranks and by how many groups the caller
has, which neither holds across the members of a move nor across two groups
over the same ranks).

:class:`ExchangeGroup` drives such a backend, or any existing process group
(:meth:`ExchangeGroup.over`), through its own methods, with ranks numbered in
the group: the point-to-point messages of the exchange and the few
collectives around it, every wait bounded by the group's timeout.

On NCCL (see ``docs/gpu.md``):

* a group is connected once, eagerly, bound to this rank's device
  (``eager_connect_single_device``); ``exchange_groups.ExchangeGroups``
  keeps it for later transactions of the same members (the members agree
  that each of them kept it, else they connect a new one), and replaces it
  only after a failure;
* each round's sends and receives are one coalesced group call (the backend's
  coalescing, as ``dist.batch_isend_irecv`` uses it): NCCL runs them on the
  group's one communicator, never on a communicator per pair of ranks;
* a failure aborts the group (:meth:`ExchangeGroup.abort`): NCCL's
  ``abort()`` ends this rank's kernels at once, where ``shutdown()`` would
  wait for kernels that a dead peer never completes (gloo's ``abort()`` and
  ``shutdown()`` do nothing in torch 2.13). A success shuts a group down
  (:meth:`ExchangeGroup.close`) or keeps it;
* no work is given a timeout of its own (``WorkNCCL::wait(timeout)`` aborts
  the communicator behind the watchdog's back, which then tears the process
  down): :meth:`ExchangeGroup.wait` polls completion against the exchange
  timeout and the transaction's abort key (``abort_signal.AbortSignal``), and the
  caller aborts first. The backend's own (watchdog) timeout is
  :data:`WATCHDOG_FACTOR` times longer than the exchange's;
* the first rank that fails posts the abort key: the others abort their
  communicators within :data:`ABORT_POLL_SECONDS` and acknowledge, then the
  failed rank aborts its own, so that no watchdog sees a peer's abort as its
  own error. Every rank passes a liveness gate on the store right before the
  group connects (``ncclCommInitRank`` has no timeout).
"""

import dataclasses
import io
import logging
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.resharding.abort_signal import (
    ABORT_GRACE_SECONDS,
    ABORT_POLL_SECONDS,
    AbortedByPeer,
    AbortSignal,
    STORE_PREFIX,
)
from torchrec.distributed.resharding.agreement import default_timeout, job_store
from torchrec.distributed.resharding.device_memory import free_device_bytes
from torchrec.distributed.resharding.devices import normalized_device
from torchrec.distributed.resharding.plan import ReshardAbortedError

logger: logging.Logger = logging.getLogger(__name__)

# An NCCL group's own timeout (its watchdog's) is this many times the exchange
# timeout that bounds every wait: the caller sees a stall first and aborts.
WATCHDOG_FACTOR = 2

# Pauses between two looks at a work's completion.
_FIRST_PAUSE_S: float = 5e-5
_LONGEST_PAUSE_S: float = 5e-3


@dataclass(frozen=True)
class Message:
    """
    One point-to-point message of an exchange round.

    Args:
        tensor (torch.Tensor): what is sent, or where it is received.
        peer (int): the other rank, numbered in the group.
        tag (int): the message's tag (its place in the pair's list).
        send (bool): whether this rank sends it (else receives it).
    """

    tensor: torch.Tensor
    peer: int
    tag: int
    send: bool


@dataclass(frozen=True)
class ExchangeGroup:
    """
    A group of ranks an exchange runs on, driven through the backend's own
    methods with group-local ranks.

    Args:
        backend (Any): a ``dist.ProcessGroup`` or a backend
            (``ProcessGroupGloo``, ``ProcessGroupNCCL``).
        rank (int): this rank in the group.
        size (int): the group's size.
        timeout (timedelta): bound of every wait on the group.
        device (torch.device): where the group's collectives' tensors live.
        owned (bool): whether the group was made for transactions (then
            :meth:`close` shuts it down and :meth:`abort` aborts it).
        name (str): the name of the transaction that connected it, or the
            process group's.
        coalesced (bool): whether a round's messages are posted as one
            coalesced call of the backend (NCCL: one communicator for every
            pair) rather than one by one (gloo).
        signal (Optional[AbortSignal]): the current transaction's abort key
            (a group of :meth:`over` has none).
        communicator_bytes (int): device memory its connect took on this
            rank (NCCL: ``mem_get_info`` before and after; 0 on CPU).
    """

    backend: Any
    rank: int
    size: int
    timeout: timedelta
    device: torch.device
    owned: bool = False
    name: str = ""
    coalesced: bool = False
    signal: Optional[AbortSignal] = field(default=None, compare=False)
    communicator_bytes: int = field(default=0, compare=False)

    @staticmethod
    def over(
        group: dist.ProcessGroup,
        timeout: Optional[timedelta] = None,
        device: Optional[torch.device] = None,
    ) -> "ExchangeGroup":
        """
        An existing process group, as an exchange group.

        Args:
            group (dist.ProcessGroup): the group (this rank is a member).
            timeout (Optional[timedelta]): bound of every wait (default: the
                default group's backend's timeout).
            device (Optional[torch.device]): where its collectives' tensors
                live (default: CPU).

        Returns:
            ExchangeGroup: the group; closing or aborting it leaves ``group``
            alone. On CUDA its rounds are coalesced (NCCL). Its waits are
            polled against ``timeout`` and never handed to NCCL (whose timed
            wait would abort the training communicator behind its watchdog's
            back): a stalled exchange raises here, and its work stays
            pending on ``group``, for that group's own watchdog to act on at
            its own timeout (on NCCL with the default error handling: the
            process is torn down, as for any stuck collective of training).
            Keep ``timeout`` generous on a group training uses.
        """
        device = normalized_device(device or torch.device("cpu"))
        return ExchangeGroup(
            backend=group,
            rank=dist.get_rank(group),
            size=dist.get_world_size(group),
            timeout=timeout or default_timeout(),
            device=device,
            name=group.group_name,
            coalesced=device.type == "cuda",
        )

    # ------------------------------------------------------------- messages

    def post(self, messages: Sequence[Message]) -> List[Any]:
        """
        Posts messages and returns their works. Per peer, the lower rank of the
        pair posts its sends first and the higher one its receives first, in
        the order given: a pair's two streams of messages meet in the same
        order on both sides, whatever the backend. A coalesced group posts
        them as one call of the backend, which returns one work.

        Args:
            messages (Sequence[Message]): this rank's messages of one round.

        Returns:
            List[Any]: their works (wait with :meth:`wait`).
        """
        ordered = _pair_order(messages, self.rank)
        if not self.coalesced:
            return [self._p2p(m) for m in ordered]
        if not ordered:
            return []
        self._start_coalescing()
        for m in ordered:
            self._p2p(m)
        return [self._end_coalescing()]

    def _start_coalescing(self) -> None:
        # A ProcessGroup (``over``) coalesces on the backend of a device type;
        # a backend (``ProcessGroupNCCL``, ``ProcessGroupGloo``) takes no
        # argument: ``Backend._start_coalescing(self)`` in torch 2.13 and 2.14.
        if isinstance(self.backend, dist.ProcessGroup):
            self.backend._start_coalescing(self.device)
        else:
            self.backend._start_coalescing()

    def _end_coalescing(self) -> Any:
        if isinstance(self.backend, dist.ProcessGroup):
            return self.backend._end_coalescing(self.device)
        return self.backend._end_coalescing()

    def _p2p(self, m: Message) -> Any:
        if m.send:
            return self.backend.send([m.tensor], m.peer, m.tag)
        return self.backend.recv([m.tensor], m.peer, m.tag)

    def wait(self, works: Sequence[Any]) -> None:
        """
        Waits for works of this group, all of them within the group's timeout,
        looking for the transaction's abort key meanwhile. A work is never
        given a timeout of its own on CUDA: ``WorkNCCL::wait(timeout)`` aborts
        the communicator itself when it expires, before this rank can stop
        the group's watchdog (which then sees the abort as an error and tears
        the process down, with the default error handling); here the works are
        polled and the caller decides, aborting first (:meth:`fail`). A group
        of :meth:`over` (a group training uses) is never aborted: its work
        stays pending for its own watchdog. On CPU (gloo, whose
        point-to-point works report completion only from ``wait``) each work
        is waited for with the time left; a failed peer's closed connections
        end them at once, and the collectives around the exchange look for
        the abort key.

        Args:
            works (Sequence[Any]): works from :meth:`post` or a collective.

        Returns:
            None

        Raises:
            AbortedByPeer: another rank posted the abort key.
            TimeoutError: the works did not complete within the timeout.
        """
        self._wait(works, poll=self.device.type == "cuda")

    def _wait(self, works: Sequence[Any], poll: bool) -> None:
        deadline = time.monotonic() + self.timeout.total_seconds()
        for work in works:
            if poll:
                self._poll(work, deadline)
            else:
                left = max(deadline - time.monotonic(), 1e-3)
                work.wait(timedelta(seconds=left))

    def _poll(self, work: Any, deadline: float) -> None:
        pause = _FIRST_PAUSE_S
        look = time.monotonic() + ABORT_POLL_SECONDS
        while not work.is_completed():
            now = time.monotonic()
            if now >= look:
                self.raise_if_aborted()
                look = now + ABORT_POLL_SECONDS
            if now >= deadline:
                raise TimeoutError(
                    f"the exchange did not complete within {self.timeout}"
                )
            time.sleep(pause)
            pause = min(2 * pause, _LONGEST_PAUSE_S)
        work.wait()

    def raise_if_aborted(self) -> None:
        """
        Raises:
            AbortedByPeer: when another rank posted the transaction's abort key.
        """
        if self.signal is not None:
            reason = self.signal.reason()
            if reason is not None:
                raise AbortedByPeer(reason)

    # ---------------------------------------------------------- collectives

    def all_reduce_max(self, values: List[int]) -> List[int]:
        """
        Args:
            values (List[int]): this rank's values (as many on every rank).

        Returns:
            List[int]: the element-wise maximum over the group.
        """
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._wait([self.backend.allreduce([tensor], opts)], poll=True)
        return [int(v) for v in tensor.tolist()]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """
        Broadcasts ``tensor`` in place from the group's rank ``src``.

        Args:
            tensor (torch.Tensor): the data on ``src``, where it lands elsewhere
                (on the group's device).
            src (int): the source, numbered in the group.

        Returns:
            None
        """
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._wait([self.backend.broadcast([tensor], opts)], poll=True)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """
        Broadcasts a picklable object from the group's rank ``src``.

        Args:
            obj (Any): the object on ``src`` (ignored elsewhere).
            src (int): the source, numbered in the group.

        Returns:
            Any: the object, on every rank.
        """
        if self.rank == src:
            buffer = io.BytesIO()
            pickle.dump(obj, buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            payload = payload.to(self.device)
            size = torch.tensor(
                [payload.numel()], dtype=torch.int64, device=self.device
            )
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(size, src)
        if self.rank != src:
            payload = torch.empty(
                int(size.item()), dtype=torch.uint8, device=self.device
            )
        self.broadcast(payload, src)
        if self.rank == src:
            return obj
        return pickle.loads(payload.cpu().numpy().tobytes())

    def barrier(self) -> None:
        """Waits (bounded) until every rank of the group reached it."""
        self.all_reduce_max([0])

    def close(self) -> None:
        """
        Shuts down a group made for transactions once they succeeded (NCCL
        finishes its queued work first; gloo's ``shutdown()`` does nothing in
        torch 2.13, its connections close when the backend is dropped);
        leaves a group from :meth:`over` alone.

        Returns:
            None
        """
        if not self.owned:
            return
        try:
            self.backend.shutdown()
        except Exception:  # already broken: nothing is left to finish
            logger.debug("shutting the exchange group down failed", exc_info=True)

    def abort(self) -> None:
        """
        Aborts a group made for transactions after a failure: on NCCL its
        communicator and its pending works end here at once (``abort()``,
        where ``shutdown()`` would wait for kernels a dead peer never
        completes); a peer learns of it only from its own communicator's
        error or from the transaction's abort key. Gloo's ``abort()`` does
        nothing in torch 2.13 (``Backend::abort() {}``): peers still waiting
        on a gloo group see an error once this rank drops the backend (its
        connections close) or at their own timeout. Leaves a group from
        :meth:`over` (a group training uses) alone: its failed works raised.

        Returns:
            None
        """
        if not self.owned:
            return
        try:
            self.backend.abort()
        except Exception:  # a group broken by the failure it reports
            logger.debug("aborting the exchange group failed", exc_info=True)

    def fail(self, reason: str) -> None:
        """
        After a failure on this rank: posts the transaction's abort key (the
        other ranks stop waiting within :data:`ABORT_POLL_SECONDS`) and aborts
        the group. On NCCL the rank that posted the key aborts its
        communicator once the others aborted theirs (each acknowledges after
        its own abort; at most :data:`ABORT_GRACE_SECONDS`), so that no
        communicator sees a peer's abort before its own watchdog was stopped.
        A failure that is another rank's abort key is acknowledged after the
        abort.

        Args:
            reason (str): what failed (the others' errors name it).

        Returns:
            None
        """
        signal = self.signal
        first = False
        if signal is not None:
            try:
                first = signal.post(reason)
            except Exception:  # the job's store is gone: nobody to tell
                logger.warning("could not post the abort key", exc_info=True)
                signal = None
        if signal is not None and first and self.owned and self.device.type == "cuda":
            grace = min(ABORT_GRACE_SECONDS, self.timeout.total_seconds())
            if not signal.await_acknowledgements(grace):
                logger.warning(
                    "not every rank acknowledged the abort within %.1f s", grace
                )
        self.abort()
        if signal is not None and not first:
            signal.acknowledge()

    def with_signal(self, signal: AbortSignal) -> "ExchangeGroup":
        """The same connected group, for the transaction of ``signal``."""
        return dataclasses.replace(self, signal=signal)

    def with_timeout(self, timeout: timedelta) -> "ExchangeGroup":
        """The same connected group, every wait bounded by ``timeout``."""
        if timeout == self.timeout:
            return self
        if self.owned:
            self.backend.set_timeout(_backend_timeout(timeout, self.device))
        return dataclasses.replace(self, timeout=timeout)


def _pair_order(messages: Sequence[Message], rank: int) -> List[Message]:
    """Per peer in ascending order: the lower rank's sends first, in order."""
    by_peer: Dict[int, Tuple[List[Message], List[Message]]] = {}
    for m in messages:
        sends, recvs = by_peer.setdefault(m.peer, ([], []))
        (sends if m.send else recvs).append(m)
    ordered: List[Message] = []
    for peer in sorted(by_peer):
        sends, recvs = by_peer[peer]
        ordered += sends + recvs if rank < peer else recvs + sends
    return ordered


def _backend_timeout(timeout: timedelta, device: torch.device) -> timedelta:
    """The backend's own timeout: NCCL's watchdog acts after the caller."""
    return timeout * WATCHDOG_FACTOR if device.type == "cuda" else timeout


def _connect(
    store: dist.Store,
    global_ranks: Sequence[int],
    rank: int,
    timeout: timedelta,
    device: torch.device,
    name: str,
) -> Any:
    """
    A backend of the ranks on ``store`` for tensors on ``device``: gloo on
    CPU; on CUDA an NCCL group connected at once (its communicator over every
    member, on this rank's device) whose errors raise in the caller first.
    """
    size = len(global_ranks)
    if device.type == "cpu":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options.global_ranks_in_group = list(global_ranks)
        options.group_name = name
        backend = dist.ProcessGroupNCCL(store, rank, size, options)
        backend.set_timeout(_backend_timeout(timeout, device))
        backend.eager_connect_single_device(device)
        return backend
    raise ValueError(f"live resharding cannot exchange {device.type} tensors")


def open_exchange_group(
    global_ranks: Sequence[int],
    transaction: str,
    timeout: Optional[timedelta] = None,
    device: Optional[torch.device] = None,
) -> ExchangeGroup:
    """
    Connects the ranks of one transaction for its exchange: only they call
    it, once they agreed on ``transaction`` (a name no other transaction has).
    Close it with :meth:`ExchangeGroup.close`.

    Args:
        global_ranks (Sequence[int]): the members, numbered in the group in
            this order; this rank among them.
        transaction (str): the agreement's transaction name.
        timeout (Optional[timedelta]): bound of connecting and of every wait
            (default: the default group's backend's timeout).
        device (Optional[torch.device]): where the exchanged tensors live:
            gloo connects CPU ranks, NCCL CUDA ones (default: CPU).

    Returns:
        ExchangeGroup: the group.

    Raises:
        ReshardAbortedError: when a peer does not connect within the timeout.
    """
    timeout = timeout or default_timeout()
    device = normalized_device(device or torch.device("cpu"))
    ranks = list(global_ranks)
    rank = ranks.index(dist.get_rank())
    store = dist.PrefixStore(f"{STORE_PREFIX}/{transaction}/", job_store())
    free_before = free_device_bytes(device)
    try:
        backend = _connect(store, ranks, rank, timeout, device, transaction)
        free_after = free_device_bytes(device)
    except Exception as e:
        raise ReshardAbortedError(
            f"could not connect the ranks for the shard exchange ({type(e).__name__}:"
            f" {e}); nothing moved and the model is unchanged"
        ) from e
    return ExchangeGroup(
        backend,
        rank,
        len(ranks),
        timeout,
        device,
        owned=True,
        name=transaction,
        coalesced=bool(backend.supports_coalescing),
        communicator_bytes=(
            max(0, free_before - free_after)
            if free_before is not None and free_after is not None
            else 0
        ),
    )

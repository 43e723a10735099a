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
"""

import io
import logging
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.resharding.agreement import default_timeout, job_store
from torchrec.distributed.resharding.plan import ReshardAbortedError

logger: logging.Logger = logging.getLogger(__name__)

# the job's store keys of exchange groups: f"{STORE_PREFIX}/{transaction}/"
STORE_PREFIX = "torchrec_reshard_exchange"


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
        owned (bool): whether the group was made for one transaction (then
            :meth:`close` shuts it down).
        name (str): the transaction's name, or the process group's.
    """

    backend: Any
    rank: int
    size: int
    timeout: timedelta
    device: torch.device
    owned: bool = False
    name: str = ""

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
            ExchangeGroup: the group; closing it leaves ``group`` alone.
        """
        return ExchangeGroup(
            backend=group,
            rank=dist.get_rank(group),
            size=dist.get_world_size(group),
            timeout=timeout or default_timeout(),
            device=device or torch.device("cpu"),
            name=group.group_name,
        )

    # ------------------------------------------------------------- messages

    def post(self, messages: Sequence[Message]) -> List[Any]:
        """
        Posts messages and returns their works. Per peer, the lower rank of the
        pair posts its sends first and the higher one its receives first, in
        the order given: a pair's two streams of messages meet in the same
        order on both sides, whatever the backend.

        Args:
            messages (Sequence[Message]): this rank's messages of one round.

        Returns:
            List[Any]: their works (wait with :meth:`wait`).
        """
        by_peer: Dict[int, Tuple[List[Message], List[Message]]] = {}
        for m in messages:
            sends, recvs = by_peer.setdefault(m.peer, ([], []))
            (sends if m.send else recvs).append(m)
        works = []
        for peer in sorted(by_peer):
            sends, recvs = by_peer[peer]
            ordered = sends + recvs if self.rank < peer else recvs + sends
            for m in ordered:
                if m.send:
                    works.append(self.backend.send([m.tensor], m.peer, m.tag))
                else:
                    works.append(self.backend.recv([m.tensor], m.peer, m.tag))
        return works

    def wait(self, works: Sequence[Any]) -> None:
        """
        Waits for works of this group, each at most the group's timeout.

        Args:
            works (Sequence[Any]): works from :meth:`post` or a collective.

        Returns:
            None
        """
        for work in works:
            work.wait(self.timeout)

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
        self.wait([self.backend.allreduce([tensor], opts)])
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
        self.wait([self.backend.broadcast([tensor], opts)])

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
        Shuts down a group made for one transaction (after a failed exchange
        this also fails the works peers still wait on, instead of letting them
        wait); leaves a group from :meth:`over` alone.

        Returns:
            None
        """
        if not self.owned:
            return
        try:
            self.backend.shutdown()
        except Exception:  # a group broken by the failure it reports
            logger.debug("shutting the exchange group down failed", exc_info=True)


def _connect(
    store: dist.Store, rank: int, size: int, timeout: timedelta, device: torch.device
) -> Any:
    """A backend of ``size`` ranks on ``store`` for tensors on ``device``."""
    if device.type == "cpu":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
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
    device = device or torch.device("cpu")
    ranks = list(global_ranks)
    rank = ranks.index(dist.get_rank())
    store = dist.PrefixStore(f"{STORE_PREFIX}/{transaction}/", job_store())
    try:
        backend = _connect(store, rank, len(ranks), timeout, device)
    except Exception as e:
        raise ReshardAbortedError(
            f"could not connect the ranks for the shard exchange ({type(e).__name__}:"
            f" {e}); nothing moved and the model is unchanged"
        ) from e
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return ExchangeGroup(
        backend, rank, len(ranks), timeout, device, owned=True, name=transaction
    )

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The exchange groups one rank keeps connected between transactions.

NCCL connects a group's communicator once, eagerly, and a kept group holds
device memory outside PyTorch's allocator. :class:`ExchangeGroups` keeps one
:class:`~torchrec.distributed.resharding.exchange_group.ExchangeGroup` per set of
members and device type (the least recently used beyond ``max_groups`` is
aborted), measures what each connect took, and remembers the peers each
group exchanged with; :func:`kept_exchange_groups` is the one a
``ShardingEnv`` keeps for its transactions (:func:`keep_exchange_groups`
installs others), and
:func:`same_kept_group` is the coordinator's answer to whether every member
kept the same one.
"""

import logging
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Dict, Iterable, Optional, Sequence, Set, Tuple

import torch
from torchrec.distributed.resharding.exchange_group import (
    ExchangeGroup,
    open_exchange_group,
)

logger: logging.Logger = logging.getLogger(__name__)

# How many exchange groups an ExchangeGroups keeps connected at most (the
# least recently used beyond that is aborted): one for the job's group and
# one for a move's union, say.
DEFAULT_KEPT_GROUPS: int = 2

# The attribute of a ShardingEnv under which the default path keeps its
# exchange groups (see kept_exchange_groups).
_KEPT_GROUPS_ATTRIBUTE = "_reshard_exchange_groups"


GroupKey = Tuple[Tuple[int, ...], str]


class ExchangeGroups:
    """
    The exchange groups one rank keeps connected between transactions: one
    per set of members (in their order) and device type, at most
    ``max_groups`` of them (the least recently used beyond that is aborted).
    Transactions without ``ReshardOptions.exchange_groups`` use the one their
    ``ShardingEnv`` keeps (:func:`kept_exchange_groups`); a ``Rebalancer``
    keeps one; NCCL then connects each set of members once rather than per
    reshard. A group that took part in a failure is aborted and forgotten;
    the next transaction of its members connects a new one.

    Members agree before using a kept group: each states the name of the one
    it kept (:meth:`kept_name`); only when every member kept the same group
    do they reuse it (:meth:`open`), else each drops its own and they connect
    anew.

    Kept NCCL communicators hold device memory outside PyTorch's allocator:
    each group's connect is measured (``mem_get_info`` before and after,
    :attr:`communicator_bytes`), the pre-flight budgets the next connect of
    as many members with the last such figure, and the peers a group has
    exchanged with (whose point-to-point buffers NCCL allocates on first use)
    are remembered (:meth:`new_peers`).

    Args:
        max_groups (int): groups kept at most (at least 1).
    """

    def __init__(self, max_groups: int = DEFAULT_KEPT_GROUPS) -> None:
        if max_groups < 1:
            raise ValueError(f"max_groups must be at least 1, got {max_groups}")
        self.max_groups = max_groups
        self._groups: "OrderedDict[GroupKey, ExchangeGroup]" = OrderedDict()
        self._peers: Dict[GroupKey, Set[int]] = {}
        # (members, device type) -> device bytes of the last such connect
        self._measured: Dict[Tuple[int, str], int] = {}
        self.connected: int = 0
        self.evicted: int = 0

    @staticmethod
    def _key(global_ranks: Sequence[int], device: torch.device) -> GroupKey:
        return (tuple(global_ranks), device.type)

    def kept_name(self, global_ranks: Sequence[int], device: torch.device) -> str:
        """
        Args:
            global_ranks (Sequence[int]): the members, in their order.
            device (torch.device): where the exchanged tensors live.

        Returns:
            str: the name of the group kept for them ("" if none).
        """
        group = self._groups.get(self._key(global_ranks, device))
        return group.name if group is not None else ""

    @property
    def communicator_bytes(self) -> int:
        """Device bytes the kept groups' connects took on this rank."""
        return sum(group.communicator_bytes for group in self._groups.values())

    def measured_bytes(self, members: int, device: torch.device) -> Optional[int]:
        """
        Args:
            members (int): a group's size.
            device (torch.device): its device.

        Returns:
            Optional[int]: the device bytes the last connect of a group of
            that size took on this rank (None before the first).
        """
        return self._measured.get((members, device.type))

    def new_peers(
        self, global_ranks: Sequence[int], device: torch.device, peers: Iterable[int]
    ) -> int:
        """
        Args:
            global_ranks (Sequence[int]): the members, in their order.
            device (torch.device): where the exchanged tensors live.
            peers (Iterable[int]): group-local ranks this rank will exchange
                with.

        Returns:
            int: how many of them the kept group never exchanged with (all,
            without a kept group).
        """
        key = self._key(global_ranks, device)
        known = self._peers.get(key, set()) if key in self._groups else set()
        return len(set(peers) - known)

    def note_peers(
        self, global_ranks: Sequence[int], device: torch.device, peers: Iterable[int]
    ) -> None:
        """Remembers the peers the members' kept group exchanged with."""
        key = self._key(global_ranks, device)
        if key in self._groups:
            self._peers.setdefault(key, set()).update(peers)

    def open(
        self,
        global_ranks: Sequence[int],
        transaction: str,
        timeout: timedelta,
        device: torch.device,
        reuse: str = "",
    ) -> ExchangeGroup:
        """
        The members' group: the kept one when every member agreed to reuse it
        (``reuse`` is its name), else a new one connected under
        ``transaction`` (the one kept before, if any, is aborted: a peer no
        longer has it). Keeping it may evict the least recently used group.

        Args:
            global_ranks (Sequence[int]): the members, in their order.
            transaction (str): the agreement's transaction name.
            timeout (timedelta): bound of connecting and of every wait.
            device (torch.device): where the exchanged tensors live.
            reuse (str): the kept group's name every member stated, or "".

        Returns:
            ExchangeGroup: the group (keep it until :meth:`discard` or
            :meth:`close`).

        Raises:
            ReshardAbortedError: when a peer does not connect in time.
        """
        key = self._key(global_ranks, device)
        kept = self._groups.get(key)
        if kept is not None and reuse and kept.name == reuse:
            group = kept.with_timeout(timeout)
            self._groups[key] = group
            self._groups.move_to_end(key)
            return group
        if kept is not None:
            self.discard(kept)
        group = self.connect(global_ranks, transaction, timeout, device)
        self.connected += 1
        self._measured[(len(global_ranks), device.type)] = group.communicator_bytes
        self._groups[key] = group
        self._peers[key] = set()
        while len(self._groups) > self.max_groups:
            evicted_key, evicted = self._groups.popitem(last=False)
            self._peers.pop(evicted_key, None)
            self.evicted += 1
            logger.info(
                "evicting exchange group %s (%d B of communicator memory): more "
                "than %d kept",
                evicted.name,
                evicted.communicator_bytes,
                self.max_groups,
            )
            evicted.abort()
        return group

    def connect(
        self,
        global_ranks: Sequence[int],
        transaction: str,
        timeout: timedelta,
        device: torch.device,
    ) -> ExchangeGroup:
        """
        Connects a new group (:func:`open_exchange_group`); a subclass may
        connect another way (e.g. a backend that records its calls).

        Args:
            global_ranks (Sequence[int]): the members, in their order.
            transaction (str): the agreement's transaction name.
            timeout (timedelta): bound of connecting and of every wait.
            device (torch.device): where the exchanged tensors live.

        Returns:
            ExchangeGroup: the connected group.
        """
        return open_exchange_group(global_ranks, transaction, timeout, device)

    def discard(self, group: ExchangeGroup) -> None:
        """
        Aborts a group after a failure and forgets it.

        Args:
            group (ExchangeGroup): a group :meth:`open` returned.

        Returns:
            None
        """
        self._forget(group)
        group.abort()

    def fail(self, group: ExchangeGroup, reason: str) -> None:
        """
        After a failure of a transaction on ``group``: tells its other ranks
        (:meth:`ExchangeGroup.fail`), aborts the group and forgets it.

        Args:
            group (ExchangeGroup): a group :meth:`open` returned.
            reason (str): what failed.

        Returns:
            None
        """
        self._forget(group)
        group.fail(reason)

    def _forget(self, group: ExchangeGroup) -> None:
        for key, kept in list(self._groups.items()):
            if kept.name == group.name:
                del self._groups[key]
                self._peers.pop(key, None)

    def close(self, graceful: bool = False) -> None:
        """
        Ends every kept group (e.g. when the job stops resharding). Kept
        groups have no work pending and their members may have left the job:
        each is aborted, which waits for nobody (a shutdown would finalize
        its communicator with peers that may be gone).

        Args:
            graceful (bool): shut the groups down instead (every member just
                finished a transaction on them: a group made for it alone).

        Returns:
            None
        """
        groups = list(self._groups.values())
        self._groups.clear()
        self._peers.clear()
        for group in groups:
            if graceful:
                group.close()
            else:
                group.abort()


def kept_exchange_groups(env: Any) -> ExchangeGroups:
    """
    The exchange groups a ``ShardingEnv`` keeps for its transactions: every module and model
    sharded over the env (and every move onto its group) shares them, so the
    default path connects each set of members once, not per transaction;
    they go with the env (nothing is kept for the process: a job that makes
    a new env per reshard connects per reshard). Created on first use.

    Args:
        env (ShardingEnv): the environment of the transaction's model (a
            move's new one where this rank has it).

    Returns:
        ExchangeGroups: the env's groups.
    """
    groups = env.__dict__.get(_KEPT_GROUPS_ATTRIBUTE)
    if not isinstance(groups, ExchangeGroups):
        groups = keep_exchange_groups(env, ExchangeGroups())
    return groups


def keep_exchange_groups(env: Any, groups: ExchangeGroups) -> ExchangeGroups:
    """
    Makes ``groups`` the exchange groups ``env`` keeps: every later
    transaction over the env connects and keeps its groups there (e.g. an
    ``ExchangeGroups`` that keeps more groups connected, or one that records
    its calls). The groups the env kept before are closed (aborted, as at
    any close of kept groups).

    Args:
        env (ShardingEnv): the environment of the models whose transactions
            should use ``groups``.
        groups (ExchangeGroups): the groups to keep.

    Returns:
        ExchangeGroups: ``groups``.
    """
    previous = env.__dict__.get(_KEPT_GROUPS_ATTRIBUTE)
    if isinstance(previous, ExchangeGroups) and previous is not groups:
        previous.close()
    setattr(env, _KEPT_GROUPS_ATTRIBUTE, groups)
    return groups


def same_kept_group(names: Sequence[str]) -> str:
    """
    Run by the coordinator: the name of the group every member kept, or ""
    when some member kept none or another one (then they connect anew).

    Args:
        names (Sequence[str]): each member's :meth:`ExchangeGroups.kept_name`.

    Returns:
        str: the group to reuse, or "".
    """
    first = names[0] if names else ""
    return first if first and all(n == first for n in names) else ""

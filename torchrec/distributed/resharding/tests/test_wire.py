#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The exchange group of a transaction (``wire``), on 4 gloo ranks: only the
members of a group connect it, under a name of the transaction; two groups in
a row over the same ranks, one over the same ranks in another order and one
over other ranks all work (``new_group`` with local synchronization names
groups by ranks and group count, and hangs on the second); nothing of
``torch.distributed``'s registries changes; messages, broadcasts, objects
and the maximum arrive exactly; a peer that never connects fails the
connection with ReshardAbortedError within the timeout; kept groups
(``ExchangeGroups``) serve the next exchange of the same ranks when every rank
kept the same one, and ranks that kept different ones agree to connect anew.
In one process: the order in which a rank posts a pair's messages.
"""

import time
import unittest
from datetime import timedelta
from typing import Any, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torchrec.distributed.resharding.agreement import agree_among_ranks
from torchrec.distributed.resharding.exchange_groups import (
    ExchangeGroups,
    same_kept_group,
)
from torchrec.distributed.resharding.plan import ReshardAbortedError
from torchrec.distributed.resharding.wire import (
    ExchangeGroup,
    Message,
    open_exchange_group,
)
from torchrec.distributed.test_utils.multi_process_utils import (
    BoundedMultiProcessContext,
    MultiRankTestBase,
)


def _registry() -> Tuple[int, int, int]:
    world = c10d._world
    return len(world.pg_map), len(world.pg_group_ranks), world.group_count


def _talk(group: ExchangeGroup, ranks: Sequence[int], seed: int) -> None:
    """Every pair exchanges three tagged messages both ways; then the
    collectives. Values depend on (seed, sender, receiver, tag)."""
    me = group.rank

    def value(src: int, dst: int, tag: int) -> torch.Tensor:
        return torch.full((3 + tag,), float(seed * 1000 + src * 100 + dst * 10 + tag))

    messages, received = [], []
    for peer in range(group.size):
        if peer == me:
            continue
        for tag in range(3):
            messages.append(Message(value(me, peer, tag), peer, tag, send=True))
            buffer = torch.empty(3 + tag)
            received.append((peer, tag, buffer))
            messages.append(Message(buffer, peer, tag, send=False))
    group.wait(group.post(messages))
    for peer, tag, buffer in received:
        assert torch.equal(buffer, value(peer, me, tag)), (peer, tag, buffer)

    assert group.all_reduce_max([me, seed - me]) == [group.size - 1, seed], me
    data = torch.arange(5.0) * seed if me == 1 else torch.zeros(5)
    group.broadcast(data, src=1)
    assert torch.equal(data, torch.arange(5.0) * seed), data
    obj = {"seed": seed, "ranks": list(ranks)} if me == 0 else None
    assert group.broadcast_object(obj, src=0) == {"seed": seed, "ranks": list(ranks)}
    group.barrier()


def _run_groups(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=60):
        before = _registry()
        # the same ranks twice, in another order, then others; each group's
        # members are the only ranks that take part in it
        for i, ranks in enumerate([[3, 1], [3, 1], [1, 3], [0, 2, 3]]):
            if rank in ranks:
                group = open_exchange_group(ranks, f"t{i}", timedelta(seconds=30))
                assert group.rank == ranks.index(rank)
                assert group.size == len(ranks)
                _talk(group, ranks, seed=i + 1)
                group.close()
        assert _registry() == before, (_registry(), before)
        dist.barrier()  # rank 0 hosts the store: nobody leaves before the end


def _run_missing_peer(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=60):
        if rank == 0:
            start = time.monotonic()
            try:
                open_exchange_group([0, 1], "nobody-else", timedelta(seconds=2))
            except ReshardAbortedError as e:
                assert "could not connect" in str(e), e
            else:
                raise AssertionError("connected without its peer")
            assert time.monotonic() - start < 30
        dist.barrier()


def _open_agreed(groups: ExchangeGroups, ranks: List[int]) -> ExchangeGroup:
    """The members agree whether they all kept a group, then open it."""
    device = torch.device("cpu")
    agreed = agree_among_ranks(
        ranks,
        0,
        None,
        groups.kept_name(ranks, device),
        timedelta(seconds=30),
        merge=same_kept_group,
    )
    return groups.open(
        ranks, agreed.transaction, timedelta(seconds=30), device, agreed.merged
    )


def _run_kept_groups(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=60):
        ranks = [0, 1]
        groups = ExchangeGroups()
        first = _open_agreed(groups, ranks)
        _talk(first, ranks, seed=1)
        # every rank kept it: the next exchange reuses it
        again = _open_agreed(groups, ranks)
        assert again.name == first.name and groups.connected == 1
        _talk(again, ranks, seed=2)
        # rank 1 lost its group (say, it failed alone): both connect anew
        if rank == 1:
            groups.close()
        fresh = _open_agreed(groups, ranks)
        assert fresh.name != first.name and groups.connected == 2, fresh.name
        _talk(fresh, ranks, seed=3)
        groups.close()
        dist.barrier()


class ExchangeGroupTest(MultiRankTestBase):
    def test_only_members_connect_any_groups_in_a_row(self) -> None:
        self.run_ranks(_run_groups, world_size=4)

    def test_kept_groups_serve_the_ranks_that_all_kept_them(self) -> None:
        self.run_ranks(_run_kept_groups, world_size=2)

    def test_a_missing_peer_fails_the_connection_in_time(self) -> None:
        self.run_ranks(_run_missing_peer, world_size=2)


class _Recorder:
    """A backend that records the order of the point-to-point calls."""

    def __init__(self) -> None:
        self.calls: List[Tuple[str, int, int]] = []

    def send(self, tensors: List[torch.Tensor], peer: int, tag: int) -> Any:
        self.calls.append(("send", peer, tag))

    def recv(self, tensors: List[torch.Tensor], peer: int, tag: int) -> Any:
        self.calls.append(("recv", peer, tag))


class PostOrderTest(unittest.TestCase):
    def test_lower_rank_of_a_pair_sends_first(self) -> None:
        t = torch.zeros(1)
        messages = [
            Message(t, 0, 0, send=False),
            Message(t, 2, 0, send=False),
            Message(t, 2, 1, send=False),
            Message(t, 0, 0, send=True),
            Message(t, 2, 0, send=True),
        ]
        backend = _Recorder()
        group = ExchangeGroup(backend, 1, 3, timedelta(seconds=1), torch.device("cpu"))
        group.post(messages)
        self.assertEqual(
            backend.calls,
            [
                ("recv", 0, 0),  # rank 0 is lower: it sends first
                ("send", 0, 0),
                ("send", 2, 0),  # this rank is lower than 2: it sends first
                ("recv", 2, 0),
                ("recv", 2, 1),
            ],
        )


if __name__ == "__main__":
    unittest.main()

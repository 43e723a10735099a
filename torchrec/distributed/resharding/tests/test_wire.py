#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The exchange group of a transaction (``exchange_group``), on 4 gloo ranks: only the
members of a group connect it, under a name of the transaction; two groups in
a row over the same ranks, one over the same ranks in another order and one
over other ranks all work (``new_group`` with local synchronization names
groups by ranks and group count, and hangs on the second); nothing of
``torch.distributed``'s registries changes; messages, broadcasts, objects
and the maximum arrive exactly; a peer that never connects fails the
connection with ReshardAbortedError within the timeout; kept groups
(``ExchangeGroups``) serve the next exchange of the same ranks when every rank
kept the same one, and ranks that kept different ones agree to connect anew.
And the order in which a rank posts a pair's messages, recorded on a real
gloo backend as its calls pass through.
"""

import time
import unittest
from datetime import timedelta
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torchrec.distributed.resharding.agreement import agree_among_ranks
from torchrec.distributed.resharding.exchange_group import (
    ExchangeGroup,
    Message,
    open_exchange_group,
)
from torchrec.distributed.resharding.exchange_groups import (
    ExchangeGroups,
    same_kept_group,
)
from torchrec.distributed.resharding.plan import ReshardAbortedError
from torchrec.distributed.test_utils.multi_process_utils import (
    BoundedMultiProcessContext,
    MultiRankTestBase,
)
from torchrec.distributed.test_utils.transaction_doubles import (
    RecordingBackend,
    RecordingGroups,
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


def _expected_order(me: int, size: int) -> List[Tuple[str, int, int]]:
    """
    The calls a rank makes for the messages ``_run_post_order`` posts: pair
    by pair, in peer order; the lower rank of a pair sends first, the
    higher receives first; each direction in tag order.
    """
    out: List[Tuple[str, int, int]] = []
    for peer in range(size):
        if peer == me:
            continue
        sends = [("send", peer, tag) for tag in range(2)]
        recvs = [("recv", peer, tag) for tag in range(2)]
        out += sends + recvs if me < peer else recvs + sends
    return out


def _run_post_order(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=60):
        ranks = list(range(world_size))
        # the real gloo backend, its calls recorded on the way through
        group = RecordingGroups([]).connect(
            ranks, "order", timedelta(seconds=30), torch.device("cpu")
        )
        backend = group.backend
        assert isinstance(backend, RecordingBackend)
        me = group.rank
        messages, received = [], []
        for peer in range(world_size):  # every receive posted before any send
            if peer != me:
                for tag in range(2):
                    buffer = torch.empty(2)
                    received.append((peer, tag, buffer))
                    messages.append(Message(buffer, peer, tag, send=False))
        for peer in range(world_size):
            if peer != me:
                for tag in range(2):
                    value = torch.full((2,), float(me * 10 + tag))
                    messages.append(Message(value, peer, tag, send=True))
        group.wait(group.post(messages))
        for peer, tag, buffer in received:
            assert torch.equal(buffer, torch.full((2,), float(peer * 10 + tag)))
        order = [
            (name, args[1], args[2])
            for name, args, _ in backend.log
            if name in ("send", "recv")
        ]
        assert order == _expected_order(me, world_size), (me, order)
        group.close()
        dist.barrier()


class PostOrderTest(MultiRankTestBase):
    def test_lower_rank_of_a_pair_sends_first(self) -> None:
        # the real backend's calls, recorded as they pass through
        self.run_ranks(_run_post_order, world_size=4)


if __name__ == "__main__":
    unittest.main()

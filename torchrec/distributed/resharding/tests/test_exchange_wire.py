#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The executor's wire on a group of 2 of 4 gloo ranks (numbered in the group
otherwise than in the world), below any module: pieces of tables of
two dtypes and three field kinds go both ways (large ones as messages of
their own, small ones packed per dtype, one column piece whose source is not
contiguous) and every new shard must equal the reference cut from the global
tables. With targets, large pieces are received straight into the new
shards' memory (no buffer) and contiguous sources are sent from the old
shards' memory; without targets (the commit does more), everything goes
through buffers and is still exact. The first runs over a group of the job
(``ExchangeGroup.over``), the second over one made for a transaction
(``open_exchange_group``). Also the message split itself, in one
process: both sides of a pair derive the same messages.
"""

import unittest
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.resharding.exchange import (
    ExchangeStats,
    execute_transfers,
    pair_messages,
    SMALL_MESSAGE_BYTES,
)
from torchrec.distributed.resharding.exchange_group import (
    ExchangeGroup,
    open_exchange_group,
)
from torchrec.distributed.resharding.fields import Field, FieldKind
from torchrec.distributed.resharding.plan import Rect, Transfer
from torchrec.distributed.resharding.transfer_plan import RankPlan
from torchrec.distributed.test_utils.multi_process_utils import (
    BoundedMultiProcessContext,
    MultiRankTestBase,
)
from torchrec.distributed.test_utils.transaction_doubles import SUM, WEIGHT

WEIGHT16 = Field("weight", FieldKind.RECT, torch.float16)
STEP = Field("step", FieldKind.SCALAR, torch.int64)

# table -> (rows, cols, fields)
TABLES: Dict[str, Tuple[int, int, Tuple[Field, ...]]] = {
    "big": (256, 64, (WEIGHT, SUM)),  # 64 KiB weight: a message of its own
    "wide": (256, 96, (WEIGHT,)),  # columns 32.. travel: a strided source
    "back": (300, 64, (WEIGHT, STEP)),  # from rank 1 to rank 0
    "tiny": (8, 4, (WEIGHT, SUM)),  # packed with the other small ones
    "half": (16, 8, (WEIGHT16,)),  # packed alone (its own dtype)
}


def _reference(table: str, f: Field) -> torch.Tensor:
    """The global value of one field of one table."""
    rows, cols, _ = TABLES[table]
    seed = sum(map(ord, table + f.name))
    shape = f.shape(rows, cols)
    values = torch.arange(torch.Size(shape).numel(), dtype=torch.float64)
    return ((values * 7 + seed) % 1009).reshape(shape).to(f.dtype)


def _whole(table: str) -> Rect:
    rows, cols, _ = TABLES[table]
    return Rect(0, 0, rows, cols)


def _cut(table: str, f: Field, rect: Rect) -> torch.Tensor:
    return _local(_reference(table, f), f, rect, _whole(table))


def _transfers() -> List[Transfer]:
    wide_cols = Rect(0, 32, 256, 64)
    whole = [(t, 0, 1) for t in ("big", "tiny", "half")] + [("back", 1, 0)]
    return [Transfer("wide", 0, 1, wide_cols, _whole("wide"), wide_cols)] + [
        Transfer(t, src, dst, _whole(t), _whole(t), _whole(t)) for t, src, dst in whole
    ]


def _local(tensor: torch.Tensor, f: Field, rect: Rect, shard: Rect) -> torch.Tensor:
    """``rect``'s part of a shard's tensor, by narrowing (not the slicing of the
    code under test)."""
    if f.kind not in (FieldKind.RECT, FieldKind.ROWS):
        return tensor.reshape(1)
    local = rect.relative_to(shard)
    rows = tensor.narrow(0, local.row, local.rows)
    return rows.narrow(1, local.col, local.cols) if f.kind == FieldKind.RECT else rows


class _ShardsIO:
    """Old shards hold the reference values; new shards start as zeros."""

    def __init__(self, rank: int, with_targets: bool) -> None:
        self.with_targets = with_targets
        self.old: Dict[Tuple[str, str], torch.Tensor] = {}
        self.new: Dict[Tuple[str, str], torch.Tensor] = {}
        for t in _transfers():
            for f in TABLES[t.table][2]:
                if t.src_rank == rank:
                    self.old[(t.table, f.name)] = _cut(t.table, f, t.src_rect).clone()
                if t.dst_rank == rank:
                    shape = f.shape(t.dst_rect.rows, t.dst_rect.cols)
                    self.new[(t.table, f.name)] = torch.zeros(shape, dtype=f.dtype)
        self.finished = False

    def resolve(self, t: Transfer, f: Field) -> torch.Tensor:
        return _local(self.old[(t.table, f.name)], f, t.rect, t.src_rect)

    def target(self, t: Transfer, f: Field) -> Optional[torch.Tensor]:
        if not self.with_targets:
            return None
        return _local(self.new[(t.table, f.name)], f, t.rect, t.dst_rect)

    def commit(self, t: Transfer, f: Field, data: torch.Tensor) -> None:
        into = _local(self.new[(t.table, f.name)], f, t.rect, t.dst_rect)
        into.copy_(data.view(into.shape))

    def kept(self, t: Transfer) -> bool:
        return False

    def finish(self) -> None:
        self.finished = True


def _fields() -> Dict[str, Sequence[Field]]:
    return {table: fields for table, (_, _, fields) in TABLES.items()}


def _nbytes(table: str, f: Field) -> int:
    t = next(x for x in _transfers() if x.table == table)
    return f.nbytes(t)


def _run_wire(rank: int, world_size: int, port: str, with_targets: bool) -> None:
    """The exchange on the group of global ranks 3 and 1 (numbered 0 and 1
    in it, as the plan numbers them) out of 4: peers are group-local."""
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=60):
        # with targets over a group of the job, without over one of its own
        group = dist.new_group([3, 1], sort_ranks=False) if with_targets else None
        if rank in (3, 1):
            wire = (
                ExchangeGroup.over(group)
                if group is not None
                else open_exchange_group([3, 1], "wire-test")
            )
            _exchange(wire, [3, 1].index(rank), with_targets)
            wire.close()
        dist.barrier()  # rank 0 hosts the store: nobody leaves before the end


def _exchange(group: ExchangeGroup, rank: int, with_targets: bool) -> None:
    transfers = _transfers()
    plan = RankPlan(
        sends=tuple(t for t in transfers if t.src_rank == rank),
        receives=tuple(t for t in transfers if t.dst_rank == rank),
        local_copies=(),
    )
    io = _ShardsIO(rank, with_targets)
    stats = execute_transfers(plan, _fields(), io, group)
    assert io.finished
    for t in plan.receives:
        for f in TABLES[t.table][2]:
            value = io.new[(t.table, f.name)]
            assert torch.equal(value, _cut(t.table, f, t.dst_rect)), (t, f)
    sent, received = (
        sum(f.nbytes(t) for t in ts for f in TABLES[t.table][2])
        for ts in (plan.sends, plan.receives)
    )
    assert (stats.bytes_sent, stats.bytes_received) == (sent, received), stats
    _check_in_place(rank, stats, with_targets)


def _check_in_place(rank: int, stats: ExchangeStats, with_targets: bool) -> None:
    """
    What travels without a buffer: a message whose pieces are contiguous and
    back to back in one storage (one piece, or several in a row) is sent from
    the old shards' memory, and with targets received into the new shards'
    memory. The column piece of "wide" has a strided source; the packed small
    float32 pieces of three tensors lie in no common storage; the float16
    piece and the int64 step are messages of one small piece each.
    """
    big, wide = _nbytes("big", WEIGHT), _nbytes("wide", WEIGHT)
    half = _nbytes("half", WEIGHT16)
    back = _nbytes("back", WEIGHT) + _nbytes("back", STEP)
    if rank == 0:
        assert stats.bytes_sent_in_place == big + half, stats
        assert stats.bytes_received_in_place == (back if with_targets else 0), stats
    else:
        assert stats.bytes_sent_in_place == back, stats
        in_place = big + wide + half if with_targets else 0
        assert stats.bytes_received_in_place == in_place, stats


class ExchangeWireTest(MultiRankTestBase):
    def test_pieces_land_exactly_and_in_place(self) -> None:
        self.run_ranks(_run_wire, world_size=4, with_targets=True)

    def test_pieces_land_exactly_through_buffers(self) -> None:
        self.run_ranks(_run_wire, world_size=4, with_targets=False)


class PairMessagesTest(unittest.TestCase):
    def test_large_alone_small_packed_per_dtype(self) -> None:
        pieces = [t for t in _transfers() if t.src_rank == 0]
        messages = pair_messages(pieces, _fields())
        entries = [[(t.table, f.name) for t, f in m.entries] for m in messages]
        self.assertEqual(
            entries,
            [
                [("wide", "weight")],
                [("big", "weight")],
                [("half", "weight")],
                [("big", "sum"), ("tiny", "sum"), ("tiny", "weight")],
            ],
        )
        self.assertEqual(
            [m.dtype for m in messages],
            [torch.float32, torch.float32, torch.float16, torch.float32],
        )

    def test_every_field_of_every_piece_travels_once(self) -> None:
        pieces = _transfers()
        for small in (1, SMALL_MESSAGE_BYTES, 1 << 30):
            carried = [
                (t, f.name)
                for m in pair_messages(pieces, _fields(), small)
                for t, f in m.entries
            ]
            expected = [(t, f.name) for t in pieces for f in TABLES[t.table][2]]
            self.assertCountEqual(carried, expected)

    def test_both_sides_derive_the_same_messages(self) -> None:
        reordered = {k: tuple(reversed(v)) for k, v in _fields().items()}
        messages = pair_messages(_transfers(), _fields())
        self.assertEqual(messages, pair_messages(_transfers(), reordered))


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of the exchange's pure parts: how a memory cap splits the
pieces of a plan into rounds (every remote piece delivered once, in plan
order, as row bands when it is larger than the cap; each rank's load within
the cap) and the kind of each field that travels with a piece (per element,
per row, per shard).
"""

import unittest
from typing import Dict, List, Tuple

import hypothesis.strategies as st
import torch
from hypothesis import given, settings
from torchrec.distributed.resharding.exchange import (
    Field,
    field_kind,
    FieldKind,
    split_into_rounds,
)
from torchrec.distributed.resharding.plan import Rect, ReshardError, Transfer

RECT, ROWS, SCALAR = FieldKind.RECT, FieldKind.ROWS, FieldKind.SCALAR


# --------------------------------------------------------------------------
# Rounds of the exchange.


def _transfer(
    table: str, src: int, dst: int, rows: int, cols: int, row: int = 0
) -> Transfer:
    rect = Rect(row, 0, rows, cols)
    return Transfer(table, src, dst, rect, rect, rect)


class SplitIntoRoundsTest(unittest.TestCase):
    FIELDS = {
        "a": [Field("weight", RECT, torch.float32)],
        "b": [Field("weight", RECT, torch.float16), Field("sum", ROWS, torch.float32)],
    }

    def size(self, t: Transfer) -> int:
        return sum(
            f.numel(t) * torch.empty((), dtype=f.dtype).element_size()
            for f in self.FIELDS[t.table]
        )

    def check_rounds(
        self, transfers: List[Transfer], rounds: List[List[Transfer]], cap: int
    ) -> None:
        remote = [t for t in transfers if not t.is_local]
        flat = [t for r in rounds for t in r]
        # Every remote transfer, in plan order, as row bands that tile it; no
        # local one.
        i = 0
        for t in remote:
            row = t.rect.row
            while row < t.rect.row + t.rect.rows:
                band = flat[i]
                i += 1
                self.assertEqual(
                    (
                        band.table,
                        band.src_rank,
                        band.dst_rank,
                        band.src_rect,
                        band.dst_rect,
                    ),
                    (t.table, t.src_rank, t.dst_rank, t.src_rect, t.dst_rect),
                )
                self.assertEqual(
                    (band.rect.row, band.rect.col, band.rect.cols),
                    (row, t.rect.col, t.rect.cols),
                )
                row += band.rect.rows
            self.assertEqual(row, t.rect.row + t.rect.rows)
        self.assertEqual(i, len(flat))
        for round_ in rounds:
            self.assertTrue(round_)
            load: Dict[int, int] = {}
            count: Dict[int, int] = {}
            for t in round_:
                for rank in (t.src_rank, t.dst_rank):
                    load[rank] = load.get(rank, 0) + self.size(t)
                    count[rank] = count.get(rank, 0) + 1
            for rank in load:
                # Per rank: within the cap, or a single one-row band larger
                # than it (which then shares the round with nothing else of
                # that rank).
                if load[rank] > cap:
                    self.assertEqual(count[rank], 1, (rank, round_))
                    (band,) = [t for t in round_ if rank in (t.src_rank, t.dst_rank)]
                    self.assertEqual(band.rect.rows, 1)

    def test_none_is_one_round_without_local(self) -> None:
        transfers = [
            _transfer("a", 0, 1, 4, 4),
            _transfer("a", 1, 1, 4, 4, row=4),
            _transfer("b", 1, 0, 2, 4),
            _transfer("b", 2, 2, 2, 4, row=2),
        ]
        self.assertEqual(
            split_into_rounds(transfers, self.FIELDS, None),
            [[transfers[0], transfers[2]]],
        )
        self.assertEqual(split_into_rounds(transfers[1::2], self.FIELDS, None), [])
        self.assertEqual(split_into_rounds([], self.FIELDS, None), [])
        self.assertEqual(split_into_rounds(transfers[1::2], self.FIELDS, 1), [])

    def test_cap_respected_per_rank(self) -> None:
        # 64 bytes each ("a": 4x4 fp32) between different rank pairs.
        transfers = [
            _transfer("a", 0, 1, 4, 4),
            _transfer("a", 2, 3, 4, 4),
            _transfer("a", 0, 2, 4, 4),
            _transfer("a", 1, 1, 4, 4, row=4),  # local: never in a round
            _transfer("a", 3, 1, 4, 4),
        ]
        # Cap 100: 0->1 and 2->3 share a round (disjoint ranks); 0->2 would
        # put 128 bytes on ranks 0 and 2, so it opens a second round, which
        # 3->1 joins (64 bytes on each of its ranks).
        rounds = split_into_rounds(transfers, self.FIELDS, 100)
        self.check_rounds(transfers, rounds, 100)
        self.assertEqual(
            rounds,
            [[transfers[0], transfers[1]], [transfers[2], transfers[4]]],
        )
        rounds = split_into_rounds(transfers, self.FIELDS, 64)
        self.check_rounds(transfers, rounds, 64)
        self.assertEqual(
            rounds, [[transfers[0], transfers[1]], [transfers[2], transfers[4]]]
        )
        # Cap 63: each 64-byte piece is cut into bands of 3 rows and 1 row.
        rounds = split_into_rounds(transfers, self.FIELDS, 63)
        self.check_rounds(transfers, rounds, 63)
        self.assertEqual(
            [t.rect.rows for r in rounds for t in r], [3, 1, 3, 1, 3, 1, 3, 1]
        )
        rounds = split_into_rounds(transfers, self.FIELDS, 10_000)
        self.assertEqual(rounds, [[t for t in transfers if not t.is_local]])

    def test_mixed_fields_sizes(self) -> None:
        # "b": 2x4 fp16 (16 bytes) + 2 fp32 row sums (8 bytes) = 24 bytes.
        t = _transfer("b", 0, 1, 2, 4)
        self.assertEqual(self.size(t), 24)
        transfers = [_transfer("b", 0, 1, 2, 4, row=2 * i) for i in range(5)]
        rounds = split_into_rounds(transfers, self.FIELDS, 48)
        self.check_rounds(transfers, rounds, 48)
        self.assertEqual([len(r) for r in rounds], [2, 2, 1])

    def test_piece_larger_than_cap_is_cut_into_row_bands(self) -> None:
        transfers = [
            _transfer("a", 0, 1, 1, 4),  # 16 bytes
            _transfer("a", 1, 0, 10, 4, row=1),  # 160 bytes > cap: 5 bands of 2 rows
            _transfer("a", 0, 1, 1, 4, row=11),  # 16 bytes
            _transfer("a", 0, 1, 1, 4, row=12),  # 16 bytes
        ]
        rounds = split_into_rounds(transfers, self.FIELDS, 40)
        self.check_rounds(transfers, rounds, 40)
        self.assertEqual(
            [[t.rect.rows for t in r] for r in rounds],
            [[1], [2], [2], [2], [2], [2], [1, 1]],
        )

    def test_row_larger_than_cap_travels_alone(self) -> None:
        transfers = [_transfer("a", 0, 1, 3, 4), _transfer("a", 2, 3, 1, 4)]
        rounds = split_into_rounds(transfers, self.FIELDS, 10)
        self.check_rounds(transfers, rounds, 10)
        self.assertEqual([[t.rect.rows for t in r] for r in rounds], [[1]] * 4)

    # pyre-ignore[56]
    @settings(max_examples=100, deadline=None)
    @given(
        pieces=st.lists(
            st.tuples(
                st.integers(0, 3),
                st.integers(0, 3),
                st.integers(1, 6),
                st.sampled_from(["a", "b"]),
            ),
            max_size=20,
        ),
        cap=st.integers(1, 400),
    )
    def test_random_rounds(
        self, pieces: List[Tuple[int, int, int, str]], cap: int
    ) -> None:
        transfers = [
            _transfer(table, src, dst, rows, 4, row=i * 8)
            for i, (src, dst, rows, table) in enumerate(pieces)
        ]
        rounds = split_into_rounds(transfers, self.FIELDS, cap)
        self.check_rounds(transfers, rounds, cap)
        self.assertEqual(rounds, split_into_rounds(transfers, self.FIELDS, cap))


class FieldKindTest(unittest.TestCase):
    def test_kinds(self) -> None:
        self.assertEqual(field_kind(torch.zeros(3, 4), 3, 4), RECT)
        self.assertEqual(field_kind(torch.zeros(12), 3, 4), RECT)
        self.assertEqual(field_kind(torch.zeros(3), 3, 4), ROWS)
        self.assertEqual(field_kind(torch.zeros(1), 3, 4), SCALAR)
        self.assertEqual(field_kind(torch.zeros(()), 3, 4), SCALAR)
        with self.assertRaises(ReshardError):
            field_kind(torch.zeros(5), 3, 4)
        t = _transfer("a", 0, 1, 3, 4)
        self.assertEqual(Field("w", RECT, torch.float32).numel(t), 12)
        self.assertEqual(Field("s", ROWS, torch.float32).numel(t), 3)
        self.assertEqual(Field("c", SCALAR, torch.float32).numel(t), 1)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of the exchange's pure parts: how a memory cap cuts each
pair of ranks' pieces into rounds (every remote piece delivered once, in plan
order, as row bands when it is larger than the pair's quota; no rank holding
more than the cap in one round).
"""

import unittest
from typing import Dict, List, Tuple

import hypothesis.strategies as st
import torch
from hypothesis import given, settings
from torchrec.distributed.resharding.exchange import chunk_pair
from torchrec.distributed.resharding.fields import Field, FieldKind
from torchrec.distributed.resharding.plan import Rect, Transfer

RECT, ROWS, SCALAR = FieldKind.RECT, FieldKind.ROWS, FieldKind.SCALAR

FIELDS: Dict[str, List[Field]] = {
    "a": [Field("weight", RECT, torch.float32)],
    "b": [Field("weight", RECT, torch.float16), Field("sum", ROWS, torch.float32)],
    "c": [Field("weight", RECT, torch.float32), Field("iter", SCALAR, torch.int64)],
}


def _transfer(
    table: str, src: int, dst: int, rows: int, cols: int, row: int = 0
) -> Transfer:
    rect = Rect(row, 0, rows, cols)
    return Transfer(table, src, dst, rect, rect, rect)


def _size(t: Transfer) -> int:
    return sum(f.nbytes(t) for f in FIELDS[t.table])


def _rounds_of(
    transfers: List[Transfer], cap: int
) -> Tuple[Dict[Tuple[int, int], List[List[Transfer]]], int]:
    """What every rank of a whole plan computes for itself: the pair quota
    from the most peers any rank has, then each pair's chunks."""
    pairs: Dict[Tuple[int, int], List[Transfer]] = {}
    for t in transfers:
        if not t.is_local:
            pairs.setdefault((t.src_rank, t.dst_rank), []).append(t)
    peers: Dict[int, int] = {}
    for src, dst in pairs:
        peers[src] = peers.get(src, 0) + 1
        peers[dst] = peers.get(dst, 0) + 1
    quota = max(1, cap // max(peers.values(), default=1))
    return {p: chunk_pair(ts, FIELDS, quota) for p, ts in pairs.items()}, quota


class ChunkPairTest(unittest.TestCase):
    def check_chunks(
        self, pieces: List[Transfer], chunks: List[List[Transfer]], quota: int
    ) -> None:
        flat = [t for chunk in chunks for t in chunk]
        i = 0
        # every piece, in plan order, as row bands that tile it
        for t in pieces:
            row = t.rect.row
            while row < t.rect.row + t.rect.rows:
                band = flat[i]
                i += 1
                self.assertEqual(
                    (band.table, band.src_rank, band.dst_rank, band.src_rect),
                    (t.table, t.src_rank, t.dst_rank, t.src_rect),
                )
                self.assertEqual((band.rect.row, band.rect.cols), (row, t.rect.cols))
                row += band.rect.rows
            self.assertEqual(row, t.rect.row + t.rect.rows)
        self.assertEqual(i, len(flat))
        for chunk in chunks:
            self.assertTrue(chunk)
            load = sum(_size(t) for t in chunk)
            if load > quota:  # only a single band of one row larger than it
                self.assertEqual(len(chunk), 1, chunk)
                self.assertEqual(chunk[0].rect.rows, 1)

    def test_none_is_one_chunk(self) -> None:
        pieces = [_transfer("a", 0, 1, 4, 4), _transfer("b", 0, 1, 2, 4)]
        self.assertEqual(chunk_pair(pieces, FIELDS, None), [pieces])
        self.assertEqual(chunk_pair([], FIELDS, None), [])
        self.assertEqual(chunk_pair([], FIELDS, 10), [])

    def test_pieces_are_packed_up_to_the_quota(self) -> None:
        # 64 bytes each ("a": 4x4 fp32)
        pieces = [_transfer("a", 0, 1, 4, 4, row=4 * i) for i in range(3)]
        self.assertEqual(chunk_pair(pieces, FIELDS, 128), [pieces[:2], pieces[2:]])
        # bands of 3 rows (48 bytes) and 1 row (16): no two of them fit in 63
        chunks = chunk_pair(pieces, FIELDS, 63)
        self.check_chunks(pieces, chunks, 63)
        self.assertEqual([[t.rect.rows for t in c] for c in chunks], [[3], [1]] * 3)
        chunks = chunk_pair(pieces, FIELDS, 64 + 48)
        self.assertEqual([[t.rect.rows for t in c] for c in chunks], [[4], [4], [4]])

    def test_mixed_fields_sizes(self) -> None:
        # "b": 2x4 fp16 (16 bytes) + 2 fp32 row sums (8 bytes) = 24 bytes
        self.assertEqual(_size(_transfer("b", 0, 1, 2, 4)), 24)
        pieces = [_transfer("b", 0, 1, 2, 4, row=2 * i) for i in range(5)]
        chunks = chunk_pair(pieces, FIELDS, 48)
        self.check_chunks(pieces, chunks, 48)
        self.assertEqual([len(c) for c in chunks], [2, 2, 1])

    def test_per_shard_values_travel_with_every_band(self) -> None:
        # "c": 4 fp32 per row + an 8-byte count: bands of (40 - 8) // 16 rows
        piece = _transfer("c", 0, 1, 5, 4)
        chunks = chunk_pair([piece], FIELDS, 40)
        self.check_chunks([piece], chunks, 40)
        self.assertEqual([[t.rect.rows for t in c] for c in chunks], [[2], [2], [1]])

    def test_row_larger_than_the_quota_travels_alone(self) -> None:
        pieces = [_transfer("a", 0, 1, 3, 4), _transfer("a", 0, 1, 1, 4, row=3)]
        chunks = chunk_pair(pieces, FIELDS, 10)
        self.check_chunks(pieces, chunks, 10)
        self.assertEqual([[t.rect.rows for t in c] for c in chunks], [[1]] * 4)

    # pyre-ignore[56]
    @settings(max_examples=100, deadline=None)
    @given(
        pieces=st.lists(
            st.tuples(
                st.integers(0, 3),
                st.integers(0, 3),
                st.integers(1, 6),
                st.sampled_from(["a", "b", "c"]),
            ),
            max_size=20,
        ),
        cap=st.integers(1, 400),
    )
    def test_no_rank_holds_more_than_the_cap(
        self, pieces: List[Tuple[int, int, int, str]], cap: int
    ) -> None:
        transfers = [
            _transfer(table, src, dst, rows, 4, row=i * 8)
            for i, (src, dst, rows, table) in enumerate(pieces)
        ]
        chunks, quota = _rounds_of(transfers, cap)
        for (src, dst), pair_chunks in chunks.items():
            pair = [t for t in transfers if (t.src_rank, t.dst_rank) == (src, dst)]
            self.check_chunks(pair, pair_chunks, quota)
        rounds = max((len(c) for c in chunks.values()), default=0)
        for k in range(rounds):
            load: Dict[int, int] = {}
            oversized: Dict[int, bool] = {}
            for (src, dst), pair_chunks in chunks.items():
                if k >= len(pair_chunks):
                    continue
                size = sum(_size(t) for t in pair_chunks[k])
                for rank in (src, dst):
                    load[rank] = load.get(rank, 0) + size
                    oversized[rank] = oversized.get(rank, False) or size > quota
            for rank, bytes_in_flight in load.items():
                # within the cap, unless a single row larger than a pair's
                # quota had to travel
                self.assertTrue(bytes_in_flight <= cap or oversized[rank])


if __name__ == "__main__":
    unittest.main()

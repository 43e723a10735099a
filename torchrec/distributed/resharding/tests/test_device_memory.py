#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The device-memory pre-flight, in one process: the bound of what a transaction
adds on a rank (new kernels' state, exchange buffers or their cap, a move's
dense part, a new communicator), counted by hand; a bound over the free
memory refused with the shortfall and the cap that fits; a GPU transaction
(``torch.cuda.mem_get_info`` mocked on this host) refused before anything is
built, every rank's error the same, nothing connected; the peak a transaction
reports (CUDA's peak statistics read, never reset; the resident set on the
host).
"""

import unittest
from typing import List
from unittest import mock

import torch
from torchrec.distributed.resharding.device_memory import (
    check_fits,
    estimate_peak,
    MemoryWatch,
    NCCL_COMMUNICATOR_BYTES,
    PeakEstimate,
)
from torchrec.distributed.resharding.fields import Field, FieldKind
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import (
    PlacedShard,
    Rect,
    ReshardError,
    TableLayout,
)
from torchrec.distributed.resharding.runner import run_transaction
from torchrec.distributed.test_utils.multi_process_utils import (
    single_rank_process_group,
)
from torchrec.distributed.test_utils.transaction_doubles import (
    CopyParticipant,
    RecordingGroups,
)

WEIGHT = Field("weight", FieldKind.RECT, torch.float32)
SUM = Field("sum", FieldKind.ROWS, torch.float32)
CUDA0 = torch.device("cuda", 0)


def _layout(*shards: PlacedShard) -> TableLayout:
    return TableLayout(8, 4, tuple(shards))


WHOLE = Rect(0, 0, 8, 4)
LEFT, RIGHT = Rect(0, 0, 8, 2), Rect(0, 2, 8, 2)


class EstimateTest(unittest.TestCase):
    def test_a_table_moving_to_another_rank(self) -> None:
        # 8x4 fp32 weights and 8 fp32 row-wise sums: 128 + 32 bytes
        old = {"t": _layout(PlacedShard(0, WHOLE))}
        new = {"t": _layout(PlacedShard(1, WHOLE))}
        fields = {"t": (WEIGHT, SUM)}
        self.assertEqual(estimate_peak(old, new, fields, 1), PeakEstimate(160, 160))
        self.assertEqual(estimate_peak(old, new, fields, 0), PeakEstimate(0, 160))
        self.assertEqual(
            estimate_peak(old, new, fields, 1, max_inflight_bytes=100),
            PeakEstimate(160, 100),
        )

    def test_a_split_counts_the_kept_half_too(self) -> None:
        # rank 0 keeps the left columns (rebuilt: counted again), sends the
        # right ones (64 bytes of weights + 32 of row-wise sums)
        old = {"t": _layout(PlacedShard(0, WHOLE))}
        new = {"t": _layout(PlacedShard(0, LEFT), PlacedShard(1, RIGHT))}
        fields = {"t": (WEIGHT, SUM)}
        self.assertEqual(estimate_peak(old, new, fields, 0), PeakEstimate(96, 96))
        self.assertEqual(estimate_peak(old, new, fields, 1), PeakEstimate(96, 96))

    def test_a_moves_dense_part_and_a_new_communicator(self) -> None:
        old = {"t": _layout(PlacedShard(0, WHOLE))}
        new = {"t": _layout(PlacedShard(1, WHOLE))}
        fields = {"t": (WEIGHT,)}
        here = estimate_peak(old, new, fields, 1, None, 1000, 7)
        self.assertEqual(here, PeakEstimate(128, 128, 1000, 7))
        self.assertEqual(here.total, 128 + 128 + 1000 + 7)
        # a rank that gets no new shard builds no dense part
        self.assertEqual(estimate_peak(old, new, fields, 0, None, 1000).dense_bytes, 0)


class CheckTest(unittest.TestCase):
    def test_a_bound_that_fits_passes(self) -> None:
        check_fits(PeakEstimate(100, 50), 150, CUDA0, "reshard")

    def test_the_shortfall_and_the_cap_that_fits_are_named(self) -> None:
        with self.assertRaisesRegex(
            ReshardError,
            r"needs up to 1500 B more on cuda:0 \(new kernels 500 B, exchange "
            r"buffers 1000 B.*1200 B are free: 300 B short; "
            r"ReshardOptions\(max_inflight_bytes=700\) would fit",
        ):
            check_fits(PeakEstimate(500, 1000), 1200, CUDA0, "reshard")

    def test_when_no_cap_can_fit_it_says_so(self) -> None:
        with self.assertRaisesRegex(ReshardError, "400 B short; free device memory"):
            check_fits(PeakEstimate(500, 100), 200, CUDA0, "move")


class PreflightTest(unittest.TestCase):
    def test_a_gpu_transaction_that_does_not_fit_is_refused_before_the_build(
        self,
    ) -> None:
        calls: List[str] = []
        groups = RecordingGroups(calls)
        free = 48 + NCCL_COMMUNICATOR_BYTES - 1  # one byte short
        with (
            single_rank_process_group(),
            mock.patch(
                "torch.cuda.mem_get_info", return_value=(free, 2 * free)
            ) as mem_get_info,
            mock.patch("torch.cuda.max_memory_allocated", return_value=0),
            mock.patch("torch.cuda.memory_allocated", return_value=0),
        ):
            participant = CopyParticipant(calls, device=CUDA0)
            with self.assertRaisesRegex(
                ReshardError, r"the copy needs up to \d+ B more on cuda:0.*1 B short"
            ):
                run_transaction(participant, ReshardOptions(exchange_groups=groups))
            mem_get_info.assert_called_once_with(CUDA0)
        self.assertEqual(calls, ["participant abort"])
        self.assertEqual(groups.connected, 0)

    def test_a_host_transaction_reports_its_bound_and_resident_set(self) -> None:
        calls: List[str] = []
        with single_rank_process_group():
            report = run_transaction(CopyParticipant(calls))
        # the 4x3 fp32 table is rebuilt on the one rank; nothing travels
        self.assertEqual(report.estimated_peak_bytes, 48)
        self.assertEqual(report.memory_kind, "host_rss")
        self.assertGreater(report.peak_memory_bytes, 0)


class MemoryWatchTest(unittest.TestCase):
    def test_cuda_peak_is_read_never_reset(self) -> None:
        allocated = [100, 300, 200]
        with (
            mock.patch("torch.cuda.max_memory_allocated", side_effect=[1000, 1000]),
            mock.patch("torch.cuda.memory_allocated", side_effect=allocated),
            mock.patch("torch.cuda.reset_peak_memory_stats") as reset,
        ):
            watch = MemoryWatch(CUDA0)
            watch.sample()
            watch.sample()
            # the process's earlier peak (1000) was not raised: the most the
            # transaction's phases held
            self.assertEqual(watch.peak(), 300)
        with (
            mock.patch("torch.cuda.max_memory_allocated", side_effect=[1000, 1600]),
            mock.patch("torch.cuda.memory_allocated", return_value=100),
        ):
            watch = MemoryWatch(CUDA0)
            self.assertEqual(watch.peak(), 1600)
        reset.assert_not_called()
        self.assertEqual(watch.kind, "cuda_allocated")


if __name__ == "__main__":
    unittest.main()

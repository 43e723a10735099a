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
dense part, a new communicator), counted by hand; by placement, per kernel
kind: HBM holds every state, UVM its weights and element-wise state off the
device (row-wise state on it), a cached kernel adds its cache and maps, a
host-built module (an unshard's destination) nothing, a data-parallel table
its DDP bucket, so neither an unshard nor a UVM table larger than free HBM is
refused; placements from a plan's kernels; free memory counting what the
allocator keeps unused; a bound over the free
memory refused with the shortfall and the cap that fits; a GPU transaction
(``torch.cuda.mem_get_info`` mocked on this host) refused before anything is
built, every rank's error the same, nothing connected; the peak a transaction
reports (CUDA's peak statistics read, never reset; the resident set on the
host).
"""

import unittest
from typing import Any, List
from unittest import mock

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
from torchrec.distributed.resharding.device_memory import (
    cache_bytes,
    check_fits,
    DEFAULT_STAGED_INFLIGHT_BYTES,
    estimate_peak,
    free_device_bytes,
    MemoryWatch,
    NCCL_COMMUNICATOR_BYTES,
    PeakEstimate,
    Placement,
    placement_of,
    TablePlacement,
)
from torchrec.distributed.resharding.elastic_plan import plan_placements
from torchrec.distributed.resharding.fields import Field, FieldKind
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
from torchrec.distributed.test_utils.reshard_utils import (
    CACHING,
    FUSED,
    make_ebc,
    make_plan,
    UVM,
)
from torchrec.distributed.test_utils.transaction_doubles import (
    CopyParticipant,
    env_keeping,
    RecordingGroups,
    SUM,
    WEIGHT,
)
from torchrec.distributed.types import ShardingPlan

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


MOMENTUM = Field("momentum1", FieldKind.RECT, torch.float32)
MOVED_IN = (
    {"t": _layout(PlacedShard(0, WHOLE))},
    {"t": _layout(PlacedShard(1, WHOLE))},
)


def _on_rank_1(placement: TablePlacement, fields: Any = (WEIGHT, SUM, MOMENTUM)) -> Any:
    """The 8x4 table moving onto rank 1 under ``placement``: its estimate
    there (weights 128 B, row-wise sums 32 B, momentum 128 B)."""
    old, new = MOVED_IN
    return estimate_peak(old, new, {"t": fields}, 1, placements={"t": placement})


class EstimateByPlacementTest(unittest.TestCase):
    def test_hbm_holds_weights_and_every_state(self) -> None:
        here = _on_rank_1(TablePlacement(Placement.DEVICE))
        self.assertEqual((here.new_state_bytes, here.managed_bytes), (288, 0))
        self.assertEqual(here.total, 288 + 288)  # and the received bytes

    def test_uvm_keeps_weights_and_element_wise_state_off_the_device(self) -> None:
        here = _on_rank_1(TablePlacement(Placement.MANAGED))
        # row-wise state stays in HBM (fbgemm's construct_split_state)
        self.assertEqual((here.new_state_bytes, here.managed_bytes), (32, 256))
        self.assertEqual(here.cache_bytes, 0)
        self.assertEqual(here.total, 32 + 288)

    def test_a_cached_kernel_adds_its_cache_and_maps(self) -> None:
        here = _on_rank_1(TablePlacement(Placement.MANAGED_CACHING, 0.5))
        # 8 rows x 0.5 -> one set of 32 slots of 4 fp32 columns, 20 B of
        # state per slot, 4 B of index map per row
        self.assertEqual(here.cache_bytes, 32 * (4 * 4 + 20) + 8 * 4)
        self.assertEqual((here.new_state_bytes, here.managed_bytes), (32, 256))
        lfu = _on_rank_1(TablePlacement(Placement.MANAGED_CACHING, 0.5, lfu=True))
        self.assertEqual(lfu.cache_bytes, here.cache_bytes + 8 * 9)
        # a bigger table: its sets follow the load factor
        self.assertEqual(
            cache_bytes(6400, 4, 4, TablePlacement(Placement.MANAGED_CACHING, 0.2)),
            1280 * (16 + 20) + 6400 * 4,
        )
        # the kernel's widest row sizes every slot of the rank's cached shards
        wide = Field("weight", FieldKind.RECT, torch.float16)
        old = {"a": _layout(PlacedShard(0, WHOLE)), "b": TableLayout(8, 16, ())}
        new = {
            "a": _layout(PlacedShard(1, WHOLE)),
            "b": TableLayout(8, 16, (PlacedShard(1, Rect(0, 0, 8, 16)),)),
        }
        placement = TablePlacement(Placement.MANAGED_CACHING, 0.5)
        both = estimate_peak(
            old,
            new,
            {"a": (wide,), "b": (wide,)},
            1,
            placements={"a": placement, "b": placement},
        )
        self.assertEqual(both.cache_bytes, 2 * (32 * (16 * 2 + 20) + 8 * 4))

    def test_a_host_built_module_takes_no_device_memory(self) -> None:
        here = _on_rank_1(TablePlacement(Placement.HOST))
        self.assertEqual((here.new_state_bytes, here.host_bytes), (0, 288))
        old, new = MOVED_IN
        # nor its dense part; the received bytes stage through the device
        staged = estimate_peak(
            old,
            new,
            {"t": (WEIGHT, SUM, MOMENTUM)},
            1,
            max_inflight_bytes=100,
            dense_bytes=1000,
            placements={"t": TablePlacement(Placement.HOST)},
        )
        self.assertEqual(staged.total, 100)

    def test_a_data_parallel_table_adds_its_ddp_bucket(self) -> None:
        here = _on_rank_1(TablePlacement(Placement.DEVICE, ddp=True))
        self.assertEqual(here.new_state_bytes, 288 + 128)

    def test_unshard_and_a_uvm_table_larger_than_free_hbm_pass(self) -> None:
        rows, cols = 1 << 20, 128  # 512 MiB of fp32 weights
        whole = Rect(0, 0, rows, cols)
        old = {"t": TableLayout(rows, cols, (PlacedShard(0, whole),))}
        new = {"t": TableLayout(rows, cols, (PlacedShard(1, whole),))}
        free = 64 * 2**20
        for kind in (Placement.MANAGED, Placement.HOST):
            estimate = estimate_peak(
                old,
                new,
                {"t": (WEIGHT,)},
                1,
                max_inflight_bytes=DEFAULT_STAGED_INFLIGHT_BYTES // 8,
                placements={"t": TablePlacement(kind)},
            )
            self.assertGreaterEqual(estimate.managed_bytes + estimate.host_bytes, 2**29)
            check_fits(estimate, free, CUDA0, "unshard")
        # the same table in HBM does not fit, and says so
        estimate = estimate_peak(old, new, {"t": (WEIGHT,)}, 1, 2**20)
        with self.assertRaisesRegex(ReshardError, "B short"):
            check_fits(estimate, free, CUDA0, "reshard")

    def test_placements_follow_the_kernel_and_the_device(self) -> None:
        self.assertEqual(placement_of(FUSED, "cuda").kind, Placement.DEVICE)
        self.assertEqual(placement_of(UVM, "cuda").kind, Placement.MANAGED)
        cached = placement_of(
            CACHING,
            "cuda",
            fused_params={
                "cache_load_factor": 0.3,
                "cache_algorithm": CacheAlgorithm.LFU,
            },
        )
        self.assertEqual(
            cached, TablePlacement(Placement.MANAGED_CACHING, 0.3, lfu=True)
        )
        for kernel in (FUSED, UVM, CACHING):
            self.assertEqual(placement_of(kernel, "cpu").kind, Placement.HOST)
        self.assertTrue(placement_of(FUSED, "cuda", "data_parallel").ddp)

    def test_a_plans_placements(self) -> None:
        ebc = make_ebc(2, rows=[16, 16], dims=[8, 8])
        specs = {"t0": ("table_wise", 0), "t1": ("table_wise", 0)}
        plan = ShardingPlan({"ebc": make_plan(ebc, specs, 1, 1, CACHING, "cuda")})
        tables = {"ebc": [("t0", 16, 8), ("t1", 16, 8)]}
        placements = plan_placements(plan, tables, "cuda")
        self.assertEqual(
            {k: p.kind for k, p in placements.items()},
            {"ebc:t0": Placement.MANAGED_CACHING, "ebc:t1": Placement.MANAGED_CACHING},
        )
        self.assertEqual(
            {p.kind for p in plan_placements(plan, tables, "cpu").values()},
            {Placement.HOST},
        )

    def test_free_memory_counts_what_the_allocator_keeps_unused(self) -> None:
        with (
            mock.patch(
                "torch.cuda.mem_get_info", autospec=True, return_value=(100, 900)
            ),
            mock.patch(
                "torch.cuda.memory_reserved",
                autospec=True,
                return_value=70,
            ),
            mock.patch(
                "torch.cuda.memory_allocated",
                autospec=True,
                return_value=50,
            ),
        ):
            self.assertEqual(free_device_bytes(CUDA0), 120)
        self.assertIsNone(free_device_bytes(torch.device("cpu")))


class CheckTest(unittest.TestCase):
    def test_a_bound_that_fits_passes(self) -> None:
        check_fits(PeakEstimate(100, 50), 150, CUDA0, "reshard")

    def test_the_shortfall_and_the_cap_that_fits_are_named(self) -> None:
        with self.assertRaisesRegex(
            ReshardError,
            r"needs up to 1500 B more on cuda:0 \(new kernels 500 B, caches 0 B, "
            r"exchange buffers 1000 B.*1200 B are free: 300 B short; "
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
                "torch.cuda.mem_get_info", autospec=True, return_value=(free, 2 * free)
            ) as mem_get_info,
            mock.patch(
                "torch.cuda.max_memory_allocated", autospec=True, return_value=0
            ),
            mock.patch("torch.cuda.memory_allocated", autospec=True, return_value=0),
        ):
            participant = CopyParticipant(
                calls, device=CUDA0, owner=env_keeping(groups)
            )
            with self.assertRaisesRegex(
                ReshardError, r"the copy needs up to \d+ B more on cuda:0.*1 B short"
            ):
                run_transaction(participant)
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
            mock.patch(
                "torch.cuda.max_memory_allocated",
                autospec=True,
                side_effect=[1000, 1000],
            ),
            mock.patch(
                "torch.cuda.memory_allocated", autospec=True, side_effect=allocated
            ),
            mock.patch("torch.cuda.reset_peak_memory_stats", autospec=True) as reset,
        ):
            watch = MemoryWatch(CUDA0)
            watch.sample()
            watch.sample()
            # the process's earlier peak (1000) was not raised: the most the
            # transaction's phases held
            self.assertEqual(watch.peak(), 300)
        with (
            mock.patch(
                "torch.cuda.max_memory_allocated",
                autospec=True,
                side_effect=[1000, 1600],
            ),
            mock.patch("torch.cuda.memory_allocated", autospec=True, return_value=100),
        ):
            watch = MemoryWatch(CUDA0)
            self.assertEqual(watch.peak(), 1600)
        reset.assert_not_called()
        self.assertEqual(watch.kind, "cuda_allocated")


if __name__ == "__main__":
    unittest.main()

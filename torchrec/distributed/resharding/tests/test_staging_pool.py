#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Bounded staging, in one process: an exchange's host staging buffers are views
of one block the rounds reuse (``exchange.StagingPool``, shown with plain host
memory: page-locking needs a GPU), a round that needs more gets one block as
large as it for the next, and the end gives pinned blocks back to the OS
(``torch.accelerator.empty_host_cache``, never called for unpinned ones); an
exchange that stages between the host and a GPU is capped by default, the
same on every rank (``runner.inflight_cap``, ``elastic_plan.staged_on_host``).
"""

import unittest
from typing import List
from unittest import mock

import torch
from torchrec.distributed.resharding.device_memory import DEFAULT_STAGED_INFLIGHT_BYTES
from torchrec.distributed.resharding.elastic_plan import staged_on_host
from torchrec.distributed.resharding.exchange import StagingPool
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.runner import inflight_cap
from torchrec.distributed.test_utils.transaction_doubles import CopyParticipant


class _Staged(CopyParticipant):
    def stages_on_host(self) -> bool:
        return True


class StagingPoolTest(unittest.TestCase):
    def test_a_rounds_buffers_are_views_of_one_reused_block(self) -> None:
        pool = StagingPool(pin=False)
        a = pool.take(10, torch.float32)
        b = pool.take(3, torch.float16)
        self.assertEqual(a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr())
        self.assertEqual(
            (a.dtype, a.numel(), b.dtype, b.numel()),
            (torch.float32, 10, torch.float16, 3),
        )
        # aligned, and not overlapping
        self.assertEqual((b.data_ptr() - a.data_ptr()) % StagingPool.ALIGN, 0)
        self.assertGreaterEqual(b.data_ptr(), a.data_ptr() + 40)
        a.fill_(1.0)
        b.fill_(2.0)
        self.assertTrue(torch.equal(a, torch.ones(10)))
        pool.reset()
        c = pool.take(10, torch.float32)
        self.assertEqual(c.data_ptr(), a.data_ptr())
        self.assertEqual(pool.pinned_bytes, 0)

    def test_a_larger_round_gets_one_block_as_large_as_it_needed(self) -> None:
        pool = StagingPool(pin=False)
        first = pool.take(100, torch.uint8)
        second = pool.take(StagingPool.SMALLEST_BLOCK, torch.uint8)
        self.assertNotEqual(
            first.untyped_storage().data_ptr(), second.untyped_storage().data_ptr()
        )
        pool.reset()
        again: List[torch.Tensor] = [
            pool.take(100, torch.uint8),
            pool.take(StagingPool.SMALLEST_BLOCK, torch.uint8),
        ]
        self.assertEqual(
            again[0].untyped_storage().data_ptr(), again[1].untyped_storage().data_ptr()
        )

    def test_only_pinned_blocks_are_given_back_to_the_os(self) -> None:
        with mock.patch(
            "torch.accelerator.empty_host_cache", autospec=True
        ) as empty_host_cache:
            pool = StagingPool(pin=False)
            pool.take(8, torch.float32)
            pool.release()
            empty_host_cache.assert_not_called()
        if not torch.cuda.is_available():
            # page-locked memory needs an accelerator: a pool that pins is
            # for CUDA data only (test_dynamic_sharding_gpu releases one)
            with self.assertRaisesRegex(RuntimeError, "pin"):
                StagingPool(pin=True).take(8, torch.float32)


class DefaultCapTest(unittest.TestCase):
    def test_an_exchange_staged_between_host_and_gpu_is_capped(self) -> None:
        self.assertIsNone(inflight_cap(CopyParticipant([]), ReshardOptions()))
        self.assertEqual(
            inflight_cap(_Staged([]), ReshardOptions()), DEFAULT_STAGED_INFLIGHT_BYTES
        )
        # the caller's cap wins
        self.assertEqual(
            inflight_cap(_Staged([]), ReshardOptions(max_inflight_bytes=10)), 10
        )

    def test_a_move_stages_when_some_but_not_all_have_a_gpu(self) -> None:
        self.assertTrue(staged_on_host(["cuda", "cpu", "cuda"]))
        self.assertFalse(staged_on_host(["cuda", "cuda"]))
        self.assertFalse(staged_on_host(["cpu", "cpu"]))


if __name__ == "__main__":
    unittest.main()

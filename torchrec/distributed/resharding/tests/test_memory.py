#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of ``memory``: giving the pages of CPU memory outside the
ranges still in use back to the OS (checked against ``mincore`` and the
memory's contents), and counting resident pages.
"""

import mmap
import sys
import unittest

import torch
from torchrec.distributed.resharding import memory

PAGE = mmap.PAGESIZE


@unittest.skipUnless(sys.platform.startswith("linux"), "madvise/mincore: Linux")
class ReleasePagesTest(unittest.TestCase):
    def _resident(self, t: torch.Tensor, start: int, end: int) -> int:
        libc = memory._LIBC
        assert libc is not None
        base = t.data_ptr()
        first = -(-(base + start * 4) // PAGE) * PAGE
        last = (base + end * 4) // PAGE * PAGE
        return memory._resident_bytes(libc, first, last - first)

    def test_only_pages_outside_kept_ranges_are_released(self) -> None:
        per_page = PAGE // 4
        t = torch.arange(1, 64 * per_page + 1, dtype=torch.float32)  # no zeros
        kept = [(0, 10 * per_page + 7), (40 * per_page + 3, 5 * per_page)]
        expected = t.clone()
        # whole pages that hold no kept element, counted page by page
        base = t.data_ptr()
        kept_bytes = [(base + o * 4, base + (o + n) * 4) for o, n in kept]
        whole_pages = [
            p
            for p in range(-(-base // PAGE) * PAGE, base + t.numel() * 4, PAGE)
            if p + PAGE <= base + t.numel() * 4
            and all(p + PAGE <= lo or p >= hi for lo, hi in kept_bytes)
        ]
        self.assertGreater(len(whole_pages), 40)

        released = memory.release_pages(
            t.untyped_storage(), [(o * 4, n * 4) for o, n in kept]
        )

        self.assertEqual(released, len(whole_pages) * PAGE)
        # out of memory now (checked before anything reads them back in)
        self.assertEqual(self._resident(t, 10 * per_page + 7, 40 * per_page + 3), 0)
        for offset, numel in kept:
            torch.testing.assert_close(
                t[offset : offset + numel], expected[offset : offset + numel]
            )
        # the released pages read as zeros (nothing reads them in a reshard:
        # this proves they were given back); every other element is intact
        zeros = t == 0
        self.assertEqual(int(zeros.sum()) * 4, released)
        torch.testing.assert_close(t[~zeros], expected[~zeros])
        for p in whole_pages:
            first = (p - base) // 4
            self.assertTrue(bool(zeros[first : first + per_page].all()))

    def test_nothing_kept_releases_every_whole_page(self) -> None:
        t = torch.ones(16 * PAGE // 4)
        released = memory.release_pages(t.untyped_storage(), [])
        aligned = t.data_ptr() % PAGE == 0
        self.assertEqual(released, (16 if aligned else 15) * PAGE)

    def test_mincore_sees_touched_pages(self) -> None:
        t = torch.ones(8 * PAGE // 4)
        self.assertGreaterEqual(self._resident(t, 0, t.numel()), 7 * PAGE)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
One-process tests of ``storage``: the batch keys that split a rebuilt group
into kernels of kept and of changed tables, and the release of the pages of
departed tables (checked against ``mincore`` and the memory's contents).
"""

import mmap
import sys
import unittest
from typing import Dict, List, Optional

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.resharding import memory
from torchrec.distributed.resharding.storage import (
    BATCH_KEY,
    MAX_KERNELS_PER_GROUP,
    split_kept_tables,
)
from torchrec.distributed.types import ParameterSharding
from torchrec.modules.embedding_configs import EmbeddingBagConfig

PAGE = mmap.PAGESIZE


def _info(name: str, batch_key: Optional[str] = None) -> EmbeddingShardingInfo:
    config = EmbeddingBagConfig(
        name=name, embedding_dim=4, num_embeddings=8, feature_names=[f"f_{name}"]
    )
    fused = {"learning_rate": 0.1}
    if batch_key is not None:
        fused[BATCH_KEY] = batch_key
    return EmbeddingShardingInfo(
        embedding_config=config,
        param_sharding=ParameterSharding(
            sharding_type="table_wise", compute_kernel="fused", ranks=[0]
        ),
        param=torch.empty(0),
        fused_params=fused,
    )


def _keys(infos: List[EmbeddingShardingInfo]) -> Dict[str, Optional[str]]:
    return {
        i.embedding_config.name: (i.fused_params or {}).get(BATCH_KEY) for i in infos
    }


class SplitKeptTablesTest(unittest.TestCase):
    def test_changed_tables_get_the_generation_key_and_kept_ones_keep_theirs(
        self,
    ) -> None:
        kept = _info("a")
        mine = _info("b", "user")
        infos = {"table_wise": [kept, _info("c"), mine, _info("d", "user#reshard2")]}
        split_kept_tables(infos, ["table_wise"], {"c", "d"}, generation=3)
        self.assertEqual(
            _keys(infos["table_wise"]),
            {"a": None, "b": "user", "c": "#reshard3", "d": "user#reshard3"},
        )
        # kept tables keep the very info object the module holds
        self.assertIs(infos["table_wise"][0], kept)
        self.assertIs(infos["table_wise"][2], mine)
        self.assertEqual(infos["table_wise"][1].fused_params["learning_rate"], 0.1)

    def test_groups_not_rebuilt_are_left_alone(self) -> None:
        infos = {"table_wise": [_info("a")], "row_wise": [_info("b")]}
        split_kept_tables(infos, ["table_wise"], {"a", "b"}, generation=1)
        self.assertEqual(_keys(infos["row_wise"]), {"b": None})
        self.assertEqual(_keys(infos["table_wise"]), {"a": "#reshard1"})

    def test_too_many_kernels_merge_into_one_per_user_key(self) -> None:
        names = [f"t{i}" for i in range(MAX_KERNELS_PER_GROUP + 1)]
        # one table per earlier generation: as many keys as the cap allows
        infos = {
            "table_wise": [_info(names[0])]
            + [
                _info(n, f"#reshard{g}")
                for g, n in enumerate(names[1:MAX_KERNELS_PER_GROUP], start=1)
            ]
            + [_info(names[-1]), _info("u0", "user"), _info("u1", "user#reshard1")]
        }
        split_kept_tables(infos, ["table_wise"], {names[-1]}, generation=9)
        self.assertEqual(
            set(_keys(infos["table_wise"]).values()), {"#reshard9", "user#reshard9"}
        )

    def test_within_the_cap_nothing_merges(self) -> None:
        infos = {"table_wise": [_info("a"), _info("b", "#reshard1"), _info("c")]}
        split_kept_tables(infos, ["table_wise"], {"c"}, generation=2)
        self.assertEqual(
            _keys(infos["table_wise"]),
            {"a": None, "b": "#reshard1", "c": "#reshard2"},
        )


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

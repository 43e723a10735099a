#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Relabelling a candidate plan's ranks (pure, one process): it never keeps
fewer bytes than the raw candidate (checked against a brute force over every
permutation), it finds a plan that is the current one up to a renaming of
ranks, it leaves row-wise and data-parallel tables where they are, and it
keeps host-bound tables on their hosts.
"""

import itertools
import unittest
from typing import Dict, List, Tuple

import torch
from hypothesis import given, settings, strategies as st
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.resharding.relabel import (
    apply_permutation,
    kept_bytes_matrix,
    relabel_plan,
    table_blocks,
)
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

ROWS, DIM = 16, 8
PATH = "ebc"


def _ebc(num_tables: int) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t{i}",
                embedding_dim=DIM,
                num_embeddings=ROWS,
                feature_names=[f"f{i}"],
            )
            for i in range(num_tables)
        ],
        device=torch.device("meta"),
    )


def _plan(specs: List[object], world_size: int, local_size: int = 0) -> ShardingPlan:
    module_plan = construct_module_sharding_plan(
        _ebc(len(specs)),
        per_param_sharding={f"t{i}": s for i, s in enumerate(specs)},  # pyre-ignore
        sharder=EmbeddingBagCollectionSharder(),
        local_size=local_size or world_size,
        world_size=world_size,
        device_type="cpu",
    )
    return ShardingPlan({PATH: module_plan})


def _shapes(n: int) -> Dict[Tuple[str, str], Tuple[int, int, int]]:
    return {(PATH, f"t{i}"): (ROWS, DIM, 4) for i in range(n)}


def _brute_force_kept(
    current: ShardingPlan, candidate: ShardingPlan, n: int, w: int
) -> int:
    return max(
        int(
            kept_bytes_matrix(
                current, apply_permutation(candidate, p), _shapes(n), w
            ).trace()
        )
        for p in itertools.permutations(range(w))
    )


def _spec(draw_rank: st.SearchStrategy[int]) -> st.SearchStrategy[object]:
    return st.one_of(
        draw_rank.map(table_wise),
        st.lists(draw_rank, min_size=2, max_size=2).map(column_wise),
    )


class RelabelTest(unittest.TestCase):
    def test_renamed_plan_comes_back_in_place(self) -> None:
        current = _plan(
            [table_wise(0), table_wise(1), table_wise(2), column_wise([0, 2])], 3
        )
        renamed = apply_permutation(current, [2, 0, 1])
        result = relabel_plan(current, renamed, _shapes(4), 3)
        self.assertEqual(result.moved_bytes, 0)
        self.assertGreater(result.moved_bytes_raw, 0)
        self.assertEqual(result.plan.plan, current.plan)

    @settings(max_examples=60, deadline=None)
    @given(data=st.data(), world_size=st.integers(2, 4), num_tables=st.integers(1, 5))
    def test_never_moves_more_than_raw_and_is_optimal(
        self, data: st.DataObject, world_size: int, num_tables: int
    ) -> None:
        rank = st.integers(0, world_size - 1)
        current = _plan([data.draw(_spec(rank)) for _ in range(num_tables)], world_size)
        candidate = _plan(
            [data.draw(_spec(rank)) for _ in range(num_tables)], world_size
        )
        result = relabel_plan(current, candidate, _shapes(num_tables), world_size)
        self.assertLessEqual(result.moved_bytes, result.moved_bytes_raw)
        self.assertEqual(
            result.kept_bytes,
            _brute_force_kept(current, candidate, num_tables, world_size),
        )
        # the relabelled plan is the candidate with renamed ranks: same shards
        for t in range(num_tables):
            new = table_blocks(
                result.plan.plan[PATH][f"t{t}"], ROWS, DIM
            )  # pyre-ignore
            raw = table_blocks(candidate.plan[PATH][f"t{t}"], ROWS, DIM)  # pyre-ignore
            self.assertEqual(
                [(b.row, b.col, b.rows, b.cols) for b in new],
                [(b.row, b.col, b.rows, b.cols) for b in raw],
            )
            self.assertEqual(
                [result.permutation[b.rank] for b in raw], [b.rank for b in new]
            )

    def test_row_wise_and_data_parallel_stay(self) -> None:
        current = _plan([table_wise(0), row_wise(), data_parallel()], 2)
        candidate = _plan([table_wise(1), row_wise(), data_parallel()], 2)
        result = relabel_plan(current, candidate, _shapes(3), 2)
        self.assertEqual(result.permutation, (1, 0))
        self.assertEqual(result.moved_bytes, 0)
        for t in ("t1", "t2"):
            self.assertEqual(
                result.plan.plan[PATH][t], candidate.plan[PATH][t]  # pyre-ignore
            )

    def test_host_bound_tables_keep_their_host(self) -> None:
        # 2 hosts x 2 ranks; a rename across hosts would keep more bytes of t0
        # but would take t1 (table-row-wise on host 1) off its host.
        current = _plan([table_wise(0), table_row_wise(1)], 4, local_size=2)
        candidate = _plan([table_wise(3), table_row_wise(1)], 4, local_size=2)
        result = relabel_plan(current, candidate, _shapes(2), 4, local_world_size=2)
        for c, r in enumerate(result.permutation):
            self.assertEqual(c // 2, r // 2, result.permutation)
        self.assertLessEqual(result.moved_bytes, result.moved_bytes_raw)


if __name__ == "__main__":
    unittest.main()

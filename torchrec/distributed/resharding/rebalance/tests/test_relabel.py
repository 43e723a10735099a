#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Relabelling a candidate plan's ranks (pure, one process): it never keeps
fewer bytes than the raw candidate and keeps as many as the best permutation
(checked against a brute force over every permutation, counting overlaps
from the shards' metadata), it finds a plan that is the current one up to a
renaming of ranks, it leaves row-wise and data-parallel tables where they
are, it keeps host-bound tables on their hosts, and a renamed shard lives on
its new rank's own device.
"""

import itertools
import unittest
from typing import Dict, List, Tuple

import torch
from hypothesis import given, settings, strategies as st
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.resharding.rebalance.relabel import relabel_plan
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    ParameterShardingGenerator,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.reshard_utils import numbered_tables
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

ROWS, DIM = 16, 8
PATH = "ebc"


def _ebc(num_tables: int) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=numbered_tables(
            EmbeddingBagConfig, num_tables, [DIM] * num_tables, [ROWS] * num_tables
        ),
        device=torch.device("meta"),
    )


def _plan(
    specs: List[ParameterShardingGenerator], world_size: int, local_size: int = 0
) -> ShardingPlan:
    module_plan = construct_module_sharding_plan(
        _ebc(len(specs)),
        per_param_sharding={f"t{i}": s for i, s in enumerate(specs)},
        sharder=EmbeddingBagCollectionSharder(),
        local_size=local_size or world_size,
        world_size=world_size,
        device_type="cpu",
    )
    return ShardingPlan({PATH: module_plan})


def _tables(n: int) -> Dict[str, List[Tuple[str, int, int]]]:
    return {PATH: [(f"t{i}", ROWS, DIM) for i in range(n)]}


def _element_bytes(n: int) -> Dict[str, int]:
    return {f"{PATH}:t{i}": 4 for i in range(n)}


def _sharding(plan: ShardingPlan, table: str) -> ParameterSharding:
    shardings = plan.plan[PATH]
    assert isinstance(shardings, EmbeddingModuleShardingPlan)
    return shardings[table]


def _shards(plan: ShardingPlan, table: str) -> List[ShardMetadata]:
    spec = _sharding(plan, table).sharding_spec
    assert isinstance(spec, EnumerableShardingSpec)
    return list(spec.shards)


def _rank(shard: ShardMetadata) -> int:
    placement = shard.placement
    assert placement is not None
    rank = placement.rank()
    assert rank is not None
    return rank


def _overlap(a: ShardMetadata, b: ShardMetadata) -> int:
    extent = 1
    for off_a, size_a, off_b, size_b in zip(
        a.shard_offsets, a.shard_sizes, b.shard_offsets, b.shard_sizes
    ):
        extent *= max(0, min(off_a + size_a, off_b + size_b) - max(off_a, off_b))
    return extent


def _brute_force_kept(
    current: ShardingPlan, candidate: ShardingPlan, n: int, w: int
) -> int:
    """The most bytes any renaming of the candidate's ranks keeps in place."""
    best = 0
    for p in itertools.permutations(range(w)):
        kept = 0
        for i in range(n):
            for new in _shards(candidate, f"t{i}"):
                for old in _shards(current, f"t{i}"):
                    if p[_rank(new)] == _rank(old):
                        kept += _overlap(new, old) * 4
        best = max(best, kept)
    return best


def _spec(
    draw_rank: st.SearchStrategy[int],
) -> st.SearchStrategy[ParameterShardingGenerator]:
    return st.one_of(
        draw_rank.map(table_wise),
        st.lists(draw_rank, min_size=2, max_size=2).map(column_wise),
    )


class RelabelTest(unittest.TestCase):
    def test_renamed_plan_comes_back_in_place(self) -> None:
        current = _plan(
            [table_wise(0), table_wise(1), table_wise(2), column_wise([0, 2])], 3
        )
        # the same shards with rank r renamed [2, 0, 1][r]
        renamed = _plan(
            [table_wise(2), table_wise(0), table_wise(1), column_wise([2, 1])], 3
        )
        result = relabel_plan(current, renamed, _tables(4), _element_bytes(4), 3)
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
        result = relabel_plan(
            current,
            candidate,
            _tables(num_tables),
            _element_bytes(num_tables),
            world_size,
        )
        self.assertLessEqual(result.moved_bytes, result.moved_bytes_raw)
        self.assertEqual(
            result.kept_bytes,
            _brute_force_kept(current, candidate, num_tables, world_size),
        )
        # the relabelled plan is the candidate with renamed ranks: same shards
        for t in range(num_tables):
            new = _shards(result.plan, f"t{t}")
            raw = _shards(candidate, f"t{t}")
            self.assertEqual(
                [(s.shard_offsets, s.shard_sizes) for s in new],
                [(s.shard_offsets, s.shard_sizes) for s in raw],
            )
            self.assertEqual(
                [result.permutation[_rank(s)] for s in raw], [_rank(s) for s in new]
            )
            self.assertEqual(
                _sharding(result.plan, f"t{t}").ranks, [_rank(s) for s in new]
            )

    def test_row_wise_and_data_parallel_stay(self) -> None:
        current = _plan([table_wise(0), row_wise(), data_parallel()], 2)
        candidate = _plan([table_wise(1), row_wise(), data_parallel()], 2)
        result = relabel_plan(current, candidate, _tables(3), _element_bytes(3), 2)
        self.assertEqual(result.permutation, (1, 0))
        self.assertEqual(result.moved_bytes, 0)
        for t in ("t1", "t2"):
            self.assertEqual(_sharding(result.plan, t), _sharding(candidate, t))

    def test_host_bound_tables_keep_their_host(self) -> None:
        # 2 hosts x 2 ranks; a rename across hosts would keep more bytes of t0
        # but would take t1 (table-row-wise on host 1) off its host.
        current = _plan([table_wise(0), table_row_wise(1)], 4, local_size=2)
        candidate = _plan([table_wise(3), table_row_wise(1)], 4, local_size=2)
        result = relabel_plan(
            current, candidate, _tables(2), _element_bytes(2), 4, local_world_size=2
        )
        for c, r in enumerate(result.permutation):
            self.assertEqual(c // 2, r // 2, result.permutation)
        self.assertLessEqual(result.moved_bytes, result.moved_bytes_raw)

    def test_renamed_shard_lives_on_its_new_ranks_device(self) -> None:
        # 1 host x 4 GPUs: t0 moves from rank 3 back to rank 0's device
        current = _plan([table_wise(0), table_wise(1)], 4)
        candidate = _plan([table_wise(3), table_wise(2)], 4)
        result = relabel_plan(
            current,
            candidate,
            _tables(2),
            _element_bytes(2),
            4,
            local_world_size=4,
            device_type="cuda",
        )
        self.assertEqual(result.moved_bytes, 0)
        for t, rank in (("t0", 0), ("t1", 1)):
            (shard,) = _shards(result.plan, t)
            self.assertEqual(str(shard.placement), f"rank:{rank}/cuda:{rank}")


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Replanning from measured load (pure, one process): the all-reduced counters
become per-table pooling factors and per-rank times; they replace the
declared load in the user's constraints (the user's other settings stay);
the planner's estimators rank a plan with the hot tables on one rank as more
costly on that rank than the planner's candidate for the measured load; a
planner without a feasible plan says so.
"""

import unittest
from typing import List, Sequence, Tuple

import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.resharding.load import (
    feature_slots,
    LoadStatistics,
    RANK_FIELDS,
    statistics_from_vector,
)
from torchrec.distributed.resharding.replan import (
    align_with_current,
    changed_tables,
    measured_constraints,
    needs_dense_rebuild,
    plan_candidate,
    predict_rank_costs,
)
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

PATH = "sparse.ebc"
ROWS, DIM, BATCH, WORLD = 1000, 32, 64, 2
TABLES: List[Tuple[str, List[str]]] = [(f"t{i}", [f"f{i}"]) for i in range(4)]


def _skeleton() -> nn.Module:
    root = nn.Module()
    root.sparse = nn.Module()
    root.sparse.ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=fs
            )
            for t, fs in TABLES
        ],
        device=torch.device("meta"),
    )
    return root


def _plan(ranks: Sequence[int]) -> ShardingPlan:
    return ShardingPlan(
        {
            PATH: construct_module_sharding_plan(
                _skeleton().sparse.ebc,
                per_param_sharding={
                    f"t{i}": table_wise(r, compute_kernel="fused")
                    for i, r in enumerate(ranks)
                },
                sharder=EmbeddingBagCollectionSharder(),
                local_size=WORLD,
                world_size=WORLD,
                device_type="cpu",
            )
        }
    )


def _stats(ids_per_sample: Sequence[float], steps: int = 10) -> LoadStatistics:
    """Counters as ``LoadMonitor`` packs them, summed over ``WORLD`` ranks."""
    module_tables = [(PATH, TABLES)]
    slots = feature_slots(module_tables)
    samples = BATCH * steps * WORLD
    vector = [ids_per_sample[int(s.feature[1:])] * samples for s in slots]
    vector += [float(samples)] * len(slots)
    for name in RANK_FIELDS:
        value = float(steps) if name == "steps" else 0.01 * steps
        vector += [value] * WORLD
    return statistics_from_vector(vector, slots, module_tables, WORLD)


TOPOLOGY = Topology(world_size=WORLD, compute_device="cpu", local_world_size=WORLD)
SHARDERS = [EmbeddingBagCollectionSharder()]


class ReplanTest(unittest.TestCase):
    def test_statistics_from_counters(self) -> None:
        stats = _stats([1.0, 2.0, 30.0, 4.5], steps=10)
        self.assertEqual(stats.steps, 10)
        t2 = stats.table(PATH, "t2")
        self.assertEqual(t2.pooling_factors, (30.0,))
        self.assertEqual(t2.samples_per_rank_step, (float(BATCH),))
        self.assertEqual(t2.ids_per_step, 30.0 * BATCH * WORLD)
        self.assertEqual(stats.compute_seconds, (0.01,) * WORLD)
        self.assertEqual(stats.imbalance, 1.0)
        self.assertEqual(stats.digest(), _stats([1.0, 2.0, 30.0, 4.5]).digest())
        self.assertNotEqual(stats.digest(), _stats([1.0, 2.0, 30.0, 4.0]).digest())

    def test_ranks_with_different_step_counts_are_refused(self) -> None:
        module_tables = [(PATH, TABLES)]
        slots = feature_slots(module_tables)
        vector = (
            [0.0] * (2 * len(slots))
            + [3.0, 4.0]
            + [0.0] * ((len(RANK_FIELDS) - 1) * WORLD)
        )
        with self.assertRaisesRegex(ValueError, "different numbers of steps"):
            statistics_from_vector(vector, slots, module_tables, WORLD)

    def test_measured_load_replaces_the_declared(self) -> None:
        user = {
            "t0": ParameterConstraints(
                sharding_types=["table_wise", "column_wise"],
                min_partition=8,
                pooling_factors=[99.0],
            )
        }
        stats = _stats([3.0, 2.0, 1.0, 1.0])
        out = measured_constraints(stats, _plan([0, 1, 0, 1]), BATCH // 2, user)
        self.assertEqual(out["t0"].pooling_factors, [3.0])
        self.assertEqual(out["t0"].num_poolings, [2.0])  # batch 64 vs planned 32
        self.assertEqual(out["t0"].sharding_types, ["table_wise", "column_wise"])
        self.assertEqual(out["t0"].min_partition, 8)
        self.assertEqual(out["t0"].compute_kernels, ["fused"])  # kept
        self.assertNotIn("data_parallel", out["t1"].sharding_types or [])
        self.assertIs(user["t0"].pooling_factors[0], 99.0)  # the user's untouched

    def test_candidate_improves_predicted_costs(self) -> None:
        stats = _stats([40.0, 1.0, 40.0, 1.0])  # the hot tables share rank 0
        current = _plan([0, 1, 0, 1])
        constraints = measured_constraints(stats, current, BATCH)
        candidate = align_with_current(
            current, plan_candidate(_skeleton(), SHARDERS, TOPOLOGY, BATCH, constraints)
        )
        now, then = predict_rank_costs(
            [current, candidate], _skeleton(), SHARDERS, TOPOLOGY, BATCH, constraints
        )
        self.assertGreater(now.per_rank[0], 5 * now.per_rank[1])
        self.assertLess(then.slowest, 0.7 * now.slowest)
        self.assertLess(then.imbalance, now.imbalance)
        self.assertTrue(changed_tables(current, candidate))
        # a renamed plan costs the same, per rank renamed
        swapped = predict_rank_costs(
            [_plan([1, 0, 1, 0])], _skeleton(), SHARDERS, TOPOLOGY, BATCH, constraints
        )[0]
        self.assertEqual(swapped.per_rank, tuple(reversed(now.per_rank)))

    def test_equal_layout_is_no_change(self) -> None:
        current = _plan([0, 1, 0, 1])
        again = _plan([0, 1, 0, 1])
        self.assertEqual(
            changed_tables(current, align_with_current(current, again)), []
        )

    def test_no_feasible_plan(self) -> None:
        tiny = Topology(
            world_size=WORLD, compute_device="cpu", local_world_size=WORLD, ddr_cap=1024
        )
        stats = _stats([1.0] * 4)
        constraints = measured_constraints(stats, _plan([0, 1, 0, 1]), BATCH)
        with self.assertRaises(PlannerError):
            plan_candidate(_skeleton(), SHARDERS, tiny, BATCH, constraints)

    def test_dense_rebuild_named(self) -> None:
        current = _plan([0, 1, 0, 1])
        module_plan = dict(current.plan[PATH])  # pyre-ignore[6]
        dp = construct_module_sharding_plan(
            _skeleton().sparse.ebc,
            per_param_sharding={
                f"t{i}": data_parallel() if i == 1 else table_wise(0) for i in range(4)
            },
            sharder=EmbeddingBagCollectionSharder(),
            local_size=WORLD,
            world_size=WORLD,
            device_type="cpu",
        )
        module_plan["t1"] = dp["t1"]
        candidate = ShardingPlan({PATH: module_plan})  # pyre-ignore[6]
        self.assertEqual(needs_dense_rebuild(current, candidate), [f"{PATH}/t1"])


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Replanning from measured load (pure, one process): the all-reduced counters
become per-table pooling factors, per-rank times and the values each rank
attached; they replace the declared load in the user's constraints (the
user's other settings stay); TorchRec's planner, given the measured load,
splits hot tables that share a rank (checked by counting each rank's
elements from the shards' metadata); a candidate that keeps a layout keeps
the current sharding object; a planner without a feasible plan says so; the
background replanner hands over a result or an error, never blocks and runs
one replan at a time.
"""

import threading
import time
import unittest
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import nn
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.resharding.model import plan_delta
from torchrec.distributed.resharding.rebalance.load import (
    feature_slots,
    LoadStatistics,
    RANK_FIELDS,
    statistics_from_vector,
)
from torchrec.distributed.resharding.rebalance.replan import (
    align_with_current,
    BackgroundReplanner,
    full_replan,
    measured_constraints,
    needs_dense_rebuild,
    ReplanRequest,
    ReplanResult,
)
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    data_parallel,
    table_wise,
)
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan
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


def _stats(
    ids_per_sample: Sequence[float],
    steps: int = 10,
    extra: Sequence[Sequence[float]] = (),
) -> LoadStatistics:
    """Counters as ``LoadMonitor`` packs them, summed over ``WORLD`` ranks."""
    module_tables = [(PATH, TABLES)]
    slots = feature_slots(module_tables)
    samples = BATCH * steps * WORLD
    vector = [ids_per_sample[int(s.feature[1:])] * samples for s in slots]
    vector += [float(samples)] * len(slots)
    for name in RANK_FIELDS:
        value = float(steps) if name == "steps" else 0.01 * steps
        vector += [value] * WORLD
    for values in extra:
        vector += list(values)
    num_extra = len(extra[0]) if extra else 0
    return statistics_from_vector(vector, slots, module_tables, WORLD, num_extra)


TOPOLOGY = Topology(world_size=WORLD, compute_device="cpu", local_world_size=WORLD)
SHARDERS = [EmbeddingBagCollectionSharder()]
SHAPES: Dict[str, List[Tuple[str, int, int]]] = {
    PATH: [(t, ROWS, DIM) for t, _ in TABLES]
}
ELEMENT_BYTES: Dict[str, int] = {f"{PATH}:{t}": 4 for t, _ in TABLES}


def _request(
    stats: LoadStatistics, current: ShardingPlan, topology: Topology = TOPOLOGY
) -> ReplanRequest:
    return ReplanRequest(
        step=10,
        definition=_skeleton(),
        sharders=SHARDERS,
        topology=topology,
        batch_size=BATCH,
        constraints=measured_constraints(stats, current, BATCH),
        current=current,
        tables=SHAPES,
        element_bytes=ELEMENT_BYTES,
        device_type="cpu",
    )


def _rank_elements(plan: ShardingPlan, ids: Sequence[float]) -> List[float]:
    """Per rank, ids x elements its shards read, from the shards' metadata."""
    out = [0.0] * WORLD
    shardings = plan.plan[PATH]
    assert isinstance(shardings, EmbeddingModuleShardingPlan)
    for t, ps in shardings.items():
        spec = ps.sharding_spec
        assert isinstance(spec, EnumerableShardingSpec)
        for shard in spec.shards:
            rows, cols = shard.shard_sizes
            placement = shard.placement
            assert placement is not None
            out[placement.rank()] += ids[int(t[1:])] * rows / ROWS * cols
    return out


def _wait_ready(background: BackgroundReplanner, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not background.ready():
        assert time.monotonic() < deadline, "the background replan never finished"
        time.sleep(0.01)


class ReplanTest(unittest.TestCase):
    def test_statistics_from_counters(self) -> None:
        stats = _stats([1.0, 2.0, 30.0, 4.5], steps=10, extra=[(7.0, 0.0), (8.0, 1.0)])
        self.assertEqual(stats.steps, 10)
        t2 = stats.table(PATH, "t2")
        self.assertEqual(t2.pooling_factors, (30.0,))
        self.assertEqual(t2.samples_per_rank_step, (float(BATCH),))
        self.assertEqual(t2.ids_per_step, 30.0 * BATCH * WORLD)
        self.assertEqual(stats.compute_seconds, (0.01,) * WORLD)
        self.assertEqual(stats.imbalance, 1.0)
        self.assertEqual(stats.extra, ((7.0, 0.0), (8.0, 1.0)))
        self.assertEqual(
            stats.digest(),
            _stats([1.0, 2.0, 30.0, 4.5], extra=[(7.0, 0.0), (8.0, 1.0)]).digest(),
        )
        self.assertNotEqual(stats.digest(), _stats([1.0, 2.0, 30.0, 4.0]).digest())
        self.assertEqual(_stats([1.0] * 4).extra, ())

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

    def test_full_replan_spreads_hot_tables(self) -> None:
        ids = [40.0, 1.0, 40.0, 1.0]  # the hot tables share rank 0
        current = _plan([0, 1, 0, 1])
        candidate = full_replan(_request(_stats(ids), current))
        before, after = _rank_elements(current, ids), _rank_elements(candidate, ids)
        self.assertGreater(before[0], 5 * before[1])
        self.assertLess(max(after), 0.7 * max(before))
        self.assertTrue(plan_delta(current, candidate))

    def test_kept_layout_keeps_the_current_sharding(self) -> None:
        current = _plan([0, 1, 0, 1])
        again = _plan([0, 1, 1, 1])
        aligned = align_with_current(current, again, SHAPES, WORLD)
        self.assertEqual(list(plan_delta(current, aligned)[PATH]), ["t2"])
        kept, new = aligned.plan[PATH], current.plan[PATH]
        assert isinstance(kept, EmbeddingModuleShardingPlan)
        assert isinstance(new, EmbeddingModuleShardingPlan)
        for t in ("t0", "t1", "t3"):
            self.assertIs(kept[t], new[t])
        self.assertEqual(
            plan_delta(
                current, align_with_current(current, _plan([0, 1, 0, 1]), SHAPES, WORLD)
            ),
            {},
        )

    def test_no_feasible_plan(self) -> None:
        tiny = Topology(
            world_size=WORLD, compute_device="cpu", local_world_size=WORLD, ddr_cap=1024
        )
        with self.assertRaises(PlannerError):
            full_replan(_request(_stats([1.0] * 4), _plan([0, 1, 0, 1]), tiny))

    def test_dense_rebuild_named(self) -> None:
        current = _plan([0, 1, 0, 1])
        shardings = current.plan[PATH]
        assert isinstance(shardings, EmbeddingModuleShardingPlan)
        changed = EmbeddingModuleShardingPlan(shardings)
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
        changed["t1"] = dp["t1"]
        candidate = ShardingPlan({PATH: changed})
        self.assertEqual(needs_dense_rebuild(current, candidate), [f"{PATH}:t1"])


class BackgroundReplannerTest(unittest.TestCase):
    def _replanner(
        self, release: threading.Event, outcome: Callable[[], ShardingPlan]
    ) -> Callable[[ReplanRequest], ShardingPlan]:
        def replan(request: ReplanRequest) -> ShardingPlan:
            release.wait(30)
            return outcome()

        return replan

    def test_result_is_picked_up_later(self) -> None:
        release = threading.Event()
        plan = _plan([1, 1, 0, 0])
        background = BackgroundReplanner(self._replanner(release, lambda: plan))
        request = _request(_stats([1.0] * 4), _plan([0, 1, 0, 1]))
        background.start(request)  # returns at once
        self.assertTrue(background.busy)
        self.assertFalse(background.ready())
        self.assertIsNone(background.take())
        with self.assertRaisesRegex(RuntimeError, "runs already"):
            background.start(request)
        release.set()
        _wait_ready(background)
        self.assertTrue(background.busy)  # until its result is taken
        result = background.take()
        assert isinstance(result, ReplanResult)
        self.assertIs(result.plan, plan)
        self.assertIsNone(result.error)
        self.assertEqual(result.step, 10)
        self.assertFalse(background.busy)
        self.assertIsNone(background.take())

    def test_failure_is_reported_not_raised(self) -> None:
        release = threading.Event()
        release.set()

        def fails() -> ShardingPlan:
            raise PlannerError("no plan fits\nmore detail")

        background = BackgroundReplanner(self._replanner(release, fails))
        background.start(_request(_stats([1.0] * 4), _plan([0, 1, 0, 1])))
        _wait_ready(background)
        result = background.take()
        assert result is not None
        self.assertIsNone(result.plan)
        self.assertEqual(result.error, "PlannerError: no plan fits")
        # the slot is free again: the next replan may start
        background.start(_request(_stats([1.0] * 4), _plan([0, 1, 0, 1])))
        _wait_ready(background)


if __name__ == "__main__":
    unittest.main()

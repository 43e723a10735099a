#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The load monitor on a sharded DLRM (one rank, in this process): the ids and
samples it counts per feature equal the sums of the batches' lengths; it
times kernels, input dists and output dists; values a rank attaches to the
window come back in its place; after a live reshard replaced the kernels its
hooks follow the new ones; ``remove()`` leaves nothing behind. As on a GPU:
timed with pooled events (the host clock's, which CPU ``timing="events"``
uses, read as CUDA events are), read after one synchronisation per window
and none per step; counting a batch whose lengths live on the counters'
device moves nothing between devices and reads nothing back to the host.
"""

import time
import unittest
from typing import Any, Dict, List, Optional, Set
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torchrec.distributed.resharding.rebalance import monitor as monitor_module
from torchrec.distributed.resharding.rebalance.load import (
    _EventTimer,
    _Timer,
    LoadMonitor,
    timer_type,
)
from torchrec.distributed.resharding.rebalance.monitor import _HostEventTimer, HostEvent
from torchrec.distributed.resharding.rebalance.rebalancer import move_seconds
from torchrec.distributed.resharding.transaction_report import (
    PhaseTimes,
    TransactionReport,
)
from torchrec.distributed.test_utils.multi_process_utils import (
    single_rank_process_group,
)
from torchrec.distributed.test_utils.rebalance_utils import (
    EBC_PATH,
    loaded_batches,
    planned,
    rebalance_dlrm,
    rebalance_model,
    table_wise_planner,
)
from torchrec.distributed.test_utils.reshard_utils import make_plan
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NUM_TABLES, ROWS, DIM, BATCH = 3, 32, 8, 5
LOADS: List[List[int]] = [[1, 4, 0], [2, 6, 1], [3, 1, 2]]


def _train(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: object
) -> None:
    optimizer.zero_grad()
    loss, _ = model(batch)
    loss.backward()
    optimizer.step()


class _DeviceTraffic(TorchDispatchMode):
    """Records ops that move data between devices or read a value back."""

    READ_BACK: Set[Any] = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.is_nonzero.default,
    }

    def __init__(self) -> None:
        super().__init__()
        self.seen: List[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Optional[Dict[str, Any]] = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [
            t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
        ]
        if len({t.device for t in tensors}) > 1 or func in self.READ_BACK:
            self.seen.append(str(func))
        return out


def _model_and_batches(pg: Any) -> Any:
    env = ShardingEnv.from_process_group(pg)
    plan = planned(
        table_wise_planner(1, BATCH, [1.0] * NUM_TABLES), NUM_TABLES, ROWS, DIM
    )
    model, optimizer = rebalance_model(
        env, torch.device("cpu"), plan, NUM_TABLES, ROWS, DIM
    )
    return model, optimizer, loaded_batches(LOADS, 0, ROWS, BATCH)


class GpuTimingTest(unittest.TestCase):
    def test_the_timer_follows_the_device(self) -> None:
        self.assertIs(timer_type(torch.device("cuda", 0)), _EventTimer)
        self.assertIs(timer_type(torch.device("cpu")), _Timer)
        self.assertIs(timer_type(torch.device("cuda", 0), "host"), _Timer)
        self.assertIs(timer_type(torch.device("cpu"), "events"), _HostEventTimer)
        with self.assertRaisesRegex(ValueError, "timing"):
            timer_type(torch.device("cpu"), "wall")

    def test_a_host_event_reads_as_a_cuda_event(self) -> None:
        start, end = HostEvent(), HostEvent()
        self.assertFalse(start.query())
        with self.assertRaisesRegex(RuntimeError, "recorded"):
            start.elapsed_time(end)
        start.record()
        time.sleep(0.01)
        end.record()
        self.assertTrue(start.query() and end.query())
        self.assertGreaterEqual(start.elapsed_time(end), 10.0)  # milliseconds

    def test_events_are_read_after_one_synchronisation_per_window(self) -> None:
        # the package's own synchronisation, wrapped: every call goes through
        with (
            single_rank_process_group() as pg,
            mock.patch.object(
                monitor_module,
                "synchronize_device",
                wraps=monitor_module.synchronize_device,
            ) as synchronize,
        ):
            model, optimizer, batches = _model_and_batches(pg)
            monitor = LoadMonitor.for_model(model, timing="events")
            for batch in batches:
                _train(model, optimizer, batch)
                monitor.end_step()
            synchronize.assert_not_called()
            stats = monitor.collect(pg)
            synchronize.assert_called_once_with(torch.device("cpu"))
            self.assertGreater(stats.compute_seconds[0], 0.0)
            self.assertGreater(stats.input_dist_seconds[0], 0.0)
            self.assertGreater(stats.output_dist_seconds[0], 0.0)
            monitor.remove()

    def test_events_are_pooled_and_finished_pairs_read_as_they_come(self) -> None:
        # the real events, counted as they are made
        with mock.patch.object(
            monitor_module, "HostEvent", wraps=monitor_module.HostEvent
        ) as made:
            timer = _HostEventTimer()
            for _ in range(3):
                timer.start()
                timer.stop()
            first = timer.seconds()
            self.assertEqual(made.call_count, 6)
            for _ in range(3):
                timer.start()
                timer.stop()
            # the read events are recorded again, none made
            self.assertEqual(made.call_count, 6)
            self.assertGreaterEqual(timer.seconds(), first)
            # a long window keeps at most MAX_PENDING unread pairs
            for _ in range(_EventTimer.MAX_PENDING + 10):
                timer.start()
                timer.stop()
            self.assertLessEqual(len(timer._pairs), _EventTimer.MAX_PENDING)
            self.assertLessEqual(made.call_count, 2 * _EventTimer.MAX_PENDING + 4)

    def test_a_reshards_bandwidth_leaves_the_connect_out(self) -> None:
        report = TransactionReport(phases=PhaseTimes(exchange=3.0), connect_seconds=2.5)
        self.assertEqual(move_seconds(report), 0.5)
        self.assertEqual(move_seconds(TransactionReport(connect_seconds=1.0)), 0.0)

    def test_counting_a_batch_moves_nothing_between_devices(self) -> None:
        with single_rank_process_group() as pg:
            model, _, batches = _model_and_batches(pg)
            # the counters on a device of their own (as on a GPU), the batch's
            # lengths there too (as after the input dist)
            meta = torch.device("meta")
            monitor = LoadMonitor(
                [(EBC_PATH, model.module.get_submodule(EBC_PATH))], meta
            )
            features = batches[0].sparse_features
            on_meta = KeyedJaggedTensor(
                keys=features.keys(),
                values=features.values().to(meta),
                lengths=features.lengths().to(meta),
            )
            counter = monitor._monitors[0]
            counter.count(on_meta)  # the first batch of these keys builds an index
            traffic = _DeviceTraffic()
            with traffic:
                for _ in range(3):
                    counter.count(on_meta)
            self.assertEqual(traffic.seen, [])
            monitor.remove()


class LoadMonitorTest(unittest.TestCase):
    def test_counts_times_rehooks_and_removes(self) -> None:
        with single_rank_process_group() as pg:
            env = ShardingEnv.from_process_group(pg)
            plan = planned(
                table_wise_planner(1, BATCH, [1.0] * NUM_TABLES), NUM_TABLES, ROWS, DIM
            )
            model, optimizer = rebalance_model(
                env, torch.device("cpu"), plan, NUM_TABLES, ROWS, DIM
            )
            monitor = LoadMonitor.for_model(model)
            batches = loaded_batches(LOADS, 0, ROWS, BATCH)
            for batch in batches:
                _train(model, optimizer, batch)
                monitor.end_step()
            stats = monitor.collect(pg, extra=(3.5, -1.0))
            self.assertEqual(stats.extra, ((3.5, -1.0),))
            self.assertEqual(stats.steps, len(batches))
            for i in range(NUM_TABLES):
                ids = sum(
                    int(b.sparse_features[f"f{i}"].lengths().sum()) for b in batches
                )
                load = stats.table(EBC_PATH, f"t{i}")
                self.assertEqual(load.pooling_factors, (ids / (BATCH * len(batches)),))
                self.assertEqual(load.samples_per_rank_step, (float(BATCH),))
                self.assertEqual(load.ids_per_step, ids / len(batches))
            self.assertGreater(stats.compute_seconds[0], 0.0)
            self.assertGreater(stats.input_dist_seconds[0], 0.0)
            self.assertGreater(stats.output_dist_seconds[0], 0.0)
            self.assertGreater(stats.step_seconds[0], 0.0)

            # a reshard replaces t0's kernel: the hooks follow
            ebc = model.module.get_submodule(EBC_PATH)
            new_plan = ShardingPlan(
                {
                    EBC_PATH: make_plan(
                        rebalance_dlrm(
                            NUM_TABLES, ROWS, DIM, torch.device("meta")
                        ).model.sparse_arch.embedding_bag_collection,
                        {
                            "t0": ("column_wise", [0, 0]),
                            "t1": ("table_wise", 0),
                            "t2": ("table_wise", 0),
                        },
                        1,
                        1,
                        "fused",
                    )
                }
            )
            generation = ebc.reshard_generation
            model.reshard(new_plan)
            self.assertGreater(ebc.reshard_generation, generation)
            _train(model, optimizer, batches[0])
            monitor.end_step()
            stats = monitor.collect(pg)
            self.assertEqual(stats.steps, 1)
            self.assertGreater(stats.compute_seconds[0], 0.0)
            t0 = int(batches[0].sparse_features["f0"].lengths().sum())
            self.assertEqual(stats.table(EBC_PATH, "t0").ids_per_step, t0)

            monitor.remove()
            hooks = [
                m for m in model.modules() if m._forward_pre_hooks or m._forward_hooks
            ]
            _train(model, optimizer, batches[1])
            stats = monitor.collect(pg)
            self.assertEqual(stats.table(EBC_PATH, "t1").ids_per_step, 0.0)
            self.assertEqual(stats.compute_seconds, (0.0,))
            self.assertEqual(hooks, [])


if __name__ == "__main__":
    unittest.main()

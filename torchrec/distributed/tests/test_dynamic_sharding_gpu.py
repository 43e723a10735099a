#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
What only a GPU shows; each test is skipped with its reason where the
machine lacks the GPUs it needs (as upstream skips its GPU tests). See
docs/gpu.md for how to run them.

One GPU (a one-rank job in this process, NCCL):

* a FUSED_UVM_CACHING table keeps the newest values of its hot rows in its
  HBM cache: a reshard and an unshard right after training (nothing flushed
  them before) carry those values, equal to a twin trained in HBM (FUSED);
  tables then move FUSED -> FUSED_UVM -> FUSED_UVM_CACHING -> FUSED, each
  step equal to a module sharded directly, and train on alike;
* the device-memory pre-flight: what a reshard adds on the GPU (a kept
  group: no communicator) stays within its bound and is no gross over-count
  of it, the report carries the peak, and a reshard whose bound exceeds the
  free memory is refused, the module unchanged; an unshard onto host modules
  needs no free HBM, where a reshard onto the device is refused;
* a coalesced NCCL round through ``ExchangeGroup`` (a send and a receive to
  itself: the one round a single GPU can post);
* the abort path: a receive nothing matches, the deadline, the group aborted
  first: the process lives 5 s on and ``exception_dump`` is not on the job's
  store (with ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=500``);
* pinned staging: one pooled block, given back to the OS at the end;
* the load monitor times with CUDA events, which agree with the profiler's
  kernel times, and adds no synchronisation to a training step
  (``torch.cuda.set_sync_debug_mode``).

Two GPUs (two ranks, NCCL):

* a rank failing after the fill: every rank raises ReshardAbortedError
  within the exchange timeout, the processes live 5 s on and no
  ``exception_dump`` is posted (the group is aborted first, NCCL's watchdog
  never acts), the module is unchanged, and the next reshard connects a new
  group and goes through;
* a rank SIGKILLed right after the build's agreement: the other raises
  ReshardAbortedError at the gate within the exchange timeout and lives on;
* kept exchange groups: one NCCL communicator serves every reshard;
* a capped exchange in several NCCL rounds, values exact;
* unshard and shard-from-rank exchange over NCCL, values exact.
"""

import contextlib
import dataclasses
import os
import time
import unittest
import warnings
from datetime import timedelta
from typing import Any, Dict, List
from unittest import mock

import torch
import torch.distributed as dist
from torchrec.distributed.resharding import (
    ExchangeGroups,
    keep_exchange_groups,
    reshard_module,
    ReshardAbortedError,
    ReshardError,
    ReshardOptions,
    runner,
    shard_from_rank,
    unshard_model,
)
from torchrec.distributed.resharding.exchange import StagingPool
from torchrec.distributed.resharding.exchange_group import (
    AbortSignal,
    Message,
    open_exchange_group,
)
from torchrec.distributed.resharding.rebalance.load import LoadMonitor
from torchrec.distributed.resharding.reshard import ModuleReshard
from torchrec.distributed.test_utils.killed_rank import (
    assert_survivor_aborted_in_time,
    DUMP_WAIT_MS,
    root_store,
)
from torchrec.distributed.test_utils.multi_process_utils import free_port
from torchrec.distributed.test_utils.rebalance_utils import (
    EBC_PATH,
    loaded_batches,
    rebalance_dlrm,
    rebalance_model,
)
from torchrec.distributed.test_utils.reshard_model_utils import (
    make_dense_optimizer,
    model_definition,
    model_plan,
    model_sharders,
    sharded_model,
    train_model,
)
from torchrec.distributed.test_utils.reshard_scenario import (
    MIXED_PLAN_A,
    MIXED_PLAN_B,
    reshard_scenario,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    CACHING,
    delta,
    FUSED,
    global_weights,
    make_plan,
    ReshardTestBase,
    train_step,
    UVM,
)
from torchrec.distributed.test_utils.transaction_doubles import RecordingBackend
from torchrec.distributed.types import ShardingPlan

ONE_GPU = unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
TWO_GPUS = unittest.skipUnless(
    torch.cuda.device_count() >= 2,
    "needs 2 CUDA devices (NCCL puts one rank on each GPU)",
)

# 4 tables: t3 stays put while the others move between the two ranks
EXCHANGE_TIMEOUT = timedelta(seconds=10)


def _kernels(plan: Dict[str, Any], kernel: str) -> Dict[str, Any]:
    for ps in plan.values():
        ps.compute_kernel = kernel
    return plan


def _assert_weights_close(
    a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]
) -> None:
    """Equal up to the rounding of two kernel kinds' arithmetic; a stale row
    (a whole optimizer step behind) is far outside it."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


class OneGpuTest(unittest.TestCase):
    @ONE_GPU
    def test_a_cached_kernels_hot_rows_move_with_it(self) -> None:
        specs = {"t0": ("table_wise", 0), "t1": ("table_wise", 0)}
        rows = [2048, 2048]
        with reshard_scenario(0, 1, free_port(), num_tables=2, rows=rows) as s:
            cached, hbm = _kernels(s.plan(specs), CACHING), _kernels(
                s.plan(specs), FUSED
            )
            uvm = _kernels(s.plan(specs), UVM)
            module, twin = s.shard(cached), s.shard(hbm)
            for batch in s.batches(4, seed=3):
                train_step(module, batch.to(s.device))
                train_step(twin, batch.to(s.device))
            # nothing read (and flushed) the cache since the last step
            reshard_module(module, delta(cached, uvm), s.env)
            _assert_weights_close(
                global_weights(module, s.pg), global_weights(twin, s.pg)
            )

            # the same through unshard, from a whole model
            model, _ = self._model(s.env, CACHING)
            twin_model, _ = self._model(s.env, FUSED)
            for m in (model, twin_model):
                optimizer = make_dense_optimizer(m)
                for step in range(3):
                    train_model(m, optimizer, step, 0)
            unsharded = unshard_model(model)
            assert unsharded is not None
            expected = {
                k[len("ebc.") :]: v
                for k, v in global_weights(twin_model, s.pg).items()
                if k.startswith("ebc.")
            }
            _assert_weights_close(unsharded.modules["ebc"].state_dict(), expected)

    def _model(self, env: Any, kernel: str) -> Any:
        plan = model_plan(1, 0, "cuda", kernel)
        return sharded_model(env, plan, torch.device("cuda", 0)), plan

    @ONE_GPU
    def test_tables_move_between_hbm_uvm_and_the_cache(self) -> None:
        specs = {"t0": ("table_wise", 0), "t1": ("column_wise", [0, 0])}
        with reshard_scenario(0, 1, free_port(), num_tables=2) as s:
            chain = [_kernels(s.plan(specs), k) for k in (FUSED, UVM, CACHING, FUSED)]
            batches = [b.to(s.device) for b in s.batches(len(chain) + 2, seed=4)]
            module = s.shard(chain[0])
            train_step(module, batches[0])
            for step, (old, new) in enumerate(zip(chain, chain[1:])):
                state = s.global_state(module)
                reshard_module(module, delta(old, new), s.env)
                reference = s.reference(new, state)
                assert_state_dicts_equal(module.state_dict(), reference.state_dict())
                assert_optimizer_states_equal(module, reference)
                out = train_step(module, batches[step + 1])
                ref = train_step(reference, batches[step + 1])
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)

    @ONE_GPU
    def test_the_preflight_bounds_refuses_and_reports(self) -> None:
        specs_a = {"t0": ("table_wise", 0), "t1": ("table_wise", 0)}
        specs_b = {"t0": ("column_wise", [0, 0]), "t1": ("table_wise", 0)}
        rows, dims = [1 << 15] * 2, [128, 128]
        with reshard_scenario(
            0, 1, free_port(), num_tables=2, rows=rows, dims=dims
        ) as s:
            a, b = s.plan(specs_a), s.plan(specs_b)
            module = s.shard(a)
            # the env keeps the exchange group: the measured reshard below
            # connects nothing (no communicator in its bound)
            reshard_module(module, delta(a, b), s.env)
            reshard_module(module, delta(b, a), s.env)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated(s.device)
            torch.cuda.reset_peak_memory_stats(s.device)  # this test's own figures
            report = reshard_module(module, delta(a, b), s.env)
            self.assertEqual(report.memory_kind, "cuda_allocated")
            self.assertEqual(report.connect_seconds, 0.0)
            added = report.peak_memory_bytes - before
            self.assertGreater(added, 0)
            # the bound holds, and is no gross over-count either
            self.assertLessEqual(added, report.estimated_peak_bytes)
            self.assertLessEqual(report.estimated_peak_bytes, 4 * added + 2**20)

            weights = global_weights(module, s.pg)
            short = report.estimated_peak_bytes // 2
            with mock.patch(f"{runner.__name__}.free_device_bytes", return_value=short):
                with self.assertRaisesRegex(ReshardError, "B short"):
                    reshard_module(module, delta(b, a), s.env)
            after = global_weights(module, s.pg)
            for key in weights:
                self.assertTrue(torch.equal(weights[key], after[key]), key)
            self.assertEqual(module.module_sharding_plan, b)

    @ONE_GPU
    def test_a_coalesced_round_sends_to_itself_over_nccl(self) -> None:
        # the one NCCL round a single GPU can post: a send and a receive to
        # itself, coalesced through the backend as torch binds it
        with reshard_scenario(0, 1, free_port()) as s:
            group = open_exchange_group(
                [0], "self-send", timedelta(seconds=60), s.device
            )
            self.assertTrue(group.coalesced)
            backend = RecordingBackend(group.backend, [])
            recorded = dataclasses.replace(group, backend=backend)
            sent = torch.arange(4096.0, device=s.device)
            received = torch.zeros_like(sent)
            recorded.wait(
                recorded.post(
                    [
                        Message(sent, 0, 0, send=True),
                        Message(received, 0, 0, send=False),
                    ]
                )
            )
            self.assertTrue(torch.equal(sent, received))
            names = [name for name, _, _ in backend.log]
            self.assertEqual(
                names[:4], ["_start_coalescing", "send", "recv", "_end_coalescing"]
            )
            group.close()

    @ONE_GPU
    def test_an_aborted_group_leaves_the_process_alive_and_posts_no_dump(self) -> None:
        # what the survivors of a failed exchange go through, on one rank: a
        # receive nothing matches, the deadline, the abort first; NCCL's
        # watchdog would post exception_dump before tearing the process down
        with (
            mock.patch.dict(
                os.environ, {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": DUMP_WAIT_MS}
            ),
            reshard_scenario(0, 1, free_port()) as s,
        ):
            signal = AbortSignal.of("abort-check", 1, 0)
            group = open_exchange_group(
                [0], "abort-check", timedelta(seconds=2), s.device
            ).with_signal(signal)
            lone = torch.zeros(16, device=s.device)
            with self.assertRaises((TimeoutError, RuntimeError)):
                group.wait(group.post([Message(lone, 0, 0, send=False)]))
            group.fail("TimeoutError: the check's receive nothing matches")
            time.sleep(5)  # the process lives on
            self.assertFalse(
                root_store(s.pg.get_group_store()).check(["exception_dump"])
            )
            t = torch.ones(4, device=s.device)
            dist.all_reduce(t, group=s.pg)  # the job's own group still works
            self.assertTrue(torch.equal(t, torch.ones(4, device=s.device)))

    @ONE_GPU
    def test_an_unshard_onto_host_modules_needs_no_free_hbm(self) -> None:
        with reshard_scenario(0, 1, free_port()) as s:
            model, _ = self._model(s.env, FUSED)
            weights = global_weights(model, s.pg)
            with mock.patch(f"{runner.__name__}.free_device_bytes", return_value=1):
                unsharded = unshard_model(model)
                assert unsharded is not None
                for key, value in unsharded.modules["ebc"].state_dict().items():
                    self.assertTrue(
                        torch.equal(value, weights[f"ebc.{key}"].cpu()), key
                    )
                # the same free memory refuses what builds on the device
                with self.assertRaisesRegex(ReshardError, "B short"):
                    model.reshard(model_plan(1, 0, "cuda", UVM))

    @ONE_GPU
    def test_pinned_staging_is_pooled_and_given_back(self) -> None:
        key = "allocated_bytes.current"
        torch.accelerator.empty_host_cache()
        before = torch.cuda.host_memory_stats().get(key, 0)
        pool = StagingPool()
        first = pool.take(1 << 20, torch.float32)
        self.assertTrue(first.is_pinned())
        pool.reset()
        again = pool.take(1 << 20, torch.float32)
        self.assertEqual(again.data_ptr(), first.data_ptr())
        del first, again
        pool.release()
        self.assertEqual(torch.cuda.host_memory_stats().get(key, 0), before)

    @ONE_GPU
    def test_event_timings_agree_with_the_profiler(self) -> None:
        with reshard_scenario(0, 1, free_port()) as s:
            model, optimizer, batches = self._timed_model(s)
            for batch in batches[:2]:
                _train_step(model, optimizer, batch.to(s.device))
            monitor = LoadMonitor.for_model(model)
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]
            ) as profile:
                for batch in batches[2:]:
                    _train_step(model, optimizer, batch.to(s.device))
                    monitor.end_step()
                torch.cuda.synchronize()
            stats = monitor.collect(s.pg)
            monitor.remove()
            kernels = sum(
                _device_us(e)
                for e in profile.key_averages()
                if "embedding" in e.key.lower()
            )
            self.assertGreater(kernels, 0)
            ratio = stats.compute_seconds[0] / (kernels / 1e6)
            # events frame the kernels and the gaps between them on their
            # stream: never much less than the kernels' own time
            self.assertGreater(ratio, 0.5, (stats.compute_seconds[0], kernels))
            self.assertLess(ratio, 20.0, (stats.compute_seconds[0], kernels))

    def _timed_model(self, s: Any) -> Any:
        dlrm = rebalance_dlrm(3, 64, 8, torch.device("meta"))
        ebc = dlrm.model.sparse_arch.embedding_bag_collection
        specs = {f"t{i}": ("table_wise", 0) for i in range(3)}
        plan = ShardingPlan({EBC_PATH: make_plan(ebc, specs, 1, 1, FUSED, "cuda")})
        model, optimizer = rebalance_model(s.env, s.device, plan, 3, 64, 8)
        return model, optimizer, loaded_batches([[1, 4, 0], [2, 6, 1]] * 3, 0, 64, 5)

    @ONE_GPU
    def test_the_load_monitor_adds_no_synchronisation(self) -> None:
        with reshard_scenario(0, 1, free_port()) as s:
            dlrm = rebalance_dlrm(3, 64, 8, torch.device("meta"))
            ebc = dlrm.model.sparse_arch.embedding_bag_collection
            plan = ShardingPlan(
                {
                    EBC_PATH: make_plan(
                        ebc,
                        {f"t{i}": ("table_wise", 0) for i in range(3)},
                        1,
                        1,
                        FUSED,
                        "cuda",
                    )
                }
            )
            model, optimizer = rebalance_model(s.env, s.device, plan, 3, 64, 8)
            batches = loaded_batches([[1, 4, 0], [2, 6, 1]] * 3, 0, 64, 5)

            def step(batch: Any) -> int:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        optimizer.zero_grad()
                        loss, _ = model(batch.to(s.device))
                        loss.backward()
                        optimizer.step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                return sum("synchroniz" in str(w.message) for w in seen)

            step(batches[0])  # warm-up
            bare = [step(b) for b in batches[1:3]]
            monitor = LoadMonitor.for_model(model)
            step(batches[3])  # the monitor's first batch builds its index
            monitor.end_step()
            watched = []
            for batch in batches[4:6]:
                watched.append(step(batch))
                monitor.end_step()
            self.assertEqual(watched, bare)
            stats = monitor.collect(s.pg)
            self.assertGreater(stats.compute_seconds[0], 0.0)
            monitor.remove()


def _train_step(model: Any, optimizer: Any, batch: Any) -> None:
    optimizer.zero_grad()
    loss, _ = model(batch)
    loss.backward()
    optimizer.step()


def _device_us(event: Any) -> float:
    """A profiler average's device time in microseconds (by torch's name)."""
    for name in ("device_time_total", "cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def _raise(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("injected after the fill")


def _run_abort(rank: int, world_size: int, port: str) -> None:
    # set before any NCCL group reads it: a dump would come within 0.5 s
    os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] = DUMP_WAIT_MS
    with reshard_scenario(rank, world_size, port, 4, timeout_s=120) as s:
        assert s.device.type == "cuda", s.device
        a, b = s.plan(MIXED_PLAN_A), s.plan(MIXED_PLAN_B)
        groups = keep_exchange_groups(s.env, ExchangeGroups())
        options = ReshardOptions(exchange_timeout=EXCHANGE_TIMEOUT)
        module, reference = s.shard(a), s.shard(a)
        reshard_module(module, delta(a, b), s.env, s.device, options)
        reshard_module(reference, delta(a, b), s.env, s.device)
        assert_state_dicts_equal(module.state_dict(), reference.state_dict())

        fault = (
            mock.patch.object(ModuleReshard, "after_exchange", _raise)
            if rank == 1
            else contextlib.nullcontext()
        )
        outcome = "no error"
        with fault:
            try:
                reshard_module(module, delta(b, a), s.env, s.device, options)
            except ReshardAbortedError:
                outcome = "aborted"
        # the survivors' processes live on, and no watchdog signalled a dump
        time.sleep(5)
        assert not root_store(s.pg.get_group_store()).check(["exception_dump"])
        outcomes: List[Any] = [None] * world_size
        dist.all_gather_object(outcomes, outcome, group=s.pg)
        assert outcomes == ["aborted"] * world_size, outcomes
        assert_state_dicts_equal(module.state_dict(), reference.state_dict())

        reshard_module(module, delta(b, a), s.env, s.device, options)
        reshard_module(reference, delta(b, a), s.env, s.device)
        assert groups.connected == 2, groups.connected
        assert_state_dicts_equal(module.state_dict(), reference.state_dict())
        groups.close()


def _run_kept_communicator(rank: int, world_size: int, port: str) -> None:
    with reshard_scenario(rank, world_size, port, 4, timeout_s=120) as s:
        a, b = s.plan(MIXED_PLAN_A), s.plan(MIXED_PLAN_B)
        groups = keep_exchange_groups(s.env, ExchangeGroups())
        module = s.shard(a)
        names = []
        for old, new in ((a, b), (b, a), (a, b)):
            report = reshard_module(module, delta(old, new), s.env, s.device)
            names.append(report.exchange_group)
        assert groups.connected == 1 and len(set(names)) == 1, names
        weights = global_weights(module, s.pg)
        expected = global_weights(s.shard(b), s.pg)
        for key in expected:
            assert torch.equal(weights[key], expected[key]), key
        groups.close()


def _run_capped(rank: int, world_size: int, port: str) -> None:
    with reshard_scenario(rank, world_size, port, 4, timeout_s=120) as s:
        a, b = s.plan(MIXED_PLAN_A), s.plan(MIXED_PLAN_B)
        module = s.shard(a)
        options = ReshardOptions(max_inflight_bytes=4096)
        report = reshard_module(module, delta(a, b), s.env, s.device, options)
        assert report.rounds > 1, report.rounds
        weights = global_weights(module, s.pg)
        expected = global_weights(s.shard(b), s.pg)
        for key in expected:
            assert torch.equal(weights[key], expected[key]), key


def _run_unshard_and_shard_from_rank(rank: int, world_size: int, port: str) -> None:
    with reshard_scenario(rank, world_size, port, 1, timeout_s=120) as s:
        model = sharded_model(s.env, model_plan(world_size, 0, "cuda"), s.device)
        weights = global_weights(model, s.pg)
        unsharded = unshard_model(model, dst=0)
        if rank == 0:
            assert unsharded is not None
            for key, value in unsharded.modules["ebc"].state_dict().items():
                assert torch.equal(value, weights[f"ebc.{key}"]), key
        source = model_definition("cpu") if rank == 0 else model_definition()
        sharded = shard_from_rank(
            source,
            model_plan(world_size, 1, "cuda"),
            s.env,
            src=0,
            sharders=model_sharders(),
            device=s.device,
        )
        again = global_weights(sharded, s.pg)
        for key, value in global_weights(model, s.pg).items():
            if key.startswith("ebc.") or key.startswith("ec."):
                assert torch.equal(again[key], value), key


class TwoGpuTest(ReshardTestBase):
    @TWO_GPUS
    def test_a_failure_after_the_fill_aborts_every_rank_and_the_job_lives(
        self,
    ) -> None:
        self.run_ranks(_run_abort, 2)

    @TWO_GPUS
    def test_one_communicator_serves_every_reshard(self) -> None:
        self.run_ranks(_run_kept_communicator, 2)

    @TWO_GPUS
    def test_unshard_and_shard_from_rank_over_nccl(self) -> None:
        self.run_ranks(_run_unshard_and_shard_from_rank, 2)

    @TWO_GPUS
    def test_a_capped_exchange_runs_in_rounds_over_nccl(self) -> None:
        self.run_ranks(_run_capped, 2)

    @TWO_GPUS
    def test_a_rank_killed_after_the_build_agreement_fails_the_other_in_time(
        self,
    ) -> None:
        assert_survivor_aborted_in_time(timeout_s=10.0, alive_s=5.0, slack_s=20.0)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A reshard request is one transaction at every level:

* a model-level request with a valid change in one module and a bad one in
  another (or on which the ranks disagree only about the last module) raises
  ReshardError on every rank and moves nothing;
* the caller's plan objects are never modified, and resharding back to them
  moves the tables back;
* a change of kernel options alone rebuilds the table's kernel with them, its
  state carried over: kernel, module plan and model plan agree with a module
  sharded directly with the new plan;
* a reshard with an autograd graph pending through the module is refused, and
  the step then completes exactly as without the attempt;
* a rank that does not call (idle, or busy in a forward) makes the callers
  raise ReshardAbortedError within the exchange timeout, and training goes on
  once the ranks are back in step.
"""

import copy
import time
import unittest
from datetime import timedelta
from typing import Any, Dict

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    CacheAlgorithm,
)
from torch.distributed import _remote_device
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.resharding import (
    reshard_module,
    ReshardAbortedError,
    ReshardError,
    ReshardOptions,
)
from torchrec.distributed.resharding.kernel_state import batched_kernels
from torchrec.distributed.test_utils.reshard_dmp_utils import (
    sparse_arch,
    sparse_arch_batches,
    sparse_arch_plan,
    sparse_arch_step,
)
from torchrec.distributed.test_utils.reshard_ec_utils import make_ec_sharder
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_same_training,
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    delta,
    global_optimizer_state,
    global_weights,
    load_global_state,
    make_sharder,
    ReshardTestBase,
    train_step,
)
from torchrec.distributed.types import CacheParams, ShardingEnv
from torchrec.modules.embedding_configs import DataType

SPECS_A = {
    "sparse_a": {
        "t0": ("table_wise", 0),
        "t1": ("table_wise", 1),
        "t2": ("row_wise", None),
    },
    "sparse_b": {"t0": ("column_wise", [0, 1]), "t1": ("table_wise", 0)},
    "seq": {"t0": ("table_wise", 1), "t1": ("row_wise", None)},
}
SPECS_B = {
    "sparse_a": {
        "t0": ("table_wise", 1),
        "t1": ("table_wise", 0),
        "t2": ("row_wise", None),
    },
    "sparse_b": {"t0": ("table_wise", 1), "t1": ("table_wise", 0)},
    "seq": {"t0": ("table_wise", 0), "t1": ("row_wise", None)},
}


def _model_state(model: torch.nn.Module, pg: dist.ProcessGroup) -> Any:
    """A global view of a model's weights and fused optimizer state."""
    return global_weights(model, pg), global_optimizer_state(model, pg)


def _assert_same_state(a: Any, b: Any) -> None:
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def _make_dmp(env: ShardingEnv, device: torch.device, plan: Any) -> Any:
    sharders = [make_sharder("rowwise_adagrad"), make_ec_sharder("rowwise_adagrad")]
    unsharded = sparse_arch()
    model = DistributedModelParallel(
        sparse_arch(), env=env, device=device, plan=plan, sharders=sharders
    )
    model.load_state_dict(unsharded.state_dict())
    return model


def _run_model_transactions(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, env, device = context.pg, context.env, context.device
        unsharded = sparse_arch()
        plan_a = sparse_arch_plan(unsharded, SPECS_A, world_size)
        plan_b = sparse_arch_plan(unsharded, SPECS_B, world_size)
        caller_a, caller_b = copy.deepcopy(plan_a), copy.deepcopy(plan_b)
        batches = sparse_arch_batches(unsharded, 4)
        model = _make_dmp(env, device, plan_a)
        sparse_arch_step(model, batches[0])
        before = _model_state(model, pg)

        # A valid change of sparse_a and a bad one of seq: nothing moves.
        bad = copy.deepcopy(plan_b)
        bad.plan["seq"]["t0"].sharding_spec.shards[0].placement = _remote_device(
            "rank:5/cpu"
        )
        try:
            model.reshard(bad)
        except ReshardError as e:
            assert "seq" in str(e) and "t0" in str(e), e
        else:
            raise AssertionError("a bad module must refuse the whole request")
        _assert_same_state(before, _model_state(model, pg))
        assert model.plan == plan_a

        # Ranks that disagree about the last module only: nothing moves.
        skewed = copy.deepcopy(plan_b)
        if rank == 1:
            skewed.plan["seq"] = copy.deepcopy(plan_a.plan["seq"])
        try:
            model.reshard(skewed)
        except ReshardError as e:
            assert "different resharding requests" in str(e), e
        else:
            raise AssertionError("ranks passing different plans must be refused")
        _assert_same_state(before, _model_state(model, pg))

        # A good request: the caller's plans are left alone, the model owns a copy.
        model.reshard(plan_b)
        assert plan_a == caller_a and plan_b == caller_b
        assert model.plan == plan_b and model.plan is not plan_b
        for path, module_plan in plan_b.plan.items():
            assert model.module.get_submodule(path).module_sharding_plan == module_plan
        reference = _make_dmp(env, device, plan_b)
        load_global_state(reference, *before)
        assert_state_dicts_equal(reference.state_dict(), model.state_dict())

        # Back to the caller's plan A: the tables move back.
        report = model.reshard(plan_a)
        assert set(report.deltas or {}) == {"sparse_a", "sparse_b", "seq"}, report
        assert model.plan == caller_a
        # (row-wise optimizer state of a table split into columns again is
        # the mean over its former columns: compare the weights)
        _assert_same_state(before[:1], _model_state(model, pg)[:1])
        for batch in batches[1:]:
            sparse_arch_step(model, batch)


# One option at a time, each against a module sharded directly with it.
KERNEL_OPTIONS: Dict[str, Any] = {
    "stochastic_rounding": False,
    "output_dtype": DataType.FP16,
    "bounds_check_mode": BoundsCheckMode.IGNORE,
    "cache_params": CacheParams(algorithm=CacheAlgorithm.LFU, load_factor=0.3),
    "enforce_hbm": True,
}
# Options whose effect a CPU kernel shows in its attributes.
OBSERVABLE = ("stochastic_rounding", "output_dtype", "bounds_check_mode")
KERNEL_ATTRIBUTES = (
    "stochastic_rounding",
    "output_dtype",
    "bounds_check_mode_int",
    "cache_algorithm",
    "enforce_hbm",
)


def _kernel_options(module: torch.nn.Module) -> Dict[str, Dict[str, Any]]:
    """table -> the fbgemm kernel attributes its options set."""
    out: Dict[str, Dict[str, Any]] = {}
    for lookup in module._lookups:
        for batched in batched_kernels(lookup):
            attrs = {a: getattr(batched.emb_module, a, None) for a in KERNEL_ATTRIBUTES}
            for table in batched.config.embedding_tables:
                out[table.name] = attrs
    return out


def _run_kernel_options(rank: int, world_size: int, port: str) -> None:
    with reshard_scenario(rank, world_size, port, 3, dims=[16] * 3) as scenario:
        device, env = scenario.device, scenario.env
        specs = {
            "t0": ("table_wise", 0),
            "t1": ("column_wise", [0, 1]),
            "t2": ("table_wise", 1),
        }
        plan = scenario.plan(specs)
        batches = scenario.batches(2 * len(KERNEL_OPTIONS), seed=8)
        module = scenario.shard(plan)
        for i, (option, value) in enumerate(KERNEL_OPTIONS.items()):
            train_step(module, batches[2 * i])
            new_plan = copy.deepcopy(plan)
            setattr(new_plan["t1"], option, value)
            state = scenario.global_state(module)
            report = reshard_module(module, delta(plan, new_plan), env)
            assert report.tables_moved == {}, (option, report)
            assert module.module_sharding_plan == new_plan, option

            reference = scenario.reference(new_plan, state)
            assert _kernel_options(module) == _kernel_options(reference), option
            if option in OBSERVABLE:  # the option took effect in the kernel
                before = _kernel_options(scenario.shard(plan))
                assert _kernel_options(module)["t1"] != before["t1"], option
            assert_state_dicts_equal(reference.state_dict(), module.state_dict())
            assert_optimizer_states_equal(reference, module)
            assert_same_training(
                reference, module, [batches[2 * i + 1]], "fused", device
            )
            plan = new_plan


def _run_pending_backward(rank: int, world_size: int, port: str) -> None:
    with reshard_scenario(rank, world_size, port, 3) as scenario:
        device, env = scenario.device, scenario.env
        specs = {f"t{i}": ("table_wise", i % world_size) for i in range(3)}
        plan_a = scenario.plan(specs)
        plan_b = scenario.plan({**specs, "t0": ("table_wise", 1)})
        batches = scenario.batches(3, seed=4)
        module, reference = scenario.twins(plan_a)

        out = module(batches[0]).wait().values()
        try:
            reshard_module(module, delta(plan_a, plan_b), env)
        except ReshardError as e:
            assert "backward" in str(e), e
        else:
            raise AssertionError("a pending backward must refuse the reshard")
        (out**2).sum().backward()  # the step completes as without the attempt
        ref = reference(batches[0]).wait().values()
        (ref**2).sum().backward()
        assert torch.equal(out, ref)
        assert_state_dicts_equal(reference.state_dict(), module.state_dict())

        # Backward done: the reshard goes through (also with `out` still held),
        # and so does one after a forward whose graph was dropped.
        reshard_module(module, delta(plan_a, plan_b), env)
        module(batches[1]).wait().values().sum()  # graph dropped at once
        reshard_module(module, delta(plan_b, plan_a), env)
        assert_same_training(reference, module, batches[2:], "fused", device)


EXCHANGE_TIMEOUT = timedelta(seconds=4)


def _run_missing_rank(rank: int, world_size: int, port: str, busy: bool) -> None:
    """Rank 1 does not join (sleeps, or is busy in a forward); rank 0 calls."""
    with reshard_scenario(rank, world_size, port, 3, timeout_s=60) as scenario:
        device, env = scenario.device, scenario.env
        specs = {f"t{i}": ("table_wise", i % world_size) for i in range(3)}
        plan_a = scenario.plan(specs)
        plan_b = scenario.plan({**specs, "t0": ("table_wise", 1)})
        batches = scenario.batches(4, seed=6)
        module, reference = scenario.twins(plan_a, batches[:1])
        options = ReshardOptions(exchange_timeout=EXCHANGE_TIMEOUT)

        wait = EXCHANGE_TIMEOUT.total_seconds() * 1.5
        if rank == 0:
            start = time.perf_counter()
            try:
                reshard_module(module, delta(plan_a, plan_b), env, device, options)
            except ReshardAbortedError as e:
                assert "[1]" in str(e), e  # names the rank that did not join
            else:
                raise AssertionError("a missing rank must abort the reshard")
            elapsed = time.perf_counter() - start
            assert elapsed < EXCHANGE_TIMEOUT.total_seconds() + 3, elapsed
        elif busy:
            # in a forward of its own, past the timeout, then the next step
            out = module(batches[1]).wait().values()
            time.sleep(wait)
            (out**2).sum().backward()
        else:
            time.sleep(wait)

        # Back in step: the module is unchanged and training works.
        if rank == 0 or not busy:
            train_step(module, batches[1])
        train_step(reference, batches[1])
        assert module.module_sharding_plan == plan_a
        assert_state_dicts_equal(reference.state_dict(), module.state_dict())
        # and the next reshard, made by every rank, goes through
        reshard_module(module, delta(plan_a, plan_b), env, device, options)
        reshard_module(reference, delta(plan_a, plan_b), env, device, options)
        assert_same_training(reference, module, batches[2:], "fused", device)


class ReshardTransactionTest(ReshardTestBase):
    def test_model_reshard_is_one_transaction(self) -> None:
        self.run_ranks(_run_model_transactions)

    def test_kernel_options_are_applied(self) -> None:
        self.run_ranks(_run_kernel_options)

    def test_pending_backward_refuses_the_reshard(self) -> None:
        self.run_ranks(_run_pending_backward)

    def test_idle_rank_aborts_within_the_timeout(self) -> None:
        self.run_ranks(_run_missing_rank, busy=False)

    def test_rank_busy_in_a_forward_aborts_within_the_timeout(self) -> None:
        self.run_ranks(_run_missing_rank, busy=True)


if __name__ == "__main__":
    unittest.main()

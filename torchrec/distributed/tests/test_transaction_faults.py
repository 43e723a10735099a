#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A fault in each phase of each of the four transaction kinds (a reshard within
a group, a move between groups, an unshard onto one rank, a shard from one
rank), injected on one rank: validating the request (agree), right after
building the new state (build), connecting the exchange group, reading a piece
in the middle of the exchange, and what travels after the pieces (right before
the barrier). The commit does nothing that can fail.
Every rank raises the same error type (ReshardError before anything is built
or filled, ReshardAbortedError from the exchange on), nothing hangs, what runs
is bit-identical to before, and the next transaction goes through.
"""

import contextlib
import unittest
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding import (
    exchange_groups,
    move_model,
    reshard_module,
    ReshardAbortedError,
    ReshardError,
    ReshardOptions,
    shard_from_rank,
    slots,
    unshard_model,
)
from torchrec.distributed.resharding.elastic import ModelMove
from torchrec.distributed.resharding.reshard import ModuleReshard
from torchrec.distributed.resharding.runner import Participant
from torchrec.distributed.resharding.unshard import ShardFromRank, Unshard
from torchrec.distributed.test_utils.reshard_model_utils import (
    global_model_state,
    make_dense_optimizer,
    model_definition,
    model_plan,
    model_sharders,
    sharded_model,
    train_model,
)
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    delta,
    ReshardTestBase,
    train_step,
    TW_CW_RW,
)
from torchrec.distributed.types import ShardingEnv

# A reshard of a module builds in well under a second; building a model over
# a group takes seconds on a loaded machine, and every rank must reach the
# agreement after it within the timeout.
OPTIONS = ReshardOptions(exchange_timeout=timedelta(seconds=10), max_inflight_bytes=512)
MODEL_OPTIONS = ReshardOptions(
    exchange_timeout=timedelta(seconds=60), max_inflight_bytes=512
)

# phase -> the error every rank raises
PHASES: Dict[str, Type[Exception]] = {
    "agree": ReshardError,
    "build": ReshardError,
    "group": ReshardAbortedError,
    "exchange": ReshardAbortedError,
    "after_exchange": ReshardAbortedError,
}
# The exchange group is opened by the runner alike for every kind: a rank
# that cannot connect makes the others wait the timeout, so only the kind
# with a short one tries it.
MODEL_PHASES: Dict[str, Type[Exception]] = {
    p: e for p, e in PHASES.items() if p != "group"
}


def _raise(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("injected fault")


def _after(original: Callable[..., None]) -> Callable[..., None]:
    """The build, then a fault: what was built must be dropped. (A rank that
    fails before the build's own collectives, which building a model over a
    group runs, leaves the others waiting in them, bounded by the group's
    timeout: the runner's exchange timeout cannot reach into them.)"""

    def build_then_fail(self: Participant) -> None:
        original(self)
        raise RuntimeError("injected fault after the build")

    return build_then_fail


def _faulty_read() -> Callable[..., torch.Tensor]:
    """``read_piece`` that raises on the first piece this rank reads."""

    def read(*args: Any) -> torch.Tensor:
        raise RuntimeError("injected fault in the middle of the exchange")

    return read


def _fault(kind: Type[Participant], phase: str, faulty: bool) -> Any:
    """A context that injects ``phase``'s fault on the faulty rank."""
    if not faulty:
        return contextlib.nullcontext()
    if phase == "agree":
        return mock.patch.object(kind, "prepare", _raise)
    if phase == "build":
        return mock.patch.object(kind, "build", _after(kind.build))
    if phase == "group":
        return mock.patch.object(exchange_groups, "open_exchange_group", _raise)
    if phase == "exchange":
        return mock.patch.object(slots, "read_piece", _faulty_read())
    return mock.patch.object(kind, "after_exchange", _raise)


def _each_fault(
    kind: Type[Participant], rank: int, pg: dist.ProcessGroup, faulty: int = 1
) -> Iterator[Tuple[str, Any]]:
    """
    Every phase, its fault injected on rank ``faulty`` (which reads pieces in
    the exchange), and the check that every rank raised the phase's error.
    """
    phases = PHASES if kind is ModuleReshard else MODEL_PHASES
    for phase, error in phases.items():
        raised: List[Optional[str]] = [None]
        yield phase, _Expect(_fault(kind, phase, rank == faulty), error, raised)
        outcomes: List[Any] = [None] * dist.get_world_size(pg)
        dist.all_gather_object(outcomes, raised[0], group=pg)
        assert outcomes == [error.__name__] * len(outcomes), (phase, outcomes)


class _Expect:
    """Runs the body under a fault and records the error type it raised."""

    def __init__(self, fault: Any, error: Type[Exception], raised: List[Any]) -> None:
        self._fault = fault
        self._error = error
        self._raised = raised

    def __enter__(self) -> None:
        self._fault.__enter__()

    def __exit__(self, kind: Any, value: Any, tb: Any) -> bool:
        self._fault.__exit__(None, None, None)
        if kind is None:
            raise AssertionError("the injected fault must fail the transaction")
        if not issubclass(kind, (ReshardError, ReshardAbortedError)):
            return False
        self._raised[0] = kind.__name__
        return True


# ---------------------------------------------------------------- reshard

PLAN_A = dict(TW_CW_RW)
PLAN_B = {"t0": ("table_wise", 1), "t1": ("table_wise", 0), "t2": ("row_wise", None)}


def _run_reshard(rank: int, world_size: int, port: str) -> None:
    with reshard_scenario(rank, world_size, port, 3, timeout_s=60) as scenario:
        pg, device, env = scenario.pg, scenario.device, scenario.env
        plan_a = scenario.plan(PLAN_A)
        plan_b = scenario.plan(PLAN_B)
        batches = scenario.batches(3, seed=3)
        module, reference = scenario.twins(plan_a, batches[:2])
        for phase, expect in _each_fault(ModuleReshard, rank, pg):
            with expect:
                reshard_module(module, delta(plan_a, plan_b), env, device, OPTIONS)
            assert module.module_sharding_plan == reference.module_sharding_plan
            assert_state_dicts_equal(reference.state_dict(), module.state_dict())
            assert_optimizer_states_equal(reference, module)
        assert torch.equal(
            train_step(module, batches[2]), train_step(reference, batches[2])
        )
        reshard_module(module, delta(plan_a, plan_b), env, device, OPTIONS)
        reshard_module(reference, delta(plan_a, plan_b), env, device, OPTIONS)
        assert_state_dicts_equal(reference.state_dict(), module.state_dict())


# ------------------------------------------------------------------- moves


def _model(env: ShardingEnv, device: torch.device, shift: int) -> nn.Module:
    plan = model_plan(dist.get_world_size(env.process_group), shift)
    return sharded_model(env, plan, device)


def _trained_model(env: ShardingEnv, device: torch.device, rank: int) -> Any:
    """A model over ``env`` and its dense optimizer, after one training step."""
    model = _model(env, device, 0)
    optimizer = make_dense_optimizer(model)
    train_model(model, optimizer, 0, rank)
    return model, optimizer


def _move(
    model: nn.Module,
    optimizer: Any,
    env: ShardingEnv,
    make_optimizer: Callable[[nn.Module], Any] = make_dense_optimizer,
) -> Any:
    """The move of the model onto the same ranks under the shifted plan."""
    world_size = dist.get_world_size(env.process_group)
    return move_model(
        model,
        model_plan(world_size, 1),
        env,
        participants=list(range(world_size)),
        optimizer=optimizer,
        make_optimizer=make_optimizer,
        options=MODEL_OPTIONS,
    )


def _assert_faults_keep_model(
    kind: Type[Participant],
    rank: int,
    pg: dist.ProcessGroup,
    model: nn.Module,
    optimizer: Any,
    attempt: Callable[[], Any],
) -> Any:
    """
    Runs ``attempt`` under each fault of :func:`_each_fault`; after every one
    the model's global state (weights, fused and dense optimizer state) is the
    one before.

    Args:
        kind (Type[Participant]): the transaction ``attempt`` runs.
        rank (int): this rank.
        pg (dist.ProcessGroup): the process group.
        model (nn.Module): the model.
        optimizer (Any): its dense optimizer.
        attempt (Callable[[], Any]): one try of the transaction.

    Returns:
        Any: the model's global state before (``global_model_state``).
    """
    before = global_model_state(model, optimizer, pg)
    for _, expect in _each_fault(kind, rank, pg):
        with expect:
            attempt()
        _assert_same_model_state(before, global_model_state(model, optimizer, pg))
    return before


def _run_move(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=60) as context:
        pg, env, device = context.pg, context.env, context.device
        model, optimizer = _trained_model(env, device, rank)
        before = _assert_faults_keep_model(
            ModelMove, rank, pg, model, optimizer, lambda: _move(model, optimizer, env)
        )
        moved = _move(model, optimizer, env)
        assert moved.model is not None
        _assert_same_model_state(
            before, global_model_state(moved.model, moved.optimizer, pg)
        )


def _run_move_failing_make_optimizer(rank: int, world_size: int, port: str) -> None:
    """
    The caller's optimizer factory raises on one rank of the new group, after
    every byte arrived: every rank raises ReshardAbortedError, the old model is
    whole and trains on exactly as a model that was never moved.
    """
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=60) as context:
        pg, env, device = context.pg, context.env, context.device
        model, optimizer = _trained_model(env, device, rank)
        reference, ref_optimizer = _trained_model(env, device, rank)
        before = global_model_state(model, optimizer, pg)

        def failing_make_optimizer(new_model: nn.Module) -> Any:
            if rank == 1:
                raise RuntimeError("injected fault in make_optimizer")
            return make_dense_optimizer(new_model)

        raised: Optional[str] = None
        try:
            _move(model, optimizer, env, failing_make_optimizer)
        except ReshardAbortedError as e:
            raised = type(e).__name__
        outcomes: List[Any] = [None] * world_size
        dist.all_gather_object(outcomes, raised, group=pg)
        assert outcomes == ["ReshardAbortedError"] * world_size, outcomes
        _assert_same_model_state(before, global_model_state(model, optimizer, pg))
        for step in (1, 2):
            out = train_model(model, optimizer, step, rank)
            ref_out = train_model(reference, ref_optimizer, step, rank)
            assert torch.equal(out, ref_out), step
        _assert_same_model_state(
            global_model_state(reference, ref_optimizer, pg),
            global_model_state(model, optimizer, pg),
        )


def _assert_same_model_state(a: Any, b: Any) -> None:
    (weights_a, fused_a, dense_a), (weights_b, fused_b, dense_b) = a, b
    assert weights_a.keys() == weights_b.keys()
    for key, value in weights_a.items():
        assert torch.equal(weights_b[key], value), key
    for key, value in fused_a.items():
        assert torch.equal(fused_b[key], value), key
    for name, value in dense_a["state"].items():
        for k, v in value.items():
            assert torch.equal(dense_b["state"][name][k], v), (name, k)


def _run_unshard(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=60) as context:
        pg, env, device = context.pg, context.env, context.device
        model, optimizer = _trained_model(env, device, rank)
        before = _assert_faults_keep_model(
            Unshard,
            rank,
            pg,
            model,
            optimizer,
            lambda: unshard_model(
                model, dst=0, optimizer_state=True, options=MODEL_OPTIONS
            ),
        )
        unsharded = unshard_model(model, dst=0, options=MODEL_OPTIONS)
        assert (unsharded is not None) == (rank == 0)
        if unsharded is not None:
            for path, module in unsharded.modules.items():
                for key, value in module.state_dict().items():
                    assert torch.equal(value, before[0][f"{path}.{key}"]), key


def _run_shard_from_rank(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=60) as context:
        pg = context.pg
        env = ShardingEnv.from_process_group(pg)
        source = model_definition("cpu", seed=7) if rank == 0 else model_definition()
        weights = (
            {k: v.clone() for k, v in source.state_dict().items()} if rank == 0 else {}
        )
        plan = model_plan(world_size, 1)
        # the source is the one rank that reads pieces
        for phase, expect in _each_fault(ShardFromRank, rank, pg, faulty=0):
            with expect:
                shard_from_rank(
                    source,
                    plan,
                    env,
                    src=0,
                    sharders=model_sharders(),
                    options=MODEL_OPTIONS,
                )
            for key, value in weights.items():
                assert torch.equal(source.state_dict()[key], value), key
        model = shard_from_rank(
            source, plan, env, src=0, sharders=model_sharders(), options=MODEL_OPTIONS
        )
        optimizer = make_dense_optimizer(model)
        sharded = global_model_state(model, optimizer, pg)[0]
        for key, value in weights.items():
            if key in sharded:
                assert torch.equal(sharded[key], value), key


class TransactionFaultTest(ReshardTestBase):
    def test_faults_in_each_phase_of_a_reshard(self) -> None:
        self.run_ranks(_run_reshard, 2)

    def test_faults_in_each_phase_of_a_move(self) -> None:
        self.run_ranks(_run_move, 2)

    def test_move_with_a_failing_make_optimizer_keeps_the_old_model(self) -> None:
        self.run_ranks(_run_move_failing_make_optimizer, 2)

    def test_faults_in_each_phase_of_an_unshard(self) -> None:
        self.run_ranks(_run_unshard, 2)

    def test_faults_in_each_phase_of_a_shard_from_rank(self) -> None:
        self.run_ranks(_run_shard_from_rank, 2)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Model-level live resharding: move a ``DistributedModelParallel`` model to a
whole new ``ShardingPlan`` (as a planner produces it) as one transaction, and
dry-run the delta between two plans.
"""

import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding.install import adapter_for, ShardedModuleAdapter
from torchrec.distributed.resharding.plan import ReshardError
from torchrec.distributed.resharding.transaction import (
    prepare_reshard,
    PreparedReshard,
    ReshardOptions,
    ReshardReport,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan

logger: logging.Logger = logging.getLogger(__name__)


def plan_delta(
    old_plan: ShardingPlan, new_plan: ShardingPlan
) -> Dict[str, Dict[str, ParameterSharding]]:
    """
    The tables whose sharding differs between two plans, per module path.

    Args:
        old_plan (ShardingPlan): the plan the model runs under.
        new_plan (ShardingPlan): the plan to move to.

    Returns:
        Dict[str, Dict[str, ParameterSharding]]: module path -> {table: new
        ParameterSharding}, only modules with changes, paths sorted.

    Raises:
        ReshardError: when the plans do not cover the same modules and tables.
    """
    old_paths = set(old_plan.plan)
    new_paths = set(new_plan.plan)
    if old_paths != new_paths:
        raise ReshardError(
            "the new plan must cover the same sharded modules: missing "
            f"{sorted(old_paths - new_paths)}, unknown {sorted(new_paths - old_paths)}"
        )
    deltas: Dict[str, Dict[str, ParameterSharding]] = {}
    for path in sorted(old_paths):
        old = old_plan.plan[path]
        new = new_plan.plan[path]
        if set(old) != set(new):
            raise ReshardError(
                f"module '{path}': the new plan must cover the same tables: missing "
                f"{sorted(set(old) - set(new))}, unknown {sorted(set(new) - set(old))}"
            )
        changed = {t: ps for t, ps in new.items() if ps != old[t]}
        if changed:
            deltas[path] = changed
    return deltas


@dataclass
class ModelReshardReport:
    """
    What one rank did in a model-level reshard.

    Args:
        rank (int): group-local rank.
        modules (Dict[str, ReshardReport]): per resharded module path.
        seconds (float): wall time on this rank.
    """

    rank: int
    modules: Dict[str, ReshardReport] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def tables_moved(self) -> Dict[str, List[str]]:
        return {p: r.tables_moved for p, r in self.modules.items() if r.tables_moved}

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.modules.values())

    @property
    def bytes_received(self) -> int:
        return sum(r.bytes_received for r in self.modules.values())


@dataclass
class DryRunReport:
    """
    What a reshard would move, computed without moving anything.

    Args:
        deltas (Dict[str, Dict[str, ParameterSharding]]): per module path, the
            changed tables with their new sharding.
        bytes_sent (Dict[int, int]): per rank, bytes it would send.
        bytes_received (Dict[int, int]): per rank, bytes it would receive.
        tables_moved (Dict[str, List[str]]): per module path, the tables whose
            layout changes.
    """

    deltas: Dict[str, Dict[str, ParameterSharding]]
    bytes_sent: Dict[int, int]
    bytes_received: Dict[int, int]
    tables_moved: Dict[str, List[str]] = field(default_factory=dict)

    @property
    def tables(self) -> Dict[str, List[str]]:
        return {path: sorted(delta) for path, delta in self.deltas.items()}


def _sharded_module(model: nn.Module, path: str) -> nn.Module:
    return model.module.get_submodule(path) if path else model.module


def _requests(
    model: nn.Module, deltas: Mapping[str, Dict[str, ParameterSharding]]
) -> List[Tuple[str, ShardedModuleAdapter, Dict[str, ParameterSharding]]]:
    requests = []
    for path, delta in deltas.items():
        try:
            adapter = adapter_for(_sharded_module(model, path))
        except ReshardError as e:
            raise ReshardError(f"module '{path}': {e}") from None
        requests.append((path, adapter, delta))
    return requests


def prepare_model_reshard(
    model: nn.Module,
    new_plan: ShardingPlan,
    options: Optional[ReshardOptions] = None,
    build: bool = True,
) -> PreparedReshard:
    """
    Validates, builds and agrees on moving every sharded module of ``model`` to
    ``new_plan``, as one transaction; nothing moves yet. Every rank calls it.

    Args:
        model (DistributedModelParallel): the sharded model.
        new_plan (ShardingPlan): a whole plan for the model.
        options (Optional[ReshardOptions]): how to run.
        build (bool): build the new groups (False for a dry run).

    Returns:
        PreparedReshard: the agreed reshard.

    Raises:
        ReshardError: for a bad plan, on every rank.
        ReshardAbortedError: when a rank does not join within the timeout.
    """
    env: ShardingEnv = model._env
    deltas = plan_delta(model.plan, new_plan)
    return prepare_reshard(
        _requests(model, deltas), env, model.device, options, build=build
    )


def dry_run(
    model: nn.Module, new_plan: ShardingPlan, options: Optional[ReshardOptions] = None
) -> DryRunReport:
    """
    Computes the delta between ``model.plan`` and ``new_plan`` and the bytes each
    rank would send and receive (weights and fused optimizer state), without
    building or moving anything: the prepare half of a reshard without its
    build. Every rank must call it (the ranks agree once, as in a reshard).

    Args:
        model (DistributedModelParallel): the sharded model.
        new_plan (ShardingPlan): the plan to move to.
        options (Optional[ReshardOptions]): how a reshard would run.

    Returns:
        DryRunReport: the delta and the per-rank byte counts.
    """
    prepared = prepare_model_reshard(model, new_plan, options, build=False)
    sent, received = prepared.bytes_per_rank()
    deltas = {path: dict(delta) for path, delta in prepared.deltas.items()}
    moved = {p: t for p, t in prepared.tables_moved.items() if t}
    return DryRunReport(deltas, sent, received, moved)


def reshard_model(
    model: nn.Module,
    new_plan: ShardingPlan,
    options: Optional[ReshardOptions] = None,
) -> ModelReshardReport:
    """
    Moves every sharded module of ``model`` to its sharding in ``new_plan``, in
    place, as one transaction: every module is validated, agreed on (once) and
    built before any data moves, and swapped only after every module's data
    arrived. The model's combined fused optimizer (and any optimizer wrapping
    it) follows the moved state. ``DistributedModelParallel.reshard`` calls
    this and then makes (a copy of) ``new_plan`` the model's plan.

    Args:
        model (DistributedModelParallel): the sharded model.
        new_plan (ShardingPlan): a whole plan for the model (same modules and
            tables as ``model.plan``); not modified.
        options (Optional[ReshardOptions]): how to run.

    Returns:
        ModelReshardReport: what this rank did.

    Raises:
        ReshardError: for a bad plan, on every rank, before any data moves.
        ReshardAbortedError: when a rank does not join or the exchange fails;
            every module keeps its old sharding.
    """
    start = time.perf_counter()
    rank = dist.get_rank(model._env.process_group)
    prepared = prepare_model_reshard(model, new_plan, options)
    report = ModelReshardReport(rank, prepared.execute())
    report.seconds = time.perf_counter() - start
    logger.info(
        "model reshard rank %d: %d modules, tables %s, sent %d B, received %d B "
        "in %.3f s",
        rank,
        len(report.modules),
        report.tables_moved,
        report.bytes_sent,
        report.bytes_received,
        report.seconds,
    )
    return report

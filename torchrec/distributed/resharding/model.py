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
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding.adapters import adapter_for
from torchrec.distributed.resharding.install import ShardedModuleAdapter
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import (
    ReshardError,
    sharding_plan_text,
    text_digest,
)
from torchrec.distributed.resharding.runner import PhaseTimes, run_transaction
from torchrec.distributed.resharding.transaction import (
    DryRunReport,
    ModuleReshard,
    ReshardReport,
)
from torchrec.distributed.types import ParameterSharding, ShardingPlan

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
        phases (PhaseTimes): wall time of each phase of the transaction.
    """

    rank: int
    modules: Dict[str, ReshardReport] = field(default_factory=dict)
    seconds: float = 0.0
    phases: PhaseTimes = field(default_factory=PhaseTimes)

    @property
    def tables_moved(self) -> Dict[str, List[str]]:
        return {p: r.tables_moved for p, r in self.modules.items() if r.tables_moved}

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.modules.values())

    @property
    def bytes_received(self) -> int:
        return sum(r.bytes_received for r in self.modules.values())


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


class ModelReshard(ModuleReshard):
    """
    This rank's part of moving every sharded module of a model to a whole new
    plan, as one transaction (the delta of each module is derived, and
    validated, in the agreement).

    Args:
        model (DistributedModelParallel): the sharded model.
        new_plan (ShardingPlan): the plan to move to.
        options (ReshardOptions): how to run.
    """

    def __init__(
        self, model: nn.Module, new_plan: ShardingPlan, options: ReshardOptions
    ) -> None:
        super().__init__([], model._env, model.device, options)
        self._model = model
        self._new_plan = new_plan
        self._derived: Optional[
            List[Tuple[str, ShardedModuleAdapter, Dict[str, ParameterSharding]]]
        ] = None

    def digest(self) -> int:
        try:
            return text_digest(sharding_plan_text(self._new_plan))
        except Exception:  # not a plan at all: validation reports it
            return text_digest(f"?{type(self._new_plan).__name__}")

    def requests(
        self,
    ) -> List[Tuple[str, ShardedModuleAdapter, Mapping[str, ParameterSharding]]]:
        if self._derived is None:
            if not isinstance(self._new_plan, ShardingPlan):
                raise ReshardError(
                    f"expected a ShardingPlan, got {type(self._new_plan).__name__}"
                )
            self._derived = _requests(
                self._model, plan_delta(self._model.plan, self._new_plan)
            )
        return list(self._derived)


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
    options = options or ReshardOptions()
    outcome = run_transaction(ModelReshard(model, new_plan, options), options, True)
    report = outcome.dry_run
    report.phases = outcome.phases
    return report


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
    rank = dist.get_rank(model._env.process_group)
    options = options or ReshardOptions()
    participant = ModelReshard(model, new_plan, options)
    phases = run_transaction(participant, options).phases
    report = ModelReshardReport(rank, participant.reports(phases), phases.total, phases)
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

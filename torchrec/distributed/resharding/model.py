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

from typing import Dict, List, Mapping, Optional, Tuple

from torch import nn
from torchrec.distributed.resharding.module_adapters import (
    adapter_for,
    ShardedModuleAdapter,
)
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import ReshardError
from torchrec.distributed.resharding.plan_validation import sharding_plan_text
from torchrec.distributed.resharding.reshard import ModuleReshard
from torchrec.distributed.resharding.runner import described, run_transaction
from torchrec.distributed.resharding.transaction_report import TransactionReport
from torchrec.distributed.resharding.whole_plan import plan_delta
from torchrec.distributed.types import ParameterSharding, ShardingPlan


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

    def request(self) -> List[str]:
        return [described(sharding_plan_text, self._new_plan)]

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
) -> TransactionReport:
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
        TransactionReport: the delta (``deltas``), the tables whose layout
        changes and the bytes each rank would send and receive
        (``bytes_sent_by_rank``, ``bytes_received_by_rank``).
    """
    options = options or ReshardOptions()
    return run_transaction(ModelReshard(model, new_plan, options), options, True)


def reshard_model(
    model: nn.Module,
    new_plan: ShardingPlan,
    options: Optional[ReshardOptions] = None,
) -> TransactionReport:
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
        TransactionReport: what this rank did.

    Raises:
        ReshardError: for a bad plan, on every rank, before any data moves.
        ReshardAbortedError: when a rank does not join or the exchange fails;
            every module keeps its old sharding.
    """
    options = options or ReshardOptions()
    return run_transaction(ModelReshard(model, new_plan, options), options)

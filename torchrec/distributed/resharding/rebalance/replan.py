#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A full replan with TorchRec's own planner, off the critical path.

* ``measured_constraints`` merges a window's measured pooling factors and
  poolings into the user's ``ParameterConstraints`` (the user's sharding
  types, kernels, partitions and cache settings stay; by default a table
  keeps its compute kernel and no table becomes data-parallel, so a reshard
  never needs the dense optimizer rebuilt);
* ``full_replan`` asks an ``EmbeddingShardingPlanner`` (topology, batch size
  and constraints given, never read from another planner) for a plan of the
  model's unsharded definition, gives every table whose layout it keeps the
  current ``ParameterSharding`` (``align_with_current``) and relabels its
  ranks to keep the most bytes in place (``relabel``);
* the Rebalancer runs it in a process of its own
  (``replan_process.ProcessReplanner``): ``start`` returns at once, a later
  window asks ``ready`` and ``take``s the result (a plan or the error). The
  planner takes minutes to hours at a thousand ranks: no step ever waits for
  it. ``BackgroundReplanner``, the same calls in a daemon thread of the
  training process, is deprecated: the planner is pure Python and, in a
  thread, holds the interpreter lock the training steps need.
"""

import threading
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.model_build import module_tree, plain_twin
from torchrec.distributed.resharding.rebalance.relabel import relabel_plan
from torchrec.distributed.resharding.rebalance.statistics import LoadStatistics
from torchrec.distributed.resharding.whole_plan import (
    module_plan,
    placement_unchanged,
    plan_delta,
    plan_layouts,
    replace_shardings,
    TableShape,
)
from torchrec.distributed.types import (
    ModuleSharder,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)

# The sharding types a table may get when neither it nor the user says more.
NON_REPLICATED_TYPES: List[str] = [
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
]


def planning_definition(model: nn.Module) -> nn.Module:
    """
    What the planner plans for a ``DistributedModelParallel`` model: each of
    its sharded modules as an unsharded twin on the meta device
    (``model_build.plain_twin``), at the module's path in the plan (nothing
    of the dense part, which the planner does not place).

    Args:
        model (DistributedModelParallel): the sharded model.

    Returns:
        nn.Module: the definition (no weights).
    """
    meta = torch.device("meta")
    return module_tree(
        {
            path: plain_twin(model.module.get_submodule(path), meta)
            for path in sorted(model.plan.plan)
        }
    )


def measured_constraints(
    stats: LoadStatistics,
    current: ShardingPlan,
    batch_size: int,
    user: Optional[Mapping[str, ParameterConstraints]] = None,
    keep_kernels: bool = True,
    allow_data_parallel: bool = False,
) -> Dict[str, ParameterConstraints]:
    """
    The user's constraints with the measured load in place of the declared.

    Args:
        stats (LoadStatistics): the window's measurements.
        current (ShardingPlan): the plan the model runs under.
        batch_size (int): the planner's batch size (samples per rank and step).
        user (Optional[Mapping[str, ParameterConstraints]]): the user's own
            constraints per table (kept, except the load figures).
        keep_kernels (bool): a table the user gave no compute kernels keeps its
            current one.
        allow_data_parallel (bool): a table the user gave no sharding types may
            become data-parallel (its reshard then needs the dense optimizer
            rebuilt); a data-parallel table stays so unless allowed.

    Returns:
        Dict[str, ParameterConstraints]: per table.
    """
    out: Dict[str, ParameterConstraints] = dict(user or {})
    for load in stats.tables:
        base = out.get(load.table) or ParameterConstraints()
        declared = list(base.pooling_factors)
        pooling: List[float] = []
        poolings: List[float] = []
        for i, pf in enumerate(load.pooling_factors):
            if pf is None:  # never seen in the window: keep what was declared
                pooling.append(declared[i] if i < len(declared) else declared[-1])
                poolings.append(base.num_poolings[i] if base.num_poolings else 1.0)
            else:
                pooling.append(pf)
                poolings.append(load.samples_per_rank_step[i] / batch_size)
        sharding = module_plan(current, load.path)[load.table]
        kernels = base.compute_kernels
        if kernels is None and keep_kernels:
            kernels = [sharding.compute_kernel]
        types = base.sharding_types
        if types is None and not allow_data_parallel:
            types = (
                [ShardingType.DATA_PARALLEL.value]
                if sharding.sharding_type == ShardingType.DATA_PARALLEL.value
                else list(NON_REPLICATED_TYPES)
            )
        out[load.table] = replace(
            base,
            pooling_factors=pooling,
            num_poolings=poolings,
            compute_kernels=kernels,
            sharding_types=types,
        )
    return out


@dataclass(frozen=True)
class ReplanRequest:
    """
    What a full replan needs, taken at a window (nothing of the live model).

    Args:
        step (int): the step of the window whose statistics it plans from.
        definition (nn.Module): the model's unsharded definition (meta).
        sharders (Sequence[ModuleSharder[nn.Module]]): the model's sharders.
        topology (Topology): the job's topology.
        batch_size (int): samples per rank and step.
        constraints (Mapping[str, ParameterConstraints]): per table, with the
            measured load (``measured_constraints``).
        current (ShardingPlan): the plan the model runs under.
        tables (Mapping[str, Sequence[TableShape]]): module path -> tables.
        element_bytes (Mapping[str, int]): table key -> bytes per element.
        device_type (str): the shards' device type ("cpu", "cuda").
    """

    step: int
    definition: nn.Module
    sharders: Sequence[ModuleSharder[nn.Module]]
    topology: Topology
    batch_size: int
    constraints: Mapping[str, ParameterConstraints]
    current: ShardingPlan
    tables: Mapping[str, Sequence[TableShape]]
    element_bytes: Mapping[str, int]
    device_type: str


def align_with_current(
    current: ShardingPlan,
    candidate: ShardingPlan,
    tables: Mapping[str, Sequence[TableShape]],
    world_size: int,
) -> ShardingPlan:
    """
    The candidate with every table whose sharding type, compute kernel and
    shards (the engine's layouts, in any order) it keeps taking the current
    plan's own ``ParameterSharding``, so that options a planner spells
    differently do not count as a change. Neither plan is modified.

    Args:
        current (ShardingPlan): the plan the model runs under.
        candidate (ShardingPlan): the candidate (same modules and tables).
        tables (Mapping[str, Sequence[TableShape]]): module path -> tables.
        world_size (int): ranks.

    Returns:
        ShardingPlan: a new plan.
    """
    ranks = list(range(world_size))
    old = plan_layouts(current, tables, ranks)
    new = plan_layouts(candidate, tables, ranks)

    def merged(key: TableKey, sharding: ParameterSharding) -> ParameterSharding:
        kept = module_plan(current, key.path)[key.table]
        if placement_unchanged(kept, sharding, old[key], new[key]):
            return kept
        return sharding

    return replace_shardings(candidate, merged)


def needs_dense_rebuild(current: ShardingPlan, candidate: ShardingPlan) -> List[str]:
    """
    Tables whose change (``plan_delta``) rebuilds a dense kernel or a
    data-parallel table, whose parameters a torch optimizer outside the
    module trains (it must be rebuilt over the new parameters after such a
    reshard).
    """
    dense = ShardingType.DATA_PARALLEL.value
    out = []
    for path, changed in plan_delta(current, candidate).items():
        old = module_plan(current, path)
        for table, new in changed.items():
            if dense in (old[table].sharding_type, new.sharding_type) or "dense" in (
                old[table].compute_kernel,
                new.compute_kernel,
            ):
                out.append(TableKey(path, table))
    return sorted(out)


def full_replan(request: ReplanRequest) -> ShardingPlan:
    """
    TorchRec's planner on the measured load, its plan aligned with the
    current one and relabelled to keep the most bytes in place.

    Args:
        request (ReplanRequest): what to plan.

    Returns:
        ShardingPlan: the candidate.

    Raises:
        PlannerError: when the planner finds no feasible plan.
    """
    planner = EmbeddingShardingPlanner(
        topology=request.topology,
        batch_size=request.batch_size,
        constraints=dict(request.constraints),
        stats=[],
        debug=False,
    )
    world_size = request.topology.world_size
    raw = align_with_current(
        request.current,
        planner.plan(request.definition, list(request.sharders)),
        request.tables,
        world_size,
    )
    relabelled = relabel_plan(
        request.current,
        raw,
        request.tables,
        request.element_bytes,
        world_size,
        request.topology.local_world_size,
        request.device_type,
    )
    return align_with_current(
        request.current, relabelled.plan, request.tables, world_size
    )


@dataclass(frozen=True)
class ReplanResult:
    """
    A finished full replan.

    Args:
        step (int): the step of the window it planned from.
        plan (Optional[ShardingPlan]): the candidate, None if it failed.
        error (Optional[str]): why it failed.
        seconds (float): how long it ran.
    """

    step: int
    plan: Optional[ShardingPlan]
    error: Optional[str]
    seconds: float


Replanner = Callable[[ReplanRequest], ShardingPlan]


class ThreadReplanner:
    """
    At most one replan at a time, in a daemon thread of this process:
    ``start`` returns at once; ``ready`` tells whether the result waits;
    ``take`` hands it over (and frees the slot). Only for a replanner that
    mostly waits (on another service, or a test's event): a CPU-bound one
    holds the interpreter lock the training steps need
    (``replan_process.ProcessReplanner`` runs one in a process).

    Args:
        replan (Replanner): plans a request (default: ``full_replan``).
    """

    def __init__(self, replan: Replanner = full_replan) -> None:
        self._replan = replan
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[ReplanResult] = None

    @property
    def busy(self) -> bool:
        """A replan runs or its result waits."""
        with self._lock:
            running = self._thread is not None and self._thread.is_alive()
            return running or self._result is not None

    def start(self, request: ReplanRequest) -> None:
        """
        Starts a replan in the background.

        Raises:
            RuntimeError: when one runs or its result waits.
        """
        if self.busy:
            raise RuntimeError("a full replan runs already")
        self._thread = threading.Thread(
            target=self._run, args=(request,), name="rebalance-replan", daemon=True
        )
        self._thread.start()

    def ready(self) -> bool:
        with self._lock:
            return self._result is not None

    def take(self) -> Optional[ReplanResult]:
        """The finished replan's result (None if none), freeing the slot."""
        with self._lock:
            result, self._result = self._result, None
            return result

    def close(self) -> None:
        """Nothing to end: the daemon thread finishes on its own."""

    def _run(self, request: ReplanRequest) -> None:
        start = time.perf_counter()
        plan: Optional[ShardingPlan] = None
        error: Optional[str] = None
        try:
            plan = self._replan(request)
        except Exception as e:  # reported at the next window, on every rank
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            error = f"{type(e).__name__}: {first}"
        with self._lock:
            self._result = ReplanResult(
                request.step, plan, error, time.perf_counter() - start
            )


class BackgroundReplanner(ThreadReplanner):
    """
    Deprecated: TorchRec's planner in a thread of the training process slows
    every step while it runs (the interpreter lock). ``Rebalancer`` runs it
    in a process (``replan_process.ProcessReplanner``, the same calls).

    Args:
        replan (Replanner): plans a request (default: ``full_replan``).
    """

    def __init__(self, replan: Replanner = full_replan) -> None:
        warnings.warn(
            "BackgroundReplanner is deprecated: the full replan runs in a process "
            "of its own (replan_process.ProcessReplanner); ThreadReplanner keeps "
            "a thread for a replanner that only waits",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(replan)

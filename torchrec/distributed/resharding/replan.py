#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Replanning from measured load with TorchRec's own planner (pure: no
collectives).

* ``measured_constraints`` merges a window's measured pooling factors and
  poolings into the user's ``ParameterConstraints`` (the user's sharding
  types, kernels, partitions and cache settings stay; by default a table
  keeps its compute kernel and no table becomes data-parallel, so a reshard
  never needs the dense optimizer rebuilt);
* ``plan_candidate`` asks an ``EmbeddingShardingPlanner`` built on those
  constraints for a plan of the model's unsharded skeleton;
* ``predict_rank_costs`` runs the planner's own estimators on any plan
  (current or candidate) and sums each rank's shard costs, as the planner's
  partitioner balances them.
"""

from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Shard,
    ShardingOption,
)
from torchrec.distributed.resharding.load import LoadStatistics
from torchrec.distributed.types import (
    ModuleSharder,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
)

# The sharding types a table may get when neither it nor the user says more.
NON_REPLICATED_TYPES: List[str] = [
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
]


@dataclass(frozen=True)
class PlanCost:
    """
    A plan's cost per rank as the planner's estimators predict it.

    Args:
        per_rank (Tuple[float, ...]): the summed ``perf.total`` of every shard
            on each rank (the estimators' unit, ms on their hardware model).
    """

    per_rank: Tuple[float, ...]

    @property
    def slowest(self) -> float:
        return max(self.per_rank) if self.per_rank else 0.0

    @property
    def imbalance(self) -> float:
        mean = sum(self.per_rank) / max(len(self.per_rank), 1)
        return self.slowest / mean if mean > 0 else 1.0


def model_skeleton(model: nn.Module) -> nn.Module:
    """
    An unsharded stand-in for a ``DistributedModelParallel`` model on the meta
    device: every sharded module of its plan as a meta
    ``EmbeddingBagCollection`` / ``EmbeddingCollection`` with the same table
    configs, at the same path, so the planner sees the same tables.

    Args:
        model (DistributedModelParallel): the sharded model.

    Returns:
        nn.Module: the skeleton (no weights).
    """
    root = nn.Module()
    meta = torch.device("meta")
    for path in sorted(model.plan.plan):
        sharded = model.module.get_submodule(path) if path else model.module
        bag_configs = getattr(sharded, "_embedding_bag_configs", None)
        if bag_configs is not None:
            stand_in: nn.Module = EmbeddingBagCollection(
                tables=list(bag_configs),
                is_weighted=bool(getattr(sharded, "_is_weighted", False)),
                device=meta,
            )
        else:
            stand_in = EmbeddingCollection(
                tables=list(sharded._embedding_configs),
                device=meta,
                need_indices=bool(getattr(sharded, "_need_indices", False)),
            )
        if not path:
            return stand_in
        parent = root
        *parents, leaf = path.split(".")
        for name in parents:
            if not hasattr(parent, name):
                parent.add_module(name, nn.Module())
            parent = getattr(parent, name)
        parent.add_module(leaf, stand_in)
    return root


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
        sharding = current.plan[load.path][load.table]  # pyre-ignore[16]
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


def plan_candidate(
    skeleton: nn.Module,
    sharders: Sequence[ModuleSharder[nn.Module]],
    topology: Topology,
    batch_size: int,
    constraints: Mapping[str, ParameterConstraints],
) -> ShardingPlan:
    """
    The planner's plan for the measured load.

    Args:
        skeleton (nn.Module): the model's unsharded stand-in
            (``model_skeleton``).
        sharders (Sequence[ModuleSharder[nn.Module]]): the model's sharders.
        topology (Topology): the job's topology.
        batch_size (int): samples per rank and step.
        constraints (Mapping[str, ParameterConstraints]): per table, with the
            measured load (``measured_constraints``).

    Returns:
        ShardingPlan: the candidate.

    Raises:
        PlannerError: when the planner finds no feasible plan.
    """
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        constraints=dict(constraints),
        stats=[],
        debug=False,
    )
    return planner.plan(skeleton, list(sharders))


def _plan_shards(sharding: ParameterSharding, rows: int, cols: int) -> List[Shard]:
    spec = sharding.sharding_spec
    if spec is None or sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
        return [
            Shard(size=[rows, cols], offset=[0, 0], rank=r)
            for r in sharding.ranks or []
        ]
    assert isinstance(spec, EnumerableShardingSpec)
    shards = []
    for metadata in spec.shards:
        placement = metadata.placement
        assert placement is not None
        shards.append(
            Shard(
                size=list(metadata.shard_sizes),
                offset=list(metadata.shard_offsets),
                rank=placement.rank(),
            )
        )
    return shards


def _option_for(
    options: Sequence[ShardingOption], sharding: ParameterSharding
) -> ShardingOption:
    """An enumerated option of the table to estimate ``sharding`` with."""
    for option in options:
        if (
            option.sharding_type == sharding.sharding_type
            and option.compute_kernel == sharding.compute_kernel
        ):
            return option
    option = options[0]  # a type or kernel the constraints exclude: estimate it
    copy = ShardingOption(
        name=option.name,
        tensor=option.tensor,
        module=option.module,
        input_lengths=option.input_lengths,
        batch_size=option.batch_size,
        sharding_type=sharding.sharding_type,
        partition_by=option.partition_by,
        compute_kernel=sharding.compute_kernel,
        shards=[],
        is_pooled=option.is_pooled,
        feature_names=option.feature_names,
    )
    return copy


def predict_rank_costs(
    plans: Sequence[ShardingPlan],
    skeleton: nn.Module,
    sharders: Sequence[ModuleSharder[nn.Module]],
    topology: Topology,
    batch_size: int,
    constraints: Mapping[str, ParameterConstraints],
) -> List[PlanCost]:
    """
    Each plan's per-rank cost under the given (measured) load, from the
    planner's estimators (``EmbeddingPerfEstimator``): the shards of every
    table as the plan places them, estimated as the planner estimates its own
    options, summed per rank.

    Args:
        plans (Sequence[ShardingPlan]): plans of the skeleton's tables.
        skeleton (nn.Module): the model's unsharded stand-in.
        sharders (Sequence[ModuleSharder[nn.Module]]): the model's sharders.
        topology (Topology): the job's topology.
        batch_size (int): samples per rank and step.
        constraints (Mapping[str, ParameterConstraints]): the load per table.

    Returns:
        List[PlanCost]: one per plan, in order.
    """
    # Every type and kernel the sharders allow, so any plan finds its options.
    loose = {
        table: replace(c, sharding_types=None, compute_kernels=None)
        for table, c in constraints.items()
    }
    enumerator = EmbeddingEnumerator(
        topology=topology, batch_size=batch_size, constraints=loose
    )
    options = enumerator.enumerate(skeleton, list(sharders))
    by_table: Dict[Tuple[str, str], List[ShardingOption]] = {}
    for option in options:
        by_table.setdefault((option.path, option.name), []).append(option)
    costs = []
    for plan in plans:
        placed: List[ShardingOption] = []
        for path, module_plan in sorted(plan.plan.items()):
            for table, sharding in sorted(module_plan.items()):  # pyre-ignore[16]
                template = _option_for(by_table[(path, table)], sharding)
                rows, cols = template.tensor.shape
                estimate = _copy_option(template, _plan_shards(sharding, rows, cols))
                placed.append(estimate)
        enumerator.populate_estimates(placed)
        per_rank = [0.0] * topology.world_size
        for option in placed:
            for shard in option.shards:
                assert shard.perf is not None and shard.rank is not None
                per_rank[shard.rank] += shard.perf.total
        costs.append(PlanCost(tuple(per_rank)))
    return costs


def _copy_option(option: ShardingOption, shards: List[Shard]) -> ShardingOption:
    return ShardingOption(
        name=option.name,
        tensor=option.tensor,
        module=option.module,
        input_lengths=option.input_lengths,
        batch_size=option.batch_size,
        sharding_type=option.sharding_type,
        partition_by=option.partition_by,
        compute_kernel=option.compute_kernel,
        shards=shards,
        cache_params=option.cache_params,
        enforce_hbm=option.enforce_hbm,
        stochastic_rounding=option.stochastic_rounding,
        bounds_check_mode=option.bounds_check_mode,
        dependency=option.dependency,
        is_pooled=option.is_pooled,
        feature_names=option.feature_names,
        output_dtype=option.output_dtype,
        key_value_params=option.key_value_params,
    )


def same_layout(a: ParameterSharding, b: ParameterSharding) -> bool:
    """True iff the two shardings place the same shards on the same ranks."""
    if a.sharding_type != b.sharding_type or a.compute_kernel != b.compute_kernel:
        return False
    rows_cols = (1 << 62, 1 << 62)

    def key(s: ParameterSharding) -> List[Tuple[int, ...]]:
        return sorted(
            (sh.rank or 0, *sh.offset, *sh.size) for sh in _plan_shards(s, *rows_cols)
        )

    return key(a) == key(b)


def align_with_current(current: ShardingPlan, candidate: ShardingPlan) -> ShardingPlan:
    """
    The candidate with every table whose layout it keeps taking the current
    plan's own ``ParameterSharding`` (so options the planner would spell
    differently do not count as a change). Neither plan is modified.

    Args:
        current (ShardingPlan): the plan the model runs under.
        candidate (ShardingPlan): the candidate.

    Returns:
        ShardingPlan: a new plan.
    """
    modules = {}
    for path, module_plan in candidate.plan.items():
        merged = type(module_plan)()
        for table, sharding in module_plan.items():  # pyre-ignore[16]
            old = current.plan[path][table]  # pyre-ignore[16]
            merged[table] = old if same_layout(old, sharding) else sharding
        modules[path] = merged
    return ShardingPlan(modules)  # pyre-ignore[6]


def changed_tables(current: ShardingPlan, candidate: ShardingPlan) -> List[str]:
    """``path/table`` of every table whose sharding differs, sorted."""
    return sorted(
        f"{path}/{table}" if path else table
        for path, module_plan in candidate.plan.items()
        for table, sharding in module_plan.items()  # pyre-ignore[16]
        if current.plan[path][table] != sharding  # pyre-ignore[16]
    )


def needs_dense_rebuild(current: ShardingPlan, candidate: ShardingPlan) -> List[str]:
    """
    Tables whose change rebuilds a dense kernel or a data-parallel table, whose
    parameters a torch optimizer outside the module trains (it must be rebuilt
    over the new parameters after such a reshard).
    """
    dense = {ShardingType.DATA_PARALLEL.value}
    out = []
    for path, module_plan in candidate.plan.items():
        for table, new in module_plan.items():  # pyre-ignore[16]
            old = current.plan[path][table]  # pyre-ignore[16]
            if old == new:
                continue
            if (
                old.sharding_type in dense
                or new.sharding_type in dense
                or old.compute_kernel == "dense"
                or new.compute_kernel == "dense"
            ):
                out.append(f"{path}/{table}" if path else table)
    return sorted(out)

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
Model-level live resharding: move a ``DistributedModelParallel`` model to a
whole new ``ShardingPlan`` (as a planner produces it), and dry-run the delta
between two plans.
"""

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Mapping, Optional, Tuple, Type

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding.exchange import agree, Field
from torchrec.distributed.resharding.install import (
    EmbeddingBagCollectionAdapter,
    reshard_sharded_module,
    ReshardReport,
    ShardedModuleAdapter,
)
from torchrec.distributed.resharding.plan import (
    delta_digest,
    plan_transfers,
    ReshardError,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan

logger: logging.Logger = logging.getLogger(__name__)


def _adapter_types() -> Dict[Type[nn.Module], Type[ShardedModuleAdapter]]:
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    adapters: Dict[Type[nn.Module], Type[ShardedModuleAdapter]] = {
        ShardedEmbeddingBagCollection: EmbeddingBagCollectionAdapter
    }
    try:
        from torchrec.distributed.embedding import ShardedEmbeddingCollection
        from torchrec.distributed.resharding.install_ec import (
            EmbeddingCollectionAdapter,
        )

        adapters[ShardedEmbeddingCollection] = EmbeddingCollectionAdapter
    except ImportError:  # pragma: no cover - EC support not built in
        pass
    return adapters


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
    """

    deltas: Dict[str, Dict[str, ParameterSharding]]
    bytes_sent: Dict[int, int]
    bytes_received: Dict[int, int]

    @property
    def tables(self) -> Dict[str, List[str]]:
        return {path: sorted(delta) for path, delta in self.deltas.items()}


def _sharded_module(model: nn.Module, path: str) -> nn.Module:
    module = model.module.get_submodule(path) if path else model.module
    return module


def _adapter_for(module: nn.Module, path: str) -> ShardedModuleAdapter:
    for module_type, adapter_type in _adapter_types().items():
        if isinstance(module, module_type):
            return adapter_type(module)
    raise ReshardError(
        f"module '{path}' of type {type(module).__name__} cannot be resharded"
    )


def dry_run(model: nn.Module, new_plan: ShardingPlan) -> DryRunReport:
    """
    Computes the delta between ``model.plan`` and ``new_plan`` and the bytes each
    rank would send and receive (weights and fused optimizer state), without
    moving any data. Every rank must call it (one small collective per changed
    module shares what optimizer state the tables carry).

    Args:
        model (DistributedModelParallel): the sharded model.
        new_plan (ShardingPlan): the plan to move to.

    Returns:
        DryRunReport: the delta and the per-rank byte counts.
    """
    from torchrec.distributed.resharding.install import (
        _local_facts,
        _merge_facts,
        _old_layouts,
        _to_fields,
        validate_delta,
    )

    env: ShardingEnv = model._env
    pg = env.process_group
    world_size = dist.get_world_size(pg)
    deltas = plan_delta(model.plan, new_plan)
    sent = {r: 0 for r in range(world_size)}
    received = {r: 0 for r in range(world_size)}
    for path, delta in deltas.items():
        module = _sharded_module(model, path)
        error: Optional[str] = None
        layouts = {}
        try:
            _adapter_for(module, path)
            layouts = validate_delta(module, delta, env, model.device)
        except ReshardError as e:
            error = f"module '{path}': {e}"
        facts = _local_facts(module._lookups, list(delta)) if error is None else None
        merged = _merge_facts(agree(pg, delta_digest(delta), error, facts))
        plan = plan_transfers(_old_layouts(module, list(delta), world_size), layouts)
        fields: Mapping[str, List[Field]] = {
            t: _to_fields(merged.fields.get(t, [])) for t in delta
        }
        for transfer in plan.transfers:
            if transfer.is_local:
                continue
            nbytes = sum(
                f.numel(transfer) * torch.empty((), dtype=f.dtype).element_size()
                for f in fields[transfer.table]
            )
            sent[transfer.src_rank] += nbytes
            received[transfer.dst_rank] += nbytes
    return DryRunReport(deltas, sent, received)


def reshard_model(
    model: nn.Module,
    new_plan: ShardingPlan,
    max_inflight_bytes: Optional[int] = None,
    exchange_timeout: Optional[timedelta] = None,
    progress: bool = False,
) -> ModelReshardReport:
    """
    Moves every sharded module of ``model`` to its sharding in ``new_plan``, in
    place, and makes ``new_plan`` the model's plan. The model's combined fused
    optimizer (and any optimizer wrapping it) follows the moved state.

    Args:
        model (DistributedModelParallel): the sharded model.
        new_plan (ShardingPlan): a whole plan for the model (same modules and
            tables as ``model.plan``).
        max_inflight_bytes (Optional[int]): cap on the exchange buffers per rank.
        exchange_timeout (Optional[timedelta]): timeout of the exchange.
        progress (bool): show a progress bar on rank 0.

    Returns:
        ModelReshardReport: what this rank did.

    Raises:
        ReshardError: for a bad plan, on every rank, before any data moves.
        ReshardAbortedError: when an exchange fails; modules resharded before
            the failing one keep their new sharding, the others their old one,
            and ``model.plan`` says which.
    """
    start = time.perf_counter()
    env: ShardingEnv = model._env
    rank = dist.get_rank(env.process_group)
    deltas = plan_delta(model.plan, new_plan)
    report = ModelReshardReport(rank)
    items: List[Tuple[str, Dict[str, ParameterSharding]]] = list(deltas.items())
    iterator = items
    if progress and rank == 0:
        from tqdm import tqdm

        iterator = tqdm(items, desc="resharding modules", unit="module")
    for path, delta in iterator:
        module = _sharded_module(model, path)
        report.modules[path] = reshard_sharded_module(
            _adapter_for(module, path),
            delta,
            env,
            model.device,
            max_inflight_bytes,
            exchange_timeout,
            progress,
        )
        model.plan.plan[path].update(delta)
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

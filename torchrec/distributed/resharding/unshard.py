#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A sharded model to and from plain modules on one rank.

:func:`unshard_model` gathers every table of a sharded model onto one rank as
plain, unsharded ``EmbeddingBagCollection`` / ``EmbeddingCollection`` modules
(for inference or export); :func:`shard_from_rank` shards a model whose
weights only one rank holds (e.g. pretrained embeddings loaded there) onto the
group. Both are the move of ``elastic`` between a sharded model and whole
tables on one rank: one agreement, one exchange.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding.elastic import (
    broadcast_dense,
    build_model,
    defined_tables,
    dense_tensors,
    is_dense,
    model_facts,
    move_tables,
    MoveReport,
    plain_tables,
    plain_twin,
    plain_weight,
    release_model,
    sharded_modules,
    sharded_slots,
)
from torchrec.distributed.resharding.elastic_plan import (
    check_move_agreement,
    move_fields,
    move_transfers,
    plan_layouts,
    plan_text,
    request_digest,
    table_key,
    TableShape,
    validate_new_plan,
    whole_on,
)
from torchrec.distributed.resharding.exchange import (
    agree_among,
    close_exchange_group,
    Field,
    FieldKind,
    open_exchange_group_among,
)
from torchrec.distributed.resharding.install import adapter_for
from torchrec.distributed.resharding.kernel_state import LocalSlot, SlotKey
from torchrec.distributed.resharding.plan import Rect, ReshardAbortedError, ReshardError
from torchrec.distributed.resharding.transaction import ReshardOptions
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import data_type_to_dtype


@dataclass
class UnshardedModel:
    """
    A model's sharded modules as plain modules on one rank.

    Args:
        modules (Dict[str, nn.Module]): module path -> an unsharded
            ``EmbeddingBagCollection`` / ``EmbeddingCollection`` (on CPU)
            holding every weight.
        optimizer_state (Dict[str, Dict[str, Dict[str, torch.Tensor]]]): module
            path -> table -> fused optimizer state key -> the whole table's
            state (per element, or per row), when asked for.
    """

    modules: Dict[str, nn.Module]
    optimizer_state: Dict[str, Dict[str, Dict[str, torch.Tensor]]] = field(
        default_factory=dict
    )


def _plain_slots(
    modules: Mapping[str, nn.Module],
    fields: Mapping[str, Sequence[Field]],
    state: Optional[Dict[str, Dict[str, Dict[str, torch.Tensor]]]],
) -> Dict[SlotKey, LocalSlot]:
    """
    Whole tables of plain modules as slots: their weights and, when ``state``
    is given, tensors for every other field (filled in ``state``).
    """
    out: Dict[SlotKey, LocalSlot] = {}
    for path, module in modules.items():
        for name, rows, cols in plain_tables(module):
            key = table_key(path, name)
            tensors = {"weight": plain_weight(module, name).detach()}
            if state is not None:
                for f in fields.get(key, []):
                    if f.name == "weight":
                        continue
                    shape = {
                        FieldKind.RECT: (rows, cols),
                        FieldKind.ROWS: (rows,),
                        FieldKind.SCALAR: (1,),
                    }[f.kind]
                    tensor = torch.empty(shape, dtype=f.dtype)
                    state.setdefault(path, {}).setdefault(name, {})[f.name] = tensor
                    tensors[f.name] = tensor
            out[(key, Rect(0, 0, rows, cols))] = LocalSlot(
                key, Rect(0, 0, rows, cols), tensors
            )
    return out


def unshard_model(
    model: nn.Module,
    dst: int = 0,
    optimizer_state: bool = False,
    options: Optional[ReshardOptions] = None,
) -> Optional[UnshardedModel]:
    """
    Gathers every sharded module of a model onto one rank as plain, unsharded
    ``EmbeddingBagCollection`` / ``EmbeddingCollection`` modules holding every
    weight (for inference or export), by one exchange; the model is unchanged.
    Every rank of the model's group calls it.

    Args:
        model (DistributedModelParallel): the sharded model.
        dst (int): the group-local rank that gets the modules.
        optimizer_state (bool): also gather the fused optimizer state.
        options (Optional[ReshardOptions]): in-flight cap and timeout.

    Returns:
        Optional[UnshardedModel]: the modules on ``dst``, None elsewhere.

    Raises:
        ReshardError: on every rank, for a bad request.
        ReshardAbortedError: on every calling rank when a rank does not join in
            time or the exchange fails.
    """
    options = options or ReshardOptions()
    group_ranks = dist.get_process_group_ranks(model._env.process_group)
    me = dist.get_rank()
    error: Optional[str] = None
    if not 0 <= dst < len(group_ranks):
        error = f"rank {dst} is outside the model's group of {len(group_ranks)}"
    facts = model_facts(model, None)
    facts.new_ranks = group_ranks  # gathered within the model's own group
    agreement = agree_among(
        group_ranks,
        request_digest("unshard", str(dst), str(optimizer_state)),
        error,
        facts,
        options.exchange_timeout,
    )
    agreed = check_move_agreement(group_ranks, agreement.facts)
    fields = move_fields(agreed)
    if not optimizer_state:
        fields = {k: [f for f in v if f.name == "weight"] for k, v in fields.items()}
    target = group_ranks[dst]
    plan = move_transfers(
        plan_layouts(agreed.old_plan, agreed.tables, group_ranks),
        whole_on(agreed.tables, target),
        group_ranks,
    )
    modules: Dict[str, nn.Module] = {}
    state: Dict[str, Dict[str, Dict[str, torch.Tensor]]] = {}
    if me == target:
        for path, module in sharded_modules(model.module).items():
            modules[path] = plain_twin(module, torch.device("meta")).to_empty(
                device=torch.device("cpu")
            )
    report = MoveReport(me, "destination" if me == target else "source")
    group = open_exchange_group_among(
        group_ranks, agreement.transaction, options.exchange_timeout
    )
    try:
        move_tables(
            plan,
            fields,
            sharded_slots(model.module),
            _plain_slots(modules, fields, state if optimizer_state else None),
            group_ranks.index(me),
            group,
            options,
            report,
        )
        dist.barrier(group=group)
    except Exception as e:
        close_exchange_group(group)
        raise ReshardAbortedError(
            f"rank {me}: gathering the model failed ({type(e).__name__}: {e})"
        ) from e
    close_exchange_group(group)
    return UnshardedModel(modules, state) if me == target else None


def shard_from_rank(
    module: nn.Module,
    plan: ShardingPlan,
    env: ShardingEnv,
    src: int = 0,
    sharders: Optional[List[Any]] = None,
    device: Optional[torch.device] = None,
    options: Optional[ReshardOptions] = None,
) -> nn.Module:
    """
    Shards a model whose weights only one rank holds (e.g. pretrained
    embeddings loaded there) onto the group, by one exchange: ``src`` passes
    the model with its weights, every other rank its definition (meta device is
    enough) and never reads the weights. Every rank of ``env``'s group calls it.

    Args:
        module (nn.Module): the unsharded model (with weights on ``src``).
        plan (ShardingPlan): the plan on the group.
        env (ShardingEnv): the group's environment.
        src (int): the group-local rank that holds the weights.
        sharders (Optional[List[ModuleSharder]]): the sharders.
        device (Optional[torch.device]): the device (default: CPU).
        options (Optional[ReshardOptions]): in-flight cap and timeout.

    Returns:
        DistributedModelParallel: the sharded model, every table and dense
        tensor equal to ``src``'s, fused optimizer state fresh (zero).

    Raises:
        ReshardError: on every rank, for a bad request (plan, definitions).
        ReshardAbortedError: on every calling rank when a rank does not join in
            time or the exchange fails.
    """
    options = options or ReshardOptions()
    device = device or torch.device("cpu")
    group_ranks = dist.get_process_group_ranks(env.process_group)
    me = dist.get_rank()
    source = group_ranks[src] if 0 <= src < len(group_ranks) else -1
    error: Optional[str] = None
    defined: Optional[Dict[str, List[TableShape]]] = None
    dense: Optional[List[Tuple[str, Tuple[int, ...], str]]] = None
    try:
        if source < 0:
            raise ReshardError(f"rank {src} is outside the group of {len(group_ranks)}")
        defined = defined_tables(module, plan)
        validate_new_plan(plan, defined, len(group_ranks), device.type)
        if me == source:
            dense = [
                (n, tuple(t.shape), str(t.dtype))
                for n, t in _plain_dense(module, plan).items()
            ]
    except ReshardError as e:
        error = str(e)
    agreement = agree_among(
        group_ranks,
        request_digest("shard_from_rank", plan_text(plan), str(src)),
        error,
        (defined, dense),
        options.exchange_timeout,
    )
    tables = agreement.facts[group_ranks.index(source)][0]
    for rank, (other, _) in zip(group_ranks, agreement.facts):
        if other != tables:
            raise ReshardError(
                f"the model definition of rank {rank} has the tables {other}, "
                f"rank {source}'s {tables}"
            )
    dense_specs = agreement.facts[group_ranks.index(source)][1]
    plain = {p: module.get_submodule(p) for p in plan.plan} if me == source else {}
    source_dense = (
        {n: t.detach().clone() for n, t in _plain_dense(module, plan).items()}
        if me == source
        else None
    )
    error = None
    new_model: Optional[nn.Module] = None
    try:
        new_model = build_model(module, env, plan, sharders, device)
    except Exception as e:
        error = f"sharding the model failed: {type(e).__name__}: {e}"
    built = agree_among(
        group_ranks, request_digest("built"), error, None, options.exchange_timeout
    )
    assert new_model is not None
    fields = {
        table_key(path, name): [
            Field("weight", FieldKind.RECT, _weight_dtype(new_model, path, name))
        ]
        for path, shapes in tables.items()
        for name, _, _ in shapes
    }
    transfers = move_transfers(
        whole_on(tables, source), plan_layouts(plan, tables, group_ranks), group_ranks
    )
    report = MoveReport(me, "source" if me == source else "destination")
    group = open_exchange_group_among(
        group_ranks, built.transaction, options.exchange_timeout
    )
    try:
        move_tables(
            transfers,
            fields,
            _plain_slots(plain, fields, None),
            sharded_slots(new_model.module),
            group_ranks.index(me),
            group,
            options,
            report,
        )
        report.dense_bytes = broadcast_dense(
            dense_specs,
            source_dense,
            dense_tensors(new_model.module),
            group_ranks.index(source),
            group,
        )
        dist.barrier(group=group)
    except Exception as e:
        close_exchange_group(group)
        release_model(new_model)
        raise ReshardAbortedError(
            f"rank {me}: sharding from rank {src} failed ({type(e).__name__}: {e})"
        ) from e
    close_exchange_group(group)
    return new_model


def _plain_dense(module: nn.Module, plan: ShardingPlan) -> Dict[str, torch.Tensor]:
    """The parameters and buffers of an unsharded model outside planned modules."""
    paths = list(plan.plan)
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return dict(sorted((n, t) for n, t in tensors if is_dense(n, paths)))


def _weight_dtype(model: nn.Module, path: str, table: str) -> torch.dtype:
    """The dtype a table's weight travels in (every rank knows its config)."""
    adapter = adapter_for(sharded_modules(model.module)[path])
    config = adapter.module._table_name_to_config[table]
    return data_type_to_dtype(config.data_type)

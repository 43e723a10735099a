#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
State-dict level resharding: move the weights of the changed tables of a
sharded module's state dict to their new placements.

These two functions are the seed API. ``ShardedEmbeddingBagCollection.update_shards``
runs the same plan and exchange (``torchrec.distributed.resharding``) directly
on the module's lookups, together with the fused optimizer state.

``output_sharding_plan_delta_single`` and ``output_sharding_plans_delta`` give
the delta between two plans of a module (or of every module of a model), the
form ``update_shards`` and ``DistributedModelParallel.reshard`` take it in.
"""

import copy
from dataclasses import replace
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    TensorProperties,
)
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.resharding.exchange import execute_transfers
from torchrec.distributed.resharding.exchange_group import (
    ExchangeGroup,
    normalized_device,
)
from torchrec.distributed.resharding.fields import Field, FieldKind
from torchrec.distributed.resharding.plan import (
    layout_from_parameter_sharding,
    layout_from_shards_metadata,
    Rect,
    replicated_layout,
    ReshardError,
    ReshardPlan,
    TableLayout,
    Transfer,
)
from torchrec.distributed.resharding.transfer_plan import (
    plan_rank_transfers,
    plan_transfers,
)
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
)

StateValue = Union[ShardedTensor, torch.Tensor]


def _identity(name: str) -> str:
    return name


def _world_size(state_dict: Mapping[str, StateValue]) -> int:
    """
    The size of the module's process group, read from any sharded table of
    its state dict (replicated tables do not say).
    """
    for value in state_dict.values():
        if isinstance(value, ShardedTensor):
            return dist.get_world_size(value._process_group)
    raise ReshardError(
        "the state dict has no sharded table to tell the process group by: "
        "reshard the module itself (update_shards) instead"
    )


def _old_layout(value: StateValue, world_size: int) -> TableLayout:
    if isinstance(value, ShardedTensor):
        rows, cols = value.size()
        return layout_from_shards_metadata(value.metadata().shards_metadata, rows, cols)
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        rows, cols = value.shape
        return replicated_layout(rows, cols, world_size)
    raise ReshardError(
        f"cannot reshard a state-dict value of type {type(value).__name__} "
        "(expected a ShardedTensor or a replicated 2D tensor)"
    )


def _local_tensors(value: StateValue) -> Dict[Rect, torch.Tensor]:
    if isinstance(value, ShardedTensor):
        out = {}
        for shard in value.local_shards():
            out[Rect.from_shard_metadata(shard.metadata)] = shard.tensor
        return out
    rows, cols = value.shape
    return {Rect(0, 0, rows, cols): value}


def _dtype(value: StateValue) -> torch.dtype:
    if isinstance(value, ShardedTensor):
        return value.metadata().tensor_properties.dtype
    return value.dtype


def _weight_plan(
    state_dict: Mapping[str, StateValue],
    sharding_params: Mapping[str, ParameterSharding],
    extend_shard_name: Callable[[str], str],
    world_size: int,
) -> ReshardPlan:
    old: Dict[str, TableLayout] = {}
    new: Dict[str, TableLayout] = {}
    for name, ps in sharding_params.items():
        key = extend_shard_name(name)
        if key not in state_dict:
            raise ReshardError(f"table '{name}': '{key}' is not in the state dict")
        old[name] = _old_layout(state_dict[key], world_size)
        new[name] = layout_from_parameter_sharding(
            ps, old[name].rows, old[name].cols, world_size
        )
    return plan_transfers(old, new, list(sharding_params))


def _slice(tensor: torch.Tensor, rect: Rect) -> torch.Tensor:
    return tensor[rect.row : rect.row + rect.rows, rect.col : rect.col + rect.cols]


def shards_all_to_all(
    module: torch.nn.Module,
    state_dict: Dict[str, StateValue],
    device: torch.device,
    changed_sharding_params: Dict[str, ParameterSharding],
    env: ShardingEnv,
    extend_shard_name: Callable[[str], str] = _identity,
) -> Tuple[List[str], torch.Tensor]:
    """
    Sends the pieces of the changed tables' weights from their current owners to
    their new owners through the resharding executor on
    ``env.process_group`` (point-to-point messages between each pair of
    ranks). Pieces that stay on a rank are not sent.

    Args:
        module (torch.nn.Module): the sharded module (unused by the exchange;
            kept for API compatibility).
        state_dict (Dict[str, StateValue]): the module's state dict.
        device (torch.device): device of the exchange buffers.
        changed_sharding_params (Dict[str, ParameterSharding]): new sharding of
            each changed table.
        env (ShardingEnv): the sharding environment.
        extend_shard_name (Callable[[str], str]): table name -> state-dict key.

    Returns:
        Tuple[List[str], torch.Tensor]: the table name of every piece this rank
        received, by source rank then shard order, and the received data, flat
        (in the table dtype when all pieces share one, otherwise raw bytes).
    """
    pg = env.process_group
    assert pg is not None
    device = normalized_device(device)
    rank = dist.get_rank(pg)
    world_size = dist.get_world_size(pg)
    plan = _weight_plan(
        state_dict, changed_sharding_params, extend_shard_name, world_size
    )
    fields = {
        name: [
            Field("weight", FieldKind.RECT, _dtype(state_dict[extend_shard_name(name)]))
        ]
        for name in changed_sharding_params
    }
    sources = {
        name: _local_tensors(state_dict[extend_shard_name(name)])
        for name in changed_sharding_params
    }
    io = _ReceivedPieces(sources)
    rank_plan = plan_rank_transfers(plan.old_layouts, plan.new_layouts, rank)
    # local pieces are installed by update_state_dict_post_resharding
    rank_plan = replace(rank_plan, local_copies=())
    execute_transfers(
        rank_plan, fields, io, ExchangeGroup.over(pg, device=device), device=device
    )
    names = [t.table for t in rank_plan.receives]
    pieces = [io.received[t] for t in rank_plan.receives]
    return names, _concat(pieces, device)


class _ReceivedPieces:
    """The executor's IO (``exchange.PieceIO``) over a state dict's weights:
    pieces are read from the local shards and kept as they arrive."""

    def __init__(self, sources: Mapping[str, Mapping[Rect, torch.Tensor]]) -> None:
        self._sources = sources
        self.received: Dict[Transfer, torch.Tensor] = {}

    def resolve(self, t: Transfer, f: Field) -> torch.Tensor:
        return _slice(
            self._sources[t.table][t.src_rect], t.rect.relative_to(t.src_rect)
        )

    def target(self, t: Transfer, f: Field) -> Optional[torch.Tensor]:
        return None

    def commit(self, t: Transfer, f: Field, data: torch.Tensor) -> None:
        self.received[t] = data.clone()

    def kept(self, t: Transfer) -> bool:
        return False

    def finish(self) -> None:
        pass


def _concat(pieces: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not pieces:
        return torch.empty(0, device=device)
    if len({p.dtype for p in pieces}) == 1:
        return torch.cat([p.view(-1) for p in pieces])
    return torch.cat([p.view(-1).view(torch.uint8) for p in pieces])


def _take(
    output_tensor: torch.Tensor, offset: int, numel: int, dtype: torch.dtype
) -> Tuple[torch.Tensor, int]:
    if output_tensor.dtype == dtype:
        return output_tensor[offset : offset + numel], offset + numel
    nbytes = numel * dtype.itemsize
    return output_tensor[offset : offset + nbytes].view(dtype), offset + nbytes


def update_state_dict_post_resharding(
    state_dict: Dict[str, StateValue],
    shard_names_by_src_rank: List[str],
    output_tensor: torch.Tensor,
    new_sharding_params: Dict[str, ParameterSharding],
    curr_rank: int,
    extend_shard_name: Callable[[str], str] = _identity,
) -> Dict[str, StateValue]:
    """
    Installs the new placements and local shards of the changed tables into
    ``state_dict``, from the pieces this rank kept and the pieces
    :func:`shards_all_to_all` delivered.

    Args:
        state_dict (Dict[str, StateValue]): the state dict passed to
            :func:`shards_all_to_all` (its old shards are still in it).
        shard_names_by_src_rank (List[str]): first output of
            :func:`shards_all_to_all`.
        output_tensor (torch.Tensor): second output of :func:`shards_all_to_all`.
        new_sharding_params (Dict[str, ParameterSharding]): the same delta.
        curr_rank (int): this rank, group-local.
        extend_shard_name (Callable[[str], str]): table name -> state-dict key.

    Returns:
        Dict[str, StateValue]: ``state_dict``, with a new ShardedTensor (or a
        replicated tensor, for data parallel) for every changed table.
    """
    any_value = next(
        (state_dict[extend_shard_name(n)] for n in new_sharding_params), None
    )
    if any_value is None:
        return state_dict
    world_size = _world_size(state_dict)
    plan = _weight_plan(state_dict, new_sharding_params, extend_shard_name, world_size)
    receives = plan.receives(curr_rank)
    if [t.table for t in receives] != list(shard_names_by_src_rank):
        raise ReshardError(
            "the received shard names do not match the plan: expected "
            f"{[t.table for t in receives]}, got {list(shard_names_by_src_rank)}"
        )

    new_locals: Dict[str, Dict[Rect, torch.Tensor]] = {}
    for name in new_sharding_params:
        value = state_dict[extend_shard_name(name)]
        layout = plan.new_layouts[name]
        new_locals[name] = {
            s.rect: torch.empty(
                s.rect.rows,
                s.rect.cols,
                dtype=_dtype(value),
                device=_new_shard_device(value, output_tensor.device),
            )
            for s in layout.shards_on(curr_rank)
        }
    for t in plan.local_copies(curr_rank):
        src = _local_tensors(state_dict[extend_shard_name(t.table)])[t.src_rect]
        _slice(new_locals[t.table][t.dst_rect], t.rect.relative_to(t.dst_rect)).copy_(
            _slice(src, t.rect.relative_to(t.src_rect))
        )
    offset = 0
    for t in receives:
        dst = new_locals[t.table][t.dst_rect]
        data, offset = _take(output_tensor, offset, t.rect.numel, dst.dtype)
        _slice(dst, t.rect.relative_to(t.dst_rect)).copy_(
            data.view(t.rect.rows, t.rect.cols)
        )

    for name, ps in new_sharding_params.items():
        key = extend_shard_name(name)
        state_dict[key] = _as_state_value(
            state_dict[key], ps, plan.new_layouts[name], new_locals[name], curr_rank
        )
    return state_dict


def _new_shard_device(value: StateValue, received: torch.device) -> torch.device:
    """
    Where this rank's new shards of a table live: where its old ones do, or,
    on a rank that held none, where it received (this rank's device; never a
    placement of another rank's shard).
    """
    if isinstance(value, ShardedTensor):
        shards = value.local_shards()
        return shards[0].tensor.device if shards else received
    return value.device


def _as_state_value(
    old: StateValue,
    ps: ParameterSharding,
    layout: TableLayout,
    locals_by_rect: Dict[Rect, torch.Tensor],
    rank: int,
) -> StateValue:
    if layout.replicated:
        return next(iter(locals_by_rect.values()))
    spec = ps.sharding_spec
    assert isinstance(spec, EnumerableShardingSpec)
    properties = (
        old.metadata().tensor_properties
        if isinstance(old, ShardedTensor)
        else TensorProperties(dtype=old.dtype)
    )
    shards = [
        Shard(locals_by_rect[Rect.from_shard_metadata(m)], m)
        for m in spec.shards
        if m.placement is not None and m.placement.rank() == rank
    ]
    process_group: Optional[dist.ProcessGroup] = (
        old._process_group if isinstance(old, ShardedTensor) else None
    )
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards=shards,
        sharded_tensor_metadata=spec.build_metadata(
            torch.Size([layout.rows, layout.cols]), properties
        ),
        process_group=process_group,
    )


# --------------------------------------------------------------------- deltas


def _shard_keys(ps: ParameterSharding) -> List[Tuple[Any, ...]]:
    """Offsets, sizes and placement of every shard of a ParameterSharding."""
    spec = ps.sharding_spec
    if not isinstance(spec, EnumerableShardingSpec):
        return []
    return [
        (
            tuple(m.shard_offsets),
            tuple(m.shard_sizes),
            str(m.placement) if m.placement is not None else None,
        )
        for m in spec.shards
    ]


def _changed(old: ParameterSharding, new: ParameterSharding) -> bool:
    return (
        old.sharding_type != new.sharding_type
        or old.compute_kernel != new.compute_kernel
        or list(old.ranks or []) != list(new.ranks or [])
        or _shard_keys(old) != _shard_keys(new)
    )


# The data volume of a delta, as TorchRec's reshard API defines it: MiB of
# every shard of each changed table, at 4 bytes (fp32) per element.
_BYTES_PER_ELEMENT = 4
_MIB: int = 1024 * 1024


def _table_mib(ps: ParameterSharding) -> float:
    """MiB of every shard of a table's new sharding, at 4 bytes per element
    (0 for a sharding without shard metadata: data-parallel)."""
    elements = 0
    for _, sizes, _ in _shard_keys(ps):
        count = 1
        for size in sizes:
            count *= size
        elements += count
    return elements * _BYTES_PER_ELEMENT / _MIB


def output_sharding_plan_delta_single(
    old_plan: EmbeddingModuleShardingPlan,
    new_plan: EmbeddingModuleShardingPlan,
    return_data_volume: bool = False,
) -> Tuple[float, EmbeddingModuleShardingPlan]:
    """
    The delta between two plans of one module: a plan with (a copy of) the new
    ParameterSharding of every table whose sharding type, compute kernel,
    ranks or shards (offsets, sizes, placements) differ; the form
    ``update_shards`` and ``EmbeddingBagCollectionSharder.reshard`` take.

    Args:
        old_plan (EmbeddingModuleShardingPlan): the module's current plan.
        new_plan (EmbeddingModuleShardingPlan): its new plan, for the same tables.
        return_data_volume (bool): also compute the delta's data volume.

    Returns:
        Tuple[float, EmbeddingModuleShardingPlan]: the data volume as
        TorchRec's reshard API defines it (MiB of every shard of every table
        in the delta, 4 bytes per element whatever the table's data type; 0
        unless ``return_data_volume``) and the delta.

    Raises:
        ValueError: when the plans do not name the same tables.
    """
    if set(old_plan.keys()) != set(new_plan.keys()):
        raise ValueError(
            f"the plans name different tables: {sorted(old_plan.keys())} and "
            f"{sorted(new_plan.keys())}"
        )
    delta = EmbeddingModuleShardingPlan()
    volume = 0.0
    for table, new in new_plan.items():
        old = old_plan[table]
        if _changed(old, new):
            delta[table] = copy.deepcopy(new)
            if return_data_volume:
                volume += _table_mib(new)
    return volume, delta


def output_sharding_plans_delta(
    old_plan: Dict[str, EmbeddingModuleShardingPlan],
    new_plan: Dict[str, EmbeddingModuleShardingPlan],
    return_data_volume: bool = False,
) -> Dict[str, Tuple[float, EmbeddingModuleShardingPlan]]:
    """
    :func:`output_sharding_plan_delta_single` for every module of a model's
    plan (``ShardingPlan.plan``): the form ``DistributedModelParallel.reshard``
    takes. Every module is in it, also those whose delta is empty.

    Args:
        old_plan (Dict[str, EmbeddingModuleShardingPlan]): per module FQN, its
            current plan.
        new_plan (Dict[str, EmbeddingModuleShardingPlan]): per module FQN, its
            new plan (the same modules).
        return_data_volume (bool): also compute each delta's data volume.

    Returns:
        Dict[str, Tuple[float, EmbeddingModuleShardingPlan]]: per module FQN,
        its data volume and delta.

    Raises:
        ValueError: when the plans do not name the same modules or tables.
    """
    if set(old_plan.keys()) != set(new_plan.keys()):
        raise ValueError(
            f"the plans name different modules: {sorted(old_plan.keys())} and "
            f"{sorted(new_plan.keys())}"
        )
    deltas: Dict[str, Tuple[float, EmbeddingModuleShardingPlan]] = {}
    for fqn, plan in old_plan.items():
        deltas[fqn] = output_sharding_plan_delta_single(
            plan, new_plan[fqn], return_data_volume
        )
    return deltas

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
The module-surgery half of live resharding, for ``ShardedEmbeddingBagCollection``.

A reshard of an EBC runs in five steps:

1. **validate** the delta against the module (pure, see ``plan``), and **agree**
   with every other rank (one small collective) — nothing has moved yet;
2. **build** the sharding groups whose tables or placements change, detached
   from the module (lookups allocated once at their final size, not randomly
   initialised; on CPU the tables of a rebuilt group that the delta does not
   change keep their kernel's storage, see ``storage``); groups the delta does
   not touch keep their sharding, lookup and output dist objects;
3. **plan** the transfers between the old and the new rectangles of every
   table in the rebuilt groups;
4. **exchange**: pieces that stay on a rank are copied locally, the others go
   through ``all_to_all_single`` straight into the new lookups' weights and
   fused optimizer state;
5. **swap** the new groups into the module and rebuild what depends on them
   (output dists and permutation, input dists on the next forward, the
   combined fused optimizer, the state-dict views), then give the pages of
   departed tables back to the OS.

Until step 5 the module is untouched, so a failure anywhere before it leaves
the module exactly as it was.
"""

import contextlib
import copy
import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import (
    AbstractSet,
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
)

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
    BatchedFusedEmbedding,
    BatchedFusedEmbeddingBag,
)
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.resharding.exchange import (
    agree,
    exchange_pieces,
    Field,
    field_kind,
    RECT,
    ROWS,
)
from torchrec.distributed.resharding.plan import (
    delta_digest,
    describe_parameter_sharding,
    layout_from_parameter_sharding,
    MOVABLE_COMPUTE_KERNELS,
    MOVABLE_SHARDING_TYPES,
    plan_transfers,
    Rect,
    ReshardAbortedError,
    ReshardError,
    ReshardPlan,
    TableLayout,
    Transfer,
    validate_parameter_sharding,
)
from torchrec.distributed.resharding.storage import (
    building_lookups,
    KeptStorage,
    split_kept_tables,
    storage_reuse_supported,
)
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.distributed.utils import (
    add_params_from_parameter_sharding,
    convert_to_fbgemm_types,
)
from torchrec.optim.keyed import CombinedOptimizer

logger: logging.Logger = logging.getLogger(__name__)

WEIGHT = "weight"


@dataclass
class ReshardReport:
    """
    What one rank did in one reshard.

    Args:
        rank (int): group-local rank.
        tables_moved (List[str]): tables whose layout changed.
        tables_rebuilt (List[str]): tables whose lookup was rebuilt (moved
            tables plus tables sharing a rebuilt group).
        bytes_sent (int): bytes this rank sent to other ranks.
        bytes_received (int): bytes this rank received from other ranks.
        bytes_copied_locally (int): bytes of pieces that stayed on this rank.
        tables_kept_in_place (List[str]): tables of rebuilt groups that kept
            this rank's storage (nothing copied, see ``storage``).
        bytes_kept_in_place (int): bytes of those tables on this rank.
        bytes_released (int): bytes of departed tables given back to the OS.
        seconds (float): wall time of the reshard on this rank.
    """

    rank: int
    tables_moved: List[str] = field(default_factory=list)
    tables_rebuilt: List[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_locally: int = 0
    tables_kept_in_place: List[str] = field(default_factory=list)
    bytes_kept_in_place: int = 0
    bytes_released: int = 0
    seconds: float = 0.0


@dataclass
class LocalSlot:
    """
    One local shard of one table and the tensors that follow its rectangle.

    Args:
        table (str): table name.
        rect (Rect): the shard, in global coordinates.
        tensors (Dict[str, torch.Tensor]): "weight" and fused optimizer state,
            views into the lookup's storage (RECT tensors viewed as 2D).
    """

    table: str
    rect: Rect
    tensors: Dict[str, torch.Tensor]


def _unwrap(lookup: nn.Module) -> nn.Module:
    while isinstance(lookup, DistributedDataParallel):
        lookup = lookup.module
    return lookup


def _batched_modules(lookup: nn.Module) -> Iterator[nn.Module]:
    for module in _unwrap(lookup).modules():
        if isinstance(module, (BaseBatchedEmbedding, BaseBatchedEmbeddingBag)):
            yield module


def _shard_rect(table_config: Any) -> Rect:
    metadata = table_config.local_metadata
    if metadata is None:
        return Rect(0, 0, table_config.num_embeddings, table_config.embedding_dim)
    rows, cols = metadata.shard_sizes
    row, col = metadata.shard_offsets
    return Rect(row, col, rows, cols)


def local_slots(lookups: Sequence[nn.Module]) -> Dict[Tuple[str, Rect], LocalSlot]:
    """
    Args:
        lookups (Sequence[nn.Module]): lookups of a sharded EBC.

    Returns:
        Dict[Tuple[str, Rect], LocalSlot]: every local shard, keyed by table and
        rectangle.
    """
    slots: Dict[Tuple[str, Rect], LocalSlot] = {}
    for lookup in lookups:
        for batched in _batched_modules(lookup):
            tables = batched.config.embedding_tables
            weights = batched.split_embedding_weights()
            states: List[Mapping[str, torch.Tensor]] = [{} for _ in tables]
            if isinstance(batched, (BatchedFusedEmbedding, BatchedFusedEmbeddingBag)):
                # Stateless optimizers (SGD) report no entries at all.
                for i, state in enumerate(batched.emb_module.get_optimizer_state()):
                    states[i] = state or {}
            for table, weight, state in zip(tables, weights, states):
                rect = _shard_rect(table)
                tensors: Dict[str, torch.Tensor] = {WEIGHT: weight.detach()}
                for key, value in state.items():
                    if field_kind(value, rect.rows, rect.cols) == RECT:
                        value = value.view(rect.rows, rect.cols)
                    tensors[key] = value
                slots[(table.name, rect)] = LocalSlot(table.name, rect, tensors)
    return slots


def _fields_of(slot: LocalSlot) -> List[Tuple[str, str, str]]:
    return [
        (name, field_kind(t, slot.rect.rows, slot.rect.cols), str(t.dtype))
        for name, t in slot.tensors.items()
    ]


@dataclass
class _Facts:
    """What a rank tells the others before any data moves."""

    fields: Dict[str, List[Tuple[str, str, str]]]
    learning_rates: Dict[str, float]
    optimizer_iter: int


def _local_facts(lookups: Sequence[nn.Module], tables: Sequence[str]) -> _Facts:
    wanted = set(tables)
    fields: Dict[str, List[Tuple[str, str, str]]] = {}
    for (name, _), slot in local_slots(lookups).items():
        if name in wanted:
            fields.setdefault(name, _fields_of(slot))
    learning_rates: Dict[str, float] = {}
    optimizer_iter = 0
    for lookup in lookups:
        for batched in _batched_modules(lookup):
            if not isinstance(
                batched, (BatchedFusedEmbedding, BatchedFusedEmbeddingBag)
            ):
                continue
            lr = batched.emb_module.get_learning_rate()
            for table in batched.config.embedding_tables:
                learning_rates[table.name] = lr
            it = getattr(batched.emb_module, "iter", None)
            if isinstance(it, torch.Tensor):
                optimizer_iter = max(optimizer_iter, int(it.item()))
    return _Facts(fields, learning_rates, optimizer_iter)


def _merge_facts(all_facts: Sequence[_Facts]) -> _Facts:
    merged = _Facts({}, {}, 0)
    for facts in all_facts:
        for table, table_fields in facts.fields.items():
            merged.fields.setdefault(table, table_fields)
        for table, lr in facts.learning_rates.items():
            merged.learning_rates.setdefault(table, lr)
        merged.optimizer_iter = max(merged.optimizer_iter, facts.optimizer_iter)
    return merged


def _to_fields(described: Sequence[Tuple[str, str, str]]) -> List[Field]:
    return [
        Field(name, kind, getattr(torch, dtype.replace("torch.", "")))
        for name, kind, dtype in described
    ]


class ShardedModuleAdapter:
    """
    What the generic reshard needs to know about one kind of sharded embedding
    module; one subclass per module type (EBC here, EC in ``install_ec``).

    Args:
        module (nn.Module): the sharded module.
    """

    param_prefix: str = ""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def configs(self) -> Sequence[Any]:
        """The module's table configs, in module order."""
        raise NotImplementedError

    def groups(self) -> List[Tuple[str, Any, nn.Module, nn.Module]]:
        """(sharding type, sharding, lookup, output dist) of every group, in order."""
        raise NotImplementedError

    def create_sharding(
        self,
        infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device],
    ) -> Any:
        """A sharding object for one group of tables of one sharding type."""
        raise NotImplementedError

    def is_data_parallel(self, sharding: Any) -> bool:
        raise NotImplementedError

    def swap(
        self,
        groups: "_Groups",
        changed_sharding_params: Mapping[str, ParameterSharding],
    ) -> None:
        """Installs the new groups and rebuilds what depends on them."""
        raise NotImplementedError


def _table_shape(module: nn.Module, table: str) -> Tuple[int, int]:
    config = module._table_name_to_config[table]
    return config.num_embeddings, config.embedding_dim


def _device_type(module: nn.Module, device: Optional[torch.device]) -> str:
    device = device or module._device
    return device.type if device is not None else "cpu"


def validate_delta(
    module: nn.Module,
    changed_sharding_params: Mapping[str, ParameterSharding],
    env: ShardingEnv,
    device: Optional[torch.device],
) -> Dict[str, TableLayout]:
    """
    Checks a delta against a sharded EBC without touching it.

    Args:
        module (ShardedEmbeddingBagCollection): the module.
        changed_sharding_params (Mapping[str, ParameterSharding]): the delta.
        env (ShardingEnv): the module's sharding environment.
        device (Optional[torch.device]): the module's device.

    Returns:
        Dict[str, TableLayout]: the new layout of every table in the delta.

    Raises:
        ReshardError: naming the table and the reason.
    """
    if not isinstance(changed_sharding_params, Mapping):
        raise ReshardError(
            "changed_sharding_params must map table names to ParameterSharding, "
            f"got {type(changed_sharding_params).__name__}"
        )
    if type(env).__name__ == "ShardingEnv2D":
        raise ReshardError("resharding under ShardingEnv2D is not supported yet")
    world_size = dist.get_world_size(env.process_group)
    layouts: Dict[str, TableLayout] = {}
    for table, ps in changed_sharding_params.items():
        if table not in module._table_name_to_config:
            raise ReshardError(
                f"table '{table}' is not in this module (tables: "
                f"{', '.join(module._table_names)})"
            )
        old = module.module_sharding_plan[table]
        if old.sharding_type not in MOVABLE_SHARDING_TYPES:
            raise ReshardError(
                f"table '{table}': its current sharding type '{old.sharding_type}' "
                "cannot be resharded"
            )
        if old.compute_kernel not in MOVABLE_COMPUTE_KERNELS:
            raise ReshardError(
                f"table '{table}': its current compute kernel "
                f"'{old.compute_kernel}' cannot be resharded"
            )
        rows, cols = _table_shape(module, table)
        layouts[table] = validate_parameter_sharding(
            table, ps, rows, cols, world_size, _device_type(module, device)
        )
    return layouts


def _new_plan(
    module: nn.Module, changed_sharding_params: Mapping[str, ParameterSharding]
) -> Dict[str, ParameterSharding]:
    plan = dict(module.module_sharding_plan)
    plan.update(changed_sharding_params)
    return plan


def _infos_for_plan(
    adapter: ShardedModuleAdapter, new_plan: Mapping[str, ParameterSharding]
) -> "OrderedDict[str, List[EmbeddingShardingInfo]]":
    # Same grouping and order as the modules' __init__: sharding types in order
    # of their first table, tables in config order.
    module = adapter.module
    old_infos = {
        info.embedding_config.name: info
        for infos in module.sharding_type_to_sharding_infos.values()
        for info in infos
    }
    grouped: "OrderedDict[str, List[EmbeddingShardingInfo]]" = OrderedDict()
    for config in adapter.configs():
        old = old_infos[config.name]
        ps = new_plan[config.name]
        if ps is old.param_sharding:
            info = old
        else:
            fused_params = convert_to_fbgemm_types(
                add_params_from_parameter_sharding(copy.copy(old.fused_params), ps)
            )
            info = EmbeddingShardingInfo(
                embedding_config=copy.deepcopy(old.embedding_config),
                param_sharding=ps,
                param=old.param,
                fused_params=fused_params,
            )
        grouped.setdefault(ps.sharding_type, []).append(info)
    return grouped


def _group_signature(infos: Sequence[EmbeddingShardingInfo]) -> List[Tuple[str, str]]:
    return [
        (info.embedding_config.name, describe_parameter_sharding(info.param_sharding))
        for info in infos
    ]


@dataclass
class _Groups:
    """The sharding groups of the module after the reshard (not yet installed)."""

    infos: "OrderedDict[str, List[EmbeddingShardingInfo]]"
    shardings: List[Any]
    lookups: List[nn.Module]
    kept_output_dists: List[Optional[nn.Module]]
    rebuilt_types: List[str]
    new_lookups: List[nn.Module]


def _changed_types(
    module: nn.Module, new_infos: Mapping[str, Sequence[EmbeddingShardingInfo]]
) -> List[str]:
    old = {
        t: _group_signature(infos)
        for t, infos in module.sharding_type_to_sharding_infos.items()
    }
    return [
        t for t, infos in new_infos.items() if old.get(t) != _group_signature(infos)
    ]


def _wrap_data_parallel(
    lookup: nn.Module, env: ShardingEnv, device: Optional[torch.device]
) -> nn.Module:
    return DistributedDataParallel(
        module=lookup,
        device_ids=(
            [device] if device is not None and device.type in {"cuda", "mtia"} else None
        ),
        process_group=env.process_group,
        gradient_as_bucket_view=True,
        broadcast_buffers=True,
        static_graph=True,
    )


def _build_groups(
    adapter: ShardedModuleAdapter,
    new_infos: "OrderedDict[str, List[EmbeddingShardingInfo]]",
    changed_types: Sequence[str],
    env: ShardingEnv,
    device: Optional[torch.device],
    reuse: Optional[KeptStorage] = None,
) -> _Groups:
    current = {
        t: (sharding, lookup, dist_) for t, sharding, lookup, dist_ in adapter.groups()
    }
    groups = _Groups(new_infos, [], [], [], list(changed_types), [])
    for sharding_type, infos in new_infos.items():
        if sharding_type not in changed_types:
            sharding, lookup, output_dist = current[sharding_type]
            groups.shardings.append(sharding)
            groups.lookups.append(lookup)
            groups.kept_output_dists.append(output_dist)
            continue
        sharding = adapter.create_sharding(infos, env, device)
        with building_lookups(reuse):
            lookup = sharding.create_lookup()
        groups.shardings.append(sharding)
        groups.lookups.append(lookup)
        groups.kept_output_dists.append(None)
        groups.new_lookups.append(lookup)
    return groups


def _wrap_new_data_parallel_lookups(
    adapter: ShardedModuleAdapter,
    groups: _Groups,
    env: ShardingEnv,
    device: Optional[torch.device],
) -> None:
    # DDP's constructor is a collective: it runs only once every rank agreed.
    for i, sharding in enumerate(groups.shardings):
        lookup = groups.lookups[i]
        if adapter.is_data_parallel(sharding) and any(
            lookup is new for new in groups.new_lookups
        ):
            wrapped = _wrap_data_parallel(lookup, env, device)
            groups.lookups[i] = wrapped
            groups.new_lookups = [
                wrapped if new is lookup else new for new in groups.new_lookups
            ]


def _check_built_layouts(
    groups: _Groups, layouts: Mapping[str, TableLayout], rank: int
) -> None:
    """
    The rebuilt lookups must hold exactly the shards the new plan gives this
    rank; TorchRec's shardings impose rules of their own (e.g. row-wise puts
    the i-th shard on rank i), and a plan they cannot honour is refused here.
    """
    built: Dict[str, List[Rect]] = {}
    for table, rect in local_slots(groups.new_lookups):
        built.setdefault(table, []).append(rect)
    for table, layout in layouts.items():
        expected = sorted(s.rect for s in layout.shards_on(rank))
        if sorted(built.get(table, [])) != expected:
            raise ReshardError(
                f"table '{table}': TorchRec's sharding cannot place its shards as "
                f"requested (rank {rank} would hold {sorted(built.get(table, []))}, "
                f"the plan says {expected})"
            )


def _read_piece(slot: LocalSlot, transfer: Transfer, f: Field) -> torch.Tensor:
    tensor = slot.tensors[f.name]
    local = transfer.rect.relative_to(slot.rect)
    if f.kind == RECT:
        return tensor[
            local.row : local.row + local.rows, local.col : local.col + local.cols
        ]
    if f.kind == ROWS:
        return tensor[local.row : local.row + local.rows]
    return tensor.reshape(1)


class _RowwiseMerges:
    """
    Row-wise state of new shards assembled from narrower column pieces.

    Each row-wise value is a mean over its shard's columns, so a shard joined
    from column pieces gets the column-width-weighted mean of the pieces'
    values. It is accumulated exactly in float64 and rounded once at the end.
    """

    def __init__(self) -> None:
        self._sums: Dict[Tuple[str, Rect, str], torch.Tensor] = {}
        self._targets: Dict[Tuple[str, Rect, str], Tuple[torch.Tensor, int]] = {}

    def add(self, slot: LocalSlot, name: str, local: Rect, data: torch.Tensor) -> None:
        key = (slot.table, slot.rect, name)
        if key not in self._sums:
            target = slot.tensors[name]
            self._sums[key] = torch.zeros(
                target.numel(), dtype=torch.float64, device=target.device
            )
            self._targets[key] = (target, slot.rect.cols)
        rows = self._sums[key][local.row : local.row + local.rows]
        rows.add_(data.view(-1).to(torch.float64) * local.cols)

    def finish(self) -> None:
        for key, total in self._sums.items():
            target, cols = self._targets[key]
            target.copy_((total / cols).to(target.dtype))
        self._sums.clear()
        self._targets.clear()


def _write_piece(
    slot: LocalSlot,
    transfer: Transfer,
    f: Field,
    data: torch.Tensor,
    merges: _RowwiseMerges,
) -> None:
    tensor = slot.tensors.get(f.name)
    if tensor is None:
        return  # the new kernel keeps no such state (e.g. fused -> dense)
    local = transfer.rect.relative_to(slot.rect)
    if f.kind == RECT:
        target = tensor[
            local.row : local.row + local.rows, local.col : local.col + local.cols
        ]
        target.copy_(data.view(local.rows, local.cols))
    elif f.kind == ROWS:
        if local.cols == slot.rect.cols:
            tensor[local.row : local.row + local.rows].copy_(data.view(-1))
        else:
            merges.add(slot, f.name, local, data)
    else:
        tensor.view(-1).copy_(data.view(-1))


def _target_piece(
    slot: LocalSlot, transfer: Transfer, f: Field
) -> Optional[torch.Tensor]:
    """
    Where a received piece lands when ``_write_piece`` would only copy it (the
    exchange then receives straight into it); None when it does more (a
    row-wise merge) or the new kernel keeps no such state.
    """
    tensor = slot.tensors.get(f.name)
    if tensor is None or tensor.dtype != f.dtype:
        return None
    local = transfer.rect.relative_to(slot.rect)
    if f.kind == RECT:
        target = tensor[
            local.row : local.row + local.rows, local.col : local.col + local.cols
        ]
        return target if target.is_contiguous() else None
    if f.kind == ROWS:
        if local.cols != slot.rect.cols:
            return None
        return tensor[local.row : local.row + local.rows]
    return tensor.view(-1) if tensor.numel() == 1 else None


def _old_layouts(
    module: nn.Module, tables: Sequence[str], world_size: int
) -> Dict[str, TableLayout]:
    return {
        t: layout_from_parameter_sharding(
            module.module_sharding_plan[t], *_table_shape(module, t), world_size
        )
        for t in tables
    }


def _apply_optimizer_facts(new_lookups: Sequence[nn.Module], facts: _Facts) -> None:
    for lookup in new_lookups:
        for batched in _batched_modules(lookup):
            if not isinstance(
                batched, (BatchedFusedEmbedding, BatchedFusedEmbeddingBag)
            ):
                continue
            names = [t.name for t in batched.config.embedding_tables]
            lrs = [facts.learning_rates[n] for n in names if n in facts.learning_rates]
            if lrs:
                batched.emb_module.set_learning_rate(lrs[0])
                batched.fused_optimizer.param_groups[0]["lr"] = lrs[0]
            it = getattr(batched.emb_module, "iter", None)
            if isinstance(it, torch.Tensor):
                it.fill_(facts.optimizer_iter)


def rebuild_fused_optimizer(
    module: nn.Module, new_lookups: Sequence[nn.Module], param_prefix: str
) -> None:
    """
    Points the module's CombinedOptimizer at the fused optimizers of its current
    lookups, in place: a DistributedModelParallel or user-level optimizer that
    wraps it sees the new state without being rebuilt.

    Args:
        module (nn.Module): the sharded module (after the swap).
        new_lookups (Sequence[nn.Module]): the lookups built by the reshard.
        param_prefix (str): prefix of the module's parameter keys.

    Returns:
        None
    """
    from torchrec.optim.fused import FusedOptimizerModule

    fresh = {id(lookup) for lookup in new_lookups}
    optims: List[Tuple[str, Any]] = []
    for lookup in module._lookups:
        for _, tbe_module in _unwrap(lookup).named_modules():
            if not isinstance(tbe_module, FusedOptimizerModule):
                continue
            if id(lookup) in fresh:
                tbe_module.fused_optimizer.params = {
                    param_prefix + key: weight
                    for key, weight in tbe_module.fused_optimizer.params.items()
                }
            optims.append(("", tbe_module.fused_optimizer))
    combined = module._optim
    if isinstance(combined, CombinedOptimizer):
        combined._optims = optims
    else:
        module._optim = CombinedOptimizer(optims)


class EmbeddingBagCollectionAdapter(ShardedModuleAdapter):
    """Module surgery for ``ShardedEmbeddingBagCollection``."""

    param_prefix = "embedding_bags."

    def configs(self) -> Sequence[Any]:
        return self.module._embedding_bag_configs

    def groups(self) -> List[Tuple[str, Any, nn.Module, nn.Module]]:
        m = self.module
        return list(
            zip(m._sharding_types, m._embedding_shardings, m._lookups, m._output_dists)
        )

    def create_sharding(
        self,
        infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device],
    ) -> Any:
        from torchrec.distributed.embeddingbag import create_embedding_bag_sharding

        return create_embedding_bag_sharding(
            infos,
            env,
            device,
            permute_embeddings=True,
            qcomm_codecs_registry=self.module.qcomm_codecs_registry,
        )

    def is_data_parallel(self, sharding: Any) -> bool:
        return isinstance(sharding, DpPooledEmbeddingSharding)

    def _input_feature_names(self) -> Optional[List[str]]:
        """
        The feature order of the inputs the module has seen, recovered from its
        input dists' feature permutation; None when it cannot be (no forward
        yet, variable batch sizes, features the module does not use).
        """
        module = self.module
        if module._has_uninitialized_input_dist:
            return None
        if module._inverse_indices_permute_indices is not None:
            return None
        names = [n for s in module._embedding_shardings for n in s.feature_names()]
        if not module._has_features_permute:
            return names
        order = module._features_order
        recovered: List[Optional[str]] = [None] * (max(order) + 1 if order else 0)
        for name, index in zip(names, order):
            recovered[index] = name
        if any(name is None for name in recovered):
            return None
        return [name for name in recovered if name is not None]

    def _kept_input_dists(self, groups: "_Groups") -> List[Optional[nn.Module]]:
        module = self.module
        if module._has_uninitialized_input_dist:
            return [None] * len(groups.shardings)
        by_sharding = {
            id(s): d for s, d in zip(module._embedding_shardings, module._input_dists)
        }
        return [by_sharding.get(id(s)) for s in groups.shardings]

    def swap(
        self,
        groups: "_Groups",
        changed_sharding_params: Mapping[str, ParameterSharding],
    ) -> None:
        module = self.module
        input_feature_names = self._input_feature_names()
        kept_input_dists = self._kept_input_dists(groups)
        module._sharding_types = list(groups.infos.keys())
        module.sharding_type_to_sharding_infos = groups.infos
        module._embedding_shardings = groups.shardings
        module._lookups = groups.lookups
        for table, ps in changed_sharding_params.items():
            module.module_sharding_plan[table] = ps

        module._output_dists = groups.kept_output_dists
        module._update_output_dist()

        module._input_dists = []
        module._feature_splits = []
        module._features_order = []
        module._has_uninitialized_input_dist = True
        module._has_features_permute = True
        module._inverse_indices_permute_indices = None
        module._kjt_key_indices = {}
        module._kjt_inverse_order = None
        module._kt_key_ordering = None
        rs_features: Dict[str, List[str]] = {}
        for config in module._embedding_bag_configs:
            if module.module_sharding_plan[config.name].sharding_type in (
                ShardingType.TABLE_ROW_WISE.value,
                ShardingType.ROW_WISE.value,
            ):
                rs_features.setdefault(config.pooling.value, []).extend(
                    config.feature_names
                )
        module._pooling_type_to_rs_features = rs_features
        module._has_mean_pooling_callback = "MEAN" in rs_features
        if input_feature_names is not None and not module._has_mean_pooling_callback:
            # Untouched groups keep their input dists; the others get new ones
            # now. Otherwise everything is rebuilt on the next forward.
            module._create_input_dist(input_feature_names, kept_input_dists)
            module._has_uninitialized_input_dist = False

        rebuild_fused_optimizer(module, groups.new_lookups, self.param_prefix)
        module._initialize_torch_state(skip_registering=True)


def _reshard_generation(module: nn.Module) -> int:
    """How many reshards the module went through (the same on every rank)."""
    return int(getattr(module, "_reshard_generation", 0))


def _keep_storage_of_kept_tables(
    adapter: ShardedModuleAdapter,
    new_infos: Mapping[str, List[EmbeddingShardingInfo]],
    changed_types: Sequence[str],
    changed_sharding_params: Mapping[str, ParameterSharding],
) -> KeptStorage:
    """
    Splits the rebuilt groups into kernels of kept and of changed tables (in
    ``new_infos``) and returns where the kept ones find their old storage.
    """
    module = adapter.module
    split_kept_tables(
        new_infos,
        changed_types,
        set(changed_sharding_params),
        _reshard_generation(module) + 1,
    )
    old_kernels = [
        batched
        for sharding_type, _, lookup, _ in adapter.groups()
        if sharding_type in changed_types
        for batched in _batched_modules(lookup)
    ]
    kept_tables = {
        info.embedding_config.name
        for sharding_type in changed_types
        for info in new_infos[sharding_type]
    } - set(changed_sharding_params)
    return KeptStorage(old_kernels, kept_tables)


def _planned_tables(
    adapter: ShardedModuleAdapter,
    new_infos: Mapping[str, Sequence[EmbeddingShardingInfo]],
    changed_types: Sequence[str],
) -> List[str]:
    """Every table of a rebuilt group, in config order; all must be movable."""
    module = adapter.module
    rebuilt = {
        info.embedding_config.name for t in changed_types for info in new_infos[t]
    }
    tables = [c.name for c in adapter.configs() if c.name in rebuilt]
    for table in tables:
        kernel = module.module_sharding_plan[table].compute_kernel
        if kernel not in MOVABLE_COMPUTE_KERNELS:
            raise ReshardError(
                f"table '{table}': shares a rebuilt group but its compute kernel "
                f"'{kernel}' cannot be resharded"
            )
    return tables


# Called with every piece this rank sends; tests use it to inject faults.
_exchange_fault_hook: Optional[Callable[[Transfer], None]] = None


# Dedicated exchange groups, by (id of the module's group, timeout), with a
# weak reference to the module's group: an entry whose group is gone (its id
# reused by a new group) is stale, and holding the group itself would keep it
# alive past destroy_process_group.
_exchange_groups: Dict[
    Tuple[int, Optional[timedelta]],
    Tuple["weakref.ref[dist.ProcessGroup]", dist.ProcessGroup],
] = {}


def _exchange_group(
    pg: dist.ProcessGroup, timeout: Optional[timedelta]
) -> dist.ProcessGroup:
    """
    The group the shards travel on: a dedicated copy of the module's group, so
    that a failed exchange never leaves stray messages on the group training
    uses. Created on first use (a collective over the same ranks) and kept.
    Only a group that spans the whole job can be copied this way; a subgroup's
    exchange runs on the subgroup itself.

    Args:
        pg (dist.ProcessGroup): the module's process group.
        timeout (Optional[timedelta]): timeout of the exchange's collectives.

    Returns:
        dist.ProcessGroup: the group to exchange on.
    """
    key = (id(pg), timeout)
    if key in _exchange_groups:
        owner, group = _exchange_groups[key]
        if owner() is pg:
            return group
        del _exchange_groups[key]  # stale: made for a group that is gone
    if dist.get_world_size(pg) != dist.get_world_size():
        return pg
    kwargs: Dict[str, Any] = {"backend": dist.get_backend(pg)}
    if timeout is not None:
        kwargs["timeout"] = timeout
    group = dist.new_group(ranks=list(range(dist.get_world_size())), **kwargs)
    _exchange_groups[key] = (weakref.ref(pg), group)
    return group


def _abandon_exchange_group(group: dist.ProcessGroup, pg: dist.ProcessGroup) -> None:
    # Closing the group wakes peers still blocked in it with an error instead
    # of letting them wait for their timeout; the next reshard makes a new one.
    for key, (_, cached) in list(_exchange_groups.items()):
        if cached is group:
            del _exchange_groups[key]
    if group is pg:
        return
    with contextlib.suppress(Exception):
        dist.destroy_process_group(group)


def _zero_undelivered_state(
    new_slots: Mapping[Tuple[str, Rect], LocalSlot],
    fields: Mapping[str, Sequence[Field]],
    in_place: AbstractSet[Tuple[str, Rect]],
) -> None:
    # State no piece carries (e.g. a dense or data-parallel table turning
    # fused) starts from zero, as in a freshly built kernel. Slots kept in
    # place are live state of the module and never touched.
    for key, slot in new_slots.items():
        if key in in_place:
            continue
        delivered = {f.name for f in fields.get(slot.table, [])}
        for name, tensor in slot.tensors.items():
            if name not in delivered:
                tensor.zero_()


def _kept_in_place(
    old_slots: Mapping[Tuple[str, Rect], LocalSlot],
    new_slots: Mapping[Tuple[str, Rect], LocalSlot],
) -> List[Tuple[str, Rect]]:
    """Slots whose new kernel took over the old storage (same memory)."""
    kept = []
    for key, new in new_slots.items():
        old = old_slots.get(key)
        if old is not None and all(
            name in old.tensors
            and tensor.data_ptr() == old.tensors[name].data_ptr()
            and tensor.shape == old.tensors[name].shape
            for name, tensor in new.tensors.items()
        ):
            kept.append(key)
    return kept


def _progress_bar(enabled: bool) -> Optional[Callable[[int, int], None]]:
    """A tqdm bar over the exchange rounds, created on the first round."""
    if not enabled:
        return None
    from tqdm import tqdm

    bar: List[Any] = []

    def on_round(done: int, total: int) -> None:
        if not bar:
            bar.append(tqdm(total=total, desc="resharding", unit="round"))
        bar[0].update(1)
        if done == total:
            bar[0].close()

    return on_round


def _fill_new_groups(
    module: nn.Module,
    groups: _Groups,
    plan: ReshardPlan,
    fields: Mapping[str, Sequence[Field]],
    rank: int,
    world_size: int,
    exchange_group: dist.ProcessGroup,
    device: Optional[torch.device],
    max_inflight_bytes: Optional[int],
    report: ReshardReport,
    progress: bool = False,
) -> None:
    """Copies the local pieces and receives the remote ones into the new groups."""
    old_slots = local_slots(module._lookups)
    new_slots = local_slots(groups.new_lookups)
    in_place = set(_kept_in_place(old_slots, new_slots))
    for table, rect in in_place:
        report.tables_kept_in_place.append(table)
        report.bytes_kept_in_place += sum(
            t.numel() * t.element_size()
            for t in new_slots[(table, rect)].tensors.values()
        )
    merges = _RowwiseMerges()
    with torch.no_grad():
        _zero_undelivered_state(new_slots, fields, in_place)

    def read_piece(t: Transfer, f: Field) -> torch.Tensor:
        if _exchange_fault_hook is not None:
            _exchange_fault_hook(t)
        return _read_piece(old_slots[(t.table, t.src_rect)], t, f)

    with torch.no_grad():
        for transfer in plan.local_copies(rank):
            if (transfer.table, transfer.dst_rect) in in_place:
                continue  # the new kernel already holds it: same memory
            src = old_slots[(transfer.table, transfer.src_rect)]
            dst = new_slots[(transfer.table, transfer.dst_rect)]
            for f in fields[transfer.table]:
                piece = _read_piece(src, transfer, f)
                _write_piece(dst, transfer, f, piece, merges)
                report.bytes_copied_locally += piece.numel() * piece.element_size()
        report.bytes_sent, report.bytes_received = exchange_pieces(
            plan,
            fields,
            rank,
            world_size,
            exchange_group,
            read_piece=read_piece,
            write_piece=lambda t, f, data: _write_piece(
                new_slots[(t.table, t.dst_rect)], t, f, data, merges
            ),
            device=device if device is not None else torch.device("cpu"),
            max_inflight_bytes=max_inflight_bytes,
            target_piece=lambda t, f: _target_piece(
                new_slots[(t.table, t.dst_rect)], t, f
            ),
            on_round=_progress_bar(progress and rank == 0),
        )
        merges.finish()


def reshard_embedding_bag_collection(
    module: nn.Module,
    changed_sharding_params: Mapping[str, ParameterSharding],
    env: ShardingEnv,
    device: Optional[torch.device] = None,
    max_inflight_bytes: Optional[int] = None,
    exchange_timeout: Optional[timedelta] = None,
) -> ReshardReport:
    """
    Reshards a ``ShardedEmbeddingBagCollection`` in place (see
    :func:`reshard_sharded_module`).

    Args:
        module (ShardedEmbeddingBagCollection): the module.
        changed_sharding_params (Mapping[str, ParameterSharding]): the delta.
        env (ShardingEnv): the module's sharding environment.
        device (Optional[torch.device]): the module's device.
        max_inflight_bytes (Optional[int]): cap on the exchange buffers per rank.
        exchange_timeout (Optional[timedelta]): timeout of the exchange's
            collectives (default: the process group's).

    Returns:
        ReshardReport: what this rank did.
    """
    return reshard_sharded_module(
        EmbeddingBagCollectionAdapter(module),
        changed_sharding_params,
        env,
        device,
        max_inflight_bytes,
        exchange_timeout,
    )


def reshard_sharded_module(
    adapter: ShardedModuleAdapter,
    changed_sharding_params: Mapping[str, ParameterSharding],
    env: ShardingEnv,
    device: Optional[torch.device] = None,
    max_inflight_bytes: Optional[int] = None,
    exchange_timeout: Optional[timedelta] = None,
    progress: bool = False,
) -> ReshardReport:
    """
    Reshards a sharded embedding module in place.

    Args:
        adapter (ShardedModuleAdapter): the module, seen through its adapter.
        changed_sharding_params (Mapping[str, ParameterSharding]): the new
            ParameterSharding of each table that changes; the same on every rank.
        env (ShardingEnv): the module's sharding environment.
        device (Optional[torch.device]): the module's device (default: its own).
        max_inflight_bytes (Optional[int]): cap on the exchange buffers per rank;
            the exchange runs in as many rounds as the cap needs.
        exchange_timeout (Optional[timedelta]): timeout of the exchange's
            collectives (default: the process group's).
        progress (bool): show a progress bar over the exchange rounds on rank 0.

    Returns:
        ReshardReport: what this rank did.

    Raises:
        ReshardError: on every rank, before any data moves, for a bad request.
        ReshardAbortedError: on every surviving rank when the exchange fails;
            the module keeps its old sharding and state (old and new shards of
            the rebuilt groups coexist until every rank has its new ones).
    """
    start = time.perf_counter()
    module = adapter.module
    pg = env.process_group
    assert pg is not None, "resharding needs the module's process group"
    rank = dist.get_rank(pg)
    world_size = dist.get_world_size(pg)
    device = device or module._device
    report = ReshardReport(rank)

    error: Optional[str] = None
    reuse: Optional[KeptStorage] = None
    changed_types: List[str] = []
    planned_tables: List[str] = []
    groups: Optional[_Groups] = None
    layouts_after: Dict[str, TableLayout] = {}
    try:
        new_layouts = validate_delta(module, changed_sharding_params, env, device)
        new_plan = _new_plan(module, changed_sharding_params)
        new_infos = _infos_for_plan(adapter, new_plan)
        changed_types = _changed_types(module, new_infos)
        planned_tables = _planned_tables(adapter, new_infos, changed_types)
        layouts_after = {
            t: new_layouts.get(t)
            or layout_from_parameter_sharding(
                new_plan[t], *_table_shape(module, t), world_size
            )
            for t in planned_tables
        }
        if changed_types and storage_reuse_supported(device):
            reuse = _keep_storage_of_kept_tables(
                adapter, new_infos, changed_types, changed_sharding_params
            )
        if changed_types:
            groups = _build_groups(
                adapter, new_infos, changed_types, env, device, reuse
            )
            _check_built_layouts(groups, layouts_after, rank)
    except ReshardError as e:
        error = str(e)
    except Exception as e:  # the base refusing a layout, out of memory, ...
        error = f"building the new sharding failed: {type(e).__name__}: {e}"
    facts = _local_facts(module._lookups, planned_tables) if error is None else None
    all_facts = agree(pg, delta_digest(changed_sharding_params), error, facts)
    if groups is None:
        report.seconds = time.perf_counter() - start
        return report
    merged = _merge_facts(all_facts)
    _wrap_new_data_parallel_lookups(adapter, groups, env, device)

    old_layouts = _old_layouts(module, planned_tables, world_size)
    plan = plan_transfers(old_layouts, layouts_after, planned_tables)
    fields = {t: _to_fields(merged.fields.get(t, [])) for t in planned_tables}

    _apply_optimizer_facts(groups.new_lookups, merged)
    exchange_group = _exchange_group(pg, exchange_timeout)
    try:
        _fill_new_groups(
            module,
            groups,
            plan,
            fields,
            rank,
            world_size,
            exchange_group,
            device,
            max_inflight_bytes,
            report,
            progress,
        )
        # Nobody swaps before everybody filled its new shards.
        dist.barrier(group=exchange_group)
    except Exception as e:
        _abandon_exchange_group(exchange_group, pg)
        raise ReshardAbortedError(
            f"rank {rank}: the shard exchange failed ({type(e).__name__}: {e}); "
            "the module is unchanged and keeps its old sharding"
        ) from e

    adapter.swap(groups, changed_sharding_params)
    module._reshard_generation = _reshard_generation(module) + 1
    if reuse is not None:
        report.bytes_released = reuse.release_departed_pages()
    report.tables_moved = [
        t for t in planned_tables if old_layouts[t] != layouts_after[t]
    ]
    report.tables_rebuilt = list(planned_tables)
    report.seconds = time.perf_counter() - start
    logger.info(
        "reshard rank %d: moved %s, rebuilt %d tables, sent %d B, received %d B, "
        "copied locally %d B, kept in place %d B, released %d B in %.3f s",
        rank,
        report.tables_moved,
        len(report.tables_rebuilt),
        report.bytes_sent,
        report.bytes_received,
        report.bytes_copied_locally,
        report.bytes_kept_in_place,
        report.bytes_released,
        report.seconds,
    )
    return report

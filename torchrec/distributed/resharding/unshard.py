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
group. Both are transactions of the runner (``runner``) between a sharded
model and whole tables on one rank, numbered in the group's ranks.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding.device_memory import Placement, TablePlacement
from torchrec.distributed.resharding.elastic_plan import (
    AgreedMove,
    check_movable_kernels,
    check_move_agreement,
    dense_specs,
    DenseSpec,
    MoveFacts,
    plan_placements,
    tables_digest,
    validate_new_plan,
    whole_on,
)
from torchrec.distributed.resharding.exchange import broadcast_dense
from torchrec.distributed.resharding.exchange_group import (
    ExchangeGroup,
    normalized_device,
)
from torchrec.distributed.resharding.fields import Field, FieldKind, TableKey, WEIGHT
from torchrec.distributed.resharding.kernel_state import invalidate_caches
from torchrec.distributed.resharding.model_build import (
    build_model,
    meta_definition,
    plain_twin,
    release_model,
)
from torchrec.distributed.resharding.model_view import (
    defined_tables,
    dense_tensors,
    is_dense,
    model_env,
    model_facts,
    plain_tables,
    plain_weight,
    plain_weight_dtypes,
    sharded_lookups,
    sharded_modules,
    sharded_slots,
)
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import Rect, ReshardError
from torchrec.distributed.resharding.plan_validation import sharding_plan_text
from torchrec.distributed.resharding.runner import (
    described,
    Participant,
    run_transaction,
    Slots,
    TransactionLayouts,
)
from torchrec.distributed.resharding.slots import LocalSlot, SlotKey
from torchrec.distributed.resharding.storage import KeptStorage
from torchrec.distributed.resharding.transaction_report import TransactionReport
from torchrec.distributed.resharding.whole_plan import plan_layouts, TableShape
from torchrec.distributed.types import ShardingEnv, ShardingPlan

# module path -> table -> fused optimizer state key -> the whole table's state
OptimizerState = Dict[str, Dict[str, Dict[str, torch.Tensor]]]


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
        report (Optional[TransactionReport]): what this rank did.
    """

    modules: Dict[str, nn.Module]
    optimizer_state: OptimizerState = field(default_factory=dict)
    report: Optional[TransactionReport] = None


def _plain_slots(
    modules: Mapping[str, nn.Module],
    fields: Mapping[str, Sequence[Field]],
    state: Optional[OptimizerState],
) -> Dict[SlotKey, LocalSlot]:
    """
    Whole tables of plain modules as slots: their weights and, when ``state``
    is given, tensors for every other field (filled in ``state``).
    """
    out: Dict[SlotKey, LocalSlot] = {}
    for path, module in modules.items():
        for name, rows, cols in plain_tables(module):
            key = TableKey(path, name)
            whole = Rect(0, 0, rows, cols)
            tensors = {WEIGHT: plain_weight(module, name).detach()}
            kinds = {WEIGHT: FieldKind.RECT}
            if state is not None:
                for f in fields.get(key, ()):
                    if f.name == WEIGHT:
                        continue
                    tensor = torch.empty(f.shape(rows, cols), dtype=f.dtype)
                    state.setdefault(path, {}).setdefault(name, {})[f.name] = tensor
                    tensors[f.name] = tensor
                    kinds[f.name] = f.kind
            out[(key, whole)] = LocalSlot(key, whole, tensors, kinds)
    return out


class Unshard(Participant[MoveFacts, AgreedMove]):
    """This rank's part of :func:`unshard_model` (see it for the arguments)."""

    kind = "unshard"

    def __init__(self, model: nn.Module, dst: int, optimizer_state: bool) -> None:
        self._model = model
        self._dst = dst
        self._with_state = optimizer_state
        self._ranks: List[int] = dist.get_process_group_ranks(model._env.process_group)
        self._me: int = dist.get_rank()
        self._fields: Dict[str, Tuple[Field, ...]] = {}
        self._modules: Dict[str, nn.Module] = {}
        self._state: OptimizerState = {}
        self.role: str = "destination" if self._is_destination() else "source"

    def ranks(self) -> List[int]:
        return self._ranks

    def request(self) -> List[str]:
        return [str(self._dst), str(self._with_state)]

    def _is_destination(self) -> bool:
        return self._ranks.index(self._me) == self._dst

    def prepare(self) -> MoveFacts:
        if not isinstance(self._dst, int) or not 0 <= self._dst < len(self._ranks):
            raise ReshardError(
                f"rank {self._dst} is outside the model's group of {len(self._ranks)}"
            )
        check_movable_kernels(self._model.plan)
        facts = model_facts(self._model)
        facts.new_group = facts.old_group
        if facts.old_ranks is not None:
            facts.new_ranks = facts.old_ranks
        return facts

    def merge(self, facts: Sequence[MoveFacts]) -> AgreedMove:
        return check_move_agreement(self._ranks, facts)

    def agreed(self, merged: AgreedMove) -> TransactionLayouts:
        fields = merged.fields()
        if not self._with_state:
            fields = {
                k: tuple(f for f in v if f.name == WEIGHT) for k, v in fields.items()
            }
        self._fields = fields
        positions = list(range(len(self._ranks)))
        new = whole_on(merged.tables, self._dst)
        return TransactionLayouts(
            plan_layouts(merged.old_plan, merged.tables, positions),
            new,
            fields,
            # the destination builds plain modules on the host
            placements={key: TablePlacement(Placement.HOST) for key in new},
        )

    def build(self) -> None:
        if not self._is_destination():
            return
        for path, module in sharded_modules(self._model.module).items():
            self._modules[path] = plain_twin(module, torch.device("meta")).to_empty(
                device=torch.device("cpu")
            )

    def slots(self) -> Tuple[Slots, Slots]:
        state = self._state if self._with_state else None
        new_slots = _plain_slots(self._modules, self._fields, state)
        return sharded_slots(self._model.module), new_slots

    def commit(self) -> int:
        return 0

    def abort(self) -> None:
        self._modules = {}
        self._state = {}

    def device(self) -> torch.device:
        return normalized_device(self._model.device)

    def unchanged(self) -> str:
        return "the model is unchanged"

    def exchange_groups_owner(self) -> Optional[ShardingEnv]:
        return model_env(self._model)

    def stages_on_host(self) -> bool:
        # the destination builds plain modules on the host
        return self.device().type == "cuda"

    def result(self, report: TransactionReport) -> Optional[UnshardedModel]:
        if not self._is_destination():
            return None
        return UnshardedModel(self._modules, self._state, report)


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
    participant = Unshard(model, dst, optimizer_state)
    return participant.result(run_transaction(participant, options))


def _plain_dense(module: nn.Module, plan: ShardingPlan) -> Dict[str, torch.Tensor]:
    """The parameters and buffers of an unsharded model outside planned modules."""
    paths = list(plan.plan)
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return dict(sorted((n, t) for n, t in tensors if is_dense(n, paths)))


@dataclass(frozen=True)
class _SourceFacts:
    """What a rank of :func:`shard_from_rank` states."""

    defined: int
    defined_text: str
    tables: Optional[Dict[str, List[TableShape]]] = None
    dense: Optional[List[DenseSpec]] = None


@dataclass(frozen=True)
class _Sources:
    tables: Dict[str, List[TableShape]]
    dense: List[DenseSpec]


class ShardFromRank(Participant[_SourceFacts, _Sources]):
    """This rank's part of :func:`shard_from_rank` (see it for the arguments)."""

    kind = "shard_from_rank"

    def __init__(
        self,
        module: nn.Module,
        plan: ShardingPlan,
        env: ShardingEnv,
        src: int,
        sharders: Optional[List[Any]],
        device: torch.device,
    ) -> None:
        self._module = module
        self._plan = plan
        self._env = env
        self._src = src
        self._sharders = sharders
        self._device: torch.device = normalized_device(device)
        self._ranks: List[int] = dist.get_process_group_ranks(env.process_group)
        self._me: int = dist.get_rank()
        self._index: int = self._ranks.index(self._me)
        self._agreed: Optional[_Sources] = None
        self._fields: Dict[str, Tuple[Field, ...]] = {}
        self._new_model: Optional[nn.Module] = None
        self._plain: Dict[str, nn.Module] = {}
        self._source_dense: Optional[Dict[str, torch.Tensor]] = None
        self.role: str = "source" if self._index == src else "destination"

    def ranks(self) -> List[int]:
        return self._ranks

    def request(self) -> List[str]:
        # every rank exchanges on a device of the same type
        return [
            described(sharding_plan_text, self._plan),
            str(self._src),
            self._device.type,
        ]

    def prepare(self) -> _SourceFacts:
        if not isinstance(self._src, int) or not 0 <= self._src < len(self._ranks):
            raise ReshardError(
                f"rank {self._src} is outside the group of {len(self._ranks)}"
            )
        defined = defined_tables(self._module, self._plan)
        validate_new_plan(
            self._plan,
            defined,
            len(self._ranks),
            self._device.type,
            self._index,
            self._device.index,
        )
        if self._index != self._src:
            return _SourceFacts(tables_digest(defined), repr(defined))
        dense = dense_specs(_plain_dense(self._module, self._plan))
        return _SourceFacts(tables_digest(defined), repr(defined), defined, dense)

    def merge(self, facts: Sequence[_SourceFacts]) -> _Sources:
        source = facts[self._src]
        assert source.tables is not None and source.dense is not None
        for rank, other in zip(self._ranks, facts):
            if other.defined != source.defined:
                raise ReshardError(
                    f"the model definition of rank {rank} has the tables "
                    f"{other.defined_text}, rank {self._ranks[self._src]}'s "
                    f"{source.tables}"
                )
        return _Sources(source.tables, source.dense)

    def agreed(self, merged: _Sources) -> TransactionLayouts:
        self._agreed = merged
        self._fields = {
            TableKey(path, name): (Field(WEIGHT, FieldKind.RECT, dtype),)
            for path, name, dtype in plain_weight_dtypes(self._module, merged.tables)
        }
        positions = list(range(len(self._ranks)))
        return TransactionLayouts(
            whole_on(merged.tables, self._src),
            plan_layouts(self._plan, merged.tables, positions),
            self._fields,
            dense_bytes=sum(s.nbytes for s in merged.dense),
            placements=plan_placements(self._plan, merged.tables, self._device.type),
        )

    def build(self) -> None:
        if self._index == self._src:
            self._plain = {p: self._module.get_submodule(p) for p in self._plan.plan}
            self._source_dense = {
                n: t.detach().clone()
                for n, t in _plain_dense(self._module, self._plan).items()
            }
        # built from a definition: the caller's module stays as it is
        self._new_model = build_model(
            meta_definition(self._module, list(self._plan.plan)),
            self._env,
            self._plan,
            self._sharders,
            self._device,
            KeptStorage(),  # no initialisation: every byte is moved in
        )

    def slots(self) -> Tuple[Slots, Slots]:
        model = self._new_model
        assert model is not None
        old_slots = _plain_slots(self._plain, self._fields, None)
        return old_slots, sharded_slots(model.module)

    def after_exchange(self, group: ExchangeGroup) -> None:
        agreed, model = self._agreed, self._new_model
        assert agreed is not None and model is not None
        invalidate_caches(sharded_lookups(model.module))
        broadcast_dense(
            agreed.dense,
            self._source_dense,
            dense_tensors(model.module),
            self._src,
            group,
        )

    def commit(self) -> int:
        self._plain = {}
        self._source_dense = None
        return 0

    def abort(self) -> None:
        if self._new_model is not None:
            release_model(self._new_model)
        self._new_model = None
        self._plain = {}
        self._source_dense = None

    def device(self) -> torch.device:
        return self._device

    def exchange_groups_owner(self) -> Optional[ShardingEnv]:
        return self._env

    def stages_on_host(self) -> bool:
        # the source's weights are on the host
        return self._device.type == "cuda"

    def unchanged(self) -> str:
        return "nothing was sharded"

    @property
    def new_model(self) -> nn.Module:
        assert self._new_model is not None
        return self._new_model


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
    participant = ShardFromRank(
        module, plan, env, src, sharders, device or torch.device("cpu")
    )
    run_transaction(participant, options)
    return participant.new_model

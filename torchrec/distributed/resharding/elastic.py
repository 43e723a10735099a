#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Elastic resharding: move a running model onto a different set of ranks.

A ``DistributedModelParallel`` model runs on a process group ``G``;
:func:`move_model`, called by every rank of ``G ∪ G'``, moves it onto ``G'``
under a new plan for ``G'`` — shrink, grow, any other set of ranks. It is one
transaction of the runner (``runner``), numbered in the participants (the
union, by global rank):

1. **agree**: the same request everywhere, the same groups, the same tables in
   the model and in the definitions the joining ranks pass; the old plan, the
   optimizer facts and the dense part travel once, from the old group's first
   rank; ranks that stay state their runs of kept shards (``kept_grouping``);
2. **build**: every rank of ``G'`` builds a fresh ``DistributedModelParallel``
   over ``G'`` from the unsharded definition (ranks that stay derive it from
   their model), kernels uninitialised; on a rank that stays (CPU,
   ``StorageMode.REUSE``), the kernels of its runs of kept shards are built on
   the old kernels' storage: nothing of them is copied or written;
3. **exchange**, on a group made for the transaction over ``G ∪ G'``: every
   table's pieces go from their old owners to their new ones (weights and
   fused optimizer state), then the dense parameters, buffers and the dense
   optimizer's state are broadcast from the old group's first rank;
   and the new model's dense optimizer is made (``make_optimizer``) and
   loaded with the old one's state;
4. **commit**: the old model is released on every rank of ``G``, then the
   pages of departed tables in storage that kept shards share, where nobody
   else references it; nothing of it can fail.

Until the commit the old model is untouched (kept shards are shared, never
written): a failure raises on every rank and nothing is lost.
``elastic_plan`` plans the move (pure); ``unshard`` is the same move between a
sharded model and plain modules on one rank.
"""

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding.devices import normalized_device
from torchrec.distributed.resharding.elastic_plan import (
    AgreedMove,
    check_movable_kernels,
    check_move_agreement,
    dense_specs,
    MoveFacts,
    plan_placements,
    ranks_digest,
    tables_digest,
    validate_new_plan,
)
from torchrec.distributed.resharding.exchange import broadcast_dense
from torchrec.distributed.resharding.exchange_group import ExchangeGroup
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.kept_grouping import direct_output_order
from torchrec.distributed.resharding.kept_step import KeptStorageStep
from torchrec.distributed.resharding.kernel_state import (
    batched_kernels,
    invalidate_caches,
)
from torchrec.distributed.resharding.model_build import (
    build_model,
    release_model,
    unsharded_definition,
)
from torchrec.distributed.resharding.model_view import (
    attached_to_pipeline,
    defined_tables,
    dense_tensors,
    model_env,
    model_facts,
    sharded_lookups,
    sharded_modules,
    sharded_slots,
    table_weights,
)
from torchrec.distributed.resharding.module_adapters import adapter_for
from torchrec.distributed.resharding.optimizer_state import apply_table_facts
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import ReshardError, TableLayout
from torchrec.distributed.resharding.plan_validation import sharding_plan_text
from torchrec.distributed.resharding.runner import (
    described,
    Participant,
    run_transaction,
    Slots,
    TransactionLayouts,
)
from torchrec.distributed.resharding.transaction_report import TransactionReport
from torchrec.distributed.resharding.whole_plan import plan_layouts, sharding_unchanged
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.optim.keyed import KeyedOptimizer

logger: logging.Logger = logging.getLogger(__name__)


@dataclass
class MovedModel:
    """
    The outcome of :func:`move_model` on one rank.

    Args:
        model (Optional[DistributedModelParallel]): the model on the new group
            (None on a rank that left).
        optimizer (Optional[KeyedOptimizer]): the dense optimizer over the new
            model, with the old one's state (when ``make_optimizer`` was given).
        report (TransactionReport): what this rank did.
    """

    model: Optional[nn.Module]
    optimizer: Optional[KeyedOptimizer]
    report: TransactionReport

    @property
    def left(self) -> bool:
        """Whether this rank left the model's group."""
        return self.model is None


def _unchanged_tables(
    model: nn.Module,
    new_plan: ShardingPlan,
    old: Dict[str, TableLayout],
    new: Dict[str, TableLayout],
) -> Dict[str, set]:
    """
    Tables a move leaves exactly where they are: the same shards on the same
    ranks, the same sharding type and compute kernel. Data-parallel tables are
    left out: building a module broadcasts their weights over the new group,
    which would write into kept storage.
    """
    out: Dict[str, set] = {}
    for path, module in sharded_modules(model.module).items():
        for config in adapter_for(module).configs():
            name = config.name
            old_ps, new_ps = model.plan.plan[path][name], new_plan.plan[path][name]
            key = TableKey(path, name)
            unchanged = sharding_unchanged(old_ps, new_ps, old[key], new[key])
            if unchanged and not old[key].replicated:
                out.setdefault(path, set()).add(name)
    return out


def _shards_in_rank_order(plan: ShardingPlan) -> bool:
    """
    Whether every sharded table of ``plan`` lists its shards in the order of
    their ranks: then a sharded module that makes its ShardedTensors from the
    plan's metadata lists their shards as one that gathers every rank's local
    shards does, and its state dict is the one of a model sharded directly.
    The hooks a move builds the new model under are in effect for all of its
    modules, so the move asks for ShardedTensors from the plan only when this
    holds for all of them; otherwise the modules gather, as TorchRec's default.

    Args:
        plan (ShardingPlan): the new plan.

    Returns:
        bool: whether every table's shards are listed in rank order.
    """
    for module_plan in plan.plan.values():
        for ps in module_plan.values():  # pyre-ignore[16]
            if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
                continue  # no ShardedTensor
            shards = getattr(ps.sharding_spec, "shards", None)
            if not shards:
                return False
            ranks = [shard.placement.rank() for shard in shards]
            if ranks != sorted(ranks):
                return False
    return True


class ModelMove(Participant[MoveFacts, AgreedMove]):
    """
    This rank's part of moving a model between groups of ranks (see
    :func:`move_model` for the arguments).
    """

    kind = "move"

    def __init__(
        self,
        model: Optional[nn.Module],
        new_plan: ShardingPlan,
        new_env: Optional[ShardingEnv],
        participants: Sequence[int],
        definition: Optional[nn.Module] = None,
        sharders: Optional[List[Any]] = None,
        optimizer: Optional[KeyedOptimizer] = None,
        make_optimizer: Optional[Callable[[nn.Module], KeyedOptimizer]] = None,
        device: Optional[torch.device] = None,
        options: Optional[ReshardOptions] = None,
    ) -> None:
        self._model = model
        self._new_plan = new_plan
        self._new_env = new_env
        self._union: List[int] = sorted(int(r) for r in participants)
        self._me: int = dist.get_rank()
        self._definition = definition
        self._sharders = sharders
        self._optimizer = optimizer
        self._make_optimizer = make_optimizer
        if device is None:
            device = model.device if model is not None else torch.device("cpu")
        self._device: torch.device = normalized_device(device)
        self._options: ReshardOptions = options or ReshardOptions()
        self._kept: KeptStorageStep = KeptStorageStep.for_options(
            self._options,
            self._device,
            normalized_device(model.device) if model is not None else None,
        )
        self._agreed: Optional[AgreedMove] = None
        self._old: Dict[str, TableLayout] = {}
        self._new: Dict[str, TableLayout] = {}
        self._new_model: Optional[nn.Module] = None
        if model is not None:
            self.role = "stayed" if new_env is not None else "left"
        else:
            self.role = "joined"
        self.new_optimizer: Optional[KeyedOptimizer] = None

    # ------------------------------------------------------------- the agree

    def ranks(self) -> List[int]:
        return self._union

    def request(self) -> List[str]:
        return [described(sharding_plan_text, self._new_plan), str(self._union)]

    def _index(self, rank: int) -> int:
        return self._union.index(rank)

    def prepare(self) -> MoveFacts:
        if self._me not in self._union:
            raise ReshardError(f"rank {self._me} calls but is not among {self._union}")
        model = self._model
        facts = self._model_facts(model) if model is not None else MoveFacts()
        facts.device_type = self._device.type
        if self._new_env is not None:
            self._new_group_facts(facts)
        return facts

    def _model_facts(self, model: nn.Module) -> MoveFacts:
        check_movable_kernels(model.plan)
        facts = model_facts(model)
        modules = sharded_modules(model.module)
        facts.has_optimizer = self._optimizer is not None
        facts.pipelined = [p for p, m in modules.items() if attached_to_pipeline(m)]
        if facts.old_ranks is not None:  # the old group's first rank
            facts.dense = dense_specs(dense_tensors(model.module))
        return facts

    def _new_group_facts(self, facts: MoveFacts) -> None:
        assert self._new_env is not None
        new_ranks = dist.get_process_group_ranks(self._new_env.process_group)
        facts.new_group = ranks_digest(new_ranks)
        if self._me == new_ranks[0]:
            facts.new_ranks = new_ranks
        model = self._model
        if self._definition is None and model is not None:
            self._definition = unsharded_definition(model)
        if self._definition is None:
            raise ReshardError("a rank that joins must pass the model definition")
        if self._sharders is None and model is not None:
            self._sharders = list(model._sharder_map.values())
        if self._sharders is None:
            raise ReshardError("a rank that joins must pass the sharders")
        defined = defined_tables(self._definition, self._new_plan)
        validate_new_plan(
            self._new_plan,
            defined,
            len(new_ranks),
            self._device.type,
            new_ranks.index(self._me),
            self._device.index,
        )
        facts.defined = tables_digest(defined)
        facts.defined_text = repr(defined)
        if model is not None and self._kept.reuse:
            old_ranks = dist.get_process_group_ranks(model._env.process_group)
            self._layouts(model.plan, defined, old_ranks, new_ranks)
            try:
                unchanged = _unchanged_tables(
                    model, self._new_plan, self._old, self._new
                )
                groups = {
                    (path, sharding_type): list(batched_kernels(lookup))
                    for path, m in sharded_modules(model.module).items()
                    for sharding_type, _, lookup in adapter_for(m).groups()
                }
                facts.kept_runs = self._kept.find_runs(groups, unchanged)
            except Exception:  # an optimisation only: copy every piece
                logger.exception("model move: kept storage skipped")
                self._kept.abort()
                facts.kept_runs = {}

    def _layouts(
        self,
        old_plan: ShardingPlan,
        tables: Dict[str, Any],
        old_ranks: Sequence[int],
        new_ranks: Sequence[int],
    ) -> None:
        """The old and new layouts, in transaction ranks: once per move."""
        if self._old:
            return
        self._old = self._old_layouts(old_plan, tables, old_ranks)
        self._new = plan_layouts(self._new_plan, tables, self._positions(new_ranks))

    def _positions(self, ranks: Sequence[int]) -> List[int]:
        """Global ``ranks`` as transaction ranks (positions in the union)."""
        index = {g: i for i, g in enumerate(self._union)}
        return [index[g] for g in ranks]

    def _old_layouts(
        self, old_plan: ShardingPlan, tables: Dict[str, Any], old_ranks: Sequence[int]
    ) -> Dict[str, TableLayout]:
        """
        The tables' layouts before the move, in transaction ranks.

        Args:
            old_plan (ShardingPlan): the old group's plan.
            tables (Dict[str, Any]): the tables, by module path.
            old_ranks (Sequence[int]): the old group's global ranks.

        Returns:
            Dict[str, TableLayout]: the layouts, by table key.
        """
        return plan_layouts(old_plan, tables, self._positions(old_ranks))

    def merge(self, facts: Sequence[MoveFacts]) -> AgreedMove:
        agreed = check_move_agreement(self._union, facts)
        placements = {
            path: {
                name: (
                    ps.sharding_type,
                    tuple(ps.ranks or range(len(agreed.new_ranks))),
                )
                for name, ps in self._new_plan.plan[path].items()
            }
            for path in agreed.tables
        }
        agreed.batch_keys = KeptStorageStep.agree(
            [(i, f.kept_runs) for i, f in enumerate(facts) if f.kept_runs],
            placements,
            {},
        )
        return agreed

    def agreed(self, merged: AgreedMove) -> TransactionLayouts:
        self._agreed = merged
        self._layouts(
            merged.old_plan, merged.tables, merged.old_ranks, merged.new_ranks
        )
        return TransactionLayouts(
            self._old,
            self._new,
            merged.fields(),
            dense_bytes=sum(s.nbytes for s in merged.dense),
            placements=plan_placements(
                self._new_plan, merged.tables, self._device.type
            ),
        )

    # ------------------------------------------------------------- the build

    def build(self) -> None:
        agreed = self._agreed
        assert agreed is not None
        if self._new_env is None:
            return
        assert self._definition is not None
        model = self._model
        old_batched = (
            [
                b
                for m in sharded_modules(model.module).values()
                for lookup in adapter_for(m).lookups()
                for b in batched_kernels(lookup)
            ]
            if model is not None and self._kept.has_runs
            else []
        )
        keys = agreed.batch_keys
        hooks, grouping = self._kept.build_hooks(
            old_batched,
            keys,
            table_weights(self._definition, {p: list(t) for p, t in keys.items()}),
            # the plan is agreed: no gather, where it gives the same metadata
            sharded_tensors_from_metadata=_shards_in_rank_order(self._new_plan),
        )
        self._new_model = build_model(
            self._definition,
            self._new_env,
            self._new_plan,
            self._sharders,
            self._device,
            hooks,
            grouping,
        )
        if dense_specs(dense_tensors(self._new_model.module)) != agreed.dense:
            raise ReshardError(
                "the dense part of the new model differs from the old one's"
            )
        # kept shards got kernels of their own: outputs in the direct order
        for module in sharded_modules(self._new_model.module).values():
            adapter = adapter_for(module)
            if adapter.positional_output:
                infos = adapter.sharding_infos()
                adapter.set_output_order(
                    direct_output_order(
                        [(sharding, infos[t]) for t, sharding, _ in adapter.groups()]
                    )
                )

    # ---------------------------------------------------------- the exchange

    def before_exchange(self, group: ExchangeGroup) -> None:
        agreed = self._agreed
        assert agreed is not None
        if self._new_model is not None:
            for path, module in sharded_modules(self._new_model.module).items():
                apply_table_facts(
                    adapter_for(module).lookups(), agreed.table_facts[path]
                )

    def slots(self) -> Tuple[Slots, Slots]:
        old = self._model.module if self._model is not None else None
        new = self._new_model.module if self._new_model is not None else None
        return (
            sharded_slots(old) if old is not None else {},
            sharded_slots(new) if new is not None else {},
        )

    def after_exchange(self, group: ExchangeGroup) -> None:
        agreed = self._agreed
        assert agreed is not None
        if self._new_model is not None:
            invalidate_caches(sharded_lookups(self._new_model.module))
        src = self._index(agreed.old_ranks[0])
        me = self._index(self._me)
        broadcast_dense(
            agreed.dense,
            dense_tensors(self._model.module) if me == src else None,
            (
                dense_tensors(self._new_model.module)
                if self._new_model is not None
                else None
            ),
            src,
            group,
        )
        dense_state = None
        if agreed.has_optimizer:
            dense_state = group.broadcast_object(
                (
                    self._optimizer.state_dict()
                    if me == src and self._optimizer is not None
                    else None
                ),
                src,
            )
        # What can fail is done before the commit, while the old model is whole:
        # the caller's optimizer factory and loading the old optimizer's state.
        if self._new_model is not None and self._make_optimizer is not None:
            optimizer = self._make_optimizer(self._new_model)
            if dense_state is not None:
                # a KeyedOptimizer loads state only into initialised state
                optimizer.init_state()
                optimizer.load_state_dict(dense_state)
            self.new_optimizer = optimizer

    # ------------------------------------------------------ commit and abort

    def commit(self) -> int:
        if self._model is not None:
            release_model(self._model)
        new_model = self._new_model
        if new_model is None:
            self._kept.abort()
            return 0
        return self._kept.release(list(sharded_modules(new_model.module).values()))

    def abort(self) -> None:
        if self._new_model is not None:
            release_model(self._new_model)
        # the old model keeps its storage as it is: nothing of it is released
        self._new_model = None
        self.new_optimizer = None
        self._kept.abort()

    def device(self) -> torch.device:
        agreed = self._agreed
        assert agreed is not None
        if agreed.exchange_device_type != self._device.type:
            return torch.device("cpu")  # mixed devices: gloo, host buffers
        return self._device

    def unchanged(self) -> str:
        return "the model on the old group is unchanged"

    def state_devices(self) -> List[torch.device]:
        return state_devices(self._device, self.device())

    def exchange_groups_owner(self) -> Optional[ShardingEnv]:
        # the env of the group this rank's model lives on afterwards
        if self._new_env is not None:
            return self._new_env
        return model_env(self._model) if self._model is not None else None

    def stages_on_host(self) -> bool:
        agreed = self._agreed
        assert agreed is not None
        return agreed.staged

    @property
    def new_model(self) -> Optional[nn.Module]:
        return self._new_model


def state_devices(
    model_device: torch.device, exchange_device: torch.device
) -> List[torch.device]:
    """
    The devices a move must synchronise before it reads or writes kernels:
    the model's (a move between CPU and GPU ranks exchanges on the host, yet
    reads and writes this rank's CUDA kernels, which a side stream may still
    be updating), and the exchange's.

    Args:
        model_device (torch.device): this rank's model device.
        exchange_device (torch.device): the move's exchange device.

    Returns:
        List[torch.device]: each once.
    """
    return [model_device] + (
        [exchange_device] if exchange_device != model_device else []
    )


def move_model(
    model: Optional[nn.Module],
    new_plan: ShardingPlan,
    new_env: Optional[ShardingEnv],
    participants: Sequence[int],
    definition: Optional[nn.Module] = None,
    sharders: Optional[List[Any]] = None,
    optimizer: Optional[KeyedOptimizer] = None,
    make_optimizer: Optional[Callable[[nn.Module], KeyedOptimizer]] = None,
    device: Optional[torch.device] = None,
    options: Optional[ReshardOptions] = None,
) -> MovedModel:
    """
    Moves a running ``DistributedModelParallel`` model from its process group
    ``G`` onto another group ``G'`` (shrink, grow, any set of ranks), with a
    new plan for ``G'``. Every rank of ``G ∪ G'`` calls it.

    Args:
        model (Optional[DistributedModelParallel]): the model, on ranks of
            ``G``; None on ranks that join.
        new_plan (ShardingPlan): the plan on ``G'`` (its group-local ranks),
            the same on every rank.
        new_env (Optional[ShardingEnv]): the environment over ``G'`` on its
            ranks (e.g. ``ShardingEnv.from_process_group(new_group)``); None on
            ranks that leave.
        participants (Sequence[int]): the global ranks of ``G ∪ G'``, the same
            on every rank.
        definition (Optional[nn.Module]): the unsharded model (meta device is
            enough) on ranks that join; ranks that stay derive it from their
            model when None.
        sharders (Optional[List[ModuleSharder]]): the sharders for ``G'`` (ranks
            that stay default to their model's; ranks that join must pass
            them).
        optimizer (Optional[KeyedOptimizer]): the dense optimizer, on ranks of
            ``G``; its state reaches the new model's optimizer.
        make_optimizer (Optional[Callable]): on ranks of ``G'``, builds the
            dense optimizer over the new model (it gets the old one's state).
        device (Optional[torch.device]): the device on ``G'`` (default: the
            model's, or CPU).
        options (Optional[ReshardOptions]): in-flight cap and timeout.

    Returns:
        MovedModel: the new model on ranks of ``G'`` (None on ranks that
        left); the old model is released on every rank of ``G``.

    Raises:
        ReshardError: on every rank, before anything moves, for a bad request
            (plan, groups, differing definitions).
        ReshardAbortedError: on every calling rank when a rank does not join
            in time or the move fails; the old model keeps its state.
    """
    participant = ModelMove(
        model,
        new_plan,
        new_env,
        participants,
        definition,
        sharders,
        optimizer,
        make_optimizer,
        device,
        options,
    )
    report = run_transaction(participant, options)
    return MovedModel(participant.new_model, participant.new_optimizer, report)


def dry_run_move(
    model: Optional[nn.Module],
    new_plan: ShardingPlan,
    new_env: Optional[ShardingEnv],
    participants: Sequence[int],
    definition: Optional[nn.Module] = None,
    sharders: Optional[List[Any]] = None,
    options: Optional[ReshardOptions] = None,
) -> TransactionReport:
    """
    The validation and agreement of :func:`move_model` (same arguments, every
    participant calls it), and exactly the bytes it would move, without
    building or moving anything.

    Returns:
        TransactionReport: the tables whose layout changes, the dense bytes
        and the bytes every rank would send and receive (global rank ->
        bytes: ``bytes_sent_by_rank``, ``bytes_received_by_rank``), the same
        on every rank.

    Raises:
        ReshardError: as :func:`move_model` would, before anything moves.
        ReshardAbortedError: when a rank does not join in time.
    """
    participant = ModelMove(
        model, new_plan, new_env, participants, definition, sharders, options=options
    )
    return run_transaction(participant, options, dry_run=True)

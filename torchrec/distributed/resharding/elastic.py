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
under a new plan for ``G'`` — shrink, grow, any other set of ranks:

1. **agree** (every participant, on the job's key-value store, bounded by the
   exchange timeout): the same request everywhere, the same groups, the same
   tables in the model and in the definitions the joining ranks pass; the old
   plan, the optimizer facts and the dense tensors travel with the agreement;
2. **build** the model on ``G'``: every rank of ``G'`` builds a fresh
   ``DistributedModelParallel`` over ``G'`` from the unsharded definition
   (ranks that stay derive it from their model), kernels uninitialised; on a
   rank that stays (CPU, ``StorageMode.REUSE``), table shards that stay on it
   with the same layout get kernels of their own built on the old kernels'
   storage (weights and fused optimizer state, see ``elastic_storage``):
   nothing of them is copied or written;
3. **move**, on a process group made for the transaction over ``G ∪ G'``:
   every table's pieces go from their old owners to their new ones (weights
   and fused optimizer state, as in a reshard within one group; layouts are
   planned in global ranks), the dense parameters, buffers and the dense
   optimizer's state are broadcast from a rank of ``G``;
4. **release** the old model on every rank of ``G``, then the pages of
   departed tables in storage that kept shards share, where nobody else
   references it.

Until step 4 the old model is untouched (kept shards are shared, never
written): a failure raises on every rank and nothing is lost.
``elastic_plan`` plans the move (pure); ``unshard`` is the same move between
a sharded model and plain modules on one rank.
"""

import contextlib
import copy
import logging
import time
from dataclasses import dataclass, field
from typing import (
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
from torchrec.distributed.batched_embedding_kernel import kernel_build_hooks
from torchrec.distributed.resharding.elastic_plan import (
    AgreedMove,
    check_move_agreement,
    move_fields,
    move_transfers,
    MoveFacts,
    plan_layouts,
    plan_text,
    request_digest,
    table_key,
    TableShape,
    validate_new_plan,
)
from torchrec.distributed.resharding.elastic_storage import (
    batch_keys,
    kept_runs,
    KeptRun,
    may_keep_storage,
    MoveStorage,
    old_batched,
    release_kept_storage,
    run_facts,
)
from torchrec.distributed.resharding.exchange import (
    agree_among,
    Agreement,
    close_exchange_group,
    Field,
    open_exchange_group_among,
)
from torchrec.distributed.resharding.install import adapter_for
from torchrec.distributed.resharding.kernel_state import LocalSlot, SlotKey
from torchrec.distributed.resharding.optimizer_state import (
    apply_table_facts,
    local_table_facts,
)
from torchrec.distributed.resharding.plan import (
    ReshardAbortedError,
    ReshardError,
    ReshardPlan,
)
from torchrec.distributed.resharding.storage import KeptStorage
from torchrec.distributed.resharding.transaction import fill_slots, ReshardOptions
from torchrec.distributed.train_pipeline.utils import BaseForward
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
)
from torchrec.optim.keyed import KeyedOptimizer

logger: logging.Logger = logging.getLogger(__name__)


@dataclass
class MoveReport:
    """
    What one rank did in a move between groups.

    Args:
        rank (int): global rank.
        role (str): "stayed", "left" or "joined" (or "source" / "destination"
            for :func:`shard_from_rank` / :func:`unshard_model`).
        tables (int): tables moved.
        bytes_sent (int): table bytes this rank sent to other ranks.
        bytes_received (int): table bytes this rank received.
        bytes_copied_locally (int): table bytes that stayed on this rank and
            were copied into the new model.
        bytes_kept_in_place (int): table bytes that stayed on this rank in the
            same storage: the new model's kernels took over the old ones'
            memory (nothing copied, see ``storage``).
        bytes_released (int): bytes of departed tables' state given back to
            the OS from storage that kept tables share.
        dense_bytes (int): bytes of dense parameters and buffers broadcast.
        seconds (float): wall time on this rank.
    """

    rank: int
    role: str
    tables: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_locally: int = 0
    bytes_kept_in_place: int = 0
    bytes_released: int = 0
    dense_bytes: int = 0
    seconds: float = 0.0


@dataclass
class MovedModel:
    """
    The outcome of :func:`move_model` on one rank.

    Args:
        model (Optional[DistributedModelParallel]): the model on the new group
            (None on a rank that left).
        optimizer (Optional[KeyedOptimizer]): the dense optimizer over the new
            model, with the old one's state (when ``make_optimizer`` was given).
        report (MoveReport): what this rank did.
    """

    model: Optional[nn.Module]
    optimizer: Optional[KeyedOptimizer]
    report: MoveReport

    @property
    def left(self) -> bool:
        """Whether this rank left the model's group."""
        return self.model is None


def sharded_modules(root: nn.Module) -> Dict[str, nn.Module]:
    """
    Args:
        root (nn.Module): a model (``DistributedModelParallel.module``).

    Returns:
        Dict[str, nn.Module]: its sharded embedding modules by path.
    """
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    kinds = (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)
    return {p: m for p, m in root.named_modules() if isinstance(m, kinds)}


def plain_tables(module: nn.Module) -> List[TableShape]:
    configs = (
        module.embedding_bag_configs()
        if isinstance(module, EmbeddingBagCollection)
        else module.embedding_configs()
    )
    return [(c.name, c.num_embeddings, c.embedding_dim) for c in configs]


def _sharded_tables(module: nn.Module) -> List[TableShape]:
    adapter = adapter_for(module)
    return [(c.name, *adapter.table_shape(c.name)) for c in adapter.configs()]


def plain_twin(module: nn.Module, device: torch.device) -> nn.Module:
    """An unsharded module of the same tables as a sharded one."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    if isinstance(module, ShardedEmbeddingCollection):
        return EmbeddingCollection(
            tables=copy.deepcopy(module._embedding_configs),
            device=device,
            need_indices=module._need_indices,
        )
    return EmbeddingBagCollection(
        tables=copy.deepcopy(module._embedding_bag_configs),
        is_weighted=module._is_weighted,
        device=device,
    )


def _unsharded_definition(model: nn.Module) -> nn.Module:
    """
    The definition of a sharded model on the meta device: its sharded modules
    as unsharded ones of the same tables, the rest copied.
    """
    root = model.module
    sharded = sharded_modules(root)
    parents = {
        path: (root.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2])
        for path in sharded
    }
    try:
        for path, (parent, name) in parents.items():
            setattr(parent, name, nn.Module())  # not copied: swapped back below
        definition = copy.deepcopy(root).to("meta")
    finally:
        for path, (parent, name) in parents.items():
            setattr(parent, name, sharded[path])
    for path in sharded:
        parent_path, _, name = path.rpartition(".")
        parent = definition.get_submodule(parent_path)
        setattr(parent, name, plain_twin(sharded[path], torch.device("meta")))
    return definition


def is_dense(name: str, sharded_paths: Sequence[str]) -> bool:
    return not any(name.startswith(p + ".") for p in sharded_paths)


def dense_tensors(root: nn.Module) -> Dict[str, torch.Tensor]:
    """
    Args:
        root (nn.Module): a model.

    Returns:
        Dict[str, torch.Tensor]: its parameters and buffers outside sharded
        embedding modules, by name (sorted): the replicated, dense part.
    """
    paths = list(sharded_modules(root))
    out: Dict[str, torch.Tensor] = {}
    for name, t in list(root.named_parameters()) + list(root.named_buffers()):
        if is_dense(name, paths):
            out[name] = t
    return dict(sorted(out.items()))


def sharded_slots(root: nn.Module) -> Dict[SlotKey, LocalSlot]:
    """This rank's shards of every sharded module, keyed by "path:table"."""
    out: Dict[SlotKey, LocalSlot] = {}
    for path, module in sharded_modules(root).items():
        adapter = adapter_for(module)
        for (table, rect), slot in adapter.local_slots(adapter.lookups()).items():
            key = table_key(path, table)
            out[(key, rect)] = LocalSlot(key, rect, slot.tensors)
    return out


def plain_weight(module: nn.Module, table: str) -> torch.Tensor:
    if isinstance(module, EmbeddingBagCollection):
        return module.embedding_bags[table].weight
    return module.embeddings[table].weight


def _table_weights(
    definition: nn.Module, keys: Mapping[str, Mapping[str, str]]
) -> Dict[str, Dict[str, torch.Tensor]]:
    """The definition's weight of every table that gets a batch key."""
    return {
        path: {t: plain_weight(definition.get_submodule(path), t) for t in tables}
        for path, tables in keys.items()
    }


def model_facts(model: nn.Module, optimizer: Optional[KeyedOptimizer]) -> MoveFacts:
    root = model.module
    modules = sharded_modules(root)
    dense = dense_tensors(root)
    return MoveFacts(
        old_ranks=dist.get_process_group_ranks(model._env.process_group),
        old_plan=model.plan,
        tables={path: _sharded_tables(m) for path, m in modules.items()},
        table_facts={
            path: local_table_facts(
                adapter_for(m).lookups(), [t[0] for t in _sharded_tables(m)]
            )
            for path, m in modules.items()
        },
        dense=[(n, tuple(t.shape), str(t.dtype)) for n, t in dense.items()],
        has_optimizer=optimizer is not None,
        pipelined=[path for path, m in modules.items() if _attached_to_pipeline(m)],
    )


def _attached_to_pipeline(module: nn.Module) -> bool:
    """
    Whether a train pipeline has replaced the module's forward: its batches in
    flight ran the input dist over the old group, which a move replaces.
    """
    return isinstance(module.__dict__.get("forward"), BaseForward)


def defined_tables(
    definition: nn.Module, plan: ShardingPlan
) -> Dict[str, List[TableShape]]:
    """The tables of the modules a plan shards, in an unsharded definition."""
    out: Dict[str, List[TableShape]] = {}
    for path in sorted(plan.plan):
        try:
            module = definition.get_submodule(path)
        except AttributeError:
            raise ReshardError(
                f"the plan shards module '{path}', which the definition lacks"
            ) from None
        if not isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
            raise ReshardError(
                f"module '{path}' of the definition is a {type(module).__name__}, "
                "not an EmbeddingBagCollection or EmbeddingCollection"
            )
        out[path] = plain_tables(module)
    return out


def move_tables(
    plan: ReshardPlan,
    fields: Mapping[str, Sequence[Field]],
    old_slots: Mapping[SlotKey, LocalSlot],
    new_slots: Mapping[SlotKey, LocalSlot],
    rank: int,
    group: dist.ProcessGroup,
    options: ReshardOptions,
    report: MoveReport,
) -> None:
    """
    Local copies and the exchange of every table's pieces (union ranks).
    Pieces whose new kernel took over the old storage (kept in place) are
    neither copied nor written.
    """
    filled = fill_slots(
        plan,
        fields,
        old_slots,
        new_slots,
        rank,
        group,
        torch.device("cpu"),
        options.max_inflight_bytes,
    )
    report.bytes_kept_in_place += filled.bytes_kept_in_place
    report.bytes_copied_locally += filled.bytes_copied_locally
    report.bytes_sent, report.bytes_received = filled.bytes_sent, filled.bytes_received


def broadcast_dense(
    specs: Sequence[Tuple[str, Tuple[int, ...], str]],
    source: Optional[Mapping[str, torch.Tensor]],
    target: Optional[Mapping[str, torch.Tensor]],
    src: int,
    group: dist.ProcessGroup,
) -> int:
    """
    The dense tensors, from ``source`` on the group's rank ``src`` into
    ``target`` (ranks of the new group; None elsewhere): one broadcast per
    dtype of a buffer that packs them.

    Returns:
        int: bytes broadcast.
    """
    total = 0
    for dtype_name in sorted({s[2] for s in specs}):
        dtype = getattr(torch, dtype_name.replace("torch.", ""))
        members = [s for s in specs if s[2] == dtype_name]
        sizes = [int(torch.Size(s[1]).numel()) for s in members]
        if source is not None:
            buffer = (
                torch.cat(
                    [
                        source[name].detach().reshape(-1).to("cpu")
                        for name, _, _ in members
                    ]
                )
                if members
                else torch.empty(0, dtype=dtype)
            )
        else:
            buffer = torch.empty(sum(sizes), dtype=dtype)
        dist.broadcast(buffer, group_src=src, group=group)
        total += buffer.numel() * buffer.element_size()
        if target is not None:
            with torch.no_grad():
                for (name, shape, _), piece in zip(members, buffer.split(sizes)):
                    target[name].copy_(piece.view(shape))
    return total


class _NoInit(KeptStorage):
    """Kernel build hooks of a model whose every byte is moved in."""

    def __init__(self) -> None:
        super().__init__([], set(), reuse=False)


def _no_init(weight: torch.Tensor) -> None:
    """A table ``init_fn`` that leaves the weight as it is."""


@contextlib.contextmanager
def _tables_not_initialised(definition: nn.Module) -> Iterator[None]:
    """
    While a model is built from ``definition``, its tables' ``init_fn`` do
    nothing, and are put back afterwards. A sharded module's
    ``reset_parameters`` (called once it is built) initialises every local
    shard with them; the kernel build hooks do not reach it, and every byte is
    moved in afterwards.
    """
    configs: List[Any] = []
    for module in definition.modules():
        if isinstance(module, EmbeddingBagCollection):
            configs += module.embedding_bag_configs()
        elif isinstance(module, EmbeddingCollection):
            configs += module.embedding_configs()
    saved = [(config, config.init_fn) for config in configs]
    try:
        for config in configs:
            config.init_fn = _no_init
        yield
    finally:
        for config, init_fn in saved:
            config.init_fn = init_fn


def build_model(
    definition: nn.Module,
    env: ShardingEnv,
    plan: ShardingPlan,
    sharders: Optional[List[Any]],
    device: torch.device,
    hooks: Optional[KeptStorage] = None,
) -> nn.Module:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    hooks = hooks if hooks is not None else _NoInit()
    with kernel_build_hooks(hooks), _tables_not_initialised(definition):
        return DistributedModelParallel(
            definition,
            env=env,
            device=device,
            plan=copy.deepcopy(plan),
            sharders=sharders,
        )


def release_model(model: nn.Module) -> None:
    model._release()


def _agree(
    union: List[int], digest: int, error: Optional[str], facts: Any, timeout: Any
) -> Agreement:
    return agree_among(union, digest, error, facts, timeout)


@dataclass
class _Request:
    """One rank's view of a move, agreed on by every participant."""

    union: List[int]
    me: int
    agreed: AgreedMove
    digest: int
    definition: Optional[nn.Module]
    sharders: Optional[List[Any]]
    device: torch.device
    kept: List[KeptRun] = field(default_factory=list)
    batch_keys: Dict[str, Dict[str, str]] = field(default_factory=dict)

    @property
    def role(self) -> str:
        if self.me in self.agreed.old_ranks:
            return "stayed" if self.me in self.agreed.new_ranks else "left"
        return "joined"

    def transfers(self, new_plan: ShardingPlan) -> ReshardPlan:
        agreed = self.agreed
        return move_transfers(
            plan_layouts(agreed.old_plan, agreed.tables, agreed.old_ranks),
            plan_layouts(new_plan, agreed.tables, agreed.new_ranks),
            self.union,
        )


def _agree_on_move(
    model: Optional[nn.Module],
    new_plan: ShardingPlan,
    new_env: Optional[ShardingEnv],
    participants: Sequence[int],
    definition: Optional[nn.Module],
    sharders: Optional[List[Any]],
    optimizer: Optional[KeyedOptimizer],
    device: Optional[torch.device],
    options: ReshardOptions,
    kind: str,
) -> _Request:
    """Phase 1 of a move: validate on every rank, agree once, check."""
    union = sorted(int(r) for r in participants)
    me = dist.get_rank()
    if device is None:
        device = model.device if model is not None else torch.device("cpu")
    facts = MoveFacts()
    kept: List[KeptRun] = []
    error: Optional[str] = None
    try:
        if me not in union:
            raise ReshardError(f"rank {me} calls but is not among {union}")
        if model is not None:
            facts = model_facts(model, optimizer)
        if new_env is not None:
            facts.new_ranks = dist.get_process_group_ranks(new_env.process_group)
            if definition is None and model is not None:
                definition = _unsharded_definition(model)
            if definition is None:
                raise ReshardError("a rank that joins must pass the model definition")
            if sharders is None and model is not None:
                sharders = list(model._sharder_map.values())
            if sharders is None:
                raise ReshardError("a rank that joins must pass the sharders")
            facts.defined_tables = defined_tables(definition, new_plan)
            validate_new_plan(
                new_plan, facts.defined_tables, len(facts.new_ranks), device.type
            )
            if model is not None and may_keep_storage(model, device, options):
                try:
                    kept = kept_runs(
                        sharded_modules(model.module),
                        model.plan,
                        facts.old_ranks or [],
                        new_plan,
                        facts.new_ranks,
                    )
                except Exception:  # an optimisation only: copy every piece
                    logger.exception("model move: kept storage skipped")
                    kept = []
                facts.kept_runs = run_facts(kept)
    except ReshardError as e:
        error = str(e)
    digest = request_digest(kind, plan_text(new_plan), str(union))
    agreement = _agree(union, digest, error, facts, options.exchange_timeout)
    agreed = check_move_agreement(union, agreement.facts)
    keys = batch_keys(
        union, [f.kept_runs for f in agreement.facts], new_plan, agreed.new_ranks
    )
    return _Request(union, me, agreed, digest, definition, sharders, device, kept, keys)


def _build_on_new_group(
    request: _Request,
    model: Optional[nn.Module],
    new_env: Optional[ShardingEnv],
    new_plan: ShardingPlan,
    options: ReshardOptions,
) -> Tuple[Optional[nn.Module], Optional[MoveStorage], Agreement]:
    """
    Phase 2: every rank of the new group builds the model; all agree it did.
    Kernels of kept shards take over the old kernels' storage (see
    :class:`MoveStorage`); the returned hooks hold it until the move ends.
    """
    new_model: Optional[nn.Module] = None
    hooks: Optional[MoveStorage] = None
    error: Optional[str] = None
    if new_env is not None:
        try:
            assert request.definition is not None
            hooks = MoveStorage(
                _table_weights(request.definition, request.batch_keys),
                request.batch_keys,
                request.kept,
                (
                    old_batched(sharded_modules(model.module))
                    if model is not None and request.kept
                    else []
                ),
            )
            new_model = build_model(
                request.definition,
                new_env,
                new_plan,
                request.sharders,
                request.device,
                hooks,
            )
            dense = [
                (n, tuple(t.shape), str(t.dtype))
                for n, t in dense_tensors(new_model.module).items()
            ]
            if dense != request.agreed.dense:
                raise ReshardError(
                    "the dense part of the new model differs from the old one's"
                )
        except Exception as e:
            error = (
                f"building the model on the new group failed: {type(e).__name__}: {e}"
            )
    try:
        built = _agree(
            request.union, request.digest, error, None, options.exchange_timeout
        )
    except BaseException:
        if new_model is not None:
            release_model(new_model)
        raise
    return new_model, hooks, built


def _move_state(
    request: _Request,
    model: Optional[nn.Module],
    new_model: Optional[nn.Module],
    new_plan: ShardingPlan,
    optimizer: Optional[KeyedOptimizer],
    group: dist.ProcessGroup,
    options: ReshardOptions,
    report: MoveReport,
) -> Optional[Dict[str, Any]]:
    """
    Phase 3, on the transaction's group over both groups: every table's
    pieces, then the dense part and the dense optimizer's state from a rank
    of the old group.

    Returns:
        Optional[Dict[str, Any]]: the dense optimizer's state (when there is
        one), on every rank.
    """
    agreed, me = request.agreed, request.union.index(request.me)
    src = request.union.index(agreed.old_ranks[0])
    old_slots = sharded_slots(model.module) if model is not None else {}
    new_slots = sharded_slots(new_model.module) if new_model is not None else {}
    if new_model is not None:
        for path, module in sharded_modules(new_model.module).items():
            apply_table_facts(adapter_for(module).lookups(), agreed.table_facts[path])
    plan = request.transfers(new_plan)
    report.tables = len(plan.new_layouts)
    move_tables(
        plan, move_fields(agreed), old_slots, new_slots, me, group, options, report
    )
    del old_slots, new_slots
    report.dense_bytes = broadcast_dense(
        agreed.dense,
        dense_tensors(model.module) if me == src else None,
        dense_tensors(new_model.module) if new_model is not None else None,
        src,
        group,
    )
    state: List[Any] = [None]
    if agreed.has_optimizer:
        state = [optimizer.state_dict() if me == src else None]
        dist.broadcast_object_list(state, group_src=src, group=group)
    return state[0]


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
    start = time.perf_counter()
    options = options or ReshardOptions()
    request = _agree_on_move(
        model,
        new_plan,
        new_env,
        participants,
        definition,
        sharders,
        optimizer,
        device,
        options,
        "move",
    )
    report = MoveReport(request.me, request.role)
    new_model, hooks, built = _build_on_new_group(
        request, model, new_env, new_plan, options
    )
    group = open_exchange_group_among(
        request.union, built.transaction, options.exchange_timeout
    )
    try:
        state = _move_state(
            request, model, new_model, new_plan, optimizer, group, options, report
        )
        dist.barrier(group=group)
    except Exception as e:
        close_exchange_group(group)
        if new_model is not None:
            release_model(new_model)
        # the old model keeps its storage as it is: nothing of it is released
        new_model = hooks = None
        raise ReshardAbortedError(
            f"rank {request.me}: moving the model failed ({type(e).__name__}: "
            f"{e}); the model on the old group is unchanged"
        ) from e
    close_exchange_group(group)

    if model is not None:
        release_model(model)
    if hooks is not None and new_model is not None:
        report.bytes_released = release_kept_storage(
            hooks, sharded_modules(new_model.module)
        )
    del hooks
    new_optimizer: Optional[KeyedOptimizer] = None
    if new_model is not None and make_optimizer is not None:
        new_optimizer = make_optimizer(new_model)
        if state is not None:
            # a KeyedOptimizer loads state only into initialised state
            new_optimizer.init_state()
            new_optimizer.load_state_dict(state)
    report.seconds = time.perf_counter() - start
    logger.info(
        "model move rank %d (%s): %d tables, sent %d B, received %d B, copied "
        "locally %d B, dense %d B in %.3f s",
        request.me,
        report.role,
        report.tables,
        report.bytes_sent,
        report.bytes_received,
        report.bytes_copied_locally,
        report.dense_bytes,
        report.seconds,
    )
    return MovedModel(new_model, new_optimizer, report)


@dataclass
class MoveDryRun:
    """
    What a move between groups would do, computed without building or moving
    anything.

    Args:
        tables_moved (Dict[str, List[str]]): module path -> tables with a
            piece that changes owner.
        bytes_sent (Dict[int, int]): global rank -> table bytes it would send.
        bytes_received (Dict[int, int]): global rank -> table bytes it would
            receive.
        dense_bytes (int): bytes of the dense part each receiver gets.
    """

    tables_moved: Dict[str, List[str]]
    bytes_sent: Dict[int, int]
    bytes_received: Dict[int, int]
    dense_bytes: int


def dry_run_move(
    model: Optional[nn.Module],
    new_plan: ShardingPlan,
    new_env: Optional[ShardingEnv],
    participants: Sequence[int],
    definition: Optional[nn.Module] = None,
    sharders: Optional[List[Any]] = None,
    options: Optional[ReshardOptions] = None,
) -> MoveDryRun:
    """
    The validation and agreement of :func:`move_model` (same arguments, every
    participant calls it), and exactly the bytes it would move, without
    building or moving anything.

    Returns:
        MoveDryRun: the tables and bytes, the same on every rank.

    Raises:
        ReshardError: as :func:`move_model` would, before anything moves.
        ReshardAbortedError: when a rank does not join in time.
    """
    options = options or ReshardOptions()
    request = _agree_on_move(
        model,
        new_plan,
        new_env,
        participants,
        definition,
        sharders,
        None,
        None,
        options,
        "dry_run_move",
    )
    plan = request.transfers(new_plan)
    fields = move_fields(request.agreed)
    union = request.union
    sent = {r: 0 for r in union}
    received = {r: 0 for r in union}
    moved: Dict[str, List[str]] = {}
    for transfer in plan.transfers:
        if transfer.is_local:
            continue
        nbytes = sum(f.nbytes(transfer) for f in fields[transfer.table])
        sent[union[transfer.src_rank]] += nbytes
        received[union[transfer.dst_rank]] += nbytes
        path, _, table = transfer.table.rpartition(":")
        if table not in moved.setdefault(path, []):
            moved[path].append(table)
    dense = sum(
        int(torch.Size(shape).numel()) * getattr(torch, dtype.split(".")[-1]).itemsize
        for _, shape, dtype in request.agreed.dense
    )
    return MoveDryRun(moved, sent, received, dense)

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
   storage (weights and fused optimizer state), as in a reshard within one
   group: nothing of them is copied or written;
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
:func:`unshard_model` (every table onto one rank as plain modules) and
:func:`shard_from_rank` (tables only one rank holds, sharded onto the group)
are the same move between a sharded model and plain modules on one rank.
"""

import contextlib
import copy
import hashlib
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
    Set,
    Tuple,
)

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.batched_embedding_kernel import kernel_build_hooks
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.resharding.exchange import (
    agree_among,
    Agreement,
    close_exchange_group,
    exchange_pieces,
    Field,
    FieldKind,
    open_exchange_group_among,
)
from torchrec.distributed.resharding.install import adapter_for
from torchrec.distributed.resharding.kernel_state import (
    batched_kernels,
    kept_in_place,
    LocalSlot,
    read_piece,
    RowwiseMerges,
    slot_bytes,
    SlotKey,
    target_piece,
    write_piece,
    zero_undelivered_state,
)
from torchrec.distributed.resharding.optimizer_state import (
    apply_table_facts,
    local_table_facts,
    merge_table_facts,
    TableFacts,
)
from torchrec.distributed.resharding.plan import (
    describe_parameter_sharding,
    layout_from_parameter_sharding,
    plan_table_transfers,
    Rect,
    ReshardAbortedError,
    ReshardError,
    ReshardPlan,
    TableLayout,
    Transfer,
    validate_parameter_sharding,
)
from torchrec.distributed.resharding.storage import (
    BATCH_KEY,
    KeptStorage,
    MAX_KERNELS_PER_GROUP,
    shard_key,
    ShardKey,
    storage_reuse_supported,
    StorageMode,
)
from torchrec.distributed.resharding.transaction import ReshardOptions
from torchrec.distributed.train_pipeline.utils import BaseForward
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import data_type_to_dtype
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
)
from torchrec.optim.keyed import KeyedOptimizer

logger: logging.Logger = logging.getLogger(__name__)

# table of a module: (name, rows, columns)
TableShape = Tuple[str, int, int]


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


# ------------------------------------------------------------------ modules


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


def _plain_tables(module: nn.Module) -> List[TableShape]:
    configs = (
        module.embedding_bag_configs()
        if isinstance(module, EmbeddingBagCollection)
        else module.embedding_configs()
    )
    return [(c.name, c.num_embeddings, c.embedding_dim) for c in configs]


def _sharded_tables(module: nn.Module) -> List[TableShape]:
    adapter = adapter_for(module)
    return [(c.name, *adapter.table_shape(c.name)) for c in adapter.configs()]


def _plain_twin(module: nn.Module, device: torch.device) -> nn.Module:
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
        setattr(parent, name, _plain_twin(sharded[path], torch.device("meta")))
    return definition


def _is_dense(name: str, sharded_paths: Sequence[str]) -> bool:
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
        if _is_dense(name, paths):
            out[name] = t
    return dict(sorted(out.items()))


# ------------------------------------------------------------------ layouts


def _key(path: str, table: str) -> str:
    return f"{path}:{table}"


def plan_layouts(
    plan: ShardingPlan,
    tables: Mapping[str, Sequence[TableShape]],
    group_ranks: Sequence[int],
) -> Dict[str, TableLayout]:
    """
    Args:
        plan (ShardingPlan): a plan for a group (group-local placements).
        tables (Mapping[str, Sequence[TableShape]]): module path -> tables.
        group_ranks (Sequence[int]): the group's global ranks.

    Returns:
        Dict[str, TableLayout]: "path:table" -> its layout, in global ranks.
    """
    out: Dict[str, TableLayout] = {}
    to_global = dict(enumerate(group_ranks))
    for path, shapes in sorted(tables.items()):
        for name, rows, cols in shapes:
            ps = plan.plan[path][name]
            layout = layout_from_parameter_sharding(ps, rows, cols, len(group_ranks))
            out[_key(path, name)] = layout.remap_ranks(to_global)
    return out


def _whole_on(
    tables: Mapping[str, Sequence[TableShape]], rank: int
) -> Dict[str, TableLayout]:
    """Every table whole on one (global) rank."""
    from torchrec.distributed.resharding.plan import PlacedShard

    return {
        _key(path, name): TableLayout(
            rows, cols, (PlacedShard(rank, Rect(0, 0, rows, cols)),)
        )
        for path, shapes in sorted(tables.items())
        for name, rows, cols in shapes
    }


def _transfers(
    old: Mapping[str, TableLayout],
    new: Mapping[str, TableLayout],
    union: Sequence[int],
) -> ReshardPlan:
    """Transfers in the union's ranks (its order numbers them)."""
    local = {g: i for i, g in enumerate(union)}
    olds = {k: v.remap_ranks(local) for k, v in old.items()}
    news = {k: v.remap_ranks(local) for k, v in new.items()}
    transfers: List[Transfer] = []
    for key in sorted(news):
        transfers.extend(plan_table_transfers(key, olds[key], news[key]))
    return ReshardPlan(tuple(transfers), olds, news)


# -------------------------------------------------------------------- slots


def sharded_slots(root: nn.Module) -> Dict[SlotKey, LocalSlot]:
    """This rank's shards of every sharded module, keyed by "path:table"."""
    out: Dict[SlotKey, LocalSlot] = {}
    for path, module in sharded_modules(root).items():
        adapter = adapter_for(module)
        for (table, rect), slot in adapter.local_slots(adapter.lookups()).items():
            key = _key(path, table)
            out[(key, rect)] = LocalSlot(key, rect, slot.tensors)
    return out


def _plain_weight(module: nn.Module, table: str) -> torch.Tensor:
    if isinstance(module, EmbeddingBagCollection):
        return module.embedding_bags[table].weight
    return module.embeddings[table].weight


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
        for name, rows, cols in _plain_tables(module):
            key = _key(path, name)
            tensors = {"weight": _plain_weight(module, name).detach()}
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


# -------------------------------------------------------------------- facts


@dataclass
class _Facts:
    """What a participant tells the others before anything moves."""

    old_ranks: Optional[List[int]] = None
    new_ranks: Optional[List[int]] = None
    old_plan: Optional[ShardingPlan] = None
    tables: Optional[Dict[str, List[TableShape]]] = None
    defined_tables: Optional[Dict[str, List[TableShape]]] = None
    table_facts: Optional[Dict[str, TableFacts]] = None
    dense: Optional[List[Tuple[str, Tuple[int, ...], str]]] = None
    has_optimizer: bool = False
    pipelined: Optional[List[str]] = None
    kept_runs: Optional[Dict[str, List[List[str]]]] = None


def _plan_text(plan: ShardingPlan) -> str:
    return "\n".join(
        f"{path}:{table}={describe_parameter_sharding(ps)}"
        for path in sorted(plan.plan)
        for table, ps in sorted(plan.plan[path].items())
    )


def _digest(*parts: str) -> int:
    text = "\n".join(parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _model_facts(model: nn.Module, optimizer: Optional[KeyedOptimizer]) -> _Facts:
    root = model.module
    modules = sharded_modules(root)
    dense = dense_tensors(root)
    return _Facts(
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


def _defined_tables(
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
        out[path] = _plain_tables(module)
    return out


def _validate_new_plan(
    plan: ShardingPlan,
    tables: Mapping[str, Sequence[TableShape]],
    world_size: int,
    device_type: str,
) -> None:
    if set(plan.plan) != set(tables):
        raise ReshardError(
            f"the new plan covers modules {sorted(plan.plan)}, the model has "
            f"sharded modules {sorted(tables)}"
        )
    for path, shapes in tables.items():
        names = {t[0] for t in shapes}
        if set(plan.plan[path]) != names:
            raise ReshardError(
                f"module '{path}': the new plan covers tables "
                f"{sorted(plan.plan[path])}, the module has {sorted(names)}"
            )
        for name, rows, cols in shapes:
            try:
                validate_parameter_sharding(
                    name, plan.plan[path][name], rows, cols, world_size, device_type
                )
            except ReshardError as e:
                raise ReshardError(f"module '{path}': {e}") from None


def _unique(values: Sequence[Any], what: str) -> Any:
    present = [v for v in values if v is not None]
    distinct: List[Any] = []
    for v in present:
        if v not in distinct:
            distinct.append(v)
    if len(distinct) > 1:
        raise ReshardError(f"ranks passed different {what}: {distinct}")
    return distinct[0] if distinct else None


@dataclass
class _Agreed:
    """What every participant knows after the agreement."""

    union: List[int]
    old_ranks: List[int]
    new_ranks: List[int]
    old_plan: ShardingPlan
    tables: Dict[str, List[TableShape]]
    table_facts: Dict[str, TableFacts]
    dense: List[Tuple[str, Tuple[int, ...], str]]
    has_optimizer: bool


def _check_agreement(union: List[int], all_facts: Sequence[_Facts]) -> _Agreed:
    """The same checks on every rank, on the same facts: the same outcome."""
    old_ranks = _unique([f.old_ranks for f in all_facts], "old groups")
    new_ranks = _unique([f.new_ranks for f in all_facts], "new groups")
    if old_ranks is None or new_ranks is None:
        raise ReshardError("no rank passed the model, or no rank the new group")
    if sorted(set(old_ranks) | set(new_ranks)) != union:
        raise ReshardError(
            f"the participants {union} must be the old group {old_ranks} and the "
            f"new group {new_ranks} together"
        )
    for rank, facts in zip(union, all_facts):
        if rank in old_ranks and facts.old_ranks is None:
            raise ReshardError(f"rank {rank} is in the old group but passed no model")
        if rank in new_ranks and facts.new_ranks is None:
            raise ReshardError(f"rank {rank} is in the new group but passed no env")
    for rank, facts in zip(union, all_facts):
        if facts.pipelined:
            raise ReshardError(
                f"rank {rank}: modules {facts.pipelined} are attached to a train "
                "pipeline, whose batches in flight went through the old group's "
                "input dist; call pipeline.detach() before the move (run the "
                "pipeline dry first to train those batches) and build a pipeline "
                "on the moved model"
            )
    model_tables = _unique(
        [f.tables for f, r in zip(all_facts, union) if r in old_ranks], "models"
    )
    for rank, facts in zip(union, all_facts):
        defined = facts.defined_tables
        if defined is not None and defined != model_tables:
            raise ReshardError(
                f"the model definition of rank {rank} has the tables {defined}, "
                f"the model {model_tables}"
            )
    holders = [f for f, r in zip(all_facts, union) if r in old_ranks]
    table_facts = {
        path: merge_table_facts([f.table_facts[path] for f in holders if f.table_facts])
        for path in model_tables
    }
    return _Agreed(
        union,
        old_ranks,
        new_ranks,
        holders[0].old_plan,
        model_tables,
        table_facts,
        holders[0].dense or [],
        holders[0].has_optimizer,
    )


def _fields(agreed: _Agreed) -> Dict[str, List[Field]]:
    return {
        _key(path, name): agreed.table_facts[path].fields_of(name)
        for path, shapes in agreed.tables.items()
        for name, _, _ in shapes
    }


# ------------------------------------------------------------------ moving


def _move_tables(
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
    in_place = set(kept_in_place(old_slots, new_slots))
    for key in in_place:
        report.bytes_kept_in_place += slot_bytes(new_slots[key])
    merges = RowwiseMerges()
    with torch.no_grad():
        zero_undelivered_state(new_slots, fields, in_place)
        for transfer in plan.local_copies(rank):
            if (transfer.table, transfer.dst_rect) in in_place:
                continue  # the new kernel already holds it: same memory
            src = old_slots[(transfer.table, transfer.src_rect)]
            dst = new_slots[(transfer.table, transfer.dst_rect)]
            for f in fields[transfer.table]:
                piece = read_piece(src, transfer, f)
                write_piece(dst, transfer, f, piece, merges)
                report.bytes_copied_locally += piece.numel() * piece.element_size()
        report.bytes_sent, report.bytes_received = exchange_pieces(
            plan,
            fields,
            rank,
            dist.get_world_size(group),
            group,
            read_piece=lambda t, f: read_piece(old_slots[(t.table, t.src_rect)], t, f),
            write_piece=lambda t, f, data: write_piece(
                new_slots[(t.table, t.dst_rect)], t, f, data, merges
            ),
            device=torch.device("cpu"),
            max_inflight_bytes=options.max_inflight_bytes,
            target_piece=lambda t, f: target_piece(
                new_slots[(t.table, t.dst_rect)], t, f
            ),
        )
        merges.finish()


def _broadcast_dense(
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


# ------------------------------------------------------------ kept storage


@dataclass
class _KeptRun:
    """
    Shards of tables whose layout a move leaves as it is, at consecutive
    positions of one old batched kernel of a rank that stays: the new model's
    kernel for them can be built on a view of the old kernel's storage.

    Args:
        path (str): the sharded module's path.
        kernel (nn.Module): the old fbgemm kernel.
        first (int): the position of the first shard in it.
        shards (List[ShardKey]): the shards, in kernel order.
    """

    path: str
    kernel: nn.Module
    first: int
    shards: List[ShardKey]


def _unchanged_tables(
    module: nn.Module,
    path: str,
    old_plan: ShardingPlan,
    new_plan: ShardingPlan,
    old_ranks: Sequence[int],
    new_ranks: Sequence[int],
) -> List[str]:
    """
    Tables of a sharded module that a move leaves exactly where they are: the
    same shards on the same global ranks, the same sharding type and compute
    kernel. Data-parallel tables are left out: building a module broadcasts
    their weights over the new group, which would write into kept storage.
    """
    adapter = adapter_for(module)
    out: List[str] = []
    for config in adapter.configs():
        name = config.name
        old_ps, new_ps = old_plan.plan[path][name], new_plan.plan[path][name]
        if (old_ps.sharding_type, old_ps.compute_kernel) != (
            new_ps.sharding_type,
            new_ps.compute_kernel,
        ):
            continue
        rows, cols = adapter.table_shape(name)
        old = layout_from_parameter_sharding(old_ps, rows, cols, len(old_ranks))
        new = layout_from_parameter_sharding(new_ps, rows, cols, len(new_ranks))
        old = old.remap_ranks(dict(enumerate(old_ranks)))
        new = new.remap_ranks(dict(enumerate(new_ranks)))
        if old == new and not old.replicated:
            out.append(name)
    return out


def _kept_runs(
    model: nn.Module,
    new_plan: ShardingPlan,
    new_ranks: Sequence[int],
) -> List[_KeptRun]:
    """
    On a rank that stays, the runs of kept shards in its old kernels: maximal
    runs of consecutive shards of unchanged tables, at most
    ``MAX_KERNELS_PER_GROUP - 1`` per sharding group (the largest), so that
    a group of the new model has at most ``MAX_KERNELS_PER_GROUP`` kernels.
    """
    old_ranks = dist.get_process_group_ranks(model._env.process_group)
    out: List[_KeptRun] = []
    for path, module in sharded_modules(model.module).items():
        unchanged = set(
            _unchanged_tables(module, path, model.plan, new_plan, old_ranks, new_ranks)
        )
        if not unchanged:
            continue
        runs: List[_KeptRun] = []
        for _, _, lookup in adapter_for(module).groups():
            group_runs: List[Tuple[int, _KeptRun]] = []
            for batched in batched_kernels(lookup):
                tables = list(batched.config.embedding_tables)
                position = 0
                while position < len(tables):
                    if tables[position].name not in unchanged:
                        position += 1
                        continue
                    first = position
                    while position < len(tables) and tables[position].name in (
                        unchanged
                    ):
                        position += 1
                    run = tables[first:position]
                    size = sum(t.local_rows * t.local_cols for t in run)
                    shards = [shard_key(t) for t in run]
                    group_runs.append(
                        (size, _KeptRun(path, batched.emb_module, first, shards))
                    )
            group_runs.sort(key=lambda x: -x[0])
            runs += [run for _, run in group_runs[: MAX_KERNELS_PER_GROUP - 1]]
        out += runs
    return out


def _run_facts(runs: Sequence[_KeptRun]) -> Dict[str, List[List[str]]]:
    """
    What the other ranks need of a rank's kept runs: per module, the tables of
    each run (a run's position in its module's list numbers it).
    """
    out: Dict[str, List[List[str]]] = {}
    for run in runs:
        out.setdefault(run.path, []).append([name for name, _ in run.shards])
    return out


def _batch_keys(
    union: Sequence[int],
    all_facts: Sequence[_Facts],
    new_plan: ShardingPlan,
    new_ranks: Sequence[int],
) -> Dict[str, Dict[str, str]]:
    """
    The batch key (TorchRec's ``_batch_key`` grouping fused param) of every
    table in a run of kept shards, the same on every rank: the runs it is in
    (rank and number), so the shards of one run get a kernel of their own on
    its rank and the tables of each new rank group alike everywhere. A module's
    sharding group that would get more than ``MAX_KERNELS_PER_GROUP`` kernels
    on a rank gets no keys (one kernel, kept tables copied).

    Returns:
        Dict[str, Dict[str, str]]: module path -> table -> batch key suffix.
    """
    runs: Dict[str, Dict[str, List[str]]] = {}
    for rank, facts in zip(union, all_facts):
        for path, path_runs in sorted((facts.kept_runs or {}).items()):
            for index, tables in enumerate(path_runs):
                for table in tables:
                    ids = runs.setdefault(path, {}).setdefault(table, [])
                    if f"{rank}.{index}" not in ids:
                        ids.append(f"{rank}.{index}")
    keys: Dict[str, Dict[str, str]] = {}
    for path, tables in sorted(runs.items()):
        path_keys = {
            table: f"#move:{path}:{'+'.join(sorted(ids))}"
            for table, ids in tables.items()
        }
        # kernels per (sharding type, new group-local rank)
        kernels: Dict[Tuple[str, int], Set[str]] = {}
        for table, ps in new_plan.plan[path].items():
            for rank in set(ps.ranks or range(len(new_ranks))):
                kernels.setdefault((ps.sharding_type, rank), set()).add(
                    path_keys.get(table, "")
                )
        crowded = {
            sharding_type
            for (sharding_type, _), ks in kernels.items()
            if len(ks) > MAX_KERNELS_PER_GROUP
        }
        keys[path] = {
            table: key
            for table, key in path_keys.items()
            if new_plan.plan[path][table].sharding_type not in crowded
        }
    return keys


class _MoveStorage(KeptStorage):
    """
    The kernel build hooks of a model built by a move: kernels skip their
    initialisation (every byte is moved in), tables in runs of kept shards
    get the agreed batch keys, and on a rank that stays the kernel of each such
    run is built on a view of the old kernel's storage (nothing copied, the
    old model unchanged: a move never writes kept pieces). Sharded modules make
    their tables' ShardedTensors from the agreed plan, without a collective
    per table.
    :meth:`KeptStorage.release` afterwards gives back the pages of departed
    tables that nobody references.

    Args:
        definition (nn.Module): the unsharded model the new one is built from.
        keys (Mapping[str, Mapping[str, str]]): module path -> table -> batch
            key suffix (the same on every rank).
        runs (Sequence[_KeptRun]): this rank's runs of kept shards (none on a
            rank that joins).
        old_batched (Sequence[nn.Module]): the old model's batched kernels.
    """

    def __init__(
        self,
        definition: nn.Module,
        keys: Mapping[str, Mapping[str, str]],
        runs: Sequence[_KeptRun],
        old_batched: Sequence[nn.Module],
    ) -> None:
        super().__init__(old_batched, set(), reuse=bool(runs))
        # the tables' parameters in the definition (held: their ids key _keys)
        self._params: List[torch.Tensor] = []
        self._keys: Dict[int, str] = {}
        for path, table_keys in keys.items():
            module = definition.get_submodule(path)
            for table, key in table_keys.items():
                param = _plain_weight(module, table)
                self._params.append(param)
                self._keys[id(param)] = key
        # batch key -> (old kernel, first position, shards) of each kept run
        self._runs: Dict[str, List[Tuple[nn.Module, int, List[ShardKey]]]] = {}
        for run in runs:
            table_keys = keys.get(run.path, {})
            start = 0
            for i in range(1, len(run.shards) + 1):
                key = table_keys.get(run.shards[start][0])
                if i < len(run.shards) and table_keys.get(run.shards[i][0]) == key:
                    continue
                if key is not None:
                    self._runs.setdefault(key, []).append(
                        (run.kernel, run.first + start, run.shards[start:i])
                    )
                start = i

    def table_fused_params(
        self, table: str, param: torch.Tensor, fused_params: Dict[str, Any]
    ) -> Dict[str, Any]:
        key = self._keys.get(id(param))
        if key is None:
            return fused_params
        out = dict(fused_params)
        out[BATCH_KEY] = f"{out.get(BATCH_KEY, '')}{key}"
        return out

    def sharded_tensors_from_plan(self) -> bool:
        # the plan is agreed and validated: no collective per table is needed
        return True

    def _kept_run(
        self, config: GroupedEmbeddingConfig, kernel_type: type
    ) -> Optional[Tuple[nn.Module, int, int]]:
        tables = list(config.embedding_tables)
        keys = {str((t.fused_params or {}).get(BATCH_KEY, "")) for t in tables}
        if len(keys) != 1:
            return None
        key = keys.pop().rpartition("#move:")
        shards = [shard_key(t) for t in tables]
        for kernel, first, run in self._runs.get("#move:" + key[2], []):
            if run == shards and type(kernel) is kernel_type:
                return kernel, first, len(shards)
        return None

    def release(self, module: nn.Module) -> int:
        self._runs = {}  # the old kernels must not count as holders
        return super().release(module)


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


def _build(
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


def _release(model: nn.Module) -> None:
    model._release()


def _release_kept_storage(hooks: KeptStorage, new_model: nn.Module) -> int:
    """
    Once the old model is released: gives the pages of departed tables in
    storage that kept tables share back to the OS, where nobody but the new
    model's sharded modules (kernels, fused optimizers, state-dict views)
    references it; what else references it counts as a caller's.

    Returns:
        int: resident bytes given back.
    """
    sharded = nn.ModuleList(sharded_modules(new_model.module).values())
    return hooks.release(sharded)


def _agree(
    union: List[int], digest: int, error: Optional[str], facts: Any, timeout: Any
) -> Agreement:
    return agree_among(union, digest, error, facts, timeout)


@dataclass
class _Request:
    """One rank's view of a move, agreed on by every participant."""

    union: List[int]
    me: int
    agreed: _Agreed
    digest: int
    definition: Optional[nn.Module]
    sharders: Optional[List[Any]]
    device: torch.device
    kept: List[_KeptRun] = field(default_factory=list)
    batch_keys: Dict[str, Dict[str, str]] = field(default_factory=dict)

    @property
    def role(self) -> str:
        if self.me in self.agreed.old_ranks:
            return "stayed" if self.me in self.agreed.new_ranks else "left"
        return "joined"

    def transfers(self, new_plan: ShardingPlan) -> ReshardPlan:
        agreed = self.agreed
        return _transfers(
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
    facts = _Facts()
    kept: List[_KeptRun] = []
    error: Optional[str] = None
    try:
        if me not in union:
            raise ReshardError(f"rank {me} calls but is not among {union}")
        if model is not None:
            facts = _model_facts(model, optimizer)
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
            facts.defined_tables = _defined_tables(definition, new_plan)
            _validate_new_plan(
                new_plan, facts.defined_tables, len(facts.new_ranks), device.type
            )
            if model is not None and _may_keep_storage(model, device, options):
                try:
                    kept = _kept_runs(model, new_plan, facts.new_ranks)
                except Exception:  # an optimisation only: copy every piece
                    logger.exception("model move: kept storage skipped")
                    kept = []
                facts.kept_runs = _run_facts(kept)
    except ReshardError as e:
        error = str(e)
    digest = _digest(kind, _plan_text(new_plan), str(union))
    agreement = _agree(union, digest, error, facts, options.exchange_timeout)
    agreed = _check_agreement(union, agreement.facts)
    batch_keys = _batch_keys(union, agreement.facts, new_plan, agreed.new_ranks)
    return _Request(
        union, me, agreed, digest, definition, sharders, device, kept, batch_keys
    )


def _may_keep_storage(
    model: nn.Module, device: torch.device, options: ReshardOptions
) -> bool:
    """Whether the new model on this rank may take over the old one's storage."""
    return (
        options.storage == StorageMode.REUSE
        and device == model.device
        and storage_reuse_supported(device)
    )


def _old_batched(model: Optional[nn.Module]) -> List[nn.Module]:
    """The batched kernels of every sharded module of a model (none for None)."""
    if model is None:
        return []
    return [
        batched
        for module in sharded_modules(model.module).values()
        for lookup in adapter_for(module).lookups()
        for batched in batched_kernels(lookup)
    ]


def _build_on_new_group(
    request: _Request,
    model: Optional[nn.Module],
    new_env: Optional[ShardingEnv],
    new_plan: ShardingPlan,
    options: ReshardOptions,
) -> Tuple[Optional[nn.Module], Optional[_MoveStorage], Agreement]:
    """
    Phase 2: every rank of the new group builds the model; all agree it did.
    Kernels of kept shards take over the old kernels' storage (see
    :class:`_MoveStorage`); the returned hooks hold it until the move ends.
    """
    new_model: Optional[nn.Module] = None
    hooks: Optional[_MoveStorage] = None
    error: Optional[str] = None
    if new_env is not None:
        try:
            assert request.definition is not None
            hooks = _MoveStorage(
                request.definition,
                request.batch_keys,
                request.kept,
                _old_batched(model) if request.kept else [],
            )
            new_model = _build(
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
            _release(new_model)
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
    _move_tables(
        plan, _fields(agreed), old_slots, new_slots, me, group, options, report
    )
    del old_slots, new_slots
    report.dense_bytes = _broadcast_dense(
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
            _release(new_model)
        # the old model keeps its storage as it is: nothing of it is released
        new_model = hooks = None
        raise ReshardAbortedError(
            f"rank {request.me}: moving the model failed ({type(e).__name__}: "
            f"{e}); the model on the old group is unchanged"
        ) from e
    close_exchange_group(group)

    if model is not None:
        _release(model)
    if hooks is not None and new_model is not None:
        report.bytes_released = _release_kept_storage(hooks, new_model)
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
    fields = _fields(request.agreed)
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
    facts = _model_facts(model, None)
    facts.new_ranks = group_ranks  # gathered within the model's own group
    agreement = _agree(
        group_ranks,
        _digest("unshard", str(dst), str(optimizer_state)),
        error,
        facts,
        options.exchange_timeout,
    )
    agreed = _check_agreement(group_ranks, agreement.facts)
    fields = _fields(agreed)
    if not optimizer_state:
        fields = {k: [f for f in v if f.name == "weight"] for k, v in fields.items()}
    target = group_ranks[dst]
    plan = _transfers(
        plan_layouts(agreed.old_plan, agreed.tables, group_ranks),
        _whole_on(agreed.tables, target),
        group_ranks,
    )
    modules: Dict[str, nn.Module] = {}
    state: Dict[str, Dict[str, Dict[str, torch.Tensor]]] = {}
    if me == target:
        for path, module in sharded_modules(model.module).items():
            modules[path] = _plain_twin(module, torch.device("meta")).to_empty(
                device=torch.device("cpu")
            )
    report = MoveReport(me, "destination" if me == target else "source")
    group = open_exchange_group_among(
        group_ranks, agreement.transaction, options.exchange_timeout
    )
    try:
        _move_tables(
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
        defined = _defined_tables(module, plan)
        _validate_new_plan(plan, defined, len(group_ranks), device.type)
        if me == source:
            dense = [
                (n, tuple(t.shape), str(t.dtype))
                for n, t in _plain_dense(module, plan).items()
            ]
    except ReshardError as e:
        error = str(e)
    agreement = _agree(
        group_ranks,
        _digest("shard_from_rank", _plan_text(plan), str(src)),
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
        new_model = _build(module, env, plan, sharders, device)
    except Exception as e:
        error = f"sharding the model failed: {type(e).__name__}: {e}"
    built = _agree(group_ranks, _digest("built"), error, None, options.exchange_timeout)
    assert new_model is not None
    fields = {
        _key(path, name): [
            Field("weight", FieldKind.RECT, _weight_dtype(new_model, path, name))
        ]
        for path, shapes in tables.items()
        for name, _, _ in shapes
    }
    transfers = _transfers(
        _whole_on(tables, source), plan_layouts(plan, tables, group_ranks), group_ranks
    )
    report = MoveReport(me, "source" if me == source else "destination")
    group = open_exchange_group_among(
        group_ranks, built.transaction, options.exchange_timeout
    )
    try:
        _move_tables(
            transfers,
            fields,
            _plain_slots(plain, fields, None),
            sharded_slots(new_model.module),
            group_ranks.index(me),
            group,
            options,
            report,
        )
        report.dense_bytes = _broadcast_dense(
            dense_specs,
            source_dense,
            dense_tensors(new_model.module),
            group_ranks.index(source),
            group,
        )
        dist.barrier(group=group)
    except Exception as e:
        close_exchange_group(group)
        _release(new_model)
        raise ReshardAbortedError(
            f"rank {me}: sharding from rank {src} failed ({type(e).__name__}: {e})"
        ) from e
    close_exchange_group(group)
    return new_model


def _plain_dense(module: nn.Module, plan: ShardingPlan) -> Dict[str, torch.Tensor]:
    """The parameters and buffers of an unsharded model outside planned modules."""
    paths = list(plan.plan)
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return dict(sorted((n, t) for n, t in tensors if _is_dense(n, paths)))


def _weight_dtype(model: nn.Module, path: str, table: str) -> torch.dtype:
    """The dtype a table's weight travels in (every rank knows its config)."""
    adapter = adapter_for(sharded_modules(model.module)[path])
    config = adapter.module._table_name_to_config[table]
    return data_type_to_dtype(config.data_type)

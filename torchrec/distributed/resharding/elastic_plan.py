#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Planning a move between groups of ranks (pure: no collectives, no modules, no
kernels).

A move is numbered in its participants: the union of the old and the new
group, sorted by global rank; a transaction rank is a position in it. Layouts
of a plan are read once, in that numbering (``whole_plan.plan_layouts``,
where every operation on a whole plan lives). Before
anything moves, every participant states its facts (:class:`MoveFacts`, as
large as its own part: the groups, the plan and the dense part travel whole
only from the first rank of the old group, the others send digests of
theirs), and the coordinator turns them into one :class:`AgreedMove` with the
same checks for everyone (:func:`check_move_agreement`).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torchrec.distributed.resharding.device_memory import placement_of, TablePlacement
from torchrec.distributed.resharding.fields import (
    Field,
    merge_table_facts,
    TableFacts,
    TableKey,
)
from torchrec.distributed.resharding.plan import (
    PlacedShard,
    Rect,
    ReshardError,
    TableLayout,
)
from torchrec.distributed.resharding.plan_validation import (
    MOVABLE_COMPUTE_KERNELS,
    text_digest,
    validate_parameter_sharding,
)
from torchrec.distributed.resharding.whole_plan import (  # noqa: F401
    plan_digest,
    plan_layouts,
    TableShape,
)
from torchrec.distributed.types import ShardingPlan


@dataclass(frozen=True)
class DenseSpec:
    """
    One tensor of a model's dense (replicated) part.

    Args:
        name (str): its name in the model.
        shape (Tuple[int, ...]): its shape.
        dtype (torch.dtype): its dtype.
    """

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def dense_specs(tensors: Mapping[str, torch.Tensor]) -> List[DenseSpec]:
    """The specs of dense tensors, by name."""
    return [DenseSpec(n, tuple(t.shape), t.dtype) for n, t in sorted(tensors.items())]


def plan_placements(
    plan: ShardingPlan,
    tables: Mapping[str, Sequence[TableShape]],
    device_type: str,
) -> Dict[str, TablePlacement]:
    """
    Where the kernels a plan builds keep each table's state on a rank with a
    device of ``device_type`` (the device memory pre-flight's placements).

    Args:
        plan (ShardingPlan): the new plan.
        tables (Mapping[str, Sequence[TableShape]]): module path -> tables.
        device_type (str): this rank's device type.

    Returns:
        Dict[str, TablePlacement]: "path:table" -> its placement.
    """
    out: Dict[str, TablePlacement] = {}
    for path, shapes in tables.items():
        for name, _, _ in shapes:
            ps = plan.plan[path][name]
            cache = ps.cache_params
            fused = {}
            if cache is not None:
                fused = {
                    "cache_load_factor": cache.load_factor,
                    "cache_algorithm": cache.algorithm,
                }
            out[TableKey(path, name)] = placement_of(
                ps.compute_kernel, device_type, ps.sharding_type, fused
            )
    return out


def whole_on(
    tables: Mapping[str, Sequence[TableShape]], rank: int
) -> Dict[str, TableLayout]:
    """Every table whole on one (transaction) rank."""
    return {
        TableKey(path, name): TableLayout(
            rows, cols, (PlacedShard(rank, Rect(0, 0, rows, cols)),)
        )
        for path, shapes in sorted(tables.items())
        for name, rows, cols in shapes
    }


def request_digest(*parts: str) -> int:
    return text_digest("\n".join(parts))


@dataclass
class MoveFacts:
    """
    What a participant tells the coordinator before anything moves. Whole
    values travel from the old group's first rank only (``old_plan``,
    ``tables``, ``dense``, the groups); every rank of a group sends digests
    of what it holds, so the coordinator can check that they agree.

    Args:
        old_group (Optional[int]): digest of the old group's ranks (ranks of
            the old group).
        new_group (Optional[int]): digest of the new group's ranks (ranks of
            the new group).
        old_ranks (Optional[List[int]]): the old group's global ranks (from
            the old group's first rank).
        new_ranks (Optional[List[int]]): the new group's global ranks (from
            the new group's first rank).
        old_plan (Optional[ShardingPlan]): the model's plan (old group's first
            rank).
        plan (Optional[int]): digest of the model's plan (old group).
        tables (Optional[Dict[str, List[TableShape]]]): the model's tables
            (old group's first rank).
        model (Optional[int]): digest of the model's tables (old group).
        defined (Optional[int]): digest of the tables of the definition a
            rank of the new group builds from.
        defined_text (Optional[str]): those tables, as text (for messages).
        table_facts (Optional[Dict[str, TableFacts]]): the facts of this rank's
            table shards, per module path (old group).
        dense (Optional[List[DenseSpec]]): the dense part (old group's first
            rank).
        has_optimizer (bool): a dense optimizer is passed (old group).
        pipelined (Optional[List[str]]): modules attached to a train pipeline.
        kept_runs (Optional[Dict[str, List[List[str]]]]): this rank's runs of
            kept shards (``kept_grouping.run_facts``).
        device_type (str): the type of this rank's device (the model's, or
            the one a joining rank builds on).
    """

    old_group: Optional[int] = None
    new_group: Optional[int] = None
    old_ranks: Optional[List[int]] = None
    new_ranks: Optional[List[int]] = None
    old_plan: Optional[ShardingPlan] = None
    plan: Optional[int] = None
    tables: Optional[Dict[str, List[TableShape]]] = None
    model: Optional[int] = None
    defined: Optional[int] = None
    defined_text: Optional[str] = None
    table_facts: Optional[Dict[str, TableFacts]] = None
    dense: Optional[List[DenseSpec]] = None
    has_optimizer: bool = False
    pipelined: Optional[List[str]] = None
    kept_runs: Optional[Dict[str, List[List[str]]]] = None
    device_type: str = "cpu"


def tables_digest(tables: Mapping[str, Sequence[TableShape]]) -> int:
    return text_digest(repr(sorted((p, list(t)) for p, t in tables.items())))


def ranks_digest(ranks: Sequence[int]) -> int:
    return text_digest(",".join(str(r) for r in ranks))


@dataclass
class AgreedMove:
    """What every participant knows after the agreement."""

    union: List[int]
    old_ranks: List[int]
    new_ranks: List[int]
    old_plan: ShardingPlan
    tables: Dict[str, List[TableShape]]
    table_facts: Dict[str, TableFacts]
    dense: List[DenseSpec]
    has_optimizer: bool
    # module path -> table -> its batch key (``kept_grouping.batch_keys``)
    batch_keys: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # the device type every participant exchanges on: theirs when they all
    # have the same (NCCL on CUDA), else the host (gloo)
    exchange_device_type: str = "cpu"
    # whether some participant's CUDA state travels through the host exchange
    staged: bool = False

    def transaction_ranks(self, group: Sequence[int]) -> List[int]:
        """The transaction rank of each rank of a group."""
        index = {g: i for i, g in enumerate(self.union)}
        return [index[g] for g in group]

    def fields(self) -> Dict[str, Tuple[Field, ...]]:
        """The fields of every table, by "path:table"."""
        return {
            TableKey(path, name): self.table_facts[path].fields_of(name)
            for path, shapes in self.tables.items()
            for name, _, _ in shapes
        }


def _one_value(values: Sequence[Any], what: str) -> Any:
    present = [v for v in values if v is not None]
    distinct: List[Any] = []
    for v in present:
        if v not in distinct:
            distinct.append(v)
    if len(distinct) > 1:
        raise ReshardError(f"ranks passed different {what}")
    return distinct[0] if distinct else None


def check_move_agreement(
    union: List[int], all_facts: Sequence[MoveFacts]
) -> AgreedMove:
    """
    The coordinator's checks of every participant's facts.

    Args:
        union (List[int]): the participants' global ranks, sorted.
        all_facts (Sequence[MoveFacts]): their facts, in that order.

    Returns:
        AgreedMove: the move every participant runs.

    Raises:
        ReshardError: naming the rank and the reason.
    """
    _one_value([f.old_group for f in all_facts], "old groups")
    _one_value([f.new_group for f in all_facts], "new groups")
    old_ranks = _one_value([f.old_ranks for f in all_facts], "old groups")
    new_ranks = _one_value([f.new_ranks for f in all_facts], "new groups")
    if old_ranks is None or new_ranks is None:
        raise ReshardError("no rank passed the model, or no rank the new group")
    if sorted(set(old_ranks) | set(new_ranks)) != union:
        raise ReshardError(
            f"the participants {union} must be the old group {old_ranks} and the "
            f"new group {new_ranks} together"
        )
    for rank, facts in zip(union, all_facts):
        if rank in old_ranks and facts.old_group is None:
            raise ReshardError(f"rank {rank} is in the old group but passed no model")
        if rank in new_ranks and facts.new_group is None:
            raise ReshardError(f"rank {rank} is in the new group but passed no env")
        if facts.pipelined:
            raise ReshardError(
                f"rank {rank}: modules {facts.pipelined} are attached to a train "
                "pipeline, whose batches in flight went through the old group's "
                "input dist; call pipeline.detach() before the move (run the "
                "pipeline dry first to train those batches) and build a pipeline "
                "on the moved model"
            )
    holders = [f for f, r in zip(all_facts, union) if r in old_ranks]
    _one_value([f.plan for f in holders], "model plans")
    model = _one_value([f.model for f in holders], "models")
    first = all_facts[union.index(old_ranks[0])]
    if first.old_plan is None or first.tables is None:
        raise ReshardError(f"rank {old_ranks[0]} passed no model")
    for rank, facts in zip(union, all_facts):
        if facts.defined is not None and facts.defined != model:
            raise ReshardError(
                f"the model definition of rank {rank} has the tables "
                f"{facts.defined_text}, the model {first.tables}"
            )
    table_facts = {
        path: merge_table_facts([f.table_facts[path] for f in holders if f.table_facts])
        for path in first.tables
    }
    return AgreedMove(
        union,
        old_ranks,
        new_ranks,
        first.old_plan,
        first.tables,
        table_facts,
        first.dense or [],
        first.has_optimizer,
        exchange_device_type=exchange_device_type([f.device_type for f in all_facts]),
        staged=staged_on_host([f.device_type for f in all_facts]),
    )


def exchange_device_type(device_types: Sequence[str]) -> str:
    """
    Where the participants of a move exchange: on their device when every one
    has a device of the same type (CUDA: NCCL, straight between the kernels'
    memory), else on the host (gloo, through host buffers).

    Args:
        device_types (Sequence[str]): each participant's device type.

    Returns:
        str: the exchange's device type.
    """
    types = set(device_types)
    return types.pop() if len(types) == 1 else "cpu"


def staged_on_host(device_types: Sequence[str]) -> bool:
    """
    Whether a move stages CUDA state in host memory: some participants have
    a GPU, not all of them a device of its type (:func:`exchange_device_type`).

    Args:
        device_types (Sequence[str]): each participant's device type.

    Returns:
        bool: CUDA state travels through the host exchange.
    """
    return "cuda" in device_types and exchange_device_type(device_types) == "cpu"


def check_movable_kernels(plan: ShardingPlan) -> None:
    """
    Checks that every table of a running model's plan sits in a kernel whose
    state can be read (before any byte moves: a move, an unshard).

    Args:
        plan (ShardingPlan): the model's plan.

    Raises:
        ReshardError: naming the module, the table and its compute kernel.
    """
    for path in sorted(plan.plan):
        for name, ps in sorted(plan.plan[path].items()):  # pyre-ignore[16]
            if ps.compute_kernel not in MOVABLE_COMPUTE_KERNELS:
                raise ReshardError(
                    f"module '{path}': table '{name}': its compute kernel "
                    f"'{ps.compute_kernel}' cannot be moved (movable: "
                    f"{', '.join(MOVABLE_COMPUTE_KERNELS)})"
                )


def validate_new_plan(
    plan: ShardingPlan,
    tables: Mapping[str, Sequence[TableShape]],
    world_size: int,
    device_type: str,
    rank: Optional[int] = None,
    device_index: Optional[int] = None,
) -> None:
    """
    Checks a plan for a model's modules on a group of ``world_size`` ranks
    (the shards of group rank ``rank``, if given, on its device's index).

    Raises:
        ReshardError: naming the module, table and reason.
    """
    if not isinstance(plan, ShardingPlan):
        raise ReshardError(f"expected a ShardingPlan, got {type(plan).__name__}")
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
                    name,
                    plan.plan[path][name],
                    rows,
                    cols,
                    world_size,
                    device_type,
                    rank,
                    device_index,
                )
            except ReshardError as e:
                raise ReshardError(f"module '{path}': {e}") from None

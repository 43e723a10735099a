#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Planning a move between groups of ranks (pure: no collectives, no modules).

Layouts of a plan in global ranks, the transfers of a move numbered in the
participants' ranks, and the facts every participant shares before anything
moves, with the checks that turn them into one agreed move (the same outcome
on every rank, since every rank checks the same facts).
"""

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from torchrec.distributed.resharding.exchange import Field
from torchrec.distributed.resharding.optimizer_state import (
    merge_table_facts,
    TableFacts,
)
from torchrec.distributed.resharding.plan import (
    describe_parameter_sharding,
    layout_from_parameter_sharding,
    PlacedShard,
    plan_table_transfers,
    Rect,
    ReshardError,
    ReshardPlan,
    TableLayout,
    Transfer,
    validate_parameter_sharding,
)
from torchrec.distributed.types import ShardingPlan

# table of a module: (name, rows, columns)
TableShape = Tuple[str, int, int]


def table_key(path: str, table: str) -> str:
    """The key of a table of a module across a move: "path:table"."""
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
            out[table_key(path, name)] = layout.remap_ranks(to_global)
    return out


def whole_on(
    tables: Mapping[str, Sequence[TableShape]], rank: int
) -> Dict[str, TableLayout]:
    """Every table whole on one (global) rank."""
    return {
        table_key(path, name): TableLayout(
            rows, cols, (PlacedShard(rank, Rect(0, 0, rows, cols)),)
        )
        for path, shapes in sorted(tables.items())
        for name, rows, cols in shapes
    }


def move_transfers(
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


@dataclass
class MoveFacts:
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
    # module path -> the tables of each run of kept shards (elastic_storage)
    kept_runs: Optional[Dict[str, List[List[str]]]] = None


def plan_text(plan: ShardingPlan) -> str:
    return "\n".join(
        f"{path}:{table}={describe_parameter_sharding(ps)}"
        for path in sorted(plan.plan)
        for table, ps in sorted(plan.plan[path].items())
    )


def request_digest(*parts: str) -> int:
    text = "\n".join(parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def validate_new_plan(
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


def agreed_value(values: Sequence[Any], what: str) -> Any:
    present = [v for v in values if v is not None]
    distinct: List[Any] = []
    for v in present:
        if v not in distinct:
            distinct.append(v)
    if len(distinct) > 1:
        raise ReshardError(f"ranks passed different {what}: {distinct}")
    return distinct[0] if distinct else None


@dataclass
class AgreedMove:
    """What every participant knows after the agreement."""

    union: List[int]
    old_ranks: List[int]
    new_ranks: List[int]
    old_plan: ShardingPlan
    tables: Dict[str, List[TableShape]]
    table_facts: Dict[str, TableFacts]
    dense: List[Tuple[str, Tuple[int, ...], str]]
    has_optimizer: bool


def check_move_agreement(
    union: List[int], all_facts: Sequence[MoveFacts]
) -> AgreedMove:
    """The same checks on every rank, on the same facts: the same outcome."""
    old_ranks = agreed_value([f.old_ranks for f in all_facts], "old groups")
    new_ranks = agreed_value([f.new_ranks for f in all_facts], "new groups")
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
    model_tables = agreed_value(
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
    return AgreedMove(
        union,
        old_ranks,
        new_ranks,
        holders[0].old_plan,
        model_tables,
        table_facts,
        holders[0].dense or [],
        holders[0].has_optimizer,
    )


def move_fields(agreed: AgreedMove) -> Dict[str, List[Field]]:
    return {
        table_key(path, name): agreed.table_facts[path].fields_of(name)
        for path, shapes in agreed.tables.items()
        for name, _, _ in shapes
    }

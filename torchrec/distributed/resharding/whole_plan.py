#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Operations on a whole ``ShardingPlan`` (pure: no collectives, no modules, no
kernels).

A plan is a mapping of module paths to modules' plans, each a mapping of table
names to ``ParameterSharding``; a table is named across modules by its
:class:`~torchrec.distributed.resharding.fields.TableKey`. Every part of the
package that reads, compares or rebuilds a whole plan does it here:

- a module's plan, typed (:func:`module_plan`), and every table's layout
  (:func:`plan_layouts`) and digest (:func:`plan_digest`);
- a plan built from per-table shardings (:func:`plan_of`), a plan with some
  tables' shardings chosen anew (:func:`replace_shardings`) or taken from a
  delta (:func:`plan_with_delta`);
- the delta between two plans (:func:`plan_delta`);
- whether a table's sharding is unchanged: of the same kind
  (:func:`same_kind`) with its shards where they were
  (:func:`placement_unchanged`), or exactly as it was, down to the spec order
  of its shards (:func:`sharding_unchanged`, what kept storage needs).
"""

from typing import Callable, Dict, List, Mapping, Sequence, Tuple

from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.plan import (
    layout_from_parameter_sharding,
    Rect,
    ReshardError,
    TableLayout,
)
from torchrec.distributed.resharding.plan_validation import (
    sharding_plan_text,
    text_digest,
)
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)

# table of a module: (name, rows, columns)
TableShape = Tuple[str, int, int]

# module path -> {table name: ParameterSharding}
Delta = Mapping[str, Mapping[str, ParameterSharding]]


def module_plan(plan: ShardingPlan, path: str) -> EmbeddingModuleShardingPlan:
    """
    A module's plan, typed (``ShardingPlan.plan`` holds untyped values).

    Args:
        plan (ShardingPlan): a plan.
        path (str): a module path of ``plan``.

    Returns:
        EmbeddingModuleShardingPlan: the module's plan (the plan's own object).
    """
    found = plan.plan[path]
    assert isinstance(found, EmbeddingModuleShardingPlan), type(found)
    return found


def plan_of(modules: Delta) -> ShardingPlan:
    """
    A plan of per-table shardings.

    Args:
        modules (Mapping[str, Mapping[str, ParameterSharding]]): module path ->
            {table name: its sharding}, in the plan's order.

    Returns:
        ShardingPlan: a new plan; its modules' plans are new
        ``EmbeddingModuleShardingPlan`` objects holding the given
        ``ParameterSharding`` objects.
    """
    return ShardingPlan(
        {path: EmbeddingModuleShardingPlan(tables) for path, tables in modules.items()}
    )


def replace_shardings(
    plan: ShardingPlan,
    choose: Callable[[TableKey, ParameterSharding], ParameterSharding],
) -> ShardingPlan:
    """
    A plan with every table's sharding chosen anew.

    Args:
        plan (ShardingPlan): the plan (left unchanged).
        choose (Callable[[TableKey, ParameterSharding], ParameterSharding]): a
            table's key and its sharding in ``plan`` -> its new sharding (the
            same object for a table that keeps it).

    Returns:
        ShardingPlan: a new plan of the same modules and tables, in the same
        order.
    """
    return plan_of(
        {
            path: {
                name: choose(TableKey(path, name), sharding)
                for name, sharding in module_plan(plan, path).items()
            }
            for path in plan.plan
        }
    )


def plan_with_delta(plan: ShardingPlan, delta: Delta) -> ShardingPlan:
    """
    A plan with the shardings of a delta.

    Args:
        plan (ShardingPlan): the plan (left unchanged).
        delta (Mapping[str, Mapping[str, ParameterSharding]]): module path ->
            {table name: new sharding}, as :func:`plan_delta` gives.

    Returns:
        ShardingPlan: ``plan`` with the shardings of ``delta``; every other
        table keeps its ``ParameterSharding`` object.
    """
    modules: Dict[str, Dict[str, ParameterSharding]] = {}
    for path in plan.plan:
        tables = dict(module_plan(plan, path))
        tables.update(delta.get(path, {}))
        modules[path] = tables
    return plan_of(modules)


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


def plan_layouts(
    plan: ShardingPlan,
    tables: Mapping[str, Sequence[TableShape]],
    ranks: Sequence[int],
) -> Dict[str, TableLayout]:
    """
    Every table's layout in a plan.

    Args:
        plan (ShardingPlan): a plan for a group (group-local placements).
        tables (Mapping[str, Sequence[TableShape]]): module path -> tables.
        ranks (Sequence[int]): the transaction rank of each group-local rank.

    Returns:
        Dict[str, TableLayout]: table key -> its layout, in transaction ranks,
        paths sorted.
    """
    out: Dict[str, TableLayout] = {}
    numbering = dict(enumerate(ranks))
    for path, shapes in sorted(tables.items()):
        for name, rows, cols in shapes:
            ps = plan.plan[path][name]
            layout = layout_from_parameter_sharding(ps, rows, cols, len(ranks))
            out[TableKey(path, name)] = layout.remap_ranks(numbering)
    return out


def plan_digest(plan: ShardingPlan) -> int:
    """
    Args:
        plan (ShardingPlan): a plan.

    Returns:
        int: a digest of every table's sharding, equal on every rank that
        holds an equal plan.
    """
    return text_digest(sharding_plan_text(plan))


def same_kind(old: ParameterSharding, new: ParameterSharding) -> bool:
    """
    Args:
        old (ParameterSharding): a table's sharding.
        new (ParameterSharding): another sharding of the table.

    Returns:
        bool: both have the same sharding type and compute kernel.
    """
    return (old.sharding_type, old.compute_kernel) == (
        new.sharding_type,
        new.compute_kernel,
    )


def _placed(layout: TableLayout) -> List[Tuple[int, Rect]]:
    return sorted((s.rank, s.rect) for s in layout.shards)


def placement_unchanged(
    old: ParameterSharding,
    new: ParameterSharding,
    old_layout: TableLayout,
    new_layout: TableLayout,
) -> bool:
    """
    Whether a table stays where it is: the same kind, the same shards on the
    same ranks (in whatever spec order).

    Args:
        old (ParameterSharding): the table's sharding before.
        new (ParameterSharding): its sharding after.
        old_layout (TableLayout): its layout before.
        new_layout (TableLayout): its layout after (the same rank numbering).

    Returns:
        bool: whether the table's placement is unchanged.
    """
    return same_kind(old, new) and _placed(old_layout) == _placed(new_layout)


def sharding_unchanged(
    old: ParameterSharding,
    new: ParameterSharding,
    old_layout: TableLayout,
    new_layout: TableLayout,
) -> bool:
    """
    Whether a table stays exactly as it is: the same kind and the same
    layout, its shards in the same spec order (a kernel of the new sharding
    lays the table's storage out as the old one did).

    Args:
        old, new, old_layout, new_layout: as for :func:`placement_unchanged`.

    Returns:
        bool: whether the table's sharding is unchanged.
    """
    return same_kind(old, new) and old_layout == new_layout

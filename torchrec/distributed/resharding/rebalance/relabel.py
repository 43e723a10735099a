#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: relabel the ranks of a candidate plan so that it keeps the most bytes in
place.

A planner balances load over interchangeable ranks: any permutation of a plan's
ranks costs the same per rank (permuted), but moves different bytes from the
current plan. ``relabel_plan`` picks the permutation that maximises the bytes
each rank already holds (an assignment problem over ranks, solved with
``scipy.optimize.linear_sum_assignment``). Row-wise and data-parallel tables
(their shard ``k`` must sit on the ``k``-th rank of their set, and they load
every rank alike) keep the candidate's placement; when the candidate has
tables bound to a host (table-row-wise, grid) and the job spans several hosts,
ranks are only permuted within their host, so every host keeps its tables.
"""

from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np
from scipy.optimize import linear_sum_assignment
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.plan import TableLayout
from torchrec.distributed.resharding.rebalance.placement import (
    device_for_rank,
    sharding_for_layout,
)
from torchrec.distributed.resharding.whole_plan import (
    module_plan,
    plan_layouts,
    replace_shardings,
    TableShape,
)
from torchrec.distributed.types import ParameterSharding, ShardingPlan, ShardingType

# Tables whose placement a rank permutation leaves as the candidate has it.
FIXED_PLACEMENT_TYPES: Tuple[str, ...] = (
    ShardingType.ROW_WISE.value,
    ShardingType.DATA_PARALLEL.value,
)
# Tables bound to one host's ranks.
HOST_BOUND_TYPES: Tuple[str, ...] = (
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.GRID_SHARD.value,
)


@dataclass(frozen=True)
class Relabelling:
    """
    A candidate plan with its ranks relabelled.

    Args:
        plan (ShardingPlan): the relabelled plan.
        permutation (Tuple[int, ...]): candidate rank ``r`` became rank
            ``permutation[r]``.
        kept_bytes_raw (int): bytes of the raw candidate already on their rank.
        kept_bytes (int): the same for the relabelled plan (never fewer).
        new_bytes (int): bytes of the new layout over all ranks (the same for
            every relabelling).
    """

    plan: ShardingPlan
    permutation: Tuple[int, ...]
    kept_bytes_raw: int
    kept_bytes: int
    new_bytes: int

    @property
    def moved_bytes_raw(self) -> int:
        return self.new_bytes - self.kept_bytes_raw

    @property
    def moved_bytes(self) -> int:
        return self.new_bytes - self.kept_bytes


def kept_bytes_matrix(
    old: Mapping[str, TableLayout],
    new: Mapping[str, TableLayout],
    element_bytes: Mapping[str, int],
    world_size: int,
    keys: Sequence[str],
) -> np.ndarray:
    """
    ``K[c, r]``: bytes the new layouts place on rank ``c`` that rank ``r``
    holds under the old ones (same table, same elements).

    Args:
        old (Mapping[str, TableLayout]): layouts before, by table key.
        new (Mapping[str, TableLayout]): layouts after, by table key.
        element_bytes (Mapping[str, int]): bytes per element, by table key.
        world_size (int): ranks.
        keys (Sequence[str]): the tables to count.

    Returns:
        np.ndarray: a ``world_size x world_size`` int64 matrix.
    """
    kept = np.zeros((world_size, world_size), dtype=np.int64)
    for key in keys:
        for n in new[key].shards:
            for o in old[key].shards:
                piece = n.rect.intersect(o.rect)
                if piece is not None:
                    kept[n.rank, o.rank] += piece.numel * element_bytes[key]
    return kept


def best_permutation(
    kept: np.ndarray, hosts: Optional[Sequence[Sequence[int]]] = None
) -> Tuple[int, ...]:
    """
    The permutation of ranks maximising the kept bytes.

    Args:
        kept (np.ndarray): ``K[c, r]`` as ``kept_bytes_matrix`` gives it.
        hosts (Optional[Sequence[Sequence[int]]]): when given, ranks are only
            permuted within each of these groups.

    Returns:
        Tuple[int, ...]: candidate rank ``c`` becomes ``permutation[c]``; ties
        keep a rank's own label.
    """
    world_size = kept.shape[0]
    groups = [list(h) for h in hosts] if hosts else [list(range(world_size))]
    permutation = list(range(world_size))
    for group in groups:
        sub = kept[np.ix_(group, group)].astype(np.float64)
        # Prefer the identity among equal choices: a tiny bonus on the diagonal.
        sub = sub * 2.0 + np.eye(len(group))
        rows, cols = linear_sum_assignment(sub, maximize=True)
        for c, r in zip(rows, cols):
            permutation[group[c]] = group[r]
    return tuple(permutation)


def host_groups(
    candidate: ShardingPlan, world_size: int, local_world_size: int
) -> Optional[List[List[int]]]:
    """
    The groups of ranks a relabelling must keep apart: each host's ranks when
    the candidate has host-bound tables on a job of several hosts, else None.
    """
    if local_world_size >= world_size:
        return None
    host_bound = any(
        ps.sharding_type in HOST_BOUND_TYPES
        for path in candidate.plan
        for ps in module_plan(candidate, path).values()
    )
    if not host_bound:
        return None
    return [
        list(range(h, min(h + local_world_size, world_size)))
        for h in range(0, world_size, local_world_size)
    ]


def relabel_plan(
    current: ShardingPlan,
    candidate: ShardingPlan,
    tables: Mapping[str, Sequence[TableShape]],
    element_bytes: Mapping[str, int],
    world_size: int,
    local_world_size: Optional[int] = None,
    device_type: str = "cpu",
) -> Relabelling:
    """
    Relabels the candidate's ranks to keep the most bytes in place.

    Args:
        current (ShardingPlan): the plan the model runs under.
        candidate (ShardingPlan): the candidate (same modules and tables);
            not modified.
        tables (Mapping[str, Sequence[TableShape]]): module path -> tables.
        element_bytes (Mapping[str, int]): table key -> bytes per element.
        world_size (int): ranks.
        local_world_size (Optional[int]): ranks per host (default: one host).
        device_type (str): the shards' device type; a renamed shard lives on
            its new rank's device (``cuda:<local index>`` on GPUs).

    Returns:
        Relabelling: the relabelled plan and the bytes kept before and after;
        the relabelled plan never keeps fewer bytes than the raw candidate.
    """
    ranks = list(range(world_size))
    old = plan_layouts(current, tables, ranks)
    new = plan_layouts(candidate, tables, ranks)
    kinds = {
        TableKey(path, name): ps.sharding_type
        for path in tables
        for name, ps in module_plan(candidate, path).items()
    }
    movable = sorted(k for k in new if kinds[k] not in FIXED_PLACEMENT_TYPES)
    fixed = sorted(k for k in new if kinds[k] in FIXED_PLACEMENT_TYPES)
    kept = kept_bytes_matrix(old, new, element_bytes, world_size, movable)
    stay = int(kept_bytes_matrix(old, new, element_bytes, world_size, fixed).trace())
    lws = local_world_size or world_size
    permutation = best_permutation(kept, host_groups(candidate, world_size, lws))
    identity = tuple(range(world_size))
    new_bytes = sum(
        s.rect.numel * element_bytes[k]
        for k, layout in new.items()
        for s in layout.shards
    )
    raw = stay + int(kept.trace())
    after = stay + int(sum(kept[c, permutation[c]] for c in range(world_size)))
    if after <= raw:  # nothing to gain: never move more
        return Relabelling(candidate, identity, raw, raw, new_bytes)
    renamed = dict(enumerate(permutation))

    def relabelled(key: TableKey, sharding: ParameterSharding) -> ParameterSharding:
        if kinds.get(key, sharding.sharding_type) in FIXED_PLACEMENT_TYPES:
            return sharding
        return sharding_for_layout(
            sharding,
            new[key].remap_ranks(renamed),
            lambda r: device_for_rank(device_type, r, lws),
        )

    plan = replace_shardings(candidate, relabelled)
    return Relabelling(plan, permutation, raw, after, new_bytes)

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

from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from scipy.optimize import linear_sum_assignment
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)

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
class Block:
    """
    One shard of a table as a rectangle on a rank.

    Args:
        rank (int): the rank holding it.
        row (int): first row.
        col (int): first column.
        rows (int): number of rows.
        cols (int): number of columns.
    """

    rank: int
    row: int
    col: int
    rows: int
    cols: int

    def overlap(self, other: "Block") -> int:
        """Elements the two rectangles share (ranks ignored)."""
        rows = min(self.row + self.rows, other.row + other.rows) - max(
            self.row, other.row
        )
        cols = min(self.col + self.cols, other.col + other.cols) - max(
            self.col, other.col
        )
        return max(rows, 0) * max(cols, 0)


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


def table_blocks(sharding: ParameterSharding, rows: int, cols: int) -> List[Block]:
    """
    The rectangles of a table under ``sharding``.

    Args:
        sharding (ParameterSharding): the table's sharding.
        rows (int): the table's rows.
        cols (int): the table's columns (embedding dim).

    Returns:
        List[Block]: one per shard (per rank for data-parallel tables).
    """
    spec = sharding.sharding_spec
    if spec is None or sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
        return [Block(r, 0, 0, rows, cols) for r in sharding.ranks or []]
    assert isinstance(spec, EnumerableShardingSpec)
    blocks = []
    for shard in spec.shards:
        placement = shard.placement
        assert placement is not None
        blocks.append(
            Block(
                placement.rank(),
                shard.shard_offsets[0],
                shard.shard_offsets[1],
                shard.shard_sizes[0],
                shard.shard_sizes[1],
            )
        )
    return blocks


def kept_bytes_matrix(
    current: ShardingPlan,
    candidate: ShardingPlan,
    shapes: Mapping[Tuple[str, str], Tuple[int, int, int]],
    world_size: int,
    tables: Optional[Sequence[Tuple[str, str]]] = None,
) -> np.ndarray:
    """
    ``K[c, r]``: bytes the candidate places on its rank ``c`` that rank ``r``
    holds under the current plan (same table, same elements).

    Args:
        current (ShardingPlan): the plan the model runs under.
        candidate (ShardingPlan): the candidate plan.
        shapes (Mapping[Tuple[str, str], Tuple[int, int, int]]): (module path,
            table) -> (rows, columns, bytes per element).
        world_size (int): ranks.
        tables (Optional[Sequence[Tuple[str, str]]]): the tables to count
            (default: all of ``shapes``).

    Returns:
        np.ndarray: a ``world_size x world_size`` int64 matrix.
    """
    kept = np.zeros((world_size, world_size), dtype=np.int64)
    for path, table in tables if tables is not None else sorted(shapes):
        rows, cols, itemsize = shapes[(path, table)]
        old = table_blocks(current.plan[path][table], rows, cols)  # pyre-ignore
        new = table_blocks(candidate.plan[path][table], rows, cols)  # pyre-ignore
        for n in new:
            for o in old:
                kept[n.rank, o.rank] += n.overlap(o) * itemsize
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


def _relabel_sharding(
    sharding: ParameterSharding, permutation: Sequence[int]
) -> ParameterSharding:
    if sharding.sharding_type in FIXED_PLACEMENT_TYPES:
        return sharding
    spec = sharding.sharding_spec
    shards = None
    if spec is not None:
        assert isinstance(spec, EnumerableShardingSpec)
        shards = []
        for shard in spec.shards:
            placement = shard.placement
            assert placement is not None
            rank = permutation[placement.rank()]
            shards.append(
                ShardMetadata(
                    shard_offsets=list(shard.shard_offsets),
                    shard_sizes=list(shard.shard_sizes),
                    placement=f"rank:{rank}/{placement.device()}",
                )
            )
    ranks = None if sharding.ranks is None else [permutation[r] for r in sharding.ranks]
    return replace(
        sharding,
        ranks=ranks,
        sharding_spec=None if shards is None else EnumerableShardingSpec(shards),
    )


def apply_permutation(plan: ShardingPlan, permutation: Sequence[int]) -> ShardingPlan:
    """
    ``plan`` with candidate rank ``c`` renamed ``permutation[c]`` (row-wise and
    data-parallel tables unchanged); ``plan`` itself is not modified.

    Args:
        plan (ShardingPlan): the plan.
        permutation (Sequence[int]): the new label of every rank.

    Returns:
        ShardingPlan: a new plan.
    """
    modules: Dict[str, EmbeddingModuleShardingPlan] = {}
    for path, module_plan in plan.plan.items():
        relabelled = EmbeddingModuleShardingPlan()
        for table, sharding in module_plan.items():  # pyre-ignore[16]
            relabelled[table] = _relabel_sharding(sharding, permutation)
        modules[path] = relabelled
    return ShardingPlan(modules)  # pyre-ignore[6]


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
        for module_plan in candidate.plan.values()
        for ps in module_plan.values()  # pyre-ignore[16]
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
    shapes: Mapping[Tuple[str, str], Tuple[int, int, int]],
    world_size: int,
    local_world_size: Optional[int] = None,
) -> Relabelling:
    """
    Relabels the candidate's ranks to keep the most bytes (weights) in place.

    Args:
        current (ShardingPlan): the plan the model runs under.
        candidate (ShardingPlan): the planner's candidate (same modules and
            tables); not modified.
        shapes (Mapping[Tuple[str, str], Tuple[int, int, int]]): (module path,
            table) -> (rows, columns, bytes per element).
        world_size (int): ranks.
        local_world_size (Optional[int]): ranks per host (default: one host).

    Returns:
        Relabelling: the relabelled plan and the bytes kept before and after;
        the relabelled plan never keeps fewer bytes than the raw candidate.
    """
    movable = [
        (path, table)
        for (path, table) in sorted(shapes)
        if candidate.plan[path][table].sharding_type  # pyre-ignore[16]
        not in FIXED_PLACEMENT_TYPES
    ]
    kept = kept_bytes_matrix(current, candidate, shapes, world_size, movable)
    hosts = host_groups(candidate, world_size, local_world_size or world_size)
    permutation = best_permutation(kept, hosts)
    identity = tuple(range(world_size))
    new_bytes = sum(
        b.rows * b.cols * shapes[(path, table)][2]
        for (path, table) in sorted(shapes)
        for b in table_blocks(
            candidate.plan[path][table],  # pyre-ignore[16]
            shapes[(path, table)][0],
            shapes[(path, table)][1],
        )
    )
    raw = int(kept_bytes_matrix(current, candidate, shapes, world_size).trace())
    relabelled = apply_permutation(candidate, permutation)
    # Row-wise / data-parallel tables keep their places: count the real plan.
    after = int(kept_bytes_matrix(current, relabelled, shapes, world_size).trace())
    if after < raw:  # cannot happen for a true maximum; never move more
        return Relabelling(candidate, identity, raw, raw, new_bytes)
    return Relabelling(relabelled, permutation, raw, after, new_bytes)

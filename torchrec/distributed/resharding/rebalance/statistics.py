#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: a window's load statistics, what every rank decides from.

``LoadMonitor`` (``monitor``) packs a rank's counters into one flat vector
and all-reduces it; ``statistics_from_vector`` turns the sum into a
``LoadStatistics``: per table (``TableLoad``) its mean pooling factor per
feature and ids per step, per rank its measured times (the fields of
``RANK_FIELDS``) and any values a caller attached to the window, which every
rank then sees for every rank. Nothing here touches a model or a process
group.
"""

import hashlib
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from torchrec.distributed.resharding.fields import TableKey

# The per-rank figures of a window, in the order they are packed.
RANK_FIELDS: Tuple[str, ...] = (
    "steps",
    "compute_seconds",
    "input_dist_seconds",
    "output_dist_seconds",
    "step_seconds",
    "reshard_bytes",
    "reshard_seconds",
)


@dataclass(frozen=True)
class FeatureSlot:
    """
    A (module, feature) the monitor counts, and the tables that read it.

    Args:
        path (str): the sharded module's path in the plan.
        feature (str): the feature name.
        tables (Tuple[str, ...]): tables of that module reading the feature.
    """

    path: str
    feature: str
    tables: Tuple[str, ...]


@dataclass(frozen=True)
class TableLoad:
    """
    A table's measured load over a window, summed over every rank.

    Args:
        path (str): the sharded module's path.
        table (str): the table.
        features (Tuple[str, ...]): its features, in its config's order.
        pooling_factors (Tuple[float, ...]): per feature, mean ids per sample
            (None where the window saw no sample of the feature).
        samples_per_rank_step (Tuple[float, ...]): per feature, mean samples
            per rank and step (the local batch size, for a plain feature).
        ids_per_step (float): ids looked up per step over all ranks.
    """

    path: str
    table: str
    features: Tuple[str, ...]
    pooling_factors: Tuple[Optional[float], ...]
    samples_per_rank_step: Tuple[float, ...]
    ids_per_step: float


@dataclass(frozen=True)
class LoadStatistics:
    """
    One window's measured load, identical on every rank (from one all-reduce).

    Args:
        steps (int): steps in the window.
        tables (Tuple[TableLoad, ...]): per table, sorted by (path, table).
        compute_seconds (Tuple[float, ...]): per rank, kernel forward +
            backward seconds per step.
        input_dist_seconds (Tuple[float, ...]): per rank, seconds per step in
            input dist calls.
        output_dist_seconds (Tuple[float, ...]): per rank, seconds per step in
            output dist calls.
        step_seconds (Tuple[float, ...]): per rank, mean wall seconds per step.
        reshard_bytes (Tuple[float, ...]): per rank, bytes sent + received by
            the reshards of the window.
        reshard_seconds (Tuple[float, ...]): per rank, their seconds.
        extra (Tuple[Tuple[float, ...], ...]): per rank, the values it
            attached to the window (``LoadMonitor.collect``'s ``extra``).
    """

    steps: int
    tables: Tuple[TableLoad, ...]
    compute_seconds: Tuple[float, ...]
    input_dist_seconds: Tuple[float, ...]
    output_dist_seconds: Tuple[float, ...]
    step_seconds: Tuple[float, ...]
    reshard_bytes: Tuple[float, ...] = ()
    reshard_seconds: Tuple[float, ...] = ()
    extra: Tuple[Tuple[float, ...], ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.compute_seconds)

    @property
    def embedding_seconds(self) -> Tuple[float, ...]:
        """Per rank, compute + input dist + output dist seconds per step."""
        return tuple(
            c + i + o
            for c, i, o in zip(
                self.compute_seconds, self.input_dist_seconds, self.output_dist_seconds
            )
        )

    @property
    def imbalance(self) -> float:
        """Slowest rank's embedding seconds over the mean (1.0: balanced)."""
        seconds = self.embedding_seconds
        mean = sum(seconds) / max(len(seconds), 1)
        return max(seconds) / mean if mean > 0 else 1.0

    @property
    def step_time(self) -> float:
        """The window's step time: the slowest rank's mean."""
        return max(self.step_seconds) if self.step_seconds else 0.0

    def table(self, path: str, table: str) -> TableLoad:
        for load in self.tables:
            if load.path == path and load.table == table:
                return load
        raise KeyError((path, table))

    def digest(self) -> str:
        """A digest of every figure: equal on ranks that reduced the same sums."""
        h = hashlib.sha256(str(self.steps).encode())
        for load in self.tables:
            h.update(str(TableKey(load.path, load.table)).encode())
            for pf in load.pooling_factors:
                h.update(struct.pack("<d", -1.0 if pf is None else pf))
            h.update(struct.pack("<d", load.ids_per_step))
        for name in RANK_FIELDS[1:]:
            for value in getattr(self, name):
                h.update(struct.pack("<d", value))
        for values in self.extra:
            h.update(struct.pack(f"<{len(values)}d", *values))
        return h.hexdigest()


def feature_slots(
    module_tables: Sequence[Tuple[str, Sequence[Tuple[str, Sequence[str]]]]],
) -> Tuple[FeatureSlot, ...]:
    """
    The counters of a model: one per (module path, feature).

    Args:
        module_tables: per module path, its tables as (table, feature names).

    Returns:
        Tuple[FeatureSlot, ...]: sorted by (path, feature).
    """
    readers: Dict[Tuple[str, str], List[str]] = {}
    for path, tables in module_tables:
        for table, features in tables:
            for feature in features:
                readers.setdefault((path, feature), []).append(table)
    return tuple(
        FeatureSlot(path, feature, tuple(readers[(path, feature)]))
        for path, feature in sorted(readers)
    )


def statistics_from_vector(
    vector: Sequence[float],
    slots: Sequence[FeatureSlot],
    module_tables: Sequence[Tuple[str, Sequence[Tuple[str, Sequence[str]]]]],
    world_size: int,
    num_extra: int = 0,
) -> LoadStatistics:
    """
    Turns the all-reduced counters of a window into statistics (pure).

    Args:
        vector (Sequence[float]): ids per slot, samples per slot, each of
            ``RANK_FIELDS`` per rank, then ``num_extra`` values per rank, as
            ``LoadMonitor`` packs them, summed.
        slots (Sequence[FeatureSlot]): the slots, as ``feature_slots`` gives.
        module_tables: per module path, its tables as (table, feature names).
        world_size (int): ranks.
        num_extra (int): values each rank attached to the window.

    Returns:
        LoadStatistics: the window's statistics.

    Raises:
        ValueError: when the ranks counted different numbers of steps.
    """
    n = len(slots)
    ids, samples = list(vector[:n]), list(vector[n : 2 * n])
    per_rank: Dict[str, Tuple[float, ...]] = {}
    for i, name in enumerate(RANK_FIELDS):
        start = 2 * n + i * world_size
        per_rank[name] = tuple(float(v) for v in vector[start : start + world_size])
    steps_per_rank = {int(s) for s in per_rank["steps"]}
    if len(steps_per_rank) != 1:
        raise ValueError(
            f"the ranks counted different numbers of steps: {per_rank['steps']}"
        )
    steps = steps_per_rank.pop()
    index = {(s.path, s.feature): i for i, s in enumerate(slots)}
    loads = []
    for path, tables in module_tables:
        for table, features in tables:
            pfs: List[Optional[float]] = []
            per_rank_step: List[float] = []
            total = 0.0
            for feature in features:
                i = index[(path, feature)]
                pfs.append(ids[i] / samples[i] if samples[i] > 0 else None)
                per_rank_step.append(samples[i] / max(steps * world_size, 1))
                total += ids[i]
            loads.append(
                TableLoad(
                    path,
                    table,
                    tuple(features),
                    tuple(pfs),
                    tuple(per_rank_step),
                    total / max(steps, 1),
                )
            )
    loads.sort(key=lambda load: (load.path, load.table))

    def per_step(name: str) -> Tuple[float, ...]:
        return tuple(v / max(steps, 1) for v in per_rank[name])

    start = 2 * n + len(RANK_FIELDS) * world_size
    extra = tuple(
        tuple(
            float(v)
            for v in vector[start + r * num_extra : start + (r + 1) * num_extra]
        )
        for r in range(world_size)
    )

    return LoadStatistics(
        steps=steps,
        tables=tuple(loads),
        compute_seconds=per_step("compute_seconds"),
        input_dist_seconds=per_step("input_dist_seconds"),
        output_dist_seconds=per_step("output_dist_seconds"),
        step_seconds=per_step("step_seconds"),
        reshard_bytes=per_rank["reshard_bytes"],
        reshard_seconds=per_rank["reshard_seconds"],
        extra=extra if num_extra else (),
    )

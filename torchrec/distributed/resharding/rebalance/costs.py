#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: what a shard costs, calibrated from what the job measured, and the step
time a move leaves.

* Every shard reads ``ids x work`` elements per step (``placement``): the
  table's ids per step (all-reduced) times the elements one id reads in the
  shard. ``calibrate`` fits the seconds one element costs from the ranks'
  measured kernel seconds (forward and backward with the fused update):
  ``kernel seconds = fixed + slope x elements`` across ranks when their
  elements differ enough to tell the slope, else through the origin. Only
  the slope is used: a prediction moves shards' costs between ranks and
  keeps each rank's own measured remainder, so the fixed part cancels.
* ``predict_step``: the step takes its placement-independent part (measured
  step time minus the slowest rank's measured kernel seconds) plus the
  slowest rank's kernel seconds after the move (its measured seconds, less
  the shards it gives, plus the shards it gets). No estimator of other
  hardware takes part. A rank's measured remainder may be noise (a rank
  slowed by a neighbour for a window): the saving is never taken above what
  the calibrated costs alone give (the slope times the cut of the busiest
  rank's elements), so noise on one rank does not pay for a move.
* Every shard also pays a fixed cost per id it reads, whatever its width
  (the id's offsets, its row's address, pooling, the fused update per row):
  ``lookup_columns`` columns' worth (``policy.DEFAULT_LOOKUP_COLUMNS``,
  calibrated by ``benchmarks/shard_cost_benchmark.py``). Moving a shard
  moves it with the shard; a split pays it once more (each column-wise
  shard reads every id of its table), a merge saves it.
* ``propose`` runs the incremental search on one window's statistics; then,
  for the tables it may spread by rows whose narrowest column shard alone
  is worth more than the mean rank (what column splits cannot fix), the
  row split search (``row_splits``): a row block reads its share of the ids
  (and of their fixed cost), and every rank of a row-wise table pays the
  pooled output of every sample (``samples x cols`` elements per rank; a
  grid block's own columns), and the communication a row split changes
  (``exchange``: every rank's bucketization of its ids, the row sharding's
  collectives, ids in, the pooled output's reduce-scatter, its gradient's
  all-gather) costs what the job measured (``ExchangePrice``) on each rank
  it changes ( the prediction's per-rank seconds then
  hold kernel and exchange, and the saving is that of the slowest rank's
  sum); then, for the tables it may split, the column split search on what
  is left.
"""

from dataclasses import dataclass, field, replace
from typing import AbstractSet, Dict, List, Mapping, Optional, Sequence, Tuple

from torchrec.distributed.resharding.fields import table_key
from torchrec.distributed.resharding.plan import TableLayout
from torchrec.distributed.resharding.rebalance.exchange_price import (
    column_shard_seconds,
    COLUMN_SHARDING_COLLECTIVES,
    ColumnShardSeconds,
    ExchangePrice,
    row_blocks_spread,
    ROW_COLLECTIVES,
    table_exchange,
    TableExchange,
    VALUE_BYTES,
)
from torchrec.distributed.resharding.rebalance.placement import (
    moved_layouts,
    Placement,
    ShardUnit,
)
from torchrec.distributed.resharding.rebalance.row_splits import (
    ROW_SPLITTABLE_TYPES,
    ROW_TYPES,
    RowCosts,
    RowSplitResult,
    search_row_splits,
)
from torchrec.distributed.resharding.rebalance.search import (
    lower_bound,
    search_moves,
    SearchResult,
)
from torchrec.distributed.resharding.rebalance.split_level import (
    column_options,
    LayoutOption,
    row_options,
    split_level,
    SplitLevel,
)
from torchrec.distributed.resharding.rebalance.splits import (
    ALIGN,
    search_splits,
    SplitResult,
)
from torchrec.distributed.resharding.rebalance.statistics import LoadStatistics
from torchrec.distributed.types import ShardingType

# Ranks' elements must spread this much (relative to their mean) for a fit
# with a fixed part; below it the slope goes through the origin.
SPREAD_FOR_INTERCEPT: float = 0.2
# Priced, the column splits level each rank's exchange too, which takes
# about twenty times the splits in a job's first window (782 at 1,024 ranks
# x 1,000 tables, 40 on kernels alone, 53 ms of the window's decision): at
# most one split per this many ranks (and at least PRICED_SPLITS_LEAST) a
# window keeps the decision within its budget; the rest waits for the next
# window (in the simulation the step's slowest rank is the same as without
# it or lower, by at most 0.03x of the step's bound; a split per four ranks
# left 1,024 x 100 at 1.59x the bound, against 1.45x).
PRICED_SPLITS_PER_RANKS: int = 2
PRICED_SPLITS_LEAST: int = 64


@dataclass(frozen=True)
class StepPrediction:
    """
    The step time before (measured) and after a move (predicted).

    Args:
        measured_step (float): seconds per step measured (slowest rank).
        measured_kernels (Tuple[float, ...]): per rank, kernel seconds per
            step measured.
        predicted_kernels (Tuple[float, ...]): per rank, the same predicted
            after the move.
        modelled_saving (Optional[float]): seconds per step the calibrated
            costs alone save (the slope times the cut of the busiest rank's
            elements); the prediction never saves more.
        measured_exchange (Tuple[float, ...]): where the exchange is priced,
            per rank, its modelled exchange seconds per step before (above
            what every rank exchanges; empty: not priced).
        predicted_exchange (Tuple[float, ...]): the same after the move.
    """

    measured_step: float
    measured_kernels: Tuple[float, ...]
    predicted_kernels: Tuple[float, ...]
    modelled_saving: Optional[float] = None
    measured_exchange: Tuple[float, ...] = ()
    predicted_exchange: Tuple[float, ...] = ()

    @property
    def fixed(self) -> float:
        """The part of the step that does not depend on placement."""
        busiest = _busiest(self.measured_kernels, self.measured_exchange)
        return max(self.measured_step - busiest, 0.0)

    @property
    def predicted_step(self) -> float:
        step = self.fixed + _busiest(self.predicted_kernels, self.predicted_exchange)
        if self.modelled_saving is None:
            return step
        return max(step, self.measured_step - self.modelled_saving)

    @property
    def saving(self) -> float:
        """Predicted seconds saved per step."""
        return self.measured_step - self.predicted_step

    @property
    def gain(self) -> float:
        """Predicted relative cut of the step time."""
        if self.measured_step <= 0:
            return 0.0
        return self.saving / self.measured_step


@dataclass(frozen=True)
class Proposal:
    """
    A window's candidate: new layouts for some tables, and what they predict.

    Args:
        layouts (Dict[str, TableLayout]): table key -> its new layout (only
            tables that change).
        prediction (StepPrediction): step time before and after.
        search (Optional[SearchResult]): the incremental search's result,
            None for a candidate from elsewhere (the full planner).
        sharding_types (Dict[str, str]): table key -> its new sharding type
            (the tables split).
        splits (Optional[SplitResult]): the split search's result, None when
            it did not run.
        row_splits (Optional[RowSplitResult]): the row split search's
            result, None when it did not run.
    """

    layouts: Dict[str, TableLayout]
    prediction: StepPrediction
    search: Optional[SearchResult] = None
    sharding_types: Dict[str, str] = field(default_factory=dict)
    splits: Optional[SplitResult] = None
    row_splits: Optional[RowSplitResult] = None

    @property
    def split(self) -> bool:
        """Whether a table was cut (by columns or by rows), not only moved."""
        return any(
            result is not None and bool(result.layouts)
            for result in (self.splits, self.row_splits)
        )


def _busiest(kernels: Sequence[float], exchange: Sequence[float]) -> float:
    """The slowest rank's kernel seconds, plus its exchange where priced."""
    if not exchange:
        return max(kernels, default=0.0)
    return max((k + e for k, e in zip(kernels, exchange)), default=0.0)


def table_ids(stats: LoadStatistics, placement: Placement) -> List[float]:
    """Per table of the placement, ids per step over all ranks (0 if unseen)."""
    ids = {table_key(t.path, t.table): t.ids_per_step for t in stats.tables}
    return [ids.get(t.key, 0.0) for t in placement.tables]


def table_samples(stats: LoadStatistics, placement: Placement) -> List[float]:
    """
    Per table of the placement, samples (bags of its features) per step over
    all ranks (0 if unseen).
    """
    world_size = placement.world_size
    samples = {
        table_key(t.path, t.table): sum(t.samples_per_rank_step) * world_size
        for t in stats.tables
    }
    return [samples.get(t.key, 0.0) for t in placement.tables]


def row_split_costs(
    placement: Placement,
    ids: Sequence[float],
    samples: Sequence[float],
    seconds_per_element: float,
    lookup_columns: float = 0.0,
) -> Dict[int, RowCosts]:
    """Per table of the placement, what its row blocks cost (seconds per step)."""
    return {
        t: RowCosts(
            ids[t] * seconds_per_element,
            lookup_columns,
            samples[t] * seconds_per_element,
        )
        for t in range(len(placement.tables))
    }


def row_output_elements(placement: Placement, samples: Sequence[float]) -> List[float]:
    """
    Per rank, elements per step of the pooled output of the row-wise,
    table-row-wise and grid shards it holds (``samples x cols`` each).
    """
    out = [0.0] * placement.world_size
    for unit in placement.units:
        table = placement.tables[unit.table]
        if table.sharding_type in ROW_TYPES:
            cols = table.layout.shards[unit.shard].rect.cols
            out[unit.rank] += samples[unit.table] * cols
    return out


def window_elements(
    stats: LoadStatistics, placement: Placement, lookup_columns: float = 0.0
) -> List[float]:
    """
    Per rank, the elements its shards read per step in a window (their fixed
    cost per id included) and those the row-wise ones write (their pooled
    output): what its kernel seconds are fitted against (``calibrate``).
    """
    ids = table_ids(stats, placement)
    elements = rank_elements(placement.units, ids, placement.world_size, lookup_columns)
    output = row_output_elements(placement, table_samples(stats, placement))
    return [e + o for e, o in zip(elements, output)]


def row_block_elements(
    layout: TableLayout, ids: float, samples: float, lookup_columns: float = 0.0
) -> List[Tuple[int, float]]:
    """
    (rank, elements per step) of each block of a row-wise, table-row-wise or
    grid layout: its share of the ids, and the pooled output of its columns.
    """
    return [
        (
            s.rank,
            ids * s.rect.rows / layout.rows * (s.rect.cols + lookup_columns)
            + samples * s.rect.cols,
        )
        for s in layout.shards
    ]


def unit_elements(unit: ShardUnit, lookup_columns: float = 0.0) -> float:
    """Elements one id of the unit's table costs in it, its fixed cost included."""
    return unit.work + lookup_columns * unit.share


def rank_elements(
    units: Sequence[ShardUnit],
    ids: Sequence[float],
    world_size: int,
    lookup_columns: float = 0.0,
) -> List[float]:
    """
    Per rank, elements its shards read per step, and ``lookup_columns`` per
    id each shard reads (its fixed cost, in elements).
    """
    elements = [0.0] * world_size
    for unit in units:
        elements[unit.rank] += ids[unit.table] * unit_elements(unit, lookup_columns)
    return elements


def calibrate(
    kernel_seconds: Sequence[float],
    elements: Sequence[float],
    prior: Optional[float] = None,
) -> Optional[float]:
    """
    Seconds per element read, fitted over the ranks of one window.

    Args:
        kernel_seconds (Sequence[float]): per rank, measured kernel seconds
            per step.
        elements (Sequence[float]): per rank, elements read per step.
        prior (Optional[float]): the slope to keep when this window cannot
            tell one (nothing read, nothing measured).

    Returns:
        Optional[float]: the slope (never negative), or ``prior``.
    """
    n = len(elements)
    total = sum(elements)
    if n == 0 or total <= 0 or sum(kernel_seconds) <= 0:
        return prior
    mean_x = total / n
    mean_y = sum(kernel_seconds) / n
    spread = (max(elements) - min(elements)) / mean_x
    if n >= 2 and spread >= SPREAD_FOR_INTERCEPT:
        slope = _bounded_fit(kernel_seconds, elements, mean_x, mean_y)
        if slope > 0:
            return slope
    return mean_y / mean_x


def _bounded_fit(
    kernel_seconds: Sequence[float],
    elements: Sequence[float],
    mean_x: float,
    mean_y: float,
) -> float:
    """
    The least-squares slope of ``kernel_seconds`` on ``elements`` with a
    fixed part between zero and the least loaded rank's seconds.

    Where the unbounded fit's fixed part falls outside those bounds (noise
    lifts it above an idle rank's seconds), the bounded optimum has it on
    the nearer bound: the slope is then fitted with that fixed part.
    """
    sxx = sum((x - mean_x) ** 2 for x in elements)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(elements, kernel_seconds))
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    fixed = min(max(intercept, 0.0), min(kernel_seconds))
    if fixed == intercept:
        return slope
    return sum(x * (y - fixed) for x, y in zip(elements, kernel_seconds)) / sum(
        x * x for x in elements
    )


def unit_costs(
    units: Sequence[ShardUnit],
    ids: Sequence[float],
    seconds_per_element: float,
    lookup_columns: float = 0.0,
) -> List[float]:
    """Per unit, its kernel seconds per step (its fixed cost included)."""
    return [
        ids[u.table] * unit_elements(u, lookup_columns) * seconds_per_element
        for u in units
    ]


def predicted_kernels(
    measured: Sequence[float],
    before: Placement,
    after: Placement,
    ids: Sequence[float],
    seconds_per_element: float,
    lookup_columns: float = 0.0,
) -> Tuple[float, ...]:
    """
    Per rank, kernel seconds after a change of placement: the measured
    seconds, less the modelled cost of the shards it held, plus that of the
    shards it holds after (never below zero).
    """
    world_size = before.world_size
    old = rank_elements(before.units, ids, world_size, lookup_columns)
    new = rank_elements(after.units, ids, world_size, lookup_columns)
    return tuple(
        max(m + (n - o) * seconds_per_element, 0.0)
        for m, o, n in zip(measured, old, new)
    )


def predict_step(
    stats: LoadStatistics,
    kernels_after: Sequence[float],
    modelled_saving: Optional[float] = None,
    exchange_before: Sequence[float] = (),
    exchange_after: Sequence[float] = (),
) -> StepPrediction:
    """
    The step time of a window and the one predicted after a move (with the
    ranks' modelled exchange before and after, where it is priced).
    """
    return StepPrediction(
        measured_step=stats.step_time,
        measured_kernels=tuple(stats.compute_seconds),
        predicted_kernels=tuple(kernels_after),
        modelled_saving=modelled_saving,
        measured_exchange=tuple(exchange_before),
        predicted_exchange=tuple(exchange_after),
    )


def modelled_saving(
    before: Sequence[float],
    after: Sequence[float],
    seconds_per_element: float,
    exchange: Sequence[float] = (),
    exchange_before: Sequence[float] = (),
) -> float:
    """
    The cut of the busiest rank's elements (per rank, before and after), in
    seconds; with ``exchange`` (per rank, its seconds of communication
    after; ``exchange_before`` those before, none if empty), of the busiest
    rank's elements' and exchange seconds.
    """
    if not exchange:
        return seconds_per_element * (
            max(before, default=0.0) - max(after, default=0.0)
        )
    was = _busiest([seconds_per_element * b for b in before], exchange_before)
    busiest = _busiest([seconds_per_element * a for a in after], exchange)
    return was - busiest


def propose(
    stats: LoadStatistics,
    placement: Placement,
    seconds_per_element: float,
    capacity: Sequence[float],
    byte_price: float = 0.0,
    move_budget: Optional[int] = None,
    splittable: Optional[AbstractSet[str]] = None,
    lookup_columns: float = 0.0,
    row_splittable: Optional[Mapping[str, Tuple[str, ...]]] = None,
    local_world_size: Optional[int] = None,
    exchange_price: Optional[ExchangePrice] = None,
) -> Proposal:
    """
    The incremental search on one window's statistics (moves and swaps, then
    row splits of the ``row_splittable`` tables the moves left as they are
    and column splits cannot fix, then column splits of the ``splittable``
    ones not split by rows). Where the exchange is priced, a hot table is
    split by rows only where its cheapest layout at the level the hot
    tables allow is by rows (``split_level``), and the row splits aim at
    that level. Such a table the column splits can still cut
    is held in place during the moves (``_moves_holding``).

    Args:
        stats (LoadStatistics): the window (identical on every rank).
        placement (Placement): the current placement.
        seconds_per_element (float): the calibrated slope.
        capacity (Sequence[float]): per rank, the most bytes of tables.
        byte_price (float): seconds per step one byte moved costs.
        move_budget (Optional[int]): the most bytes a rank may send plus
            receive.
        splittable (Optional[AbstractSet[str]]): keys of the tables whose
            shards may be split (None or empty: no splits).
        lookup_columns (float): a shard's fixed cost per id, in columns.
        row_splittable (Optional[Mapping[str, Tuple[str, ...]]]): keys of the
            tables that may be spread by rows, each with the row sharding
            types its constraints allow (None or empty: no row splits).
        local_world_size (Optional[int]): ranks per host (for table-row-wise
            splits; None: one host).
        exchange_price (Optional[ExchangePrice]): the measured figures that
            price the work outside the kernels a row split changes (None:
            not priced).

    Returns:
        Proposal: the new layouts and the predicted step time.
    """
    ids = table_ids(stats, placement)
    samples = table_samples(stats, placement)
    costs = unit_costs(placement.units, ids, seconds_per_element, lookup_columns)
    narrowest = [n * seconds_per_element * (ALIGN + lookup_columns) for n in ids]
    measured = stats.compute_seconds
    held = _column_bound(
        placement,
        row_splittable or {},
        set(),
        narrowest,
        sum(measured) / max(len(measured), 1),
    )
    result = _moves_holding(
        {t for t in held if _column_splittable(placement, t, splittable or ())},
        measured,
        placement.units,
        costs,
        capacity,
        byte_price,
        move_budget,
    )
    layouts = moved_layouts(placement, result.moves)
    loads: Sequence[float] = result.loads
    traffic: Sequence[int] = result.rank_bytes
    types: Dict[str, str] = {}
    split: Optional[SplitResult] = None
    where = [u.rank for u in placement.units]
    for index, rank in result.moves:
        where[index] = rank
    after = [0.0] * placement.world_size
    used = [0] * placement.world_size
    for unit, rank in zip(placement.units, where):
        after[rank] += ids[unit.table] * unit_elements(unit, lookup_columns)
        used[rank] += unit.nbytes
    index = {t.key: i for i, t in enumerate(placement.tables)}
    rows: Optional[RowSplitResult] = None
    row_costs = row_split_costs(
        placement, ids, samples, seconds_per_element, lookup_columns
    )
    allowed = _column_bound(
        placement,
        row_splittable or {},
        set(layouts),
        narrowest,
        sum(loads) / max(len(loads), 1),
    )
    # what a column shard of each table exchanges, once per window: the
    # level and the column splits both price it
    columns = _column_exchange(
        placement, ids, samples, {t.key for t in placement.tables}, exchange_price
    )
    # and what each shard exchanges more than a rank holding none: the
    # level, the column splits' base and the prediction all sum it
    shard_exchange = (
        None
        if columns is None or exchange_price is None
        else _unit_exchange(placement, ids, samples, exchange_price, columns)
    )
    level: Optional[SplitLevel] = None
    if allowed and columns is not None and shard_exchange is not None:
        assert exchange_price is not None
        level = _split_level(
            placement,
            allowed,
            sum(loads) + sum(shard_exchange),
            where,
            ids,
            samples,
            row_costs,
            columns,
            seconds_per_element,
            lookup_columns,
            local_world_size or placement.world_size,
            exchange_price,
        )
        allowed = {t: kinds for t, kinds in allowed.items() if t in level.by_rows}
    if allowed:
        rows = search_row_splits(
            placement,
            loads,
            costs,
            capacity,
            row_costs,
            allowed,
            where=where,
            used=used,
            traffic=traffic,
            byte_price=byte_price,
            move_budget=move_budget,
            local_world_size=local_world_size,
            volumes={t: (ids[t], samples[t]) for t in allowed},
            price=exchange_price,
            level=level.level if level is not None else 0.0,
        )
        _take_off(placement, where, ids, lookup_columns, rows.layouts, after, used)
        for key, layout in rows.layouts.items():
            t = index[key]
            for rank, elements in row_block_elements(
                layout, ids[t], samples[t], lookup_columns
            ):
                after[rank] += elements
        layouts.update(rows.layouts)
        types.update(rows.sharding_types)
        loads, traffic, used = rows.loads, rows.rank_bytes, list(rows.rank_used)
    if splittable and rows is not None:
        splittable = {key for key in splittable if key not in rows.layouts}
    if splittable:
        column_exchange = (
            None
            if columns is None
            else {
                t: c
                for t, c in columns.items()
                if placement.tables[t].key in splittable
            }
        )
        base = (
            _sum_at(shard_exchange, where, placement.world_size)
            if column_exchange is not None and shard_exchange is not None
            else [0.0] * placement.world_size
        )
        split = search_splits(
            placement,
            [v + b for v, b in zip(loads, base)],
            costs,
            capacity,
            splittable,
            byte_price=byte_price,
            move_budget=move_budget,
            traffic=traffic,
            where=where,
            fixed=[n * lookup_columns * seconds_per_element for n in ids],
            used=used,
            exchange=column_exchange,
            max_splits=(
                None
                if column_exchange is None
                else max(
                    PRICED_SPLITS_LEAST,
                    placement.world_size // PRICED_SPLITS_PER_RANKS,
                )
            ),
        )
        split = replace(split, loads=tuple(v - b for v, b in zip(split.loads, base)))
        _take_off(placement, where, ids, lookup_columns, split.layouts, after, used)
        for key, layout in split.layouts.items():  # and after (every row)
            for shard in layout.shards:
                after[shard.rank] += ids[index[key]] * (
                    shard.rect.cols + lookup_columns
                )
        layouts.update(split.layouts)
        types.update(split.sharding_types)
        loads = split.loads
    before = rank_elements(placement.units, ids, placement.world_size, lookup_columns)
    # the pooled output of the tables already row-wise, which nothing here
    # changes: the busiest rank in elements is the busiest rank
    output = row_output_elements(placement, samples)
    before = [b + o for b, o in zip(before, output)]
    after = [a + o for a, o in zip(after, output)]
    if columns is not None and shard_exchange is not None:
        assert exchange_price is not None
        prediction = _priced_prediction(
            stats,
            placement,
            layouts,
            types,
            (before, after),
            seconds_per_element,
            (ids, samples),
            exchange_price,
            columns,
            _sum_at(
                shard_exchange,
                [u.rank for u in placement.units],
                placement.world_size,
            ),
        )
    else:
        saving = modelled_saving(before, after, seconds_per_element)
        prediction = predict_step(stats, loads, saving)
    return Proposal(
        layouts=layouts,
        prediction=prediction,
        search=result,
        sharding_types=types,
        splits=split,
        row_splits=rows,
    )


def predict_placement(
    stats: LoadStatistics,
    before: Placement,
    after: Placement,
    seconds_per_element: float,
    lookup_columns: float = 0.0,
    exchange_price: Optional[ExchangePrice] = None,
) -> StepPrediction:
    """
    The step after ``before`` becomes ``after`` (any layouts and sharding
    types: a full replan's plan), by the model ``propose`` predicts its own
    proposals with: per rank the measured kernel seconds moved by the
    modelled elements (the row-wise shards' pooled output included) and,
    where the exchange is priced, plus each rank's whole modelled exchange
    before and after. A candidate from any source is so judged on the same
    model.

    Args:
        stats (LoadStatistics): the window (identical on every rank).
        before (Placement): the current placement.
        after (Placement): the candidate's placement (the same tables).
        seconds_per_element (float): the calibrated slope.
        lookup_columns (float): a shard's fixed cost per id, in columns.
        exchange_price (Optional[ExchangePrice]): the measured figures that
            price the exchange (None: not priced; the slowest rank's
            exchange then counts as a fixed part of the step).

    Returns:
        StepPrediction: the step time before and after.
    """
    elements = (
        window_elements(stats, before, lookup_columns),
        window_elements(stats, after, lookup_columns),
    )
    ids = table_ids(stats, before)
    samples = table_samples(stats, before)
    columns = _column_exchange(
        before, ids, samples, {t.key for t in before.tables}, exchange_price
    )
    if columns is None:
        old, new = elements
        kernels = [
            max(m + (n - o) * seconds_per_element, 0.0)
            for m, o, n in zip(stats.compute_seconds, old, new)
        ]
        return predict_step(
            stats, kernels, modelled_saving(old, new, seconds_per_element)
        )
    assert exchange_price is not None
    was = {t.key: t for t in before.tables}
    changed = [
        t
        for t in after.tables
        if t.layout != was[t.key].layout or t.sharding_type != was[t.key].sharding_type
    ]
    return _priced_prediction(
        stats,
        before,
        {t.key: t.layout for t in changed},
        {t.key: t.sharding_type for t in changed},
        elements,
        seconds_per_element,
        (ids, samples),
        exchange_price,
        columns,
        _holder_exchange(
            before,
            [u.rank for u in before.units],
            ids,
            samples,
            exchange_price,
            columns,
        ),
    )


def _column_exchange(
    placement: Placement,
    ids: Sequence[float],
    samples: Sequence[float],
    splittable: AbstractSet[str],
    price: Optional[ExchangePrice],
) -> Optional[Dict[int, ColumnShardSeconds]]:
    """
    Per splittable table, what a column shard of it adds outside the
    kernels at ``price`` (None where it is not priced).
    """
    if price is None or not price.priced:
        return None
    world_size = placement.world_size
    return {
        t: column_shard_seconds(world_size, ids[t], samples[t], price)
        for t, table in enumerate(placement.tables)
        if table.key in splittable
    }


def _holder_exchange(
    placement: Placement,
    where: Sequence[int],
    ids: Sequence[float],
    samples: Sequence[float],
    price: ExchangePrice,
    columns: Mapping[int, ColumnShardSeconds],
) -> List[float]:
    """
    Per rank, the seconds per step its shards (at ``where``) exchange more
    than a rank holding none of their tables (``_unit_exchange``).
    """
    return _sum_at(
        _unit_exchange(placement, ids, samples, price, columns),
        where,
        placement.world_size,
    )


def _unit_exchange(
    placement: Placement,
    ids: Sequence[float],
    samples: Sequence[float],
    price: ExchangePrice,
    columns: Mapping[int, ColumnShardSeconds],
) -> List[float]:
    """
    Per unit of the placement, the seconds per step its holder exchanges
    more than a rank holding none of its table (``_shard_exchange``).
    """
    per_table = [
        _shard_exchange(
            table.layout,
            placement.world_size,
            ids[t],
            samples[t],
            price,
            columns.get(t),
        )[0]
        for t, table in enumerate(placement.tables)
    ]
    return [per_table[unit.table][unit.shard] for unit in placement.units]


def _shard_exchange(
    layout: TableLayout,
    world_size: int,
    ids: float,
    samples: float,
    price: ExchangePrice,
    column: Optional[ColumnShardSeconds],
) -> Tuple[List[float], Optional[TableExchange]]:
    """
    Per shard of one table's ``layout``, the seconds per step its holder
    exchanges more than a rank holding none: for a shard spanning every
    row of a layout not replicated, the table's ``column`` figures (per
    shard and per column), else what ``table_exchange`` counts; and
    ``table_exchange``'s result where it was needed (None where not).
    """
    exchange: Optional[TableExchange] = None
    out = []
    for shard in layout.shards:
        if (
            column is not None
            and shard.rect.rows == layout.rows
            and not layout.replicated
        ):
            out.append(column.shard + column.column * shard.rect.cols)
            continue
        if exchange is None:
            exchange = table_exchange(layout, world_size, ids, samples)
        seconds = exchange.of(shard.rank) - exchange.others
        out.append(seconds * price.seconds_per_byte)
    return out, exchange


def _sum_at(
    values: Sequence[float], where: Sequence[int], world_size: int
) -> List[float]:
    """Per rank, the sum of the ``values`` of the units ``where`` puts on it."""
    out = [0.0] * world_size
    for value, rank in zip(values, where):
        out[rank] += value
    return out


def _priced_prediction(
    stats: LoadStatistics,
    placement: Placement,
    layouts: Mapping[str, TableLayout],
    types: Mapping[str, str],
    elements: Tuple[Sequence[float], Sequence[float]],
    seconds_per_element: float,
    volumes: Tuple[Sequence[float], Sequence[float]],
    price: ExchangePrice,
    columns: Mapping[int, ColumnShardSeconds],
    exchange_before: Sequence[float],
) -> StepPrediction:
    """
    The step after ``layouts`` where the exchange is priced: per rank its
    kernels (the measured seconds moved by the modelled elements, never
    below zero) plus its whole modelled exchange, before
    (``exchange_before``, the holders' as ``_holder_exchange`` sums it)
    and after. The
    searches' own loads count only the exchange their steps change (a move
    carries none), so the slowest rank's exchange before would otherwise
    pass for a fixed part of the step.
    """
    before, after = elements
    ids, samples = volumes
    measured = stats.compute_seconds
    exchange_after = _exchange_after(
        placement, layouts, types, ids, samples, price, columns, exchange_before
    )
    kernels = [
        max(m + (a - b) * seconds_per_element, 0.0)
        for m, b, a in zip(measured, before, after)
    ]
    saving = modelled_saving(
        before, after, seconds_per_element, exchange_after, exchange_before
    )
    return predict_step(stats, kernels, saving, exchange_before, exchange_after)


def _exchange_after(
    placement: Placement,
    layouts: Mapping[str, TableLayout],
    types: Mapping[str, str],
    ids: Sequence[float],
    samples: Sequence[float],
    price: ExchangePrice,
    columns: Mapping[int, ColumnShardSeconds],
    before: Sequence[float],
) -> List[float]:
    """
    Per rank, ``before`` (the holders' exchange, ``_holder_exchange``) with
    the tables of ``layouts`` laid out anew: their holders' seconds
    swapped, and every rank's change (ids sent to more or fewer shards, a
    row spread's bucketization and collectives, the column-wise sharding's
    collectives of a module that gains or loses its only such table).
    """
    out = list(before)
    everyone = 0.0
    column_wise = ShardingType.COLUMN_WISE.value
    paths_before = {t.path for t in placement.tables if t.sharding_type == column_wise}
    paths_after = {
        t.path
        for t in placement.tables
        if types.get(t.key, t.sharding_type) == column_wise
    }
    everyone += (
        (len(paths_after - paths_before) - len(paths_before - paths_after))
        * COLUMN_SHARDING_COLLECTIVES
        * price.seconds_per_collective
    )
    for t, table in enumerate(placement.tables):
        layout = layouts.get(table.key)
        if layout is None:
            continue
        column = columns.get(t)
        for sign, laid in ((-1.0, table.layout), (1.0, layout)):
            holders, others = _layout_exchange(
                laid, placement.world_size, ids[t], samples[t], price, column
            )
            for rank, seconds in holders.items():
                out[rank] += sign * seconds
            everyone += sign * others
    return [value + everyone for value in out]


def _layout_exchange(
    layout: TableLayout,
    world_size: int,
    ids: float,
    samples: float,
    price: ExchangePrice,
    column: Optional[ColumnShardSeconds],
) -> Tuple[Dict[int, float], float]:
    """
    One table's exchange seconds per step as ``layout``: per holder what it
    exchanges more than a rank holding none (as ``_holder_exchange`` counts
    it), and what every rank exchanges.
    """
    per_byte = price.seconds_per_byte
    holders: Dict[int, float] = {}
    seconds, exchange = _shard_exchange(layout, world_size, ids, samples, price, column)
    for shard, value in zip(layout.shards, seconds):
        holders[shard.rank] = holders.get(shard.rank, 0.0) + value
    if exchange is None:
        # column shards only (most of a window's tables), each priced by the
        # table's figures: ``blocks_exchange``'s others in closed form, every
        # rank sending its ids to each shard and writing its own samples'
        # output of every column
        assert column is not None
        own_output = 2.0 * samples / world_size * layout.cols * VALUE_BYTES
        return holders, len(layout.shards) * column.everyone + own_output * per_byte
    others = exchange.others * per_byte
    spread = row_blocks_spread(layout)
    if spread:
        others += price.seconds_per_id * ids / world_size * spread
        others += price.seconds_per_collective * ROW_COLLECTIVES
    return holders, others


def _column_splittable(
    placement: Placement, t: int, splittable: AbstractSet[str]
) -> bool:
    """
    Whether the column splits may still cut table ``t``: it is splittable
    and a shard of it is wider than ``ALIGN``.
    """
    table = placement.tables[t]
    return table.key in splittable and any(
        shard.rect.cols >= 2 * ALIGN for shard in table.layout.shards
    )


def _moves_holding(
    held: AbstractSet[int],
    loads: Sequence[float],
    units: Sequence[ShardUnit],
    costs: Sequence[float],
    capacity: Sequence[float],
    byte_price: float,
    move_budget: Optional[int],
) -> SearchResult:
    """
    ``search_moves`` with the shards of the ``held`` tables kept where they
    are and left out of the loads the moves level (added back after): a
    table hotter than column splits can fix gains nothing moved whole (its
    rank only changes), and a table the window moves is not spread by rows;
    what the row splits leave of it the column splits take (only tables they
    can still cut are held: one in 4-column shards moves). Moved first,
    such a table (worth 56 mean ranks at 256 ranks x 1,000 tables) was cut
    into 4-column shards worth 1.68 mean ranks each, and the ranks the moves
    had levelled to that left no room for any row split after.

    Args:
        held (AbstractSet[int]): indexes of the tables kept in place.
        loads (Sequence[float]): per rank, its load now.
        units (Sequence[ShardUnit]): every shard.
        costs (Sequence[float]): per unit, its share of its rank's load.
        capacity (Sequence[float]): per rank, the most bytes it may hold.
        byte_price (float): seconds per step one byte moved costs.
        move_budget (Optional[int]): the most bytes a rank may send plus
            receive.

    Returns:
        SearchResult: the moves, and the loads after with the held tables.
    """
    if not held:
        return search_moves(
            loads,
            units,
            costs,
            capacity,
            byte_price=byte_price,
            move_budget=move_budget,
        )
    rest = list(loads)
    for unit, cost in zip(units, costs):
        if unit.table in held:
            rest[unit.rank] -= cost
    result = search_moves(
        rest,
        [replace(u, movable=False) if u.table in held else u for u in units],
        [0.0 if u.table in held else c for u, c in zip(units, costs)],
        capacity,
        byte_price=byte_price,
        move_budget=move_budget,
    )
    after = list(result.loads)
    for unit, cost in zip(units, costs):
        if unit.table in held:
            after[unit.rank] += cost
    return replace(
        result,
        loads=tuple(after),
        slowest_before=max(loads, default=0.0),
        slowest_after=max(after, default=0.0),
        lower_bound=lower_bound(loads, units, costs),
        mean_load=sum(loads) / max(len(loads), 1),
    )


def _split_level(
    placement: Placement,
    hot: Mapping[int, Tuple[str, ...]],
    total: float,
    where: Sequence[int],
    ids: Sequence[float],
    samples: Sequence[float],
    row_costs: Mapping[int, RowCosts],
    columns: Mapping[int, ColumnShardSeconds],
    seconds_per_element: float,
    lookup_columns: float,
    local_world_size: int,
    price: ExchangePrice,
) -> SplitLevel:
    """
    ``split_level`` of the ``hot`` tables (by index, with the row sharding
    types allowed), each whole or in column shards now (at ``where``), in
    every column and row layout it may take (``columns``: per table, what
    a column shard of it exchanges), ``total`` the seconds of all ranks
    together now.
    """
    shards: Dict[int, List[int]] = {t: [] for t in hot}
    for unit, rank in zip(placement.units, where):
        if unit.table in shards:
            shards[unit.table].append(rank)
    world_size = placement.world_size
    options: Dict[int, List[LayoutOption]] = {}
    for t, kinds in hot.items():
        layout = placement.tables[t].layout
        options[t] = column_options(
            layout.cols,
            len(shards[t]),
            ids[t],
            world_size,
            seconds_per_element,
            lookup_columns,
            columns[t],
        ) + row_options(
            layout,
            len(shards[t]),
            ids[t],
            samples[t],
            row_costs[t],
            world_size,
            local_world_size,
            kinds,
            shards[t],
            price,
        )
    return split_level(total, world_size, options)


def _column_bound(
    placement: Placement,
    row_splittable: Mapping[str, Tuple[str, ...]],
    changed: AbstractSet[str],
    narrowest: Sequence[float],
    mean: float,
) -> Dict[int, Tuple[str, ...]]:
    """
    The tables the row split search may spread, by index, with the row
    sharding types allowed: those of ``row_splittable`` the moves left as
    they are, of a type it can split, whose narrowest column shard
    (``narrowest``, per table: ``ALIGN`` columns reading every id) alone
    costs more than the mean rank (what column splits cannot fix).
    """
    out = {}
    for t, table in enumerate(placement.tables):
        if (
            narrowest[t] <= mean
            or table.sharding_type not in ROW_SPLITTABLE_TYPES
            or table.layout.replicated
        ):
            continue
        key = table.key  # built only for the few hot tables
        kinds = row_splittable.get(key)
        if kinds is not None and key not in changed:
            out[t] = kinds
    return out


def _take_off(
    placement: Placement,
    where: Sequence[int],
    ids: Sequence[float],
    lookup_columns: float,
    layouts: Mapping[str, TableLayout],
    elements: List[float],
    used: List[int],
) -> None:
    """Takes the shards of the tables of ``layouts`` off the ranks' elements and bytes."""
    if not layouts:
        return
    tables = {t for t, table in enumerate(placement.tables) if table.key in layouts}
    for unit, rank in zip(placement.units, where):
        if unit.table in tables:
            elements[rank] -= ids[unit.table] * unit_elements(unit, lookup_columns)
            used[rank] -= unit.nbytes

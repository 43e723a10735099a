#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Rebalancing at scale, by simulation (issue 27): no processes, the
rebalancer's own pure parts driven by synthetic ``LoadStatistics``.

For W ranks and T tables (fp32, 1e5-1e6 rows, dim 64 or 128, weights plus
optimizer state 8 B per element; tables with few ranks each cut into
column-wise shards so that there are a few shards per rank), a load trace
drifts through three phases of ``--windows`` windows:

* ``rotating``  Zipf-like pooling over the tables; at each phase the hot set
  moves to other tables;
* ``growing``   a handful of middling tables' pooling factor grows every
  window (8x over the trace);
* ``new-hot``   at each phase a table that was cold becomes the hottest.

A window's "measured" statistics come from a reference model the rebalancer
does not know: rank r's kernel seconds = ``fixed + slope x elements`` (times
a 2% noise), the step = a placement-independent 20 ms + the slowest rank's
kernel seconds. Every window the simulated job does what ``Rebalancer`` does
on every rank: calibrate (``costs.calibrate``), search (``costs.propose``),
screen and judge with the policy (bytes from the engine's ``bytes_per_rank``,
the busiest rank's transfers planned by ``plan_rank_transfers``), and apply
the moves. Compared per window, under the true load:

* ``static``   the initial placement (balanced for the first phase's load);
* ``oracle``   the best placement a strong search finds from scratch with no
  regard for bytes (longest-processing-time first, then the same local
  search without a byte price), next to the lower bound no placement of
  whole shards beats (the mean rank, the costliest shard);
* ``rebalanced``.

Printed per case: decision time per window (median, max; the thread's CPU
time, what the decision costs a rank, and the wall time, which on a shared
machine also holds other processes' turns), the rebalanced
and static slowest rank relative to the oracle at the end of each phase,
windows from a shift until the rebalanced slowest rank is within 1.1x the
oracle's, reshards, bytes per rank (busiest rank, per reshard), the
predicted step time against the reference model's after each reshard, and
the engine's per-rank planning time. ``--out-dir`` (default
``benchmarks/results/``, the options of ``common.py``) keeps a table, a JSON
file and, but with ``--no-plot``, a plot.

``--zipf S`` (issue 34) runs instead the loads that need splits: every
table starts whole (table-wise), placed for a uniform load; then the ids
per sample follow a Zipf law of exponent ``S`` (>= 1) over the tables, so
that the hottest table outweighs the mean rank. Per case, the slowest
rank's kernel time relative to the split bound (the mean rank, what
splitting could reach at best): the whole-shard bound (the mean rank or
the costliest whole table), the column bound (the costliest table cut in
4-column shards), the layout bound (the costliest table in its best layout
of TorchRec's: 4-column shards, row-wise over the group or a host, a grid;
no plan's slowest rank goes below it), the static placement, the rebalancer's moves only and
its moves with (column) splits and with row splits too (``+rows``: a table
may become row-wise over the group, table-row-wise over a host of
``--local-world-size`` ranks, or a grid of column blocks each over a host;
the reference model charges every rank of a row-wise table the pooled
output of its columns, ``samples x cols`` elements)
after ``--windows`` windows, the shards after, and the decision's CPU time
per window with splits and with row splits (median, max).

Issue 35: every column of the ``--zipf`` table is the slowest rank's kernel
plus exchange seconds: each rank's bytes per step of every table
(``exchange.table_exchange``: ids in, pooled output out, gradients back;
row groups reduce-scatter the output) at ``--seconds-per-byte``, and for
a row-wise, table-row-wise or grid table every rank's bucketization of its
ids at ``--seconds-per-id`` and the row sharding's collectives at
``--collective-seconds`` each. ASSUMED figures for a datacenter network of
GPUs (printed with the table): 100 Gb/s per rank (8e-11 s per byte), 30 us
per collective, 0.1 ns per id bucketized. ``+rows`` is the row split search
priced at nothing (kernels alone, as before issue 35), ``priced`` the same
search given those figures (what a job's calibration measures): its row
splits priced by what they change, and its column splits leveling each
rank's kernel plus its modelled exchange (a piece's holder receives every
id of its table). ``step LB`` is the least kernel plus exchange seconds
of the slowest rank in any plan: the mean rank's with every table whole
(a split only adds ids sent and received, a row group output exchanged),
or a table's busiest rank in its best layout (``least_step``) plus what
every other table costs every rank at least; ``/LB`` the slowest rank's
kernel plus exchange over it.

    python benchmarks/rebalance_scale_benchmark.py            # every case
    python benchmarks/rebalance_scale_benchmark.py --worlds 64 --tables 100
    python benchmarks/rebalance_scale_benchmark.py --zipf 1.1 --windows 6
"""

import argparse
import dataclasses
import gc
import heapq
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from common import fmt, output_arguments, save_results

NAME = "rebalance_scale_benchmark"  # of its results in --out-dir
PATH = "ebc"
ELEMENT_BYTES = 8  # fp32 weights + one optimizer value per element
LOCAL_BATCH = 512
DENSE_S = 0.020
FIXED_S = 0.0005
SLOPE_S = 2.0e-10  # seconds per element read (reference model)
NOISE = 0.02
TRACES = ("rotating", "growing", "new-hot")
ROW_TYPES = ("row_wise", "table_row_wise", "grid_shard")


@dataclass
class Case:
    world: int
    tables: int
    trace: str
    decision_ms: List[float] = field(default_factory=list)
    decision_cpu_ms: List[float] = field(default_factory=list)
    rows: List[Dict[str, Any]] = field(default_factory=list)
    phase_end: List[Dict[str, float]] = field(default_factory=list)
    react: List[Optional[int]] = field(default_factory=list)
    reshards: List[Dict[str, Any]] = field(default_factory=list)


def make_tables(rng: random.Random, t: int, w: int) -> List[Any]:
    """The tables, laid out as ``TableInfo`` with placeholder ranks."""
    from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
    from torchrec.distributed.resharding.rebalance.placement import TableInfo

    infos = []
    for i in range(t):
        rows, dim = rng.randint(100_000, 1_000_000), rng.choice([64, 128])
        k = max(1, min(dim // 16, round(3 * w / t)))
        k = 1 << (k.bit_length() - 1)  # a power of two dividing dim
        width = dim // k
        shards = tuple(
            PlacedShard(0, Rect(0, j * width, rows, width)) for j in range(k)
        )
        kind = "table_wise" if k == 1 else "column_wise"
        infos.append(
            TableInfo(PATH, f"t{i:04d}", kind, TableLayout(rows, dim, shards), 8)
        )
    return infos


def pooling(trace: str, t: int, window: int, per_phase: int, seed: int) -> List[float]:
    """Mean ids per sample of each table at a window of the trace."""
    phase = window // per_phase
    rng = random.Random(seed)
    order = list(range(t))
    rng.shuffle(order)
    base = [0.0] * t
    for position, table in enumerate(order):
        base[table] = 1.0 + 15.0 / (position + 1) ** 0.8
    if trace == "rotating":
        shift = phase * (t // 4)
        return [base[(i + shift) % t] for i in range(t)]
    if trace == "growing":  # tables of middling popularity
        grown = order[t // 10 : t // 10 + max(1, t // 50)]
        factor = 8.0 ** (window / max(3 * per_phase - 1, 1))
        return [b * factor if i in grown else b for i, b in enumerate(base)]
    hot = list(base)
    coldest = sorted(range(t), key=lambda i: base[i])
    for p in range(1, phase + 1):
        hot[coldest[p - 1]] = 2.0 * max(base)
    return hot


def exchange_seconds(placement: Any, ids: Sequence[float], price: Any) -> List[float]:
    """
    Per rank, seconds per step of its exchange under the reference model:
    every table's bytes, and each row-spread table's bucketization and
    collectives.
    """
    from torchrec.distributed.resharding.rebalance.exchange_price import (
        row_blocks_spread,
        ROW_COLLECTIVES,
        table_exchange,
    )

    w = placement.world_size
    samples = LOCAL_BATCH * w
    every = 0.0
    out = [0.0] * w
    for table, n in zip(placement.tables, ids):
        exchange = table_exchange(table.layout, w, n, samples)
        spread = row_blocks_spread(table.layout)
        every += exchange.others * price.seconds_per_byte
        if spread:
            every += price.seconds_per_id * n / w * spread
            every += price.seconds_per_collective * ROW_COLLECTIVES
        for rank, value in exchange.holders.items():
            out[rank] += (value - exchange.others) * price.seconds_per_byte
    return [every + v for v in out]


def true_kernels(
    placement: Any, ids: Sequence[float], noise: Optional[random.Random]
) -> List[float]:
    from torchrec.distributed.resharding.rebalance.costs import rank_elements

    elements = rank_elements(placement.units, ids, placement.world_size)
    samples = LOCAL_BATCH * placement.world_size  # per table: one feature
    for unit in placement.units:  # a row-wise shard's pooled output
        table = placement.tables[unit.table]
        if table.sharding_type in ROW_TYPES:
            elements[unit.rank] += samples * table.layout.shards[unit.shard].rect.cols
    out = []
    for e in elements:
        k = FIXED_S + SLOPE_S * e
        out.append(k * (1.0 + NOISE * (2 * noise.random() - 1)) if noise else k)
    return out


def window_stats(placement: Any, ids: Sequence[float], noise: random.Random) -> Any:
    from torchrec.distributed.resharding.rebalance.load import LoadStatistics, TableLoad

    kernels = true_kernels(placement, ids, noise)
    w = placement.world_size
    step = DENSE_S + max(kernels)
    return LoadStatistics(
        steps=50,
        tables=tuple(
            TableLoad(
                PATH, t.name, (t.name,), (n / (LOCAL_BATCH * w),), (LOCAL_BATCH,), n
            )
            for t, n in zip(placement.tables, ids)
        ),
        compute_seconds=tuple(kernels),
        input_dist_seconds=(0.0,) * w,
        output_dist_seconds=(0.0,) * w,
        step_seconds=(step,) * w,
    )


def assign(placement: Any, ranks: Sequence[int]) -> Any:
    """The placement with unit i on ``ranks[i]``."""
    from torchrec.distributed.resharding.rebalance.placement import (
        moved_layouts,
        with_layouts,
    )

    moves = [(i, r) for i, r in enumerate(ranks) if r != placement.units[i].rank]
    return with_layouts(placement, moved_layouts(placement, moves))


def from_scratch(placement: Any, costs: Sequence[float]) -> Any:
    """Longest processing time first, then the local search (bytes free)."""
    from torchrec.distributed.resharding.rebalance.search import search_moves

    w = placement.world_size
    heap = [(0.0, r) for r in range(w)]
    holders: Dict[int, set] = {}
    ranks = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        table = placement.units[i].table
        held = holders.setdefault(table, set())
        skipped = []
        load, r = heapq.heappop(heap)
        while r in held:  # no two shards of a table on one rank
            skipped.append((load, r))
            load, r = heapq.heappop(heap)
        ranks[i] = r
        held.add(r)
        heapq.heappush(heap, (load + costs[i], r))
        for entry in skipped:
            heapq.heappush(heap, entry)
    first = assign(placement, ranks)
    loads = [0.0] * w
    for u, c in zip(first.units, costs):
        loads[u.rank] += c
    result = search_moves(loads, first.units, costs, [float("inf")] * w, min_cut=0.0)
    return apply_moves(first, result.moves)


def apply_moves(placement: Any, moves: Sequence[Tuple[int, int]]) -> Any:
    from torchrec.distributed.resharding.rebalance.placement import (
        moved_layouts,
        with_layouts,
    )

    return with_layouts(placement, moved_layouts(placement, moves))


def bytes_and_planning(before: Any, layouts: Dict[str, Any]) -> Tuple[List[int], float]:
    """
    The engine's dry-run count of a move (bytes sent + received per rank)
    and the seconds ``plan_rank_transfers`` takes for its busiest rank.
    """
    from torchrec.distributed.resharding.transfer_bytes import bytes_per_rank, PieceCost
    from torchrec.distributed.resharding.transfer_plan import plan_rank_transfers

    old = {k: v for k, v in before.layouts().items() if k in layouts}
    costs = {k: PieceCost(ELEMENT_BYTES) for k in layouts}
    sent, received = bytes_per_rank(old, layouts, costs)
    per_rank = [0] * before.world_size
    for r, b in sent.items():
        per_rank[r] += b
    for r, b in received.items():
        per_rank[r] += b
    busiest = max(range(len(per_rank)), key=lambda r: per_rank[r])
    start = time.perf_counter()
    plan_rank_transfers(old, layouts, busiest)
    return per_rank, time.perf_counter() - start


def run_case(w: int, t: int, trace: str, args: argparse.Namespace) -> Case:
    from torchrec.distributed.resharding.rebalance.costs import (
        calibrate,
        propose,
        rank_elements,
        table_ids,
        unit_costs,
    )
    from torchrec.distributed.resharding.rebalance.placement import (
        placement_from_tables,
    )
    from torchrec.distributed.resharding.rebalance.policy import (
        after_reshard,
        blocked_reason,
        byte_price,
        judge_move,
        PolicyState,
        RebalancePolicy,
        screen,
    )

    rng = random.Random(args.seed * 1000 + w + t)
    noise = random.Random(args.seed)
    per_phase = args.windows
    policy = RebalancePolicy(
        window=50,
        min_gain=0.05,
        hysteresis=2,
        min_interval=100,
        horizon=10_000,
        default_bandwidth=args.bandwidth,
    )
    state = PolicyState()
    placement = placement_from_tables(make_tables(rng, t, w), w)
    first_ids = [
        p * LOCAL_BATCH * w for p in pooling(trace, t, 0, per_phase, args.seed)
    ]
    # the static plan: balanced for the first phase's load
    static = from_scratch(placement, unit_costs(placement.units, first_ids, SLOPE_S))
    placement = static
    capacity = [float("inf")] * w
    case = Case(w, t, trace)
    slope: Optional[float] = None
    pending: Optional[Dict[str, Any]] = None
    shift_at = 0
    reacted: Optional[int] = None
    for window in range(3 * per_phase):
        step = (window + 1) * policy.window
        ids = [
            p * LOCAL_BATCH * w for p in pooling(trace, t, window, per_phase, args.seed)
        ]
        costs = unit_costs(placement.units, ids, SLOPE_S)
        oracle = from_scratch(placement, costs)
        truth = {
            name: max(true_kernels(p, ids, None))
            for name, p in (("static", static), ("oracle", oracle))
        }
        stats = window_stats(placement, ids, noise)
        truth["rebalanced"] = max(true_kernels(placement, ids, None))
        bound = max(sum(costs) / w + FIXED_S, max(costs) + FIXED_S)
        if pending is not None:
            pending["measured_step_s"] = stats.step_time
            case.reshards.append(pending)
            pending = None
        if window % per_phase == 0:
            shift_at, reacted = window, None
        if reacted is None and truth["rebalanced"] <= 1.1 * truth["oracle"]:
            reacted = window - shift_at
        gc.collect()  # the oracle's garbage is not the decision's to collect
        start, cpu = time.perf_counter(), time.thread_time()
        elements = rank_elements(placement.units, table_ids(stats, placement), w)
        slope = calibrate(stats.compute_seconds, elements, slope)
        proposal = None
        if slope is not None and blocked_reason(policy, state, step) is None:
            proposal = propose(
                stats, placement, slope, capacity, byte_price(policy, state)
            )
        decided = time.perf_counter() - start
        case.decision_ms.append(1e3 * decided)
        case.decision_cpu_ms.append(1e3 * (time.thread_time() - cpu))
        action = "keep"
        if proposal is not None and proposal.layouts:
            gain = proposal.prediction.gain
            reason, state = screen(policy, state, gain)
            if reason is None:
                per_rank, planning = bytes_and_planning(placement, proposal.layouts)
                reason, move_s = judge_move(
                    policy, state, proposal.prediction.saving, max(per_rank)
                )
                if reason is None:
                    action = "reshard"
                    placement = apply_moves(placement, proposal.search.moves)
                    state = after_reshard(policy, state, step)
                    pending = {
                        "window": window,
                        "tables": len(proposal.layouts),
                        "max_rank_mib": max(per_rank) / 2**20,
                        "mean_rank_mib": sum(per_rank) / w / 2**20,
                        "planning_ms": 1e3 * planning,
                        "predicted_step_s": proposal.prediction.predicted_step,
                        "model_step_s": DENSE_S
                        + max(true_kernels(placement, ids, None)),
                    }
        case.rows.append(
            {
                "window": window,
                "decision_ms": 1e3 * decided,
                "static": truth["static"],
                "oracle": truth["oracle"],
                "rebalanced": truth["rebalanced"],
                "bound": bound,
                "action": action,
            }
        )
        if window % per_phase == per_phase - 1:
            case.react.append(reacted)
            after = max(true_kernels(placement, ids, None))
            case.phase_end.append(
                {
                    "rebalanced_x_oracle": after / truth["oracle"],
                    "static_x_oracle": truth["static"] / truth["oracle"],
                    "oracle_x_bound": truth["oracle"] / bound,
                }
            )
    if pending is not None:
        case.reshards.append(pending)
    return case


def zipf_tables(rng: random.Random, t: int) -> List[Any]:
    """Table-wise tables (1e5-1e6 rows, dim 64 or 128), ranks placeholders."""
    from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
    from torchrec.distributed.resharding.rebalance.placement import TableInfo

    infos = []
    for i in range(t):
        rows, dim = rng.randint(100_000, 1_000_000), rng.choice([64, 128])
        layout = TableLayout(rows, dim, (PlacedShard(0, Rect(0, 0, rows, dim)),))
        infos.append(TableInfo(PATH, f"t{i:04d}", "table_wise", layout, 8))
    return infos


def zipf_pooling(t: int, exponent: float, seed: int) -> List[float]:
    """Ids per sample of each table: 64 / position^exponent, shuffled."""
    order = list(range(t))
    random.Random(seed).shuffle(order)
    out = [0.0] * t
    for position, table in enumerate(order):
        out[table] = 64.0 / (position + 1) ** exponent
    return out


def least_per_rank(
    cost: float, cols: int, samples: int, world_size: int, local_world_size: int
) -> float:
    """
    The least kernel seconds a table of ``cost`` seconds and ``cols``
    columns puts on its busiest rank in any of TorchRec's layouts: whole,
    in 4-column shards, row-wise over the group or a host, or a grid of
    ``k`` column blocks over ``k`` hosts (a row group's ranks each write
    the pooled output of their columns, ``samples x cols`` elements).
    """
    from torchrec.distributed.resharding.rebalance.row_splits import grid_blocks
    from torchrec.distributed.resharding.rebalance.splits import ALIGN

    output = samples * SLOPE_S
    hosts = world_size // local_world_size
    options = [
        cost * ALIGN / cols,
        cost / world_size + output * cols,
        cost / local_world_size + output * cols,
    ]
    for k in grid_blocks(cols, hosts):
        options.append(cost / (k * local_world_size) + output * (cols // k))
    return min([cost] + options)


def step_options(
    table: Any,
    ids: float,
    samples: int,
    world_size: int,
    local_world_size: int,
    price: Any,
) -> List[Tuple[float, float, float]]:
    """
    Per layout of TorchRec's a table may take (whole, column-wise in ``k``
    shards of widths that are multiples of 4, row-wise over the group or a
    host, a grid of ``k`` column blocks over ``k`` hosts), under the
    reference model (``true_kernels``, ``exchange_seconds``): the kernel
    plus exchange seconds it puts on its busiest rank, on all ranks
    together, and on a rank holding none of it.
    """
    from torchrec.distributed.resharding.rebalance.exchange_price import (
        blocks_exchange,
        ROW_COLLECTIVES,
    )
    from torchrec.distributed.resharding.rebalance.row_splits import (
        grid_blocks,
        host_ranks,
        row_blocks,
    )
    from torchrec.distributed.resharding.rebalance.splits import ALIGN

    rows, cols = table.layout.rows, table.layout.cols
    per_byte = price.seconds_per_byte
    hosts = host_ranks(world_size, local_world_size)

    def spread(ranks: Sequence[int]) -> List[Tuple[int, int]]:
        return [(r, n) for r, (_, n) in zip(ranks, row_blocks(rows, len(ranks)))]

    layouts = [[((0, cols), [(0, rows)])]]
    for k in range(2, cols // ALIGN + 1):
        width = -(-cols // k // ALIGN) * ALIGN  # the widest shard of k
        if width * (k - 1) < cols:
            layouts.append(
                [((i * width, width), [(i, rows)]) for i in range(k - 1)]
                + [(((k - 1) * width, cols - (k - 1) * width), [(k - 1, rows)])]
            )
    layouts.append([((0, cols), spread(range(world_size)))])
    if 1 < local_world_size < world_size:
        layouts.append([((0, cols), spread(hosts[0]))])
        for k in grid_blocks(cols, len(hosts)):
            width = cols // k
            layouts.append([((c * width, width), spread(hosts[c])) for c in range(k)])
    out = []
    for blocks in layouts:
        exchange = blocks_exchange(blocks, rows, world_size, ids, samples)
        fixed = 0.0
        row_spread = sum(1 for _, shards in blocks if len(shards) > 1)
        if row_spread:
            fixed = price.seconds_per_id * ids / world_size * row_spread
            fixed += price.seconds_per_collective * ROW_COLLECTIVES
        everyone = exchange.others * per_byte + fixed
        busiest, total = 0.0, everyone * world_size
        for (_, width), shards in blocks:
            output = samples * width if len(shards) > 1 else 0.0
            for rank, count in shards:
                kernel = SLOPE_S * (ids * count / rows * width + output)
                seconds = kernel + exchange.of(rank) * per_byte + fixed
                busiest = max(busiest, seconds)
                total += seconds - everyone
        out.append((busiest, total, everyone))
    return out


def step_bound(
    options: Sequence[Sequence[Tuple[float, float, float]]], w: int
) -> float:
    """
    The least kernel plus exchange seconds of the slowest rank in any plan
    whose tables take the layouts of ``options`` (per table,
    ``step_options``): the least ``X`` for which every table has a layout
    whose busiest rank, plus what every other table costs every rank at
    least, is at most ``X``, and the mean rank, each table in the least
    costly of those layouts, is at most ``X`` (a plan's slowest rank is at
    least its mean and at least any rank holding part of a table).
    """
    least = [min(e for _, _, e in table) for table in options]
    every = FIXED_S + sum(least)

    def feasible(x: float) -> bool:
        total = FIXED_S * w
        for table, own in zip(options, least):
            allowed = [t for b, t, _ in table if b + every - own <= x]
            if not allowed:
                return False
            total += min(allowed)
        return total / w <= x

    low = max(
        min(b for b, _, _ in table) + every - own for table, own in zip(options, least)
    )
    high = low
    while not feasible(high):
        high *= 2
    for _ in range(40):
        middle = (low + high) / 2
        if feasible(middle):
            high = middle
        else:
            low = middle
    return high


def with_split_layouts(placement: Any, proposal: Any) -> Any:
    """The placement with a proposal's layouts and sharding types."""
    from dataclasses import replace

    from torchrec.distributed.resharding.rebalance.placement import (
        placement_from_tables,
    )

    tables = [
        replace(
            t,
            layout=proposal.layouts.get(t.key, t.layout),
            sharding_type=proposal.sharding_types.get(t.key, t.sharding_type),
        )
        for t in placement.tables
    ]
    return placement_from_tables(tables, placement.world_size)


def run_zipf_case(w: int, t: int, args: argparse.Namespace) -> Dict[str, Any]:
    """Static, moves only, moves and splits on a Zipf load, and the bounds."""
    from torchrec.distributed.resharding.rebalance.costs import (
        calibrate,
        propose,
        unit_costs,
        window_elements,
    )
    from torchrec.distributed.resharding.rebalance.exchange_price import ExchangePrice
    from torchrec.distributed.resharding.rebalance.placement import (
        placement_from_tables,
    )
    from torchrec.distributed.resharding.rebalance.splits import ALIGN

    price = ExchangePrice(
        args.seconds_per_byte, args.collective_seconds, args.seconds_per_id
    )

    def step_seconds(placement: Any) -> List[float]:
        kernels = true_kernels(placement, ids, None)
        exchange = exchange_seconds(placement, ids, price)
        return [k + e for k, e in zip(kernels, exchange)]

    rng = random.Random(args.seed * 1000 + w + t)
    placement = placement_from_tables(zipf_tables(rng, t), w)
    uniform = [4.0 * LOCAL_BATCH * w] * t
    static = from_scratch(placement, unit_costs(placement.units, uniform, SLOPE_S))
    ids = [p * LOCAL_BATCH * w for p in zipf_pooling(t, args.zipf, args.seed)]
    costs = unit_costs(static.units, ids, SLOPE_S)
    mean = sum(costs) / w
    split_bound = FIXED_S + mean
    whole_bound = FIXED_S + max(mean, max(costs))
    column_bound = FIXED_S + max(
        [mean]
        + [c / max(1, tb.layout.cols // ALIGN) for c, tb in zip(costs, static.tables)]
    )
    samples = LOCAL_BATCH * w
    geometry_bound = FIXED_S + max(
        [mean]
        + [
            least_per_rank(c, tb.layout.cols, samples, w, args.local_world_size)
            for c, tb in zip(costs, static.tables)
        ]
    )
    # the step's bound: no plan's slowest rank is below its mean rank, nor
    # below any rank holding part of a table (``step_bound``)
    options = [
        step_options(tb, n, samples, w, args.local_world_size, price)
        for tb, n in zip(static.tables, ids)
    ]
    out: Dict[str, Any] = {
        "step_bound_s": step_bound(options, w),
        "whole_mean_s": sum(step_seconds(static)) / w,
        "world": w,
        "tables": t,
        "zipf": args.zipf,
        "split_bound_s": split_bound,
        "whole_bound_s": whole_bound,
        "column_bound_s": column_bound,
        "geometry_bound_s": geometry_bound,
        "static_s": max(step_seconds(static)),
        "static_kernel_s": max(true_kernels(static, ids, None)),
    }
    splittable = {tb.key for tb in static.tables}
    rows = {tb.key: ROW_TYPES for tb in static.tables}
    for name, splits, row_splits, priced in (
        ("moves", False, False, False),
        ("splits", True, False, False),
        ("rows", True, True, False),
        ("priced", True, True, True),
    ):
        placement, slope = static, None
        cpu_ms: List[float] = []
        # each case its own noise, the same draws window by window: a case's
        # result must not depend on how many windows the cases before it ran
        noise = random.Random(args.seed)
        for _ in range(args.windows):
            stats = window_stats(placement, ids, noise)
            # the measured step holds the slowest rank's exchange too (in every
            # case, as a job's would: the cases without the price stop by it as
            # well, so their ratios differ from runs before the price existed)
            step = DENSE_S + max(
                k + e
                for k, e in zip(
                    stats.compute_seconds, exchange_seconds(placement, ids, price)
                )
            )
            stats = dataclasses.replace(stats, step_seconds=(step,) * w)
            gc.collect()
            cpu = time.thread_time()
            elements = window_elements(stats, placement)
            slope = calibrate(stats.compute_seconds, elements, slope)
            assert slope is not None
            proposal = propose(
                stats,
                placement,
                slope,
                [float("inf")] * w,
                0.0,
                None,
                splittable if splits else None,
                row_splittable=rows if row_splits else None,
                local_world_size=args.local_world_size,
                exchange_price=price if priced else None,
            )
            cpu_ms.append(1e3 * (time.thread_time() - cpu))
            if not proposal.layouts or proposal.prediction.gain < 0.01:
                break
            placement = with_split_layouts(placement, proposal)
        kernels = step_seconds(placement)
        out[f"{name}_s"] = max(kernels)
        out[f"{name}_kernel_s"] = max(true_kernels(placement, ids, None))
        out[f"{name}_mean_s"] = sum(kernels) / w
        out[f"{name}_cpu_ms"] = cpu_ms
        out[f"{name}_shards"] = len(placement.units)
        out[f"{name}_row_wise"] = sum(
            tb.sharding_type in ROW_TYPES for tb in placement.tables
        )
    return out


def zipf_table(rows: Sequence[Dict[str, Any]], args: argparse.Namespace) -> str:
    head = (
        f"{'W':>5} {'T':>5} {'zipf':>5} {'whole LB':>9} {'column LB':>9} "
        f"{'layout LB':>9} "
        f"{'static':>11} {'moves':>11} {'+splits':>11} {'+rows':>11} {'priced':>11} "
        f"{'shards':>11} {'+rows':>11} {'priced':>11} {'row/grid':>8} {'priced':>7} "
        f"{'cpu ms med':>10} {'max':>6} {'+rows med':>9} {'max':>6} "
        f"{'priced med':>10} {'max':>6} {'step LB':>8} {'/LB +rows':>9} {'priced':>6}"
    )
    lines = [
        "slowest rank's kernel seconds / split bound (the mean rank's "
        "kernel), then its kernel + exchange seconds / split bound; +splits: moves and column splits, +rows: and row "
        "splits searched on kernels alone (a row-wise table's ranks each pay "
        "its pooled output), priced: row and column splits searched with "
        "the exchange priced (the column splits level each rank's kernel plus "
        "its modelled exchange); layout LB: the costliest table in its best layout of "
        "TorchRec's (4-column shards, row-wise, table-row-wise, grid), no "
        "plan's slowest rank is below it; shards: before -> after; row/grid: "
        "tables made row-wise, table-row-wise or grid; cpu ms: the decision "
        "per window; step LB: the least kernel + exchange seconds of the "
        "slowest rank in any plan (the mean rank's with every table whole, "
        "or a table's busiest rank in its best layout plus what every other "
        "table costs every rank at least), over the split bound; /LB: the "
        "slowest rank's kernel + exchange over it",
        f"exchange (ASSUMED, a datacenter network of GPUs): "
        f"{args.seconds_per_byte:.3g} s/byte ({8e-9 / args.seconds_per_byte:.0f} "
        f"Gb/s per rank), {args.collective_seconds * 1e6:.0f} us per collective, "
        f"{args.seconds_per_id * 1e9:.2f} ns per id bucketized",
        head,
        "-" * len(head),
    ]
    for r in rows:
        b = r["split_bound_s"]
        cpus = [r[f"{n}_cpu_ms"] for n in ("splits", "rows", "priced")]
        lines.append(
            f"{r['world']:>5} {r['tables']:>5} {r['zipf']:>5.2f} "
            f"{r['whole_bound_s'] / b:>9.2f} {r['column_bound_s'] / b:>9.2f} "
            f"{r['geometry_bound_s'] / b:>9.2f} "
            + " ".join(
                f"{r[n + '_kernel_s'] / b:>5.2f}/{r[n + '_s'] / b:<5.2f}"
                for n in ("static", "moves", "splits", "rows", "priced")
            )
            + " "
            f"{str(r['tables']) + '->' + str(r['splits_shards']):>11} "
            f"{str(r['tables']) + '->' + str(r['rows_shards']):>11} "
            f"{str(r['tables']) + '->' + str(r['priced_shards']):>11} "
            f"{r['rows_row_wise']:>8} {r['priced_row_wise']:>7} "
            + " ".join(
                f"{statistics.median(c):>{w1}.1f} {max(c):>6.1f}"
                for c, w1 in zip(cpus, (10, 9, 10))
            )
            + f" {r['step_bound_s'] / b:>8.2f}"
            + f" {r['rows_s'] / r['step_bound_s']:>9.2f}"
            + f" {r['priced_s'] / r['step_bound_s']:>6.2f}"
        )
    return "\n".join(lines)


def zipf_main(args: argparse.Namespace) -> None:
    rows = []
    for w in args.worlds:
        for t in args.tables:
            rows.append(run_zipf_case(w, t, args))
            print(zipf_table(rows[-1:], args).splitlines()[-1], flush=True)
    text = zipf_table(rows, args)
    print()
    print(text)
    for name, what in (
        ("splits", "with splits"),
        ("rows", "with row splits"),
        ("priced", "with priced row and column splits"),
    ):
        worst = max(max(r[f"{name}_cpu_ms"]) for r in rows)
        print(f"worst decision per window (CPU, {what}): {worst:.1f} ms")
    stem = save_results(
        args.out_dir, NAME + "_zipf", {"args": vars(args), "cases": rows}
    )
    save_text(stem, text)


def save_text(stem: str, text: str) -> None:
    """
    Writes a run's table beside its results, to ``stem.txt``; says so.

    Args:
        stem (str): the results' path without its extension.
        text (str): the table.

    Returns:
        None
    """
    with open(stem + ".txt", "w") as f:
        f.write(text + "\n")
    print(f"wrote {stem}.txt")


def fmt_phases(values: Sequence[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def table(cases: Sequence[Case]) -> str:
    head = (
        f"{'W':>5} {'T':>5} {'trace':<9} {'cpu ms':>7} {'max':>6} {'wall ms':>8} "
        f"{'max':>6} "
        f"{'rebal/oracle':>15} {'static/oracle':>15} {'oracle/LB':>15} "
        f"{'react':>8} {'reshards':>8} {'MiB/rank':>9} {'pred err':>9} "
        f"{'plan ms':>8}"
    )
    lines = [head, "-" * len(head)]
    for c in cases:
        moved = [r["max_rank_mib"] for r in c.reshards]
        errors = [
            abs(r["predicted_step_s"] / r["model_step_s"] - 1.0) for r in c.reshards
        ]
        planning = [r["planning_ms"] for r in c.reshards]
        react = "/".join(fmt(r, "d") for r in c.react)
        lines.append(
            f"{c.world:>5} {c.tables:>5} {c.trace:<9} "
            f"{statistics.median(c.decision_cpu_ms):>7.1f} {max(c.decision_cpu_ms):>6.1f} "
            f"{statistics.median(c.decision_ms):>8.1f} {max(c.decision_ms):>6.1f} "
            f"{fmt_phases([p['rebalanced_x_oracle'] for p in c.phase_end]):>15} "
            f"{fmt_phases([p['static_x_oracle'] for p in c.phase_end]):>15} "
            f"{fmt_phases([p['oracle_x_bound'] for p in c.phase_end]):>15} "
            f"{react:>8} {len(c.reshards):>8} "
            f"{(max(moved) if moved else 0.0):>9.0f} "
            f"{(max(errors) if errors else 0.0):>8.1%} "
            f"{(max(planning) if planning else 0.0):>8.1f}"
        )
    return "\n".join(lines)


def plot(cases: Sequence[Case], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TRACES), figsize=(15, 4.5), sharey=True)
    for ax, trace in zip(axes, TRACES):
        for c in cases:
            if c.trace != trace:
                continue
            x = [r["window"] for r in c.rows]
            line = ax.plot(
                x,
                [r["rebalanced"] / r["oracle"] for r in c.rows],
                label=f"W={c.world} T={c.tables}",
            )[0]
            ax.plot(
                x,
                [r["static"] / r["oracle"] for r in c.rows],
                color=line.get_color(),
                ls=":",
                lw=0.8,
            )
        ax.axhline(1.1, color="black", lw=0.6, ls="--")
        ax.set_title(f"{trace} (dotted: static)")
        ax.set_xlabel("window")
    axes[0].set_ylabel("slowest rank / oracle's")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[output_arguments()],
    )
    p.add_argument("--worlds", default="64,256,1024")
    p.add_argument("--tables", default="100,1000")
    p.add_argument("--traces", default=",".join(TRACES))
    p.add_argument("--windows", type=int, default=8, help="windows per phase")
    p.add_argument("--bandwidth", type=float, default=10e9, help="bytes/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--local-world-size",
        type=int,
        default=8,
        help="ranks per host (--zipf: the hosts of table-row-wise splits)",
    )
    p.add_argument(
        "--zipf",
        type=float,
        default=None,
        help="run the split cases on a Zipf load of this exponent (>= 1)",
    )
    p.add_argument(
        "--seconds-per-byte",
        type=float,
        default=8e-11,
        help="--zipf: ASSUMED seconds per byte a rank sends or receives "
        "(default: 100 Gb/s)",
    )
    p.add_argument(
        "--collective-seconds",
        type=float,
        default=30e-6,
        help="--zipf: ASSUMED seconds of a collective however small",
    )
    p.add_argument(
        "--seconds-per-id",
        type=float,
        default=1e-10,
        help="--zipf: ASSUMED seconds to bucketize one id by row block",
    )
    args = p.parse_args(argv)
    args.worlds = [int(x) for x in args.worlds.split(",")]
    args.tables = [int(x) for x in args.tables.split(",")]
    args.traces = [x for x in args.traces.split(",") if x]
    if set(args.traces) - set(TRACES):
        p.error(f"--traces: one of {TRACES}")
    if args.zipf is not None and args.zipf < 1.0:
        p.error("--zipf: an exponent >= 1")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.zipf is not None:
        zipf_main(args)
        return
    cases = []
    for w in args.worlds:
        for t in args.tables:
            for trace in args.traces:
                case = run_case(w, t, trace, args)
                cases.append(case)
                print(table([case]).splitlines()[-1], flush=True)
    text = table(cases)
    print()
    print(text)
    biggest = [
        c for c in cases if (c.world, c.tables) == (max(args.worlds), max(args.tables))
    ]
    if biggest:
        for what, key in (("CPU", "decision_cpu_ms"), ("wall", "decision_ms")):
            values = [d for c in biggest for d in getattr(c, key)]
            print(
                f"decision per window at {max(args.tables)} tables x "
                f"{max(args.worlds)} ranks, {what} time: median "
                f"{statistics.median(values):.1f} ms, max {max(values):.1f} ms "
                "(target <= 50 ms): " + ("MET" if max(values) <= 50 else "NOT MET")
            )
    stem = save_results(
        args.out_dir,
        NAME,
        {"args": vars(args), "cases": [c.__dict__ for c in cases]},
        None if args.no_plot else lambda path: plot(cases, path),
    )
    save_text(stem, text)


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
How the cost of a reshard's planning and agreement grows with ranks and
tables: pure planner and store protocol, one process, no data.

Synthetic layouts, a mix of jobs at scale: of T tables, 60% go row-wise from
W/2 to W ranks, 20% move table-wise from a rank of the old group to a rank
of the new one, 10% go column-wise from 2 to 4 shards, 10% go row-wise (W/2
ranks) -> replicated (W ranks). The old group is ranks 0 .. W/2 - 1 of the
new one (a job that doubles), so W is the new world size.

Measured per (T, W), in one run:

* ``layouts``  building the old and new layouts of all T tables (what every
  rank does once from the sharding plans; not part of planning);
* ``per rank`` ``plan_rank_transfers`` for a sample of ranks (min, median,
  max; the planner caches nothing, so every call is cold: its indexes are
  built inside the timed call); ``objects s`` is what only constructing as
  many ``Transfer`` objects as the slowest rank's answer holds costs (a floor
  for any planner that returns them);
* ``dry run``  ``bytes_per_rank``: bytes sent and received by every rank;
* ``today``    what every rank did before: the whole plan by intersecting
  every new shard with every old rectangle
  (``test_utils.plan_layouts.reference_plan``), then its own sends, receives
  and local copies out of it. Measured where it fits ``--today-budget-s``
  (estimated from the cheaper sizes measured first); elsewhere extrapolated
  linearly in the intersected pairs from the largest measured size, and
  marked so.

And the store agreement (``scale_agreement.measure_agreement``, the
other half of the scale story; the run fails if that module is missing): N
participants as threads on one local ``TCPStore``, seconds and bytes
through the store, and today's protocol where it ran.

Times are wall-clock (``max cpu s``: CPU time of the slowest sampled rank);
on a shared machine compare the ratios within one run.

Example::

    python benchmarks/scale_benchmark.py --tables 100,1000 --worlds 64,256,1024
"""

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import textwrap
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from common import benchmark_parser, fmt, save_figure, save_results, table_head
from torchrec.distributed.resharding.plan import (
    PlacedShard,
    Rect,
    replicated_layout,
    TableLayout,
    Transfer,
)
from torchrec.distributed.resharding.transfer_bytes import bytes_per_rank, PieceCost
from torchrec.distributed.resharding.transfer_plan import plan_rank_transfers
from torchrec.distributed.test_utils.plan_layouts import reference_plan

# Measured with the whole-plan planner every rank used to run (same machine).
ISSUE_TODAY = {
    (1000, 128): "7-11 s per rank",
    (1000, 1024): "486-622 s per rank",
}

Layouts = Dict[str, Any]  # name -> TableLayout


def table_mix(
    tables: int, world: int, dim: int = 128
) -> Tuple[List[Tuple[str, str, int, int]], int]:
    """
    Args:
        tables (int): number of tables.
        world (int): new world size (the old one is half of it).
        dim (int): columns of every table.

    Returns:
        Tuple[List[Tuple[str, str, int, int]], int]: (name, kind, rows, cols)
        per table, and the old world size.
    """
    if world < 4 or world % 2:
        raise ValueError(f"the new world size must be even and >= 4, got {world}")
    kinds = ["rw_grow"] * 6 + ["tw_move"] * 2 + ["cw_2_to_4", "rw_to_dp"]
    out = []
    for i in range(tables):
        rows = 500_000 + (i * 7919) % 500_000  # uneven row-wise splits
        out.append((f"t{i}", kinds[i % 10], rows, dim))
    return out, world // 2


def build_layouts(
    tables: int, world: int, dim: int = 128
) -> Tuple[Layouts, Layouts, Dict[str, Any]]:
    """
    Args:
        tables (int): number of tables.
        world (int): new world size.
        dim (int): columns of every table.

    Returns:
        Tuple[Layouts, Layouts, Dict[str, Any]]: old layouts, new layouts
        (one rank numbering: the new world's) and each table's PieceCost.
    """

    def row_wise(rows: int, cols: int, ranks: List[int]) -> TableLayout:
        block = -(-rows // len(ranks))
        return TableLayout(
            rows,
            cols,
            tuple(
                PlacedShard(
                    r,
                    Rect(
                        min(i * block, rows),
                        0,
                        max(0, min(block, rows - i * block)),
                        cols,
                    ),
                )
                for i, r in enumerate(ranks)
            ),
        )

    def column_wise(rows: int, cols: int, ranks: List[int]) -> TableLayout:
        width = cols // len(ranks)
        return TableLayout(
            rows,
            cols,
            tuple(
                PlacedShard(r, Rect(0, i * width, rows, width))
                for i, r in enumerate(ranks)
            ),
        )

    mix, old_world = table_mix(tables, world, dim)
    old: Layouts = {}
    new: Layouts = {}
    costs: Dict[str, Any] = {}
    old_ranks, new_ranks = list(range(old_world)), list(range(world))
    for i, (name, kind, rows, cols) in enumerate(mix):
        if kind == "rw_grow":
            old[name] = row_wise(rows, cols, old_ranks)
            new[name] = row_wise(rows, cols, new_ranks)
        elif kind == "tw_move":
            src = (7 * i) % old_world
            dst = (13 * i + 1) % world
            dst = dst if dst != src else (dst + 1) % world
            old[name] = row_wise(rows, cols, [src])
            new[name] = row_wise(rows, cols, [dst])
        elif kind == "cw_2_to_4":
            a = (3 * i) % old_world
            old[name] = column_wise(rows, cols, [a, (a + 1) % old_world])
            new[name] = column_wise(
                rows, cols, [(5 * i + k * world // 4) % world for k in range(4)]
            )
        else:
            old[name] = row_wise(rows, cols, old_ranks)
            new[name] = replicated_layout(rows, cols, world)
        # fp32 weights, row-wise Adagrad momentum (one fp32 per row)
        costs[name] = PieceCost(per_element=4, per_row=4, per_piece=0)
    return old, new, costs


def intersected_pairs(old: Layouts, new: Layouts) -> int:
    """Pairs (new shard, distinct old rectangle) the old planner intersects."""
    return sum(
        len({s.rect for s in old[name].shards}) * len(new[name].shards) for name in new
    )


def cpu_timed(fn: Callable[[], Any]) -> Tuple[float, float, Any]:
    """(wall seconds, CPU seconds of this process, result) of ``fn()``."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def sample_ranks(world: int, count: int, seed: int = 0) -> List[int]:
    """The first and last rank of each half (old group, newcomers), plus
    random ranks, ``count`` in all (every rank when the world is smaller)."""
    fixed = [0, world // 2 - 1, world // 2, world - 1]
    rest = [r for r in range(world) if r not in fixed]
    random.Random(seed).shuffle(rest)
    return sorted(fixed + rest[: max(0, count - len(fixed))])[:count]


def measure_planning(
    tables: int, world: int, ranks: int
) -> Tuple[Dict[str, Any], Layouts, Layouts, Dict[str, Any]]:
    """Layouts, per-rank planning (cold) and the dry run for one (T, W)."""
    layouts_s, _, (old, new, costs) = cpu_timed(lambda: build_layouts(tables, world))
    per_rank: List[Dict[str, Any]] = []
    for rank in sample_ranks(world, ranks):
        wall, cpu, part = cpu_timed(lambda: plan_rank_transfers(old, new, rank))
        per_rank.append(
            {
                "rank": rank,
                "wall_s": wall,
                "cpu_s": cpu,
                "sends": len(part.sends),
                "receives": len(part.receives),
                "local_copies": len(part.local_copies),
            }
        )
    # What only building the slowest rank's Transfer objects costs (the
    # answer's own size: a floor for any planner returning them).
    slowest = max(per_rank, key=lambda r: r["wall_s"])
    count = slowest["sends"] + slowest["receives"] + slowest["local_copies"]
    piece = Rect(0, 0, 1, 1)
    floor_s, _, _ = cpu_timed(
        lambda: [Transfer("t", 0, 1, piece, piece, piece) for _ in range(count)]
    )
    dry_wall, dry_cpu, (sent, received) = cpu_timed(
        lambda: bytes_per_rank(old, new, costs)
    )
    if sum(sent.values()) != sum(received.values()) or len(sent) != world:
        raise AssertionError(f"dry run at T={tables} W={world}: inconsistent totals")
    walls = [r["wall_s"] for r in per_rank]
    row = {
        "tables": tables,
        "world": world,
        "old_world": world // 2,
        "old_shards": sum(len(v.shards) for v in old.values()),
        "new_shards": sum(len(v.shards) for v in new.values()),
        "pairs": intersected_pairs(old, new),
        "layouts_s": layouts_s,
        "rank_min_s": min(walls),
        "rank_median_s": statistics.median(walls),
        "rank_max_s": max(walls),
        "rank_max_cpu_s": max(r["cpu_s"] for r in per_rank),
        "rank_max_transfers": count,
        "rank_max_objects_s": floor_s,
        "per_rank": per_rank,
        "dry_run_s": dry_wall,
        "dry_run_cpu_s": dry_cpu,
        "moved_gib": sum(sent.values()) / 2**30,
        "max_sent_mib": max(sent.values()) / 2**20,
        "max_received_mib": max(received.values()) / 2**20,
    }
    return row, old, new, costs


def measure_today(
    old: Layouts, new: Layouts, costs: Dict[str, Any], rank: int = 0
) -> Tuple[float, float]:
    """
    The old way on one rank: the whole plan by every pair, then the rank's
    part. Checks the new per-rank plan and dry run against it.

    Returns:
        Tuple[float, float]: wall and CPU seconds.
    """

    def today() -> Any:
        plan = reference_plan(old, new, list(new))
        return plan, (plan.sends(rank), plan.receives(rank), plan.local_copies(rank))

    wall, cpu, (plan, part) = cpu_timed(today)
    mine = plan_rank_transfers(old, new, rank)
    if [list(mine.sends), list(mine.receives), list(mine.local_copies)] != list(part):
        raise AssertionError(f"rank {rank}: per-rank plan differs from the old plan")
    sent, received = bytes_per_rank(old, new, costs)
    for t in plan.transfers:
        if not t.is_local:
            nbytes = costs[t.table].of(t.rect)
            sent[t.src_rank] -= nbytes
            received[t.dst_rank] -= nbytes
    if any(sent.values()) or any(received.values()):
        raise AssertionError("dry run differs from the sums over the old plan")
    return wall, cpu


def measure_agreements(sizes: List[int], repeats: int) -> List[Dict[str, Any]]:
    """The store agreement of ``scale_agreement.py`` for each N."""
    here = os.path.dirname(os.path.abspath(__file__))
    if not os.path.exists(os.path.join(here, "scale_agreement.py")):
        raise SystemExit(
            "benchmarks/scale_agreement.py is missing: the agreement phase cannot "
            "run (use --agreement-sizes '' to leave it out, and say so)"
        )
    sys.path.insert(0, here)
    from scale_agreement import measure_agreement  # pyre-ignore[21]

    rows = []
    for n in sizes:
        result = dict(measure_agreement(n, repeats=repeats))
        for key in ("seconds", "store_bytes"):
            if key not in result:
                raise AssertionError(f"measure_agreement({n}) gave no '{key}'")
        result["n"] = n
        rows.append(result)
        print(
            f"  agreement N={n}: {result['seconds']:.3f} s, "
            f"{result['store_bytes'] / 2**20:.2f} MiB through the store",
            flush=True,
        )
    return rows


# ---------------------------------------------------------------- report ----


def planning_table(rows: List[Dict[str, Any]]) -> str:
    lines = table_head(
        [("T", 5), ("W (old)", 11), ("shards old/new", 15), ("layouts s", 9)]
        + [("rank min s", 10), ("median s", 8), ("max s", 7), ("max cpu s", 9)]
        + [("transfers", 9), ("objects s", 9), ("dry run s", 9), ("today s", 8)]
        + [("today cpu", 9), ("today is", 20), ("x faster", 8)]
    )
    for r in rows:
        cpu = r.get("today_cpu_s")
        lines.append(
            f"{r['tables']:>5} {r['world']:>5} ({r['old_world']:>3}) "
            f"{r['old_shards']:>7}/{r['new_shards']:<7} {r['layouts_s']:>9.2f} "
            f"{r['rank_min_s']:>10.3f} {r['rank_median_s']:>8.3f} "
            f"{r['rank_max_s']:>7.3f} {r['rank_max_cpu_s']:>9.3f} "
            f"{r['rank_max_transfers']:>9} {r['rank_max_objects_s']:>9.3f} "
            f"{r['dry_run_s']:>9.2f} "
            f"{r['today_s']:>8.1f} {'-' if cpu is None else format(cpu, '.1f'):>9} "
            f"{r['today_how']:>20} {r['today_s'] / r['rank_max_s']:>8.0f}"
        )
    return "\n".join(lines)


def agreement_table(rows: List[Dict[str, Any]]) -> str:
    lines = table_head(
        [("N", 6), ("seconds", 8), ("store MiB", 10), ("bytes / N", 10)]
        + [("busiest trips", 13), ("today s", 8), ("today MiB", 10), ("today is", 12)]
    )
    for r in rows:
        today_s = r.get("today_seconds")
        today_bytes = r.get("today_store_bytes")
        measured = r.get("today_measured")
        lines.append(
            f"{r['n']:>6} {r['seconds']:>8.3f} {r['store_bytes'] / 2**20:>10.2f} "
            f"{r['store_bytes'] / r['n']:>10.0f} "
            f"{fmt(r.get('max_round_trips'), '.0f'):>13} "
            f"{fmt(today_s if measured else None, '.3f'):>8} "
            f"{fmt(None if today_bytes is None else today_bytes / 2**20, '.1f'):>10} "
            f"{'-' if measured is None else 'measured' if measured else 'extrapolated':>12}"
        )
    return "\n".join(lines)


def targets_text(rows: List[Dict[str, Any]], agreement: List[Dict[str, Any]]) -> str:
    lines = ["Targets (the spec's planning and agreement budgets):"]
    big = [r for r in rows if r["tables"] == 1000 and r["world"] == 1024]
    if big:
        r = big[0]
        lines.append(
            f"  1,000 tables, 512 -> 1,024 ranks, planning per rank <= 0.5 s: "
            f"{'met' if r['rank_max_s'] <= 0.5 else 'NOT met'} (max {r['rank_max_s']:.3f} s "
            f"wall, {r['rank_max_cpu_s']:.3f} s CPU, median {r['rank_median_s']:.3f} s, "
            f"over {len(r['per_rank'])} ranks)"
        )
        lines.append(
            f"  dry run of the whole plan <= 10 s: "
            f"{'met' if r['dry_run_s'] <= 10 else 'NOT met'} ({r['dry_run_s']:.2f} s)"
        )
    else:
        lines.append("  (T=1000, W=1024 not in this run: planning targets not checked)")
    big_n = [a for a in agreement if a["n"] == 1024]
    if big_n:
        a = big_n[0]
        lines.append(
            f"  1,024 participants agree in <= 5 s: "
            f"{'met' if a['seconds'] <= 5 else 'NOT met'} ({a['seconds']:.3f} s)"
        )
    if len(agreement) >= 2:
        first, last = agreement[0], agreement[-1]
        growth = (last["store_bytes"] / first["store_bytes"]) / (last["n"] / first["n"])
        lines.append(
            f"  store bytes grow linearly in N: bytes ratio / N ratio from "
            f"N={first['n']} to N={last['n']} = {growth:.2f} (1.00 = linear)"
        )
    return "\n".join(lines)


def plot(
    rows: List[Dict[str, Any]], agreement: List[Dict[str, Any]], path: str, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if agreement else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8))
    ax = axes[0] if panels == 2 else axes
    for i, tables in enumerate(sorted({r["tables"] for r in rows})):
        pts = sorted(
            (r for r in rows if r["tables"] == tables), key=lambda r: r["world"]
        )
        xs = [r["world"] for r in pts]
        color = f"C{i}"
        for key, style, what in (
            ("rank_max_s", "o-", "per rank (max)"),
            ("dry_run_s", "s-.", "dry run, all ranks"),
        ):
            ax.plot(
                xs,
                [r[key] for r in pts],
                style,
                color=color,
                label=f"T={tables}: {what}",
            )
        ax.plot(xs, [r["today_s"] for r in pts], ":", color=color)
        measured = [r for r in pts if r["today_how"] == "measured"]
        guessed = [r for r in pts if r["today_how"] != "measured"]
        ax.plot(
            [r["world"] for r in measured],
            [r["today_s"] for r in measured],
            "^",
            color=color,
            label=f"T={tables}: today per rank (measured)",
        )
        ax.plot(
            [r["world"] for r in guessed],
            [r["today_s"] for r in guessed],
            "^",
            mfc="none",
            color=color,
            label=f"T={tables}: today per rank (extrapolated)",
        )
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.axhline(10, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("new world size W (old: W/2)")
    ax.set_ylabel("seconds")
    ax.set_title("planning", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    if agreement:
        ax2 = axes[1]
        ns = [a["n"] for a in agreement]
        ax2.plot(
            ns, [a["seconds"] for a in agreement], "o-", color="C3", label="seconds"
        )
        measured = [a for a in agreement if a.get("today_measured")]
        if measured:
            ax2.plot(
                [a["n"] for a in measured],
                [a["today_seconds"] for a in measured],
                "^:",
                color="C3",
                label="seconds, today's protocol (measured)",
            )
        ax2.axhline(5, color="grey", lw=0.8, ls="--")
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.set_xlabel("participants N (threads on one TCPStore)")
        ax2.set_ylabel("seconds")
        twin = ax2.twinx()
        twin.plot(
            ns,
            [a["store_bytes"] / 2**20 for a in agreement],
            "s--",
            color="C4",
            label="MiB through the store",
        )
        today = [a for a in agreement if a.get("today_store_bytes") is not None]
        if today:
            twin.plot(
                [a["n"] for a in today],
                [a["today_store_bytes"] / 2**20 for a in today],
                "x:",
                color="C4",
                label="MiB, today's protocol (x: measured or N^2 extrapolated)",
            )
        twin.set_yscale("log")
        twin.set_ylabel("MiB through the store")
        ax2.set_title("agreement", fontsize=9)
        ax2.grid(True, which="both", alpha=0.3)
        h1, l1 = ax2.get_legend_handles_labels()
        h2, l2 = twin.get_legend_handles_labels()
        ax2.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    fig.suptitle(textwrap.fill(title, 150), fontsize=7)
    save_figure(fig, path)


def ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = benchmark_parser(
        "How planning and agreement costs grow with ranks and tables.",
        argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--tables", type=str, default="100,1000", help="T values")
    p.add_argument(
        "--worlds", type=str, default="64,256,1024", help="new world sizes W (old: W/2)"
    )
    p.add_argument(
        "--ranks", type=int, default=8, help="ranks sampled for per-rank planning"
    )
    p.add_argument(
        "--today-budget-s",
        type=float,
        default=30.0,
        help="measure the old planner where it is estimated to take at most this "
        "long on one rank; extrapolate elsewhere",
    )
    p.add_argument(
        "--agreement-sizes",
        type=str,
        default="64,256,1024",
        help="participants N of the store agreement ('' leaves the phase out, "
        "and the table says so)",
    )
    p.add_argument(
        "--agreement-repeats",
        type=int,
        default=3,
        help="agreements in a row per N (seconds: their median)",
    )
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    load = os.getloadavg()
    header = (
        f"scale benchmark: pure planner and store agreement, one process, "
        f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"python {platform.python_version()}, torch {torch.__version__}; load average "
        f"at start {load[0]:.1f}; mix: 60% row-wise W/2 -> W, 20% table-wise moves, "
        f"10% column-wise 2 -> 4 shards, 10% row-wise (W/2) -> replicated (W); "
        f"{args.ranks} sampled ranks per size, every call cold (no cache)"
    )
    print(header, flush=True)
    rows: List[Dict[str, Any]] = []
    sizes = sorted(
        ((t, w) for t in ints(args.tables) for w in ints(args.worlds)),
        key=lambda tw: tw[0] * tw[1] * tw[1],  # ~ the pairs the old planner intersects
    )
    per_pair: Optional[Tuple[float, int, int]] = None  # (s / pair, T, W) measured
    for tables, world in sizes:
        row, old, new, costs = measure_planning(tables, world, args.ranks)
        estimate = per_pair[0] * row["pairs"] if per_pair else 0.0
        if per_pair is None or estimate <= args.today_budget_s:
            wall, cpu = measure_today(old, new, costs)
            row["today_s"], row["today_how"] = wall, "measured"
            row["today_cpu_s"] = cpu
            per_pair = (wall / row["pairs"], tables, world)
        else:
            row["today_s"] = estimate
            row["today_cpu_s"] = None
            row["today_how"] = f"extrapolated (T{per_pair[1]} W{per_pair[2]})"
        row["today_issue"] = ISSUE_TODAY.get((tables, world))
        rows.append(row)
        print(
            f"  T={tables} W={world}: layouts {row['layouts_s']:.2f} s, per rank "
            f"max {row['rank_max_s']:.3f} s, dry run {row['dry_run_s']:.2f} s, "
            f"today {row['today_s']:.2f} s ({row['today_how']})",
            flush=True,
        )
        del old, new, costs
    rows.sort(key=lambda r: (r["tables"], r["world"]))
    agreement_sizes = ints(args.agreement_sizes)
    agreement = (
        measure_agreements(agreement_sizes, args.agreement_repeats)
        if agreement_sizes
        else []
    )
    text = [
        "",
        "Planning (seconds; per rank = plan_rank_transfers, cold; today = whole plan "
        "by every pair, then the rank's part):",
        planning_table(rows),
    ]
    for r in rows:
        if r["today_issue"]:
            text.append(
                f"  the whole-plan planner measured at T={r['tables']} W={r['world']}: "
                f"{r['today_issue']}"
            )
    text.append(
        "  the whole-plan planner measured at T=1000, 64 -> 128 ranks: 7-11 s per rank"
    )
    text += ["", "Agreement (threads on one TCPStore):"]
    text.append(
        agreement_table(agreement) if agreement else "  not run (--agreement-sizes '')"
    )
    text += ["", targets_text(rows, agreement)]
    report = "\n".join(text)
    print(report, flush=True)
    save_results(
        args.out_dir,
        "scale_benchmark",
        {
            "header": header,
            "argv": sys.argv,
            "rows": rows,
            "agreement": agreement,
            "report": report,
        },
        None if args.no_plot else lambda path: plot(rows, agreement, path, header),
    )


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Benchmark of live resharding: time against the wire floors and the
checkpoint route, and peak extra memory, as ratios in one run.

Scenario: ``4 * world_size`` fp32 tables of dim 128, table-wise, 4 per rank.
Each reshard moves half of every rank's tables (2 tables) to the next rank, so
every rank sends (and receives) ``size`` bytes of weights. Repetitions
alternate between the two plans (A -> B, B -> A, ...), so each moves the same
bytes.

Measured per size, in one run, on every rank (min and median over reps):

* ``a2a_warm``   bare ``all_to_all_single`` of the same bytes, warm buffers;
* ``a2a_fresh``  the same into a freshly allocated receive buffer;
* ``dense``      the fork's reshard, dense kernel;
* ``fused``      the fork's reshard, fused kernel + optimizer with state;
* ``fused_cap``  the same with ``max_inflight_bytes``;
* ``ckpt``       the checkpoint route: torch.distributed.checkpoint save of the
  sharded model + optimizer state, build a new sharded module with the new
  plan (as users do, with random init), dcp.load into it.

Peak extra memory per rank = VmHWM - VmRSS just before the step, with the
high-water mark reset through /proc/self/clear_refs (or, when that is not
permitted, a fresh process group of processes per method).

Example::

    python benchmarks/reshard_benchmark.py --sizes-mib 64,256 --reps 3
"""

import argparse
import contextlib
import gc
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import (
    benchmark_parser,
    fmt,
    free_port,
    gather_to_json,
    meta_ebc,
    MiB,
    progress,
    save_figure,
    save_results,
    worker_setup,
)

DIM = 128
TABLES_PER_RANK = 4
MOVED_PER_RANK = 2

ALL_METHODS = ["a2a_warm", "a2a_fresh", "dense", "fused", "fused_cap", "ckpt"]
METHOD_LABELS = {
    "a2a_warm": "all_to_all_single, warm buffers (floor)",
    "a2a_fresh": "all_to_all_single, fresh buffer (floor)",
    "dense": "fork reshard, dense kernel",
    "fused": "fork reshard, fused kernel + {opt}",
    "fused_cap": "fork reshard, fused + {opt}, max_inflight {cap} MiB",
    "ckpt": "checkpoint route (dcp save, rebuild, load), fused + {opt}",
}


# ---------------------------------------------------------------- memory ----


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` field of this process, in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def reset_hwm() -> bool:
    """Resets VmHWM to the current RSS; False when not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """
    Peak extra resident memory of a region (VmHWM after - VmRSS before) and
    the memory it still holds at its end (VmRSS after - VmRSS before).
    """

    def __init__(self, resettable: bool) -> None:
        self.resettable = resettable
        self.rss_before = 0
        self.extra_bytes = 0
        self.held_bytes = 0

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        self.rss_before = status_kib("VmRSS")
        if self.resettable:
            reset_hwm()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.extra_bytes = max(0, status_kib("VmHWM") - self.rss_before) * 1024
        self.held_bytes = (status_kib("VmRSS") - self.rss_before) * 1024


# ------------------------------------------------------------- the model ----


def table_names(world_size: int) -> List[str]:
    return [f"t{i}" for i in range(TABLES_PER_RANK * world_size)]


def placements(world_size: int, flipped: bool) -> Dict[str, int]:
    """Plan A: table i on rank i // 4. Plan B: tables 2, 3 of each rank's four
    go to the next rank."""
    out = {}
    for i, name in enumerate(table_names(world_size)):
        owner = i // TABLES_PER_RANK
        if flipped and i % TABLES_PER_RANK >= TABLES_PER_RANK - MOVED_PER_RANK:
            owner = (owner + 1) % world_size
        out[name] = owner
    return out


def make_ebc(rows: int, world_size: int) -> Any:
    return meta_ebc(table_names(world_size), rows, DIM)


def make_plan(ebc: Any, kernel: str, world_size: int, flipped: bool) -> Any:
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        table_wise,
    )

    return construct_module_sharding_plan(
        ebc,
        {
            t: table_wise(rank=r, compute_kernel=kernel)
            for t, r in placements(world_size, flipped).items()
        },
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )


def make_sharder(kernel: str, optimizer: str) -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    if kernel == "fused":
        return EmbeddingBagCollectionSharder(
            fused_params={
                "optimizer": getattr(EmbOptimType, optimizer),
                "learning_rate": 0.01,
            }
        )
    return EmbeddingBagCollectionSharder()


def shard(
    ebc: Any, plan: Any, env: Any, kernel: str, optimizer: str, random_init: bool
) -> Any:
    from torchrec.distributed.batched_embedding_kernel import (
        kernel_build_hooks,
        KernelBuildHooks,
    )

    class NoInit(KernelBuildHooks):
        # fill() overwrites every weight: skip the random init
        def init_parameters(self, config: Any) -> bool:
            return False

    sharder = make_sharder(kernel, optimizer)
    ctx = contextlib.nullcontext() if random_init else kernel_build_hooks(NoInit())
    with ctx:
        return sharder.shard(ebc, plan, env, torch.device("cpu"))


def local_tensors(module: Any) -> Dict[str, Dict[str, torch.Tensor]]:
    """table -> {"weight": 2D view, state key: tensor} for every local table."""
    from torchrec.distributed.resharding.kernel_state import local_slots

    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for (table, _), slot in local_slots(module._lookups).items():
        out[table] = slot.tensors
    return out


CHUNK_ROWS = 1 << 16


def _weight_values(t: int, r0: int, r1: int) -> torch.Tensor:
    r = torch.arange(r0, r1, dtype=torch.int64).unsqueeze(1)
    c = torch.arange(DIM, dtype=torch.int64).unsqueeze(0)
    return ((t * 131 + r * 7 + c * 13) % 65521).to(torch.float32)


def _row_values(t: int, key: str, rows: int) -> torch.Tensor:
    salt = sum(key.encode()) % 97
    r = torch.arange(rows, dtype=torch.int64)
    return ((t * 17 + salt + r * 3) % 1009).to(torch.float32)


def fill(module: Any) -> None:
    """Known values derived from (table, row, column) / (table, state, row)."""
    with torch.no_grad():
        for table, tensors in local_tensors(module).items():
            t = int(table[1:])
            w = tensors["weight"]
            for r0 in range(0, w.shape[0], CHUNK_ROWS):
                r1 = min(w.shape[0], r0 + CHUNK_ROWS)
                w[r0:r1].copy_(_weight_values(t, r0, r1))
            for key, value in tensors.items():
                if key == "weight":
                    continue
                if value.dim() == 1 and value.numel() == w.shape[0]:
                    value.copy_(_row_values(t, key, w.shape[0]))
                elif value.numel() == w.numel():
                    v2 = value.view(w.shape)
                    for r0 in range(0, w.shape[0], CHUNK_ROWS):
                        r1 = min(w.shape[0], r0 + CHUNK_ROWS)
                        v2[r0:r1].copy_(_weight_values(t + 1000, r0, r1))
                else:
                    value.fill_(float(t))


def fingerprint(tensors: Dict[str, torch.Tensor]) -> str:
    """Exact float64 row and column sums of every tensor, hashed."""
    h = hashlib.sha1()
    for key in sorted(tensors):
        x = tensors[key]
        x2 = x.view(x.shape[0], -1) if x.dim() > 0 else x.view(1, 1)
        rows = []
        cols = torch.zeros(x2.shape[1], dtype=torch.float64)
        for r0 in range(0, x2.shape[0], CHUNK_ROWS):
            block = x2[r0 : r0 + CHUNK_ROWS].to(torch.float64)
            rows.append(block.sum(1))
            cols += block.sum(0)
        h.update(key.encode())
        h.update(torch.cat(rows).numpy().tobytes())
        h.update(cols.numpy().tobytes())
    return h.hexdigest()


def local_fingerprints(module: Any) -> Dict[str, str]:
    return {t: fingerprint(ts) for t, ts in local_tensors(module).items()}


def expected_fingerprints(module: Any, pg: Any) -> Dict[str, str]:
    gathered: List[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, local_fingerprints(module), group=pg)
    out: Dict[str, str] = {}
    for g in gathered:
        out.update(g)
    return out


def check(
    module: Any, expected: Dict[str, str], plan_owner: Dict[str, int], rank: int
) -> None:
    got = local_fingerprints(module)
    want = {t for t, r in plan_owner.items() if r == rank}
    if set(got) != want:
        raise AssertionError(
            f"rank {rank}: local tables {sorted(got)} != {sorted(want)}"
        )
    bad = [t for t in got if got[t] != expected[t]]
    if bad:
        raise AssertionError(f"rank {rank}: wrong contents after reshard in {bad}")


# ----------------------------------------------------------- instrumentation --


def phase_seconds(phases: Any) -> Dict[str, float]:
    """The phase times a report carries (``report.phases``), by name."""
    return {
        "agree": phases.agree,
        "build": phases.build,
        "exchange": phases.exchange,
        "commit": phases.commit,
    }


# --------------------------------------------------------------- methods ----


def timed(
    pg: Any, resettable: bool, fn: Callable[[], Any]
) -> Tuple[float, PeakMemory, Any]:
    with PeakMemory(resettable) as mem:
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        out = fn()
        dist.barrier(group=pg)
        seconds = time.perf_counter() - t0
    return seconds, mem, out


@dataclass(frozen=True)
class RankJob:
    """What every measured method of one rank runs with.

    Args:
        args (argparse.Namespace): the benchmark's arguments.
        rank (int): this rank.
        ws (int): world size.
        pg (Any): the process group.
        env (Any): the ShardingEnv of ``pg``.
        resettable (bool): the peak-memory counter can be reset.
    """

    args: argparse.Namespace
    rank: int
    ws: int
    pg: Any
    env: Any
    resettable: bool


def run_floor(method: str, size: int, job: RankJob) -> Dict[str, Any]:
    """The wire floor: one all-to-all of the bytes a reshard moves."""
    args, rank, ws, pg, resettable = job.args, job.rank, job.ws, job.pg, job.resettable
    n = size // 4
    send_splits = [0] * ws
    recv_splits = [0] * ws
    if ws > 1:
        send_splits[(rank + 1) % ws] = n
        recv_splits[(rank - 1) % ws] = n
    send = torch.full((n,), float(rank + 1))  # touched: the data exists
    recv_warm = torch.ones(n) if method == "a2a_warm" else None
    times, peaks, held = [], [], []
    for rep in range(args.warmup + args.reps):
        recv: Optional[torch.Tensor] = None

        def step() -> None:
            nonlocal recv
            recv = recv_warm if recv_warm is not None else torch.empty(n)
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=pg)

        s, peak, _ = timed(pg, resettable, step)
        assert (
            recv is not None
            and float(recv[0]) == float((rank - 1) % ws + 1)
            and float(recv[-1]) == float((rank - 1) % ws + 1)
        )
        del recv
        if rep >= args.warmup:
            times.append(s)
            peaks.append(peak.extra_bytes)
            held.append(peak.held_bytes)
    return {
        "times": times,
        "peaks": peaks,
        "held": held,
        "moved_bytes": size,
        "bound_bytes": 0 if method == "a2a_warm" else size,
    }


def _new_local_bytes(module: Any, tables: List[str]) -> int:
    total = 0
    for t, ts in local_tensors(module).items():
        if t in tables:
            total += sum(x.numel() * x.element_size() for x in ts.values())
    return total


def run_fork(method: str, size: int, job: RankJob) -> Dict[str, Any]:
    """Reshards with the fork, there and back, ``args.reps`` times."""
    args, rank, ws, pg, resettable = job.args, job.rank, job.ws, job.pg, job.resettable
    env = job.env
    from torchrec.distributed.resharding import reshard_module, ReshardOptions

    kernel = "dense" if method == "dense" else "fused"
    cap = args.max_inflight_mib * MiB if method == "fused_cap" else None
    rows = size // (MOVED_PER_RANK * DIM * 4)
    ebc = make_ebc(rows, ws)
    plans = [make_plan(ebc, kernel, ws, False), make_plan(ebc, kernel, ws, True)]
    module = shard(ebc, plans[0], env, kernel, args.optimizer, random_init=False)
    fill(module)
    expected = expected_fingerprints(module, pg)
    times, peaks, held, reports, bounds, breakdowns = [], [], [], [], [], []
    current = 0
    for rep in range(args.warmup + args.reps):
        target = 1 - current
        delta = {t: ps for t, ps in plans[target].items() if plans[current][t] != ps}
        s, peak, report = timed(
            pg,
            resettable,
            lambda: reshard_module(
                module,
                delta,
                env,
                torch.device("cpu"),
                ReshardOptions(max_inflight_bytes=cap),
            ),
        )
        current = target
        check(module, expected, placements(ws, current == 1), rank)
        inflight = report.bytes_sent + report.bytes_received
        if cap is not None:
            inflight = min(inflight, cap)
        bound = _new_local_bytes(module, report.tables_rebuilt.get("", [])) + inflight
        if rep >= args.warmup:
            times.append(s)
            peaks.append(peak.extra_bytes)
            held.append(peak.held_bytes)
            bounds.append(bound)
            reports.append(
                {
                    "bytes_sent": report.bytes_sent,
                    "bytes_received": report.bytes_received,
                    "bytes_copied_locally": report.bytes_copied_locally,
                    "bytes_kept_in_place": report.bytes_kept_in_place,
                    "bytes_released": report.bytes_released,
                    "tables_rebuilt": len(report.tables_rebuilt.get("", [])),
                    "seconds": report.seconds,
                }
            )
            breakdowns.append(dict(phase_seconds(report.phases), total=report.seconds))
    moved_rows = rows * MOVED_PER_RANK
    sent = reports[-1]["bytes_sent"]
    del module
    gc.collect()
    return {
        "times": times,
        "peaks": peaks,
        "held": held,
        "moved_bytes": sent,
        "bytes_per_row": sent / moved_rows,
        "bound_bytes": max(bounds),
        "reports": reports,
        "breakdown": breakdowns,
    }


def run_ckpt(size: int, job: RankJob) -> Dict[str, Any]:
    """Reshards by checkpoint and restart (DCP save, build, load)."""
    args, rank, ws, pg, resettable = job.args, job.rank, job.ws, job.pg, job.resettable
    env = job.env
    import torch.distributed.checkpoint as dcp

    kernel = "fused"
    rows = size // (MOVED_PER_RANK * DIM * 4)
    ebc = make_ebc(rows, ws)
    plans = [make_plan(ebc, kernel, ws, False), make_plan(ebc, kernel, ws, True)]
    holder = {"m": shard(ebc, plans[0], env, kernel, args.optimizer, random_init=False)}
    fill(holder["m"])
    expected = expected_fingerprints(holder["m"], pg)
    base = args.ckpt_dir or tempfile.gettempdir()
    times, peaks, held, breakdowns = [], [], [], []
    current = 0
    for rep in range(args.warmup + args.reps):
        target = 1 - current
        objs = [
            (
                tempfile.mkdtemp(prefix="reshard_bench_ckpt_", dir=base)
                if rank == 0
                else None
            )
        ]
        dist.broadcast_object_list(objs, src=0, group=pg)
        path = objs[0]
        bd: Dict[str, float] = {}

        def step() -> None:
            t0 = time.perf_counter()
            m = holder.pop("m")
            sd = {"model": m.state_dict(), "optim": m.fused_optimizer.state_dict()}
            dcp.save(sd, checkpoint_id=path, process_group=pg)
            del sd, m
            gc.collect()
            t1 = time.perf_counter()
            new = shard(
                ebc, plans[target], env, kernel, args.optimizer, random_init=True
            )
            t2 = time.perf_counter()
            sd = {"model": new.state_dict(), "optim": new.fused_optimizer.state_dict()}
            dcp.load(sd, checkpoint_id=path, process_group=pg)
            new.load_state_dict(sd["model"])
            new.fused_optimizer.load_state_dict(sd["optim"])
            del sd
            holder["m"] = new
            t3 = time.perf_counter()
            bd.update(save=t1 - t0, build=t2 - t1, load=t3 - t2)

        s, peak, _ = timed(pg, resettable, step)
        current = target
        check(holder["m"], expected, placements(ws, current == 1), rank)
        dist.barrier(group=pg)
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        if rep >= args.warmup:
            times.append(s)
            peaks.append(peak.extra_bytes)
            held.append(peak.held_bytes)
            breakdowns.append(bd)
    del holder
    gc.collect()
    return {
        "times": times,
        "peaks": peaks,
        "held": held,
        "moved_bytes": None,
        "bound_bytes": None,
        "breakdown": breakdowns,
    }


# ---------------------------------------------------------------- worker ----


def worker(
    rank: int,
    ws: int,
    port: int,
    args: argparse.Namespace,
    jobs: List[Tuple[int, str]],
    out_path: str,
    resettable: bool,
) -> None:
    worker_setup(port, args.verbose)
    dist.init_process_group(
        "gloo", rank=rank, world_size=ws, timeout=timedelta(seconds=args.timeout_s)
    )
    from torchrec.distributed.types import ShardingEnv

    pg = dist.group.WORLD
    job = RankJob(args, rank, ws, pg, ShardingEnv.from_process_group(pg), resettable)
    results = []
    for size, method in jobs:
        if method in ("a2a_warm", "a2a_fresh"):
            r = run_floor(method, size, job)
        elif method == "ckpt":
            r = run_ckpt(size, job)
        else:
            r = run_fork(method, size, job)
        r.update(size=size, method=method, rank=rank)
        results.append(r)
        progress(
            rank,
            args.verbose,
            f"  size {size // MiB} MiB {method}: times {['%.3f' % t for t in r['times']]}",
        )
    gather_to_json(results, out_path, pg)
    dist.destroy_process_group()


def launch(
    args: argparse.Namespace, jobs: List[Tuple[int, str]], resettable: bool
) -> List[List[Dict[str, Any]]]:
    fd, out_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        mp.spawn(
            worker,
            args=(args.world_size, free_port(), args, jobs, out_path, resettable),
            nprocs=args.world_size,
            join=True,
        )
        with open(out_path) as f:
            return json.load(f)
    finally:
        os.unlink(out_path)


# ---------------------------------------------------------------- report ----


def summarise(
    per_rank: List[List[Dict[str, Any]]], args: argparse.Namespace
) -> List[Dict[str, Any]]:
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        ranks = [pr[i] for pr in per_rank]
        times = r0[
            "times"
        ]  # barriers around the step: identical up to noise on every rank
        row = {
            "size_mib": r0["size"] // MiB,
            "method": r0["method"],
            "label": METHOD_LABELS[r0["method"]].format(
                opt=args.optimizer, cap=args.max_inflight_mib
            ),
            "times_s": times,
            "min_s": min(times),
            "median_s": statistics.median(times),
            "peak_extra_mib_per_rank": [max(r["peaks"]) / MiB for r in ranks],
            "peak_extra_mib": max(max(r["peaks"]) for r in ranks) / MiB,
            "held_mib": max(max(r["held"]) for r in ranks) / MiB,
            "moved_mib_per_rank": (
                (r0["moved_bytes"] / MiB) if r0.get("moved_bytes") else None
            ),
            "bytes_per_row": r0.get("bytes_per_row"),
            "bound_mib": (
                (max(r["bound_bytes"] for r in ranks) / MiB)
                if r0.get("bound_bytes") is not None
                else None
            ),
            "breakdown_rank0": r0.get("breakdown"),
            "reports_rank0": r0.get("reports"),
        }
        rows.append(row)
    for row in rows:
        floors = {
            r["method"]: r["min_s"] for r in rows if r["size_mib"] == row["size_mib"]
        }
        row["x_warm"] = (
            row["min_s"] / floors["a2a_warm"] if "a2a_warm" in floors else None
        )
        row["x_fresh"] = (
            row["min_s"] / floors["a2a_fresh"] if "a2a_fresh" in floors else None
        )
        ck = floors.get("ckpt")
        row["x_ckpt"] = row["min_s"] / ck if ck else None
    return rows


def print_table(rows: List[Dict[str, Any]], header: str) -> str:
    lines = [header]
    cols = f"{'size MiB':>8} {'method':<10} {'min s':>8} {'median s':>8} {'x warm':>7} {'x fresh':>7} {'x ckpt':>7} {'peak MiB':>9} {'held MiB':>9} {'bound MiB':>9} {'moved MiB':>9} {'B/row':>6}"
    lines.append(cols)
    lines.append("-" * len(cols))
    for r in rows:
        lines.append(
            f"{r['size_mib']:>8} {r['method']:<10} {r['min_s']:>8.3f} {r['median_s']:>8.3f} "
            f"{fmt(r['x_warm'], '7.2f'):>7} {fmt(r['x_fresh'], '7.2f'):>7} {fmt(r['x_ckpt'], '7.2f'):>7} "
            f"{r['peak_extra_mib']:>9.0f} {r['held_mib']:>9.0f} {fmt(r['bound_mib'], '9.0f'):>9} "
            f"{fmt(r['moved_mib_per_rank'], '9.1f'):>9} {fmt(r['bytes_per_row'], '6.0f'):>6}"
        )
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def breakdown_text(rows: List[Dict[str, Any]]) -> str:
    lines = ["", "Where the time goes (rank 0, min-time rep, seconds):"]
    for r in rows:
        if not r.get("breakdown_rank0"):
            continue
        i = r["times_s"].index(r["min_s"])
        bd = r["breakdown_rank0"][i]
        parts = ", ".join(f"{k} {v:.3f}" for k, v in bd.items())
        if "total" in bd:
            other = bd["total"] - sum(v for k, v in bd.items() if k != "total")
            parts += f", other {other:.3f}"
        lines.append(f"  {r['size_mib']:>5} MiB {r['method']:<10} {parts}")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot(rows: List[Dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method in ALL_METHODS:
        pts = [r for r in rows if r["method"] == method]
        if not pts:
            continue
        xs = [r["size_mib"] for r in pts]
        ax1.plot(xs, [r["min_s"] for r in pts], marker="o", label=method)
        ax2.plot(xs, [r["peak_extra_mib"] for r in pts], marker="o", label=method)
    for ax, ylabel in (
        (ax1, "time, min over reps (s)"),
        (ax2, "peak extra RSS per rank (MiB)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("moved weight bytes per rank (MiB)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = benchmark_parser(
        "Benchmark live resharding of a ShardedEmbeddingBagCollection "
        "against the all_to_all_single floors and the checkpoint route.",
        argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--sizes-mib",
        type=str,
        default="64,256,1024",
        help="moved weight bytes per rank, comma separated",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=3,
        help="measured repetitions per method (each reshards the other way)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="unmeasured repetitions before the measured ones",
    )
    p.add_argument(
        "--methods",
        type=str,
        default=",".join(ALL_METHODS),
        help="subset of " + ",".join(ALL_METHODS),
    )
    p.add_argument(
        "--world-size", type=int, default=2, help="number of gloo ranks (CPU)"
    )
    p.add_argument(
        "--optimizer",
        type=str,
        default="EXACT_ROWWISE_ADAGRAD",
        help="fused optimizer (EmbOptimType name)",
    )
    p.add_argument(
        "--max-inflight-mib",
        type=int,
        default=64,
        help="max_inflight_bytes of fused_cap, MiB",
    )
    p.add_argument(
        "--ckpt-dir",
        type=str,
        default=None,
        help="where the checkpoint route writes (default: the temp dir)",
    )
    p.add_argument(
        "--fresh-process-per-method",
        action="store_true",
        help="start new ranks for every (size, method) (automatic when /proc/self/clear_refs is not writable)",
    )
    p.add_argument("--timeout-s", type=int, default=1800, help="process group timeout")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    unknown = set(args.methods.split(",")) - set(ALL_METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    sizes = [int(float(s) * MiB) for s in args.sizes_mib.split(",")]
    methods = [m for m in ALL_METHODS if m in args.methods.split(",")]
    resettable = reset_hwm()
    fresh = args.fresh_process_per_method or not resettable
    how = (
        "VmHWM reset via /proc/self/clear_refs before each step"
        if resettable
        else "/proc/self/clear_refs not writable: fresh ranks per method, peak since process start"
    )
    if fresh and resettable:
        how += "; fresh ranks per (size, method)"
    cores = os.cpu_count()
    header = (
        f"reshard benchmark: {args.world_size} gloo ranks on CPU, {cores} cores "
        f"({platform.processor() or platform.machine()}), 1 thread per rank, torch {torch.__version__}; "
        f"{TABLES_PER_RANK * args.world_size} fp32 tables dim {DIM} table-wise, {MOVED_PER_RANK} of each rank's "
        f"{TABLES_PER_RANK} move; reps {args.reps} (+{args.warmup} warmup); memory: {how}"
    )
    print(header, flush=True)
    all_results: List[List[Dict[str, Any]]] = [[] for _ in range(args.world_size)]
    for size in sizes:
        job_groups = (
            [[(size, m)] for m in methods] if fresh else [[(size, m) for m in methods]]
        )
        for jobs in job_groups:
            t0 = time.perf_counter()
            per_rank = launch(args, jobs, resettable and not (fresh and not resettable))
            for r, res in enumerate(per_rank):
                all_results[r].extend(res)
            print(
                f"  size {size // MiB} MiB: {[m for _, m in jobs]} done in {time.perf_counter() - t0:.1f}s",
                flush=True,
            )
    rows = summarise(all_results, args)
    print()
    table = print_table(rows, "")
    bd = breakdown_text(rows)
    save_results(
        args.out_dir,
        "reshard_benchmark",
        {
            "header": header,
            "argv": sys.argv,
            "cores": cores,
            "world_size": args.world_size,
            "optimizer": args.optimizer,
            "max_inflight_mib": args.max_inflight_mib,
            "memory_method": how,
            "rows": rows,
            "table": table,
            "breakdown": bd,
        },
        None if args.no_plot else lambda path: plot(rows, path, header[:160]),
    )


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Benchmark of surviving a lost rank: from the kill to the first training step
on the survivors, with ``FaultTolerance`` (nothing restarts) against the
restart route (what a job does today: every rank restarts and loads the last
DCP checkpoint), at ``--sizes-mib`` of tables, with the steps of updates each
loses.

The job: 4 gloo ranks (CPU, one thread each) whose store the benchmark's own
process hosts (as a launcher's agent hosts it). The model: an
``EmbeddingBagCollection`` of 8 fp32 table-wise tables of dim 64 (``size``
MiB of weights in all: table ``i`` on rank ``i % 4``) with fused row-wise
Adagrad, a small data-parallel table, and a dense MLP. Rank 3 is killed
(SIGKILL) in the forward of step ``--kill-step``.

Routes (each a fresh job):

* ``snapshot``: ``FaultTolerance`` with a buddy snapshot every
  ``--snapshot-every`` steps; the survivors recover rank 3's tables from its
  buddy's copy;
* ``checkpoint``: ``FaultTolerance``, ``ft.save_checkpoint`` every
  ``--checkpoint-every`` steps; the survivors read only rank 3's tables back;
* ``restart``: the same checkpoints, taken the usual way (``dcp.save`` of the
  model's state dict and fused optimizer state); when rank 3 dies the
  launcher stops the others (as torchrun's agent does) and starts 4 ranks
  anew (rank 3 on a replacement), which build the model and ``dcp.load`` it,
  then train. This is a lower bound of a real restart: no scheduler, no
  container start, a warm page cache.

Times are wall-clock (``time.time()`` of processes on one machine); kill ->
first step = the end of the first training step after the kill on the
slowest survivor minus the victim's kill time. Steps lost: the steps whose
updates of rank 3's tables are gone (a data-parallel table's replica loses
none).

Example::

    python benchmarks/fault_benchmark.py --sizes-mib 256,1024
"""

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from common import (
    benchmark_parser,
    fmt,
    MiB,
    save_figure,
    save_results,
    table_head,
    worker_setup,
)

WORLD = 4
VICTIM = 3
TABLES = 8
DIM = 64
BATCH = 64
KEY = "fault_benchmark"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", default="256,1024", help="table sizes, MiB")
    p.add_argument(
        "--routes", default="snapshot,checkpoint,restart", help="routes to run"
    )
    p.add_argument("--kill-step", type=int, default=9)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--snapshot-every", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=4)
    p.add_argument("--heartbeat-timeout", type=float, default=2.0)
    p.add_argument("--collective-timeout", type=float, default=30.0)
    p.add_argument("--deadline", type=float, default=1200.0)
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


# --------------------------------------------------------------- the model


class Model(torch.nn.Module):
    """An EBC of ``TABLES`` big tables and a small replicated one, an MLP."""

    def __init__(self, rows: int, device: torch.device) -> None:
        from torchrec.distributed.test_utils.model_zoo import numbered_tables
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        tables = numbered_tables(
            EmbeddingBagConfig, TABLES, [DIM] * TABLES, [rows] * TABLES
        )
        tables.append(
            EmbeddingBagConfig(
                name="dp", embedding_dim=DIM, num_embeddings=1024, feature_names=["fdp"]
            )
        )
        self.sparse = EmbeddingBagCollection(tables=tables, device=device)
        self.dense = torch.nn.Sequential(
            torch.nn.Linear(DIM * (TABLES + 1), 64, device=device),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 1, device=device),
        )

    def forward(self, features: Any) -> torch.Tensor:
        pooled = self.sparse(features).to_dict()
        return self.dense(torch.cat([pooled[k] for k in sorted(pooled)], dim=1))


def rows_for(size_mib: int) -> int:
    return size_mib * MiB // (TABLES * DIM * 4)


def build(rows: int) -> Any:
    """The model sharded over the default group, fused row-wise Adagrad."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        data_parallel,
        table_wise,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    meta = Model(rows, torch.device("meta"))
    generators = {f"t{i}": table_wise(rank=i % WORLD) for i in range(TABLES)}
    generators["dp"] = data_parallel()
    module_plan = construct_module_sharding_plan(
        meta.sparse, generators, local_size=WORLD, world_size=WORLD, device_type="cpu"
    )
    for name, ps in module_plan.items():
        if name != "dp":
            ps.compute_kernel = EmbeddingComputeKernel.FUSED.value
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": 0.05,
            "eps": 0.01,
        }
    )
    return DistributedModelParallel(
        meta,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"sparse": module_plan}),
        sharders=[sharder],
    )


def make_optimizer(model: Any) -> Any:
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.01),
    )


def batch(rows: int, step: int, rank: int) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1000 * step + rank)
    keys = [f"f{i}" for i in range(TABLES)] + ["fdp"]
    sizes = [rows] * TABLES + [1024]
    values = torch.cat(
        [torch.randint(0, n, (BATCH * 2,), generator=gen) for n in sizes]
    )
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=values, lengths=torch.full((len(keys) * BATCH,), 2)
    )


def train_step(model: Any, optimizer: Any, rows: int, step: int, rank: int) -> None:
    optimizer.zero_grad()
    (model(batch(rows, step, rank)) ** 2).mean().backward()
    optimizer.step()


# ------------------------------------------------------------------ ranks


def _connect(rank: int, port: int, args: argparse.Namespace, prefix: str) -> Any:
    worker_setup(0, args.verbose)
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=args.collective_timeout),
    )
    return store


def _note(store: Any, what: str, value: Any) -> None:
    store.set(f"{KEY}/{what}", json.dumps(value))


def _kill_self(store: Any) -> None:
    _note(store, "killed_at", time.time())
    os.kill(os.getpid(), signal.SIGKILL)


def ft_rank(
    rank: int, port: int, args: argparse.Namespace, route: str, size: int, ckpt: str
) -> None:
    from torchrec.distributed.resharding.fault import FaultOptions, FaultTolerance

    store = _connect(rank, port, args, "job/")
    rows = rows_for(size)
    model = build(rows)
    options = FaultOptions(
        heartbeat_timeout=timedelta(seconds=args.heartbeat_timeout),
        collective_timeout=timedelta(seconds=args.collective_timeout),
        sources=("replica", route),
        snapshot_every=args.snapshot_every if route == "snapshot" else 0,
    )
    ft = FaultTolerance(model, make_optimizer(model), make_optimizer, options)
    first_after: Optional[float] = None
    while ft.steps < args.steps:
        step = ft.steps

        def run(model: Any, optimizer: Any) -> None:
            if rank == VICTIM and step == args.kill_step:
                _kill_self(store)
            train_step(model, optimizer, rows, step, rank)

        recovered = len(ft.reports)
        ft.step(run)
        if len(ft.reports) > recovered:
            continue
        if ft.reports and first_after is None:
            first_after = time.time()
        if route == "checkpoint" and ft.steps % args.checkpoint_every == 0:
            ft.save_checkpoint(os.path.join(ckpt, str(ft.steps)))
    report = ft.reports[0]
    _note(
        store,
        f"rank{rank}",
        {
            "first_step_at": first_after,
            "detected_at": report.detected_at,
            "agree": report.agree_seconds,
            "group": report.group_seconds,
            "sources": report.sources_seconds,
            "move": report.move_seconds,
            "restore": report.restore_seconds,
            "bytes": report.bytes_by_source,
            "steps_lost": report.steps_lost,
        },
    )
    ft.close()
    os._exit(0)


def restart_rank(
    rank: int, port: int, args: argparse.Namespace, phase: str, size: int, ckpt: str
) -> None:
    import torch.distributed.checkpoint as dcp

    store = _connect(rank, port, args, f"{phase}/")
    rows = rows_for(size)
    model = build(rows)
    optimizer = make_optimizer(model)
    if phase == "before":
        try:
            for step in range(args.kill_step + 1):
                if rank == VICTIM and step == args.kill_step:
                    _kill_self(store)
                train_step(model, optimizer, rows, step, rank)
                if (step + 1) % args.checkpoint_every == 0:
                    state = {
                        "model": model.state_dict(),
                        "optim": model.fused_optimizer.state_dict(),
                    }
                    dcp.save(state, checkpoint_id=os.path.join(ckpt, str(step + 1)))
                    _note(store, f"ckpt{rank}", step + 1)
        except RuntimeError:
            pass  # a collective with the dead rank
        time.sleep(3600)  # the launcher stops it
    last = json.loads(store.get(f"{KEY}/ckpt{rank}"))
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(ckpt, str(last)))
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])
    train_step(model, optimizer, rows, args.kill_step, rank)
    _note(store, f"rank{rank}", {"first_step_at": time.time(), "restored_step": last})
    dist.barrier()
    os._exit(0)


# ----------------------------------------------------------------- launcher


def _launch(target: Any, extra: tuple) -> List[Any]:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *extra)) for r in range(WORLD)]
    for p in procs:
        p.start()
    return procs


def _wait(procs: List[Any], deadline: float) -> None:
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_route(args: argparse.Namespace, route: str, size: int) -> Dict[str, Any]:
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=120), wait_for_workers=False
    )
    ckpt = tempfile.mkdtemp(prefix="fault_bench_")
    deadline = time.monotonic() + args.deadline
    try:
        if route == "restart":
            procs = _launch(restart_rank, (store.port, args, "before", size, ckpt))
            while procs[VICTIM].is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            for p in procs:  # the launcher stops the job
                if p.is_alive():
                    p.kill()
            _wait(procs, deadline)
            procs = _launch(restart_rank, (store.port, args, "after", size, ckpt))
        else:
            procs = _launch(ft_rank, (store.port, args, route, size, ckpt))
        _wait(procs, deadline)
        killed_at = json.loads(store.get(f"{KEY}/killed_at"))
        survivors = [r for r in range(WORLD) if route == "restart" or r != VICTIM]
        ranks = [json.loads(store.get(f"{KEY}/rank{r}")) for r in survivors]
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    first = max(r["first_step_at"] for r in ranks)
    out: Dict[str, Any] = {
        "route": route,
        "size_mib": size,
        "kill_to_first_step_s": first - killed_at,
    }
    if route == "restart":
        restored = ranks[0]["restored_step"]
        out["steps_lost"] = {"checkpoint": args.kill_step - restored}
        return out
    slowest = max(ranks, key=lambda r: r["first_step_at"])
    out.update(
        detect_s=max(r["detected_at"] for r in ranks) - killed_at,
        agree_s=slowest["agree"],
        group_s=slowest["group"] + slowest["sources"],
        move_s=slowest["move"],
        restore_s=slowest["restore"],
        bytes=slowest["bytes"],
        steps_lost=slowest["steps_lost"],
    )
    return out


def table(results: List[Dict[str, Any]]) -> str:
    lines = table_head(
        [("MiB", 6), ("route", 10), ("kill->first step", 17), ("detect", 7)]
        + [("agree", 6), ("group", 6), ("move", 6)],
        "  steps lost (by source); bytes restored",
    )
    for r in results:
        lost = ", ".join(f"{k} {v}" for k, v in sorted(r["steps_lost"].items()))
        restored = ", ".join(
            f"{k} {v / MiB:.1f} MiB" for k, v in sorted(r.get("bytes", {}).items())
        )
        lines.append(
            f"{r['size_mib']:>6} {r['route']:>10} {r['kill_to_first_step_s']:>16.2f}s "
            f"{fmt(r.get('detect_s'), '6.2f'):>7} {fmt(r.get('agree_s'), '5.2f'):>6} "
            f"{fmt(r.get('group_s'), '5.2f'):>6} {fmt(r.get('move_s'), '5.2f'):>6}  "
            f"{lost}" + (f"; {restored}" if restored else "")
        )
    return "\n".join(lines)


def plot(results: List[Dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["size_mib"] for r in results})
    routes = [
        r
        for r in ("snapshot", "checkpoint", "restart")
        if any(x["route"] == r for x in results)
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(routes), 1)
    for i, route in enumerate(routes):
        ys = [
            next(
                (
                    r["kill_to_first_step_s"]
                    for r in results
                    if r["route"] == route and r["size_mib"] == s
                ),
                0,
            )
            for s in sizes
        ]
        ax.bar([j + i * width for j in range(len(sizes))], ys, width, label=route)
    ax.set_xticks([j + width * (len(routes) - 1) / 2 for j in range(len(sizes))])
    ax.set_xticklabels([f"{s} MiB" for s in sizes])
    ax.set_ylabel("kill -> first step on the survivors (s)")
    ax.set_title("surviving a lost rank vs restarting from a checkpoint (4 gloo ranks)")
    ax.legend()
    save_figure(fig, path, dpi=None)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    results = []
    for size in [int(s) for s in args.sizes_mib.split(",")]:
        for route in args.routes.split(","):
            start = time.time()
            result = run_route(args, route, size)
            result["wall_s"] = time.time() - start
            results.append(result)
            print(
                f"{size} MiB {route}: kill -> first step "
                f"{result['kill_to_first_step_s']:.2f} s",
                flush=True,
            )
    print()
    print(table(results))
    save_results(
        args.out_dir,
        "fault_benchmark",
        {"args": vars(args), "results": results},
        None if args.no_plot else lambda path: plot(results, path),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Benchmark of live rebalancing (issue 17): the outcome for the job, not the
mechanism.

Scenario: 2 gloo ranks (one core each), a DLRM with ``--tables`` fp32 tables
of ``--rows`` x ``--dim``, fused row-wise Adagrad, trained with
``TrainPipelineSparseDist``. Table ``i`` of the hot order gets ``--top-pf /
(i + 1)`` ids per sample (Zipf-like). The planner's plan A balances the load
declared before the change. At step ``--change`` the hot set changes: the
heaviest pooling factors move to the tables plan A put on rank 0.

Runs, in one sitting, from the same start (same weights, plan A, batches),
advanced in turn one step each (so that every run sees the same moments of a
shared machine; a run's wall time is the sum of its steps' times):

* ``static``      plan A throughout;
* ``monitored``   plan A throughout with a ``LoadMonitor`` (its overhead);
* ``rebalanced``  the ``Rebalancer`` (planner of plan A, ``RebalancePolicy``);
* ``oracle``      the planner's plan for the true post-change load, resharded
  to at the change step;
* ``control``     the ``Rebalancer`` on a load that never changes (it must
  not reshard).

Printed: steps/s before and after the change (after: the last
``--steady`` steps), total wall time, the reshards (step, seconds, bytes with
and without relabelling), and the ratios the issue's targets are stated in;
``benchmarks/results/rebalance_benchmark.{json,png}`` keep the figures and a
plot of step time over steps with the reshards marked.

Example::

    python benchmarks/rebalance_benchmark.py --steps 200 --change 50
"""

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
EBC = "model.sparse_arch.embedding_bag_collection"
DENSE_IN = 8
RUNS = ("static", "monitored", "rebalanced", "oracle", "control")


def pooling_before(tables: int, top: float) -> List[float]:
    """Zipf-like ids per sample, hot order t0, t1, ... before the change."""
    return [max(1.0, round(top / (i + 1), 1)) for i in range(tables)]


def pooling_after(before: Sequence[float], plan_a: Any, world_size: int) -> List[float]:
    """The same figures with the heaviest moved to the tables plan A put on rank 0."""
    order = sorted(
        range(len(before)),
        key=lambda i: (plan_a.plan[EBC][f"t{i}"].ranks[0] != 0, i),
    )
    ranked = sorted(before, reverse=True)
    after = [0.0] * len(before)
    for value, table in zip(ranked, order):
        after[table] = value
    return after


def build(args: argparse.Namespace, device: torch.device) -> Any:
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=args.dim,
            num_embeddings=args.rows,
            feature_names=[f"f{i}"],
        )
        for i in range(args.tables)
    ]
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables, device=device),
            dense_in_features=DENSE_IN,
            dense_arch_layer_sizes=[args.dim],
            over_arch_layer_sizes=[16, 1],
            dense_device=device,
        )
    )


def sharder() -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": 0.01,
        }
    )


def planner(args: argparse.Namespace, pooling: Sequence[float]) -> Any:
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )

    return EmbeddingShardingPlanner(
        topology=Topology(
            world_size=dist.get_world_size(),
            compute_device="cpu",
            local_world_size=dist.get_world_size(),
        ),
        batch_size=args.batch,
        constraints={
            f"t{i}": ParameterConstraints(
                sharding_types=["table_wise"],
                compute_kernels=["fused"],
                pooling_factors=[p],
            )
            for i, p in enumerate(pooling)
        },
        stats=[],
        debug=False,
    )


def make_model(args: argparse.Namespace, plan: Any) -> Any:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model = DistributedModelParallel(
        build(args, torch.device("cpu")),
        device=torch.device("cpu"),
        plan=plan,
        sharders=[sharder()],
    )
    model.load_state_dict(build(args, torch.device("cpu")).state_dict())
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.01),
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def batches(
    args: argparse.Namespace,
    before: Sequence[float],
    after: Optional[Sequence[float]],
    rank: int,
) -> Iterator[Any]:
    """The run's batches: the same on every run, made as the pipeline pulls them."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [f"f{i}" for i in range(args.tables)]
    for step in range(args.steps + 1):  # the pipeline reads one ahead
        pooling = after if after is not None and step >= args.change else before
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        lengths = torch.cat(
            [
                torch.full((args.batch,), int(round(p)), dtype=torch.long)
                for p in pooling
            ]
        )
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=gen)
        dense = torch.rand(args.batch, DENSE_IN, generator=gen)
        yield Batch(
            dense_features=dense,
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=keys, values=values, lengths=lengths
            ),
            labels=(dense.sum(dim=1) > DENSE_IN / 2).long(),
        )


class Run:
    """One run's model, pipeline and (per run) rebalancer or monitor."""

    def __init__(
        self, args: argparse.Namespace, name: str, plan_a: Any, plan_oracle: Any
    ) -> None:
        from torchrec.distributed.resharding import (
            LoadMonitor,
            RebalancePolicy,
            Rebalancer,
        )
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        self.name = name
        self.args = args
        self.plan_oracle = plan_oracle
        before = pooling_before(args.tables, args.top_pf)
        after = None if name == "control" else args.after
        self.model, optimizer = make_model(args, plan_a)
        self.pipeline = TrainPipelineSparseDist(
            self.model, optimizer, torch.device("cpu")
        )
        self.it: Iterator[Any] = batches(args, before, after, dist.get_rank())
        self.rebalancer: Optional[Any] = None
        self.monitor: Optional[Any] = None
        if name in ("rebalanced", "control"):
            policy = RebalancePolicy(
                window=args.window,
                min_gain=0.1,
                hysteresis=2,
                min_interval=args.min_interval,
                horizon=args.horizon,
            )
            self.rebalancer = Rebalancer(self.model, planner(args, before), policy)
        elif name == "monitored":
            self.monitor = LoadMonitor.for_model(self.model)
        self.reshards: List[Dict[str, Any]] = []
        self.times: List[float] = []

    def step(self, step: int) -> None:
        """One training step (and what the run does after it), timed."""
        # the runs take turns: their steps start here, not at their last end
        if self.rebalancer is not None:
            self.rebalancer.monitor.start_step()
        elif self.monitor is not None:
            self.monitor.start_step()
        t0 = time.perf_counter()
        self.pipeline.progress(self.it)
        if self.rebalancer is not None:
            decision = self.rebalancer.step()
            if decision is not None and decision.action == "reshard":
                self.reshards.append(
                    {
                        "step": step,
                        "seconds": decision.reshard_seconds,
                        "bytes_raw": decision.bytes_raw,
                        "bytes_relabelled": decision.bytes_relabelled,
                        "predicted_step_s": decision.predicted_step_seconds,
                        "tables": list(decision.tables),
                    }
                )
        elif self.monitor is not None:
            self.monitor.end_step()
            if step % self.args.window == 0:
                self.monitor.collect(dist.group.WORLD)
        elif self.name == "oracle" and step == self.args.change:
            report = self.model.reshard(self.plan_oracle)
            self.reshards.append(
                {
                    "step": step,
                    "seconds": report.seconds,
                    "bytes_raw": None,
                    "bytes_relabelled": None,
                    "tables": sorted(
                        t for ts in report.tables_moved.values() for t in ts
                    ),
                }
            )
        self.times.append(time.perf_counter() - t0)

    def result(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "times": self.times,
            "wall": sum(self.times),
            "reshards": self.reshards,
        }
        if self.rebalancer is not None:
            out["history"] = [d.line() for d in self.rebalancer.history]
            out["outcomes"] = [o.__dict__ for o in self.rebalancer.outcomes]
            self.rebalancer.close()
        if self.monitor is not None:
            self.monitor.remove()
        return out


def worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600)
    )
    try:
        before = pooling_before(args.tables, args.top_pf)
        meta = build(args, torch.device("meta"))
        plan_a = planner(args, before).collective_plan(
            meta, [sharder()], dist.group.WORLD
        )
        args.after = pooling_after(before, plan_a, 2)
        plan_oracle = planner(args, args.after).collective_plan(
            meta, [sharder()], dist.group.WORLD
        )
        # The runs advance in turn, one step each: every run sees the same
        # moments of a machine that others share.
        runs = [Run(args, name, plan_a, plan_oracle) for name in args.runs]
        dist.barrier()
        for step in range(1, args.steps + 1):
            for r in runs:
                r.step(step)
            if rank == 0 and step % 20 == 0:
                print(f"  step {step}/{args.steps}", flush=True)
        results = {r.name: r.result() for r in runs}
        gathered: List[Any] = [None, None]
        dist.all_gather_object(gathered, results)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(
                    {
                        "ranks": gathered,
                        "before": before,
                        "after": args.after,
                        "plan_a": {t: ps.ranks for t, ps in plan_a.plan[EBC].items()},
                        "plan_oracle": {
                            t: ps.ranks for t, ps in plan_oracle.plan[EBC].items()
                        },
                    },
                    f,
                )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def summarise(args: argparse.Namespace, data: Dict[str, Any]) -> Dict[str, Any]:
    """Per run: the slowest rank's step times and the figures of the table."""
    out: Dict[str, Any] = {}
    warm = min(10, args.change // 2)
    for name in args.runs:
        per_rank = [r[name] for r in data["ranks"]]
        times = [max(ts) for ts in zip(*(r["times"] for r in per_rank))]
        before = times[warm : args.change - 1]
        steady = times[-args.steady :]
        out[name] = {
            "times": times,
            "steps_per_s_before": 1.0 / statistics.mean(before),
            "steps_per_s_after": 1.0 / statistics.mean(steady),
            "step_ms_after": 1e3 * statistics.mean(steady),
            "wall_s": max(r["wall"] for r in per_rank),
            "reshards": [
                dict(
                    r0,
                    seconds=max(r["reshards"][i]["seconds"] for r in per_rank),
                )
                for i, r0 in enumerate(per_rank[0]["reshards"])
            ],
            "history": per_rank[0].get("history", []),
            "outcomes": per_rank[0].get("outcomes", []),
        }
    return out


def table(args: argparse.Namespace, summary: Dict[str, Any]) -> str:
    lines = [
        f"{'run':<11}{'steps/s before':>15}{'steps/s after':>14}{'ms/step after':>14}"
        f"{'wall s':>8}{'x static':>9}{'x oracle':>9}{'reshards':>9}"
        f"{'reshard s':>10}{'MiB raw':>9}{'MiB relab':>10}",
        "-" * 118,
    ]
    static = summary["static"]["step_ms_after"]
    oracle = summary.get("oracle", summary["static"])["step_ms_after"]
    for name in args.runs:
        s = summary[name]
        r = s["reshards"]
        secs = sum(x["seconds"] for x in r)
        raw = sum((x["bytes_raw"] or 0) for x in r) / 2**20
        relab = sum((x["bytes_relabelled"] or 0) for x in r) / 2**20
        has_bytes = any(x["bytes_raw"] is not None for x in r)
        lines.append(
            f"{name:<11}{s['steps_per_s_before']:>15.2f}{s['steps_per_s_after']:>14.2f}"
            f"{s['step_ms_after']:>14.1f}{s['wall_s']:>8.1f}"
            f"{static / s['step_ms_after']:>9.2f}{s['step_ms_after'] / oracle:>9.2f}"
            f"{len(r):>9}{secs:>10.3f}"
            f"{(f'{raw:.2f}' if has_bytes else '-'):>9}{(f'{relab:.2f}' if has_bytes else '-'):>10}"
        )
    return "\n".join(lines)


def targets(summary: Dict[str, Any]) -> List[str]:
    out = []
    reb, ora, sta = summary["rebalanced"], summary["oracle"], summary["static"]
    r_oracle = reb["step_ms_after"] / ora["step_ms_after"]
    r_static = sta["step_ms_after"] / reb["step_ms_after"]
    out.append(
        f"rebalanced steady step time / oracle = {r_oracle:.2f} (target <= 1.10): "
        + ("MET" if r_oracle <= 1.10 else "NOT MET")
    )
    out.append(
        f"static / rebalanced steady step time = {r_static:.2f} (target >= 1.30): "
        + ("MET" if r_static >= 1.30 else "NOT MET")
    )
    wall = reb["wall_s"] / sta["wall_s"]
    out.append(
        f"rebalanced / static total wall time = {wall:.2f} (target < 1): "
        + ("MET" if wall < 1.0 else "NOT MET")
    )
    if "control" in summary:
        n = len(summary["control"]["reshards"])
        out.append(
            f"control reshards = {n} (target 0): " + ("MET" if n == 0 else "NOT MET")
        )
    if "monitored" in summary:
        # the same job (plan A, same batches) with and without the monitor
        mon = statistics.median(summary["monitored"]["times"][10:])
        base = statistics.median(summary["static"]["times"][10:])
        over = mon / base - 1.0
        out.append(
            f"monitoring overhead = {over:+.1%} of the median step time "
            "(target <= 2%): " + ("MET" if over <= 0.02 else "NOT MET")
        )
    return out


def plot(args: argparse.Namespace, summary: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    colours = {
        "static": "tab:red",
        "rebalanced": "tab:blue",
        "oracle": "tab:green",
        "control": "tab:gray",
        "monitored": "tab:orange",
    }
    for name in args.runs:
        if name == "monitored":
            continue
        times = summary[name]["times"]
        ax.plot(
            range(1, len(times) + 1),
            [1e3 * t for t in times],
            label=name,
            color=colours[name],
            lw=0.9,
            alpha=0.5 if name == "control" else 0.9,
        )
        for r in summary[name]["reshards"]:
            ax.axvline(r["step"], color=colours[name], ls="--", lw=1)
    ax.axvline(args.change, color="black", ls=":", lw=1, label="load change")
    ax.set_xlabel("step")
    ax.set_ylabel("step time, slowest rank (ms)")
    ax.set_yscale("log")
    ax.set_title("Live rebalancing: step time over steps (dashed: reshards)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tables", type=int, default=16)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--top-pf", type=float, default=64.0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--change", type=int, default=50)
    p.add_argument("--steady", type=int, default=50, help="steps averaged after")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--min-interval", type=int, default=100)
    p.add_argument("--horizon", type=int, default=1000)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--out", default=os.path.join(RESULTS, "rebalance_benchmark"))
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = set(args.runs) - set(RUNS)
    if unknown or not {"static", "rebalanced", "oracle"} <= set(args.runs):
        p.error(
            f"--runs must name static, rebalanced, oracle (+ {RUNS}), got {args.runs}"
        )
    if not 0 < args.change < args.steps - args.steady:
        p.error("need 0 < --change < --steps - --steady")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    fd, out_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    print(
        f"rebalance benchmark: 2 gloo ranks, {args.tables} tables x {args.rows} x "
        f"{args.dim}, batch {args.batch}/rank, top pooling {args.top_pf}, "
        f"{args.steps} steps, load change at step {args.change}",
        flush=True,
    )
    mp.spawn(worker, args=(args, free_port(), out_path), nprocs=2)
    with open(out_path) as f:
        data = json.load(f)
    os.unlink(out_path)
    summary = summarise(args, data)
    text = table(args, summary)
    print(text)
    for line in targets(summary):
        print(line)
    for name in ("rebalanced", "control"):
        if name in summary:
            print(f"{name} decisions:")
            for line in summary[name]["history"]:
                print("   ", line)
            for o in summary[name]["outcomes"]:
                print(
                    f"    after the reshard at step {o['step']}: measured "
                    f"{1e3 * o['measured_step_seconds']:.1f} ms/step, predicted "
                    f"{1e3 * o['predicted_step_seconds']:.1f}, before "
                    f"{1e3 * o['step_seconds_before']:.1f}"
                )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    plot(args, summary, args.out + ".png")
    with open(args.out + ".json", "w") as f:
        json.dump(
            {
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                "args": {k: v for k, v in vars(args).items() if k != "after"},
                "pooling_before": data["before"],
                "pooling_after": data["after"],
                "plan_a": data["plan_a"],
                "plan_oracle": data["plan_oracle"],
                "table": text,
                "targets": targets(summary),
                "runs": summary,
            },
            f,
            indent=1,
        )
    print(f"saved {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Benchmark of live rebalancing (issues 17 and 27): the outcome for the job,
judged on a machine where placement matters.

Scenario: 2 gloo ranks (one thread each), a DLRM with ``--tables`` small
fp32 tables (``--rows`` x ``--dim``: they stay in cache, so a lookup costs
compute, not memory bandwidth, and a rank with more lookups is slower even
when the two ranks share one memory bus), fused row-wise Adagrad, trained
with ``TrainPipelineSparseDist``. Before step ``--change`` every table gets
``--cold-pf`` ids per sample; the planner's plan A balances that. From
``--change`` on, the tables plan A put on rank 0 get ``--hot-pf``.

Runs, from the same start (same weights, plan A, batches):

* ``static``      plan A throughout;
* ``oracle``      the planner's plan for the true post-change load,
  resharded to at the change;
* ``rebalanced``  the ``Rebalancer``;
* ``control``     the ``Rebalancer`` on a load that never changes (it must
  not reshard);
* ``monitored``   (``--runs``) plan A with a ``LoadMonitor``: its overhead.

With ``--split`` (issue 34), only the first of plan A's tables on rank 0
gets ``--hot-pf``: one table hotter than the mean rank, which moving whole
tables cannot fix (it only changes ranks). The constraints allow
column-wise sharding, the policy has ``split_shards`` on, and the results
go to ``rebalance_benchmark_split.{json,png}``: the prediction of a split's
step time against the step measured after it.

Time is measured over blocks of ``--block`` steps between barriers: the
runs take turns block by block (the order rotates), each block starts and
ends with a barrier of the two ranks, so no block carries the skew another
run left behind, and every run sees the same moments of a shared machine.
A block's time includes everything the run does in it (the rebalancer's
windows, its reshards). The steady state is the mean over the last
``--steady`` blocks.

Printed first: the oracle's own gain over static (and whether it stands
out of the noise: if not, the machine cannot judge the targets and the
benchmark says so); then the targets relative to it (rebalanced steady
state within 1.1x the oracle's, at least 70% of the oracle's gain, no
reshard of the stationary control, predicted step time within 15% of the
measured one after each reshard: in the window right after it, and as the
median of the windows until the policy's ``min_interval``, which a
transient of a window or two after the reshard does not move); the
decisions and outcomes.
``rebalance_benchmark.{json,png}`` in ``--out-dir`` (default
``benchmarks/results/``, the options of ``common.py``) keep the figures and,
but with ``--no-plot``, a plot of block time over steps with the reshards
marked.

Example::

    python benchmarks/rebalance_benchmark.py --steps 200 --change 40
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import (
    benchmark_parser,
    free_port,
    gather_to_json,
    save_figure,
    save_results,
    worker_setup,
)

EBC = "model.sparse_arch.embedding_bag_collection"
DENSE_IN = 8
RUNS = ("static", "oracle", "rebalanced", "control", "monitored")
DEFAULT_RUNS = ("static", "oracle", "rebalanced", "control")


def pooling_before(args: argparse.Namespace) -> List[float]:
    """Every table the same ids per sample before the change."""
    return [float(args.cold_pf)] * args.tables


def pooling_after(args: argparse.Namespace, plan_a: Any) -> List[float]:
    """
    The tables plan A put on rank 0 hot (``--split``: the first of them
    only), the others cold.
    """
    hot = [i for i in range(args.tables) if plan_a.plan[EBC][f"t{i}"].ranks == [0]]
    if args.split:
        hot = hot[:1]
    return [
        float(args.hot_pf if i in hot else args.cold_pf) for i in range(args.tables)
    ]


def build(args: argparse.Namespace, device: torch.device) -> Any:
    from torchrec.distributed.test_utils.reshard_model_utils import equal_tables_dlrm

    return equal_tables_dlrm(
        args.tables, args.rows, args.dim, DENSE_IN, [16, 1], device
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


def topology() -> Any:
    from torchrec.distributed.planner import Topology

    world = dist.get_world_size()
    return Topology(world_size=world, compute_device="cpu", local_world_size=world)


def constraints(pooling: Sequence[float], split: bool = False) -> Dict[str, Any]:
    """Table-wise tables (``split``: or column-wise) of the given pooling."""
    from torchrec.distributed.planner import ParameterConstraints

    kinds = ["table_wise", "column_wise"] if split else ["table_wise"]
    return {
        f"t{i}": ParameterConstraints(
            sharding_types=kinds,
            compute_kernels=["fused"],
            pooling_factors=[p],
        )
        for i, p in enumerate(pooling)
    }


def plan_for(args: argparse.Namespace, pooling: Sequence[float]) -> Any:
    """The planner's plan for a load (rank 0 plans, every rank gets it)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    planner = EmbeddingShardingPlanner(
        topology=topology(),
        batch_size=args.batch,
        constraints=constraints(pooling, args.split),
        stats=[],
        debug=False,
    )
    return planner.collective_plan(
        build(args, torch.device("meta")), [sharder()], dist.group.WORLD
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
        self,
        args: argparse.Namespace,
        name: str,
        plan_a: Any,
        plan_oracle: Any,
        after: Sequence[float],
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
        before = pooling_before(args)
        self.model, optimizer = make_model(args, plan_a)
        self.pipeline = TrainPipelineSparseDist(
            self.model, optimizer, torch.device("cpu")
        )
        loaded = None if name == "control" else after
        self.it: Iterator[Any] = batches(args, before, loaded, dist.get_rank())
        self.rebalancer: Optional[Any] = None
        self.monitor: Optional[Any] = None
        if name in ("rebalanced", "control"):
            policy = RebalancePolicy(
                window=args.block,
                min_gain=args.min_gain,
                hysteresis=2,
                min_interval=args.min_interval,
                horizon=args.horizon,
                split_shards=args.split,
            )
            self.rebalancer = Rebalancer(
                self.model,
                topology(),
                policy,
                batch_size=args.batch,
                constraints=constraints(before, args.split),
            )
            self.monitor = self.rebalancer.monitor
        elif name == "monitored":
            self.monitor = LoadMonitor.for_model(self.model)
        self.step_count = 0
        self.reshards: List[Dict[str, Any]] = []
        self.blocks: List[float] = []

    def block(self) -> None:
        """``--block`` training steps (and what the run does after each)."""
        if self.monitor is not None:
            self.monitor.start_step()  # the block starts now, not at the last end
        for _ in range(self.args.block):
            self.step_count += 1
            self.pipeline.progress(self.it)
            if self.rebalancer is not None:
                decision = self.rebalancer.step()
                if decision is not None and decision.action == "reshard":
                    self.reshards.append(
                        {
                            "step": self.step_count,
                            "seconds": decision.reshard_seconds,
                            "bytes": decision.bytes_moved,
                            "source": decision.source,
                            "predicted_step_s": decision.predicted_step_seconds,
                            "step_s_before": decision.step_seconds,
                            "tables": list(decision.tables),
                        }
                    )
            elif self.monitor is not None:
                self.monitor.end_step()
                if self.step_count % self.args.block == 0:
                    self.monitor.collect(dist.group.WORLD)
            if self.name == "oracle" and self.step_count == self.args.change:
                report = self.model.reshard(self.plan_oracle)
                sent = torch.tensor([float(report.bytes_sent)])
                dist.all_reduce(sent)  # every rank's, as the dry run counts
                self.reshards.append(
                    {
                        "step": self.step_count,
                        "seconds": report.seconds,
                        "bytes": int(sent.item()),
                        "tables": sorted(
                            t for ts in report.tables_moved.values() for t in ts
                        ),
                    }
                )
        if self.monitor is not None:
            self.monitor.pause()  # the other runs' blocks are not its steps

    def result(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"blocks": self.blocks, "reshards": self.reshards}
        if self.rebalancer is not None:
            out["history"] = [d.line() for d in self.rebalancer.history]
            out["outcomes"] = [
                dict(
                    o.__dict__,
                    error=o.error,
                    settled_step_seconds=o.settled_step_seconds,
                    settled_error=o.settled_error,
                )
                for o in self.rebalancer.outcomes
            ]
            self.rebalancer.close()
        elif self.monitor is not None:
            self.monitor.remove()
        return out


def worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    worker_setup(port, verbose=False, loggers=("torch",))
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600)
    )
    try:
        plan_a = plan_for(args, pooling_before(args))
        after = pooling_after(args, plan_a)
        plan_oracle = plan_for(args, after)
        runs = [Run(args, name, plan_a, plan_oracle, after) for name in args.runs]
        for b in range(args.steps // args.block):
            shift = b % len(runs)  # the order rotates: no run always first
            for r in runs[shift:] + runs[:shift]:
                dist.barrier()
                start = time.perf_counter()
                r.block()
                dist.barrier()
                r.blocks.append(time.perf_counter() - start)
            if rank == 0 and (b + 1) % 5 == 0:
                print(f"  block {b + 1}/{args.steps // args.block}", flush=True)
        results = {
            "runs": {r.name: r.result() for r in runs},
            "before": pooling_before(args),
            "after": after,
            "plan_a": {t: ps.ranks for t, ps in plan_a.plan[EBC].items()},
            "plan_oracle": {t: ps.ranks for t, ps in plan_oracle.plan[EBC].items()},
        }
        gather_to_json(results, out, dist.group.WORLD)  # main reads rank 0's
    finally:
        dist.destroy_process_group()


def summarise(args: argparse.Namespace, data: Dict[str, Any]) -> Dict[str, Any]:
    """Per run: ms per step per block, before the change and in steady state."""
    out: Dict[str, Any] = {}
    change_block = args.change // args.block
    for name in args.runs:
        run = data["runs"][name]
        ms = [1e3 * t / args.block for t in run["blocks"]]
        before = ms[1:change_block]  # the first block warms up
        steady = ms[-args.steady :]
        out[name] = {
            "block_ms": ms,
            "ms_before": statistics.mean(before),
            "ms_steady": statistics.mean(steady),
            "sem_steady": statistics.stdev(steady) / len(steady) ** 0.5,
            "wall_s": sum(run["blocks"]),
            "reshards": run["reshards"],
            "history": run.get("history", []),
            "outcomes": run.get("outcomes", []),
        }
    return out


def table(args: argparse.Namespace, summary: Dict[str, Any]) -> str:
    lines = [
        f"{'run':<11}{'ms/step before':>15}{'ms/step steady':>15}{'+-':>6}"
        f"{'x static':>9}{'x oracle':>9}{'wall s':>8}{'reshards':>9}"
        f"{'reshard s':>10}{'MiB sent':>10}",
        "-" * 102,
    ]
    static = summary["static"]["ms_steady"]
    oracle = summary["oracle"]["ms_steady"]
    for name in args.runs:
        s = summary[name]
        r = s["reshards"]
        lines.append(
            f"{name:<11}{s['ms_before']:>15.2f}{s['ms_steady']:>15.2f}"
            f"{s['sem_steady']:>6.2f}{static / s['ms_steady']:>9.2f}"
            f"{s['ms_steady'] / oracle:>9.2f}{s['wall_s']:>8.1f}{len(r):>9}"
            f"{sum(x['seconds'] or 0 for x in r):>10.3f}"
            f"{sum(x['bytes'] or 0 for x in r) / 2**20:>10.2f}"
        )
    return "\n".join(lines)


def targets(summary: Dict[str, Any]) -> List[str]:
    sta, ora, reb = (summary[n] for n in ("static", "oracle", "rebalanced"))
    gain = sta["ms_steady"] - ora["ms_steady"]
    noise = 2.0 * (sta["sem_steady"] ** 2 + ora["sem_steady"] ** 2) ** 0.5
    out = [
        f"oracle's gain over static: {sta['ms_steady']:.2f} -> {ora['ms_steady']:.2f} "
        f"ms/step, {sta['ms_steady'] / ora['ms_steady']:.2f}x "
        f"(noise +-{noise:.2f} ms/step)"
    ]
    judged = gain > max(noise, 0.02 * sta["ms_steady"])
    if not judged:
        out.append(
            "THE ORACLE SHOWS NO GAIN over static on this machine: placement does "
            "not matter here, and the speed targets below cannot be judged"
        )

    def verdict(met: bool) -> str:
        return ("MET" if met else "NOT MET") if judged else "NOT JUDGED (no gain)"

    ratio = reb["ms_steady"] / ora["ms_steady"]
    out.append(
        f"rebalanced steady state / oracle = {ratio:.2f} (target <= 1.10): "
        + verdict(ratio <= 1.10)
    )
    share = (sta["ms_steady"] - reb["ms_steady"]) / gain if gain > 0 else 0.0
    out.append(
        f"rebalanced share of the oracle's gain = {share:.0%} (target >= 70%): "
        + verdict(share >= 0.70)
    )
    if "control" in summary:
        n = len(summary["control"]["reshards"])
        out.append(
            f"stationary control reshards = {n} (target 0): "
            + ("MET" if n == 0 else "NOT MET")
        )
    for o in reb["outcomes"]:
        out.append(
            f"after the reshard at step {o['step']}: predicted "
            f"{1e3 * o['predicted_step_seconds']:.2f} ms/step, measured "
            f"{1e3 * o['measured_step_seconds']:.2f} (next window; before "
            f"{1e3 * o['step_seconds_before']:.2f}): error {o['error']:+.1%}"
        )
        if "settled_error" in o:
            windows = ", ".join(
                f"{1e3 * s:.1f}" for s in o.get("settling_step_seconds", ())
            )
            out.append(
                f"    median of the {len(o.get('settling_step_seconds', ()))} "
                f"windows until min_interval ({windows}): "
                f"{1e3 * o['settled_step_seconds']:.2f} ms/step: error "
                f"{o['settled_error']:+.1%}"
            )
    for key, what in (("error", "next window"), ("settled_error", "settled")):
        errors = [abs(o[key]) for o in reb["outcomes"] if key in o]
        if errors:
            worst = max(errors)
            out.append(
                f"prediction error ({what}), worst reshard = {worst:.1%} "
                "(target <= 15%): " + ("MET" if worst <= 0.15 else "NOT MET")
            )
    if not reb["outcomes"]:
        out.append("prediction error: no reshard to judge")
    if "monitored" in summary:
        over = summary["monitored"]["ms_steady"] / sta["ms_steady"] - 1.0
        out.append(f"monitoring overhead = {over:+.1%} of the steady step time")
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
        ms = summary[name]["block_ms"]
        x = [(b + 1) * args.block for b in range(len(ms))]
        ax.plot(x, ms, label=name, color=colours[name], lw=1.0)
        for r in summary[name]["reshards"]:
            ax.axvline(r["step"], color=colours[name], ls="--", lw=1)
    ax.axvline(args.change, color="black", ls=":", lw=1, label="load change")
    ax.set_xlabel("step")
    ax.set_ylabel(f"ms per step (blocks of {args.block} between barriers)")
    ax.set_title("Live rebalancing on 2 ranks (dashed: reshards)")
    ax.legend()
    save_figure(fig, path)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = benchmark_parser(__doc__, argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--cold-pf", type=float, default=8.0)
    p.add_argument("--hot-pf", type=float, default=384.0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--change", type=int, default=40)
    p.add_argument("--block", type=int, default=10, help="steps per block = window")
    p.add_argument("--steady", type=int, default=10, help="blocks averaged")
    p.add_argument("--min-gain", type=float, default=0.1)
    p.add_argument("--min-interval", type=int, default=50)
    p.add_argument("--horizon", type=int, default=1000)
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS))
    p.add_argument(
        "--split",
        action="store_true",
        help="one hot table, which only a split fixes (column-wise allowed)",
    )
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = set(args.runs) - set(RUNS)
    if unknown or not {"static", "rebalanced", "oracle"} <= set(args.runs):
        p.error(
            f"--runs must name static, rebalanced, oracle (+ {RUNS}), got {args.runs}"
        )
    if args.change % args.block or args.steps % args.block:
        p.error("--change and --steps must be multiples of --block")
    if not 0 < args.change // args.block < args.steps // args.block - args.steady:
        p.error("need 0 < --change < --steps - --steady blocks")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    fd, out_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    print(
        f"rebalance benchmark: 2 gloo ranks, {args.tables} tables x {args.rows} x "
        f"{args.dim}, batch {args.batch}/rank, {args.cold_pf:g} ids/sample, "
        f"{args.hot_pf:g} on rank 0's {'first table' if args.split else 'tables'} "
        f"from step {args.change}; "
        f"{args.steps} steps in blocks of {args.block}",
        flush=True,
    )
    mp.spawn(worker, args=(args, free_port(), out_path), nprocs=2)
    with open(out_path) as f:
        data = json.load(f)[0]  # rank 0's
    os.unlink(out_path)
    summary = summarise(args, data)
    checks = targets(summary)
    print(checks[0])
    if len(checks) > 1 and checks[1].startswith("THE ORACLE"):
        print(checks[1])
    text = table(args, summary)
    print(text)
    for line in checks[1:]:
        if not line.startswith("THE ORACLE"):
            print(line)
    for name in ("rebalanced", "control"):
        if name in summary:
            print(f"{name} decisions:")
            for line in summary[name]["history"]:
                print("   ", line)
    save_results(
        args.out_dir,
        "rebalance_benchmark_split" if args.split else "rebalance_benchmark",
        {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "args": vars(args),
            "pooling_before": data["before"],
            "pooling_after": data["after"],
            "plan_a": data["plan_a"],
            "plan_oracle": data["plan_oracle"],
            "table": text,
            "targets": checks,
            "runs": summary,
        },
        None if args.no_plot else lambda path: plot(args, summary, path),
    )


if __name__ == "__main__":
    main(sys.argv[1:])

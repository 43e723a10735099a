#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
Live resharding demo: train, move embedding tables while the job runs, keep training.

A small recommendation model (an ``EmbeddingBagCollection`` with one table per
sparse feature, plus a replicated MLP over the pooled embeddings and a few dense
features, trained on synthetic click labels with BCE) is sharded under plan A
and trained for ``--steps-before`` steps. The job then reshards the embedding
tables **in place** to plan B with
``torchrec.distributed.resharding.reshard_module``
(the same process, process group and module object) and trains
``--steps-after`` more steps.

To show the reshard is exact, right before it every rank gathers the full
pre-reshard state (every table's weights, the fused optimizer state, the
optimizer step counter, the dense part and its optimizer) and builds a
*reference* model sharded directly with plan B from that state. Both models
then train on the same batches; the losses must be bit-identical at every step
and the state dicts (weights and optimizer state) equal at the end.

Run (2 gloo ranks on CPU, spawned here)::

    python examples/live_reshard_demo.py
    python examples/live_reshard_demo.py --plan mixed --optimizer adam

Under torchrun (one process per rank; RANK/WORLD_SIZE are read from the env)::

    torchrun --standalone --nproc-per-node 2 examples/live_reshard_demo.py
    torchrun --standalone --nproc-per-node 2 examples/live_reshard_demo.py --backend nccl

Exit status: 0 when training after the reshard matches the reference exactly,
1 when it does not, 2 on any other failure.
"""

import argparse
import copy
import dataclasses
import logging
import os
import socket
import sys
import time
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

PLANS: Dict[str, str] = {
    "rebalance": "A: every table table-wise on rank 0; B: table-wise round-robin",
    "tw-to-cw": "A: table-wise round-robin; B: every table column-wise on all ranks",
    "tw-to-rw": "A: table-wise round-robin; B: every table row-wise on all ranks",
    "cw-to-tw": "A: every table column-wise on all ranks; B: table-wise round-robin",
    "mixed": (
        "several changes at once, cycling over the tables: TW move, TW -> CW, "
        "RW -> TW, TW -> DP, CW -> RW, DP -> TW, and one table left alone "
        "(use --num-tables 7 for all of them)"
    ),
}
OPTIMIZERS: Dict[str, str] = {
    "sgd": "EXACT_SGD",
    "adagrad": "EXACT_ADAGRAD",
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adam": "ADAM",
}
NUM_DENSE_FEATURES = 4
LOG = logging.getLogger("live_reshard_demo")


# --------------------------------------------------------------------------
# options and launching


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line."""
    parser = argparse.ArgumentParser(
        description=(
            "Train a small recommendation model with sharded embedding tables, "
            "reshard the tables live from plan A to plan B, keep training, and "
            "check that training continues exactly as a reference model sharded "
            "directly with plan B from the same state."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="plans (--plan):\n"
        + "\n".join(f"  {k:<10} {v}" for k, v in PLANS.items())
        + "\n\nLaunch: without RANK/WORLD_SIZE in the environment the demo spawns "
        "--world-size local processes itself; under torchrun it uses torchrun's "
        "ranks (and --world-size is ignored).\n"
        "Exit status: 0 exact, 1 not exact, 2 other failure.",
    )
    parser.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        default="gloo",
        help="collective backend: gloo on CPU (default) or nccl on cuda:LOCAL_RANK",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=2,
        help="number of ranks to spawn when not under torchrun (default 2)",
    )
    parser.add_argument(
        "--num-tables", type=int, default=4, help="embedding tables (default 4)"
    )
    parser.add_argument(
        "--rows", type=int, default=1000, help="rows per table (default 1000)"
    )
    parser.add_argument(
        "--dim",
        type=int,
        default=16,
        help="embedding dimension (default 16; column-wise plans split it evenly "
        "over the ranks, so make it a multiple of 4 * world size)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="samples per rank per step"
    )
    parser.add_argument(
        "--steps-before", type=int, default=5, help="steps under plan A (default 5)"
    )
    parser.add_argument(
        "--steps-after", type=int, default=5, help="steps under plan B (default 5)"
    )
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adagrad",
        help="fused embedding optimizer (default adagrad); --kernel dense "
        "supports sgd only",
    )
    parser.add_argument(
        "--lr", type=float, default=0.05, help="learning rate (default 0.05)"
    )
    parser.add_argument(
        "--kernel",
        choices=["fused", "dense"],
        default="fused",
        help="embedding compute kernel: fused (optimizer applied in backward, "
        "default) or dense (torch.optim.SGD on the embedding gradients)",
    )
    parser.add_argument(
        "--plan",
        choices=sorted(PLANS),
        default="rebalance",
        help="the plan pair A -> B (default rebalance; see below)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--perturb-reference",
        action="store_true",
        help="nudge one weight of the reference by one ulp before training on, "
        "to show that the exactness check does catch a difference (exits 1)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="log on every rank, not only rank 0"
    )
    args = parser.parse_args(argv)
    if args.kernel == "dense" and args.optimizer != "sgd":
        parser.error(
            "--kernel dense trains the embeddings with torch.optim.SGD (a torch "
            "optimizer's state is not part of the module, so it cannot move with "
            "the tables): use --optimizer sgd"
        )
    if args.optimizer == "adam" and args.backend != "nccl":
        parser.error(
            "fbgemm's CPU kernels have no Adam: use --optimizer adam with "
            "--backend nccl on GPUs"
        )
    for name in ("world_size", "num_tables", "rows", "dim", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.steps_before < 0 or args.steps_after < 0:
        parser.error("step counts must be >= 0")
    return args


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _spawned_worker(rank: int, world_size: int, port: int, args: Any) -> None:
    os.environ.update(
        MASTER_ADDR="localhost",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    code = worker(args)
    if code:
        sys.exit(code)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: runs the ranks (spawning them unless under torchrun)."""
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
        return worker(args)
    port = _free_port()
    try:
        mp.spawn(
            _spawned_worker,
            args=(args.world_size, port, args),
            nprocs=args.world_size,
            join=True,
        )
    except mp.ProcessExitedException as e:
        return 1 if e.exit_code == 1 else 2
    except mp.ProcessRaisedException as e:
        print(f"a rank failed:\n{e}", file=sys.stderr)
        return 2
    return 0


# --------------------------------------------------------------------------
# model and data


class DenseArch(nn.Module):
    """
    The replicated dense part: an MLP over the concatenated pooled embeddings
    and the dense features, predicting a click logit.

    Args:
        in_features (int): pooled embedding width plus dense feature count.
        hidden (int): hidden width.
    """

    def __init__(self, in_features: int, hidden: int = 32) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, pooled: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Returns logits of shape [batch]."""
        return self.mlp(torch.cat([pooled, dense], dim=1)).squeeze(1)


@dataclasses.dataclass
class Batch:
    """One rank's share of one step's synthetic data."""

    sparse: Any  # KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor


def make_batch(
    args: argparse.Namespace, step: int, rank: int, device: torch.device
) -> Batch:
    """
    Deterministic synthetic data for (seed, step, rank): up to 3 ids per
    feature, dense features, and labels from a hidden linear "true" model so
    that the loss can go down.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    hidden = torch.Generator().manual_seed(args.seed + 7919)
    row_scores = torch.randn(args.num_tables, args.rows, generator=hidden)
    dense_w = torch.randn(NUM_DENSE_FEATURES, generator=hidden)

    g = torch.Generator().manual_seed(
        args.seed * 1_000_003 + step * 4_099 + rank * 17 + 1
    )
    b, n = args.batch_size, args.num_tables
    lengths = torch.randint(0, 4, (n * b,), generator=g)
    values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=g)
    dense = torch.randn(b, NUM_DENSE_FEATURES, generator=g)
    score = dense @ dense_w
    offset = 0
    for t in range(n):
        lens = lengths[t * b : (t + 1) * b]
        ids = values[offset : offset + int(lens.sum())]
        offset += int(lens.sum())
        seg = torch.repeat_interleave(torch.arange(b), lens)
        score = score.index_add(0, seg, row_scores[t][ids])
    labels = (score > 0).float()
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{t}" for t in range(n)], values=values, lengths=lengths
    )
    return Batch(sparse.to(device), dense.to(device), labels.to(device))


# --------------------------------------------------------------------------
# plans


def plan_generators(
    args: argparse.Namespace, world_size: int
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Returns the per-table ParameterSharding generators of plans A and B."""
    from torchrec.distributed.sharding_plan import (
        column_wise,
        data_parallel,
        row_wise,
        table_wise,
    )

    ws = world_size
    names = [f"t{i}" for i in range(args.num_tables)]
    all_ranks = list(range(ws))

    def cw() -> Any:
        return column_wise(ranks=all_ranks)

    if args.plan == "rebalance":
        a = {n: table_wise(rank=0) for n in names}
        b = {n: table_wise(rank=i % ws) for i, n in enumerate(names)}
    elif args.plan == "tw-to-cw":
        a = {n: table_wise(rank=i % ws) for i, n in enumerate(names)}
        b = {n: cw() for n in names}
    elif args.plan == "tw-to-rw":
        a = {n: table_wise(rank=i % ws) for i, n in enumerate(names)}
        b = {n: row_wise() for n in names}
    elif args.plan == "cw-to-tw":
        a = {n: cw() for n in names}
        b = {n: table_wise(rank=i % ws) for i, n in enumerate(names)}
    elif args.plan == "mixed":
        last = ws - 1
        changes: List[Tuple[Callable[[], Any], Callable[[], Any]]] = [
            (lambda: table_wise(rank=0), lambda: table_wise(rank=last)),
            (lambda: table_wise(rank=0), cw),
            (row_wise, lambda: table_wise(rank=last)),
            (lambda: table_wise(rank=last), data_parallel),
            (cw, row_wise),
            (data_parallel, lambda: table_wise(rank=0)),
            (lambda: table_wise(rank=last), lambda: table_wise(rank=last)),
        ]
        a, b = {}, {}
        for i, n in enumerate(names):
            old, new = changes[i % len(changes)]
            a[n], b[n] = old(), new()
    else:  # pragma: no cover - argparse restricts the choices
        raise ValueError(args.plan)
    return a, b


def build_plan(
    ebc: nn.Module,
    generators: Dict[str, Any],
    sharder: Any,
    world_size: int,
    local_size: int,
    device: torch.device,
    kernel: str,
) -> Dict[str, Any]:
    """
    Builds an ``EmbeddingModuleShardingPlan`` with the requested compute kernel
    on every non-data-parallel table (``construct_module_sharding_plan`` alone
    picks the dense kernel unless the parameters carry an in-backward
    optimizer).
    """
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan

    plan = construct_module_sharding_plan(
        ebc,
        generators,
        sharder=sharder,
        local_size=local_size,
        world_size=world_size,
        device_type=device.type,
    )
    for name, ps in plan.items():
        if ps.sharding_type != "data_parallel":
            plan[name] = dataclasses.replace(ps, compute_kernel=kernel)
    return plan


def describe(ps: Any) -> str:
    """``table_wise [0]``-style text for a ParameterSharding."""
    return f"{ps.sharding_type} {ps.ranks}"


# --------------------------------------------------------------------------
# state gathering and loading


def gather_full_tree(
    local: Dict[str, Dict[str, Any]], pg: dist.ProcessGroup
) -> Dict[str, Dict[str, torch.Tensor]]:
    """
    Gathers a two-level dict of ShardedTensors / replicated tensors into full
    CPU tensors on every rank, with one object collective. A key may exist on
    some ranks only (a fused optimizer lists only the tables a rank holds).
    """
    packed: Dict[str, Dict[str, Any]] = {}
    for outer, inner in local.items():
        for name, t in inner.items():
            if isinstance(t, ShardedTensor):
                shards = [
                    (list(s.metadata.shard_offsets), s.tensor.detach().cpu())
                    for s in t.local_shards()
                ]
                dtype = t.metadata().tensor_properties.dtype
                packed.setdefault(outer, {})[name] = (list(t.size()), dtype, shards)
            else:
                full = t.detach().cpu().clone()
                packed.setdefault(outer, {})[name] = (
                    list(full.shape),
                    full.dtype,
                    [([0] * full.dim(), full)],
                )
    everyone: List[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, packed, group=pg)
    result: Dict[str, Dict[str, torch.Tensor]] = {}
    for rank_packed in everyone:
        for outer, inner in rank_packed.items():
            for name, (size, dtype, shards) in inner.items():
                full = result.setdefault(outer, {}).get(name)
                if full is None:
                    full = torch.zeros(size, dtype=dtype)
                    result[outer][name] = full
                for offsets, tensor in shards:
                    index = tuple(
                        slice(o, o + n) for o, n in zip(offsets, tensor.shape)
                    )
                    full[index] = tensor
    return result


def fill_from_full(t: Any, full: torch.Tensor) -> None:
    """Copies the matching slice of ``full`` into every local shard of ``t``."""
    with torch.no_grad():
        if not isinstance(t, ShardedTensor):
            t.copy_(full.to(t.device))
            return
        for s in t.local_shards():
            index = tuple(
                slice(o, o + n)
                for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes)
            )
            s.tensor.copy_(full[index].to(s.tensor.device))


def column_segments(ps: Any, cols: int) -> List[Tuple[int, int]]:
    """
    The distinct column ranges (offset, width) of a table's shards, in column
    order: one entry for row-split layouts, one per column shard for
    column-wise ones. This is how TorchRec lays out row-wise optimizer state
    (one value per row per column shard).
    """
    spec = ps.sharding_spec
    if spec is None or not getattr(spec, "shards", None):
        return [(0, cols)]
    segs = sorted(
        {(int(m.shard_offsets[1]), int(m.shard_sizes[1])) for m in spec.shards}
    )
    return segs


def convert_rowwise_state(
    full: torch.Tensor,
    rows: int,
    old_segments: List[Tuple[int, int]],
    new_segments: List[Tuple[int, int]],
) -> torch.Tensor:
    """
    Converts row-wise optimizer state (row-wise Adagrad) between column
    layouts, with the fork's rule: a new column shard inside one old shard
    takes that shard's row state; one assembled from several old column
    pieces takes their column-width-weighted mean (summed in float64, rounded
    once, so the result does not depend on the order of the pieces).
    """
    out = []
    for d0, dw in new_segments:
        pieces = []
        for j, (c0, cw) in enumerate(old_segments):
            lo, hi = max(c0, d0), min(c0 + cw, d0 + dw)
            if hi > lo:
                pieces.append((full[j * rows : (j + 1) * rows], hi - lo))
        if len(pieces) == 1 and pieces[0][1] == dw:
            out.append(pieces[0][0].clone())
            continue
        total = torch.zeros(rows, dtype=torch.float64)
        for values, width in pieces:
            total += values.to(torch.float64) * width
        out.append((total / dw).to(full.dtype))
    return torch.cat(out)


@dataclasses.dataclass
class Snapshot:
    """The full (unsharded) training state of the job at one moment."""

    weights: Dict[str, torch.Tensor]
    optimizer: Dict[str, Dict[str, torch.Tensor]]
    optimizer_iter: int
    dense: Dict[str, torch.Tensor]
    dense_optimizer: Dict[str, Any]


def _tbe_modules(module: nn.Module) -> List[nn.Module]:
    return [
        m.emb_module
        for m in module.modules()
        if hasattr(m, "emb_module") and hasattr(m.emb_module, "iter")
    ]


def take_snapshot(job: "Job", pg: dist.ProcessGroup) -> Snapshot:
    """Gathers the job's full state on every rank."""
    weights = gather_full_tree({"": dict(job.ebc.state_dict())}, pg).get("", {})
    optimizer: Dict[str, Dict[str, torch.Tensor]] = {}
    if job.kernel == "fused":
        optimizer = gather_full_tree(job.ebc.fused_optimizer.state_dict()["state"], pg)
    iters = [int(m.iter.item()) for m in _tbe_modules(job.ebc)]
    it = torch.tensor([max(iters, default=0)], device=job.device)
    dist.all_reduce(it, op=dist.ReduceOp.MAX, group=pg)
    return Snapshot(
        weights=weights,
        optimizer=optimizer,
        optimizer_iter=int(it.item()),
        dense={k: v.detach().cpu().clone() for k, v in job.dense.state_dict().items()},
        dense_optimizer=copy.deepcopy(job.dense_opt.state_dict()),
    )


def load_snapshot(
    job: "Job", snap: Snapshot, old_plan: Dict[str, Any], rows: int, cols: int
) -> None:
    """
    Loads a snapshot taken under ``old_plan`` into a job sharded with its own
    plan: weights by global coordinates, fused optimizer state likewise
    (row-wise state converted between column layouts), the step counter, the
    dense part and its optimizer.
    """
    sd = job.ebc.state_dict()
    for key, value in sd.items():
        fill_from_full(value, snap.weights[key])
    job.ebc.load_state_dict(sd)
    if job.kernel == "fused":
        osd = job.ebc.fused_optimizer.state_dict()
        for key, states in osd["state"].items():
            table = key.split(".")[1]
            for name, value in states.items():
                full = snap.optimizer.get(key, {}).get(name)
                if full is None:
                    continue  # e.g. the table was data-parallel under plan A
                if tuple(full.shape) != tuple(value.size()):
                    full = convert_rowwise_state(
                        full,
                        rows,
                        column_segments(old_plan[table], cols),
                        column_segments(job.plan[table], cols),
                    )
                fill_from_full(value, full)
        job.ebc.fused_optimizer.load_state_dict(osd)
        for m in _tbe_modules(job.ebc):
            m.iter.fill_(snap.optimizer_iter)
    job.dense.load_state_dict(snap.dense)
    job.dense_opt.load_state_dict(snap.dense_optimizer)


# --------------------------------------------------------------------------
# the job


@dataclasses.dataclass
class Job:
    """A sharded EBC, the replicated dense part and their optimizers."""

    ebc: Any  # ShardedEmbeddingBagCollection
    dense: DenseArch
    dense_opt: torch.optim.Optimizer
    emb_opt: torch.optim.Optimizer  # SGD for dense-kernel / data-parallel tables
    plan: Dict[str, Any]
    kernel: str
    device: torch.device
    features: List[str]
    lr: float

    def rebuild_emb_opt(self) -> None:
        """Points the dense embedding optimizer at the module's current params."""
        self.emb_opt = torch.optim.SGD(list(self.ebc.parameters()), lr=self.lr)

    def step(self, batch: Batch, pg: dist.ProcessGroup) -> torch.Tensor:
        """One training step; returns [local loss, global mean loss]."""
        self.dense_opt.zero_grad(set_to_none=True)
        self.emb_opt.zero_grad(set_to_none=True)
        pooled = self.ebc(batch.sparse).wait().to_dict()
        x = torch.cat([pooled[f] for f in self.features], dim=1)
        logits = self.dense(x, batch.dense)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        loss.backward()  # fused tables are updated here
        ws = dist.get_world_size(pg)
        for p in self.dense.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=pg)
                p.grad.div_(ws)
        self.dense_opt.step()
        self.emb_opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=pg)
        return torch.stack([loss.detach(), mean / ws])


def make_job(
    ebc: nn.Module,
    plan: Dict[str, Any],
    sharder: Any,
    env: Any,
    device: torch.device,
    args: argparse.Namespace,
    dense_init: Dict[str, torch.Tensor],
) -> Job:
    """Shards ``ebc`` with ``plan`` (copying its weights) and builds the job."""
    sharded = sharder.shard(ebc, plan, env, device)
    sd = sharded.state_dict()
    for key, value in sd.items():
        fill_from_full(value, ebc.state_dict()[key].detach().cpu())
    sharded.load_state_dict(sd)
    dense = DenseArch(args.num_tables * args.dim + NUM_DENSE_FEATURES).to(device)
    dense.load_state_dict(dense_init)
    job = Job(
        ebc=sharded,
        dense=dense,
        dense_opt=torch.optim.Adagrad(dense.parameters(), lr=args.lr),
        emb_opt=torch.optim.SGD([torch.zeros(1)], lr=args.lr),
        plan=dict(plan),
        kernel=args.kernel,
        device=device,
        features=[f"f{t}" for t in range(args.num_tables)],
        lr=args.lr,
    )
    job.rebuild_emb_opt()
    return job


def perturb_one_weight(job: Job) -> None:
    """Moves the first local weight of the first table by one ulp (on one rank)."""
    for value in job.ebc.state_dict().values():
        shards = (
            [s.tensor for s in value.local_shards()]
            if isinstance(value, ShardedTensor)
            else [value]
        )
        for t in shards:
            if t.numel():
                with torch.no_grad():
                    flat = t.view(-1)
                    flat[0] = torch.nextafter(flat[0], flat[0] + 1)
                return


def compare_state(a: Job, b: Job) -> List[str]:
    """Differences (on this rank) between two jobs' states; empty if equal."""
    problems: List[str] = []

    def same(x: Any, y: Any, what: str) -> None:
        if isinstance(x, ShardedTensor) != isinstance(y, ShardedTensor):
            problems.append(f"{what}: one is sharded, the other is not")
        elif isinstance(x, ShardedTensor):
            if x.metadata() != y.metadata():
                problems.append(f"{what}: shard metadata differs")
                return
            xs, ys = x.local_shards(), y.local_shards()
            if len(xs) != len(ys):
                problems.append(f"{what}: local shard count differs")
                return
            for s, t in zip(xs, ys):
                if s.metadata != t.metadata or not torch.equal(s.tensor, t.tensor):
                    problems.append(f"{what}: local shard {s.metadata} differs")
        elif x.dtype != y.dtype or not torch.equal(x, y):
            problems.append(f"{what}: values differ")

    sa, sb = a.ebc.state_dict(), b.ebc.state_dict()
    if list(sa) != list(sb):
        problems.append(f"state dict keys differ: {list(sa)} vs {list(sb)}")
    for k in sa:
        if k in sb:
            same(sa[k], sb[k], k)
    if a.kernel == "fused":
        oa = a.ebc.fused_optimizer.state_dict()["state"]
        ob = b.ebc.fused_optimizer.state_dict()["state"]
        if sorted(oa) != sorted(ob):
            problems.append("fused optimizer state keys differ")
        for k in oa:
            for name in oa[k]:
                if name not in ob.get(k, {}):
                    problems.append(f"optimizer state {k}/{name} missing")
                else:
                    same(oa[k][name], ob[k][name], f"optimizer {k}/{name}")
    for (ka, va), (_, vb) in zip(
        a.dense.state_dict().items(), b.dense.state_dict().items()
    ):
        same(va, vb, f"dense.{ka}")
    return problems


def all_true(flag: bool, pg: dist.ProcessGroup, device: torch.device) -> bool:
    """True iff ``flag`` is true on every rank."""
    t = torch.tensor([0 if flag else 1], device=device)
    dist.all_reduce(t, group=pg)
    return int(t.item()) == 0


# --------------------------------------------------------------------------
# one rank


def worker(args: argparse.Namespace) -> int:
    """Runs the demo on this rank; returns the exit status."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.resharding import reshard_module
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"[rank {rank}] %(asctime)s %(message)s", "%H:%M:%S")
    )
    LOG.handlers[:] = [handler]
    LOG.propagate = False
    LOG.setLevel(logging.INFO if (rank == 0 or args.verbose) else logging.WARNING)
    if not args.verbose:
        # Deprecation chatter from torch / torchrec / fbgemm, not about the demo.
        for category in (UserWarning, FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        for noisy in ("torchrec", "fbgemm_gpu", "torch"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        args.backend, init_method="env://", timeout=timedelta(seconds=60)
    )
    pg = dist.group.WORLD
    world_size = dist.get_world_size()
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    env = ShardingEnv.from_process_group(pg)
    t_start = time.perf_counter()
    try:
        LOG.info(
            "phase 0/5 setup: %d ranks (%s), %d tables x %d rows x dim %d, "
            "optimizer %s (%s kernel), plan %s",
            world_size,
            args.backend,
            args.num_tables,
            args.rows,
            args.dim,
            args.optimizer,
            args.kernel,
            args.plan,
        )
        tables = [
            EmbeddingBagConfig(
                name=f"t{i}",
                embedding_dim=args.dim,
                num_embeddings=args.rows,
                feature_names=[f"f{i}"],
            )
            for i in range(args.num_tables)
        ]
        torch.manual_seed(args.seed)
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        dense_init = DenseArch(args.num_tables * args.dim + NUM_DENSE_FEATURES)
        dense_state = {k: v.clone() for k, v in dense_init.state_dict().items()}
        fused_params = None
        if args.kernel == "fused":
            fused_params = {
                "optimizer": getattr(EmbOptimType, OPTIMIZERS[args.optimizer]),
                "learning_rate": args.lr,
            }
        sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
        gen_a, gen_b = plan_generators(args, world_size)
        plan_a = build_plan(
            ebc, gen_a, sharder, world_size, local_size, device, args.kernel
        )
        plan_b = build_plan(
            ebc, gen_b, sharder, world_size, local_size, device, args.kernel
        )
        delta = {t: plan_b[t] for t in plan_b if plan_b[t] != plan_a[t]}

        LOG.info("phase 1/5 shard under plan A")
        live = make_job(ebc, plan_a, sharder, env, device, args, dense_state)

        LOG.info("phase 2/5 train %d steps under plan A", args.steps_before)
        losses_before: List[float] = []
        for step in range(args.steps_before):
            losses = live.step(make_batch(args, step, rank, device), pg)
            losses_before.append(float(losses[1]))
            LOG.info("  step %3d  loss %.6f", step, losses_before[-1])

        LOG.info("phase 3/5 snapshot the full state, build the plan-B reference")
        snap = take_snapshot(live, pg)
        ref = make_job(ebc, plan_b, sharder, env, device, args, dense_state)
        load_snapshot(ref, snap, plan_a, args.rows, args.dim)
        del snap
        if args.perturb_reference:
            perturb_one_weight(ref)

        LOG.info("phase 4/5 reshard live A -> B (%d tables in the delta)", len(delta))
        dist.barrier(group=pg)
        t0 = time.perf_counter()
        report = reshard_module(live.ebc, delta, env, device)
        wall = time.perf_counter() - t0
        live.plan.update(delta)
        live.rebuild_emb_opt()
        reports: List[Any] = [None] * world_size
        dist.all_gather_object(reports, (dataclasses.asdict(report), wall), group=pg)
        problems = compare_state(live, ref)
        exact_after_reshard = all_true(not problems, pg, device)
        for p in problems[:10]:
            LOG.warning("right after the reshard: %s", p)

        LOG.info(
            "phase 5/5 train %d steps under plan B: live vs reference",
            args.steps_after,
        )
        exact_losses = True
        losses_after: List[float] = []
        for step in range(args.steps_before, args.steps_before + args.steps_after):
            a = live.step(make_batch(args, step, rank, device), pg)
            b = ref.step(make_batch(args, step, rank, device), pg)
            same = all_true(torch.equal(a, b), pg, device)
            exact_losses = exact_losses and same
            losses_after.append(float(a[1]))
            LOG.info(
                "  step %3d  live %.9f  reference %.9f  %s",
                step,
                float(a[1]),
                float(b[1]),
                "bit-identical" if same else "DIFFERENT",
            )
        problems = compare_state(live, ref)
        exact_final = all_true(not problems, pg, device)
        for p in problems[:10]:
            LOG.warning("after training: %s", p)
        exact = exact_after_reshard and exact_losses and exact_final

        if rank == 0:
            print_report(
                args,
                world_size,
                plan_a,
                plan_b,
                reports,
                losses_before,
                losses_after,
                exact_after_reshard,
                exact_losses,
                exact_final,
                time.perf_counter() - t_start,
            )
        dist.barrier(group=pg)
        return 0 if exact else 1
    finally:
        dist.destroy_process_group()


def print_report(
    args: argparse.Namespace,
    world_size: int,
    plan_a: Dict[str, Any],
    plan_b: Dict[str, Any],
    reports: List[Any],
    losses_before: List[float],
    losses_after: List[float],
    exact_after_reshard: bool,
    exact_losses: bool,
    exact_final: bool,
    seconds: float,
) -> None:
    """Prints the rank-0 summary."""
    out: List[str] = []
    out.append("")
    out.append("=" * 72)
    out.append(
        f"Live reshard report  (plan '{args.plan}', {world_size} ranks, "
        f"{args.backend}, optimizer {args.optimizer}, {args.kernel} kernel)"
    )
    out.append("-" * 72)
    out.append(f"{'table':<8}{'plan A':<30}{'plan B':<30}moved")
    moved = sorted(
        {t for r, _ in reports for t in r["tables_moved"]},
        key=lambda t: int(t[1:]),
    )
    for t in plan_a:
        out.append(
            f"{t:<8}{describe(plan_a[t]):<30}{describe(plan_b[t]):<30}"
            f"{'yes' if t in moved else '-'}"
        )
    out.append(f"tables moved: {', '.join(moved) if moved else 'none'}")
    kept = sorted(
        {t for r, _ in reports for t in r["tables_kept_in_place"]} - set(moved),
        key=lambda t: int(t[1:]),
    )
    copied = sorted(
        {t for r, _ in reports for t in r["tables_rebuilt"]} - set(moved) - set(kept),
        key=lambda t: int(t[1:]),
    )
    if kept:
        out.append(
            "tables not moved, in a rebuilt group, kept in place (not copied): "
            + ", ".join(kept)
        )
    if copied:
        out.append(
            "tables not moved but rebuilt with their group (copied locally): "
            + ", ".join(copied)
        )
    out.append(
        f"{'rank':<6}{'sent B':>12}{'received B':>12}{'local copy B':>14}"
        f"{'kept B':>12}{'released B':>12}{'reshard s':>11}"
    )
    for r, wall in reports:
        out.append(
            f"{r['rank']:<6}{r['bytes_sent']:>12}{r['bytes_received']:>12}"
            f"{r['bytes_copied_locally']:>14}{r['bytes_kept_in_place']:>12}"
            f"{r['bytes_released']:>12}{wall:>11.4f}"
        )
    out.append(
        f"reshard time (slowest rank): {max(w for _, w in reports):.4f} s; "
        f"total bytes over the wire: {sum(r['bytes_sent'] for r, _ in reports)}"
    )

    def fmt(xs: List[float], i: int) -> str:
        return f"{xs[i]:.6f}" if xs else "n/a"

    out.append(
        f"loss: first step {fmt(losses_before, 0)}, last before reshard "
        f"{fmt(losses_before, -1)}, first after {fmt(losses_after, 0)}, "
        f"last {fmt(losses_after, -1)}"
    )
    out.append(
        f"state right after the reshard equals plan-B reference: "
        f"{'yes' if exact_after_reshard else 'NO'}"
    )
    out.append(
        f"losses bit-identical for all {len(losses_after)} steps after: "
        f"{'yes' if exact_losses else 'NO'}"
    )
    out.append(
        f"final state dicts (weights + optimizer state) equal: "
        f"{'yes' if exact_final else 'NO'}"
    )
    exact = exact_after_reshard and exact_losses and exact_final
    out.append(
        f"training continues exactly as the reference: {'YES' if exact else 'NO'}"
    )
    out.append(f"total run time: {seconds:.1f} s")
    out.append("=" * 72)
    print("\n".join(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Live resharding demo: a DLRM (``DLRMTrain``) under ``DistributedModelParallel``
trains with ``TrainPipelineSparseDist`` on the planner's plan A. Then the load
shifts (two tables get hot, another one busier), the planner makes plan B,
``dry_run`` shows what would move, and ``model.reshard(plan_b)`` moves the
tables while the job runs; the same pipeline trains on. Finally a reference
sharded directly with plan B, loaded with the state gathered right before the
reshard, trains on the same batches: the losses and the final weights and
optimizer state must be equal, bit for bit.

Without RANK/WORLD_SIZE in the environment it spawns --world-size ranks here
(gloo on CPU by default; --backend nccl uses cuda:LOCAL_RANK); under torchrun
it runs as torchrun's ranks::

    python examples/live_reshard_demo.py
    torchrun --standalone --nproc-per-node 2 examples/live_reshard_demo.py

With ``--rebalance`` nobody types the shift in: the batches after step
``--steps-before`` simply carry the new load, a ``Rebalancer`` measures it,
asks the planner of plan A for a plan under the measured load, relabels it to
keep the most bytes in place and reshards when the policy says it pays; a
second model then applies the same plans by hand at the same steps, and the
losses and final state must be equal, bit for bit.

Exit status (of every rank): 0 exact, 1 a difference, 2 any other failure.
"""

import argparse
import logging
import os
import socket
import sys
import traceback
import warnings
from datetime import timedelta
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.nn.parallel import DistributedDataParallel
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Topology,
)
from torchrec.distributed.resharding import (
    dry_run,
    MoveOptions,
    RebalancePolicy,
    Rebalancer,
    ReplanOptions,
    ReshardOptions,
    TransactionReport,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

EBC = "model.sparse_arch.embedding_bag_collection"
DENSE_IN = 4
OPTIMIZERS: Dict[str, EmbOptimType] = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}
# A table's shard in its weight: first row, first column, rows, columns.
Rect = Tuple[int, int, int, int]
# The state gathered before the reshard: full weights by state-dict key, and
# full fused optimizer state by (weight key, state name), as float64.
FullState = Tuple[Dict[str, torch.Tensor], Dict[Tuple[str, str], torch.Tensor]]
INT_OPTIONS: List[Tuple[str, int, str]] = [
    ("--world-size", 2, "ranks to spawn when not under torchrun"),
    ("--num-tables", 4, "embedding tables, at least 3"),
    ("--rows", 1000, "rows per table"),
    ("--dim", 16, "embedding dimension, a multiple of 8"),
    ("--batch-size", 32, "samples per rank and step"),
    ("--steps-before", 5, "steps under plan A"),
    ("--steps-after", 5, "steps under plan B"),
    ("--timeout", 60, "seconds any rank waits for the others"),
]


def parse_args() -> argparse.Namespace:
    """Returns the command line options."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad")
    for flag, default, text in INT_OPTIONS:
        p.add_argument(flag, type=int, default=default, help=f"{text} ({default})")
    p.add_argument("--progress", action="store_true", help="reshard progress bar")
    p.add_argument(
        "--rebalance",
        action="store_true",
        help="measure the shift and let a Rebalancer reshard (window 2 steps)",
    )
    p.add_argument("--verbose", action="store_true", help="show library warnings")
    p.add_argument(
        "--perturb-reference",
        action="store_true",
        help="move the reference's t0 up by one ulp: the check must say NO (exit 1)",
    )
    args = p.parse_args()
    if args.num_tables < 3 or args.dim % 8 or args.world_size < 1:
        p.error("need --num-tables >= 3, --dim a multiple of 8, --world-size >= 1")
    if min(args.steps_before, args.steps_after) < 1:
        p.error("need at least one step before and one after the reshard")
    return args


def say(msg: str) -> None:
    """Prints on rank 0 only."""
    if dist.get_rank() == 0:
        print(msg, flush=True)


def build_dlrm(args: argparse.Namespace, device: torch.device) -> DLRMTrain:
    """
    The DLRM on ``device`` ("meta" for the planner): ``--num-tables`` tables
    ``t{i}`` of ``--rows`` x ``--dim``, one feature ``f{i}`` each. Seed 0
    first, so that every rank builds the same weights.
    """
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name=f"t{i}",
                feature_names=[f"f{i}"],
                num_embeddings=args.rows,
                embedding_dim=args.dim,
            )
            for i in range(args.num_tables)
        ],
        device=device,
    )
    dlrm = DLRM(ebc, DENSE_IN, [args.dim], [8, 1], dense_device=device)
    return DLRMTrain(dlrm)


def shifted_ids(args: argparse.Namespace) -> Dict[str, float]:
    """Mean ids per sample after the shift: t0 20, t1 8, the last table 30."""
    ids = {f"t{i}": 2.0 for i in range(args.num_tables)}
    ids.update(t0=20.0, t1=8.0)
    ids[f"t{args.num_tables - 1}"] = 30.0
    return ids


def make_batches(args: argparse.Namespace, rank: int) -> List[Batch]:
    """
    Each rank's own synthetic batches; the label depends on the dense input.
    With ``--rebalance`` the batches after the shift carry the shifted load.
    """
    gen = torch.Generator().manual_seed(1000 + rank)
    n, b = args.num_tables, args.batch_size
    batches = []
    for step in range(args.steps_before + args.steps_after):
        if args.rebalance and step >= args.steps_before:
            lengths = torch.cat(
                [
                    torch.randint(0, int(2 * ids) + 1, (b,), generator=gen)
                    for ids in shifted_ids(args).values()
                ]
            )
        else:
            lengths = torch.randint(0, 4, (n * b,), generator=gen)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=gen)
        dense = torch.randn(b, DENSE_IN, generator=gen)
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(n)], values=values, lengths=lengths
        )
        batches.append(Batch(dense, sparse, (dense.sum(dim=1) > 0).long()))
    return batches


def make_plan(
    args: argparse.Namespace, sharder: EmbeddingBagCollectionSharder, shifted: bool
) -> ShardingPlan:
    """
    The planner's plan for the load (rank 0 plans, every rank gets it). Before
    the shift every table is table-wise with 2 ids per sample. After it, t0 (20
    ids) and t1 (8 ids) are hot and must spread over column shards, and the
    last table's traffic grew to 30 ids.
    """
    return make_planner(args, shifted).collective_plan(
        build_dlrm(args, torch.device("meta")), [sharder], dist.group.WORLD
    )


def make_topology(args: argparse.Namespace) -> Topology:
    """The job's topology."""
    return Topology(
        world_size=dist.get_world_size(),
        compute_device="cuda" if args.backend == "nccl" else "cpu",
        local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]),
    )


def make_constraints(
    args: argparse.Namespace, shifted: bool
) -> Dict[str, ParameterConstraints]:
    """The constraints of the declared load (see ``make_plan``)."""
    load = {f"t{i}": ("table_wise", 2.0) for i in range(args.num_tables)}
    if shifted:
        ids = shifted_ids(args)
        load.update(t0=("column_wise", ids["t0"]), t1=("table_column_wise", ids["t1"]))
        last = f"t{args.num_tables - 1}"
        load[last] = ("table_wise", ids[last])
    return {
        table: ParameterConstraints(
            sharding_types=[kind],
            compute_kernels=["fused"],
            pooling_factors=[ids],
            min_partition=args.dim // 2,
        )
        for table, (kind, ids) in load.items()
    }


def make_planner(args: argparse.Namespace, shifted: bool) -> EmbeddingShardingPlanner:
    """The planner for the declared load (see ``make_plan``)."""
    return EmbeddingShardingPlanner(
        topology=make_topology(args),
        batch_size=args.batch_size,
        constraints=make_constraints(args, shifted),
        stats=[],
        debug=False,
    )


def describe(plan: ShardingPlan) -> str:
    """One line per table: sharding type and ranks."""
    return "\n".join(
        f"    {t}: {ps.sharding_type} on ranks {ps.ranks}"
        for t, ps in plan.plan[EBC].items()
    )


def build_model(
    args: argparse.Namespace,
    sharder: EmbeddingBagCollectionSharder,
    plan: ShardingPlan,
    device: torch.device,
) -> Tuple[DistributedModelParallel, CombinedOptimizer]:
    """The model sharded with ``plan``, its optimizer (fused + dense SGD)."""
    model = DistributedModelParallel(
        build_dlrm(args, torch.device("cpu")),
        device=device,
        plan=plan,
        sharders=[sharder],
    )
    for ddp in model.modules():  # the dense part's DistributedDataParallel
        if isinstance(ddp, DistributedDataParallel):
            ddp.register_comm_hook(None, all_reduce_each_gradient)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def all_reduce_each_gradient(
    state: None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """
    A DDP comm hook that all-reduces every gradient of the bucket on its own.
    With more than 2 ranks the rounding of an all-reduce depends on where a
    value lies in the buffer, and DDP repacks its buckets after the first
    steps: without this hook a fresh reference would differ from the running
    model in the last bits of the dense part, reshard or not.
    """
    for grad in bucket.gradients():  # views into bucket.buffer()
        dist.all_reduce(grad)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer().div_(dist.get_world_size()))
    return future


def everywhere(flag: bool, device: torch.device) -> bool:
    """True iff ``flag`` holds on every rank."""
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def sharded_pieces(
    model: nn.Module,
) -> Iterator[Tuple[Tuple[str, str], Tuple[int, int], Rect, torch.Tensor]]:
    """
    This rank's pieces of every sharded table, weights and fused optimizer
    state alike: (name, the table's shape, the piece's rectangle in the table,
    the local tensor). A weight is named (state-dict key, ""), its optimizer
    state (state-dict key, state name). A row-wise state (one value per row of
    a shard) is a piece of as many values as its rectangle has rows.

    Args:
        model (nn.Module): the sharded model.

    Returns:
        Iterator[Tuple[Tuple[str, str], Tuple[int, int], Rect, torch.Tensor]]:
        the pieces.
    """
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            for piece in value.local_shards():
                rect = (*piece.metadata.shard_offsets, *piece.metadata.shard_sizes)
                yield (key, ""), tuple(value.size()), rect, piece.tensor
    optimizer = model.fused_optimizer
    state = optimizer.state_dict()["state"]
    for key, weight in optimizer.params.items():
        if not isinstance(weight, ShardedTensor):
            continue
        rects = [
            (*piece.metadata.shard_offsets, *piece.metadata.shard_sizes)
            for piece in weight.local_shards()
        ]
        for name, value in state.get(key, {}).items():
            if isinstance(value, ShardedTensor):
                for rect, piece in zip(rects, value.local_shards()):
                    yield (key, name), tuple(weight.size()), rect, piece.tensor


def gather_state(model: nn.Module) -> FullState:
    """
    Every table's full weight and fused optimizer state, on every rank: each
    rank writes its pieces into zeros, and a sum over the ranks assembles
    them (each element has one owner). A row-wise state is spread over its
    shard's columns, so that a shard of another width can take it back.

    Args:
        model (nn.Module): the sharded model.

    Returns:
        FullState: the weights (in their dtype; what is not sharded as it is)
        and the optimizer state.
    """
    pieces = list(sharded_pieces(model))
    shapes: List[Dict[Tuple[str, str], Tuple[int, int]]] = [{}] * dist.get_world_size()
    # every rank sums every table, a rank without a piece of it too
    dist.all_gather_object(shapes, {name: shape for name, shape, _, _ in pieces})
    full = {
        name: torch.zeros(shape, dtype=torch.float64)
        for rank_shapes in shapes
        for name, shape in rank_shapes.items()
    }
    for name, _, (row, col, rows, cols), tensor in pieces:
        full[name][row : row + rows, col : col + cols] = tensor.reshape(rows, -1)
    for name in sorted(full):
        dist.all_reduce(full[name])
    weights = {
        key: (
            full[(key, "")].to(value.metadata().tensor_properties.dtype)
            if isinstance(value, ShardedTensor)
            else value.detach().clone()
        )
        for key, value in model.state_dict().items()
    }
    return weights, {name: t for name, t in full.items() if name[1]}


def load_state(model: nn.Module, state: FullState) -> None:
    """
    Loads what ``gather_state`` gathered into ``model``, sharded with any plan:
    the weights through ``load_state_dict``, every local piece of the fused
    optimizer state from its rectangle (a row-wise state takes the mean of
    its rows).

    Args:
        model (nn.Module): the sharded model.
        state (FullState): the weights and the optimizer state.

    Returns:
        None
    """
    weights, optimizer_state = state
    model.load_state_dict(weights)
    with torch.no_grad():
        for name, _, (row, col, rows, cols), tensor in sharded_pieces(model):
            if name in optimizer_state:
                values = optimizer_state[name][row : row + rows, col : col + cols]
                if tensor.numel() == rows:
                    values = values.mean(dim=1)
                tensor.copy_(values.reshape(tensor.shape))


def state_tensors(model: nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """
    This rank's state of ``model``, labelled: its pieces of the tables'
    weights and fused optimizer state (in order of name and rectangle), then
    what its state dict holds unsharded (the dense part), then each table's
    learning rate.

    Args:
        model (nn.Module): the sharded model.

    Returns:
        List[Tuple[str, torch.Tensor]]: (label, tensor) pairs.
    """
    pieces = sorted(sharded_pieces(model), key=lambda piece: (piece[0], piece[2]))
    labelled = [
        (f"{' '.join(filter(None, name))} at {rect}", tensor)
        for name, _, rect, tensor in pieces
    ]
    for key, value in model.state_dict().items():
        if not isinstance(value, ShardedTensor):
            labelled.append((key, value))
    # each table's learning rate, whichever kernel group it is in now
    optimizer = model.fused_optimizer
    rates = {}
    for key, param in optimizer.params.items():
        for group in optimizer.param_groups:
            if any(param is p for p in group["params"]):
                rates[key] = float(group["lr"])
    for key in sorted(rates):
        labelled.append((f"{key} learning rate", torch.tensor(rates[key])))
    return labelled


def first_difference(a: nn.Module, b: nn.Module) -> str:
    """
    Where two models' states differ on this rank ("" where they hold the same
    pieces, with the same dtypes and values, bit for bit).

    Args:
        a (nn.Module): the model.
        b (nn.Module): the one it is compared with.

    Returns:
        str: the first difference, or "".
    """
    xs, ys = state_tensors(a), state_tensors(b)
    if [label for label, _ in xs] != [label for label, _ in ys]:
        return "the models hold other pieces of the tables"
    for (label, x), (_, y) in zip(xs, ys):
        if x.dtype != y.dtype or not torch.equal(x, y):
            return f"{label} differs"
    return ""


def same_state(a: nn.Module, b: nn.Module, device: torch.device) -> bool:
    """
    Whether ``a`` and ``b`` hold bit-identical weights and fused optimizer
    state on every rank; a rank where they differ says how.

    Args:
        a (nn.Module): the model.
        b (nn.Module): the one it is compared with.
        device (torch.device): this rank's device (for the vote).

    Returns:
        bool: the same on every rank.
    """
    difference = first_difference(a, b)
    if difference:
        print(f"rank {dist.get_rank()}: state differs: {difference[:200]}", flush=True)
    return everywhere(not difference, device)


def set_up(
    args: argparse.Namespace, phases: int, story: str
) -> Tuple[EmbeddingBagCollectionSharder, List[Batch]]:
    """
    Phase 0 of a demo: says the set-up, then makes the tables' sharder (with
    the fused ``--optimizer``) and this rank's batches.

    Args:
        args (argparse.Namespace): the demo's options.
        phases (int): the demo's last phase.
        story (str): the end of the set-up line.

    Returns:
        Tuple[EmbeddingBagCollectionSharder, List[Batch]]: the sharder and the
        batches.
    """
    say(
        f"phase 0/{phases} setup: {dist.get_world_size()} ranks ({args.backend}), "
        f"DLRM with {args.num_tables} tables x {args.rows} rows x dim {args.dim}"
        + story
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": OPTIMIZERS[args.optimizer], "learning_rate": 0.05}
    )
    return sharder, make_batches(args, dist.get_rank())


def matches_reference(
    args: argparse.Namespace,
    sharder: EmbeddingBagCollectionSharder,
    model: DistributedModelParallel,
    live_losses: List[torch.Tensor],
    state: FullState,
    batches: List[Batch],
    device: torch.device,
) -> bool:
    """
    A reference sharded directly with the model's (new) plan, loaded with
    ``state`` (weights, fused optimizer state), trains on ``batches`` with a
    plain loop (the pipeline's order of operations). True iff, on every rank,
    every loss and the final weights and optimizer state are bit-identical.
    """
    reference, optimizer = build_model(args, sharder, model.plan, device)
    if args.perturb_reference:
        table = state[0][f"{EBC}.embedding_bags.t0.weight"]
        table.copy_(torch.nextafter(table, table + 1))  # one ulp up, every row
    load_state(reference, state)
    exact = True
    for step, (batch, live) in enumerate(zip(batches, live_losses), args.steps_before):
        optimizer.zero_grad()
        loss, _ = reference(batch.to(device))
        loss.backward()
        optimizer.step()
        same = everywhere(torch.equal(live, loss.detach()), device)
        exact = exact and same
        say(
            f"    step {step}  loss (rank 0) {live.item():.9f}  "
            f"reference {loss.item():.9f}  {'bit-identical' if same else 'DIFFERENT'}"
        )
    return same_state(model, reference, device) and exact


def demo(args: argparse.Namespace, device: torch.device) -> int:
    """The user's story on this rank; returns the exit status."""
    sharder, batches = set_up(
        args, 5, f", fused {args.optimizer} for the tables, SGD for the dense part"
    )
    stream = iter(batches)

    plan_a = make_plan(args, sharder, shifted=False)
    say("phase 1/5 plan A from the planner:\n" + describe(plan_a))
    model, optimizer = build_model(args, sharder, plan_a, device)
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    for step in range(args.steps_before):
        loss = pipeline.progress(stream)[0]
        say(f"    step {step}  loss (rank 0) {loss.item():.6f}")

    plan_b = make_plan(args, sharder, shifted=True)
    say(
        f"phase 2/5 the load shifts (t0, t1 hot, t{args.num_tables - 1} busier); "
        "plan B from the planner:\n" + describe(plan_b)
    )

    preview = dry_run(model, plan_b)  # moves nothing
    for path, tables in preview.tables_moved.items():
        say(f"phase 3/5 dry run: {path} would move {', '.join(tables)}")
    for r in sorted(preview.bytes_sent_by_rank):
        say(
            f"    rank {r}: would send {preview.bytes_sent_by_rank[r]} B, "
            f"receive {preview.bytes_received_by_rank.get(r, 0)} B"
        )

    # Full weights and fused optimizer state, for the reference, right before.
    state = gather_state(model)
    options = ReshardOptions(
        exchange_timeout=timedelta(seconds=args.timeout), progress=args.progress
    )
    report = model.reshard(plan_b, options)
    reports: List[TransactionReport] = [report] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    moved = sorted({t for r in reports for ts in r.tables_moved.values() for t in ts})
    say(f"phase 4/5 resharded live: tables moved: {', '.join(moved) or 'none'}")
    for r in reports:
        say(
            f"    rank {r.rank}: sent {r.bytes_sent} B, received {r.bytes_received} B "
            f"in {r.seconds:.3f} s"
        )

    say(f"phase 5/5 train {args.steps_after} more steps with the same pipeline")
    live = [pipeline.progress(stream)[0].detach() for _ in range(args.steps_after)]
    remaining = batches[args.steps_before :]
    exact = matches_reference(args, sharder, model, live, state, remaining, device)
    say(f"training continues exactly as the reference: {'YES' if exact else 'NO'}")
    dist.barrier()  # no rank exits (and gets the others stopped) before that line
    return 0 if exact else 1


def rebalance_demo(args: argparse.Namespace, device: torch.device) -> int:
    """``--rebalance``: the shift is measured and the Rebalancer reshards."""
    sharder, batches = set_up(
        args,
        4,
        f"; the load shifts after step {args.steps_before} (nobody tells the job)",
    )
    planner = make_planner(args, shifted=False)
    plan_a = planner.collective_plan(
        build_dlrm(args, torch.device("meta")), [sharder], dist.group.WORLD
    )
    say("phase 1/4 plan A from the planner:\n" + describe(plan_a))
    model, optimizer = build_model(args, sharder, plan_a, device)
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    options = ReshardOptions(
        exchange_timeout=timedelta(seconds=args.timeout), progress=args.progress
    )
    # A demo of the loop on tiny tables: the lookups are a sliver of a step,
    # so any predicted gain counts (a real job keeps the default 10%).
    policy = RebalancePolicy(
        window=2, min_gain=0.0, hysteresis=1, min_interval=2, horizon=10**4
    )
    rebalancer = Rebalancer(
        model,
        make_topology(args),
        policy,
        replan=ReplanOptions(
            batch_size=args.batch_size,
            constraints=make_constraints(args, shifted=False),
        ),
        moves=MoveOptions(reshard=options),
    )
    say(f"phase 2/4 train with the Rebalancer ({policy})")
    stream = iter(batches)
    live = []
    for step in range(1, len(batches) + 1):
        live.append(pipeline.progress(stream)[0].detach())
        decision = rebalancer.step()
        say(f"    step {step}  loss (rank 0) {live[-1].item():.6f}")
        if decision is not None:
            say(f"    decision: {decision.line()}")
            if decision.action == "reshard":
                say("    new plan:\n" + describe(model.plan))
    rebalancer.close()
    reshards = {d.step: d.plan for d in rebalancer.history if d.action == "reshard"}
    if not reshards:
        say("the Rebalancer did not reshard: give it more --steps-after")
        return 1
    say(
        "phase 3/4 a second model applies the same plans by hand at steps "
        f"{sorted(reshards)}"
    )
    replay, replay_optimizer = build_model(args, sharder, plan_a, device)
    replay_pipeline = TrainPipelineSparseDist(replay, replay_optimizer, device)
    stream = iter(batches)
    exact = True
    for step in range(1, len(batches) + 1):
        loss = replay_pipeline.progress(stream)[0].detach()
        exact = everywhere(torch.equal(loss, live[step - 1]), device) and exact
        if step in reshards:
            replay.reshard(reshards[step], options)
    exact = same_state(model, replay, device) and exact
    say(
        "phase 4/4 the rebalanced run equals the plans applied by hand (losses, "
        f"weights, optimizer state): {'YES' if exact else 'NO'}"
    )
    dist.barrier()
    return 0 if exact else 1


def run_rank(args: argparse.Namespace) -> int:
    """Joins the process group and runs the demo; exit status 2 on a failure."""
    torch.set_num_threads(1)
    if not args.verbose:  # deprecation notes from torch and fbgemm
        warnings.simplefilter("ignore")
        logging.getLogger("torch").setLevel(logging.ERROR)
    try:
        device, backend = torch.device("cpu"), "gloo"
        if args.backend == "nccl":  # the check gathers CPU tensors: gloo for those
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            backend = "cpu:gloo,cuda:nccl"
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
        return rebalance_demo(args, device) if args.rebalance else demo(args, device)
    except Exception:
        traceback.print_exc()
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawned(rank: int, args: argparse.Namespace) -> None:
    """One spawned rank: the rest of torchrun's environment, then the demo."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    status = run_rank(args)
    # The outcome is printed and the process group destroyed: leave without the
    # interpreter's teardown. In it, torch's C++ objects are destroyed in no
    # set order, and once in a while (1 CI run of many, after every rank had
    # printed its result) one aborted the rank ("terminate called without an
    # active exception"), which made spawn report a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main() -> int:
    """Runs under torchrun's ranks, or spawns ``--world-size`` local ones."""
    args = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
        return run_rank(args)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("localhost", 0))
        port = str(s.getsockname()[1])
    size = str(args.world_size)
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=port)
    os.environ.update(WORLD_SIZE=size, LOCAL_WORLD_SIZE=size)
    try:
        mp.spawn(spawned, args=(args,), nprocs=args.world_size)
    except mp.ProcessExitedException as e:  # a rank returned 1 or 2
        return 1 if e.exit_code == 1 else 2
    except mp.ProcessRaisedException:  # printed by the rank
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Surviving a lost rank: four ranks train a DLRM under
``DistributedModelParallel``; in the middle of a step one of them is killed
(SIGKILL, as a lost host would vanish); the three others notice, agree on who
is left, restore its tables from the best source (a buddy's snapshot, else
the last checkpoint; a data-parallel table from the survivors' replicas),
and train on, with no restart. The timeline is printed as it happens, then
each recovery's report.

Only the public API: ``torchrec`` (the DLRM, the sharder, the plan helpers,
``DistributedModelParallel``), ``torch.distributed`` and
``torchrec.distributed.resharding.fault`` (``FaultTolerance``,
``FaultOptions``). The loop is::

    ft = FaultTolerance(model, optimizer, make_optimizer, options)
    for step in range(steps):
        ft.step(lambda model, optimizer: train_step(model, optimizer, batch))

The job's store must outlive any worker: this script is its own launcher, as
a launcher's agent would: it hosts the store (a ``TCPStore`` server) and
starts the ranks, and it does not stop the others when one dies (torchrun's
agent would; see docs/faults.md)::

    python examples/fault_tolerance_demo.py
    python examples/fault_tolerance_demo.py --source checkpoint --kill-at backward
    python examples/fault_tolerance_demo.py --pipeline   # TrainPipelineSparseDist

Exit status: 0 when every survivor finished its steps, else 1.
"""

import argparse
import logging
import multiprocessing
import os
import signal
import sys
import time
import warnings
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.resharding.fault import (
    FaultOptions,
    FaultTolerance,
    FaultToleranceError,
)
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import (
    CombinedOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
)
from torchrec.optim.optimizers import in_backward_optimizer_filter

TABLES = 6
BATCH_SIZE = 32
DENSE_IN = 8


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--victim", type=int, default=3, help="the rank killed")
    p.add_argument("--kill-step", type=int, default=6, help="the step it dies in")
    p.add_argument(
        "--kill-at",
        choices=("forward", "backward", "optimizer"),
        default="forward",
        help="where in the step",
    )
    p.add_argument("--steps", type=int, default=12, help="steps in all")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument(
        "--source",
        choices=("snapshot", "checkpoint"),
        default="snapshot",
        help="the source of the lost shards (replicas always serve)",
    )
    p.add_argument("--snapshot-every", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=4)
    p.add_argument("--checkpoint-dir", default="/tmp/torchrec_fault_demo")
    p.add_argument("--collective-timeout", type=float, default=5.0)
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="train with TrainPipelineSparseDist (rebuilt on the recovered "
        "model; its batches in flight are dropped); the kill is then before "
        "the step",
    )
    p.add_argument("--deadline", type=float, default=300.0, help="seconds")
    return p.parse_args(argv)


def say(start: float, rank: int, message: str) -> None:
    print(f"{time.time() - start:7.2f}s  rank {rank}: {message}", flush=True)


# --------------------------------------------------------------- the model


def build(args: argparse.Namespace) -> DLRMTrain:
    """A DLRM of TABLES tables, the same on every rank (seeded)."""
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=args.dim,
            num_embeddings=args.rows,
            feature_names=[f"f{i}"],
        )
        for i in range(TABLES)
    ]
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(
                tables, device=torch.device("cpu")
            ),
            dense_in_features=DENSE_IN,
            dense_arch_layer_sizes=[32, args.dim],
            over_arch_layer_sizes=[32, 1],
        )
    )


def sharder() -> EmbeddingBagCollectionSharder:
    """Fused row-wise Adagrad for the tables."""
    return EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": 0.05,
            "eps": 0.01,
        }
    )


def plan(model: DLRMTrain, world_size: int) -> ShardingPlan:
    """Data-parallel, table-wise, column-wise and row-wise tables."""
    last = world_size - 1
    ebc = model.model.sparse_arch.embedding_bag_collection
    module_plan = construct_module_sharding_plan(
        ebc,
        {
            "t0": data_parallel(),
            "t1": table_wise(rank=0),
            "t2": table_wise(rank=1 % world_size),
            "t3": column_wise(ranks=[last, 0]),
            "t4": row_wise(),
            "t5": table_wise(rank=last),
        },
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    for ps in module_plan.values():
        if ps.sharding_type != ShardingType.DATA_PARALLEL.value:
            # the fused optimizer's state lives with the shards it moves with
            ps.compute_kernel = EmbeddingComputeKernel.FUSED.value
    return ShardingPlan({"model.sparse_arch.embedding_bag_collection": module_plan})


def make_pipeline(model: nn.Module, optimizer: Any) -> TrainPipelineSparseDist:
    """A pipeline over the model, its fused and its dense optimizer."""
    return TrainPipelineSparseDist(
        model,
        CombinedOptimizer([model.fused_optimizer, optimizer]),
        torch.device("cpu"),
    )


def make_optimizer(model: nn.Module) -> KeyedOptimizer:
    """Adam for what the fused kernels do not train."""
    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=0.01),
    )


# ------------------------------------------------------------------ a rank


def run_rank(rank: int, args: argparse.Namespace, port: int, start: float) -> int:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for noisy in ("torchrec", "torch", "fbgemm_gpu"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.collective_timeout),
    )
    definition = build(args)
    model = DistributedModelParallel(
        build(args),
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=plan(definition, args.world_size),
        sharders=[sharder()],
    )
    model.load_state_dict(definition.state_dict())  # sharding does not copy
    options = FaultOptions(
        heartbeat_interval=timedelta(milliseconds=100),
        heartbeat_timeout=timedelta(seconds=args.heartbeat_timeout),
        collective_timeout=timedelta(seconds=args.collective_timeout),
        sources=("replica", args.source),
        snapshot_every=args.snapshot_every if args.source == "snapshot" else 0,
    )
    pipelined = make_pipeline if args.pipeline else None
    ft = FaultTolerance(
        model, make_optimizer(model), make_optimizer, options, make_pipeline=pipelined
    )
    data = iter(
        RandomRecDataset(
            keys=[f"f{i}" for i in range(TABLES)],
            batch_size=BATCH_SIZE,
            hash_size=args.rows,
            ids_per_feature=2,
            num_dense=DENSE_IN,
            manual_seed=rank,
        )
    )

    def die(where: str) -> None:
        say(start, rank, f"killed (SIGKILL) in the {where} of step {step}")
        os.kill(os.getpid(), signal.SIGKILL)

    def train_step(model: nn.Module, optimizer: Any) -> torch.Tensor:
        victim = rank == args.victim and step == args.kill_step
        if victim and args.kill_at == "forward":
            die("forward")
        if ft.pipeline is not None:  # the pipeline draws its own batches
            loss, _, _ = ft.pipeline.progress(data)  # (loss, logits, labels)
            return loss
        optimizer.zero_grad()
        loss, _ = model(batch)
        if victim and args.kill_at == "backward":
            loss.register_hook(lambda grad: die("backward"))
        loss.backward()
        if victim and args.kill_at == "optimizer":
            die("optimizer step")
        optimizer.step()
        return loss.detach()

    seen = 0
    try:
        while ft.steps < args.steps:
            step = ft.steps
            if ft.pipeline is None:
                batch = next(data)
            loss = ft.step(train_step)
            if len(ft.reports) > seen:
                seen = len(ft.reports)
                report = ft.reports[-1]
                if rank == ft.members[0]:
                    say(start, rank, f"recovered:\n{report.timeline()}")
                continue
            if rank == ft.members[0]:
                say(
                    start,
                    rank,
                    f"step {step}: loss {float(loss):.4f} on {list(ft.members)}",
                )
            if args.source == "checkpoint" and ft.steps % args.checkpoint_every == 0:
                ft.save_checkpoint(os.path.join(args.checkpoint_dir, str(ft.steps)))
                if rank == ft.members[0]:
                    say(start, rank, f"checkpoint after step {ft.steps - 1}")
    except FaultToleranceError as e:
        say(start, rank, f"stopped: {e}")
        return 1
    if rank == ft.members[0]:
        for report in ft.reports:
            say(
                start,
                rank,
                f"first step after the recovery {report.first_step_seconds:.3f} s "
                "after noticing the loss",
            )
    ft.close()
    return 0


def _spawned(rank: int, args: argparse.Namespace, port: int, start: float) -> None:
    os._exit(run_rank(rank, args, port, start))  # peers may be gone: no teardown


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    start = time.time()
    # the job's store, hosted by the launcher: it outlives any rank
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False
    )
    print(
        f"{args.world_size} gloo ranks; rank {args.victim} dies in the "
        f"{args.kill_at} of step {args.kill_step}; lost shards from the "
        f"{args.source}, data-parallel tables from the replicas",
        flush=True,
    )
    ctx = multiprocessing.get_context("spawn")
    processes = [
        ctx.Process(target=_spawned, args=(rank, args, store.port, start))
        for rank in range(args.world_size)
    ]
    for p in processes:
        p.start()
    deadline = time.monotonic() + args.deadline
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in processes]
    print(f"exit codes: {codes}", flush=True)
    survivors = [c for r, c in enumerate(codes) if r != args.victim]
    return 0 if all(c == 0 for c in survivors) else 1


if __name__ == "__main__":
    sys.exit(main())

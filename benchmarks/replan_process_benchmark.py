#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Benchmark of the full replan off the training process (issue 34): what a
running replan costs the steps of the process that trains.

One process trains a ``--tables``-table ``EmbeddingBagCollection`` and an
MLP with SGD (one intra-op thread) in blocks of ``--block`` steps. Three
modes take turns block by block (the order rotates each round), so each
sees the same moments of a shared machine:

* ``none``     no replan;
* ``thread``   TorchRec's planner plans ``--plan-tables`` tables on
  ``--plan-ranks`` ranks in a thread of this process
  (``replan.ThreadReplanner``, what ``BackgroundReplanner`` did), restarted
  whenever it finishes, so it runs through the whole block;
* ``process``  the same replan in the ``ProcessReplanner``'s child (nice 19,
  spawned once before the first block and kept), restarted likewise.

Printed: per mode the median ms/step over its blocks, the ratio to
``none`` (target: process <= 1.10x) and how many replans finished in its
blocks. ``results/replan_process_benchmark.json`` keeps every block.

Example::

    nice python benchmarks/replan_process_benchmark.py --rounds 3
"""

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Union

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import benchmark_parser, fmt, meta_ebc, save_results  # noqa: E402

MODES = ("none", "thread", "process")


def _arguments() -> argparse.Namespace:
    p = benchmark_parser(__doc__)
    p.add_argument("--tables", type=int, default=32, help="tables trained")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--pooling", type=int, default=8, help="ids per sample")
    p.add_argument("--block", type=int, default=20, help="steps per block")
    p.add_argument("--rounds", type=int, default=3, help="blocks per mode")
    p.add_argument("--plan-tables", type=int, default=200)
    p.add_argument("--plan-ranks", type=int, default=16)
    return p.parse_args()


def _request(num_tables: int, world: int):  # -> ReplanRequest
    """A replan of ``num_tables`` table-wise tables, a heavy-tailed load."""
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.resharding import ReplanRequest
    from torchrec.distributed.resharding.rebalance.replan import NON_REPLICATED_TYPES
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    names = [f"t{i}" for i in range(num_tables)]
    ebc = meta_ebc(names, 100_000, 64)
    root = torch.nn.Module()
    root.ebc = ebc
    current = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                ebc,
                per_param_sharding={
                    n: table_wise(i % world) for i, n in enumerate(names)
                },
                sharder=EmbeddingBagCollectionSharder(),
                local_size=world,
                world_size=world,
                device_type="cpu",
            )
        }
    )
    return ReplanRequest(
        step=0,
        definition=root,
        sharders=(EmbeddingBagCollectionSharder(),),
        topology=Topology(
            world_size=world, compute_device="cpu", local_world_size=world
        ),
        batch_size=512,
        constraints={
            n: ParameterConstraints(
                sharding_types=list(NON_REPLICATED_TYPES),
                compute_kernels=["fused"],
                pooling_factors=[100.0 / (i + 1)],
            )
            for i, n in enumerate(names)
        },
        current=current,
        tables={"ebc": [(n, 100_000, 64) for n in names]},
        element_bytes={f"ebc:{n}": 4 for n in names},
        device_type="cpu",
    )


class _Trainer:
    """An EBC and an MLP trained with SGD on random batches."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        torch.manual_seed(0)
        self.keys = [f"f{i}" for i in range(args.tables)]
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t{i}",
                    embedding_dim=args.dim,
                    num_embeddings=args.rows,
                    feature_names=[k],
                )
                for i, k in enumerate(self.keys)
            ]
        )
        width = args.tables * args.dim
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)
        )
        params = list(self.ebc.parameters()) + list(self.mlp.parameters())
        self.optimizer = torch.optim.SGD(params, lr=0.01)
        n = args.batch * args.tables
        self.kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys,
            values=torch.randint(0, args.rows, (n * args.pooling,)),
            lengths=torch.full((n,), args.pooling, dtype=torch.int32),
        )
        self.label = torch.rand(args.batch, 1)

    def step(self) -> None:
        import torch

        self.optimizer.zero_grad()
        pooled = self.ebc(self.kjt).values()
        loss = torch.nn.functional.mse_loss(self.mlp(pooled), self.label)
        loss.backward()
        self.optimizer.step()


def main() -> None:
    args = _arguments()
    import warnings

    import torch
    from torchrec.distributed.resharding.rebalance.replan import (
        full_replan,
        ThreadReplanner,
    )
    from torchrec.distributed.resharding.rebalance.replan_process import (
        ProcessReplanner,
    )

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    trainer = _Trainer(args)
    request = _request(args.plan_tables, args.plan_ranks)
    replanners: Dict[str, Union[ThreadReplanner, ProcessReplanner]] = {
        "thread": ThreadReplanner(full_replan),
        "process": ProcessReplanner(),
    }
    # spawn the child and let it import torchrec before any block
    t0 = time.perf_counter()
    process = replanners["process"]
    assert isinstance(process, ProcessReplanner)
    process.start(_request(4, 2))
    while not process.ready():
        time.sleep(0.1)
    warm = process.take()
    assert warm is not None and warm.error is None, warm
    print(f"replan process started in {time.perf_counter() - t0:.1f} s", flush=True)
    for _ in range(3):
        trainer.step()
    blocks: Dict[str, List[float]] = {m: [] for m in MODES}
    finished: Dict[str, int] = {m: 0 for m in MODES}
    plan_seconds: Dict[str, List[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            replanner = replanners.get(mode)
            if replanner is not None:
                replanner.start(request)
            start = time.perf_counter()
            for _ in range(args.block):
                trainer.step()
                if replanner is not None and replanner.ready():
                    result = replanner.take()
                    assert result is not None and result.error is None, result
                    finished[mode] += 1
                    plan_seconds[mode].append(result.seconds)
                    replanner.start(request)
            blocks[mode].append((time.perf_counter() - start) / args.block * 1e3)
            if replanner is not None:  # let it finish outside the blocks
                while not replanner.ready():
                    time.sleep(0.05)
                result = replanner.take()
                assert result is not None and result.error is None, result
                plan_seconds[mode].append(result.seconds)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    process.close()
    none = statistics.median(blocks["none"])
    print(
        f"\n{args.tables}-table EBC + MLP, batch {args.batch}, one intra-op thread; "
        f"replan: TorchRec's planner, {args.plan_tables} tables on "
        f"{args.plan_ranks} ranks; {args.rounds} blocks of {args.block} steps "
        "per mode\n"
    )
    print(
        f"{'mode':<8} {'ms/step (median)':>17} {'blocks (ms/step)':>30} "
        f"{'x none':>7} {'replans done':>13} {'replan s':>9}"
    )
    for mode in MODES:
        ms = statistics.median(blocks[mode])
        each = " ".join(f"{b:.1f}" for b in blocks[mode])
        secs = statistics.median(plan_seconds[mode]) if plan_seconds[mode] else None
        print(
            f"{mode:<8} {ms:>17.1f} {each:>30} {ms / none:>6.2f}x "
            f"{finished[mode]:>13} {fmt(secs, '>9.1f')}"
        )
    ratio = statistics.median(blocks["process"]) / none
    print(f"\ntarget process <= 1.10x none: {'met' if ratio <= 1.10 else 'MISSED'}")
    save_results(
        args.out_dir,
        "replan_process_benchmark",
        {"args": vars(args), "ms_per_step": blocks, "replan_seconds": plan_seconds},
    )


if __name__ == "__main__":
    main()

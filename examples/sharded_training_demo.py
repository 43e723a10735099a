#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""End-to-end run of the fork on 2 gloo ranks (CPU).

Shards an EmbeddingBagCollection table-wise, column-wise, row-wise and
data-parallel, trains a small regression head on top of it for a few steps
(fused EXACT_ROWWISE_ADAGRAD for the sharded tables, SGD for the rest) and
prints a summary: where each table lives, the loss curve, and a check that
the shards still tile their tables.

    python examples/sharded_training_demo.py [--steps N] [--world-size W]
"""

import argparse
import logging
import os
import socket
import time
import warnings
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

BATCH_SIZE: int = 32
TABLES: List[EmbeddingBagConfig] = [
    EmbeddingBagConfig(
        name=f"t{i}", embedding_dim=16, num_embeddings=1000, feature_names=[f"f{i}"]
    )
    for i in range(4)
]


def make_batch(gen: torch.Generator) -> KeyedJaggedTensor:
    """A random batch of ids for every feature."""
    lengths = torch.randint(1, 5, (len(TABLES) * BATCH_SIZE,), generator=gen)
    values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
    keys = [f for table in TABLES for f in table.feature_names]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=values, lengths=lengths
    )


def quiet() -> None:
    """Keep the demo's output to its summary (the base is chatty on CPU)."""
    warnings.simplefilter("ignore")
    for name in ("torch", "torchrec", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)


def worker(rank: int, world_size: int, port: int, steps: int) -> None:
    """One rank of the demo."""
    quiet()
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    device = torch.device("cpu")

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=TABLES, device=device)
    plan = construct_module_sharding_plan(
        ebc,
        {
            "t0": table_wise(rank=world_size - 1),
            "t1": column_wise(ranks=list(range(world_size))),
            "t2": row_wise(),
            "t3": data_parallel(),
        },
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    for ps in plan.values():
        if ps.sharding_type != ShardingType.DATA_PARALLEL.value:
            ps.compute_kernel = EmbeddingComputeKernel.FUSED.value
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": 0.05,
        }
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    model = sharder.shard(ebc, plan, env, device)
    model.load_state_dict(ebc.state_dict())  # CPU sharding does not copy weights

    head = torch.nn.Linear(sum(t.embedding_dim for t in TABLES), 1)
    for param in head.parameters():
        dist.broadcast(param.data, src=0)
    dense = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
    opt = torch.optim.SGD(dense, lr=0.05)

    gen = torch.Generator().manual_seed(rank)
    batches = [make_batch(gen) for _ in range(4)]
    targets = [torch.randn(BATCH_SIZE, 1, generator=gen) for _ in batches]
    losses: List[float] = []
    start = time.perf_counter()
    for step in range(steps):
        kjt, target = batches[step % len(batches)], targets[step % len(batches)]
        pooled = model(kjt).wait().values()
        loss = torch.nn.functional.mse_loss(head(pooled), target)
        opt.zero_grad()
        loss.backward()
        for param in head.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world_size
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    elapsed = time.perf_counter() - start

    layout: Dict[str, str] = {}
    covered: Dict[str, int] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            shards = value.metadata().shards_metadata
            layout[key] = ", ".join(
                f"r{m.placement.rank()}@{tuple(m.shard_offsets)}+{tuple(m.shard_sizes)}"
                for m in shards
            )
            covered[key] = sum(m.shard_sizes[0] * m.shard_sizes[1] for m in shards)
            assert covered[key] == value.size(0) * value.size(1), key
        else:
            layout[key] = f"replicated on all {world_size} ranks"
    if rank == 0:
        print(f"torchrec fork demo: {world_size} gloo ranks, {len(TABLES)} tables")
        for name, ps in plan.items():
            print(f"  {name}: {ps.sharding_type:<14} {ps.compute_kernel:<6}", end="")
            print(f" {layout[f'embedding_bags.{name}.weight']}")
        for step in sorted({0, steps // 2, steps - 1}):
            print(f"  step {step:3d}: loss {losses[step]:.4f}")
        trend = "down" if losses[-1] < losses[0] else "NOT down"
        print(
            f"summary: {steps} steps in {elapsed:.2f}s, loss {losses[0]:.4f} -> "
            f"{losses[-1]:.4f} ({trend}); every table's shards tile it exactly"
        )
    dist.destroy_process_group()


def free_port() -> int:
    """A free TCP port on localhost."""
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    """Parse arguments and spawn the ranks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks")
    args = parser.parse_args()
    mp.spawn(
        worker,
        args=(args.world_size, free_port(), args.steps),
        nprocs=args.world_size,
        join=True,
    )


if __name__ == "__main__":
    main()

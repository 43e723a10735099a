#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
What connecting the exchange group costs per reshard: a small table-wise
module is resharded back and forth (``--reshards`` times, after a warm-up),
once with a new exchange group per reshard (a new ``ExchangeGroups`` that
``keep_exchange_groups`` gives the env each time, closed after it) and once the
default way, where the module's ``ShardingEnv`` keeps the group across the
reshards (``exchange_groups.kept_exchange_groups``).
Each reshard's report gives the seconds spent connecting the group
(``connect_seconds``), the exchange phase and the whole reshard; the table
prints their means on rank 0 and the ratio kept / per reshard.

gloo on CPU ranks (``--world-size``, default 2); on a machine with as many
GPUs, ``--backend nccl`` measures NCCL communicators, whose set-up is the cost
that matters (see docs/gpu.md).
"""

import argparse
import os
import statistics
import tempfile
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import benchmark_parser, fmt, free_port, gather_to_json, save_results
from reshard_benchmark import make_ebc, make_plan, shard

MODES = ("per_reshard", "kept")


def _run_mode(mode: str, args: argparse.Namespace, env: Any, device: Any) -> Dict:
    from torchrec.distributed.resharding import (
        ExchangeGroups,
        keep_exchange_groups,
        reshard_module,
    )

    ws = dist.get_world_size()
    ebc = make_ebc(args.rows, ws)
    plans = [make_plan(ebc, "fused", ws, False), make_plan(ebc, "fused", ws, True)]
    module = shard(ebc, plans[0], env, "fused", "EXACT_SGD", random_init=False)
    rows: List[Dict[str, float]] = []
    current = 0
    connections = 0
    for rep in range(args.warmup + args.reshards):
        target = 1 - current
        delta = {t: ps for t, ps in plans[target].items() if plans[current][t] != ps}
        # per reshard: new groups for the env, closed after it; kept: the env's
        groups = (
            keep_exchange_groups(env, ExchangeGroups())
            if mode == "per_reshard"
            else None
        )
        dist.barrier()
        report = reshard_module(module, delta, env, device)
        connections += report.connect_seconds > 0
        if groups is not None:
            groups.close(graceful=True)
        current = target
        if rep >= args.warmup:
            rows.append(
                {
                    "connect": report.connect_seconds,
                    "exchange": report.phases.exchange,
                    "total": report.seconds,
                }
            )
    return {"mode": mode, "rows": rows, "connections": connections}


def worker(rank: int, ws: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        args.backend, rank=rank, world_size=ws, timeout=timedelta(seconds=120)
    )
    from torchrec.distributed.types import ShardingEnv

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    results = [_run_mode(mode, args, env, device) for mode in MODES]
    gather_to_json(results, out, dist.group.WORLD)
    dist.destroy_process_group()


def summarise(per_rank: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    out = []
    for i, mode in enumerate(MODES):
        rows = per_rank[0][i]["rows"]
        out.append(
            {
                "mode": mode,
                "connections": per_rank[0][i]["connections"],
                **{
                    f"{k}_s": statistics.mean(r[k] for r in rows)
                    for k in ("connect", "exchange", "total")
                },
                "connect_max_rank_s": max(
                    statistics.mean(r["connect"] for r in pr[i]["rows"])
                    for pr in per_rank
                ),
            }
        )
    return out


def print_table(rows: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Exchange group set-up per reshard ({args.backend}, {args.world_size} ranks,"
        f" {args.reshards} reshards after {args.warmup} warm-up; means, rank 0)",
        f"{'mode':<12} {'connections':>11} {'connect s':>10} {'exchange s':>10}"
        f" {'reshard s':>10}",
    ]
    for r in rows:
        lines.append(
            f"{r['mode']:<12} {r['connections']:>11} {r['connect_s']:>10.4f}"
            f" {r['exchange_s']:>10.4f} {r['total_s']:>10.4f}"
        )
    per, kept = rows
    lines.append(
        "kept / per reshard: exchange phase "
        f"{fmt(kept['exchange_s'] / per['exchange_s'], '.2f')}x, reshard "
        f"{fmt(kept['total_s'] / per['total_s'], '.2f')}x"
    )
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def main() -> None:
    parser = benchmark_parser(__doc__, argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--reshards", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        mp.spawn(
            worker,
            args=(args.world_size, free_port(), args, out),
            nprocs=args.world_size,
            join=True,
        )
        import json

        with open(out) as f:
            per_rank = json.load(f)
    finally:
        os.unlink(out)
    rows = summarise(per_rank)
    text = print_table(rows, args)
    save_results(
        args.out_dir,
        "exchange_group_benchmark",
        {"args": vars(args), "rows": rows, "table": text},
    )


if __name__ == "__main__":
    main()

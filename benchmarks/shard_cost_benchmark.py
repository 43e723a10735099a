#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Calibration of the rebalancer's per-shard fixed cost (issue 34): what one
id costs a shard whatever its width.

The cost model priced a shard by the elements its ids read (ids times its
columns), so halving a table's columns halved its predicted kernel time.
A column-wise shard reads every id of its table though, and each id has a
cost of its own (its offsets, its row's address, the pooling and the
optimizer's update per row): after a split the measured kernel time stayed
near the whole table's (issue 34, ``test_rebalance_splits``).

This times fbgemm's CPU kernel as the fused compute kernel runs it
(``SplitTableBatchedEmbeddingBagsCodegen`` on the host, exact SGD fused in
the backward, one intra-op thread): forward and backward of one table of
``--rows`` rows, ``--batch`` samples of ``--pooling`` ids each, at every
``--widths`` (interleaved, round after round, so every width sees the same
moments of a shared machine). A least-squares fit of
``ms = ids * (a + b * width)`` gives the fixed cost of an id in columns,
``a / b``: ``policy.DEFAULT_LOOKUP_COLUMNS["cpu"]`` is this figure.
Printed: per width the median ms, the fit, and each width's time as a ratio
to the widest; then per width, what a split predicts for one half (a
column-wise shard of half the width reading every id), by elements only
and with the fitted fixed cost (``--lookup-columns`` if given), against
the half measured in the same run: the error is predicted over measured,
minus one.

Example::

    nice python benchmarks/shard_cost_benchmark.py --rounds 7
"""

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import benchmark_parser, save_results  # noqa: E402


def _arguments() -> argparse.Namespace:
    p = benchmark_parser(__doc__)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--pooling", type=int, default=4000, help="ids per sample")
    p.add_argument(
        "--widths", type=str, default="8,16,32,64,128,256", help="columns, comma"
    )
    p.add_argument("--rounds", type=int, default=7, help="timings per width")
    p.add_argument(
        "--lookup-columns",
        type=float,
        default=None,
        help="the fixed cost to judge the halves by (default: this run's fit)",
    )
    return p.parse_args()


def _kernel(rows: int, width: int) -> torch.nn.Module:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, width, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_SGD,
        learning_rate=0.01,
        device=torch.device("cpu"),
    )


def main() -> None:
    args = _arguments()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    widths = [int(w) for w in args.widths.split(",")]
    ids = args.batch * args.pooling
    indices = torch.randint(0, args.rows, (ids,), dtype=torch.int64)
    offsets = torch.arange(0, ids + 1, args.pooling, dtype=torch.int64)
    kernels = {w: _kernel(args.rows, w) for w in widths}
    times: Dict[int, List[float]] = {w: [] for w in widths}
    for w in widths:  # warm up
        kernels[w](indices, offsets).sum().backward()
    for r in range(args.rounds):
        for w in widths[r % len(widths) :] + widths[: r % len(widths)]:
            start = time.perf_counter()
            kernels[w](indices, offsets).sum().backward()
            times[w].append(time.perf_counter() - start)
    ms = {w: 1e3 * statistics.median(times[w]) for w in widths}
    # least squares of ms = a + b * width (per ids; ids are the same)
    mean_w = sum(widths) / len(widths)
    mean_t = sum(ms.values()) / len(widths)
    b = sum((w - mean_w) * (ms[w] - mean_t) for w in widths) / sum(
        (w - mean_w) ** 2 for w in widths
    )
    a = mean_t - b * mean_w
    columns = a / b if b > 0 else float("inf")
    print(
        f"fbgemm CPU TBE, fused exact SGD, one thread: {args.rows} rows, "
        f"{ids} ids per step, {args.rounds} rounds"
    )
    print(f"{'width':>6} {'ms':>8} {'fit ms':>8} {'x widest':>9}")
    widest = ms[max(widths)]
    for w in widths:
        print(f"{w:>6} {ms[w]:>8.2f} {a + b * w:>8.2f} {ms[w] / widest:>9.2f}")
    print(
        f"fit: {a:.2f} ms + {b * 1e3:.1f} us per column; the fixed cost of an "
        f"id is {columns:.0f} columns"
    )
    lookup = columns if args.lookup_columns is None else args.lookup_columns
    print(f"\na split into halves, predicted from the whole (fixed cost {lookup:.0f})")
    print(
        f"{'width':>6} {'half ms':>8} {'elements':>9} {'error':>7} "
        f"{'+fixed':>8} {'error':>7}"
    )
    halves = {}
    for w in widths:
        if w // 2 not in ms:
            continue
        old = ms[w] / 2
        new = ms[w] * (w / 2 + lookup) / (w + lookup)
        half = ms[w // 2]
        halves[str(w)] = {"measured": half, "elements": old, "fixed": new}
        print(
            f"{w:>6} {half:>8.2f} {old:>9.2f} {old / half - 1:>+7.0%} "
            f"{new:>8.2f} {new / half - 1:>+7.0%}"
        )
    save_results(
        args.out_dir,
        "shard_cost_benchmark",
        {
            "arguments": vars(args),
            "ms": {str(w): ms[w] for w in widths},
            "times": {str(w): times[w] for w in widths},
            "fixed_ms": a,
            "ms_per_column": b,
            "lookup_columns": columns,
            "halves": halves,
        },
    )


if __name__ == "__main__":
    main()

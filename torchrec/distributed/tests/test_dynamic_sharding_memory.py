#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Memory is deterministic across many reshards: with Python's cycle collector
off, 100 random reshards (a training step after each, ending on the plan they
started from) grow resident memory and malloc's in-use bytes by at most one
table beyond a control run that trains as many steps without resharding;
kernels per group stay bounded, and a reshard does not get slower over time.
"""

import ctypes
import gc
import mmap
import random
import statistics
import sys
import time
import unittest
from typing import Dict, List, Optional

import torch
from torchrec.distributed.resharding import reshard_module
from torchrec.distributed.resharding.kept_grouping import MAX_KERNELS_PER_GROUP
from torchrec.distributed.resharding.kernel_state import batched_kernels
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import (
    delta,
    make_batches,
    ReshardTestBase,
    TableSpec,
    train_step,
)

NUM_TABLES, ROWS, DIM = 4, 1024, 1024  # 4 MiB of fp32 weights per table
TABLE_BYTES = ROWS * DIM * 4
RESHARDS = 100


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _malloc_in_use() -> Optional[int]:
    """Bytes malloc has handed out and not got back (glibc), or None."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _random_plans(count: int, world_size: int) -> List[Dict[str, TableSpec]]:
    """The same sequence on every rank: a start plan, random ones, the start."""
    rng = random.Random(1234)

    def one() -> Dict[str, TableSpec]:
        plan: Dict[str, TableSpec] = {}
        for i in range(NUM_TABLES):
            kind = rng.choice(
                ["table_wise", "column_wise", "row_wise", "data_parallel"]
            )
            if kind == "table_wise":
                plan[f"t{i}"] = (kind, rng.randrange(world_size))
            elif kind == "column_wise":
                plan[f"t{i}"] = (kind, [rng.randrange(world_size) for _ in range(2)])
            else:
                plan[f"t{i}"] = (kind, None)
        return plan

    start = {f"t{i}": ("table_wise", i % world_size) for i in range(NUM_TABLES)}
    return [start] + [one() for _ in range(count - 1)] + [start]


def _most_kernels_per_group(module: torch.nn.Module) -> int:
    return max(sum(1 for _ in batched_kernels(lookup)) for lookup in module._lookups)


def _run_memory(rank: int, world_size: int, port: str) -> None:
    with reshard_scenario(
        rank,
        world_size,
        port,
        NUM_TABLES,
        dims=[DIM] * NUM_TABLES,
        rows=[ROWS] * NUM_TABLES,
    ) as scenario:
        env = scenario.env
        plans = [scenario.plan(spec) for spec in _random_plans(RESHARDS, world_size)]
        batches = make_batches(NUM_TABLES, [ROWS] * NUM_TABLES, 4, 8, seed=1)
        module = scenario.shard(plans[0])
        for i in range(3):  # warm up the allocator and the input dists
            train_step(module, batches[i % 4])
            reshard_module(module, delta(plans[i % 2], plans[1 - i % 2]), env)
        train_step(module, batches[0])

        gc.collect()
        gc.disable()  # nothing may rely on the cycle collector
        try:
            rss, malloc = _rss(), _malloc_in_use()
            for i in range(RESHARDS):
                train_step(module, batches[i % 4])
            control_rss = _rss() - rss
            control_malloc = (_malloc_in_use() or 0) - (malloc or 0)

            rss, malloc = _rss(), _malloc_in_use()
            seconds: List[float] = []
            kernels: List[int] = []
            for i in range(RESHARDS):
                start = time.perf_counter()
                reshard_module(module, delta(plans[i], plans[i + 1]), env)
                seconds.append(time.perf_counter() - start)
                kernels.append(_most_kernels_per_group(module))
                train_step(module, batches[i % 4])
            reshard_rss = _rss() - rss
            reshard_malloc = (_malloc_in_use() or 0) - (malloc or 0)
        finally:
            gc.enable()

        print(
            f"rank {rank}: resident growth {reshard_rss / 2**20:.1f} MiB after "
            f"{RESHARDS} reshards vs {control_rss / 2**20:.1f} MiB for the control; "
            f"malloc in use {reshard_malloc / 2**20:.1f} vs "
            f"{control_malloc / 2**20:.1f} MiB; one table is "
            f"{TABLE_BYTES / 2**20:.1f} MiB",
            file=sys.stderr,
        )
        assert reshard_rss - control_rss <= TABLE_BYTES, (reshard_rss, control_rss)
        if malloc is not None:
            assert reshard_malloc - control_malloc <= TABLE_BYTES, (
                reshard_malloc,
                control_malloc,
            )
        assert max(kernels) <= MAX_KERNELS_PER_GROUP, kernels
        first = statistics.median(seconds[:20])
        last = statistics.median(seconds[-20:])
        assert last <= 2 * first + 0.05, (first, last)


class ReshardMemoryTest(ReshardTestBase):
    @unittest.skipUnless(sys.platform.startswith("linux"), "/proc and glibc")
    def test_memory_is_deterministic_over_100_random_reshards(self) -> None:
        self.run_ranks(_run_memory)


if __name__ == "__main__":
    unittest.main()

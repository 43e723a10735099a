#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
What a row split adds outside the kernels, measured on the running job
(``measure_exchange_price``): the group's all-to-all, small and large (the
collectives of a row-wise table's ids and output), and TorchRec's
bucketization of ids by row block, each timed on every rank at the same
point between steps, the slowest rank's figures agreed by an all-reduce.
The ``Rebalancer`` calls it before each of its first searches that may
split (``EXCHANGE_CALIBRATIONS``) and prices splits at the median;
``exchange_price`` turns the figures into seconds per step (pure).
"""

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import bucketize_kjt_before_all2all
from torchrec.distributed.resharding.devices import synchronize_device
from torchrec.distributed.resharding.rebalance.exchange_price import (
    exchange_price_of,
    ExchangePrice,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# The calibration of what a row split adds outside the kernels: bytes of one
# rank's input to the large all-to-all (and of the ids bucketized), and
# timed repeats of each.
EXCHANGE_CALIBRATION_BYTES: int = 4 * 2**20
EXCHANGE_CALIBRATION_REPEATS: int = 3
# The small all-to-all (its latency, which a column split that makes a
# module's first column-wise table pays five times over) is timed more
# often: the median of 3 ranged over 0.18-2.0 ms on 2 gloo ranks of a
# shared host, and a burst of load on 2 of 3 runs decides it. Each run takes
# about a third of a millisecond there.
EXCHANGE_LATENCY_REPEATS: int = 25
# Calibrations the Rebalancer makes (one in each of its first windows that
# search with splits): their median is the price. With one, on 2 gloo
# ranks of a shared host, one run in about sixty of the split test kept its
# hot table whole for good: the split saved 2.8% of the step by its price,
# 12-20% in the other runs, as a latency ten times the usual would make it.
EXCHANGE_CALIBRATIONS: int = 3


def _timed(run: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The median seconds of ``repeats`` runs after one warm-up."""
    seconds = []
    for i in range(repeats + 1):
        synchronize_device(device)
        start = time.perf_counter()
        run()
        synchronize_device(device)
        if i:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def measure_exchange_price(
    pg: dist.ProcessGroup,
    device: torch.device,
    nbytes: int = EXCHANGE_CALIBRATION_BYTES,
    repeats: int = EXCHANGE_CALIBRATION_REPEATS,
    latency_repeats: int = EXCHANGE_LATENCY_REPEATS,
) -> ExchangePrice:
    """
    What the work outside the kernels that a row split adds costs on this
    job: an all-to-all of the group (the collective of a row-wise table's
    ids) of one value per rank and of ``nbytes`` per rank (its latency and
    its seconds per byte), and TorchRec's bucketization by row block of
    ``nbytes / 8`` ids (``bucketize_kjt_before_all2all``), each the median
    of ``repeats`` after a warm-up, the slowest rank's (all-reduced, so
    every rank prices alike). Every rank of the group calls it at the same
    point, between steps.

    Args:
        pg (dist.ProcessGroup): the model's process group.
        device (torch.device): the model's device.
        nbytes (int): bytes of each rank's input to the large exchange.
        repeats (int): timed runs of the large exchange and of the
            bucketization.
        latency_repeats (int): timed runs of the small exchange.

    Returns:
        ExchangePrice: the figures (all 0 on one rank).
    """
    world_size = dist.get_world_size(pg)
    if world_size < 2:
        return ExchangePrice()
    count = max(1, nbytes // 4 // world_size) * world_size
    seconds = []
    for n, runs in ((world_size, latency_repeats), (count, repeats)):
        send = torch.zeros(n, dtype=torch.float32, device=device)
        receive = torch.empty_like(send)
        seconds.append(
            _timed(
                lambda: dist.all_to_all_single(receive, send, group=pg),
                device,
                runs,
            )
        )
    rows, batch = 1 << 20, 512
    # a generator of its own: the job's random streams stay as they were
    generator = torch.Generator(device=device).manual_seed(0)
    ids = max(1, nbytes // 8 // batch) * batch
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["calibration"],
        values=torch.randint(0, rows, (ids,), device=device, generator=generator),
        lengths=torch.full((batch,), ids // batch, dtype=torch.int32, device=device),
    )
    block = torch.tensor([-(-rows // world_size)], device=device)
    seconds.append(
        _timed(
            lambda: bucketize_kjt_before_all2all(features, world_size, block),
            device,
            repeats,
        )
    )
    slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=pg)
    small, large, bucketize = (float(v) for v in slowest.tolist())
    # of its input, a rank sends and receives all but its own part
    share = 2.0 * (world_size - 1) / world_size
    return exchange_price_of(
        small, large, 4 * world_size * share, 4 * count * share, bucketize, ids
    )

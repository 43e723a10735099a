#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
``measure_exchange_price`` on 2 gloo ranks: every figure measured above
zero, the same on both ranks (the slowest rank's, all-reduced), and the
job's own state untouched: torch's global random stream and the group's
later collectives are as they would have been without it.
"""

import unittest
from typing import List

import torch
import torch.distributed as dist
from torchrec.distributed.resharding.rebalance.exchange_calibration import (
    measure_exchange_price,
)
from torchrec.distributed.test_utils.rebalance_utils import same_everywhere
from torchrec.distributed.test_utils.reshard_utils import (
    BoundedMultiProcessContext,
    ReshardTestBase,
)


def _run_calibration(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, device = context.pg, context.device
        torch.manual_seed(1234 + rank)
        rng_before = torch.get_rng_state()
        price = measure_exchange_price(pg, device, nbytes=1 << 16, repeats=2)
        assert torch.equal(torch.get_rng_state(), rng_before)
        assert price.seconds_per_byte > 0, price
        assert price.seconds_per_collective > 0, price
        assert price.seconds_per_id > 0, price
        same_everywhere(repr(price))
        # the group goes on: a collective after it sees every rank's value
        values: List[torch.Tensor] = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(values, torch.tensor([float(rank)]), group=pg)
        assert [float(v) for v in values] == [float(r) for r in range(world_size)]


class ExchangeCalibrationTest(ReshardTestBase):
    def test_figures_agreed_and_the_job_s_random_stream_untouched(self) -> None:
        self.run_ranks(_run_calibration)


if __name__ == "__main__":
    unittest.main()

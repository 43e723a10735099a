#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Moves between groups that must be refused, the same on every rank and before
anything moves: shards placed outside the new group, ranks disagreeing about
the new group, a participant that never calls (bounded by the exchange
timeout), a joining rank whose definition differs. The model keeps every
weight.
"""

import unittest
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.resharding import ReshardAbortedError, ReshardError
from torchrec.distributed.resharding.elastic import move_model
from torchrec.distributed.test_utils.reshard_model_utils import (
    group_envs,
    model_definition,
    model_plan,
    model_sharders,
    sharded_model,
    WORLD,
)
from torchrec.distributed.test_utils.reshard_utils import (
    BoundedMultiProcessContext,
    global_weights,
    make_plan,
    ReshardTestBase,
)
from torchrec.distributed.types import ShardingPlan


def _run_bad_moves(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=60) as context:
        device = context.device
        groups, envs = group_envs(rank)
        old, new = (0, 1, 2, 3), (0, 1)
        env = envs[old]
        assert env is not None
        model = sharded_model(env, model_plan(4, 0), device)
        before = global_weights(model, groups[old])
        options_timeout = timedelta(seconds=4)

        def attempt(plan: ShardingPlan, **kwargs: Any) -> str:
            from torchrec.distributed.resharding import ReshardOptions

            try:
                move_model(
                    model,
                    plan,
                    envs[new],
                    participants=[0, 1, 2, 3],
                    options=ReshardOptions(exchange_timeout=options_timeout),
                    **kwargs,
                )
            except (ReshardError, ReshardAbortedError) as e:
                return f"{type(e).__name__}: {e}"
            return "moved"

        # shards placed on a rank outside the new group (rank 3 of 2)
        outside = model_plan(2, 0)
        outside.plan["ebc"]["t1"] = make_plan(
            model_definition("cpu").ebc, {"t1": ("table_wise", 3)}, 4, 4, "fused"
        )["t1"]
        outcome = attempt(outside)
        assert outcome.startswith("ReshardError") and "t1" in outcome, outcome

        # ranks disagreeing about the new group
        skewed = envs[(0, 1, 2)] if rank == 0 else envs[new]
        try:
            move_model(
                model,
                model_plan(2, 0),
                skewed if rank in (0, 1) else None,
                participants=[0, 1, 2, 3],
            )
        except ReshardError as e:
            assert "different" in str(e) or "new group" in str(e), e
        else:
            raise AssertionError("disagreeing groups must be refused")

        # a participant that does not call: rank 3 idles past the timeout
        if rank != 3:
            outcome = attempt(model_plan(2, 0))
            assert outcome.startswith("ReshardAbortedError"), outcome
        else:
            import time

            time.sleep(options_timeout.total_seconds() * 1.5)

        # nothing was lost: the model still has every weight
        after = global_weights(model, groups[old])
        for key in before:
            assert torch.equal(before[key], after[key]), key
        dist.barrier()


def _run_bad_definition(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, timeout_s=60) as context:
        device = context.device
        groups, envs = group_envs(rank)
        model = None
        if rank in (0, 1):
            env = envs[(0, 1)]
            assert env is not None
            model = sharded_model(env, model_plan(2, 0), device, weights=False)
        # rank 3 joins with a definition whose table t3 has other rows
        definition = model_definition(ebc_rows=[24, 27, 30, 99] if rank == 3 else None)
        try:
            move_model(
                model,
                model_plan(4, 0),
                envs[(0, 1, 2, 3)],
                participants=[0, 1, 2, 3],
                definition=definition if rank >= 2 else None,
                sharders=model_sharders() if rank >= 2 else None,
            )
        except ReshardError as e:
            assert "rank 3" in str(e) and "t3" in str(e), e
        else:
            raise AssertionError("a differing definition must be refused")


class ElasticBadInputTest(ReshardTestBase):
    def test_bad_moves(self) -> None:
        self.run_ranks(_run_bad_moves, world_size=WORLD)

    def test_differing_definition(self) -> None:
        self.run_ranks(_run_bad_definition, world_size=WORLD)


if __name__ == "__main__":
    unittest.main()

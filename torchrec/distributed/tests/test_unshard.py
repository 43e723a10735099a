#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
unshard_model and shard_from_rank: every table of a sharded model onto one
rank as plain modules (weights and fused optimizer state equal to the sharded
model's), and a model whose weights only rank 0 holds sharded onto the group
(equal to a model sharded directly and loaded on every rank).
"""

import unittest

import torch
from torchrec.distributed.resharding.unshard import shard_from_rank, unshard_model
from torchrec.distributed.test_utils.reshard_model_utils import (
    make_dense_optimizer,
    model_definition,
    model_plan,
    model_sharders,
    sharded_model,
    share_from,
    train_model,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    global_optimizer_state,
    global_weights,
    ReshardTestBase,
)


def _run_unshard_and_shard_from_rank(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port) as context:
        pg, env, device = context.pg, context.env, context.device
        model = sharded_model(env, model_plan(2, 1), device)
        optimizer = make_dense_optimizer(model)
        for step in range(2):
            train_model(model, optimizer, step, rank)
        weights = global_weights(model, pg)
        fused = global_optimizer_state(model, pg)

        # every table onto rank 1, as plain modules, optimizer state included
        unsharded = unshard_model(model, dst=1, optimizer_state=True)
        assert (unsharded is not None) == (rank == 1)
        if unsharded is not None:
            for path, module in unsharded.modules.items():
                for key, value in module.state_dict().items():
                    assert torch.equal(value, weights[f"{path}.{key}"]), key
                for table, state in unsharded.optimizer_state[path].items():
                    prefix = "embedding_bags" if path == "ebc" else "embeddings"
                    param = f"{path}.{prefix}.{table}.weight"
                    # row-wise Adagrad: one state tensor, one value per row: a
                    # table split in columns gets the mean over its columns
                    (full,) = [v for k, v in fused.items() if k[0] == param]
                    (tensor,) = state.values()
                    expected = full.mean(dim=1).to(tensor.dtype)
                    assert torch.equal(tensor, expected), param

        # the reverse: only rank 0 has the weights (e.g. pretrained)
        source = model_definition("cpu", seed=7) if rank == 0 else model_definition()
        expected = share_from(
            (
                {k: v.clone() for k, v in source.state_dict().items()}
                if rank == 0
                else None
            ),
            0,
        )
        sharded = shard_from_rank(
            source, model_plan(2, 0), env, src=0, sharders=model_sharders()
        )
        direct = sharded_model(env, model_plan(2, 0), device, weights=False)
        direct.load_state_dict(expected)  # every rank reads the weights
        assert_state_dicts_equal(direct.state_dict(), sharded.state_dict())
        assert_optimizer_states_equal(direct, sharded)


class UnshardTest(ReshardTestBase):
    def test_unshard_and_shard_from_rank(self) -> None:
        self.run_ranks(_run_unshard_and_shard_from_rank, world_size=2)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""EmbeddingCollection with DTensor state dicts.

Shards an EmbeddingCollection table-wise, column-wise and row-wise over 2
gloo ranks with DTensor state dicts, asked for through
``ShardingEnv.output_dtensor`` or through the ``output_dtensor`` fused param
TorchRec 1.1.0's EC read, checks that every table is a DTensor holding exactly
the rank's shards, and trains it against the unsharded module.
"""

import unittest
from typing import Any, Dict, List

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed._tensor import DTensor, Replicate, Shard
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.test_utils.model_zoo import numbered_tables
from torchrec.distributed.test_utils.multi_process import MultiProcessContext
from torchrec.distributed.test_utils.multi_process_utils import NcclOrGlooTestBase
from torchrec.distributed.test_utils.sgd_reference import (
    averaged_sgd_step,
    LEARNING_RATE,
    random_batch,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

WORLD_SIZE: int = 2
EC_DIM: int = 8
EC_TABLES: List[EmbeddingConfig] = numbered_tables(
    EmbeddingConfig,
    4,
    [EC_DIM] * 4,
    [13 + 2 * i for i in range(4)],
    table_prefix="e",
    feature_prefix="h",
)
# sharding per table, the DTensor placements it gives, and whether the
# table's state dict value is a DTensor at all (data-parallel: a plain tensor)
EC_LAYOUT: Dict[str, Any] = {
    "e0": (table_wise(rank=1), (Replicate(),)),
    "e1": (column_wise(ranks=[0, 1]), (Shard(1),)),
    "e2": (row_wise(), (Shard(0),)),
    "e3": (table_wise(rank=0), (Replicate(),)),
}


def _ec_batch(rank: int, step: int) -> KeyedJaggedTensor:
    """A deterministic local batch per rank and step, with repeated ids."""
    return random_batch(EC_TABLES, 5000 + 100 * step + rank)


def _ec_loss(out: Dict[str, JaggedTensor], rank: int, step: int) -> torch.Tensor:
    """A loss giving every looked-up position its own gradient."""
    gen = torch.Generator().manual_seed(6000 + 100 * step + rank)
    loss = torch.zeros(())
    for name in sorted(out):
        values = out[name].values()
        weights = torch.randn(values.shape, generator=gen).to(values.device)
        loss = loss + (values * weights).sum()
    return loss


def _ec_reference_step(
    weights: Dict[str, torch.Tensor], world_size: int, step: int
) -> Dict[str, torch.Tensor]:
    """The weights after one EXACT_SGD step of the sharded EC: the gradients of
    every rank's batch averaged over the ranks, times the learning rate."""
    ref = EmbeddingCollection(tables=EC_TABLES, device=torch.device("cpu"))
    ref.load_state_dict(weights)
    return averaged_sgd_step(
        ref, lambda src: _ec_loss(ref(_ec_batch(src, step)), src, step), world_size
    )


def _ec_output_dtensor_rank(
    rank: int, world_size: int, switch: str, backend: str
) -> None:
    """One rank: shard an EC with DTensor output asked for through ``switch``
    ("env" or "fused_param"), check the state dict, train, check again."""
    torch.set_num_threads(1)
    with MultiProcessContext(rank, world_size, backend) as ctx:
        device = ctx.device
        assert ctx.pg is not None
        torch.manual_seed(0)
        ec = EmbeddingCollection(tables=EC_TABLES, device=torch.device("cpu"))
        fused_params: Dict[str, Any] = {
            "optimizer": EmbOptimType.EXACT_SGD,
            "learning_rate": LEARNING_RATE,
        }
        env = ShardingEnv.from_process_group(ctx.pg)
        if switch == "env":
            env.output_dtensor = True
        else:
            fused_params["output_dtensor"] = True
        plan = construct_module_sharding_plan(
            ec,
            {name: gen for name, (gen, _) in EC_LAYOUT.items()},
            local_size=world_size,
            world_size=world_size,
            device_type=device.type,
        )
        for ps in plan.values():
            ps.compute_kernel = EmbeddingComputeKernel.FUSED.value
        sharded = EmbeddingCollectionSharder(fused_params=fused_params).shard(
            ec, plan, env, device
        )
        sharded.load_state_dict(ec.state_dict())
        weights = {k: v.detach().clone() for k, v in ec.state_dict().items()}

        def check(expected: Dict[str, torch.Tensor], when: str) -> None:
            state = sharded.state_dict()
            assert list(state) == list(expected), (list(state), list(expected))
            for name, want in expected.items():
                value = state[name]
                table = name.split(".")[1]
                assert isinstance(value, DTensor), (when, name, type(value))
                assert value.placements == EC_LAYOUT[table][1], (name, value)
                assert value.size() == want.size(), name
                wrapper = value._local_tensor
                local = list(zip(wrapper.local_shards(), wrapper.local_offsets()))
                # every rank holds what the plan gives it, nothing else
                owned = [
                    s.shard_offsets
                    for s in plan[table].sharding_spec.shards
                    if s.placement.rank() == rank
                ]
                assert [list(o) for _, o in local] == [list(o) for o in owned], (
                    name,
                    local,
                    owned,
                )
                for tensor, (row, col) in local:
                    piece = want[
                        row : row + tensor.shape[0], col : col + tensor.shape[1]
                    ]
                    torch.testing.assert_close(
                        tensor.cpu(), piece, msg=f"{when} rank {rank} {name}"
                    )

        check(weights, "after load")
        for step in range(2):
            out = sharded(_ec_batch(rank, step).to(device)).wait()
            want = ec(_ec_batch(rank, step))
            # (the sharded EC orders its features by sharding type)
            assert sorted(out) == sorted(want), (list(out), list(want))
            for feature in want:
                torch.testing.assert_close(
                    out[feature].values().cpu(), want[feature].values().detach()
                )
            _ec_loss(out, rank, step).backward()  # the fused SGD steps here
            weights = _ec_reference_step(weights, world_size, step)
            ec.load_state_dict(weights)
            check(weights, f"after step {step}")


class EcOutputDTensorHealthTest(NcclOrGlooTestBase):
    """An EmbeddingCollection with table-wise, column-wise and row-wise tables
    shards with DTensor state and trains like the unsharded module, whichever
    way DTensor output is asked for."""

    def _run(self, switch: str) -> None:
        self.run_on_ranks(_ec_output_dtensor_rank, WORLD_SIZE, switch=switch)

    def test_ec_tw_cw_rw_dtensor_from_env(self) -> None:
        self._run("env")

    def test_ec_tw_cw_rw_dtensor_from_fused_param(self) -> None:
        self._run("fused_param")


if __name__ == "__main__":
    unittest.main()

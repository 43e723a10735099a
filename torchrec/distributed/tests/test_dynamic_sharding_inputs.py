#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The inputs a module sees in training, across a reshard: MEAN pooling (row-wise
MEAN tables without a row-wise SUM table), weighted features, features in an
order other than the tables', a feature shared by two tables, empty bags and
empty features, and a different batch size after the reshard. For an
EmbeddingBagCollection and an EmbeddingCollection, every output equals a module
sharded directly with the new plan, before and after a training step.
"""

import unittest
from typing import Any, Dict, List, Sequence

import torch
from torchrec.distributed.test_utils.reshard_ec_utils import (
    assert_ec_outputs_equal,
    ec_train_step,
    make_ec_sharder,
)
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    delta,
    ReshardTestBase,
    TableSpec,
    train_step,
)
from torchrec.modules.embedding_configs import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

ROWS, DIM = 32, 8
# (table, features, pooling): t1 and t2 share feature "s"; t0 and t3 pool MEAN.
EBC_TABLES = [
    ("t0", ["a"], PoolingType.MEAN),
    ("t1", ["s"], PoolingType.SUM),
    ("t2", ["s", "b"], PoolingType.SUM),
    ("t3", ["c"], PoolingType.MEAN),
]
# row-wise tables pool MEAN only (the case that used to break after a reshard)
EBC_PLAN_A: Dict[str, TableSpec] = {
    "t0": ("row_wise", None),
    "t1": ("table_wise", 0),
    "t2": ("table_wise", 1),
    "t3": ("column_wise", [0, 1]),
}
EBC_PLANS_B: List[Dict[str, TableSpec]] = [
    {**EBC_PLAN_A, "t1": ("table_wise", 1)},  # one table-wise table moving rank
    {**EBC_PLAN_A, "t0": ("table_wise", 0), "t3": ("row_wise", None)},
]
EC_TABLES = [("t0", ["a"]), ("t1", ["b"]), ("t2", ["c"])]
EC_PLAN_A: Dict[str, TableSpec] = {
    "t0": ("row_wise", None),
    "t1": ("table_wise", 0),
    "t2": ("column_wise", [0, 1]),
}
EC_PLANS_B: List[Dict[str, TableSpec]] = [
    {**EC_PLAN_A, "t1": ("table_wise", 1)},
    {"t0": ("table_wise", 1), "t1": ("row_wise", None), "t2": ("table_wise", 0)},
]
# features in an order other than the tables'
KEYS = ["c", "s", "b", "a"]
EC_KEYS = ["c", "a", "b"]


def _ebc(weighted: bool) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=name,
                embedding_dim=DIM,
                num_embeddings=ROWS,
                feature_names=features,
                pooling=pooling,
            )
            for name, features, pooling in EBC_TABLES
        ],
        is_weighted=weighted,
        device=torch.device("cpu"),
    )


def _ec() -> EmbeddingCollection:
    torch.manual_seed(0)
    return EmbeddingCollection(
        tables=[
            EmbeddingConfig(
                name=name, embedding_dim=DIM, num_embeddings=ROWS, feature_names=f
            )
            for name, f in EC_TABLES
        ],
        device=torch.device("cpu"),
    )


def _batch(
    keys: Sequence[str], batch_size: int, seed: int, weighted: bool
) -> KeyedJaggedTensor:
    """
    A batch with empty bags in every feature and the first feature empty in
    every sample.
    """
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * batch_size,), generator=generator)
    lengths[:batch_size] = 0  # one feature empty everywhere
    lengths[batch_size::2] = 0  # and empty bags in the others
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=generator)
    weights = torch.rand(values.numel(), generator=generator) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys), values=values, lengths=lengths, weights=weights
    )


def _shapes(prefix: str, names: Sequence[str]) -> Dict[str, Any]:
    return {f"{prefix}.{n}.weight": (ROWS, DIM) for n in names}


def _assert_same_outputs(kind: str, a: Any, b: Any) -> None:
    if kind == "ec":
        assert_ec_outputs_equal(a, b)
    else:
        assert torch.equal(a, b)


def _run_inputs(
    rank: int, world_size: int, port: str, kind: str, weighted: bool = False
) -> None:
    """
    An EBC (``kind`` "ebc") or an EC ("ec") resharded through its plans with
    batches of other sizes before and after; each step against the oracle.
    """
    if kind == "ec":
        unsharded, sharder = _ec(), make_ec_sharder("rowwise_adagrad")
        keys, specs, step = EC_KEYS, [EC_PLAN_A] + EC_PLANS_B, ec_train_step
    else:
        unsharded, sharder = _ebc(weighted), None
        keys, specs, step = KEYS, [EBC_PLAN_A] + EBC_PLANS_B, train_step
    with reshard_scenario(
        rank, world_size, port, unsharded=unsharded, sharder=sharder
    ) as scenario:
        env, device = scenario.env, scenario.device
        plans = scenario.plans(specs)
        module = scenario.shard(plans[0])
        seed = 10 * rank
        step(module, _batch(keys, 4, seed, weighted))
        for new_plan, batch_size in zip(plans[1:], (7, 3)):
            state = scenario.global_state(module)
            old_plan = dict(module.module_sharding_plan)
            module.update_shards(delta(old_plan, new_plan), env, device)
            reference = scenario.reference(new_plan, state)
            for _ in range(2):  # outputs before and after a training step
                seed += 1
                batch = _batch(keys, batch_size, seed, weighted)
                _assert_same_outputs(kind, step(module, batch), step(reference, batch))
            assert_state_dicts_equal(reference.state_dict(), module.state_dict())
            assert_optimizer_states_equal(reference, module)


class ReshardInputsTest(ReshardTestBase):
    def test_ebc_inputs(self) -> None:
        self.run_ranks(_run_inputs, kind="ebc", weighted=False)

    def test_weighted_ebc_inputs(self) -> None:
        self.run_ranks(_run_inputs, kind="ebc", weighted=True)

    def test_ec_inputs(self) -> None:
        self.run_ranks(_run_inputs, kind="ec")


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Every kernel upstream reshards takes part, on a one-rank job (on CPU TorchRec
builds FUSED_UVM and FUSED_UVM_CACHING tables on the host; the cache itself
is tested where CUDA exists, ``test_dynamic_sharding_gpu``): tables move
between FUSED, FUSED_UVM and FUSED_UVM_CACHING and a change of sharding type,
equal bit for bit to a module sharded directly under the new plan, and train
on alike; every kernel read is flushed first (reshard and unshard); new
kernels start with an empty cache; a kernel whose state cannot be read is
refused by name before anything moves, the model unchanged; a weight that is
not its shard's rectangle (INT8 rows with their scale and bias) is refused.
"""

import unittest
from typing import Any, Dict, List, Tuple
from unittest import mock

import torch
from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag
from torchrec.distributed.resharding import reshard_module, ReshardError, unshard_model
from torchrec.distributed.resharding.elastic_plan import check_movable_kernels
from torchrec.distributed.resharding.kernel_state import batched_kernels, shard_weight
from torchrec.distributed.resharding.plan import Rect
from torchrec.distributed.test_utils.multi_process_utils import free_port
from torchrec.distributed.test_utils.reshard_model_utils import (
    model_plan,
    sharded_model,
)
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_same_training,
    assert_state_dicts_equal,
    CACHING,
    delta,
    FUSED,
    global_weights,
    UVM,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan

# two tables, both table-wise on the one rank
BOTH_ON_RANK_0: Dict[str, Any] = {"t0": ("table_wise", 0), "t1": ("table_wise", 0)}


def _with_kernels(plan: Dict[str, Any], kernels: Dict[str, str]) -> Dict[str, Any]:
    for name, kernel in kernels.items():
        plan[name].compute_kernel = kernel
    return plan


def _model_with_kernel(env: ShardingEnv, kernel: str) -> Tuple[Any, ShardingPlan]:
    """The one-rank model of the move tests, its sharded tables in ``kernel``."""
    plan = model_plan(1, 0)
    for module_plan in plan.plan.values():
        for ps in module_plan.values():  # pyre-ignore[16]
            if ps.compute_kernel == FUSED:
                ps.compute_kernel = kernel
    return sharded_model(env, plan), plan


class _KernelCalls:
    """Records flush and split_embedding_weights of given kernels, in order."""

    def __init__(self, kernels: List[Any]) -> None:
        self.calls: List[Tuple[int, str]] = []
        for i, kernel in enumerate(kernels):
            for name in ("flush", "split_embedding_weights"):
                original = getattr(kernel, name)
                setattr(kernel, name, self._spy(i, name, original))

    def _spy(self, i: int, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((i, name))
            return original(*args, **kwargs)

        return call

    def assert_flushed_before_read(self, count: int) -> None:
        for i in range(count):
            mine = [name for k, name in self.calls if k == i]
            assert "split_embedding_weights" in mine, (i, self.calls)
            assert mine[0] == "flush", (i, mine)


class EveryKernelTest(unittest.TestCase):
    def test_tables_move_between_hbm_uvm_and_cached_kernels(self) -> None:
        with reshard_scenario(0, 1, free_port(), num_tables=3) as s:
            old = _with_kernels(
                s.plan(
                    {
                        "t0": ("table_wise", 0),
                        "t1": ("table_wise", 0),
                        "t2": ("table_wise", 0),
                    }
                ),
                {"t0": FUSED, "t1": UVM, "t2": CACHING},
            )
            new = _with_kernels(
                s.plan(
                    {
                        "t0": ("table_wise", 0),
                        "t1": ("table_wise", 0),
                        "t2": ("column_wise", [0, 0]),
                    }
                ),
                {"t0": CACHING, "t1": FUSED, "t2": UVM},
            )
            batches = s.batches(3, seed=1)
            module = s.shard(old)
            assert_same_training(module, s.shard(old), batches[:1], FUSED, s.device)
            state = s.global_state(module)
            reshard_module(module, delta(old, new), s.env)
            reference = s.reference(new, state)
            assert_state_dicts_equal(module.state_dict(), reference.state_dict())
            assert_optimizer_states_equal(module, reference)
            self.assertEqual(
                module.module_sharding_plan, reference.module_sharding_plan
            )
            assert_same_training(module, reference, batches[1:], FUSED, s.device)

    def test_every_kernel_read_is_flushed_first(self) -> None:
        with reshard_scenario(0, 1, free_port(), num_tables=2) as s:
            old = _with_kernels(s.plan(BOTH_ON_RANK_0), {"t0": CACHING, "t1": UVM})
            new = _with_kernels(s.plan(BOTH_ON_RANK_0), {"t0": FUSED, "t1": CACHING})
            module = s.shard(old)
            kernels = [b for lookup in module._lookups for b in batched_kernels(lookup)]
            spy = _KernelCalls(kernels)
            reshard_module(module, delta(old, new), s.env)
            spy.assert_flushed_before_read(len(kernels))

            # unshard reads the kernels through the same path
            model, _ = _model_with_kernel(s.env, CACHING)
            kernels = [
                b
                for name in ("ebc", "ec")
                for lookup in getattr(model.module, name)._lookups
                for b in batched_kernels(lookup)
            ]
            spy = _KernelCalls(kernels)
            weights = global_weights(model, s.pg)
            unsharded = unshard_model(model)
            assert unsharded is not None
            spy.assert_flushed_before_read(len(kernels))
            for key, value in unsharded.modules["ebc"].state_dict().items():
                torch.testing.assert_close(value, weights[f"ebc.{key}"], rtol=0, atol=0)

    def test_new_kernels_start_with_an_empty_cache(self) -> None:
        purged: List[Any] = []
        with reshard_scenario(0, 1, free_port(), num_tables=2) as s:
            old = _with_kernels(s.plan(BOTH_ON_RANK_0), {"t0": UVM, "t1": UVM})
            new = _with_kernels(s.plan(BOTH_ON_RANK_0), {"t0": CACHING, "t1": UVM})
            module = s.shard(old)
            with mock.patch.object(
                BatchedFusedEmbeddingBag,
                "purge",
                autospec=True,
                side_effect=lambda kernel: purged.append(kernel),
            ):
                reshard_module(module, delta(old, new), s.env)
            new_kernels = [
                b for lookup in module._lookups for b in batched_kernels(lookup)
            ]
            self.assertTrue(new_kernels)
            self.assertEqual([id(k) for k in purged], [id(k) for k in new_kernels])


class RefusalTest(unittest.TestCase):
    def test_a_kernel_that_cannot_move_is_refused_by_name(self) -> None:
        plan = model_plan(1, 0)
        plan.plan["ebc"]["t1"].compute_kernel = "key_value"  # pyre-ignore[16]
        with self.assertRaisesRegex(
            ReshardError, "module 'ebc': table 't1': its compute kernel 'key_value'"
        ):
            check_movable_kernels(plan)
        check_movable_kernels(model_plan(1, 0))

    def test_unshard_refuses_before_anything_moves(self) -> None:
        with reshard_scenario(0, 1, free_port(), num_tables=1) as s:
            model, plan = _model_with_kernel(s.env, FUSED)
            before = global_weights(model, s.pg)
            plan.plan["ebc"]["t1"].compute_kernel = "key_value"  # pyre-ignore[16]
            with self.assertRaisesRegex(ReshardError, "'key_value' cannot be moved"):
                unshard_model(model)
            after = global_weights(model, s.pg)
            self.assertEqual(sorted(before), sorted(after))
            for key in before:
                self.assertTrue(torch.equal(before[key], after[key]), key)

    def test_a_weight_that_is_not_the_shards_rectangle_is_refused(self) -> None:
        rect = Rect(0, 0, 4, 3)
        weight = torch.arange(12, dtype=torch.float32).view(4, 3)
        self.assertTrue(torch.equal(shard_weight(weight, rect, "t"), weight))
        int8_rows = torch.zeros(4, 3 + 8, dtype=torch.uint8)
        with self.assertRaisesRegex(ReshardError, r"table 't'.*\(4, 11\).*INT8"):
            shard_weight(int8_rows, rect, "t")
        with self.assertRaisesRegex(ReshardError, "key-value"):
            shard_weight([weight], rect, "t")


if __name__ == "__main__":
    unittest.main()

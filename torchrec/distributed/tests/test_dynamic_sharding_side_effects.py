#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A reshard changes the module it is given and nothing else:

* another thread that, while reshards run, draws random numbers from a seeded
  generator, builds fbgemm kernels, builds an EmbeddingBagCollection and shards
  an eval copy of the tables gets exactly what it gets without a reshard
  running, and none of its storage is the training module's;
* views a caller took before a reshard (a state dict, a fused optimizer state
  dict, a local shard) keep their values for departed tables and track the
  live table for tables that stayed in place, also through ``torch.save``;
  fresh state dicts equal a module sharded directly with the new plan;
* checkpoints (torch.distributed.checkpoint) cross a reshard both ways.
"""

import io
import tempfile
import threading
import unittest
from typing import Any, Dict, List, Set, Tuple
from unittest import mock

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    DenseTableBatchedEmbeddingBagsCodegen,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.resharding import reshard_module
from torchrec.distributed.resharding.kernel_state import batched_kernels
from torchrec.distributed.resharding.module_adapters import (
    EmbeddingBagCollectionAdapter,
)
from torchrec.distributed.test_utils.reshard_scenario import reshard_scenario
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_same_training,
    assert_state_dicts_equal,
    delta,
    make_ebc,
    make_plan,
    make_sharder,
    ReshardTestBase,
    shard,
    train_step,
)
from torchrec.distributed.types import ShardingEnv

ROWS, DIM = 64, 64
# t1 moves and t3 changes type; t0 and t2 stay where they are.
PLAN_A = {
    "t0": ("table_wise", 0),
    "t1": ("table_wise", 0),
    "t2": ("table_wise", 1),
    "t3": ("table_wise", 1),
}
PLAN_B = {
    "t0": ("table_wise", 0),
    "t1": ("table_wise", 1),
    "t2": ("table_wise", 1),
    "t3": ("column_wise", [1, 0]),
}
EVAL_PLAN = {f"t{i}": ("table_wise", i // 2) for i in range(4)}


def _storages(module: torch.nn.Module) -> Set[int]:
    """Addresses of every storage the module's kernels use."""
    out: Set[int] = set()
    for lookup in module._lookups:
        for batched in batched_kernels(lookup):
            for tensor in list(batched.emb_module.parameters()) + list(
                batched.emb_module.buffers()
            ):
                if tensor.numel() > 0:
                    out.add(tensor.untyped_storage().data_ptr())
    return out


def _local_state(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Copies of the module's local weight shards, by state-dict key."""
    return {
        key: torch.cat([s.tensor.reshape(-1) for s in value.local_shards()]).clone()
        for key, value in module.state_dict().items()
        if isinstance(value, ShardedTensor) and value.local_shards()
    }


class _Bystander:
    """
    Work another thread does while reshards run, with the results it must get:
    recorded once before any reshard starts.
    """

    def __init__(self, env: ShardingEnv, device: torch.device) -> None:
        self._env = env
        self._device = device
        self.expected: Dict[str, torch.Tensor] = self._work()[0]
        self.failures: List[str] = []
        self.rounds = 0

    def _work(self) -> Tuple[Dict[str, torch.Tensor], torch.nn.Module]:
        out: Dict[str, torch.Tensor] = {}
        out["randn"] = torch.randn(4096, generator=torch.Generator().manual_seed(7))
        fused = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            device=torch.device("cpu"),
        )
        out["fbgemm_weights"] = fused.weights_host.detach().clone()
        out["fbgemm_momentum"] = fused.momentum1_host.detach().clone()
        torch.manual_seed(11)
        dense = DenseTableBatchedEmbeddingBagsCodegen([(ROWS, DIM)], use_cpu=True)
        out["fbgemm_dense"] = dense.weights.detach().clone()
        ebc = make_ebc(4, dims=[DIM] * 4, rows=[ROWS] * 4, seed=5)
        for key, value in ebc.state_dict().items():
            out[f"ebc.{key}"] = value.clone()
        torch.manual_seed(13)
        plan = make_plan(ebc, EVAL_PLAN, 2, 2, "fused")
        copy = make_sharder("rowwise_adagrad").shard(ebc, plan, self._env, self._device)
        for key, value in _local_state(copy).items():
            out[f"eval.{key}"] = value
        return out, copy

    def run(self, rounds: int, training: torch.nn.Module, turns: "_Turns") -> None:
        try:
            for _ in range(rounds):
                turns.wait_for_build()
                got, copy = self._work()
                for key, value in self.expected.items():
                    if not torch.equal(got[key], value):
                        self.failures.append(f"round {self.rounds}: {key} differs")
                shared = _storages(copy) & _storages(training)
                if shared:
                    self.failures.append(f"round {self.rounds}: storage shared")
                self.rounds += 1
                turns.work_done()
        except Exception as e:  # reported by the main thread
            self.failures.append(f"{type(e).__name__}: {e}")
            turns.work_done()


class _Turns:
    """
    Makes the bystander's work happen while a reshard builds its new groups
    (under its kernel build hooks): the reshard pauses in the middle of
    building until the bystander finished a round.
    """

    def __init__(self, rounds: int) -> None:
        self._rounds = rounds
        self._building = threading.Event()
        self._done = threading.Event()

    def wait_for_build(self) -> None:
        assert self._building.wait(timeout=60), "no reshard started building"
        self._building.clear()

    def work_done(self) -> None:
        self._done.set()

    def pause_build(self, create_sharding: Any) -> Any:
        def paused(adapter: Any, *args: Any, **kwargs: Any) -> Any:
            sharding = create_sharding(adapter, *args, **kwargs)
            if self._rounds > 0:  # as many pauses as the bystander has rounds
                self._rounds -= 1
                lookup = sharding.create_lookup()  # kernels built under the hooks
                del lookup
                self._building.set()
                assert self._done.wait(timeout=60), "the bystander did not finish"
                self._done.clear()
            return sharding

        return paused


def _run_other_thread(rank: int, world_size: int, port: str) -> None:
    with reshard_scenario(
        rank, world_size, port, 4, dims=[DIM] * 4, rows=[ROWS] * 4
    ) as scenario:
        device, env = scenario.device, scenario.env
        plans = [scenario.plan(s) for s in (PLAN_A, PLAN_B)]
        batches = scenario.batches(2, seed=3)
        module = scenario.shard(plans[0])
        # Sharding runs collectives: the eval copies get a group of their own.
        eval_env = ShardingEnv(
            world_size, rank, dist.new_group(list(range(world_size)))
        )
        bystander = _Bystander(eval_env, device)
        rounds = 4
        turns = _Turns(rounds)
        thread = threading.Thread(target=bystander.run, args=(rounds, module, turns))
        thread.start()
        adapter = EmbeddingBagCollectionAdapter
        with mock.patch.object(
            adapter, "create_sharding", turns.pause_build(adapter.create_sharding)
        ):
            for i in range(rounds):
                train_step(module, batches[i % 2])
                reshard_module(module, delta(plans[i % 2], plans[1 - i % 2]), env)
        thread.join()
        assert (
            bystander.rounds == rounds and bystander.failures == []
        ), bystander.failures[:5]

        # And the training module itself is exactly a module sharded with B.
        reshard_module(module, delta(plans[0], plans[1]), env)
        reference = scenario.reference(plans[1], scenario.global_state(module))
        assert_same_training(reference, module, batches, "fused", device)


def _optimizer_views(module: torch.nn.Module) -> Dict[Tuple[str, str], torch.Tensor]:
    """(param key, state key) -> the local tensor of a fused optimizer state."""
    out: Dict[Tuple[str, str], torch.Tensor] = {}
    for key, state in module.fused_optimizer.state_dict()["state"].items():
        for name, value in state.items():
            if isinstance(value, ShardedTensor) and value.local_shards():
                out[(key, name)] = value.local_shards()[0].tensor
    return out


def _run_views(rank: int, world_size: int, port: str) -> None:
    with reshard_scenario(
        rank, world_size, port, 4, dims=[DIM] * 4, rows=[ROWS] * 4
    ) as scenario:
        pg, device, env = scenario.pg, scenario.device, scenario.env
        plan_a, plan_b = (scenario.plan(s) for s in (PLAN_A, PLAN_B))
        batches = scenario.batches(3, seed=9)
        module = scenario.shard(plan_a)
        train_step(module, batches[0])
        state = scenario.global_state(module)

        # What a caller holds: a state dict, an optimizer state dict, a shard.
        state_dict = module.state_dict()
        views = {
            key: value.local_shards()[0].tensor
            for key, value in state_dict.items()
            if isinstance(value, ShardedTensor) and value.local_shards()
        }
        optimizer_views = _optimizer_views(module)
        before = {k: v.clone() for k, v in views.items()}
        optimizer_before = {k: v.clone() for k, v in optimizer_views.items()}

        report = reshard_module(module, delta(plan_a, plan_b), env)
        kept_tables = report.tables_kept_in_place.get("", [])
        kept = {f"embedding_bags.{t}.weight" for t in kept_tables}
        departed = set(views) - kept
        assert departed, "the test needs a table that leaves this rank's kernels"

        # A background checkpoint writer saves the old state dict now.
        buffer = io.BytesIO()
        torch.save({k: v for k, v in views.items()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
        for key in views:
            assert torch.equal(views[key], before[key]), key
            assert torch.equal(saved[key], before[key]), key
            assert bool(before[key].ne(0).any()), key  # the values are real
        for key, view in optimizer_views.items():
            assert torch.equal(view, optimizer_before[key]), key

        # Fresh state dicts equal a module sharded directly with the new plan.
        reference = scenario.reference(plan_b, state)
        assert_state_dicts_equal(reference.state_dict(), module.state_dict())
        assert_optimizer_states_equal(reference, module)

        # Training on: kept tables' views track the live table, departed
        # tables' views keep the values they had.
        assert_same_training(reference, module, batches[1:], "fused", device)
        live = _local_state(module)
        for key in views:
            if key in kept:
                assert torch.equal(views[key].reshape(-1), live[key]), key
                assert not torch.equal(views[key], before[key]), key
            else:
                assert torch.equal(views[key], before[key]), key
        outcome: List[Any] = [None] * world_size
        dist.all_gather_object(outcome, sorted(kept), group=pg)
        assert any(outcome), "some table must have stayed in place somewhere"


def _save(module: torch.nn.Module, path: str, pg: dist.ProcessGroup) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": module.state_dict(), "optim": module.fused_optimizer.state_dict()}
    dcp.save(state, checkpoint_id=path, process_group=pg)


def _load(module: torch.nn.Module, path: str, pg: dist.ProcessGroup) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": module.state_dict(), "optim": module.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path, process_group=pg)
    module.load_state_dict(state["model"])
    module.fused_optimizer.load_state_dict(state["optim"])


def _run_checkpoints(rank: int, world_size: int, port: str, path: str) -> None:
    """
    A checkpoint (torch.distributed.checkpoint) of a resharded module loads
    into a module sharded directly with the new plan, and the other way round:
    for code that reads by key, the two are indistinguishable.
    """
    with reshard_scenario(
        rank, world_size, port, 4, dims=[DIM] * 4, rows=[ROWS] * 4
    ) as scenario:
        pg, device, env = scenario.pg, scenario.device, scenario.env
        sharder = scenario.sharder
        plan_a, plan_b = (scenario.plan(s) for s in (PLAN_A, PLAN_B))
        batches = scenario.batches(4, seed=21)
        resharded = scenario.shard(plan_a)
        train_step(resharded, batches[0])
        reshard_module(resharded, delta(plan_a, plan_b), env)
        train_step(resharded, batches[1])

        direct = shard(
            make_ebc(4, dims=[DIM] * 4, rows=[ROWS] * 4, seed=99),
            sharder,
            plan_b,
            env,
            device,
        )
        _save(resharded, f"{path}/resharded", pg)
        _load(direct, f"{path}/resharded", pg)
        assert_state_dicts_equal(resharded.state_dict(), direct.state_dict())
        assert_optimizer_states_equal(resharded, direct)

        train_step(direct, batches[2])  # the direct one moves ahead ...
        _save(direct, f"{path}/direct", pg)
        _load(resharded, f"{path}/direct", pg)  # ... and the resharded follows
        assert_state_dicts_equal(direct.state_dict(), resharded.state_dict())
        assert_optimizer_states_equal(direct, resharded)
        assert_same_training(direct, resharded, batches[3:], "fused", device)


class ReshardSideEffectsTest(ReshardTestBase):
    def test_checkpoints_cross_a_reshard(self) -> None:
        with tempfile.TemporaryDirectory() as path:
            self.run_ranks(_run_checkpoints, path=path)

    def test_other_thread_sees_nothing_of_a_reshard(self) -> None:
        self.run_ranks(_run_other_thread)

    def test_views_taken_before_a_reshard_keep_their_values(self) -> None:
        self.run_ranks(_run_views)


if __name__ == "__main__":
    unittest.main()

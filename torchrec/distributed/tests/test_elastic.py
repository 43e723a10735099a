#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Moving a running model onto another set of ranks (4 gloo ranks): shrink
4 -> 2 (ranks 2, 3 leave), a move to a disjoint set (0, 1 -> 2, 3), grow
2 -> 4 (ranks 0, 1 join), 4 -> 3. The model holds an EmbeddingBagCollection
with data-parallel, table-wise, column-wise and row-wise tables, an
EmbeddingCollection and a dense part, trained with fused row-wise Adagrad for
the tables and SGD with momentum for the dense part. After each move the
state (weights, fused and dense optimizer state) is bit-equal to a model built
directly on the new group with the new plan from the same global state, and so
is every training step after it, on the same global batches. Ranks that leave
keep nothing of the model; a dry run reports exactly the bytes each rank
sends and receives. The new model's modules make their ShardedTensors from
the plan's metadata (no gather) only for a plan that lists every table's
shards in rank order (the shrink), and gather otherwise.
"""

import gc
import unittest
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding import ReshardAbortedError, ReshardOptions, slots
from torchrec.distributed.resharding.elastic import (
    _shards_in_rank_order,
    dry_run_move,
    move_model,
)
from torchrec.distributed.resharding.slots import read_piece
from torchrec.distributed.test_utils.reshard_model_utils import (
    global_model_state,
    group_envs,
    kernel_refs,
    make_dense_optimizer,
    model_definition,
    model_plan,
    model_sharders,
    reference_model,
    shard_addresses,
    sharded_model,
    share_from,
    train_model,
    WORLD,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_dense_optimizer_states_equal,
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    BoundedMultiProcessContext,
    ReshardTestBase,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan

# growing (2, 3) -> (0, 1, 2, 3) with plan shift 2 leaves ebc's t1 (table-wise)
# on rank 2 and the two column shards of t2 on ranks 3 and 2: their new kernels
# take over the old kernels' storage.
KEPT: Dict[int, List[str]] = {2: ["ebc.embedding_bags.t1.weight"], 3: []}
KEPT[2].append("ebc.embedding_bags.t2.weight")
KEPT[3].append("ebc.embedding_bags.t2.weight")


def _failing_read_piece() -> Callable[..., torch.Tensor]:
    """``read_piece`` that raises on the second piece a rank reads."""
    seen: List[int] = []

    def failing(slot: Any, transfer: Any, f: Any) -> torch.Tensor:
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("injected fault in the middle of the move")
        return read_piece(slot, transfer, f)

    return failing


def _failed_move(
    rank: int,
    model: Optional[nn.Module],
    optimizer: Any,
    plan: ShardingPlan,
    old: Tuple[int, ...],
    new: Tuple[int, ...],
    envs: Dict[Tuple[int, ...], Optional[ShardingEnv]],
    groups: Dict[Tuple[int, ...], dist.ProcessGroup],
) -> None:
    """
    A move that fails in the exchange, after every rank built the new model
    (whose kept shards share the old kernels' storage): every rank raises and
    the old model is bit-identical to before, its kept shards where they were.
    """
    before = global_model_state(model, optimizer, groups[old]) if rank in old else None
    addresses = shard_addresses(model, KEPT[rank]) if rank in KEPT else {}
    read = _failing_read_piece() if rank == old[0] else read_piece
    try:
        with mock.patch.object(slots, "read_piece", read):
            move_model(
                model if rank in old else None,
                plan,
                envs[new],
                participants=sorted(set(old) | set(new)),
                definition=model_definition() if rank not in old else None,
                sharders=model_sharders() if rank not in old else None,
                optimizer=optimizer if rank in old else None,
                make_optimizer=make_dense_optimizer,
                options=ReshardOptions(exchange_timeout=timedelta(seconds=10)),
            )
    except ReshardAbortedError as e:
        assert "unchanged" in str(e), e
    else:
        raise AssertionError("the injected fault must abort the move")
    if rank in old:
        weights, fused, dense = global_model_state(model, optimizer, groups[old])
        assert before is not None
        for key, value in before[0].items():
            assert torch.equal(weights[key], value), key
        for key, value in before[1].items():
            assert torch.equal(fused[key], value), key
        for name, value in before[2]["state"].items():
            assert all(
                torch.equal(dense["state"][name][k], v) for k, v in value.items()
            )
        assert shard_addresses(model, KEPT.get(rank, [])) == addresses


def _table_configs(model: nn.Module) -> List[Any]:
    return model.ebc.embedding_bag_configs() + model.ec.embedding_configs()


def _run_moves(rank: int, world_size: int, port: str) -> None:
    with BoundedMultiProcessContext(rank, world_size, port, local_size=2) as context:
        device = context.device
        groups, envs = group_envs(rank)
        # (old group, new group, plan shift): shrink, disjoint, grow, 4 -> 3
        moves = [((0, 1, 2, 3), (0, 1), 1), ((0, 1), (2, 3), 0)]
        moves += [((2, 3), (0, 1, 2, 3), 2), ((0, 1, 2, 3), (0, 1, 2), 1)]

        start = (0, 1, 2, 3)
        model: Optional[nn.Module] = None
        optimizer: Any = None
        env = envs[start]
        assert env is not None
        model = sharded_model(env, model_plan(4, 0), device)
        optimizer = make_dense_optimizer(model)
        step = 0
        for index in range(2):
            train_model(model, optimizer, step, start.index(rank))
            step += 1

        for old, new, shift in moves:
            plan = model_plan(len(new), shift)
            state = None
            if rank in old:
                state = global_model_state(model, optimizer, groups[old])
            state = share_from(state, old[0])
            if old == (2, 3):
                _failed_move(rank, model, optimizer, plan, old, new, envs, groups)
            kept = old == (2, 3) and rank in KEPT
            addresses = shard_addresses(model, KEPT[rank]) if kept else {}
            refs = kernel_refs(model) if model is not None else []
            participants = sorted(set(old) | set(new))
            definition, configs, inits = None, [], []
            if rank not in old:
                definition = model_definition()
                configs = _table_configs(definition)
                for config in configs:
                    config.init_fn = lambda w, n=config.name, out=inits: out.append(n)
            dry = dry_run_move(
                model if rank in old else None,
                plan,
                envs[new],
                participants=participants,
                definition=model_definition() if rank not in old else None,
                sharders=model_sharders() if rank not in old else None,
            )
            gc.disable()
            try:
                moved = move_model(
                    model if rank in old else None,
                    plan,
                    envs[new],
                    participants=participants,
                    definition=definition,
                    sharders=model_sharders() if rank not in old else None,
                    optimizer=optimizer if rank in old else None,
                    make_optimizer=make_dense_optimizer,
                )
                # the old model is released at once, even while still held
                assert all(r() is None for r in refs), (old, new)
            finally:
                gc.enable()
            assert moved.left == (rank not in new)
            # the dry run said exactly what would move
            assert moved.report.bytes_sent == dry.bytes_sent_by_rank[rank], (dry, moved)
            assert moved.report.bytes_received == dry.bytes_received_by_rank[rank], dry
            # every byte is moved in: no table is initialised for nothing, and
            # the definition's init functions are back afterwards
            assert inits == [], inits
            for config in configs:
                config.init_fn(torch.empty(0))
            assert len(inits) == len(configs), inits
            model, optimizer = moved.model, moved.optimizer
            if kept:
                # shards that stay put keep their storage: nothing copied
                assert shard_addresses(model, KEPT[rank]) == addresses
                assert moved.report.bytes_kept_in_place > 0, moved.report
            if rank not in old or rank not in new:
                assert moved.report.bytes_kept_in_place == 0, moved.report
            if rank in new:
                env = envs[new]
                assert env is not None
                reference, ref_optimizer = reference_model(env, plan, state)
                assert_state_dicts_equal(reference.state_dict(), model.state_dict())
                assert_optimizer_states_equal(reference, model)
                assert_dense_optimizer_states_equal(optimizer, ref_optimizer)
                for _ in range(2):
                    index = new.index(rank)
                    out = train_model(model, optimizer, step, index)
                    ref = train_model(reference, ref_optimizer, step, index)
                    assert torch.equal(out, ref), (old, new)
                    step += 1
                assert_state_dicts_equal(reference.state_dict(), model.state_dict())
                assert_optimizer_states_equal(reference, model)
            else:
                step += 2
            dist.barrier()


class ElasticTest(ReshardTestBase):
    def test_shrink_disjoint_grow_and_three(self) -> None:
        self.run_ranks(_run_moves, world_size=WORLD)

    def test_sharded_tensors_from_metadata_only_for_shards_in_rank_order(
        self,
    ) -> None:
        # the shrink to 2 ranks lists every table's shards in rank order: its
        # new modules make their ShardedTensors from the plan; the other moves
        # list t2's column shards against it: their new modules gather, as a
        # module sharded directly does (either way the same state dict)
        self.assertTrue(_shards_in_rank_order(model_plan(2, 1)))
        for size, shift in ((2, 0), (4, 2), (3, 1)):
            self.assertFalse(_shards_in_rank_order(model_plan(size, shift)))


if __name__ == "__main__":
    unittest.main()

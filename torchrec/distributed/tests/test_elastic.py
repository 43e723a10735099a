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
sends and receives.
"""

import gc
import unittest
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.resharding import (
    ReshardAbortedError,
    ReshardOptions,
    transaction,
)
from torchrec.distributed.resharding.elastic import dry_run_move, move_model
from torchrec.distributed.resharding.kernel_state import batched_kernels, read_piece
from torchrec.distributed.test_utils.reshard_ec_utils import make_ec, make_ec_sharder
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    global_optimizer_state,
    global_weights,
    load_global_state,
    make_batches,
    make_ebc,
    make_plan,
    make_sharder,
    process_group,
    ReshardTestBase,
    TableSpec,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
)
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

WORLD = 4
DIM = 16
GROUPS: List[List[int]] = [[0, 1, 2, 3], [0, 1], [2, 3], [0, 1, 2]]
# growing (2, 3) -> (0, 1, 2, 3) with plan shift 2 leaves ebc's t1 (table-wise)
# on rank 2 and the two column shards of t2 on ranks 3 and 2: their new kernels
# take over the old kernels' storage.
KEPT: Dict[int, List[str]] = {2: ["ebc.embedding_bags.t1.weight"], 3: []}
KEPT[2].append("ebc.embedding_bags.t2.weight")
KEPT[3].append("ebc.embedding_bags.t2.weight")


class _Model(nn.Module):
    """Pooled (EBC) and sequence (EC) embeddings and a dense layer."""

    def __init__(self, ebc: EmbeddingBagCollection, ec: EmbeddingCollection) -> None:
        super().__init__()
        self.ebc = ebc
        self.ec = ec
        self.dense = nn.Linear(DIM, DIM)

    def forward(self, batch: Tuple[KeyedJaggedTensor, KeyedJaggedTensor]) -> Any:
        pooled = self.ebc(batch[0]).to_dict()
        sequences = self.ec(batch[1])
        x = torch.cat([pooled[k] for k in sorted(pooled)], dim=0)
        return torch.cat(
            [self.dense(x).flatten()]
            + [sequences[k].values().flatten() for k in sorted(sequences.keys())]
        )


def _on_meta(module: nn.Module) -> nn.Module:
    """The same embedding tables, built on the meta device (no weights)."""
    meta = torch.device("meta")
    if isinstance(module, EmbeddingCollection):
        return EmbeddingCollection(tables=module.embedding_configs(), device=meta)
    return EmbeddingBagCollection(tables=module.embedding_bag_configs(), device=meta)


def _definition(
    device: str = "meta", seed: int = 1, ebc_rows: Optional[Sequence[int]] = None
) -> _Model:
    ebc = make_ebc(4, dims=[DIM] * 4, rows=ebc_rows, seed=seed)
    ec = make_ec(2, dim=DIM, seed=seed + 1)
    torch.manual_seed(seed + 2)
    model = _Model(ebc, ec)
    if device == "cpu":
        return model
    model.dense.to("meta")
    model.ebc, model.ec = _on_meta(ebc), _on_meta(ec)
    return model


def _specs(size: int, shift: int) -> Dict[str, Dict[str, TableSpec]]:
    last = size - 1
    return {
        "ebc": {
            "t0": ("data_parallel", None),
            "t1": ("table_wise", shift % size),
            "t2": ("column_wise", [(shift + 1) % size, shift % size]),
            "t3": ("row_wise", None),
        },
        "ec": {"t0": ("table_wise", last - shift % size), "t1": ("row_wise", None)},
    }


def _plan(size: int, shift: int) -> ShardingPlan:
    model = _definition("cpu")
    specs = _specs(size, shift)
    return ShardingPlan(
        {
            name: make_plan(getattr(model, name), specs[name], size, size, "fused")
            for name in ("ebc", "ec")
        }
    )


def _sharders() -> List[Any]:
    return [make_sharder("rowwise_adagrad"), make_ec_sharder("rowwise_adagrad")]


def _make_optimizer(model: nn.Module) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    )


def _batch(step: int, index: int) -> Tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """The batch of a group's index-th rank at a step (the same global batch)."""
    ebc_rows = [24 + 3 * i for i in range(4)]
    return (
        make_batches(4, ebc_rows, 1, 3, seed=1000 * step + index)[0],
        make_batches(2, [16, 16], 1, 3, seed=2000 * step + index)[0],
    )


def _train(model: nn.Module, optimizer: Any, step: int, index: int) -> torch.Tensor:
    optimizer.zero_grad()
    out = model(_batch(step, index))
    (out**2).sum().backward()
    optimizer.step()
    return out.detach()


def _shapes(model: nn.Module) -> Dict[str, Tuple[int, int]]:
    return {
        key: tuple(value.size())
        for key, value in model.state_dict().items()
        if key.startswith(("ebc.", "ec.")) and value.dim() == 2
    }


def _global_state(model: Any, optimizer: Any, pg: dist.ProcessGroup) -> Any:
    weights = global_weights(model, pg)
    fused = global_optimizer_state(model, pg, _shapes(model))
    return weights, fused, optimizer.state_dict()


def _share(state: Any, src: int) -> Any:
    """A state known on rank ``src``, on every rank of the world."""
    box = [state if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _reference(
    env: ShardingEnv, plan: ShardingPlan, state: Any
) -> Tuple[nn.Module, Any]:
    model = DistributedModelParallel(
        _definition(),
        env=env,
        device=torch.device("cpu"),
        plan=plan,
        sharders=_sharders(),
    )
    weights, fused, dense_state = state
    load_global_state(model, weights, fused)
    optimizer = _make_optimizer(model)
    optimizer.init_state()
    optimizer.load_state_dict(dense_state)
    return model, optimizer


def _kernel_refs(model: nn.Module) -> List["weakref.ReferenceType[nn.Module]"]:
    return [
        weakref.ref(b.emb_module)
        for m in model.modules()
        if hasattr(m, "_lookups")
        for lookup in m._lookups
        for b in batched_kernels(lookup)
    ]


def _shard_addresses(model: nn.Module, keys: Sequence[str]) -> Dict[str, List[int]]:
    """Where the local shards of some tables of a model live."""
    state = model.state_dict()
    return {
        key: [s.tensor.data_ptr() for s in state[key].local_shards()] for key in keys
    }


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
    before = _global_state(model, optimizer, groups[old]) if rank in old else None
    addresses = _shard_addresses(model, KEPT[rank]) if rank in KEPT else {}
    read = _failing_read_piece() if rank == old[0] else read_piece
    try:
        with mock.patch.object(transaction, "read_piece", read):
            move_model(
                model if rank in old else None,
                plan,
                envs[new],
                participants=sorted(set(old) | set(new)),
                definition=_definition() if rank not in old else None,
                sharders=_sharders() if rank not in old else None,
                optimizer=optimizer if rank in old else None,
                make_optimizer=_make_optimizer,
                options=ReshardOptions(exchange_timeout=timedelta(seconds=10)),
            )
    except ReshardAbortedError as e:
        assert "unchanged" in str(e), e
    else:
        raise AssertionError("the injected fault must abort the move")
    if rank in old:
        weights, fused, dense = _global_state(model, optimizer, groups[old])
        assert before is not None
        for key, value in before[0].items():
            assert torch.equal(weights[key], value), key
        for key, value in before[1].items():
            assert torch.equal(fused[key], value), key
        for name, value in before[2]["state"].items():
            assert all(
                torch.equal(dense["state"][name][k], v) for k, v in value.items()
            )
        assert _shard_addresses(model, KEPT.get(rank, [])) == addresses


def _table_configs(model: nn.Module) -> List[Any]:
    return model.ebc.embedding_bag_configs() + model.ec.embedding_configs()


def _run_moves(rank: int, world_size: int, port: str) -> None:
    with process_group(rank, world_size, port, local_size=2) as (world, device):
        groups = {tuple(g): dist.new_group(g) for g in GROUPS}  # every rank, in order
        envs = {
            g: ShardingEnv.from_process_group(pg) if rank in g else None
            for g, pg in groups.items()
        }
        # (old group, new group, plan shift): shrink, disjoint, grow, 4 -> 3
        moves = [((0, 1, 2, 3), (0, 1), 1), ((0, 1), (2, 3), 0)]
        moves += [((2, 3), (0, 1, 2, 3), 2), ((0, 1, 2, 3), (0, 1, 2), 1)]

        start = (0, 1, 2, 3)
        model: Optional[nn.Module] = None
        optimizer: Any = None
        env = envs[start]
        assert env is not None
        model = DistributedModelParallel(
            _definition(),
            env=env,
            device=device,
            plan=_plan(4, 0),
            sharders=_sharders(),
        )
        model.load_state_dict(_definition("cpu").state_dict())
        optimizer = _make_optimizer(model)
        step = 0
        for index in range(2):
            _train(model, optimizer, step, start.index(rank))
            step += 1

        for old, new, shift in moves:
            plan = _plan(len(new), shift)
            state = None
            if rank in old:
                state = _global_state(model, optimizer, groups[old])
            state = _share(state, old[0])
            if old == (2, 3):
                _failed_move(rank, model, optimizer, plan, old, new, envs, groups)
            kept = old == (2, 3) and rank in KEPT
            addresses = _shard_addresses(model, KEPT[rank]) if kept else {}
            refs = _kernel_refs(model) if model is not None else []
            participants = sorted(set(old) | set(new))
            definition, configs, inits = None, [], []
            if rank not in old:
                definition = _definition()
                configs = _table_configs(definition)
                for config in configs:
                    config.init_fn = lambda w, n=config.name, out=inits: out.append(n)
            dry = dry_run_move(
                model if rank in old else None,
                plan,
                envs[new],
                participants=participants,
                definition=_definition() if rank not in old else None,
                sharders=_sharders() if rank not in old else None,
            )
            gc.disable()
            try:
                moved = move_model(
                    model if rank in old else None,
                    plan,
                    envs[new],
                    participants=participants,
                    definition=definition,
                    sharders=_sharders() if rank not in old else None,
                    optimizer=optimizer if rank in old else None,
                    make_optimizer=_make_optimizer,
                )
                # the old model is released at once, even while still held
                assert all(r() is None for r in refs), (old, new)
            finally:
                gc.enable()
            assert moved.left == (rank not in new)
            # the dry run said exactly what would move
            assert moved.report.bytes_sent == dry.bytes_sent[rank], (dry, moved)
            assert moved.report.bytes_received == dry.bytes_received[rank], dry
            # every byte is moved in: no table is initialised for nothing, and
            # the definition's init functions are back afterwards
            assert inits == [], inits
            for config in configs:
                config.init_fn(torch.empty(0))
            assert len(inits) == len(configs), inits
            model, optimizer = moved.model, moved.optimizer
            if kept:
                # shards that stay put keep their storage: nothing copied
                assert _shard_addresses(model, KEPT[rank]) == addresses
                assert moved.report.bytes_kept_in_place > 0, moved.report
            if rank not in old or rank not in new:
                assert moved.report.bytes_kept_in_place == 0, moved.report
            if rank in new:
                env = envs[new]
                assert env is not None
                reference, ref_optimizer = _reference(env, plan, state)
                assert_state_dicts_equal(reference.state_dict(), model.state_dict())
                assert_optimizer_states_equal(reference, model)
                for name, value in ref_optimizer.state_dict()["state"].items():
                    got = optimizer.state_dict()["state"][name]
                    assert all(torch.equal(got[k], v) for k, v in value.items()), name
                for _ in range(2):
                    index = new.index(rank)
                    out = _train(model, optimizer, step, index)
                    ref = _train(reference, ref_optimizer, step, index)
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


if __name__ == "__main__":
    unittest.main()

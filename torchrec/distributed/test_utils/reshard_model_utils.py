#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A model scenario for the moves between groups of ranks (elastic, unshard,
shard from a rank) and the transaction tests: a ``DistributedModelParallel``
of pooled (EBC) and sequence (EC) embeddings and a dense layer, its plans for
any group size, its batches, a training step, and the oracle: the global
state gathered with plain collectives and a reference model built directly
on a group from it.
"""

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.resharding.kernel_state import batched_kernels
from torchrec.distributed.test_utils.model_zoo import (  # noqa: F401
    EMBEDDINGS_MODEL_DIM,
    EmbeddingsModel,
    equal_tables_dlrm,
    model_definition,
    on_meta,
)
from torchrec.distributed.test_utils.reshard_ec_utils import make_ec_sharder
from torchrec.distributed.test_utils.reshard_utils import (
    global_optimizer_state,
    global_weights,
    load_global_state,
    make_batches,
    make_plan,
    make_sharder,
    TableSpec,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# the world of the scenario and the groups a model moves between
WORLD = 4
DIM: int = EMBEDDINGS_MODEL_DIM
GROUPS: List[List[int]] = [[0, 1, 2, 3], [0, 1], [2, 3], [0, 1, 2]]


def group_envs(
    rank: int,
) -> Tuple[
    Dict[Tuple[int, ...], dist.ProcessGroup],
    Dict[Tuple[int, ...], Optional[ShardingEnv]],
]:
    """
    Creates the process groups of :data:`GROUPS` (every rank creates every
    group, in the same order) and this rank's environments on them.

    Args:
        rank (int): this rank.

    Returns:
        Tuple[Dict[Tuple[int, ...], dist.ProcessGroup], Dict[Tuple[int, ...],
        Optional[ShardingEnv]]]: the groups, and the environment of each group
        this rank is a member of (None for the others), by the group's ranks.
    """
    groups = {tuple(g): dist.new_group(g) for g in GROUPS}
    envs = {
        g: ShardingEnv.from_process_group(pg) if rank in g else None
        for g, pg in groups.items()
    }
    return groups, envs


def model_specs(size: int, shift: int) -> Dict[str, Dict[str, TableSpec]]:
    """The table specs of the model on ``size`` ranks, placements rotated by ``shift``."""
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


def model_plan(
    size: int, shift: int, device_type: str = "cpu", kernel: str = "fused"
) -> ShardingPlan:
    """The ShardingPlan of :func:`model_specs` (``kernel`` for the tables that
    are not data-parallel), placed on ``device_type`` devices."""
    model = model_definition("cpu")
    specs = model_specs(size, shift)
    return ShardingPlan(
        {
            name: make_plan(
                getattr(model, name), specs[name], size, size, kernel, device_type
            )
            for name in ("ebc", "ec")
        }
    )


def model_sharders() -> List[Any]:
    """The model's sharders (EBC and EC, fused row-wise Adagrad)."""
    return [make_sharder("rowwise_adagrad"), make_ec_sharder("rowwise_adagrad")]


def make_dense_optimizer(model: nn.Module) -> KeyedOptimizerWrapper:
    """SGD with momentum for the parameters the fused optimizer does not update."""
    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    )


def model_batch(step: int, index: int) -> Tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """The batch of a group's index-th rank at a step (the same global batch)."""
    ebc_rows = [24 + 3 * i for i in range(4)]
    return (
        make_batches(4, ebc_rows, 1, 3, seed=1000 * step + index)[0],
        make_batches(2, [16, 16], 1, 3, seed=2000 * step + index)[0],
    )


def train_model(
    model: nn.Module, optimizer: Any, step: int, index: int
) -> torch.Tensor:
    """One training step of a group's ``index``-th rank; the outputs."""
    optimizer.zero_grad()
    out = model(model_batch(step, index))
    (out**2).sum().backward()
    optimizer.step()
    return out.detach()


def global_model_state(model: Any, optimizer: Any, pg: dist.ProcessGroup) -> Any:
    """
    The oracle's view of a model, gathered with plain collectives: global
    weights, global fused optimizer state and the dense optimizer's state.
    """
    weights = global_weights(model, pg)
    fused = global_optimizer_state(model, pg)
    return weights, fused, optimizer.state_dict()


def share_from(state: Any, src: int) -> Any:
    """A state known on rank ``src``, on every rank of the world."""
    box = [state if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def sharded_model(
    env: ShardingEnv,
    plan: ShardingPlan,
    device: Optional[torch.device] = None,
    weights: bool = True,
) -> nn.Module:
    """
    The model sharded directly under ``plan`` over ``env``, with the weights
    of ``model_definition("cpu")`` (or its own initial ones without
    ``weights``).
    """
    model = DistributedModelParallel(
        model_definition(),
        env=env,
        device=device or torch.device("cpu"),
        plan=plan,
        sharders=model_sharders(),
    )
    if weights:
        model.load_state_dict(model_definition("cpu").state_dict())
    return model


def reference_model(
    env: ShardingEnv, plan: ShardingPlan, state: Any
) -> Tuple[nn.Module, Any]:
    """
    The reference: the model sharded directly under ``plan`` and loaded with
    ``state`` (from :func:`global_model_state`), with its dense optimizer.
    """
    return load_model_state(
        sharded_model(env, plan, weights=False), state, make_dense_optimizer
    )


def load_model_state(
    model: nn.Module, state: Any, make_optimizer: Callable[[nn.Module], Any]
) -> Tuple[nn.Module, Any]:
    """
    Loads a global state (weights, fused optimizer state, dense optimizer
    state, as :func:`global_model_state` gathers it) into a sharded model and
    a dense optimizer made for it.

    Args:
        model (nn.Module): the sharded model.
        state (Any): the global state.
        make_optimizer (Callable[[nn.Module], Any]): makes the dense optimizer.

    Returns:
        Tuple[nn.Module, Any]: the model and its optimizer.
    """
    weights, fused, dense_state = state
    load_global_state(model, weights, fused)
    optimizer = make_optimizer(model)
    optimizer.init_state()
    optimizer.load_state_dict(dense_state)
    return model, optimizer


def kernel_refs(model: nn.Module) -> List["weakref.ReferenceType[nn.Module]"]:
    """Weak references to every batched kernel of a model (to see them freed)."""
    return [
        weakref.ref(b.emb_module)
        for m in model.modules()
        if hasattr(m, "_lookups")
        for lookup in m._lookups
        for b in batched_kernels(lookup)
    ]


def shard_addresses(model: nn.Module, keys: Sequence[str]) -> Dict[str, List[int]]:
    """Where the local shards of some tables of a model live."""
    state = model.state_dict()
    return {
        key: [s.tensor.data_ptr() for s in state[key].local_shards()] for key in keys
    }

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Per-kernel state for live resharding: every local shard of a sharded module's
lookups as a :class:`~torchrec.distributed.resharding.slots.LocalSlot` (the
weight and the fused optimizer state that follow its rectangle, as views into
the batched kernels' storage, each with the kind the optimizer's state layout
gives it); the runner reads and writes them (``slots``).
"""

from typing import Any, Dict, Iterator, List, Mapping, Sequence

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
    BatchedFusedEmbedding,
    BatchedFusedEmbeddingBag,
)
from torchrec.distributed.resharding.fields import FieldKind, WEIGHT
from torchrec.distributed.resharding.plan import Rect, ReshardError
from torchrec.distributed.resharding.slots import LocalSlot, SlotKey


def unwrap_lookup(lookup: nn.Module) -> nn.Module:
    """
    Args:
        lookup (nn.Module): a lookup, possibly wrapped in DDP (data parallel).

    Returns:
        nn.Module: the lookup itself.
    """
    while isinstance(lookup, DistributedDataParallel):
        lookup = lookup.module
    return lookup


def batched_kernels(lookup: nn.Module) -> Iterator[nn.Module]:
    """
    Args:
        lookup (nn.Module): a lookup of a sharded module.

    Returns:
        Iterator[nn.Module]: its TorchRec batched kernels, in module order.
    """
    for module in unwrap_lookup(lookup).modules():
        if isinstance(module, (BaseBatchedEmbedding, BaseBatchedEmbeddingBag)):
            yield module


def is_fused(batched: nn.Module) -> bool:
    """Whether a batched kernel trains with a fused optimizer."""
    return isinstance(batched, (BatchedFusedEmbedding, BatchedFusedEmbeddingBag))


def shard_rect(table_config: Any) -> Rect:
    """
    Args:
        table_config (ShardedEmbeddingTable): a table of a batched kernel.

    Returns:
        Rect: the local shard it holds, in global coordinates.
    """
    metadata = table_config.local_metadata
    if metadata is None:
        return Rect(0, 0, table_config.num_embeddings, table_config.embedding_dim)
    return Rect.from_shard_metadata(metadata)


def local_slots(lookups: Sequence[nn.Module]) -> Dict[SlotKey, LocalSlot]:
    """
    Args:
        lookups (Sequence[nn.Module]): lookups of a sharded module.

    Returns:
        Dict[SlotKey, LocalSlot]: every local shard, keyed by table and rectangle.
    """
    slots: Dict[SlotKey, LocalSlot] = {}
    for lookup in lookups:
        for batched in batched_kernels(lookup):
            tables = batched.config.embedding_tables
            # A cached kernel holds the newest values of its hot rows in its
            # cache: write them back before the weights are read.
            batched.flush()
            weights = batched.split_embedding_weights()
            states: List[Mapping[str, torch.Tensor]] = [{} for _ in tables]
            if is_fused(batched):
                # Stateless optimizers (SGD) report no entries at all.
                for i, state in enumerate(batched.emb_module.get_optimizer_state()):
                    states[i] = state or {}
            layout = optimizer_state_layout(batched) if is_fused(batched) else {}
            for table, weight, state in zip(tables, weights, states):
                rect = shard_rect(table)
                tensors: Dict[str, torch.Tensor] = {
                    WEIGHT: shard_weight(weight, rect, table.name)
                }
                kinds: Dict[str, FieldKind] = {WEIGHT: FieldKind.RECT}
                for key, value in state.items():
                    kind = _state_kind(batched, layout, key)
                    tensors[key] = _shaped(value, kind, rect, table.name, key)
                    kinds[key] = kind
                slots[(table.name, rect)] = LocalSlot(table.name, rect, tensors, kinds)
    return slots


def shard_weight(weight: Any, rect: Rect, table: str) -> torch.Tensor:
    """
    A kernel's weight of one shard, checked against the shard's rectangle.

    Args:
        weight (Any): what the kernel's ``split_embedding_weights`` gave.
        rect (Rect): the shard.
        table (str): the table (for messages).

    Returns:
        torch.Tensor: the weight, detached.

    Raises:
        ReshardError: when the weight is not a ``rows x cols`` tensor (INT8
            rows carry a scale and a bias after their columns; a key-value
            kernel gives no tensor): its bytes cannot be moved column by
            column.
    """
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (
        rect.rows,
        rect.cols,
    ):
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        raise ReshardError(
            f"table '{table}': the kernel's weight of its {rect.rows}x{rect.cols} "
            f"shard is {shape if shape is not None else type(weight).__name__} "
            f"({getattr(weight, 'dtype', '')}), not the shard's rectangle (INT8 "
            "rows carry their scale and bias; key-value kernels hold rows "
            "elsewhere): it cannot be resharded"
        )
    return weight.detach()


def invalidate_caches(lookups: Sequence[nn.Module]) -> None:
    """
    Empties the caches of the batched kernels of ``lookups`` (new kernels
    whose weights were just written): their next lookup reads the weights.

    Args:
        lookups (Sequence[nn.Module]): lookups of a sharded module.

    Returns:
        None
    """
    for lookup in lookups:
        for batched in batched_kernels(lookup):
            batched.purge()


# How each state of fbgemm's fused optimizers follows a table's rectangles, by
# optimizer, as fbgemm lays it out (``split_optimizer_states``): per element,
# per row, or one value for the whole kernel.
_ROWWISE_ADAGRAD: Dict[str, FieldKind] = {
    "sum": FieldKind.ROWS,
    "prev_iter": FieldKind.ROWS,
    "row_counter": FieldKind.ROWS,
    "iter": FieldKind.SCALAR,
}
_STATE_LAYOUTS: Dict[EmbOptimType, Dict[str, FieldKind]] = {
    EmbOptimType.EXACT_SGD: {},
    EmbOptimType.SGD: {},
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: _ROWWISE_ADAGRAD,
    EmbOptimType.ROWWISE_ADAGRAD: _ROWWISE_ADAGRAD,
    EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD: _ROWWISE_ADAGRAD,
    EmbOptimType.EXACT_ADAGRAD: {**_ROWWISE_ADAGRAD, "sum": FieldKind.RECT},
    EmbOptimType.ADAM: {
        "exp_avg": FieldKind.RECT,
        "exp_avg_sq": FieldKind.RECT,
        "row_counter": FieldKind.ROWS,
    },
    EmbOptimType.LAMB: {"exp_avg": FieldKind.RECT, "exp_avg_sq": FieldKind.RECT},
    EmbOptimType.PARTIAL_ROWWISE_ADAM: {
        "exp_avg": FieldKind.RECT,
        "exp_avg_sq": FieldKind.ROWS,
    },
    EmbOptimType.PARTIAL_ROWWISE_LAMB: {
        "exp_avg": FieldKind.RECT,
        "exp_avg_sq": FieldKind.ROWS,
    },
    EmbOptimType.ENSEMBLE_ROWWISE_ADAGRAD: {
        "sum": FieldKind.ROWS,
        "sparse_ema": FieldKind.ROWS,
    },
}


def optimizer_state_layout(batched: nn.Module) -> Dict[str, FieldKind]:
    """
    Args:
        batched (nn.Module): a fused batched kernel.

    Returns:
        Dict[str, FieldKind]: how each of its optimizer states follows a
        table's rectangles.

    Raises:
        ReshardError: for an optimizer whose state layout resharding does not
            know.
    """
    optimizer = batched.emb_module.optimizer
    layout = _STATE_LAYOUTS.get(EmbOptimType(optimizer.value))
    if layout is None:
        raise ReshardError(
            f"the state of fused optimizer '{optimizer.value}' cannot be resharded "
            f"(known: {', '.join(sorted(o.value for o in _STATE_LAYOUTS))})"
        )
    return layout


def _state_kind(
    batched: nn.Module, layout: Mapping[str, FieldKind], key: str
) -> FieldKind:
    kind = layout.get(key)
    if kind is None:
        raise ReshardError(
            f"fused optimizer '{batched.emb_module.optimizer.value}' has a state "
            f"'{key}' whose layout resharding does not know"
        )
    return kind


def _shaped(
    value: torch.Tensor, kind: FieldKind, rect: Rect, table: str, key: str
) -> torch.Tensor:
    """A state tensor in its kind's shape, checked against the shard."""
    expected = {
        FieldKind.RECT: rect.numel,
        FieldKind.ROWS: rect.rows,
        FieldKind.SCALAR: 1,
    }[kind]
    if value.numel() != expected:
        raise ReshardError(
            f"table '{table}': optimizer state '{key}' has {value.numel()} values, "
            f"its {kind.value} layout on a {rect.rows}x{rect.cols} shard needs "
            f"{expected}"
        )
    if kind == FieldKind.RECT:
        return value.view(rect.rows, rect.cols)
    return value

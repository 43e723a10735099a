#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The checkpoint source: every shard of a model, with its fused optimizer
state, saved with ``torch.distributed.checkpoint`` (DCP) so that a recovery
reads back only the lost shards.

Each rank saves its shards as the engine sees them (``slots``: the weight
and every optimizer state tensor of a shard), one DCP entry per shard and
field::

    torchrec_fault/<module path>:<table>/<row>,<col>,<rows>,<cols>/<field>

A data-parallel table's replicas share their entry (DCP keeps one). A
recovery loads, with ``no_dist`` (no collective), only the entries of the
saved shards that overlap a lost piece, each on the survivor that will hold
the piece, and cuts the piece out of them.
"""

import logging
import time
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torchrec.distributed.resharding.fault.sources import CheckpointRecord, SourcePiece
from torchrec.distributed.resharding.fields import Field, FieldKind
from torchrec.distributed.resharding.model_view import sharded_slots
from torchrec.distributed.resharding.plan import Rect
from torchrec.distributed.resharding.slots import LocalSlot, SlotKey

logger: logging.Logger = logging.getLogger(__name__)

ENTRY_PREFIX = "torchrec_fault"


def entry_name(key: str, rect: Rect, field_name: str) -> str:
    """
    The DCP entry of one field of one saved shard.

    Args:
        key (str): the table, "module path:table".
        rect (Rect): the shard.
        field_name (str): "weight" or an optimizer state key.

    Returns:
        str: the entry's name.
    """
    return (
        f"{ENTRY_PREFIX}/{key}/{rect.row},{rect.col},{rect.rows},{rect.cols}/"
        f"{field_name}"
    )


def _entries(slots: Mapping[SlotKey, LocalSlot]) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for (key, rect), slot in slots.items():
        for name, tensor in slot.tensors.items():
            out[entry_name(key, rect, name)] = tensor.detach().contiguous()
    return out


def save_checkpoint(
    model: nn.Module,
    checkpoint_id: str,
    step: int,
    group: dist.ProcessGroup,
) -> CheckpointRecord:
    """
    Saves every shard of the model with its optimizer state (DCP); every
    rank of ``group`` calls it.

    Args:
        model (DistributedModelParallel): the model.
        checkpoint_id (str): where (a directory, DCP's checkpoint id).
        step (int): the steps the model completed.
        group (dist.ProcessGroup): the ranks that save (the model's group, or
            the survivors' after a loss no source covers).

    Returns:
        CheckpointRecord: what was saved, the same on every rank.
    """
    slots = sharded_slots(model.module)
    dcp.save(_entries(slots), checkpoint_id=checkpoint_id, process_group=group)
    local = [(key, rect, slot.fields()) for (key, rect), slot in slots.items()]
    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    shards: Dict[Tuple[str, Rect], None] = {}
    fields: Dict[str, Tuple[Field, ...]] = {}
    for rank_local in gathered:
        for key, rect, rank_fields in rank_local:
            shards[(key, rect)] = None
            fields.setdefault(key, rank_fields)
    return CheckpointRecord(
        checkpoint_id, step, tuple(sorted(shards)), tuple(sorted(fields.items()))
    )


def _cut(tensor: torch.Tensor, kind: FieldKind, local: Rect) -> torch.Tensor:
    if kind == FieldKind.RECT:
        return tensor[
            local.row : local.row + local.rows, local.col : local.col + local.cols
        ]
    if kind == FieldKind.ROWS:
        return tensor[local.row : local.row + local.rows]
    return tensor


def load_pieces(
    record: CheckpointRecord,
    pieces: Sequence[SourcePiece],
    fields: Mapping[str, Sequence[Field]],
) -> Tuple[Dict[SlotKey, LocalSlot], int, float]:
    """
    Reads the saved shards the pieces are cut from (only those, with no
    collective) and cuts the pieces out.

    Args:
        record (CheckpointRecord): the checkpoint.
        pieces (Sequence[SourcePiece]): this rank's checkpoint pieces.
        fields (Mapping[str, Sequence[Field]]): each table's fields.

    Returns:
        Tuple[Dict[SlotKey, LocalSlot], int, float]: the pieces as slots,
        the bytes read and the seconds it took.
    """
    start = time.perf_counter()
    wanted: Dict[str, torch.Tensor] = {}
    for piece in pieces:
        origin = piece.origin
        for f in fields[piece.key]:
            name = entry_name(piece.key, origin, f.name)
            if name not in wanted:
                wanted[name] = torch.empty(
                    f.shape(origin.rows, origin.cols), dtype=f.dtype
                )
    if wanted:
        dcp.load(
            wanted,
            checkpoint_id=record.checkpoint_id,
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
    out: Dict[SlotKey, LocalSlot] = {}
    for piece in pieces:
        local = piece.rect.relative_to(piece.origin)
        tensors: Dict[str, torch.Tensor] = {}
        kinds: Dict[str, FieldKind] = {}
        for f in fields[piece.key]:
            data = wanted[entry_name(piece.key, piece.origin, f.name)]
            tensors[f.name] = _cut(data, f.kind, local)
            kinds[f.name] = f.kind
        out[(piece.key, piece.rect)] = LocalSlot(piece.key, piece.rect, tensors, kinds)
    nbytes = sum(t.numel() * t.element_size() for t in wanted.values())
    seconds = time.perf_counter() - start
    logger.info(
        "rank %d: read %d B of %d saved shards from checkpoint %s in %.3f s",
        dist.get_rank() if dist.is_initialized() else 0,
        nbytes,
        len({(p.key, p.origin) for p in pieces}),
        record.checkpoint_id,
        seconds,
    )
    return out, nbytes, seconds

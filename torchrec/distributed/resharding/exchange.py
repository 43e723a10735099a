#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
The collective half of live resharding.

Two steps talk to other ranks:

* :func:`agree` — one small ``all_gather_object`` before any data moves: every
  rank shares the digest of its delta, its validation error (if any) and a few
  facts about the tables it holds. Disagreement or any error makes every rank
  raise the same :class:`ReshardError`.
* :func:`exchange_pieces` — the data: per round and per dtype, every rank packs
  the pieces of each destination into one contiguous buffer and calls one
  ``all_to_all_single`` with exact split sizes on the module's process group.
  Pieces whose source and destination are the same rank never enter a buffer;
  the caller copies them locally.
"""

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.resharding.plan import ReshardError, ReshardPlan, Transfer

logger: logging.Logger = logging.getLogger(__name__)

ROWS = "rows"  # a value per row of the shard (e.g. row-wise Adagrad)
RECT = "rect"  # a value per element of the shard (weights, Adam moments)
SCALAR = "scalar"  # a single value per shard


@dataclass(frozen=True)
class Field:
    """
    One tensor that travels with every piece of a table.

    Args:
        name (str): "weight" or an optimizer state key.
        kind (str): RECT, ROWS or SCALAR.
        dtype (torch.dtype): element type on the wire.
    """

    name: str
    kind: str
    dtype: torch.dtype

    def numel(self, transfer: Transfer) -> int:
        if self.kind == RECT:
            return transfer.rect.numel
        if self.kind == ROWS:
            return transfer.rect.rows
        return 1


def field_kind(tensor: torch.Tensor, rows: int, cols: int) -> str:
    """
    Args:
        tensor (torch.Tensor): a local tensor attached to a ``rows`` x ``cols`` shard.
        rows (int): shard rows.
        cols (int): shard columns.

    Returns:
        str: how the tensor follows the shard's rectangle.
    """
    if tensor.dim() == 2 and tuple(tensor.shape) == (rows, cols):
        return RECT
    if tensor.dim() == 1 and tensor.numel() == rows:
        return ROWS
    if tensor.numel() == 1:
        return SCALAR
    if tensor.numel() == rows * cols:
        return RECT
    raise ReshardError(
        f"cannot tell how a tensor of shape {tuple(tensor.shape)} follows a "
        f"{rows}x{cols} shard"
    )


def agree(
    process_group: dist.ProcessGroup, digest: int, error: Optional[str], facts: Any
) -> List[Any]:
    """
    Makes every rank agree to go ahead, or every rank raise the same error.

    Args:
        process_group (dist.ProcessGroup): the module's process group.
        digest (int): digest of this rank's request.
        error (Optional[str]): this rank's validation error, if any.
        facts (Any): picklable facts this rank shares with the others.

    Returns:
        List[Any]: the facts of every rank, by group-local rank.

    Raises:
        ReshardError: on every rank, if the digests differ or any rank failed
            validation (the lowest failing rank's message).
    """
    world_size = dist.get_world_size(process_group)
    gathered: List[Any] = [None] * world_size
    dist.all_gather_object(gathered, (digest, error, facts), group=process_group)
    digests = [g[0] for g in gathered]
    if len(set(digests)) != 1:
        groups: Dict[int, List[int]] = {}
        for rank, d in enumerate(digests):
            groups.setdefault(d, []).append(rank)
        raise ReshardError(
            "ranks passed different resharding requests (every rank must pass the "
            f"same delta); ranks grouped by request: {sorted(groups.values())}"
        )
    for rank, (_, rank_error, _) in enumerate(gathered):
        if rank_error is not None:
            raise ReshardError(f"{rank_error} (reported by rank {rank})")
    return [g[2] for g in gathered]


def split_into_rounds(
    transfers: Sequence[Transfer],
    fields: Mapping[str, Sequence[Field]],
    max_inflight_bytes: Optional[int],
) -> List[List[Transfer]]:
    """
    Groups the remote transfers into rounds so that no rank has more than
    ``max_inflight_bytes`` of send plus receive buffers in one round. A single
    piece larger than the cap travels alone.

    Args:
        transfers (Sequence[Transfer]): the plan's transfers.
        fields (Mapping[str, Sequence[Field]]): what travels per table.
        max_inflight_bytes (Optional[int]): the cap; None for one round.

    Returns:
        List[List[Transfer]]: the rounds, identical on every rank.
    """
    remote = [t for t in transfers if not t.is_local]
    if max_inflight_bytes is None:
        return [remote] if remote else []
    rounds: List[List[Transfer]] = []
    current: List[Transfer] = []
    load: Dict[int, int] = {}
    for transfer in remote:
        size = sum(f.numel(transfer) * _itemsize(f.dtype) for f in fields[transfer.table])
        over = any(
            load.get(r, 0) + size > max_inflight_bytes
            for r in (transfer.src_rank, transfer.dst_rank)
        )
        if current and over:
            rounds.append(current)
            current, load = [], {}
        current.append(transfer)
        for r in (transfer.src_rank, transfer.dst_rank):
            load[r] = load.get(r, 0) + size
    if current:
        rounds.append(current)
    return rounds


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _wire_dtypes(
    transfers: Sequence[Transfer], fields: Mapping[str, Sequence[Field]]
) -> List[torch.dtype]:
    dtypes = {f.dtype for t in transfers for f in fields[t.table]}
    return sorted(dtypes, key=str)


def exchange_pieces(
    plan: ReshardPlan,
    fields: Mapping[str, Sequence[Field]],
    rank: int,
    world_size: int,
    process_group: dist.ProcessGroup,
    read_piece: Callable[[Transfer, Field], torch.Tensor],
    write_piece: Callable[[Transfer, Field, torch.Tensor], None],
    device: torch.device,
    max_inflight_bytes: Optional[int] = None,
) -> Tuple[int, int]:
    """
    Sends every remote piece of ``plan`` from its source to its destination.

    Args:
        plan (ReshardPlan): the plan, identical on every rank.
        fields (Mapping[str, Sequence[Field]]): what travels per table.
        rank (int): this rank, group-local.
        world_size (int): size of ``process_group``.
        process_group (dist.ProcessGroup): the module's process group.
        read_piece (Callable): returns the source tensor of a field of a piece
            this rank sends (any strides; it is packed here).
        write_piece (Callable): consumes a received field of a piece (a view
            into the receive buffer, valid only during the call).
        device (torch.device): device of the exchange buffers.
        max_inflight_bytes (Optional[int]): cap on the exchange buffers per
            rank and round.

    Returns:
        Tuple[int, int]: bytes this rank sent and received.
    """
    sent_bytes = 0
    received_bytes = 0
    for round_transfers in split_into_rounds(plan.transfers, fields, max_inflight_bytes):
        for dtype in _wire_dtypes(round_transfers, fields):
            s, r = _exchange_one_dtype(
                round_transfers,
                fields,
                dtype,
                rank,
                world_size,
                process_group,
                read_piece,
                write_piece,
                device,
            )
            sent_bytes += s
            received_bytes += r
    return sent_bytes, received_bytes


def _exchange_one_dtype(
    transfers: Sequence[Transfer],
    fields: Mapping[str, Sequence[Field]],
    dtype: torch.dtype,
    rank: int,
    world_size: int,
    process_group: dist.ProcessGroup,
    read_piece: Callable[[Transfer, Field], torch.Tensor],
    write_piece: Callable[[Transfer, Field, torch.Tensor], None],
    device: torch.device,
) -> Tuple[int, int]:
    sends = sorted(
        (t for t in transfers if t.src_rank == rank), key=lambda t: t.dst_rank
    )
    receives = sorted(
        (t for t in transfers if t.dst_rank == rank), key=lambda t: t.src_rank
    )
    send_splits = [0] * world_size
    recv_splits = [0] * world_size
    for t in sends:
        send_splits[t.dst_rank] += _numel_of_dtype(t, fields, dtype)
    for t in receives:
        recv_splits[t.src_rank] += _numel_of_dtype(t, fields, dtype)

    send_buffer = torch.empty(sum(send_splits), dtype=dtype, device=device)
    offset = 0
    for t in sends:
        for f in fields[t.table]:
            if f.dtype != dtype:
                continue
            n = f.numel(t)
            source = read_piece(t, f)
            send_buffer[offset : offset + n].view(source.shape).copy_(source)
            offset += n
    recv_buffer = torch.empty(sum(recv_splits), dtype=dtype, device=device)
    dist.all_to_all_single(
        recv_buffer,
        send_buffer,
        output_split_sizes=recv_splits,
        input_split_sizes=send_splits,
        group=process_group,
    )
    del send_buffer
    offset = 0
    for t in receives:
        for f in fields[t.table]:
            if f.dtype != dtype:
                continue
            n = f.numel(t)
            write_piece(t, f, recv_buffer[offset : offset + n])
            offset += n
    itemsize = _itemsize(dtype)
    return sum(send_splits) * itemsize, sum(recv_splits) * itemsize


def _numel_of_dtype(
    transfer: Transfer, fields: Mapping[str, Sequence[Field]], dtype: torch.dtype
) -> int:
    return sum(f.numel(transfer) for f in fields[transfer.table] if f.dtype == dtype)

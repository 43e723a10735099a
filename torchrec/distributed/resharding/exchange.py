#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The collective half of live resharding.

Three steps talk to other ranks:

* :func:`agree` — before any data moves, every rank publishes the digest of
  its request, its validation error (if any) and a few facts about the tables
  it holds, through the job's key-value store, and waits (bounded by the
  exchange timeout) until every rank of the group did. A rank that does not
  join makes every caller raise :class:`ReshardAbortedError`; disagreement or
  any error makes every rank raise the same :class:`ReshardError`. No process
  group is used, so a rank that never comes leaves every group usable.
* :func:`open_exchange_group` — the shards travel on a process group of their
  own, created for this transaction under a name every rank derives from it,
  and destroyed afterwards: a failed exchange never leaves stray messages on
  the group training uses.
* :func:`exchange_pieces` — the data: per round and per (dtype, field), every
  rank packs the pieces of each destination into one contiguous buffer and
  calls one ``all_to_all_single`` with exact split sizes. Pieces that already
  lie back to back in one storage are sent from it without packing, and, when
  the caller names the destinations, received straight into them. Pieces whose
  source and destination are the same rank never enter a buffer; the caller
  copies them locally.
"""

import enum
import hashlib
import logging
import pickle
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torchrec.distributed.resharding.memory import release_buffer
from torchrec.distributed.resharding.plan import (
    Rect,
    ReshardAbortedError,
    ReshardError,
    ReshardPlan,
    Transfer,
)

logger: logging.Logger = logging.getLogger(__name__)


class FieldKind(enum.Enum):
    """How a tensor that travels with a table follows the table's rectangles."""

    RECT = "rect"  # a value per element of the shard (weights, Adam moments)
    ROWS = "rows"  # a value per row of the shard (e.g. row-wise Adagrad)
    SCALAR = "scalar"  # a single value per shard


@dataclass(frozen=True)
class Field:
    """
    One tensor that travels with every piece of a table.

    Args:
        name (str): "weight" or an optimizer state key.
        kind (FieldKind): how it follows the table's rectangles.
        dtype (torch.dtype): element type on the wire.
    """

    name: str
    kind: FieldKind
    dtype: torch.dtype

    def numel(self, transfer: Transfer) -> int:
        """Elements of this field in one piece."""
        if self.kind == FieldKind.RECT:
            return transfer.rect.numel
        if self.kind == FieldKind.ROWS:
            return transfer.rect.rows
        return 1

    def nbytes(self, transfer: Transfer) -> int:
        """Bytes of this field in one piece."""
        return self.numel(transfer) * self.dtype.itemsize


def field_kind(tensor: torch.Tensor, rows: int, cols: int) -> FieldKind:
    """
    Args:
        tensor (torch.Tensor): a local tensor attached to a ``rows`` x ``cols`` shard.
        rows (int): shard rows.
        cols (int): shard columns.

    Returns:
        FieldKind: how the tensor follows the shard's rectangle.
    """
    if tensor.dim() == 2 and tuple(tensor.shape) == (rows, cols):
        return FieldKind.RECT
    if tensor.dim() == 1 and tensor.numel() == rows:
        return FieldKind.ROWS
    if tensor.numel() == 1:
        return FieldKind.SCALAR
    if tensor.numel() == rows * cols:
        return FieldKind.RECT
    raise ReshardError(
        f"cannot tell how a tensor of shape {tuple(tensor.shape)} follows a "
        f"{rows}x{cols} shard"
    )


@dataclass(frozen=True)
class Agreement:
    """
    What every rank agreed on before any data moved.

    Args:
        transaction (str): a name for this transaction, the same on every rank
            and never used again for the same ranks.
        facts (List[Any]): the facts every rank shared, by group-local rank.
    """

    transaction: str
    facts: List[Any]


_GO = b"go"
_ABORTED = b"aborted"


def _rendezvous_prefix(global_ranks: Sequence[int]) -> str:
    text = ",".join(str(r) for r in global_ranks)
    return "torchrec_reshard/" + hashlib.sha1(text.encode()).hexdigest()[:16]


def _default_timeout(process_group: dist.ProcessGroup) -> timedelta:
    return c10d._get_default_timeout(dist.get_backend(process_group))


def _open_attempt(store: dist.Store, prefix: str) -> int:
    """
    The attempt of the ranks' rendezvous that is open now. Attempts that were
    decided without this rank (aborted while it was away) are skipped, so a
    rank that missed a reshard rejoins the others at the next one.
    """
    while True:
        attempt = int(store.add(f"{prefix}/current", 0))
        if not store.check([f"{prefix}/{attempt}/state"]):
            return attempt
        _close_attempt(store, prefix, attempt)


def _close_attempt(store: dist.Store, prefix: str, attempt: int) -> None:
    store.compare_set(f"{prefix}/current", str(attempt), str(attempt + 1))


def agree(
    process_group: dist.ProcessGroup,
    digest: int,
    error: Optional[str],
    facts: Any,
    timeout: Optional[timedelta] = None,
) -> Agreement:
    """
    Makes every rank of ``process_group`` agree to go ahead, or every rank raise
    the same error. Runs on the job's key-value store, not on a process group,
    and waits at most ``timeout`` for the other ranks.

    Args:
        process_group (dist.ProcessGroup): the module's process group.
        digest (int): digest of this rank's request.
        error (Optional[str]): this rank's validation error, if any.
        facts (Any): picklable facts this rank shares with the others.
        timeout (Optional[timedelta]): how long to wait for the other ranks
            (default: the backend's default process-group timeout).

    Returns:
        Agreement: the transaction's name and every rank's facts, by
        group-local rank.

    Raises:
        ReshardAbortedError: on every rank that called, when some rank did not
            join within the timeout; nothing has moved.
        ReshardError: on every rank, if the digests differ or any rank failed
            validation (the lowest failing rank's message).
    """
    return agree_among(
        dist.get_process_group_ranks(process_group),
        digest,
        error,
        facts,
        timeout or _default_timeout(process_group),
    )


def agree_among(
    global_ranks: Sequence[int],
    digest: int,
    error: Optional[str],
    facts: Any,
    timeout: Optional[timedelta] = None,
) -> Agreement:
    """
    :func:`agree` among any ranks of the job, given by their global ranks (in
    the order that numbers them), e.g. the ranks of two groups a model moves
    between; no process group over them needs to exist.

    Args:
        global_ranks (Sequence[int]): the participants; this rank among them.
        digest (int): digest of this rank's request.
        error (Optional[str]): this rank's validation error, if any.
        facts (Any): picklable facts this rank shares with the others.
        timeout (Optional[timedelta]): how long to wait for the other ranks
            (default: the default process group's backend's).

    Returns:
        Agreement: the transaction's name and every participant's facts, in
        the order of ``global_ranks``.

    Raises:
        ReshardAbortedError: see :func:`agree`.
        ReshardError: see :func:`agree`.
    """
    timeout = timeout or _default_timeout(c10d._get_default_group())
    world_size = len(global_ranks)
    rank = list(global_ranks).index(dist.get_rank())
    store = c10d._get_default_store()
    prefix = _rendezvous_prefix(global_ranks)
    attempt = _open_attempt(store, prefix)
    here = f"{prefix}/{attempt}"
    if attempt > 1:
        # Every rank read the facts of attempt - 2 before it arrived at
        # attempt - 1, which this rank saw decided.
        store.delete_key(f"{prefix}/{attempt - 2}/rank{rank}")
    store.set(f"{here}/rank{rank}", pickle.dumps((digest, error, facts)))
    if int(store.add(f"{here}/arrived", 1)) >= world_size:
        decision = store.compare_set(f"{here}/state", "", _GO)
    else:
        try:
            store.wait([f"{here}/state"], timeout)
            decision = store.get(f"{here}/state")
        except dist.DistStoreError:
            decision = store.compare_set(f"{here}/state", "", _ABORTED)
    _close_attempt(store, prefix, attempt)
    if decision != _GO:
        missing = [
            global_ranks[r]
            for r in range(world_size)
            if not store.check([f"{here}/rank{r}"])
        ]
        raise ReshardAbortedError(
            f"rank {dist.get_rank()}: ranks {missing} did not join the reshard "
            f"within {timeout}; nothing moved and the module is unchanged"
        )
    gathered = [pickle.loads(store.get(f"{here}/rank{r}")) for r in range(world_size)]
    # Nobody returns (and may exit, taking the store's host with it) before
    # every rank has read the facts.
    if int(store.add(f"{here}/read", 1)) >= world_size:
        store.set(f"{here}/all_read", _GO)
    else:
        try:
            store.wait([f"{here}/all_read"], timeout)
        except dist.DistStoreError as e:
            raise ReshardAbortedError(
                f"rank {rank}: a rank left the reshard while the ranks agreed; "
                "nothing moved and the module is unchanged"
            ) from e
    digests = [g[0] for g in gathered]
    if len(set(digests)) != 1:
        groups: Dict[int, List[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        raise ReshardError(
            "ranks passed different resharding requests (every rank must pass the "
            f"same delta); ranks grouped by request: {sorted(groups.values())}"
        )
    for r, (_, rank_error, _) in enumerate(gathered):
        if rank_error is not None:
            raise ReshardError(f"{rank_error} (reported by rank {r})")
    return Agreement(f"{here}/exchange", [g[2] for g in gathered])


def open_exchange_group(
    process_group: dist.ProcessGroup,
    transaction: str,
    timeout: Optional[timedelta] = None,
) -> dist.ProcessGroup:
    """
    A process group over the same ranks as ``process_group`` (same group-local
    ranks), made for one transaction: its name comes from the agreement, so
    only the group's members create it and the job's group counter is not
    touched. Close it with :func:`close_exchange_group`.

    Args:
        process_group (dist.ProcessGroup): the module's process group.
        transaction (str): :attr:`Agreement.transaction`.
        timeout (Optional[timedelta]): timeout of its collectives.

    Returns:
        dist.ProcessGroup: the exchange group.

    Raises:
        ReshardAbortedError: when a peer does not connect within the timeout.
    """
    return open_exchange_group_among(
        dist.get_process_group_ranks(process_group),
        transaction,
        timeout or _default_timeout(process_group),
        dist.get_backend(process_group),
    )


def open_exchange_group_among(
    global_ranks: Sequence[int],
    transaction: str,
    timeout: Optional[timedelta] = None,
    backend: Optional[str] = None,
) -> dist.ProcessGroup:
    """
    :func:`open_exchange_group` over any ranks of the job, given by their
    global ranks (their group-local ranks follow this order).

    Args:
        global_ranks (Sequence[int]): the members; this rank among them.
        transaction (str): :attr:`Agreement.transaction`.
        timeout (Optional[timedelta]): timeout of its collectives.
        backend (Optional[str]): the backend (default: the default group's).

    Returns:
        dist.ProcessGroup: the exchange group.

    Raises:
        ReshardAbortedError: when a peer does not connect within the timeout.
    """
    default = c10d._get_default_group()
    store = c10d._get_default_store()
    try:
        group, _ = c10d._new_process_group_helper(
            len(global_ranks),
            list(global_ranks).index(dist.get_rank()),
            list(global_ranks),
            backend or dist.get_backend(default),
            store,
            c10d.GroupName(transaction),
            timeout=timeout or _default_timeout(default),
        )
    except Exception as e:
        raise ReshardAbortedError(
            f"could not connect the ranks for the shard exchange ({type(e).__name__}:"
            f" {e}); nothing moved and the module is unchanged"
        ) from e
    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(global_ranks)}
    return group


def close_exchange_group(group: dist.ProcessGroup) -> None:
    """
    Destroys an exchange group; after a failed exchange this also wakes peers
    still blocked in it with an error instead of letting them wait.

    Args:
        group (dist.ProcessGroup): a group from :func:`open_exchange_group`.

    Returns:
        None
    """
    try:
        dist.destroy_process_group(group)
    except Exception:  # a group broken by the failure it reports
        logger.debug("destroying the exchange group failed", exc_info=True)


def _piece_bytes(transfer: Transfer, fields: Sequence[Field]) -> int:
    return sum(f.nbytes(transfer) for f in fields)


def _split_by_rows(
    transfer: Transfer, fields: Sequence[Field], max_bytes: int
) -> List[Transfer]:
    # Cuts a piece into row bands of at most ``max_bytes`` (at least one row),
    # so that a cap smaller than a whole piece still bounds the buffers.
    rect = transfer.rect
    per_row = sum(
        (rect.cols if f.kind == FieldKind.RECT else 1) * f.dtype.itemsize
        for f in fields
        if f.kind != FieldKind.SCALAR
    )
    scalars = sum(f.dtype.itemsize for f in fields if f.kind == FieldKind.SCALAR)
    if per_row == 0:
        return [transfer]
    band = max(1, (max_bytes - scalars) // per_row)
    if band >= rect.rows:
        return [transfer]
    return [
        replace(
            transfer,
            rect=Rect(rect.row + r, rect.col, min(band, rect.rows - r), rect.cols),
        )
        for r in range(0, rect.rows, band)
    ]


def split_into_rounds(
    transfers: Sequence[Transfer],
    fields: Mapping[str, Sequence[Field]],
    max_inflight_bytes: Optional[int],
) -> List[List[Transfer]]:
    """
    Groups the remote transfers into rounds so that no rank has more than
    ``max_inflight_bytes`` of send plus receive buffers in one round. A piece
    larger than the cap is cut into bands of rows that fit it (a single row
    larger than the cap travels alone).

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
    for whole in remote:
        for transfer in _split_by_rows(whole, fields[whole.table], max_inflight_bytes):
            size = _piece_bytes(transfer, fields[transfer.table])
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


def _wire_groups(
    transfers: Sequence[Transfer], fields: Mapping[str, Sequence[Field]]
) -> List[Tuple[torch.dtype, str]]:
    # One collective per (dtype, field): the pieces of one field of
    # consecutive tables usually lie back to back in one storage (a batched
    # kernel's flat weights or optimizer state), so they can travel without
    # being packed or unpacked.
    groups = {(f.dtype, f.name) for t in transfers for f in fields[t.table]}
    return sorted(groups, key=lambda g: (str(g[0]), g[1]))


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
    target_piece: Optional[Callable[[Transfer, Field], Optional[torch.Tensor]]] = None,
    on_round: Optional[Callable[[int, int], None]] = None,
) -> Tuple[int, int]:
    """
    Sends every remote piece of ``plan`` from its source to its destination.

    Per round, one ``all_to_all_single`` per (dtype, field). When the pieces a
    rank sends of a field lie back to back in one storage, that storage is sent
    as is (no send buffer); when ``target_piece`` gives, for every piece a rank
    receives of a field, destinations that lie back to back in one storage, the
    data is received straight into them (no receive buffer, ``write_piece`` is
    not called for them).

    Args:
        plan (ReshardPlan): the plan, identical on every rank.
        fields (Mapping[str, Sequence[Field]]): what travels per table.
        rank (int): this rank, group-local.
        world_size (int): size of ``process_group``.
        process_group (dist.ProcessGroup): the module's process group.
        read_piece (Callable): returns the source tensor of a field of a piece
            this rank sends (any strides; it is packed here if needed).
        write_piece (Callable): consumes a received field of a piece (a view
            into the receive buffer, valid only during the call).
        device (torch.device): device of the exchange buffers.
        max_inflight_bytes (Optional[int]): cap on the exchange buffers per
            rank and round.
        target_piece (Optional[Callable]): optionally, the tensor a received
            field of a piece would be copied into by ``write_piece`` (same
            dtype and number of elements), or None when ``write_piece`` does
            more than a copy.
        on_round (Optional[Callable[[int, int], None]]): called after each
            round with (rounds done, rounds in all), e.g. for a progress bar.

    Returns:
        Tuple[int, int]: bytes this rank sent and received.
    """
    sent_bytes = 0
    received_bytes = 0
    rounds = split_into_rounds(plan.transfers, fields, max_inflight_bytes)
    for done, round_transfers in enumerate(rounds, start=1):
        for dtype, name in _wire_groups(round_transfers, fields):
            s, r = _exchange_one_group(
                round_transfers,
                fields,
                dtype,
                name,
                rank,
                world_size,
                process_group,
                read_piece,
                write_piece,
                target_piece,
                device,
            )
            sent_bytes += s
            received_bytes += r
        if on_round is not None:
            on_round(done, len(rounds))
    return sent_bytes, received_bytes


def _field_of(
    transfer: Transfer,
    fields: Mapping[str, Sequence[Field]],
    dtype: torch.dtype,
    name: str,
) -> Optional[Field]:
    for f in fields[transfer.table]:
        if f.dtype == dtype and f.name == name:
            return f
    return None


def _pieces_by_peer(
    transfers: Sequence[Transfer],
    fields: Mapping[str, Sequence[Field]],
    dtype: torch.dtype,
    name: str,
    world_size: int,
    rank: int,
    outgoing: bool,
) -> Tuple[List[Tuple[Transfer, Field]], List[int]]:
    """
    The pieces of one (dtype, field) this rank sends (``outgoing``) or
    receives, ordered by peer rank then plan order, and the element count per
    peer (the all-to-all split sizes).
    """
    pieces: List[Tuple[Transfer, Field]] = []
    splits = [0] * world_size
    mine = [t for t in transfers if (t.src_rank if outgoing else t.dst_rank) == rank]
    for t in sorted(mine, key=lambda t: t.dst_rank if outgoing else t.src_rank):
        f = _field_of(t, fields, dtype, name)
        if f is not None:
            pieces.append((t, f))
            splits[t.dst_rank if outgoing else t.src_rank] += f.numel(t)
    return pieces, splits


def _flat_span(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device
) -> Optional[torch.Tensor]:
    """
    A flat tensor over ``tensors`` when they are contiguous, of ``dtype``, on
    ``device`` and lie back to back in one storage, in order; else None.
    """
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    end = first.data_ptr()
    total = 0
    for t in tensors:
        if (
            t.dtype != dtype
            or t.device != device
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.data_ptr() != end
        ):
            return None
        end += t.numel() * t.element_size()
        total += t.numel()
    span = torch.empty(0, dtype=dtype, device=device)
    span.set_(storage, first.storage_offset(), (total,))
    return span


def _exchange_one_group(
    transfers: Sequence[Transfer],
    fields: Mapping[str, Sequence[Field]],
    dtype: torch.dtype,
    name: str,
    rank: int,
    world_size: int,
    process_group: dist.ProcessGroup,
    read_piece: Callable[[Transfer, Field], torch.Tensor],
    write_piece: Callable[[Transfer, Field, torch.Tensor], None],
    target_piece: Optional[Callable[[Transfer, Field], Optional[torch.Tensor]]],
    device: torch.device,
) -> Tuple[int, int]:
    sends, send_splits = _pieces_by_peer(
        transfers, fields, dtype, name, world_size, rank, outgoing=True
    )
    receives, recv_splits = _pieces_by_peer(
        transfers, fields, dtype, name, world_size, rank, outgoing=False
    )

    sources = [read_piece(t, f) for t, f in sends]
    send_buffer = _flat_span(
        [s.reshape(-1) if s.is_contiguous() else s for s in sources], dtype, device
    )
    packed = send_buffer is None
    if send_buffer is None:
        send_buffer = torch.empty(sum(send_splits), dtype=dtype, device=device)
        offset = 0
        for (t, f), source in zip(sends, sources):
            n = f.numel(t)
            send_buffer[offset : offset + n].view(source.shape).copy_(source)
            offset += n
    del sources

    recv_buffer: Optional[torch.Tensor] = None
    if target_piece is not None and receives:
        targets = [target_piece(t, f) for t, f in receives]
        if all(
            x is not None and x.numel() == f.numel(t)
            for x, (t, f) in zip(targets, receives)
        ):
            recv_buffer = _flat_span(
                [
                    x.reshape(-1) if x.is_contiguous() else x for x in targets
                ],  # pyre-ignore[16]
                dtype,
                device,
            )
        del targets
    direct = recv_buffer is not None
    if recv_buffer is None:
        recv_buffer = torch.empty(sum(recv_splits), dtype=dtype, device=device)
    dist.all_to_all_single(
        recv_buffer,
        send_buffer,
        output_split_sizes=recv_splits,
        input_split_sizes=send_splits,
        group=process_group,
    )
    if packed:
        release_buffer(send_buffer)
    del send_buffer
    if not direct:
        offset = 0
        for t, f in receives:
            n = f.numel(t)
            write_piece(t, f, recv_buffer[offset : offset + n])
            offset += n
        release_buffer(recv_buffer)
    itemsize = dtype.itemsize
    return sum(send_splits) * itemsize, sum(recv_splits) * itemsize

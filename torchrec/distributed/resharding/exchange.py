#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The one executor of live resharding: it fills new shards from old ones, on
the transaction's exchange group (``exchange_group.ExchangeGroup``).

:func:`execute_transfers` takes one rank's part of a plan
(:class:`~torchrec.distributed.resharding.transfer_plan.RankPlan`), the fields
of every table, a :class:`PieceIO` (where a piece is read from and written to,
in the spirit of DCP's ``resolve_tensor`` / ``commit_tensor``) and the group:

* pieces that stay on the rank are copied locally, unless the new shard
  already holds them in the old storage;
* the others travel as point-to-point messages, posted together per round
  (``ExchangeGroup.post``): one per field of each large piece, one per dtype
  for each pair's small pieces packed together (:func:`pair_messages`). A
  message is sent straight from the old shard's memory and received straight
  into the new shard's wherever its pieces are one contiguous span there, so
  the bytes of a move are not copied on either side; only the others go
  through a buffer. The sender and the receiver of a message derive it from
  their own parts of the plan, which list the pieces of each pair of ranks in
  the same order; a message's tag is its place in the pair's list.

A memory cap splits the exchange into rounds: every pair of ranks sends at
most ``cap / peers`` bytes per round (``peers``: the most distinct peers any
rank has, one small all-reduce), cutting pieces into row bands where needed,
so that no rank holds more than the cap in buffers (where it needs any); a second all-reduce agrees
on the number of rounds. Both sides of a pair cut its pieces alike.

A move between groups of ranks also sends the model's dense (replicated)
part from one rank of the old group to the new group: :func:`broadcast_dense`
packs it into one buffer per dtype and broadcasts it on the same group.
"""

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch
from torchrec.distributed.resharding.elastic_plan import DenseSpec
from torchrec.distributed.resharding.exchange_group import ExchangeGroup, Message
from torchrec.distributed.resharding.fields import Field, FieldKind
from torchrec.distributed.resharding.memory import pinned_staging, release_buffer
from torchrec.distributed.resharding.plan import Rect, Transfer
from torchrec.distributed.resharding.transfer_plan import RankPlan


class PieceIO(Protocol):
    """
    Where the executor reads the pieces a rank sends or copies, and writes the
    pieces it receives or copies (implemented by ``slots.SlotIO``, over a
    module's kernels or over plain modules).
    """

    def resolve(self, transfer: Transfer, f: Field) -> torch.Tensor:
        """A view of the piece ``transfer`` of field ``f`` in the old shard."""
        ...

    def target(self, transfer: Transfer, f: Field) -> Optional[torch.Tensor]:
        """
        The tensor :meth:`commit` would only copy the piece into (the exchange
        then receives straight into it), or None when commit does more.
        """
        ...

    def commit(self, transfer: Transfer, f: Field, data: torch.Tensor) -> None:
        """Writes the piece's values (valid only during the call)."""
        ...

    def kept(self, transfer: Transfer) -> bool:
        """Whether the new shard holds the local piece already (same memory)."""
        ...

    def finish(self) -> None:
        """Called once every piece was committed."""
        ...


@dataclass
class ExchangeStats:
    """
    What :func:`execute_transfers` did on one rank.

    Args:
        bytes_sent (int): bytes sent to other ranks.
        bytes_received (int): bytes received from other ranks.
        bytes_sent_in_place (int): of ``bytes_sent``, bytes sent straight from
            the old shards' memory (not packed into a buffer first).
        bytes_received_in_place (int): of ``bytes_received``, bytes received
            straight into the new shards' memory (not through a buffer).
        bytes_copied_locally (int): bytes of local pieces copied.
        bytes_kept_in_place (int): bytes of local pieces the new shards held
            already (neither copied nor written).
        rounds (int): rounds of the exchange.
        pinned_bytes (int): page-locked host memory its staging took (given
            back at its end).
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_sent_in_place: int = 0
    bytes_received_in_place: int = 0
    bytes_copied_locally: int = 0
    bytes_kept_in_place: int = 0
    rounds: int = 0
    pinned_bytes: int = 0


# ------------------------------------------------------------------ rounds


def _piece_bytes(transfer: Transfer, fields: Sequence[Field]) -> int:
    return sum(f.nbytes(transfer) for f in fields)


def _row_bands(
    transfer: Transfer, fields: Sequence[Field], quota: int
) -> List[Transfer]:
    """A piece cut into bands of whole rows of at most ``quota`` bytes each (at
    least one row per band)."""
    rect = transfer.rect
    per_row = sum(
        (rect.cols if f.kind == FieldKind.RECT else 1) * f.dtype.itemsize
        for f in fields
        if f.kind != FieldKind.SCALAR
    )
    scalars = sum(f.dtype.itemsize for f in fields if f.kind == FieldKind.SCALAR)
    if per_row == 0 or _piece_bytes(transfer, fields) <= quota:
        return [transfer]
    # every band carries the per-shard values again (written alike each time)
    band = max(1, (quota - scalars) // per_row)
    return [
        replace(
            transfer,
            rect=Rect(rect.row + r, rect.col, min(band, rect.rows - r), rect.cols),
        )
        for r in range(0, rect.rows, band)
    ]


def chunk_pair(
    pieces: Sequence[Transfer],
    fields: Mapping[str, Sequence[Field]],
    quota: Optional[int],
) -> List[List[Transfer]]:
    """
    The rounds of one pair of ranks: its pieces (in plan order) packed into
    chunks of at most ``quota`` bytes, a piece larger than the quota cut into
    row bands (a single row larger than the quota travels alone). Pure and
    deterministic: the sender and the receiver cut alike.

    Args:
        pieces (Sequence[Transfer]): the pair's remote pieces, in plan order.
        fields (Mapping[str, Sequence[Field]]): the fields of every table.
        quota (Optional[int]): bytes per round; None for a single round.

    Returns:
        List[List[Transfer]]: the pieces (or bands) of each round.
    """
    if not pieces:
        return []
    if quota is None:
        return [list(pieces)]
    chunks: List[List[Transfer]] = []
    current: List[Transfer] = []
    load = 0
    for whole in pieces:
        for band in _row_bands(whole, fields[whole.table], quota):
            size = _piece_bytes(band, fields[band.table])
            if current and load + size > quota:
                chunks.append(current)
                current, load = [], 0
            current.append(band)
            load += size
    chunks.append(current)
    return chunks


def _by_peer(
    transfers: Sequence[Transfer], outgoing: bool
) -> Dict[int, List[Transfer]]:
    out: Dict[int, List[Transfer]] = {}
    for t in transfers:
        out.setdefault(t.dst_rank if outgoing else t.src_rank, []).append(t)
    return out


@dataclass(frozen=True)
class _Rounds:
    """Per peer, the pieces this rank sends / receives in each round."""

    sends: Dict[int, List[List[Transfer]]]
    receives: Dict[int, List[List[Transfer]]]
    count: int


def _plan_rounds(
    plan: RankPlan,
    fields: Mapping[str, Sequence[Field]],
    group: ExchangeGroup,
    max_inflight_bytes: Optional[int],
) -> _Rounds:
    """The rounds of this rank, consistent with every other rank's."""
    send_peers = _by_peer(plan.sends, outgoing=True)
    recv_peers = _by_peer(plan.receives, outgoing=False)
    quota: Optional[int] = None
    if max_inflight_bytes is not None:
        (peers,) = group.all_reduce_max([len(send_peers) + len(recv_peers)])
        quota = max(1, max_inflight_bytes // max(1, peers))
    sends = {p: chunk_pair(t, fields, quota) for p, t in send_peers.items()}
    receives = {p: chunk_pair(t, fields, quota) for p, t in recv_peers.items()}
    count = max(
        (len(c) for c in list(sends.values()) + list(receives.values())), default=0
    )
    if max_inflight_bytes is not None:
        (count,) = group.all_reduce_max([count])
    else:
        count = 1  # one round, taken by every rank whether it has pieces or not
    return _Rounds(sends, receives, count)


def _round_pieces(
    by_peer: Mapping[int, List[List[Transfer]]], k: int
) -> Dict[int, List[Transfer]]:
    """Per peer, the pieces of round ``k`` in plan order."""
    return {peer: chunks[k] for peer, chunks in by_peer.items() if k < len(chunks)}


# ---------------------------------------------------------------- the wire


class StagingPool:
    """
    The pinned host buffers of one exchange (host buffers that stage CUDA
    tensors, e.g. on gloo): one page-locked block reused by every round, each
    message a view into it; :meth:`release` at the end gives it back to the
    OS with the host allocator's other unused cached blocks
    (``torch.accelerator.empty_host_cache``). Pinned memory freed into the
    caching host allocator stays page-locked for the rest of the process
    otherwise (torch rounds each block up to a power of two and caches
    without limit by default).

    Args:
        pin (bool): page-lock the blocks (False: plain host memory, the same
            bookkeeping).
    """

    ALIGN = 64
    SMALLEST_BLOCK = 1 << 20

    def __init__(self, pin: bool = True) -> None:
        self._pin = pin
        self._blocks: List[torch.Tensor] = []
        self._offset = 0
        self.pinned_bytes = 0  # bytes ever page-locked by this pool

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """
        Args:
            numel (int): elements of the buffer.
            dtype (torch.dtype): their type.

        Returns:
            torch.Tensor: a buffer valid until the next :meth:`reset`.
        """
        nbytes = numel * dtype.itemsize
        start = -(-self._offset // self.ALIGN) * self.ALIGN
        if not self._blocks or start + nbytes > self._blocks[-1].numel():
            last = self._blocks[-1].numel() if self._blocks else 0
            size = max(nbytes, 2 * last, self.SMALLEST_BLOCK)
            self._blocks.append(
                torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
            )
            self.pinned_bytes += size if self._pin else 0
            start = 0
        self._offset = start + nbytes
        return self._blocks[-1][start : start + nbytes].view(dtype)

    def reset(self) -> None:
        """After a round: its buffers are no longer in use. The next round
        reuses one block as large as this round needed."""
        used = sum(b.numel() for b in self._blocks[:-1]) + self._offset
        if len(self._blocks) > 1:
            self._blocks = [torch.empty(used, dtype=torch.uint8, pin_memory=self._pin)]
            self.pinned_bytes += used if self._pin else 0
        self._offset = 0

    def release(self) -> None:
        """Drops the blocks; pinned ones go back to the OS."""
        self._blocks = []
        self._offset = 0
        if self.pinned_bytes:
            torch.accelerator.empty_host_cache()


# A piece's field smaller than this travels packed with the pair's other small
# pieces of its dtype (one message instead of many tiny ones); a larger one is
# a message of its own, sent from and received into the kernels' memory.
SMALL_MESSAGE_BYTES: int = 64 * 1024


@dataclass(frozen=True)
class WireMessage:
    """
    One point-to-point message between a pair of ranks in one round: one
    field of one large piece, or the small pieces' fields of one dtype packed
    in order.

    Args:
        dtype (torch.dtype): element type of every entry.
        entries (Tuple[Tuple[Transfer, Field], ...]): the (piece, field) pairs
            it carries, in order.
    """

    dtype: torch.dtype
    entries: Tuple[Tuple[Transfer, Field], ...]

    @property
    def numel(self) -> int:
        """Elements of the message."""
        return sum(f.numel(t) for t, f in self.entries)


def pair_messages(
    pieces: Sequence[Transfer],
    fields: Mapping[str, Sequence[Field]],
    small_bytes: int = SMALL_MESSAGE_BYTES,
) -> List[WireMessage]:
    """
    The messages of one pair of ranks in one round, the same on both sides:
    both derive them from their parts of the plan, which list the pair's
    pieces in the same order. Pure and deterministic.

    Args:
        pieces (Sequence[Transfer]): the pair's pieces of the round, in order.
        fields (Mapping[str, Sequence[Field]]): the fields of every table.
        small_bytes (int): a field of a piece below this many bytes travels
            packed with the pair's other small ones of its dtype.

    Returns:
        List[WireMessage]: the large messages in piece and field order, then
        one packed message per dtype of small ones.
    """
    large: List[WireMessage] = []
    small: Dict[torch.dtype, List[Tuple[Transfer, Field]]] = {}
    for t in pieces:
        for f in sorted(fields[t.table], key=lambda f: (str(f.dtype), f.name)):
            if f.numel(t) == 0:
                continue
            if f.nbytes(t) >= small_bytes:
                large.append(WireMessage(f.dtype, ((t, f),)))
            else:
                small.setdefault(f.dtype, []).append((t, f))
    packed = [
        WireMessage(dtype, tuple(entries))
        for dtype, entries in sorted(small.items(), key=lambda kv: str(kv[0]))
    ]
    return large + packed


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


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t


@dataclass
class _Receive:
    """A message being received, into a buffer to commit from or in place."""

    message: WireMessage
    tensor: torch.Tensor
    buffered: bool


@dataclass
class _Wire:
    """
    The messages of one round: every pair's pieces travel as point-to-point
    messages (:func:`pair_messages`), sent straight from the old shards' memory
    and received straight into the new shards' wherever a message's pieces are
    one contiguous span there; a message is packed into (or received into) a
    buffer only where they are not.

    Args:
        fields (Mapping[str, Sequence[Field]]): every table's fields.
        io (PieceIO): where the pieces are read and written.
        group (ExchangeGroup): the exchange's group.
        device (torch.device): the exchange's device.
    """

    fields: Mapping[str, Sequence[Field]]
    io: PieceIO
    group: ExchangeGroup
    device: torch.device
    staging: StagingPool = field(default_factory=StagingPool, init=False)

    def _outgoing(self, message: WireMessage) -> Tuple[torch.Tensor, bool]:
        """The tensor a message is sent from, and whether it is a buffer."""
        sources = [_flat(self.io.resolve(t, f)) for t, f in message.entries]
        span = _flat_span(sources, message.dtype, self.device)
        if span is not None:
            return span, False
        buffer = self._buffer(message, sources)
        offset = 0
        for source in sources:
            n = source.numel()
            buffer[offset : offset + n].view(source.shape).copy_(source)
            offset += n
        return buffer, True

    def _incoming(self, message: WireMessage) -> _Receive:
        """Where a message is received: the new shards' memory, or a buffer."""
        targets = [self.io.target(t, f) for t, f in message.entries]
        if all(
            x is not None and x.numel() == f.numel(t)
            for x, (t, f) in zip(targets, message.entries)
        ):
            span = _flat_span(
                [_flat(x) for x in targets if x is not None],
                message.dtype,
                self.device,
            )
            if span is not None:
                return _Receive(message, span, buffered=False)
        staged = [x for x in targets if x is not None]
        return _Receive(message, self._buffer(message, staged), buffered=True)

    def _buffer(
        self, message: WireMessage, data: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """A message's buffer on the wire's device (pinned host memory from
        the exchange's pool where it stages CUDA tensors)."""
        if pinned_staging(self.device, [t.device for t in data]):
            return self.staging.take(message.numel, message.dtype)
        return torch.empty(message.numel, dtype=message.dtype, device=self.device)

    def _commit(self, receive: _Receive) -> None:
        offset = 0
        for t, f in receive.message.entries:
            n = f.numel(t)
            self.io.commit(t, f, receive.tensor[offset : offset + n])
            offset += n
        release_buffer(receive.tensor)

    def run(
        self,
        sends: Mapping[int, Sequence[Transfer]],
        receives: Mapping[int, Sequence[Transfer]],
        stats: ExchangeStats,
    ) -> None:
        """
        Exchanges one round's pieces with every peer.

        Args:
            sends (Mapping[int, Sequence[Transfer]]): peer -> pieces it gets.
            receives (Mapping[int, Sequence[Transfer]]): peer -> pieces from it.
            stats (ExchangeStats): updated with the bytes moved.

        Returns:
            None
        """
        messages: List[Message] = []
        incoming: List[_Receive] = []
        outgoing: List[Tuple[torch.Tensor, bool]] = []
        # Peers are group-local ranks (the plan numbers ranks in the group).
        for peer in sorted(receives):
            for tag, message in enumerate(pair_messages(receives[peer], self.fields)):
                receive = self._incoming(message)
                incoming.append(receive)
                messages.append(Message(receive.tensor, peer, tag, send=False))
                nbytes = message.numel * message.dtype.itemsize
                stats.bytes_received += nbytes
                if not receive.buffered:
                    stats.bytes_received_in_place += nbytes
        for peer in sorted(sends):
            for tag, message in enumerate(pair_messages(sends[peer], self.fields)):
                tensor, buffered = self._outgoing(message)
                outgoing.append((tensor, buffered))
                messages.append(Message(tensor, peer, tag, send=True))
                nbytes = message.numel * message.dtype.itemsize
                stats.bytes_sent += nbytes
                if not buffered:
                    stats.bytes_sent_in_place += nbytes
        self.group.wait(self.group.post(messages))
        for tensor, buffered in outgoing:
            if buffered:
                release_buffer(tensor)
        for receive in incoming:
            if receive.buffered:
                self._commit(receive)
        self.staging.reset()


def _copy_local(
    plan: RankPlan,
    fields: Mapping[str, Sequence[Field]],
    io: PieceIO,
    stats: ExchangeStats,
) -> None:
    for transfer in plan.local_copies:
        nbytes = _piece_bytes(transfer, fields[transfer.table])
        if io.kept(transfer):
            stats.bytes_kept_in_place += nbytes
            continue
        for f in fields[transfer.table]:
            io.commit(transfer, f, io.resolve(transfer, f))
        stats.bytes_copied_locally += nbytes


def execute_transfers(
    plan: RankPlan,
    fields: Mapping[str, Sequence[Field]],
    io: PieceIO,
    group: ExchangeGroup,
    max_inflight_bytes: Optional[int] = None,
    device: Optional[torch.device] = None,
    on_round: Optional[Callable[[int, int], None]] = None,
) -> ExchangeStats:
    """
    Fills this rank's new shards: copies the local pieces, exchanges the
    remote ones with every other rank of ``group``. Every rank of the group
    calls it with its own part of the same plan and the same ``fields``.

    Args:
        plan (RankPlan): this rank's sends, receives and local copies, ranks
            numbered in ``group``.
        fields (Mapping[str, Sequence[Field]]): the fields of every table of
            the plan, the same on every rank.
        io (PieceIO): where pieces are read and written.
        group (ExchangeGroup): the transaction's exchange group (or any
            process group, through ``ExchangeGroup.over``).
        max_inflight_bytes (Optional[int]): cap on this rank's buffers.
        device (Optional[torch.device]): device of the buffers (CPU default).
        on_round (Optional[Callable[[int, int], None]]): called after each
            round with (rounds done, rounds in all).

    Returns:
        ExchangeStats: what moved.
    """
    device = device or torch.device("cpu")
    stats = ExchangeStats()
    with torch.no_grad():
        _copy_local(plan, fields, io, stats)
        rounds = _plan_rounds(plan, fields, group, max_inflight_bytes)
        wire = _Wire(fields, io, group, device)
        try:
            for k in range(rounds.count):
                wire.run(
                    _round_pieces(rounds.sends, k),
                    _round_pieces(rounds.receives, k),
                    stats,
                )
                if on_round is not None:
                    on_round(k + 1, rounds.count)
        finally:
            wire.staging.release()
        stats.rounds = rounds.count
        stats.pinned_bytes = wire.staging.pinned_bytes
        io.finish()
    return stats


def broadcast_dense(
    specs: Sequence[DenseSpec],
    source: Optional[Mapping[str, torch.Tensor]],
    target: Optional[Mapping[str, torch.Tensor]],
    src: int,
    group: ExchangeGroup,
) -> int:
    """
    The dense tensors, from ``source`` on the group's rank ``src`` into
    ``target`` (ranks of the new group; None elsewhere): one broadcast per
    dtype of a buffer (on the group's device) that packs them.

    Returns:
        int: bytes broadcast.
    """
    total = 0
    for dtype in sorted({s.dtype for s in specs}, key=str):
        members = [s for s in specs if s.dtype == dtype]
        sizes = [s.nbytes // dtype.itemsize for s in members]
        if source is not None:
            buffer = torch.cat(
                [source[s.name].detach().reshape(-1).to(group.device) for s in members]
            )
        else:
            buffer = torch.empty(sum(sizes), dtype=dtype, device=group.device)
        group.broadcast(buffer, src)
        total += buffer.numel() * buffer.element_size()
        if target is not None:
            with torch.no_grad():
                for s, piece in zip(members, buffer.split(sizes)):
                    target[s.name].copy_(piece.view(s.shape))
    return total

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Slots: the shards a rank holds before and after a transaction, as the runner
reads and writes them. A :class:`LocalSlot` is one local shard of one table
with the tensors that follow its rectangle (the weight and any optimizer
state, per element, per row or per shard: ``fields.FieldKind``); the
sharded modules' kernels (``kernel_state``) and plain modules (``unshard``)
are read into slots. :class:`SlotIO` is the executor's read/write interface
(``exchange.PieceIO``) over a rank's old and new slots.
"""

import dataclasses
from dataclasses import dataclass
from typing import AbstractSet, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torchrec.distributed.resharding.fields import Field, FieldKind
from torchrec.distributed.resharding.plan import Rect, Transfer

SlotKey = Tuple[str, Rect]


@dataclass
class LocalSlot:
    """
    One local shard of one table and the tensors that follow its rectangle.

    Args:
        table (str): table name.
        rect (Rect): the shard, in global coordinates.
        tensors (Dict[str, torch.Tensor]): "weight" and fused optimizer state,
            views into the lookup's storage (RECT tensors viewed as 2D).
        kinds (Dict[str, FieldKind]): how each tensor follows the rectangle
            (missing: RECT, the weight's kind).
    """

    table: str
    rect: Rect
    tensors: Dict[str, torch.Tensor]
    kinds: Dict[str, FieldKind] = dataclasses.field(default_factory=dict)

    def fields(self) -> Tuple[Field, ...]:
        """The fields of the slot's tensors (weights first)."""
        return tuple(
            Field(name, self.kinds.get(name, FieldKind.RECT), t.dtype)
            for name, t in self.tensors.items()
        )


def read_piece(slot: LocalSlot, transfer: Transfer, f: Field) -> torch.Tensor:
    """
    Args:
        slot (LocalSlot): the source shard.
        transfer (Transfer): the piece.
        f (Field): which tensor.

    Returns:
        torch.Tensor: a view of the piece in the slot's tensor.
    """
    tensor = slot.tensors[f.name]
    local = transfer.rect.relative_to(slot.rect)
    if f.kind == FieldKind.RECT:
        return tensor[
            local.row : local.row + local.rows, local.col : local.col + local.cols
        ]
    if f.kind == FieldKind.ROWS:
        return tensor[local.row : local.row + local.rows]
    return tensor.reshape(1)


class RowwiseMerges:
    """
    Row-wise state of new shards assembled from narrower column pieces.

    Each row-wise value is a mean over its shard's columns, so a shard joined
    from column pieces gets the column-width-weighted mean of the pieces'
    values. It is accumulated exactly in float64 and rounded once at the end.
    """

    def __init__(self) -> None:
        self._sums: Dict[Tuple[str, Rect, str], torch.Tensor] = {}
        self._targets: Dict[Tuple[str, Rect, str], Tuple[torch.Tensor, int]] = {}

    def add(self, slot: LocalSlot, name: str, local: Rect, data: torch.Tensor) -> None:
        """Adds the row-wise values of a piece ``local`` (in slot coordinates)."""
        key = (slot.table, slot.rect, name)
        if key not in self._sums:
            target = slot.tensors[name]
            self._sums[key] = torch.zeros(
                target.numel(), dtype=torch.float64, device=target.device
            )
            self._targets[key] = (target, slot.rect.cols)
        rows = self._sums[key][local.row : local.row + local.rows]
        rows.add_(data.view(-1).to(torch.float64) * local.cols)

    def finish(self) -> None:
        """Writes the means into their targets."""
        for key, total in self._sums.items():
            target, cols = self._targets[key]
            target.copy_((total / cols).to(target.dtype))
        self._sums.clear()
        self._targets.clear()


def write_piece(
    slot: LocalSlot,
    transfer: Transfer,
    f: Field,
    data: torch.Tensor,
    merges: RowwiseMerges,
) -> None:
    """
    Writes a received (or locally read) piece into a new slot.

    Args:
        slot (LocalSlot): the destination shard.
        transfer (Transfer): the piece.
        f (Field): which tensor.
        data (torch.Tensor): the piece's values, as many as ``f`` says.
        merges (RowwiseMerges): collects row-wise state joined from columns.

    Returns:
        None
    """
    tensor = slot.tensors.get(f.name)
    if tensor is None:
        return  # the new kernel keeps no such state (e.g. fused -> dense)
    local = transfer.rect.relative_to(slot.rect)
    if f.kind == FieldKind.RECT:
        target = tensor[
            local.row : local.row + local.rows, local.col : local.col + local.cols
        ]
        target.copy_(data.view(local.rows, local.cols))
    elif f.kind == FieldKind.ROWS:
        if local.cols == slot.rect.cols:
            tensor[local.row : local.row + local.rows].copy_(data.view(-1))
        else:
            merges.add(slot, f.name, local, data)
    else:
        tensor.view(-1).copy_(data.view(-1))


def target_piece(
    slot: LocalSlot, transfer: Transfer, f: Field
) -> Optional[torch.Tensor]:
    """
    Where a received piece lands when :func:`write_piece` would only copy it
    (the exchange then receives straight into it); None when it does more (a
    row-wise merge) or the new kernel keeps no such state.
    """
    tensor = slot.tensors.get(f.name)
    if tensor is None or tensor.dtype != f.dtype:
        return None
    local = transfer.rect.relative_to(slot.rect)
    if f.kind == FieldKind.RECT:
        target = tensor[
            local.row : local.row + local.rows, local.col : local.col + local.cols
        ]
        return target if target.is_contiguous() else None
    if f.kind == FieldKind.ROWS:
        if local.cols != slot.rect.cols:
            return None
        return tensor[local.row : local.row + local.rows]
    return tensor.view(-1) if tensor.numel() == 1 else None


def zero_undelivered_state(
    new_slots: Mapping[SlotKey, LocalSlot],
    fields: Mapping[str, Sequence[Field]],
    in_place: AbstractSet[SlotKey],
) -> None:
    """
    State no piece carries (e.g. a dense or data-parallel table turning fused)
    starts from zero, as in a freshly built kernel. Slots kept in place are
    live state of the module and never touched.
    """
    for key, slot in new_slots.items():
        if key in in_place:
            continue
        delivered = {f.name for f in fields.get(slot.table, [])}
        for name, tensor in slot.tensors.items():
            if name not in delivered:
                tensor.zero_()


def kept_in_place(
    old_slots: Mapping[SlotKey, LocalSlot],
    new_slots: Mapping[SlotKey, LocalSlot],
) -> List[SlotKey]:
    """Slots whose new kernel took over the old storage (same memory)."""
    kept = []
    for key, new in new_slots.items():
        old = old_slots.get(key)
        if old is not None and all(
            name in old.tensors
            and tensor.data_ptr() == old.tensors[name].data_ptr()
            and tensor.shape == old.tensors[name].shape
            for name, tensor in new.tensors.items()
        ):
            kept.append(key)
    return kept


class SlotIO:
    """
    The executor's read/write interface (``exchange.PieceIO``) over a rank's
    old and new slots: pieces are read from old slots and written into new
    ones; row-wise state joined from column pieces is merged exactly; slots
    whose kernel took over the old storage are neither copied nor written.
    State no piece delivers starts from zero. Build it with :func:`slot_io`.

    Args:
        old_slots (Mapping[SlotKey, LocalSlot]): this rank's old shards.
        new_slots (Mapping[SlotKey, LocalSlot]): this rank's new shards.
        in_place (AbstractSet[SlotKey]): new slots that share the old storage.
    """

    def __init__(
        self,
        old_slots: Mapping[SlotKey, LocalSlot],
        new_slots: Mapping[SlotKey, LocalSlot],
        in_place: AbstractSet[SlotKey],
    ) -> None:
        self._old = old_slots
        self._new = new_slots
        self.in_place: AbstractSet[SlotKey] = in_place
        self._merges = RowwiseMerges()

    def resolve(self, transfer: Transfer, f: Field) -> torch.Tensor:
        return read_piece(self._old[(transfer.table, transfer.src_rect)], transfer, f)

    def target(self, transfer: Transfer, f: Field) -> Optional[torch.Tensor]:
        return target_piece(self._new[(transfer.table, transfer.dst_rect)], transfer, f)

    def commit(self, transfer: Transfer, f: Field, data: torch.Tensor) -> None:
        write_piece(
            self._new[(transfer.table, transfer.dst_rect)],
            transfer,
            f,
            data,
            self._merges,
        )

    def kept(self, transfer: Transfer) -> bool:
        return (transfer.table, transfer.dst_rect) in self.in_place

    def finish(self) -> None:
        self._merges.finish()


def slot_io(
    old_slots: Mapping[SlotKey, LocalSlot],
    new_slots: Mapping[SlotKey, LocalSlot],
    fields: Mapping[str, Sequence[Field]],
) -> SlotIO:
    """
    Args:
        old_slots (Mapping[SlotKey, LocalSlot]): this rank's old shards.
        new_slots (Mapping[SlotKey, LocalSlot]): this rank's new shards.
        fields (Mapping[str, Sequence[Field]]): the fields that travel.

    Returns:
        SlotIO: the interface; new state that no piece delivers is zeroed.
    """
    in_place = set(kept_in_place(old_slots, new_slots))
    with torch.no_grad():
        zero_undelivered_state(new_slots, fields, in_place)
    return SlotIO(old_slots, new_slots, in_place)


def keyed_slots(
    slots: Mapping[SlotKey, LocalSlot], key: Callable[[str], str]
) -> Dict[SlotKey, LocalSlot]:
    """The same slots under other table names (e.g. "path:table")."""
    return {
        (key(table), rect): dataclasses.replace(slot, table=key(table))
        for (table, rect), slot in slots.items()
    }

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The buddy snapshot: every N steps each rank sends its shards (weights and
fused optimizer state) to a buddy on another host, which keeps a copy; when
the rank is lost, the copy is the source of its shards, and the updates
since that step are what is lost.

* **Only the rows touched since the last snapshot travel.** A forward
  pre-hook on each batched kernel (a public ``nn.Module`` hook: nothing is
  replaced) marks the rows its ids read; those rows are the ones the step's
  fused optimizer updates. The first snapshot (and the first after a
  reshard or a recovery) sends every row.
* **Within a memory budget.** A rank sends the shards whose copies fit its
  buddy's budget (``FaultOptions.snapshot_budget_bytes``), in table order;
  the others need another source.
* **Off the critical path.** The rows are gathered into one buffer, the
  sizes exchanged, and the buffer sent by one asynchronous ``all_to_all``
  on the training group, which runs while training goes on; the buddy
  applies it at the next snapshot (or when a recovery asks), so a snapshot
  costs the step a gather and a small collective.
* **Consistent.** A copy changes only once a whole snapshot arrived: a
  snapshot interrupted by a failure leaves the previous one.
"""

import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding.fault.options import FaultOptions
from torchrec.distributed.resharding.fault.sources import SnapshotOffer, SourcePiece
from torchrec.distributed.resharding.fields import Field, FieldKind, TableKey
from torchrec.distributed.resharding.kernel_state import batched_kernels, shard_rect
from torchrec.distributed.resharding.model_view import sharded_modules, sharded_slots
from torchrec.distributed.resharding.module_adapters import adapter_for
from torchrec.distributed.resharding.plan import Rect
from torchrec.distributed.resharding.slots import LocalSlot, SlotKey
from torchrec.distributed.resharding.whole_plan import plan_digest
from torchrec.distributed.types import ShardingType

logger: logging.Logger = logging.getLogger(__name__)


def buddy_of(members: Sequence[int], rank: int, local_size: int) -> Optional[int]:
    """
    The member ``rank`` sends its snapshots to: the one ``local_size``
    places further on (the same local rank of the next host), so that a lost
    host never takes a rank's shards and their copy at once; the next member
    when the job has one host. None when alone.

    Args:
        members (Sequence[int]): the members' global ranks, ascending.
        rank (int): a member.
        local_size (int): ranks per host.

    Returns:
        Optional[int]: its buddy.
    """
    n = len(members)
    if n < 2:
        return None
    index = list(members).index(rank)
    step = local_size if 0 < local_size < n else 1
    buddy = members[(index + step) % n]
    if buddy == rank:
        buddy = members[(index + 1) % n]
    return buddy


@dataclass
class _Copy:
    """A buddy's copy of another rank's shards."""

    of_rank: int
    step: int
    plan: int
    slots: Dict[SlotKey, LocalSlot]


@dataclass
class _Pending:
    """A snapshot sent, not yet applied by this rank."""

    work: Any
    received: torch.Tensor
    splits: List[int]
    step: int


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class BuddySnapshot:
    """
    This rank's side of the buddy snapshots of a model (see the module
    docstring): it sends to its buddy and keeps the copies of the ranks it
    is the buddy of.

    Args:
        model (DistributedModelParallel): the model.
        options (FaultOptions): the budget.
    """

    def __init__(self, model: nn.Module, options: FaultOptions) -> None:
        self._options = options
        self._group: dist.ProcessGroup = model._env.process_group
        self._members: List[int] = sorted(dist.get_process_group_ranks(self._group))
        self._me: int = dist.get_rank()
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", len(self._members)))
        self.buddy: Optional[int] = buddy_of(self._members, self._me, local_size)
        self.senders: List[int] = [
            r
            for r in self._members
            if buddy_of(self._members, r, local_size) == self._me
        ]
        self._copies: Dict[int, _Copy] = {}
        self._pending: Optional[_Pending] = None
        self._plan: int = 0
        self._touched: Dict[SlotKey, torch.Tensor] = {}
        self._hooks: List[Any] = []
        self._full = True
        self._watch(model)

    # ------------------------------------------------------ touched rows

    def _watch(self, model: nn.Module) -> None:
        """Marks the rows each kernel reads, from now on."""
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._touched = [], {}
        self._plan = plan_digest(model.plan)
        for path, module in sharded_modules(model.module).items():
            shardings = model.plan.plan[path]
            for lookup in adapter_for(module).lookups():
                for kernel in batched_kernels(lookup):
                    by_feature: Dict[str, List[torch.Tensor]] = {}
                    for table in kernel.config.embedding_tables:
                        if (
                            shardings[table.name].sharding_type
                            == ShardingType.DATA_PARALLEL.value
                        ):
                            continue  # a replica on every rank: not snapshotted
                        key = (TableKey(path, table.name), shard_rect(table))
                        mask = torch.zeros(key[1].rows, dtype=torch.bool)
                        self._touched[key] = mask
                        for feature in table.feature_names:
                            by_feature.setdefault(feature, []).append(mask)
                    if by_feature:
                        self._hooks.append(
                            kernel.register_forward_pre_hook(_marker(by_feature))
                        )

    # ------------------------------------------------------------ taking

    def take(self, model: nn.Module, step: int) -> None:
        """
        Sends this rank's rows touched since the last snapshot to its buddy
        (every rank of the group calls it at the same step); applies the
        previous snapshot received first.

        Args:
            model (DistributedModelParallel): the model.
            step (int): the steps it completed.
        """
        self._apply_pending(wait=True)
        if plan_digest(model.plan) != self._plan:  # resharded: start afresh
            self._watch(model)
            self._copies = {}
            self._full = True
        payload = self._pack(model, step)
        n = len(self._members)
        position = {g: i for i, g in enumerate(self._members)}
        sizes = torch.zeros(n, dtype=torch.int64)
        if self.buddy is not None:
            sizes[position[self.buddy]] = payload.numel()
        incoming = torch.empty(n, dtype=torch.int64)
        dist.all_to_all_single(incoming, sizes, group=self._group)
        splits = [int(v) for v in incoming.tolist()]
        received = torch.empty(sum(splits), dtype=torch.uint8)
        work = dist.all_to_all_single(
            received,
            payload,
            output_split_sizes=splits,
            input_split_sizes=[int(v) for v in sizes.tolist()],
            group=self._group,
            async_op=True,
        )
        self._pending = _Pending(work, received, splits, step)
        for mask in self._touched.values():
            mask.zero_()
        self._full = False

    def _pack(self, model: nn.Module, step: int) -> torch.Tensor:
        """This rank's touched rows (all on a full snapshot), in one buffer."""
        budget = self._options.snapshot_budget_bytes
        header: List[Tuple[str, Rect, Tuple[Field, ...], int]] = []
        parts: List[torch.Tensor] = []
        held = 0
        slots = sharded_slots(model.module)
        for key in sorted(self._touched, key=str):
            slot = slots[key]
            full_bytes = sum(
                t.numel() * t.element_size() for t in slot.tensors.values()
            )
            if budget is not None and held + full_bytes > budget:
                continue  # beyond the buddy's budget: another source covers it
            held += full_bytes
            mask = self._touched[key]
            rows = torch.arange(key[1].rows) if self._full else mask.nonzero().flatten()
            fields = slot.fields()
            header.append((key[0], key[1], fields, rows.numel()))
            parts.append(_as_bytes(rows.to(torch.int64)))
            for f in fields:
                tensor = slot.tensors[f.name]
                if f.kind == FieldKind.SCALAR:
                    parts.append(_as_bytes(tensor.detach().clone()))
                else:
                    parts.append(_as_bytes(tensor.detach().index_select(0, rows)))
        head = pickle.dumps((self._me, step, self._plan, self._full, header))
        size = torch.tensor([len(head)], dtype=torch.int64)
        return torch.cat(
            [
                _as_bytes(size),
                torch.frombuffer(bytearray(head), dtype=torch.uint8),
                *parts,
            ]
        )

    # ----------------------------------------------------------- applying

    def _apply_pending(self, wait: bool) -> None:
        """
        Applies the snapshot received last once its transfer completed
        (``wait``: block until then); a transfer that failed is dropped and
        the copies stay as they were.
        """
        pending = self._pending
        if pending is None:
            return
        if not wait and not pending.work.is_completed():
            self._pending = None  # a recovery: the transfer will not finish
            logger.warning("rank %d: an unfinished snapshot is dropped", self._me)
            return
        self._pending = None
        pending.work.wait()
        offset = 0
        for size in pending.splits:
            if size:
                self._apply(pending.received[offset : offset + size])
            offset += size

    def _apply(self, payload: torch.Tensor) -> None:
        head_size = int(_typed(payload[:8], torch.int64).item())
        sender, step, plan, full, header = pickle.loads(
            payload[8 : 8 + head_size].numpy().tobytes()
        )
        offset = 8 + head_size
        copy = self._copies.get(sender)
        if full or copy is None or copy.plan != plan:
            copy = _Copy(sender, step, plan, {})
        for key, rect, fields, count in header:
            rows = _typed(payload[offset : offset + 8 * count], torch.int64)
            offset += 8 * count
            slot = copy.slots.get((key, rect))
            if slot is None:
                slot = _empty_slot(key, rect, fields)
                copy.slots[(key, rect)] = slot
            for f in fields:
                shape = f.shape(count if f.kind != FieldKind.SCALAR else 1, rect.cols)
                nbytes = f.dtype.itemsize * _numel(shape)
                data = _typed(payload[offset : offset + nbytes], f.dtype).reshape(shape)
                offset += nbytes
                target = slot.tensors[f.name]
                if f.kind == FieldKind.SCALAR:
                    target.copy_(data.reshape(target.shape))
                else:
                    target.index_copy_(0, rows, data)
        copy.step = step
        self._copies[sender] = copy

    # ----------------------------------------------------------- recovery

    def offers(self) -> Tuple[SnapshotOffer, ...]:
        """The copies this rank holds, for a recovery (an unfinished
        snapshot is dropped: the copy before it stands)."""
        try:
            self._apply_pending(wait=False)
        except Exception:  # the transfer failed with the lost rank
            logger.warning(
                "rank %d: the last snapshot failed; kept the one before", self._me
            )
        return tuple(
            SnapshotOffer(
                copy.of_rank,
                copy.step,
                copy.plan,
                tuple(sorted(copy.slots, key=str)),
                tuple(
                    sorted(
                        {
                            key: slot.fields() for (key, _), slot in copy.slots.items()
                        }.items()
                    )
                ),
            )
            for _, copy in sorted(self._copies.items())
        )

    def slots_for(self, pieces: Sequence[SourcePiece]) -> Dict[SlotKey, LocalSlot]:
        """The copies of the lost shards of ``pieces`` (this rank holds them)."""
        held = {
            key: slot
            for copy in self._copies.values()
            for key, slot in copy.slots.items()
        }
        return {(p.key, p.rect): held[(p.key, p.shard)] for p in pieces}

    def copied_ranks(self) -> Set[int]:
        """The ranks whose shards this rank holds a copy of."""
        return set(self._copies)

    def close(self) -> None:
        """Removes the hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _typed(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes of a received buffer as ``dtype`` (copied: an offset into the
    buffer need not be aligned for it)."""
    return data.clone().view(dtype)


def _numel(shape: Tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def _empty_slot(key: str, rect: Rect, fields: Sequence[Field]) -> LocalSlot:
    tensors = {
        f.name: torch.zeros(f.shape(rect.rows, rect.cols), dtype=f.dtype)
        for f in fields
    }
    return LocalSlot(key, rect, tensors, {f.name: f.kind for f in fields})


def _marker(by_feature: Dict[str, List[torch.Tensor]]) -> Any:
    """A forward pre-hook marking the rows a kernel's ids read."""

    def mark(module: nn.Module, args: Tuple[Any, ...]) -> None:
        features = args[0]
        values = features.values()
        offsets = features.offset_per_key()
        for i, feature in enumerate(features.keys()):
            masks = by_feature.get(feature)
            if not masks:
                continue
            ids = values[offsets[i] : offsets[i + 1]]
            for mask in masks:
                mask[ids] = True

    return mark

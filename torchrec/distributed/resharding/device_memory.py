#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Device memory of a transaction: what a rank needs on top of what it holds,
checked before anything is built, and what it reached.

On a GPU the old kernels live until the commit, so a rank's peak is what it
holds now plus, at most: the new kernels' device state of its new shards,
the exchange buffers (everything it sends and receives, or the
``max_inflight_bytes`` cap), the new dense part of a move and the buffers of
the exchange's NCCL communicator. Where a new kernel keeps its state
depends on its placement (:class:`Placement`, as fbgemm lays it out):
``FUSED`` keeps weights and optimizer state in HBM; ``FUSED_UVM`` keeps
weights and element-wise state in unified memory (host-backed: not counted
against HBM) and row-wise state in HBM; ``FUSED_UVM_CACHING`` adds an HBM
cache of rows with its maps; a module built on the host (an unshard's
destination, a CPU kernel) takes no device memory. Data-parallel tables add
their DDP gradient buckets. :func:`estimate_peak` computes that bound by
placement (pure); :func:`check_fits` compares it with the free memory
(``torch.cuda.mem_get_info``, which counts NCCL's and every other allocation
outside PyTorch's allocator too, plus what PyTorch's allocator reserved and
does not use) and refuses, naming the shortfall and the cap that would make
it fit, before anything is built. :class:`MemoryWatch` reports the peak a
transaction reached: device bytes allocated through PyTorch on CUDA, the
resident set on the host.
"""

import enum
import math
import os
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence

import torch
from torchrec.distributed.resharding.fields import Field, FieldKind, piece_cost, WEIGHT
from torchrec.distributed.resharding.plan import ReshardError, TableLayout
from torchrec.distributed.resharding.transfer_bytes import bytes_per_rank

# Device buffers a newly connected NCCL communicator allocates outside
# PyTorch's allocator (channels x peers x NCCL_BUFFSIZE, 4 MiB by default):
# a margin, not a measurement; ``mem_get_info`` sees the real figure.
NCCL_COMMUNICATOR_BYTES: int = 256 * 2**20

# Device buffers NCCL allocates for point-to-point with a peer it has not yet
# exchanged with (on first use, inside the group call): a margin per new
# peer, not a measurement (verify on GPU).
NCCL_PEER_BYTES: int = 16 * 2**20

# The in-flight cap of an exchange that stages data between the host and a
# GPU when the caller sets none (pinned host buffers, or device buffers for
# host state): a whole model's bytes in one round would exhaust either.
DEFAULT_STAGED_INFLIGHT_BYTES: int = 256 * 2**20

# fbgemm's cache: rows per set, and TorchRec's default cache load factor.
CACHE_ASSOCIATIVITY: int = 32
DEFAULT_CACHE_LOAD_FACTOR: float = 0.2
# HBM bytes per cache slot besides the row: its state (8), LRU/LFU state (8)
# and prefetch locking counter (4); per row of a cached table: its index map.
_CACHE_SLOT_BYTES: int = 8 + 8 + 4
_CACHE_MAP_BYTES_PER_ROW: int = 4


class Placement(enum.Enum):
    """Where a new kernel keeps a table's state (fbgemm's locations)."""

    DEVICE = "device"  # HBM: weights and optimizer state
    MANAGED = "managed"  # UVM weights and element-wise state, row-wise in HBM
    MANAGED_CACHING = "managed_caching"  # MANAGED plus an HBM cache of rows
    HOST = "host"  # host memory only (a CPU kernel, a module built on the host)


@dataclass(frozen=True)
class TablePlacement:
    """
    A table's placement in the kernel a transaction builds for it.

    Args:
        kind (Placement): where its state lives.
        cache_load_factor (float): a cached kernel's rows in cache per row.
        lfu (bool): a cached kernel's LFU state (one value per row, not per
            cache slot).
        ddp (bool): a data-parallel table (its gradients get DDP buckets).
    """

    kind: Placement = Placement.DEVICE
    cache_load_factor: float = DEFAULT_CACHE_LOAD_FACTOR
    lfu: bool = False
    ddp: bool = False


def placement_of(
    compute_kernel: str,
    device_type: str,
    sharding_type: str = "",
    fused_params: Optional[Mapping[str, Any]] = None,
) -> TablePlacement:
    """
    A table's placement under its new ``ParameterSharding``.

    Args:
        compute_kernel (str): its compute kernel (``EmbeddingComputeKernel``'s
            value, e.g. "fused_uvm_caching").
        device_type (str): the type of the device its shard is placed on.
        sharding_type (str): its sharding type ("data_parallel": DDP buckets).
        fused_params (Optional[Mapping[str, Any]]): its fused parameters
            (``cache_load_factor``, ``cache_algorithm``).

    Returns:
        TablePlacement: the placement.
    """
    params = fused_params or {}
    load_factor = params.get("cache_load_factor") or DEFAULT_CACHE_LOAD_FACTOR
    lfu = "LFU" in str(params.get("cache_algorithm", ""))
    ddp = sharding_type == "data_parallel"
    if device_type != "cuda":
        kind = Placement.HOST
    elif compute_kernel == "fused_uvm":
        kind = Placement.MANAGED
    elif compute_kernel == "fused_uvm_caching":
        kind = Placement.MANAGED_CACHING
    else:
        kind = Placement.DEVICE
    return TablePlacement(kind, float(load_factor), lfu, ddp)


@dataclass(frozen=True)
class StateBytes:
    """A kernel's state of some shards by where it lives."""

    device: int = 0
    managed: int = 0
    host: int = 0

    def __add__(self, other: "StateBytes") -> "StateBytes":
        return StateBytes(
            self.device + other.device,
            self.managed + other.managed,
            self.host + other.host,
        )


def state_bytes(
    fields: Sequence[Field], rows: int, cols: int, placement: TablePlacement
) -> StateBytes:
    """
    Where the state of one ``rows`` x ``cols`` shard lives (fbgemm: a managed
    table's row-wise optimizer state is on the device, its weights and
    element-wise state in unified memory).

    Args:
        fields (Sequence[Field]): the table's fields.
        rows (int): the shard's rows.
        cols (int): its columns.
        placement (TablePlacement): its new kernel's placement.

    Returns:
        StateBytes: its bytes by location (without a cache).
    """
    out = StateBytes()
    for f in fields:
        nbytes = math.prod(f.shape(rows, cols)) * f.dtype.itemsize
        if placement.kind == Placement.HOST:
            out += StateBytes(host=nbytes)
        elif placement.kind == Placement.DEVICE or f.kind != FieldKind.RECT:
            out += StateBytes(device=nbytes)
        else:
            out += StateBytes(managed=nbytes)
        if placement.ddp and f.name == WEIGHT and placement.kind != Placement.HOST:
            out += StateBytes(device=nbytes)  # the gradient's DDP bucket
    return out


def cache_bytes(
    rows: int, max_cols: int, itemsize: int, placement: TablePlacement
) -> int:
    """
    HBM of a cached kernel's cache for one table's shard (fbgemm
    ``_apply_cache_state``): its cache slots, whole sets of
    ``CACHE_ASSOCIATIVITY`` rows of the kernel's widest row, their state, and
    one index-map entry per row (LFU: state per row as well).

    Args:
        rows (int): the shard's rows.
        max_cols (int): the widest row among the rank's cached shards (the
            kernel's ``max_D``, at most).
        itemsize (int): bytes per cached element.
        placement (TablePlacement): its placement (load factor, LFU).

    Returns:
        int: bytes.
    """
    if placement.kind != Placement.MANAGED_CACHING or rows == 0:
        return 0
    sets = max(1, -(-int(rows * placement.cache_load_factor) // CACHE_ASSOCIATIVITY))
    slots = sets * CACHE_ASSOCIATIVITY
    per_row_state = 8 * (rows + 1) if placement.lfu else 0
    return (
        slots * (max_cols * itemsize + _CACHE_SLOT_BYTES)
        + rows * _CACHE_MAP_BYTES_PER_ROW
        + per_row_state
    )


@dataclass(frozen=True)
class PeakEstimate:
    """
    The device bytes a transaction may add on one rank, by cause.

    Args:
        new_state_bytes (int): the new kernels' device state of this rank's
            new shards (weights and fused optimizer state placed in HBM, DDP
            buckets of data-parallel tables).
        buffer_bytes (int): exchange buffers at most (sent plus received, or
            the in-flight cap).
        dense_bytes (int): the dense part a move builds on this rank.
        communicator_bytes (int): the exchange's NCCL communicator (a new
            connect, new peers).
        cache_bytes (int): the HBM caches of new cached kernels and their maps.
        managed_bytes (int): new state in unified memory (host-backed: not
            counted against the device's free memory).
        host_bytes (int): new state in host memory (not counted).
    """

    new_state_bytes: int
    buffer_bytes: int
    dense_bytes: int = 0
    communicator_bytes: int = 0
    cache_bytes: int = 0
    managed_bytes: int = 0
    host_bytes: int = 0

    @property
    def total(self) -> int:
        """Device bytes in all (what must fit the free device memory)."""
        return (
            self.new_state_bytes
            + self.buffer_bytes
            + self.dense_bytes
            + self.communicator_bytes
            + self.cache_bytes
        )


def estimate_peak(
    old: Mapping[str, TableLayout],
    new: Mapping[str, TableLayout],
    fields: Mapping[str, Sequence[Field]],
    index: int,
    max_inflight_bytes: Optional[int] = None,
    dense_bytes: int = 0,
    communicator_bytes: int = 0,
    placements: Optional[Mapping[str, TablePlacement]] = None,
) -> PeakEstimate:
    """
    A bound of the device bytes a transaction adds on one rank (pure).

    Args:
        old (Mapping[str, TableLayout]): every planned table's layout before.
        new (Mapping[str, TableLayout]): its layout after.
        fields (Mapping[str, Sequence[Field]]): the fields of every table.
        index (int): this rank in the transaction.
        max_inflight_bytes (Optional[int]): the exchange's in-flight cap.
        dense_bytes (int): the dense part of a move (counted on ranks that
            get new shards on the device).
        communicator_bytes (int): the exchange's communicator.
        placements (Optional[Mapping[str, TablePlacement]]): each table's new
            placement (default: the device).

    Returns:
        PeakEstimate: the bound, by cause.
    """
    placements = placements or {}
    state = StateBytes()
    cached = []
    for key, layout in new.items():
        placement = placements.get(key, TablePlacement())
        for shard in layout.shards_on(index):
            rect = shard.rect
            state += state_bytes(fields[key], rect.rows, rect.cols, placement)
            if placement.kind == Placement.MANAGED_CACHING:
                cached.append((key, rect.rows, rect.cols, placement))
    widest = max((cols for _, _, cols, _ in cached), default=0)
    cache = sum(
        cache_bytes(rows, widest, _weight_itemsize(fields[key]), placement)
        for key, rows, _, placement in cached
    )
    costs = {key: piece_cost(fields[key]) for key in new}
    sent, received = bytes_per_rank(old, new, costs)
    wire = sent.get(index, 0) + received.get(index, 0)
    if max_inflight_bytes is not None:
        wire = min(wire, max_inflight_bytes)
    on_device = state.device + cache
    return PeakEstimate(
        state.device,
        wire,
        dense_bytes if on_device else 0,
        communicator_bytes,
        cache,
        state.managed,
        state.host,
    )


def _weight_itemsize(fields: Sequence[Field]) -> int:
    """Bytes per element of a table's weight (what its cache holds)."""
    return max((f.dtype.itemsize for f in fields if f.name == WEIGHT), default=4)


def check_fits(
    estimate: PeakEstimate, free_bytes: int, device: torch.device, what: str
) -> None:
    """
    Refuses a transaction whose bound does not fit the free device memory.

    Args:
        estimate (PeakEstimate): the bound on this rank.
        free_bytes (int): free bytes on the device.
        device (torch.device): the device (for the message).
        what (str): the transaction's kind (for the message).

    Raises:
        ReshardError: naming the bytes needed by cause, the free bytes, the
            shortfall and, where a smaller in-flight cap would make it fit,
            that cap.
    """
    short = estimate.total - free_bytes
    if short <= 0:
        return
    hint = "free device memory or move fewer tables at once"
    cap = estimate.buffer_bytes - short
    if cap > 0:
        hint = f"ReshardOptions(max_inflight_bytes={cap}) would fit"
    raise ReshardError(
        f"the {what} needs up to {estimate.total} B more on {device} (new "
        f"kernels {estimate.new_state_bytes} B, caches {estimate.cache_bytes} B, "
        f"exchange buffers {estimate.buffer_bytes} B, dense part "
        f"{estimate.dense_bytes} B, communicator {estimate.communicator_bytes} B; "
        f"besides {estimate.managed_bytes} B in unified and "
        f"{estimate.host_bytes} B in host memory) but {free_bytes} B are free: "
        f"{short} B short; {hint}"
    )


def free_device_bytes(device: torch.device) -> Optional[int]:
    """
    Free bytes on a CUDA device: what ``mem_get_info`` says is free plus what
    PyTorch's caching allocator reserved and does not use (it allocates from
    there first). None elsewhere: host memory is not checked.
    """
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def resident_set_bytes() -> int:
    """This process's resident set now (Linux; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryWatch:
    """
    The peak memory of a transaction on one rank: on CUDA the device bytes
    allocated through PyTorch (``max_memory_allocated``, when the transaction
    raised the process's peak, else the most sampled at its phases), on the
    host the resident set sampled at its phases. CUDA's peak statistics are
    read, never reset.

    Args:
        device (torch.device): the transaction's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind: str = "cuda_allocated" if device.type == "cuda" else "host_rss"
        self._peak_before: int = self._peak()
        self._samples: List[int] = []
        self.sample()

    def _peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return 0

    def sample(self) -> None:
        """Samples the memory now (at the end of a phase)."""
        if self.device.type == "cuda":
            self._samples.append(int(torch.cuda.memory_allocated(self.device)))
        else:
            self._samples.append(resident_set_bytes())

    def peak(self) -> int:
        """The peak reached so far (bytes)."""
        peak = self._peak()
        if peak > self._peak_before:
            return peak
        return max(self._samples)

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
holds now plus, at most: the new kernels' state of its new shards (weights and
optimizer state), the exchange buffers (everything it sends and receives, or
the ``max_inflight_bytes`` cap), the new dense part of a move and the buffers
of a newly connected NCCL communicator. :func:`estimate_peak` computes that
bound (pure); :func:`check_fits` compares it with the free memory
``torch.cuda.mem_get_info`` reports (which counts NCCL's and every other
allocation outside PyTorch's allocator too) and refuses, naming the
shortfall and the cap that would make it fit, before anything is built.
:class:`MemoryWatch` reports the peak a transaction reached: device bytes
allocated through PyTorch on CUDA, the resident set on the host.
"""

import os
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence

import torch
from torchrec.distributed.resharding.fields import Field, piece_cost
from torchrec.distributed.resharding.plan import (
    bytes_per_rank,
    ReshardError,
    TableLayout,
)

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


@dataclass(frozen=True)
class PeakEstimate:
    """
    The device bytes a transaction may add on one rank, by cause.

    Args:
        new_state_bytes (int): the new kernels' state of this rank's new
            shards (weights and fused optimizer state).
        buffer_bytes (int): exchange buffers at most (sent plus received, or
            the in-flight cap).
        dense_bytes (int): the dense part a move builds on this rank.
        communicator_bytes (int): a newly connected NCCL communicator.
    """

    new_state_bytes: int
    buffer_bytes: int
    dense_bytes: int = 0
    communicator_bytes: int = 0

    @property
    def total(self) -> int:
        """Bytes in all."""
        return (
            self.new_state_bytes
            + self.buffer_bytes
            + self.dense_bytes
            + self.communicator_bytes
        )


def estimate_peak(
    old: Mapping[str, TableLayout],
    new: Mapping[str, TableLayout],
    fields: Mapping[str, Sequence[Field]],
    index: int,
    max_inflight_bytes: Optional[int] = None,
    dense_bytes: int = 0,
    communicator_bytes: int = 0,
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
            get new shards).
        communicator_bytes (int): a communicator connected for the exchange.

    Returns:
        PeakEstimate: the bound, by cause.
    """
    costs = {key: piece_cost(fields[key]) for key in new}
    new_state = sum(
        costs[key].of(shard.rect)
        for key, layout in new.items()
        for shard in layout.shards_on(index)
    )
    sent, received = bytes_per_rank(old, new, costs)
    wire = sent.get(index, 0) + received.get(index, 0)
    if max_inflight_bytes is not None:
        wire = min(wire, max_inflight_bytes)
    return PeakEstimate(
        new_state, wire, dense_bytes if new_state else 0, communicator_bytes
    )


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
        f"kernels {estimate.new_state_bytes} B, exchange buffers "
        f"{estimate.buffer_bytes} B, dense part {estimate.dense_bytes} B, "
        f"communicator {estimate.communicator_bytes} B) but {free_bytes} B are "
        f"free: {short} B short; {hint}"
    )


def free_device_bytes(device: torch.device) -> Optional[int]:
    """Free bytes on a CUDA device (None elsewhere: host memory is not checked)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


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

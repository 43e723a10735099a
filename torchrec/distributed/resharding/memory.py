#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Page-level memory of live resharding: giving the pages of CPU memory that
nothing reads any more back to the OS (``madvise(MADV_DONTNEED)``), and
counting what was resident (``mincore``). A reshard allocates and frees memory
of the size of the tables it moves; freed memory the allocator keeps would
otherwise stay resident long after the reshard.
"""

import ctypes
import mmap
import sys
from typing import Any, List, Optional, Sequence, Tuple

import torch


def _load_libc() -> Optional[Any]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mincore.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


# The C library's madvise and mincore (Linux); loaded once, like any constant.
_LIBC: Optional[Any] = _load_libc()


def _resident_bytes(libc: Any, start: int, length: int) -> int:
    """Bytes of the page-aligned range that are in memory (``mincore``)."""
    pages = length // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(start, length, vec) != 0:
        return length
    flags = torch.frombuffer(vec, dtype=torch.uint8)
    return int(flags.bitwise_and(1).sum()) * mmap.PAGESIZE


def _gaps(length: int, live: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Byte ranges (start, end) of ``[0, length)`` outside the ``live`` ranges."""
    gaps: List[Tuple[int, int]] = []
    cursor = 0
    for start, size in sorted(live):
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, start + size)
    if cursor < length:
        gaps.append((cursor, length))
    return gaps


def release_buffer(tensor: torch.Tensor) -> None:
    """
    Gives the pages of a CPU buffer the caller owns alone (e.g. an exchange
    buffer it is about to drop) back to the OS; pinned buffers stay as they
    are (CUDA's host allocator owns their pages).

    Args:
        tensor (torch.Tensor): the buffer; nothing may read it afterwards.

    Returns:
        None
    """
    if tensor.device.type == "cpu" and tensor.numel() > 0 and not tensor.is_pinned():
        release_pages(tensor.untyped_storage(), [])


def pinned_staging(
    buffer_device: torch.device, data_devices: Sequence[torch.device]
) -> bool:
    """
    Whether a buffer on ``buffer_device`` that stages data on
    ``data_devices`` is pinned: a host buffer for CUDA tensors (where the wire
    needs host memory, e.g. gloo) is page-locked, so that the copies to and
    from the GPU run at full speed.

    Args:
        buffer_device (torch.device): where the buffer lives.
        data_devices (Sequence[torch.device]): where the tensors copied into
            or out of it live.

    Returns:
        bool: pin the buffer.
    """
    return buffer_device.type == "cpu" and any(d.type == "cuda" for d in data_devices)


def release_pages(
    storage: torch.UntypedStorage, live: Sequence[Tuple[int, int]]
) -> int:
    """
    ``madvise(MADV_DONTNEED)`` on the whole pages of a CPU storage outside the
    ``live`` byte ranges: their memory goes back to the OS and they read as
    zeros afterwards. Only for storage nobody reads outside ``live``.

    Args:
        storage (torch.UntypedStorage): the storage.
        live (Sequence[Tuple[int, int]]): byte ranges (offset, length) in use.

    Returns:
        int: resident bytes given back.
    """
    if storage.device.type != "cpu":
        return 0
    libc = _LIBC
    if libc is None:
        return 0
    page = mmap.PAGESIZE
    base = storage.data_ptr()
    released = 0
    for start, end in _gaps(storage.nbytes(), live):
        first = -(-(base + start) // page) * page
        last = (base + end) // page * page
        if last <= first:
            continue
        resident = _resident_bytes(libc, first, last - first)
        if libc.madvise(first, last - first, mmap.MADV_DONTNEED) == 0:
            released += resident
    return released

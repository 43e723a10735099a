#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The device a transaction exchanges on, as its tensors report it, and waiting
for the work queued on it before the exchange reads or the commit installs.
"""

import torch


def normalized_device(device: torch.device) -> torch.device:
    """
    A device as tensors report theirs: ``cuda`` without an index is the
    current CUDA device (``torch.device("cuda") != torch.device("cuda:0")``,
    which would make the exchange buffer every message).

    Args:
        device (torch.device): a device.

    Returns:
        torch.device: the same device, with its index on CUDA.
    """
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize_device(device: torch.device) -> None:
    """
    Waits until a CUDA device finished the work queued on it on any stream (a
    pipeline's collectives in flight, an optimizer step on a side stream): an
    exchange group orders its streams after the current stream only. Nothing
    to wait for on CPU.

    Args:
        device (torch.device): the exchange's device.

    Returns:
        None
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)

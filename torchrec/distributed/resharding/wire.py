#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Deprecated (goes in the next release): the exchange group is in
``exchange_group``, the abort signal in ``abort_signal``, the device helpers
in ``devices``.
"""

import warnings

from torchrec.distributed.resharding.abort_signal import AbortedByPeer, AbortSignal
from torchrec.distributed.resharding.devices import (
    normalized_device,
    synchronize_device,
)
from torchrec.distributed.resharding.exchange_group import (
    ExchangeGroup,
    Message,
    open_exchange_group,
)

__all__ = [
    "AbortedByPeer",
    "AbortSignal",
    "ExchangeGroup",
    "Message",
    "normalized_device",
    "open_exchange_group",
    "synchronize_device",
]

warnings.warn(
    "torchrec.distributed.resharding.wire is deprecated: import from "
    "torchrec.distributed.resharding.exchange_group (the group), "
    "abort_signal or devices",
    DeprecationWarning,
    stacklevel=2,
)

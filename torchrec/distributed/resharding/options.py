#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
How a live reshard runs: the options every entry point takes (a module, a
model, a move between groups), and the storage mode of rebuilt kernels.
"""

import enum
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, TYPE_CHECKING

if TYPE_CHECKING:
    from torchrec.distributed.resharding.exchange_groups import ExchangeGroups


class StorageMode(enum.Enum):
    """
    How a reshard gives memory to the table shards that stay where they are in
    a rebuilt kernel group.

    * ``REUSE``: they keep their storage where the device allows it (CPU on
      Linux), in kernels of their own; elsewhere they are copied;
    * ``COPY``: a rebuilt group is always one kernel, kept shards are copied.
    """

    REUSE = "reuse"
    COPY = "copy"


@dataclass(frozen=True)
class ReshardOptions:
    """
    How a reshard runs; the same for a module (``reshard_module``,
    ``update_shards``), a model (``DistributedModelParallel.reshard``) and a
    move between groups of ranks (``move_model``, ``unshard_model``,
    ``shard_from_rank``).

    Args:
        max_inflight_bytes (Optional[int]): cap on a rank's exchange buffers
            (send plus receive) at any time; the exchange runs in as many
            rounds as the cap needs.
        exchange_timeout (Optional[timedelta]): how long a rank waits for the
            others, in the agreement and in the exchange (default: the
            backend's default process-group timeout).
        progress (bool): a progress bar over the exchange rounds on the
            transaction's first rank.
        storage (StorageMode): whether table shards that stay put keep their
            storage (``REUSE``, the default) or are copied (``COPY``).
        exchange_groups (Optional[ExchangeGroups]): deprecated (options hold
            settings, not connections): a transaction keeps its exchange
            groups in its ``ShardingEnv``
            (``exchange_groups.kept_exchange_groups``; install others with
            ``exchange_groups.keep_exchange_groups``). Still honoured, with a
            ``DeprecationWarning``, for one release.
    """

    max_inflight_bytes: Optional[int] = None
    exchange_timeout: Optional[timedelta] = None
    progress: bool = False
    storage: StorageMode = StorageMode.REUSE
    exchange_groups: Optional["ExchangeGroups"] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.exchange_groups is not None:
            warnings.warn(
                "ReshardOptions.exchange_groups is deprecated: options hold "
                "settings, not connections; a transaction keeps its exchange "
                "groups in its ShardingEnv (install others with "
                "torchrec.distributed.resharding.exchange_groups."
                "keep_exchange_groups(env, groups))",
                DeprecationWarning,
                stacklevel=3,
            )
        if self.max_inflight_bytes is not None and self.max_inflight_bytes <= 0:
            raise ValueError(
                f"max_inflight_bytes must be positive, got {self.max_inflight_bytes}"
            )

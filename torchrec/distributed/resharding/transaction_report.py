#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
What one rank reports of a transaction of any kind.

:class:`TransactionReport` is what every kind of transaction returns (a
reshard, a move, an unshard, a shard from one rank, a dry run): the tables it
moved and rebuilt, the bytes this rank moved (the executor's
:class:`~torchrec.distributed.resharding.exchange.ExchangeStats`) or, from a
dry run, the bytes every rank would move, the exchange group it used and the
device memory it took, and the wall time of each phase
(:class:`PhaseTimes`). The runner (``runner``) fills it in.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from torchrec.distributed.resharding.exchange import ExchangeStats
from torchrec.distributed.types import ParameterSharding


@dataclass(frozen=True)
class PhaseTimes:
    """
    Wall time of each phase of a transaction on one rank, in seconds.

    Args:
        agree (float): validation and the first agreement.
        build (float): building the new state and the second agreement.
        exchange (float): the exchange group, the fill, what else travels and
            the barrier.
        commit (float): swapping the new state in.
    """

    agree: float = 0.0
    build: float = 0.0
    exchange: float = 0.0
    commit: float = 0.0

    @property
    def total(self) -> float:
        return self.agree + self.build + self.exchange + self.commit


@dataclass
class TransactionReport(ExchangeStats):
    """
    What one rank did in a transaction of any kind, or, from a dry run, what
    every rank would move. The byte counts of :class:`ExchangeStats` are what
    this rank moved (none in a dry run).

    Args:
        kind (str): "reshard", "move", "unshard" or "shard_from_rank".
        rank (int): this rank's global rank.
        role (str): this rank's part ("member" of a reshard; "stayed", "left"
            or "joined" in a move; "source" or "destination" in an unshard or
            a shard from one rank).
        dry_run (bool): nothing was built or moved.
        phases (PhaseTimes): wall time of each phase on this rank.
        tables_moved (Dict[str, List[str]]): module path -> its tables whose
            layout changes (the same on every rank).
        tables_rebuilt (Dict[str, List[str]]): module path -> its tables the
            transaction plans and rebuilds.
        tables_kept_in_place (Dict[str, List[str]]): module path -> its tables
            of which a shard of this rank kept its storage (nothing copied),
            once per shard.
        bytes_released (int): bytes of departed tables' state given back to
            the OS from storage that kept shards share.
        dense_bytes (int): bytes of the dense part each receiving rank gets.
        bytes_sent_by_rank (Dict[int, int]): from a dry run: global rank ->
            table bytes it would send.
        bytes_received_by_rank (Dict[int, int]): from a dry run: global rank
            -> table bytes it would receive.
        deltas (Optional[Dict[str, Dict[str, ParameterSharding]]]): the facts
            of a reshard: module path -> its changed tables and their new
            sharding (None for the other kinds).
        connect_seconds (float): of the exchange phase, the time this rank
            took to connect the exchange group (0 when a kept one was reused).
        exchange_group (str): the name of the exchange group used (the
            transaction that connected it).
        communicator_bytes (int): device memory the exchange group's
            connect took on this rank (measured; 0 on CPU).
        kept_communicator_bytes (int): device memory of every exchange group
            this rank keeps after the transaction (its ``ExchangeGroups``).
        estimated_peak_bytes (int): the bound of the bytes the transaction
            could add on this rank's device (``device_memory``; checked
            against the free memory on CUDA).
        peak_memory_bytes (int): the peak this rank reached (``memory_kind``).
        memory_kind (str): what ``peak_memory_bytes`` counts:
            "cuda_allocated" (device bytes allocated through PyTorch) or
            "host_rss" (the process's resident set).
    """

    kind: str = ""
    rank: int = 0
    role: str = "member"
    dry_run: bool = False
    phases: PhaseTimes = field(default_factory=PhaseTimes)
    tables_moved: Dict[str, List[str]] = field(default_factory=dict)
    tables_rebuilt: Dict[str, List[str]] = field(default_factory=dict)
    tables_kept_in_place: Dict[str, List[str]] = field(default_factory=dict)
    bytes_released: int = 0
    dense_bytes: int = 0
    bytes_sent_by_rank: Dict[int, int] = field(default_factory=dict)
    bytes_received_by_rank: Dict[int, int] = field(default_factory=dict)
    deltas: Optional[Dict[str, Dict[str, ParameterSharding]]] = None
    connect_seconds: float = 0.0
    exchange_group: str = ""
    communicator_bytes: int = 0
    kept_communicator_bytes: int = 0
    estimated_peak_bytes: int = 0
    peak_memory_bytes: int = 0
    memory_kind: str = ""

    @property
    def seconds(self) -> float:
        """Wall time of the transaction on this rank."""
        return self.phases.total

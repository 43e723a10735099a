#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Doubles for one-process tests of the transaction runner: a participant that
copies one table of one rank into a new slot (and records what it is asked),
and kept exchange groups whose backends record their calls (every method
call, and the lifecycle as text: connect, abort, shutdown, set_timeout)
while they pass each call to a real gloo backend; the environment that
keeps such groups for a participant's transactions.
"""

import dataclasses
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.resharding.exchange_group import (
    ExchangeGroup,
    open_exchange_group,
)
from torchrec.distributed.resharding.exchange_groups import (
    ExchangeGroups,
    keep_exchange_groups,
)
from torchrec.distributed.resharding.fields import Field, FieldKind
from torchrec.distributed.resharding.plan import PlacedShard, Rect, TableLayout
from torchrec.distributed.resharding.runner import (
    Participant,
    Slots,
    TransactionLayouts,
)
from torchrec.distributed.resharding.slots import LocalSlot
from torchrec.distributed.types import ShardingEnv

# the fields of the tests' tables: fp32 weights, and a per-row state
WEIGHT = Field("weight", FieldKind.RECT, torch.float32)
SUM = Field("sum", FieldKind.ROWS, torch.float32)
WHOLE = Rect(0, 0, 4, 3)


class RecordingBackend:
    """
    A real backend (e.g. a ``ProcessGroupGloo``) whose method calls are
    recorded and passed through unchanged: a call the real binding refuses
    raises here as it would without the double. Lifecycle calls (abort,
    shutdown, set_timeout) are also written to ``calls`` as text.

    Args:
        backend (Any): the real backend.
        calls (List[str]): where the lifecycle calls are written.
    """

    def __init__(self, backend: Any, calls: List[str]) -> None:
        self._backend = backend
        self.calls = calls
        # (method, positional arguments, keyword arguments), in call order
        self.log: List[Tuple[str, Tuple[Any, ...], Dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._backend, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            self.log.append((name, args, kwargs))
            if name in ("abort", "shutdown"):
                self.calls.append(name)
            elif name == "set_timeout":
                self.calls.append(f"set_timeout {args[0].total_seconds():g}")
            result = attribute(*args, **kwargs)
            if isinstance(result, dist.Work):
                return RecordingWork(result, self.log)
            return result

        return call


class RecordingWork:
    """
    A real work whose calls are recorded in its backend's log (as
    ``work.NAME``) and passed through unchanged.

    Args:
        work (dist.Work): the real work.
        log (List[Tuple[str, Tuple[Any, ...], Dict[str, Any]]]): the log.
    """

    def __init__(
        self, work: Any, log: List[Tuple[str, Tuple[Any, ...], Dict[str, Any]]]
    ) -> None:
        self._work = work
        self._log = log

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._work, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self._log.append((f"work.{name}", args, kwargs))
            return attribute(*args, **kwargs)

        return call


class RecordingGroups(ExchangeGroups):
    """
    Kept groups (gloo, on the host) whose backends record their calls: the
    one wrapping of a real group's backend that every test uses.

    Args:
        calls (List[str]): where "connect" and the backends' lifecycle calls
            are written.
        max_groups (int): the most groups kept.
        one_rank (bool): for a one-rank job: every group connects this rank
            alone (for real), whatever members it is asked for.
        device (Optional[torch.device]): the device every group states
            (None: the one it connected on).
        communicator_bytes (Optional[int]): the communicator memory every
            group states (None: what it measured).
    """

    def __init__(
        self,
        calls: List[str],
        max_groups: int = 2,
        one_rank: bool = False,
        device: Optional[torch.device] = None,
        communicator_bytes: Optional[int] = None,
    ) -> None:
        super().__init__(max_groups)
        self.calls = calls
        self._one_rank = one_rank
        self._device = device
        self._bytes = communicator_bytes

    def connect(
        self,
        global_ranks: Sequence[int],
        transaction: str,
        timeout: timedelta,
        device: torch.device,
    ) -> ExchangeGroup:
        self.calls.append("connect")
        ranks = [0] if self._one_rank else global_ranks
        group = open_exchange_group(ranks, transaction, timeout)
        return dataclasses.replace(
            group,
            backend=RecordingBackend(group.backend, self.calls),
            device=self._device or group.device,
            communicator_bytes=(
                group.communicator_bytes if self._bytes is None else self._bytes
            ),
        )


class CopyParticipant(Participant[Any, Any]):
    """
    One 4x3 table of a one-rank job copied into a new slot; it may fail after
    the fill, and states any device (its tensors stay on the host).

    Args:
        calls (List[str]): where it records what it is asked.
        fail (bool): raise after the fill.
        device (Optional[torch.device]): the device it states.
        owner (Optional[Any]): the env whose kept exchange groups it uses
            (none: a group of its own).
    """

    kind = "copy"

    def __init__(
        self,
        calls: List[str],
        fail: bool = False,
        device: Optional[torch.device] = None,
        owner: Optional[Any] = None,
    ) -> None:
        self.calls = calls
        self.fail = fail
        self._device: torch.device = device or torch.device("cpu")
        self._owner = owner
        self.old: torch.Tensor = torch.arange(12, dtype=torch.float32).view(4, 3)
        self.new: torch.Tensor = torch.zeros(4, 3)

    def ranks(self) -> List[int]:
        return [dist.get_rank()]

    def request(self) -> List[str]:
        return ["copy"]

    def prepare(self) -> Any:
        return None

    def agreed(self, merged: Any) -> TransactionLayouts:
        layout = TableLayout(4, 3, (PlacedShard(0, WHOLE),))
        return TransactionLayouts({"t": layout}, {"t": layout}, {"t": (WEIGHT,)})

    def build(self) -> None:
        self.calls.append("build")
        self.new.zero_()

    def slots(self) -> Tuple[Slots, Slots]:
        self.calls.append("slots")
        old = LocalSlot("t", WHOLE, {"weight": self.old})
        new = LocalSlot("t", WHOLE, {"weight": self.new})
        return {("t", WHOLE): old}, {("t", WHOLE): new}

    def after_exchange(self, group: ExchangeGroup) -> None:
        if self.fail:
            raise RuntimeError("injected after the fill")

    def commit(self) -> int:
        self.calls.append("commit")
        return 0

    def abort(self) -> None:
        self.calls.append("participant abort")

    def device(self) -> torch.device:
        return self._device

    def exchange_groups_owner(self) -> Optional[Any]:
        return self._owner


def env_keeping(groups: ExchangeGroups) -> ShardingEnv:
    """
    A ``ShardingEnv`` of the default process group that keeps ``groups`` for
    its transactions (a participant's ``owner``).

    Args:
        groups (ExchangeGroups): the groups the transactions should keep.

    Returns:
        ShardingEnv: the environment.
    """
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    keep_exchange_groups(env, groups)
    return env

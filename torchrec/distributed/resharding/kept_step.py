#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The kept-storage step of a transaction: one object, beside the participant,
that owns everything about the shards a transaction leaves where they are,
for every kind of transaction (a reshard of a model's modules, a move of the
model onto other ranks and the recoveries built on it).

A participant drives it through the transaction's phases, the way a
checkpoint planner is paired with its storage reader:

* **prepare**: :meth:`KeptStorageStep.find_runs` finds this rank's runs of
  kept shards (``kept_grouping.kept_runs``) and returns what the agreement
  carries of them;
* **merge** (the coordinator): :meth:`KeptStorageStep.agree` gives every
  table of a run the same batch key on every rank (``kept_grouping``);
* **build**: :meth:`KeptStorageStep.build_hooks` makes the kernel build hooks
  (``storage.KeptStorage``: kernels of kept runs on views of the old storage)
  and the sharding build hooks (``kept_grouping.KeptGrouping``: a kernel of
  their own for the shards of each run); the runs go to the hooks, which hold
  the old kernels until the release;
* **commit**: :meth:`KeptStorageStep.release` decides what happens to the old
  kernels' storage; **abort**: :meth:`KeptStorageStep.abort` drops it all, the
  old model keeping its storage as it is.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torchrec.distributed.resharding.kept_grouping import (
    batch_keys,
    kept_runs,
    KeptBatchKey,
    KeptGrouping,
    KeptRun,
    run_facts,
    TablePlacement,
)
from torchrec.distributed.resharding.options import ReshardOptions, StorageMode
from torchrec.distributed.resharding.storage import KeptStorage, storage_reuse_supported

# module path -> the tables of each of this rank's runs of kept shards
RunFacts = Dict[str, List[List[str]]]
# module path -> table -> its agreed batch key
BatchKeys = Dict[str, Dict[str, KeptBatchKey]]


class KeptStorageStep:
    """
    A transaction's kept shards on one rank: their runs, their batch keys,
    the build hooks that keep their storage, and the release of the old
    kernels' storage.

    Args:
        reuse (bool): kept shards may keep their storage (see
            :meth:`for_options`); without it nothing is kept and the old
            storage is simply dropped at the commit.
    """

    def __init__(self, reuse: bool) -> None:
        self._reuse = reuse
        self._runs: List[KeptRun] = []
        self._hooks: Optional[KeptStorage] = None

    @classmethod
    def for_options(
        cls,
        options: ReshardOptions,
        device: Optional[torch.device],
        model_device: Optional[torch.device] = None,
    ) -> "KeptStorageStep":
        """
        The step a transaction's options allow: storage is kept only under
        ``StorageMode.REUSE``, on a device whose storage can be shared, and,
        for a model that moves, only where it stays on its device.

        Args:
            options (ReshardOptions): the transaction's options.
            device (Optional[torch.device]): the device the new kernels are
                built on.
            model_device (Optional[torch.device]): the device of the model
                being moved, where it differs from the transaction's (None:
                the same).

        Returns:
            KeptStorageStep: the step, keeping storage or not.
        """
        reuse = options.storage == StorageMode.REUSE and storage_reuse_supported(device)
        if model_device is not None and model_device != device:
            reuse = False
        return cls(reuse)

    @property
    def reuse(self) -> bool:
        """Whether kept shards may keep their storage."""
        return self._reuse

    @property
    def has_runs(self) -> bool:
        """Whether this rank found runs of kept shards (and holds them)."""
        return bool(self._runs)

    @property
    def hooks(self) -> Optional[KeptStorage]:
        """The kernel build hooks, once :meth:`build_hooks` made them."""
        return self._hooks

    def find_runs(
        self,
        groups: Mapping[Tuple[str, str], Sequence[nn.Module]],
        kept: Mapping[str, Any],
    ) -> RunFacts:
        """
        Finds this rank's runs of kept shards (none where storage is not
        kept), and adds them to those it already found.

        Args:
            groups (Mapping[Tuple[str, str], Sequence[nn.Module]]): (module
                path, sharding type) -> the group's old batched kernels.
            kept (Mapping[str, Any]): module path -> the set of tables whose
                shards stay exactly where they are.

        Returns:
            RunFacts: what the agreement carries of every run found so far.
        """
        if self._reuse:
            self._runs += kept_runs(groups, kept)
        return run_facts(self._runs)

    @staticmethod
    def agree(
        all_runs: Sequence[Tuple[int, Mapping[str, List[List[str]]]]],
        placements: Mapping[str, Mapping[str, TablePlacement]],
        user_keys: Mapping[str, Mapping[str, Any]],
    ) -> BatchKeys:
        """
        The batch keys of every kept run, the same on every rank (pure: the
        coordinator computes them from every rank's :meth:`find_runs`).

        Args:
            all_runs (Sequence[Tuple[int, Mapping[str, List[List[str]]]]]):
                (rank, its run facts) for every rank that has runs.
            placements (Mapping[str, Mapping[str, TablePlacement]]): module
                path -> table -> its sharding type and ranks under the new plan.
            user_keys (Mapping[str, Mapping[str, Any]]): module path -> table
                -> the user's own batch key (None for none).

        Returns:
            BatchKeys: module path -> table -> its batch key.
        """
        return batch_keys(all_runs, placements, user_keys)

    def build_hooks(
        self,
        old_batched: Sequence[nn.Module],
        keys: Mapping[str, Mapping[str, KeptBatchKey]],
        params: Mapping[str, Mapping[str, torch.Tensor]],
        sharded_tensors_from_metadata: bool = False,
    ) -> Tuple[KeptStorage, KeptGrouping]:
        """
        The hooks the new kernels are built under; the runs go to them.

        Args:
            old_batched (Sequence[nn.Module]): the batched kernels whose
                storage the transaction retires.
            keys (Mapping[str, Mapping[str, KeptBatchKey]]): the agreed batch
                keys (:meth:`agree`).
            params (Mapping[str, Mapping[str, torch.Tensor]]): module path ->
                table -> the parameter the sharded module is built from
                (``KeptGrouping``).
            sharded_tensors_from_metadata (bool): see ``KeptGrouping``.

        Returns:
            Tuple[KeptStorage, KeptGrouping]: the kernel build hooks and the
            sharding build hooks.
        """
        # nothing retired, nothing to release: the old storage is not walked
        reuse = self._reuse and bool(old_batched)
        self._hooks = KeptStorage(old_batched, self._runs, keys, reuse=reuse)
        self._runs = []  # the hooks hold the old kernels until they release
        grouping = KeptGrouping(
            keys, params, sharded_tensors_from_metadata=sharded_tensors_from_metadata
        )
        return self._hooks, grouping

    def release(self, modules: Sequence[nn.Module]) -> int:
        """
        At the commit, once the old kernels are retired: what happens to their
        storage (``KeptStorage.release``).

        Args:
            modules (Sequence[nn.Module]): the sharded embedding modules, after
                the swap.

        Returns:
            int: resident bytes of tables' state given back to the OS (0 when
            no hooks were built).
        """
        hooks, self._hooks = self._hooks, None
        self._runs = []
        return hooks.release(modules) if hooks is not None else 0

    def abort(self) -> None:
        """Drops the runs and the hooks: the old model keeps its storage."""
        self._runs = []
        self._hooks = None

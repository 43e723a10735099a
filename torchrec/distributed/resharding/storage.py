#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Kernel storage for live resharding: where the kernels a transaction builds get
their memory, and what happens to the memory of the old ones. One mechanism
serves a reshard within a group and a move between groups; it goes through
TorchRec's :class:`KernelBuildHooks` (a patch of the series), scoped to the
building call in the building thread:

* **no initialisation**: the transaction overwrites every byte of the kernels
  it builds, so they skip random init and fbgemm's zero fill (host buffers of
  the sizes fbgemm's own ``construct_split_state`` gives);
* **kept shards keep their storage** (:attr:`StorageMode.REUSE`, CPU): the
  kernel of each run of kept shards (``kept_grouping``) is built on a view of
  the old kernel's storage (fbgemm's ``preallocated_host_buffers``; the dense
  kernel's weights): nothing is copied, and views a caller took of them keep
  tracking the live table;
* **retired storage**: once the old kernels are retired (their reference
  cycles broken, so they are freed at once), their memory goes back to the OS
  only where nothing outside the module can see it (``retired``).
"""

import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    construct_split_state,
    DenseTableBatchedEmbeddingBagsCodegen,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torchrec.distributed.batched_embedding_kernel import KernelBuildHooks
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.resharding.kept_grouping import (
    BATCH_KEY,
    KeptBatchKey,
    KeptRun,
    RunId,
    shard_key,
    ShardKey,
)
from torchrec.distributed.resharding.options import (  # noqa: F401 (its old home)
    StorageMode,
)
from torchrec.distributed.resharding.retired import HOST_STATES, RetiredStorage

# Optimizers whose host state layout is known here (the CPU ones): whether
# their momentum1 is row-wise. Others get only their weights preallocated.
_MOMENTUM1_ROWWISE: Dict[EmbOptimType, Optional[bool]] = {
    EmbOptimType.EXACT_SGD: None,
    EmbOptimType.EXACT_ADAGRAD: False,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: True,
}


def storage_reuse_supported(device: Optional[torch.device]) -> bool:
    """
    Kept shards keep their storage only where the pages of departed tables can
    be given back: CPU memory on Linux.

    Args:
        device (Optional[torch.device]): the module's device.

    Returns:
        bool: whether kept shards may keep their storage.
    """
    on_cpu = device is None or device.type == "cpu"
    return on_cpu and sys.platform.startswith("linux")


class KeptStorage(KernelBuildHooks):
    """
    The kernel build hooks of a transaction: kernels skip initialisation and
    take uninitialised host buffers (every byte is overwritten), and the
    kernel of each run of kept shards (its tables grouped by their agreed
    batch key, see :class:`KeptGrouping`) is built on a view of the old
    kernel's storage. Afterwards, :meth:`release` decides what happens to the
    old kernels' storage.

    Args:
        old_batched (Sequence[nn.Module]): the TorchRec batched kernels whose
            storage the transaction retires.
        runs (Sequence[KeptRun]): this rank's runs of kept shards.
        keys (Mapping[str, Mapping[str, KeptBatchKey]]): module path -> table
            -> its agreed batch key.
        reuse (bool): kept shards may keep their storage: :meth:`release`
            gives the pages nobody uses back (otherwise old storage is simply
            dropped).
    """

    def __init__(
        self,
        old_batched: Sequence[nn.Module] = (),
        runs: Sequence[KeptRun] = (),
        keys: Optional[Mapping[str, Mapping[str, KeptBatchKey]]] = None,
        reuse: bool = False,
    ) -> None:
        keys = keys or {}
        self._reuse = reuse
        # (module path, the runs of a batch key) -> (old kernel, first
        # position, shards) of each kept run, a run split where its tables'
        # keys differ
        self._runs: Dict[
            Tuple[str, Tuple[RunId, ...]], List[Tuple[nn.Module, int, List[ShardKey]]]
        ] = {}
        for run in runs:
            table_keys = keys.get(run.path, {})
            start = 0
            for i in range(1, len(run.shards) + 1):
                key = table_keys.get(run.shards[start][0])
                if i < len(run.shards) and table_keys.get(run.shards[i][0]) == key:
                    continue
                if key is not None:
                    self._runs.setdefault((run.path, key.runs), []).append(
                        (run.kernel, run.first + start, run.shards[start:i])
                    )
                start = i
        self._retired = RetiredStorage(old_batched)

    # ------------------------------------------------------------- build hooks

    def init_parameters(self, config: GroupedEmbeddingConfig) -> bool:
        return False

    def host_buffers(
        self, config: GroupedEmbeddingConfig, tbe_kwargs: Dict[str, Any]
    ) -> Optional[Dict[str, torch.Tensor]]:
        kept = self._kept_run(config, SplitTableBatchedEmbeddingBagsCodegen)
        if kept is not None:
            kernel, first, count = kept
            buffers = {}
            for state in HOST_STATES:
                view = self._kept_view(kernel, state, first, count)
                if view is not None:
                    buffers[state] = view
            if "weights" in buffers:
                return buffers
        return _uninitialized_host_buffers(tbe_kwargs)

    def dense_weights(
        self,
        config: GroupedEmbeddingConfig,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Optional[torch.Tensor]:
        kept = self._kept_run(config, DenseTableBatchedEmbeddingBagsCodegen)
        if kept is None:
            return None
        kernel, first, count = kept
        view = self._kept_view(kernel, "weights", first, count)
        if view is None or view.numel() != numel or view.dtype != dtype:
            return None
        return view

    def _kept_run(
        self, config: GroupedEmbeddingConfig, kernel_type: type
    ) -> Optional[Tuple[nn.Module, int, int]]:
        """
        (old kernel, first position, count) when the tables of ``config`` are
        one kept run of an old kernel of ``kernel_type``; else None.
        """
        tables = list(config.embedding_tables)
        keys = {(t.fused_params or {}).get(BATCH_KEY) for t in tables}
        if len(keys) != 1:
            return None
        key = keys.pop()
        if not isinstance(key, KeptBatchKey):
            return None
        shards = [shard_key(t) for t in tables]
        for kernel, first, run in self._runs.get((key.path, key.runs), []):
            if run == shards and type(kernel) is kernel_type:
                return kernel, first, len(shards)
        return None

    def _kept_view(
        self, kernel: nn.Module, state: str, first: int, count: int
    ) -> Optional[torch.Tensor]:
        """A 1-D view of positions ``first .. first + count - 1`` of one state."""
        if isinstance(kernel, DenseTableBatchedEmbeddingBagsCodegen):
            if state != "weights":
                return None
            tensor = kernel.weights
            offsets = list(kernel.weights_physical_offsets)
        else:
            tensor = getattr(kernel, f"{state}_host", None)
            offsets = getattr(kernel, f"{state}_physical_offsets", None)
            placements = getattr(kernel, f"{state}_physical_placements", None)
            if tensor is None or offsets is None or placements is None:
                return None
            host = EmbeddingLocation.HOST.value
            if any(placements[p] != host for p in range(first, first + count)):
                return None
            offsets = list(offsets) + [tensor.numel()]
        if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
            return None
        flat = tensor.detach().view(-1)
        view = flat[offsets[first] : offsets[first + count]]
        return view if self._retired.take_over(view) else None

    # ----------------------------------------------------------------- release

    def release(self, modules: Sequence[nn.Module]) -> int:
        """
        Decides what happens to the old kernels' storage, once the old kernels
        are retired and nothing of the reshard references them any more: with
        storage reuse off it is simply dropped, otherwise ``retired`` gives
        the pages nobody uses back to the OS.

        Args:
            modules (Sequence[nn.Module]): the sharded embedding modules,
                after the swap.

        Returns:
            int: resident bytes of tables' state given back to the OS.
        """
        self._runs = {}  # the old kernels' references would keep the storage
        if not self._reuse:
            self._retired.drop()  # copied: the old storage is simply dropped
            return 0
        return self._retired.release(modules)


def _uninitialized_host_buffers(
    tbe_kwargs: Mapping[str, Any],
) -> Optional[Dict[str, torch.Tensor]]:
    """
    Uninitialised host buffers for a fused kernel on CPU, of the sizes
    fbgemm's own ``construct_split_state`` gives (fbgemm would allocate and
    zero them): weights, and momentum1 for the optimizers whose layout is
    known here. None when a table is not in host memory.
    """
    specs = tbe_kwargs.get("embedding_specs") or []
    precision = tbe_kwargs.get("weights_precision")
    if not specs or precision is None:
        return None
    if any(spec[2] != EmbeddingLocation.HOST for spec in specs):
        return None
    device = tbe_kwargs.get("device") or torch.device("cpu")
    weights = construct_split_state(
        specs, rowwise=False, cacheable=True, precision=precision
    )
    buffers = {
        "weights": torch.empty(
            weights.host_size, dtype=precision.as_dtype(), device=device
        )
    }
    optimizer = tbe_kwargs.get("optimizer", EmbOptimType.EXACT_SGD)
    rowwise = _MOMENTUM1_ROWWISE.get(optimizer)
    if rowwise is not None and tbe_kwargs.get("optimizer_state_dtypes") is None:
        momentum1 = construct_split_state(specs, rowwise=rowwise, cacheable=False)
        buffers["momentum1"] = torch.empty(
            momentum1.host_size, dtype=torch.float32, device=device
        )
    return buffers

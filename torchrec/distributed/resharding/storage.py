#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Kernel storage for live resharding: where the kernels of a rebuilt sharding
group get their memory, and what happens to the memory of the old ones.

The tables of one sharding group live in one fbgemm batched kernel per grouped
config, i.e. one contiguous storage per state (weights, momentum1, ...). When a
group gains or loses a table it is rebuilt. Everything here goes through
TorchRec's :class:`KernelBuildHooks` (a patch of the series), scoped to the
building call in the building thread:

* **no initialisation**: the reshard overwrites every byte of the kernels it
  builds, so they skip random init and fbgemm's zero fill;
* **kept tables keep their storage** (:attr:`StorageMode.REUSE`, CPU): tables
  the reshard does not change keep their batch key (TorchRec's ``_batch_key``
  grouping parameter) while changed tables get one of this reshard's
  generation, so the kept tables of an old kernel form a grouped config of
  their own. When they lie back to back in the old kernel's storage, the new
  kernel is built on a view of it (fbgemm's ``preallocated_host_buffers``; the
  dense kernel's weights): nothing is copied, and views a caller took of them
  keep tracking the live table. Otherwise they are copied;
* **retired storage**: after the swap the old kernels are retired (their
  reference cycles broken, so they are freed at once, not at the next garbage
  collection). Their memory goes back to the OS only where nothing outside the
  module can see it: a storage nobody else references is released (pages of
  departed tables, or all of it); a storage a caller still references (an old
  state dict, a tensor from ``local_shards()``) is left exactly as it is and
  lives on as long as the caller holds it.

Every group keeps at most ``MAX_KERNELS_PER_GROUP`` kernels: a reshard that
would exceed it rebuilds the group as one kernel (kept tables copied).
"""

import enum
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DenseTableBatchedEmbeddingBagsCodegen,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._tensor import DTensor
from torchrec.distributed.batched_embedding_kernel import KernelBuildHooks
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.resharding.memory import release_pages

BATCH_KEY = "_batch_key"
_RESHARD_TAG = "#reshard"
MAX_KERNELS_PER_GROUP = 4

# Host state of a fused kernel: weights, then the optimizer's momenta.
_HOST_STATES: Tuple[str, ...] = ("weights", "momentum1", "momentum2")
# Optimizers whose host state sizes are known here (the CPU ones): whether
# their momentum1 is row-wise. Others get only their weights preallocated.
_MOMENTUM1_ROWWISE: Dict[EmbOptimType, Optional[bool]] = {
    EmbOptimType.EXACT_SGD: None,
    EmbOptimType.EXACT_ADAGRAD: False,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: True,
}


class StorageMode(enum.Enum):
    """
    How a reshard gives memory to the kept tables of a rebuilt group.

    * ``REUSE``: they keep their storage where the device allows it (CPU on
      Linux); elsewhere they are copied;
    * ``COPY``: a rebuilt group is always one kernel, kept tables are copied.
    """

    REUSE = "reuse"
    COPY = "copy"


def storage_reuse_supported(device: Optional[torch.device]) -> bool:
    """
    Kept tables keep their storage only where the pages of departed tables can
    be given back: CPU memory on Linux.

    Args:
        device (Optional[torch.device]): the module's device.

    Returns:
        bool: whether rebuilt groups split kept tables into kernels of their own.
    """
    on_cpu = device is None or device.type == "cpu"
    return on_cpu and sys.platform.startswith("linux")


def _batch_key(info: EmbeddingShardingInfo) -> str:
    return str((info.fused_params or {}).get(BATCH_KEY, ""))


def _with_batch_key(info: EmbeddingShardingInfo, key: str) -> EmbeddingShardingInfo:
    fused_params = dict(info.fused_params or {})
    fused_params[BATCH_KEY] = key
    return EmbeddingShardingInfo(
        embedding_config=info.embedding_config,
        param_sharding=info.param_sharding,
        param=info.param,
        fused_params=fused_params,
    )


def _user_key(info: EmbeddingShardingInfo) -> str:
    return _batch_key(info).split(_RESHARD_TAG)[0]


def _generation_key(info: EmbeddingShardingInfo, generation: int) -> str:
    # A user's own batch key is kept as the prefix, so their grouping holds.
    return f"{_user_key(info)}{_RESHARD_TAG}{generation}"


def _most_kernels_per_user_key(infos: Sequence[EmbeddingShardingInfo]) -> int:
    keys: Dict[str, Set[str]] = {}
    for info in infos:
        keys.setdefault(_user_key(info), set()).add(_batch_key(info))
    return max((len(k) for k in keys.values()), default=0)


def next_generation(infos: Mapping[str, Sequence[EmbeddingShardingInfo]]) -> int:
    """
    Args:
        infos (Mapping[str, Sequence[EmbeddingShardingInfo]]): a module's
            sharding infos.

    Returns:
        int: one more than the highest reshard generation in their batch keys
        (1 for a module never resharded); the same on every rank.
    """
    generations = [
        int(_batch_key(info).split(_RESHARD_TAG)[1])
        for group in infos.values()
        for info in group
        if _RESHARD_TAG in _batch_key(info)
    ]
    return max(generations, default=0) + 1


def split_kept_tables(
    new_infos: Mapping[str, List[EmbeddingShardingInfo]],
    changed_types: Sequence[str],
    changed_tables: Set[str],
    generation: int,
) -> None:
    """
    Gives the tables of rebuilt groups that the reshard changes a batch key of
    this reshard's generation, so TorchRec groups them into kernels apart from
    the tables that stay (which keep their key, hence their old grouping).
    A group that would split a user's batch key (none, by default) into more
    than ``MAX_KERNELS_PER_GROUP`` keys gets one key of this generation per
    user key instead (one kernel each, kept tables copied).
    Deterministic in its inputs, so every rank groups alike.

    Args:
        new_infos (Mapping[str, List[EmbeddingShardingInfo]]): the module's
            sharding infos after the reshard, by sharding type; changed in place.
        changed_types (Sequence[str]): sharding types whose group is rebuilt.
        changed_tables (Set[str]): tables whose ParameterSharding changes.
        generation (int): the module's reshard count, the same on every rank.

    Returns:
        None
    """
    for sharding_type in changed_types:
        if sharding_type not in new_infos:
            continue  # the group goes away
        infos = new_infos[sharding_type]
        for i, info in enumerate(infos):
            if info.embedding_config.name in changed_tables:
                infos[i] = _with_batch_key(info, _generation_key(info, generation))
        if _most_kernels_per_user_key(infos) > MAX_KERNELS_PER_GROUP:
            for i, info in enumerate(infos):
                infos[i] = _with_batch_key(info, _generation_key(info, generation))


ShardKey = Tuple[str, Tuple[int, ...]]


def shard_key(table: Any) -> ShardKey:
    """(table name, shard offsets) of a kernel's table shard."""
    metadata = table.local_metadata
    offsets = tuple(metadata.shard_offsets) if metadata is not None else ()
    return table.name, offsets


def _cpu_tensors(candidates: Sequence[Optional[torch.Tensor]]) -> List[torch.Tensor]:
    return [
        t
        for t in candidates
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() > 0
    ]


def _table_state(kernel: nn.Module) -> List[torch.Tensor]:
    """The per-table state of an fbgemm kernel in host memory (weights, momenta)."""
    if isinstance(kernel, DenseTableBatchedEmbeddingBagsCodegen):
        return _cpu_tensors([kernel.weights])
    return _cpu_tensors([getattr(kernel, f"{s}_host", None) for s in _HOST_STATES])


def _other_memory(kernel: nn.Module) -> List[torch.Tensor]:
    """
    The rest of the CPU memory an fbgemm kernel holds: the gradients of its
    parameters (a data-parallel kernel's live in DDP's buckets) and buffers.
    """
    params = list(kernel.parameters())
    return _cpu_tensors([p.grad for p in params] + list(kernel.buffers()))


@dataclass
class _Storage:
    """
    An old kernel's storage, held (one reference) until the reshard decides
    what happens to it.

    Args:
        storage (torch.UntypedStorage): the storage.
        live (List[Tuple[int, int]]): byte ranges (offset, length) that new
            kernels took over.
        table_state (bool): it holds tables' weights or optimizer state
            (what a report counts as released), not gradients or buffers.
    """

    storage: torch.UntypedStorage
    live: List[Tuple[int, int]] = field(default_factory=list)
    table_state: bool = True


class KeptStorage(KernelBuildHooks):
    """
    The kernel build hooks of a reshard: kernels skip initialisation and take
    uninitialised host buffers (every byte is overwritten), and kernels made of
    kept tables that lie back to back in one old kernel take views of its
    storage (when ``reuse``). Afterwards, :meth:`release` decides what happens
    to the old kernels' storage.

    Args:
        old_batched (Sequence[nn.Module]): the batched kernels of the rebuilt
            groups (TorchRec ``BaseBatchedEmbedding[Bag]`` modules).
        kept_tables (Set[str]): tables the reshard does not change.
        reuse (bool): whether kept tables may keep their storage.
    """

    def __init__(
        self, old_batched: Sequence[nn.Module], kept_tables: Set[str], reuse: bool
    ) -> None:
        self._reuse = reuse
        # kept shard -> (old fbgemm kernel, its position in that kernel)
        self._kept: Dict[ShardKey, Tuple[nn.Module, int]] = {}
        self._storages: Dict[int, _Storage] = {}
        for batched in old_batched:
            kernel = batched.emb_module
            for position, table in enumerate(batched.config.embedding_tables):
                if table.name in kept_tables:
                    self._kept[shard_key(table)] = (kernel, position)
            for tensor in _table_state(kernel):
                storage = tensor.untyped_storage()
                self._storages.setdefault(storage.data_ptr(), _Storage(storage))
            for tensor in _other_memory(kernel):
                storage = tensor.untyped_storage()
                self._storages.setdefault(
                    storage.data_ptr(), _Storage(storage, table_state=False)
                )

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
            for state in _HOST_STATES:
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
        (old kernel, first position, count) when every table of ``config`` is a
        kept shard of one old kernel of ``kernel_type``, at consecutive
        positions in order; else None.
        """
        if not self._reuse:
            return None
        keys = [shard_key(t) for t in config.embedding_tables]
        if not keys or any(k not in self._kept for k in keys):
            return None
        kernel, first = self._kept[keys[0]]
        if type(kernel) is not kernel_type:
            return None
        for i, key in enumerate(keys):
            other, position = self._kept[key]
            if other is not kernel or position != first + i:
                return None
        return kernel, first, len(keys)

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
        record = self._storages.get(view.untyped_storage().data_ptr())
        if record is None:
            return None
        start = view.data_ptr() - record.storage.data_ptr()
        record.live.append((start, view.numel() * view.element_size()))
        return view

    # ----------------------------------------------------------------- release

    def release(self, module: nn.Module) -> int:
        """
        Decides what happens to the old kernels' storage, once the old kernels
        are retired and nothing of the reshard references them any more. With
        storage reuse off, it is simply dropped. Otherwise, a storage that only
        the module (through the kernels that took it over)
        and these hooks reference gives the pages nobody uses back to the OS:
        the departed tables' pages, or all of it when no table stayed. A
        storage something else references (a view a caller took before the
        reshard) is left untouched. Either way this object drops its own
        reference, so a storage nobody uses any more is freed now.

        Args:
            module (nn.Module): the sharded module, after the swap.

        Returns:
            int: resident bytes of tables' state given back to the OS (the
            gradients and buffers of the old kernels go too, uncounted).
        """
        self._kept = {}  # the old kernels must not count as holders
        if not self._reuse:
            self._storages = {}  # copied: the old storage is simply dropped
            return 0
        held = tensors_reachable_from(module)
        released = 0
        for ptr, record in self._storages.items():
            others = _use_count(record.storage) - 1 - held.get(ptr, 0)
            if others == 0:
                pages = release_pages(record.storage, record.live)
                released += pages if record.table_state else 0
        self._storages = {}
        return released


def _uninitialized_host_buffers(
    tbe_kwargs: Mapping[str, Any],
) -> Optional[Dict[str, torch.Tensor]]:
    """
    Uninitialised host buffers of the sizes fbgemm would allocate (and zero)
    for a fused kernel on CPU: weights, and momentum1 for the optimizers whose
    layout is known here. None when a table is not in host memory.
    """
    specs = tbe_kwargs.get("embedding_specs") or []
    host = EmbeddingLocation.HOST
    if not specs or any(spec[2] != host for spec in specs):
        return None
    device = tbe_kwargs.get("device") or torch.device("cpu")
    rows = sum(spec[0] for spec in specs)
    elements = sum(spec[0] * spec[1] for spec in specs)
    precision = tbe_kwargs.get("weights_precision")
    if precision is None:
        return None
    buffers = {
        "weights": torch.empty(elements, dtype=precision.as_dtype(), device=device)
    }
    optimizer = tbe_kwargs.get("optimizer", EmbOptimType.EXACT_SGD)
    rowwise = _MOMENTUM1_ROWWISE.get(optimizer)
    if rowwise is not None and tbe_kwargs.get("optimizer_state_dtypes") is None:
        buffers["momentum1"] = torch.empty(
            rows if rowwise else elements, dtype=torch.float32, device=device
        )
    return buffers


def _use_count(storage: torch.UntypedStorage) -> int:
    """References to a storage: tensors over it and Python storage objects."""
    return int(torch._C._storage_Use_Count(storage._cdata))


_FOLLOWED_PACKAGES: Tuple[str, ...] = ("torchrec.", "torch.", "fbgemm_gpu.")


def _attributes(obj: object) -> List[object]:
    """The attribute values of an object, from its ``__dict__`` and slots."""
    values = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                values.append(getattr(obj, name))
    return values


def _followed(obj: object) -> bool:
    """Objects of the libraries a sharded module is made of."""
    module = type(obj).__module__ or ""
    return module.startswith(_FOLLOWED_PACKAGES) and not callable(obj)


def _storage_address(tensor: torch.Tensor) -> Optional[int]:
    """Where a CPU tensor's storage starts; None for wrappers without one."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper subclass (e.g. LocalShardsWrapper)
        return None


def tensors_reachable_from(root: nn.Module) -> Dict[int, int]:
    """
    The tensors a module holds, directly or through its submodules, kernels,
    optimizers and state-dict views (and the bases of views), counted per
    storage.

    Args:
        root (nn.Module): the module.

    Returns:
        Dict[int, int]: storage address -> number of distinct tensors over it.
    """
    counts: Dict[int, int] = defaultdict(int)
    seen: Set[int] = set()
    stack: List[object] = [root]
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (ShardedTensor, DTensor)):
            stack.extend(_attributes(obj))  # wrappers: their parts hold storage
        elif isinstance(obj, torch.Tensor):
            address = _storage_address(obj)
            if address is not None:
                counts[address] += 1
            stack.extend([obj._base, obj.grad] + _attributes(obj))
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, nn.Module) or _followed(obj):
            stack.extend(_attributes(obj))
    return dict(counts)

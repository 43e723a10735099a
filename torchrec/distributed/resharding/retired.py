#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The release policy of live resharding: what happens to the memory of the
kernels a transaction retires. It goes back to the OS only where nothing
outside the module can see it: a storage that only the module (through the
kernels that took parts of it over, ``storage``) holds gives the pages nobody
uses back (the pages of departed tables, or all of it when no table stayed);
a storage a caller still references (an old state dict, a tensor from
``local_shards()``) is left exactly as it is.
"""

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DenseTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._tensor import DTensor
from torchrec.distributed.resharding.memory import release_pages

# Host state of a fused kernel: weights, then the optimizer's momenta.
HOST_STATES: Tuple[str, ...] = ("weights", "momentum1", "momentum2")


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
    return _cpu_tensors([getattr(kernel, f"{s}_host", None) for s in HOST_STATES])


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
    An old kernel's storage, held (one reference) until the transaction
    decides what happens to it.

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


class RetiredStorage:
    """
    The storage of the kernels a transaction retires, held (one reference
    each) until :meth:`release` decides what happens to it.

    Args:
        old_batched (Sequence[nn.Module]): the TorchRec batched kernels whose
            storage the transaction retires.
    """

    def __init__(self, old_batched: Sequence[nn.Module] = ()) -> None:
        self._storages: Dict[int, _Storage] = {}
        for batched in old_batched:
            kernel = batched.emb_module
            for tensor in _table_state(kernel):
                storage = tensor.untyped_storage()
                self._storages.setdefault(storage.data_ptr(), _Storage(storage))
            for tensor in _other_memory(kernel):
                storage = tensor.untyped_storage()
                self._storages.setdefault(
                    storage.data_ptr(), _Storage(storage, table_state=False)
                )

    def take_over(self, view: torch.Tensor) -> bool:
        """
        Records that a new kernel takes ``view`` of a retired storage over.

        Returns:
            bool: whether ``view`` lies in a retired storage.
        """
        record = self._storages.get(view.untyped_storage().data_ptr())
        if record is None:
            return False
        start = view.data_ptr() - record.storage.data_ptr()
        record.live.append((start, view.numel() * view.element_size()))
        return True

    def drop(self) -> None:
        """Drops the references: a storage nobody else uses is freed now."""
        self._storages = {}

    def release(self, module: nn.Module) -> int:
        """
        Gives back to the OS the pages nobody uses of every retired storage
        that only ``module`` (through the kernels that took parts of it over)
        and this object reference; a storage something else references is
        left untouched. Drops this object's references either way.

        Args:
            module (nn.Module): the sharded module (or modules), after the swap.

        Returns:
            int: resident bytes of tables' state given back to the OS (the
            gradients and buffers of the old kernels go too, uncounted).
        """
        held = tensors_reachable_from(module)
        released = 0
        for ptr, record in self._storages.items():
            others = _use_count(record.storage) - 1 - held.get(ptr, 0)
            if others == 0:
                pages = release_pages(record.storage, record.live)
                released += pages if record.table_state else 0
        self.drop()
        return released


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

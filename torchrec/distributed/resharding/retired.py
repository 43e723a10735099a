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

The module's own references are not found by following its object graph:
they are the tensors of a fixed list of holders, and nothing else:

* the views of a retired storage that the transaction handed to the new
  kernels (:meth:`RetiredStorage.take_over`; fbgemm keeps them as its
  ``preallocated_host_buffers``);
* each new fbgemm kernel's host state: the fused kernel's ``weights_host``,
  ``momentum1_host`` and ``momentum2_host``, the dense kernel's ``weights``
  (:func:`kernel_holders`);
* each TorchRec batched kernel's fused optimizer (``fused_optimizer``): its
  parameters and state (:func:`optimizer_holders`);
* the per-table parameters (TableBatchedEmbeddingSlices) of the batched
  kernels (the ``_param_per_table`` they made when built) and of the sharded
  module (the ``weight`` of each of its table modules), each with the tensor
  it is sliced from and the per-table fused optimizers it carries
  (``_in_backward_optimizers``; :func:`parameter_holders`);
* the state-dict views the sharded module registers: its local shards,
  ShardedTensors, DTensors and shards wrappers
  (``_model_parallel_name_to_*``; :func:`state_dict_holders`).

A view keeps its base alive, so a holder's ``_base`` is the module's too
(:func:`tensors_per_storage`). Any other reference to a retired storage is
somebody else's (a caller's view, an old state dict, a slice a fused kernel
made for a caller): the storage is kept as it is.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DenseTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._tensor import DTensor
from torchrec.distributed.resharding.kernel_state import batched_kernels
from torchrec.distributed.resharding.memory import release_pages
from torchrec.distributed.shards_wrapper import LocalShardsWrapper

# Host state of a fused kernel: weights, then the optimizer's momenta.
HOST_STATES: Tuple[str, ...] = ("weights", "momentum1", "momentum2")

# The per-table modules whose ``weight`` a sharded embedding module registers
# (EmbeddingBagCollection's, EmbeddingCollection's).
TABLE_MODULES: Tuple[str, ...] = ("embedding_bags", "embeddings")

# The state-dict views a sharded embedding module registers, per table.
STATE_DICT_VIEWS: Tuple[str, ...] = (
    "_model_parallel_name_to_local_shards",
    "_model_parallel_name_to_sharded_tensor",
    "_model_parallel_name_to_dtensor",
    "_model_parallel_name_to_shards_wrapper",
)


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
        views (List[torch.Tensor]): the views of it handed to new kernels.
        table_state (bool): it holds tables' weights or optimizer state
            (what a report counts as released), not gradients or buffers.
    """

    storage: torch.UntypedStorage
    live: List[Tuple[int, int]] = field(default_factory=list)
    views: List[torch.Tensor] = field(default_factory=list)
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
        Records that a new kernel takes ``view`` of a retired storage over:
        its bytes stay live, and the view (one of the holders :meth:`release`
        expects) is kept until then.

        Args:
            view (torch.Tensor): the view handed to the new kernel.

        Returns:
            bool: whether ``view`` lies in a retired storage.
        """
        record = self._storages.get(view.untyped_storage().data_ptr())
        if record is None:
            return False
        start = view.data_ptr() - record.storage.data_ptr()
        record.live.append((start, view.numel() * view.element_size()))
        record.views.append(view)
        return True

    def drop(self) -> None:
        """Drops the references: a storage nobody else uses is freed now."""
        self._storages = {}

    def release(self, modules: Sequence[nn.Module]) -> int:
        """
        Gives back to the OS the pages nobody uses of every retired storage
        that only ``modules`` (through the holders this module's docstring
        lists) and this object reference; a storage something else
        references is left untouched. Drops this object's references either
        way.

        Args:
            modules (Sequence[nn.Module]): the sharded embedding modules
                (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection),
                after the swap.

        Returns:
            int: resident bytes of tables' state given back to the OS (the
            gradients and buffers of the old kernels go too, uncounted).
        """
        holders = [v for record in self._storages.values() for v in record.views]
        for module in modules:
            holders.extend(module_holders(module))
        held = tensors_per_storage(holders)
        del holders
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


def local_tensors(value: Any) -> List[torch.Tensor]:
    """
    The local tensors of a holder's value.

    Args:
        value (Any): a tensor, a Shard, a ShardedTensor, a DTensor (whose local
            tensor may be a shards wrapper), or anything else (no tensors).

    Returns:
        List[torch.Tensor]: its local tensors.
    """
    if isinstance(value, Shard):
        return [value.tensor]
    if isinstance(value, ShardedTensor):
        return [shard.tensor for shard in value.local_shards()]
    if isinstance(value, DTensor):
        local = value._local_tensor
        if isinstance(local, LocalShardsWrapper):
            return list(local.local_shards())
        return [local]
    if isinstance(value, torch.Tensor):
        return [value]
    return []


def optimizer_holders(optimizer: Any) -> List[torch.Tensor]:
    """
    The tensors a fused optimizer (a KeyedOptimizer) holds: its parameters
    and their state.

    Args:
        optimizer (Any): the optimizer.

    Returns:
        List[torch.Tensor]: their local tensors.
    """
    values: List[Any] = list(getattr(optimizer, "params", {}).values())
    for param, state in getattr(optimizer, "state", {}).items():
        values.append(param)
        values.extend(state.values())
    return [t for value in values for t in local_tensors(value)]


def parameter_holders(param: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """
    The tensors a per-table parameter (a TableBatchedEmbeddingSlice) holds: the
    slice, the tensor it is sliced from, and the parameters and state of the
    per-table fused optimizers it carries (``_in_backward_optimizers``).

    Args:
        param (Optional[torch.Tensor]): the parameter (None: none).

    Returns:
        List[torch.Tensor]: the tensors.
    """
    if param is None:
        return []
    holders = [param] + _cpu_tensors([getattr(param, "_original_tensor", None)])
    for optimizer in getattr(param, "_in_backward_optimizers", []):
        holders.extend(optimizer_holders(optimizer))
    return holders


def kernel_holders(batched: nn.Module) -> List[torch.Tensor]:
    """
    The tensors a TorchRec batched kernel holds over its fbgemm kernel's
    storage: the fbgemm kernel's host state, its fused optimizer's parameters
    and state, and its per-table parameters (:func:`parameter_holders`).

    Args:
        batched (nn.Module): the batched kernel.

    Returns:
        List[torch.Tensor]: the tensors.
    """
    holders = _table_state(batched.emb_module)
    optimizer = getattr(batched, "fused_optimizer", None)
    if optimizer is not None:
        holders.extend(optimizer_holders(optimizer))
    # The slices the kernel made when it was built: where `_param_per_table`
    # is a property (fused kernels on torchrec 1.8 and later), every read
    # makes new ones, which nothing holds.
    for param in vars(batched).get("_param_per_table", {}).values():
        holders.extend(parameter_holders(param))
    return holders


def state_dict_holders(module: nn.Module) -> List[torch.Tensor]:
    """
    The tensors a sharded embedding module registers per table: the weights
    of its table modules (``TABLE_MODULES``, :func:`parameter_holders`) and
    its state-dict views (``STATE_DICT_VIEWS``): local shards,
    ShardedTensors, DTensors, and the local tensors of the shards wrappers
    DTensors are made from.

    Args:
        module (nn.Module): the sharded module.

    Returns:
        List[torch.Tensor]: the tensors.
    """
    holders: List[torch.Tensor] = []
    for name in TABLE_MODULES:
        for table in getattr(module, name, {}).values():
            holders.extend(parameter_holders(getattr(table, "weight", None)))
    values: List[Any] = []
    for name in STATE_DICT_VIEWS:
        for value in getattr(module, name, {}).values():
            if isinstance(value, dict):  # a shards wrapper's parts
                value = value.get("local_tensors", [])
            values.extend(value if isinstance(value, list) else [value])
    return holders + [t for value in values for t in local_tensors(value)]


def module_holders(module: nn.Module) -> List[torch.Tensor]:
    """
    The tensors a sharded embedding module holds over its kernels' storage:
    those of its batched kernels and of its state-dict views.

    Args:
        module (nn.Module): the sharded module.

    Returns:
        List[torch.Tensor]: the tensors (a tensor may appear more than once).
    """
    holders = state_dict_holders(module)
    for lookup in getattr(module, "_lookups", []):
        for batched in batched_kernels(lookup):
            holders.extend(kernel_holders(batched))
    return holders


def _storage_address(tensor: torch.Tensor) -> Optional[int]:
    """Where a CPU tensor's storage starts; None for wrappers without one."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper subclass (e.g. LocalShardsWrapper)
        return None


def tensors_per_storage(holders: Iterable[torch.Tensor]) -> Dict[int, int]:
    """
    Counts the distinct tensors over each storage among ``holders`` and their
    bases (a view keeps its base alive).

    Args:
        holders (Iterable[torch.Tensor]): the tensors, possibly repeated.

    Returns:
        Dict[int, int]: storage address -> number of distinct tensors over it.
    """
    distinct: Dict[int, torch.Tensor] = {}  # by identity, kept alive meanwhile
    for tensor in holders:
        for t in (tensor, tensor._base):
            if isinstance(t, torch.Tensor):
                distinct.setdefault(id(t), t)
    counts: Dict[int, int] = {}
    for tensor in distinct.values():
        address = _storage_address(tensor)
        if address is not None:
            counts[address] = counts.get(address, 0) + 1
    return counts

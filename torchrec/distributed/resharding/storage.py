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
serves a reshard within a group and a move between groups.

The tables of one sharding group live in one fbgemm batched kernel per grouped
config, i.e. one contiguous storage per state (weights, momentum1, ...).
Everything here goes through TorchRec's :class:`KernelBuildHooks` and
:class:`ShardingBuildHooks` (patches of the series), scoped to the building
call in the building thread:

* **no initialisation**: the transaction overwrites every byte of the kernels
  it builds, so they skip random init and fbgemm's zero fill;
* **kept shards keep their storage** (:attr:`StorageMode.REUSE`, CPU): on each
  rank, the shards that stay exactly where they are form *runs*, maximal
  sequences at consecutive positions of one old kernel
  (:func:`kept_runs`). Every rank states its runs in the agreement; the
  coordinator gives every table in a run the same batch key on every rank
  (:func:`batch_keys`): a :class:`KeptBatchKey` in TorchRec's ``_batch_key``
  grouping fused param, keeping the user's own key. TorchRec then groups the
  shards of a run into a kernel of their own, which is built on a view of the
  old kernel's storage (fbgemm's ``preallocated_host_buffers``; the dense
  kernel's weights): nothing is copied, and views a caller took of them keep
  tracking the live table. The key is an object, looked up by equality: no
  string is ever parsed back;
* **retired storage**: once the old kernels are retired (their reference
  cycles broken, so they are freed at once), their memory goes back to the OS
  only where nothing outside the module can see it: a storage nobody else
  references is released (the pages of departed tables, or all of it); a
  storage a caller still references (an old state dict, a tensor from
  ``local_shards()``) is left exactly as it is.

Every sharding group keeps at most ``MAX_KERNELS_PER_GROUP`` kernels per rank:
runs beyond it are copied.
"""

import sys
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

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
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo, group_tables
from torchrec.distributed.embedding_types import (
    GroupedEmbeddingConfig,
    ShardingBuildHooks,
)
from torchrec.distributed.resharding.memory import release_pages
from torchrec.distributed.resharding.options import (  # noqa: F401 (its old home)
    StorageMode,
)

BATCH_KEY = "_batch_key"
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

# A run of kept shards: (rank in the transaction, index of the run on it)
RunId = Tuple[int, int]
ShardKey = Tuple[str, Tuple[int, ...]]


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


@dataclass(frozen=True)
class KeptBatchKey:
    """
    The batch key (TorchRec's ``_batch_key`` grouping fused param, which only
    decides which tables share a kernel) of a table in runs of kept shards.

    Args:
        user (Any): the user's own batch key, kept (None for none).
        runs (Tuple[RunId, ...]): the runs the table's shards are in, on every
            rank: tables of equal runs share kernels, others do not.
    """

    user: Any
    runs: Tuple[RunId, ...]


def user_batch_key(fused_params: Optional[Mapping[str, Any]]) -> Any:
    """The user's own batch key in a table's fused params (None for none)."""
    key = (fused_params or {}).get(BATCH_KEY)
    return key.user if isinstance(key, KeptBatchKey) else key


def with_batch_key(
    fused_params: Optional[Mapping[str, Any]], key: Any
) -> Dict[str, Any]:
    """A table's fused params with ``key`` as its batch key (None: no key)."""
    out = dict(fused_params or {})
    out.pop(BATCH_KEY, None)
    if key is not None:
        out[BATCH_KEY] = key
    return out


def user_fused_params(fused_params: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """A table's fused params with the user's own batch key only (no kept one)."""
    return with_batch_key(fused_params, user_batch_key(fused_params))


def shard_key(table: Any) -> ShardKey:
    """(table name, shard offsets) of a kernel's table shard."""
    metadata = table.local_metadata
    offsets = tuple(metadata.shard_offsets) if metadata is not None else ()
    return table.name, offsets


@dataclass
class KeptRun:
    """
    Shards of tables that a transaction leaves exactly where they are, at
    consecutive positions of one old batched kernel of this rank: the new
    kernel for them can be built on a view of the old kernel's storage.

    Args:
        path (str): the sharded module's path.
        kernel (nn.Module): the old fbgemm kernel.
        first (int): the position of the first shard in it.
        shards (List[ShardKey]): the shards, in kernel order.
    """

    path: str
    kernel: nn.Module
    first: int
    shards: List[ShardKey]


def kept_runs(
    groups: Mapping[Tuple[str, str], Sequence[nn.Module]],
    kept: Mapping[str, AbstractSet[str]],
) -> List[KeptRun]:
    """
    This rank's runs of kept shards: maximal runs of consecutive shards of
    kept tables in each old batched kernel, the ``MAX_KERNELS_PER_GROUP - 1``
    largest per sharding group (the rest of a rebuilt group takes one more
    kernel).

    Args:
        groups (Mapping[Tuple[str, str], Sequence[nn.Module]]): (module path,
            sharding type) -> the group's old TorchRec batched kernels.
        kept (Mapping[str, AbstractSet[str]]): module path -> the tables whose
            shards stay exactly where they are.

    Returns:
        List[KeptRun]: the runs, by group, largest first.
    """
    out: List[KeptRun] = []
    for (path, _), kernels in groups.items():
        tables_kept = kept.get(path, set())
        group_runs: List[Tuple[int, KeptRun]] = []
        for batched in kernels:
            tables = list(batched.config.embedding_tables)
            position = 0
            while position < len(tables):
                if tables[position].name not in tables_kept:
                    position += 1
                    continue
                first = position
                while position < len(tables) and tables[position].name in tables_kept:
                    position += 1
                run = tables[first:position]
                size = sum(t.local_rows * t.local_cols for t in run)
                shards = [shard_key(t) for t in run]
                group_runs.append(
                    (size, KeptRun(path, batched.emb_module, first, shards))
                )
        group_runs.sort(key=lambda x: -x[0])
        out += [run for _, run in group_runs[: MAX_KERNELS_PER_GROUP - 1]]
    return out


def run_facts(runs: Sequence[KeptRun]) -> Dict[str, List[List[str]]]:
    """
    What the others need of this rank's runs: per module, the tables of each
    run (a run's position in its module's list numbers it).
    """
    out: Dict[str, List[List[str]]] = {}
    for run in runs:
        out.setdefault(run.path, []).append([name for name, _ in run.shards])
    return out


# (sharding type, the ranks holding shards) of a table under the new plan
TablePlacement = Tuple[str, Tuple[int, ...]]


def batch_keys(
    all_runs: Sequence[Tuple[int, Mapping[str, List[List[str]]]]],
    placements: Mapping[str, Mapping[str, TablePlacement]],
    user_keys: Mapping[str, Mapping[str, Any]],
) -> Dict[str, Dict[str, KeptBatchKey]]:
    """
    The batch key of every table in a run of kept shards, the same on every
    rank (pure: the coordinator computes it from every rank's run facts): the
    runs it is in, so the shards of one run get a kernel of their own on its
    rank and the tables of each rank group alike everywhere. A module's
    sharding type that would get more than ``MAX_KERNELS_PER_GROUP`` kernels
    on a rank gets no keys (one kernel, kept shards copied).

    Args:
        all_runs (Sequence[Tuple[int, Mapping[str, List[List[str]]]]]): (rank,
            its :func:`run_facts`) for every rank that has runs.
        placements (Mapping[str, Mapping[str, TablePlacement]]): module path ->
            table -> its sharding type and ranks under the new plan.
        user_keys (Mapping[str, Mapping[str, Any]]): module path -> table ->
            the user's own batch key (None for none).

    Returns:
        Dict[str, Dict[str, KeptBatchKey]]: module path -> table -> its key.
    """
    runs: Dict[str, Dict[str, List[RunId]]] = {}
    for rank, rank_runs in all_runs:
        for path, path_runs in sorted(rank_runs.items()):
            for index, tables in enumerate(path_runs):
                for table in tables:
                    ids = runs.setdefault(path, {}).setdefault(table, [])
                    if (rank, index) not in ids:
                        ids.append((rank, index))
    keys: Dict[str, Dict[str, KeptBatchKey]] = {}
    for path, tables in sorted(runs.items()):
        path_keys = {
            table: KeptBatchKey(user_keys.get(path, {}).get(table), tuple(sorted(ids)))
            for table, ids in tables.items()
        }
        kernels: Dict[Tuple[str, int], Set[Any]] = {}
        for table, (sharding_type, ranks) in placements[path].items():
            key = path_keys.get(table, user_keys.get(path, {}).get(table))
            for rank in ranks:
                kernels.setdefault((sharding_type, rank), set()).add(key)
        crowded = {
            sharding_type
            for (sharding_type, _), ks in kernels.items()
            if len(ks) > MAX_KERNELS_PER_GROUP
        }
        keys[path] = {
            table: key
            for table, key in path_keys.items()
            if placements[path][table][0] not in crowded
        }
    return keys


def key_rebuilt_groups(
    infos: Dict[str, List[EmbeddingShardingInfo]],
    rebuilt_types: Sequence[str],
    hooks: "KeptGrouping",
) -> None:
    """
    Gives every table of a rebuilt group the batch key the transaction agreed
    on (runs of kept shards get keys of their own; the others only the user's
    key, whatever an earlier transaction gave them), as a module's ``__init__``
    would under the same hooks.

    Args:
        infos (OrderedDict[str, List[EmbeddingShardingInfo]]): the module's
            infos after the transaction; changed in place.
        rebuilt_types (Sequence[str]): sharding types whose group is rebuilt.
        hooks (KeptGrouping): the transaction's batch keys.

    Returns:
        None
    """
    for sharding_type in rebuilt_types:
        group = infos.get(sharding_type, [])
        for i, info in enumerate(group):
            fused_params = hooks.table_fused_params(
                info.embedding_config.name,
                info.param,
                user_fused_params(info.fused_params),
            )
            if fused_params != info.fused_params:
                group[i] = replace(info, fused_params=fused_params)


def direct_output_order(
    groups: Sequence[Tuple[Any, Sequence[EmbeddingShardingInfo]]],
) -> Optional[List[str]]:
    """
    The output keys (embedding names) of a module whose tables in runs of kept
    shards have kernels of their own, in the order a module sharded directly
    under the same plan lists them. A sharding lists its keys in the order of
    its tables' grouping into kernels, rank after rank (a key once, for
    column shards); a kept run's batch key makes a kernel of its own, so it
    may list the rank's tables in another order than the grouping without
    it, which this one follows. Pure: the shardings' own ``_shard`` and
    TorchRec's ``group_tables``.

    Args:
        groups (Sequence[Tuple[Any, Sequence[EmbeddingShardingInfo]]]): the
            module's (sharding, its tables' infos) per group, in group order.

    Returns:
        Optional[List[str]]: the keys, or None when no table has a kept
        batch key (the module lists them in that order already).
    """
    if not any(
        isinstance((info.fused_params or {}).get(BATCH_KEY), KeptBatchKey)
        for _, infos in groups
        for info in infos
    ):
        return None
    keys: List[str] = []
    for sharding, infos in groups:
        direct = [
            replace(info, fused_params=user_fused_params(info.fused_params))
            for info in infos
        ]
        names = (
            name
            for rank_groups in group_tables(sharding._shard(direct))
            for config in rank_groups
            for name in config.embedding_names()
        )
        keys += list(dict.fromkeys(names))
    return keys


# ------------------------------------------------------------------- memory


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


class KeptGrouping(ShardingBuildHooks):
    """
    The sharding build hooks of a transaction: tables in runs of kept shards
    get their agreed batch key (so that TorchRec gives each run a kernel of
    its own, see :class:`KeptStorage`), and, when the transaction asks for it,
    modules make their ShardedTensors from their (agreed) plan's metadata.

    Args:
        keys (Mapping[str, Mapping[str, KeptBatchKey]]): module path -> table
            -> its agreed batch key.
        params (Mapping[str, Mapping[str, torch.Tensor]]): module path ->
            table -> the parameter the sharded module is built from (table
            names repeat across modules; the hook gets the parameter).
        sharded_tensors_from_metadata (bool): modules built meanwhile make
            their ShardedTensors from their plan's metadata.
    """

    def __init__(
        self,
        keys: Optional[Mapping[str, Mapping[str, KeptBatchKey]]] = None,
        params: Optional[Mapping[str, Mapping[str, torch.Tensor]]] = None,
        sharded_tensors_from_metadata: bool = False,
    ) -> None:
        keys = keys or {}
        params = params or {}
        self._from_metadata = sharded_tensors_from_metadata
        # table -> (parameter, key) per module that has it: a table name is
        # unique within a module, the parameter tells the modules apart
        self._keys: Dict[str, List[Tuple[torch.Tensor, KeptBatchKey]]] = {}
        for path, table_keys in keys.items():
            for table, key in table_keys.items():
                if table in params.get(path, {}):
                    self._keys.setdefault(table, []).append((params[path][table], key))

    def table_fused_params(
        self, table: str, param: torch.Tensor, fused_params: Dict[str, Any]
    ) -> Dict[str, Any]:
        """
        Args:
            table (str): a table of a module being sharded.
            param (torch.Tensor): its parameter in the unsharded module.
            fused_params (Dict[str, Any]): the fused params of its kernel.

        Returns:
            Dict[str, Any]: them with the table's agreed batch key, if any.
        """
        key = next((k for p, k in self._keys.get(table, []) if p is param), None)
        if key is None:
            return fused_params
        user = user_batch_key(fused_params)
        return with_batch_key(fused_params, KeptBatchKey(user, key.runs))

    def sharded_tensors_from_metadata(self) -> bool:
        return self._from_metadata


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
        # the runs of a batch key -> (old kernel, first position, shards) of
        # each kept run, a run split where its tables' keys differ
        self._runs: Dict[
            Tuple[RunId, ...], List[Tuple[nn.Module, int, List[ShardKey]]]
        ] = {}
        for run in runs:
            table_keys = keys.get(run.path, {})
            start = 0
            for i in range(1, len(run.shards) + 1):
                key = table_keys.get(run.shards[start][0])
                if i < len(run.shards) and table_keys.get(run.shards[i][0]) == key:
                    continue
                if key is not None:
                    self._runs.setdefault(key.runs, []).append(
                        (run.kernel, run.first + start, run.shards[start:i])
                    )
                start = i
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
        for kernel, first, run in self._runs.get(key.runs, []):
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
        self._runs = {}  # the old kernels must not count as holders
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

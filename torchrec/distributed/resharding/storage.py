#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
Kernel storage for live resharding: how the lookups of a rebuilt sharding
group get their memory.

The tables of one sharding group live in one fbgemm batched kernel per grouped
config, i.e. one contiguous storage per state (weights, momentum1, ...). When a
group gains or loses a table it is rebuilt, and by default every table in it
would be copied into fresh pages, including the tables that stay put. This
module avoids that:

* **no initialisation**: while new lookups are built, TorchRec's random
  ``init_parameters``, the ``torch.randn`` of fbgemm's dense kernel and the zero
  fill of a fused kernel's host buffers are skipped — the reshard overwrites
  every byte anyway;
* **kept tables keep their storage** (CPU): tables a reshard does not change
  but whose group is rebuilt get their own grouped config (through TorchRec's
  ``_batch_key`` grouping parameter), and the kernel built for it takes the old
  kernel's storage and offsets instead of allocating: nothing is copied. Tables
  that arrive or change get a kernel of their own, allocated once at its final
  size and filled straight from the exchange;
* **released pages**: after the swap, the pages of the reused storage that
  only held departed tables are returned to the OS (``madvise``), so the memory
  of a rank is its new tables, not its old ones plus its new ones.

Every group keeps at most ``MAX_KERNELS_PER_GROUP`` kernels: a reshard that
would exceed it rebuilds the group as one kernel (kept tables then are copied
locally, as on devices other than CPU where pages cannot be released).
"""

import contextlib
import ctypes
import functools
import mmap
import sys
import threading
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
)

import fbgemm_gpu.split_table_batched_embeddings_ops_training as tbe_training
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from torch import nn
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
)
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo

BATCH_KEY = "_batch_key"
_RESHARD_TAG = "#reshard"
MAX_KERNELS_PER_GROUP = 4

# The host buffers of a fused kernel that a reshard fills entirely: weights
# from the pieces, optimizer state from the pieces or, where no piece carries
# it, zeroed by install's ``_zero_undelivered_state``.
_FILLED_HOST_BUFFERS = ("weights", "momentum1", "momentum2")


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
        infos = new_infos[sharding_type]
        for i, info in enumerate(infos):
            if info.embedding_config.name in changed_tables:
                infos[i] = _with_batch_key(info, _generation_key(info, generation))
        if _most_kernels_per_user_key(infos) > MAX_KERNELS_PER_GROUP:
            for i, info in enumerate(infos):
                infos[i] = _with_batch_key(info, _generation_key(info, generation))


@dataclass
class _OldKernel:
    """A kernel of the module before the reshard, as a source of storage."""

    batched: nn.Module
    positions: Dict[Tuple[str, Tuple[int, ...]], int]


def _shard_key(table: Any) -> Tuple[str, Tuple[int, ...]]:
    metadata = table.local_metadata
    offsets = tuple(metadata.shard_offsets) if metadata is not None else ()
    return table.name, offsets


class KeptStorage:
    """
    Where the kernels built for kept tables find their storage.

    Args:
        old_batched (Sequence[nn.Module]): the module's batched kernels before
            the reshard (TorchRec ``BaseBatchedEmbedding[Bag]`` instances).
        kept_tables (Set[str]): tables the reshard does not change.
    """

    def __init__(self, old_batched: Sequence[nn.Module], kept_tables: Set[str]) -> None:
        self._kernels: Dict[Tuple[str, Tuple[int, ...]], _OldKernel] = {}
        self._old_batched: List[nn.Module] = list(old_batched)
        for batched in old_batched:
            tables = batched.config.embedding_tables
            kernel = _OldKernel(
                batched, {_shard_key(t): i for i, t in enumerate(tables)}
            )
            for table in tables:
                if table.name in kept_tables:
                    self._kernels[_shard_key(table)] = kernel
        # address of a reused storage -> (element offset, count) of every
        # table region a new kernel uses in it
        self._kept_regions: Dict[int, List[Tuple[int, int]]] = {}

    def source_for(
        self, config: Any, kernel_type: type
    ) -> Optional[Tuple[nn.Module, List[int]]]:
        """
        The old kernel holding every table of a new grouped config, and each
        table's position in it; None when the config is not made of kept tables
        of one old kernel of the same type.
        """
        keys = [_shard_key(t) for t in config.embedding_tables]
        kernels = {id(self._kernels.get(k)) for k in keys}
        if not keys or len(kernels) != 1 or keys[0] not in self._kernels:
            return None
        source = self._kernels[keys[0]]
        if type(source.batched.emb_module) is not kernel_type:
            return None
        return source.batched, [source.positions[k] for k in keys]

    def record(self, tensor: torch.Tensor, offset: int, numel: int) -> None:
        """Notes that a new kernel uses ``numel`` elements of ``tensor`` at ``offset``."""
        self._kept_regions.setdefault(tensor.data_ptr(), []).append((offset, numel))

    def release_departed_pages(self) -> int:
        """
        Gives the pages of the old kernels' storage that no kept table uses back
        to the OS: the departed tables of reused storages, and the whole
        storage of old kernels nothing kept (which would otherwise wait for
        Python's cycle collector). Call only after the swap: until then the old
        kernels read them. Views taken from the module before the reshard
        (e.g. an old state dict) of departed tables read zeros afterwards.

        Returns:
            int: resident bytes given back.
        """
        released = 0
        seen: Set[int] = set()
        for batched in self._old_batched:
            for storage in _state_storages(batched.emb_module):
                if storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                kept = self._kept_regions.get(storage.data_ptr(), [])
                released += _release_pages(storage, kept)
        self._old_batched = []
        self._kernels = {}
        self._kept_regions = {}
        return released


def _state_storages(kernel: nn.Module) -> List[torch.Tensor]:
    """The 1-D CPU storages of a kernel's per-table state (weights, optimizer)."""
    if isinstance(kernel, tbe_training.DenseTableBatchedEmbeddingBagsCodegen):
        candidates = [kernel.weights]
    else:
        candidates = [
            getattr(kernel, name)
            for name in list(kernel._parameters) + list(kernel._buffers)
            if name.endswith("_host")
            and hasattr(kernel, name[: -len("_host")] + "_physical_offsets")
        ]
    return [
        t.detach().view(-1)
        for t in candidates
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
    ]


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[Any]:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mincore.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _resident_bytes(libc: Any, start: int, length: int) -> int:
    """Bytes of the page-aligned range that are in memory (``mincore``)."""
    pages = length // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(start, length, vec) != 0:
        return length
    flags = torch.frombuffer(vec, dtype=torch.uint8)
    return int(flags.bitwise_and(1).sum()) * mmap.PAGESIZE


def _release_pages(tensor: torch.Tensor, kept: Sequence[Tuple[int, int]]) -> int:
    """
    ``madvise(MADV_DONTNEED)`` on the whole pages of ``tensor`` outside the
    ``kept`` element ranges: their memory goes back to the OS (they would read
    as zeros, but nothing reads them any more).
    """
    libc = _libc()
    if libc is None or tensor.device.type != "cpu":
        return 0
    page = mmap.PAGESIZE
    size = tensor.element_size()
    base = tensor.data_ptr()
    gaps: List[Tuple[int, int]] = []
    cursor = 0
    for offset, numel in sorted(kept):
        if offset > cursor:
            gaps.append((cursor, offset))
        cursor = max(cursor, offset + numel)
    if cursor < tensor.numel():
        gaps.append((cursor, tensor.numel()))
    released = 0
    for start, end in gaps:
        first = -(-(base + start * size) // page) * page
        last = (base + end * size) // page * page
        if last <= first:
            continue
        resident = _resident_bytes(libc, first, last - first)
        if libc.madvise(first, last - first, mmap.MADV_DONTNEED) == 0:
            released += resident
    return released


def _uninitialized(*size: Any, **kwargs: Any) -> torch.Tensor:
    kwargs.pop("generator", None)
    return torch.empty(*size, **kwargs)


class _BuildState(threading.local):
    config: Optional[Any] = None


_build_state = _BuildState()
# Builds of two reshards in different threads take turns: the hooks are global.
_build_lock = threading.RLock()


def _remember_config(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
        _build_state.config = config
        original(self, config, *args, **kwargs)

    return __init__


def _split_from_old(
    reuse: KeptStorage,
    split: Any,
    prefix: str,
    dtype: torch.dtype,
    kwargs: Dict[str, Any],
) -> Any:
    """The SplitState of a fused kernel's state pointing at the old storage."""
    config = _build_state.config
    source = (
        reuse.source_for(config, tbe_training.SplitTableBatchedEmbeddingBagsCodegen)
        if config is not None
        else None
    )
    if source is None or split.host_size == 0 or split.dev_size or split.uvm_size:
        return None
    batched, positions = source
    old = batched.emb_module
    old_host = getattr(old, f"{prefix}_host", None)
    old_offsets = getattr(old, f"{prefix}_physical_offsets", None)
    old_placements = getattr(old, f"{prefix}_physical_placements", None)
    if old_host is None or old_offsets is None or old_host.dtype != dtype:
        return None
    if any(old_placements[p] != EmbeddingLocation.HOST.value for p in positions):
        return None
    sizes = [
        end - start
        for start, end in zip(
            split.offsets, list(split.offsets[1:]) + [split.host_size]
        )
    ]
    offsets = [old_offsets[p] for p in positions]
    host = old_host.detach().view(-1)
    for offset, numel in zip(offsets, sizes):
        reuse.record(host, offset, numel)
    kwargs["preallocated_host_buffer"] = host
    return split._replace(host_size=host.numel(), offsets=offsets)


def _fused_host_buffers(
    original: Callable[..., None], reuse: Optional[KeptStorage]
) -> Callable[..., None]:
    def apply_split_helper(*args: Any, **kwargs: Any) -> None:
        current_device, split, prefix, dtype = args[2], args[5], args[6], args[7]
        reused = (
            _split_from_old(reuse, split, prefix, dtype, kwargs)
            if reuse is not None
            else None
        )
        if reused is not None:
            args = args[:5] + (reused,) + args[6:]
        elif (
            prefix in _FILLED_HOST_BUFFERS
            and split.host_size > 0
            and kwargs.get("preallocated_host_buffer") is None
        ):
            kwargs["preallocated_host_buffer"] = torch.empty(
                split.host_size, dtype=dtype, device=current_device
            )
        original(*args, **kwargs)

    return apply_split_helper


def _dense_weights_from_old(
    original: Callable[..., None], reuse: KeptStorage
) -> Callable[..., None]:
    kernel_type = tbe_training.DenseTableBatchedEmbeddingBagsCodegen

    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        config = _build_state.config
        source = reuse.source_for(config, kernel_type) if config is not None else None
        if source is None:
            return
        batched, positions = source
        old = batched.emb_module
        if old.weights.dtype != self.weights.dtype:
            return
        offsets = [old.weights_physical_offsets[p] for p in positions]
        weights = old.weights.detach()
        for offset, (rows, dim) in zip(offsets, self.embedding_specs):
            reuse.record(weights, offset, rows * dim)
        self.weights = nn.Parameter(weights, requires_grad=old.weights.requires_grad)
        self.weights_physical_offsets = offsets
        feature_table_map = kwargs.get("feature_table_map") or (
            args[1] if len(args) > 1 and args[1] else range(len(offsets))
        )
        self.weights_offsets = torch.tensor(
            [offsets[t] for t in feature_table_map],
            device=self.weights_offsets.device,
            dtype=torch.int64,
        )

    return __init__


@contextlib.contextmanager
def building_lookups(reuse: Optional[KeptStorage] = None) -> Iterator[None]:
    """
    While new lookups are built: no random init and no zero fill (the reshard
    overwrites every byte), and kernels made only of kept tables of one old
    kernel take that kernel's storage (``reuse``) instead of allocating.
    Only the fused kernel has a switch for the zero fill (a preallocated host
    buffer per constructor call), hence the hooks; they are scoped to the
    build, builds of reshards in other threads wait for it, but a module built
    by other code in another thread meanwhile would see them too.

    Args:
        reuse (Optional[KeptStorage]): old storage of kept tables, or None.

    Returns:
        Iterator[None]: a context manager.
    """
    with _build_lock, _build_hooks(reuse):
        yield


@contextlib.contextmanager
def _build_hooks(reuse: Optional[KeptStorage]) -> Iterator[None]:
    classes = (BaseBatchedEmbedding, BaseBatchedEmbeddingBag)
    saved_inits = [(cls, cls.__init__, cls.init_parameters) for cls in classes]
    randn = torch.randn
    split_helper = tbe_training.apply_split_helper
    dense = tbe_training.DenseTableBatchedEmbeddingBagsCodegen
    dense_init = dense.__init__
    for cls, init, _ in saved_inits:
        cls.__init__ = _remember_config(init)  # pyre-ignore[8]
        cls.init_parameters = lambda self: None  # pyre-ignore[8]
    torch.randn = _uninitialized  # pyre-ignore[9]
    tbe_training.apply_split_helper = _fused_host_buffers(split_helper, reuse)
    if reuse is not None:
        dense.__init__ = _dense_weights_from_old(dense_init, reuse)  # pyre-ignore[8]
    try:
        yield
    finally:
        dense.__init__ = dense_init  # pyre-ignore[8]
        tbe_training.apply_split_helper = split_helper
        torch.randn = randn  # pyre-ignore[9]
        for cls, init, init_parameters in saved_inits:
            cls.__init__ = init  # pyre-ignore[8]
            cls.init_parameters = init_parameters  # pyre-ignore[8]
        _build_state.config = None

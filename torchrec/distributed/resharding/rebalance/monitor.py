#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Load measurement of a running sharded model: what each table is asked for and
what each rank spends on its embeddings.

``LoadMonitor`` registers hooks on the sharded embedding modules of a
``DistributedModelParallel`` (and removes them on ``remove()``):

* a forward pre-hook on each sharded module counts, per feature, the ids and
  the samples of the local batch from the ``KeyedJaggedTensor``'s lengths (a
  sum on the lengths' device, no collective and no host sync per step);
* forward pre/post hooks on the module's input dists, output dists and lookup
  kernels time each part on this rank, and autograd hooks on each kernel's
  output node time its backward (with the fused optimizer's update): the
  kernels' forward and backward are the rank's compute, the dists' calls are
  timed apart from it. A dist's awaitable is waited for later, where ranks
  wait for each other; that waiting is in no figure but the step time. On a
  GPU the hooks record CUDA events on the stream each part runs on (a host
  clock around asynchronous kernels would time their launch); the events are
  read once per window, after one synchronisation in ``collect``, so no step
  waits for the GPU. They frame the work queued on the *current* stream
  only: a dist's NCCL all-to-all runs on its process group's internal
  stream, so a dist's seconds on a GPU are its launch-side work (splits,
  permutes, copies), not the time on the wire, which only the step time
  holds. Events go to the current device's stream (TorchRec needs
  ``torch.cuda.set_device`` anyway). A timer's events are pooled, and pairs
  the device finished are read as the window goes (``Event.query``, which
  does not wait), so a long window holds a bounded number of them. The
  variable-batch (VBE) path counts with one ``sum`` per key per forward.

Every ``window`` steps ``LoadMonitor.collect`` packs this rank's counters into
one flat tensor and all-reduces it once; ``statistics_from_vector`` (pure)
turns the sum into a ``LoadStatistics``: per table its mean pooling factor per
feature and ids per step, per rank its measured times (and any values a
caller attached to the window, which every rank then sees for every rank).
After a live reshard replaced a module's kernels and dists, the hooks follow
the new ones (the module's ``reshard_generation`` tells).
"""

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle
from torchrec.distributed.resharding.devices import synchronize_device
from torchrec.distributed.resharding.module_adapters import adapter_for
from torchrec.distributed.resharding.rebalance.statistics import (
    feature_slots,
    FeatureSlot,
    LoadStatistics,
    RANK_FIELDS,
    statistics_from_vector,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def module_tables(
    sharded: nn.Module,
) -> List[Tuple[str, List[str]]]:
    """
    A sharded EBC's or EC's tables with their features, in config order.

    Args:
        sharded (nn.Module): a ``ShardedEmbeddingBagCollection`` or
            ``ShardedEmbeddingCollection``.

    Returns:
        List[Tuple[str, List[str]]]: (table, feature names) per table.
    """
    return [(c.name, list(c.feature_names)) for c in adapter_for(sharded).configs()]


def _kernels(lookup: nn.Module) -> List[nn.Module]:
    """The kernel modules of a lookup (through a data-parallel wrapper)."""
    inner = getattr(lookup, "module", None)
    if not hasattr(lookup, "_emb_modules") and isinstance(inner, nn.Module):
        lookup = inner
    return list(getattr(lookup, "_emb_modules", [lookup]))


class _Timer:
    """
    Accumulates the time between pairs of start/stop calls with the host's
    clock (right where the work runs on the host, i.e. on CPU).
    """

    def __init__(self) -> None:
        self._seconds: float = 0.0
        self._start: float = 0.0

    def start(self, *args: Any, **kwargs: Any) -> None:
        self._start = time.perf_counter()

    def stop(self, *args: Any, **kwargs: Any) -> None:
        self._seconds += time.perf_counter() - self._start

    def add(self, other: "_Timer") -> None:
        """Adds what another timer of the same kind measured."""
        self._seconds += other._seconds

    def seconds(self) -> float:
        """Seconds measured (on CUDA: once the device finished the work)."""
        return self._seconds

    def reset(self) -> None:
        self._seconds = 0.0


class _EventTimer(_Timer):
    """
    Accumulates the GPU time between pairs of start/stop calls: each records
    a CUDA event on the current stream (the stream the timed work is queued
    on); the pairs' elapsed times are read by :meth:`seconds` once the device
    finished them, so no call waits for the GPU. Read events are recorded
    again (a pool), and beyond :attr:`MAX_PENDING` pairs those the device
    finished are read at once (``query`` does not wait).
    """

    MAX_PENDING = 256

    def __init__(self) -> None:
        super().__init__()
        self._pending: Optional[Any] = None
        self._pairs: List[Tuple[Any, Any]] = []
        self._free: List[Any] = []

    def _new_event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def _event(self) -> Any:
        event = self._free.pop() if self._free else self._new_event()
        event.record()
        return event

    def start(self, *args: Any, **kwargs: Any) -> None:
        self._pending = self._event()

    def stop(self, *args: Any, **kwargs: Any) -> None:
        if self._pending is not None:
            self._pairs.append((self._pending, self._event()))
            self._pending = None
            if len(self._pairs) > self.MAX_PENDING:
                self._read(finished_only=True)

    def _read(self, finished_only: bool) -> None:
        waiting: List[Tuple[Any, Any]] = []
        for a, b in self._pairs:
            if finished_only and not (a.query() and b.query()):
                waiting.append((a, b))
                continue
            self._seconds += a.elapsed_time(b) / 1000.0
            self._free += [a, b]
        self._pairs = waiting

    def add(self, other: _Timer) -> None:
        assert isinstance(other, _EventTimer)
        self._pairs += other._pairs
        other._pairs = []

    def seconds(self) -> float:
        self._read(finished_only=False)
        return self._seconds

    def reset(self) -> None:
        super().reset()
        self._pairs = []
        self._pending = None


class HostEvent:
    """
    An event of the host's clock, with the part of ``torch.cuda.Event``'s
    interface the monitor uses: where kernels run on the host (CPU) they
    finish before the call that launched them returns, so the clock at
    :meth:`record` is when the work queued before it finished.
    """

    def __init__(self) -> None:
        self._at: Optional[float] = None

    def record(self) -> None:
        """Marks now."""
        self._at = time.perf_counter()

    def query(self) -> bool:
        """Whether the event was recorded (the work before it is done)."""
        return self._at is not None

    def elapsed_time(self, end: "HostEvent") -> float:
        """
        Args:
            end (HostEvent): a later event.

        Returns:
            float: milliseconds from this event to ``end``, as CUDA's.
        """
        if self._at is None or end._at is None:
            raise RuntimeError("both events must be recorded first")
        return (end._at - self._at) * 1000.0


class _HostEventTimer(_EventTimer):
    """``timing="events"`` on a CPU device: the pooled events of the host's
    clock (the same reads, pool and bound as CUDA events)."""

    def _new_event(self) -> Any:
        return HostEvent()


def timer_type(device: torch.device, timing: Optional[str] = None) -> type:
    """
    Args:
        device (torch.device): where the timed kernels run.
        timing (Optional[str]): "events" (CUDA events on CUDA, pooled events
            of the host's clock on CPU) or "host" (the host's clock); default:
            events on CUDA, the host's clock elsewhere.

    Returns:
        type: the timer class.
    """
    if timing is None:
        timing = "events" if device.type == "cuda" else "host"
    if timing not in ("events", "host"):
        raise ValueError(f"timing must be 'events' or 'host', got {timing!r}")
    if timing == "host":
        return _Timer
    return _EventTimer if device.type == "cuda" else _HostEventTimer


class _ModuleMonitor:
    """The hooks on one sharded module and its counters."""

    def __init__(
        self,
        path: str,
        module: nn.Module,
        slot_index: Dict[Tuple[str, str], int],
        ids: torch.Tensor,
        samples: List[float],
        timers: Dict[str, _Timer],
        timer: type = _Timer,
    ) -> None:
        self._path = path
        self._timer = timer
        self._module = module
        self._slot_index = slot_index
        self._ids = ids
        self._samples = samples
        self._timers = timers
        self._index_cache: Dict[Tuple[str, ...], torch.Tensor] = {}
        self._inner: List[RemovableHandle] = []
        self._signature: Tuple[int, ...] = ()
        self._handle: RemovableHandle = module.register_forward_pre_hook(
            self._pre_forward, with_kwargs=True
        )
        self._rehook()

    def _current_signature(self) -> Tuple[int, ...]:
        m = self._module
        return (
            m.reshard_generation,
            len(getattr(m, "_input_dists", [])),
            len(getattr(m, "_lookups", [])),
            len(getattr(m, "_output_dists", [])),
        )

    def _rehook(self) -> None:
        for handle in self._inner:
            handle.remove()
        self._inner = []
        m = self._module
        for dist_module, timer in [
            *[(d, self._timers["input_dist_seconds"]) for d in m._input_dists],
            *[(d, self._timers["output_dist_seconds"]) for d in m._output_dists],
        ]:
            if isinstance(dist_module, nn.Module):
                self._inner.append(dist_module.register_forward_pre_hook(timer.start))
                self._inner.append(dist_module.register_forward_hook(timer.stop))
        compute = self._timers["compute_seconds"]
        for lookup in m._lookups:
            for kernel in _kernels(lookup):
                self._inner.append(kernel.register_forward_pre_hook(compute.start))
                self._inner.append(kernel.register_forward_hook(self._post_kernel))
        self._signature = self._current_signature()

    def _post_kernel(self, module: nn.Module, args: Any, output: Any) -> None:
        compute = self._timers["compute_seconds"]
        compute.stop()
        node = getattr(output, "grad_fn", None)
        if node is not None:
            backward = self._timer()

            def stop(grad_inputs: Any, grad_outputs: Any) -> None:
                backward.stop()
                compute.add(backward)

            node.register_prehook(lambda grad_outputs: backward.start())
            node.register_hook(stop)

    def _slots_for(self, keys: Tuple[str, ...], device: torch.device) -> torch.Tensor:
        index = self._index_cache.get(keys)
        if index is None:
            trash = self._ids.numel() - 1
            index = torch.tensor(
                [self._slot_index.get((self._path, k), trash) for k in keys],
                dtype=torch.long,
                device=device,
            )
            self._index_cache[keys] = index
        return index

    def _host_slots(self, keys: Tuple[str, ...]) -> List[int]:
        trash = self._ids.numel() - 1
        return [self._slot_index.get((self._path, k), trash) for k in keys]

    def _pre_forward(
        self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> None:
        if self._current_signature() != self._signature:
            self._rehook()
        features = args[0] if args else kwargs.get("features")
        if isinstance(features, KeyedJaggedTensor):
            self.count(features)

    def count(self, features: KeyedJaggedTensor) -> None:
        """
        Adds a local batch's ids and samples per feature to the counters: the
        ids summed on their device, the samples (the batch's strides, known
        on the host) on the host, so no copy between them per forward.
        """
        keys = tuple(features.keys())
        if not keys:
            return
        lengths = features.lengths()
        index = self._slots_for(keys, self._ids.device)
        if features.variable_stride_per_key():
            strides = features.stride_per_key()
            per_key = torch.stack([s.sum() for s in torch.split(lengths, strides)]).to(
                self._ids
            )
        else:
            stride = features.stride()
            strides = [stride] * len(keys)
            per_key = lengths.view(len(keys), stride).sum(dim=1).to(self._ids)
        self._ids.index_add_(0, index, per_key.to(self._ids.device))
        for slot, samples in zip(self._host_slots(keys), strides):
            self._samples[slot] += float(samples)

    def remove(self) -> None:
        self._handle.remove()
        for handle in self._inner:
            handle.remove()
        self._inner = []


class LoadMonitor:
    """
    Measures the load of every sharded embedding module of a model: per
    feature the ids and samples this rank's batches had, per part the seconds
    this rank spent. Hooks only: ``remove()`` takes them all off again.

    Args:
        modules (Sequence[Tuple[str, nn.Module]]): (plan path, sharded module)
            of every sharded EBC / EC to watch.
        device (torch.device): where the id counters live (the device of the
            process group's collectives).
        timing (Optional[str]): how parts are timed: "events" (CUDA events,
            read once per window; on CPU pooled events of the host's clock)
            or "host" (the host's clock); default: events on CUDA, the
            host's clock elsewhere.

    Example::

        monitor = LoadMonitor.for_model(model)
        for step in range(window):
            train_step()
            monitor.end_step()
        stats = monitor.collect(pg)  # every rank, once per window
    """

    def __init__(
        self,
        modules: Sequence[Tuple[str, nn.Module]],
        device: torch.device,
        timing: Optional[str] = None,
    ) -> None:
        self.module_tables: List[Tuple[str, List[Tuple[str, List[str]]]]] = [
            (path, module_tables(m)) for path, m in modules
        ]
        self.slots: Tuple[FeatureSlot, ...] = feature_slots(self.module_tables)
        index = {(s.path, s.feature): i for i, s in enumerate(self.slots)}
        # One extra slot collects keys the modules do not read.
        self._ids: torch.Tensor = torch.zeros(
            len(self.slots) + 1, dtype=torch.float64, device=device
        )
        self._samples: List[float] = [0.0] * (len(self.slots) + 1)
        self._timer: type = timer_type(device, timing)
        self._timers: Dict[str, _Timer] = {
            name: self._timer()
            for name in ("compute_seconds", "input_dist_seconds", "output_dist_seconds")
        }
        self._monitors: List[_ModuleMonitor] = [
            _ModuleMonitor(
                path, m, index, self._ids, self._samples, self._timers, self._timer
            )
            for path, m in modules
        ]
        self._steps: int = 0
        self._step_seconds: float = 0.0
        self._timed_steps: int = 0
        self._last_step_end: Optional[float] = None
        self._reshard_bytes: float = 0.0
        self._reshard_seconds: float = 0.0

    @classmethod
    def for_model(cls, model: nn.Module, timing: Optional[str] = None) -> "LoadMonitor":
        """
        A monitor over every module of a ``DistributedModelParallel``'s plan.

        Args:
            model (DistributedModelParallel): the sharded model.
            timing (Optional[str]): see :class:`LoadMonitor` (default: by the
                model's device).

        Returns:
            LoadMonitor: hooks registered.
        """
        modules = []
        for path in sorted(model.plan.plan):
            module = model.module.get_submodule(path) if path else model.module
            modules.append((path, module))
        return cls(modules, model.device, timing)

    @property
    def steps(self) -> int:
        return self._steps

    def end_step(self) -> None:
        """Marks the end of a training step on this rank (no collective)."""
        now = time.perf_counter()
        if self._last_step_end is not None:  # else the step's start is unknown
            self._step_seconds += now - self._last_step_end
            self._timed_steps += 1
        self._last_step_end = now
        self._steps += 1

    def start_step(self) -> None:
        """
        Marks the start of a step (optional): the step time then runs from
        here to ``end_step()``, for loops that do other work between steps.
        """
        self._last_step_end = time.perf_counter()

    def pause(self) -> None:
        """Excludes the time until the next step's work from the step times."""
        self._last_step_end = None

    def record_reshard(self, bytes_moved: int, seconds: float) -> None:
        """Adds a reshard of this rank (bytes sent + received, its seconds)."""
        self._reshard_bytes += float(bytes_moved)
        self._reshard_seconds += seconds

    def local_vector(
        self, rank: int, world_size: int, extra: Sequence[float] = ()
    ) -> torch.Tensor:
        """
        This rank's counters, packed as ``statistics_from_vector`` reads them,
        with ``extra`` in this rank's place of the extra values.
        """
        n = len(self.slots)
        timed = self._timed_steps
        mean_step = self._step_seconds / timed if timed > 0 else 0.0
        if issubclass(self._timer, _EventTimer):
            # the window's one wait for the GPU: every timed event completed
            synchronize_device(self._ids.device)
        values = {
            "steps": float(self._steps),
            "compute_seconds": self._timers["compute_seconds"].seconds(),
            "input_dist_seconds": self._timers["input_dist_seconds"].seconds(),
            "output_dist_seconds": self._timers["output_dist_seconds"].seconds(),
            "step_seconds": mean_step * self._steps,
            "reshard_bytes": self._reshard_bytes,
            "reshard_seconds": self._reshard_seconds,
        }
        per_rank = torch.zeros(
            len(RANK_FIELDS), world_size, dtype=torch.float64, device=self._ids.device
        )
        for i, name in enumerate(RANK_FIELDS):
            per_rank[i, rank] = values[name]
        extras = torch.zeros(
            world_size, len(extra), dtype=torch.float64, device=self._ids.device
        )
        if len(extra):
            extras[rank] = torch.tensor(list(extra), dtype=torch.float64)
        samples = torch.tensor(self._samples[:n], dtype=torch.float64)
        return torch.cat(
            [
                self._ids[:n],
                samples.to(self._ids.device),
                per_rank.flatten(),
                extras.flatten(),
            ]
        )

    def reset(self) -> None:
        """Starts a new window."""
        self._ids.zero_()
        self._samples[:] = [0.0] * len(self._samples)  # shared with the monitors
        for timer in self._timers.values():
            timer.reset()
        self._steps = 0
        self._step_seconds = 0.0
        self._timed_steps = 0
        self._reshard_bytes = 0.0
        self._reshard_seconds = 0.0

    def collect(
        self, pg: dist.ProcessGroup, extra: Sequence[float] = ()
    ) -> LoadStatistics:
        """
        The window's statistics over every rank: one all-reduce. Every rank of
        ``pg`` calls it at the same step, with as many ``extra`` values; the
        counters start a new window.

        Args:
            pg (dist.ProcessGroup): the model's process group.
            extra (Sequence[float]): values this rank attaches to the window
                (every rank reads every rank's in ``LoadStatistics.extra``).

        Returns:
            LoadStatistics: identical on every rank.

        Raises:
            ValueError: when the ranks counted different numbers of steps
                (on every rank: it is read from the reduced counters).
        """
        world_size = dist.get_world_size(pg)
        vector = self.local_vector(dist.get_rank(pg), world_size, extra)
        dist.all_reduce(vector, group=pg)
        self.reset()
        return statistics_from_vector(
            vector.cpu().tolist(),
            self.slots,
            self.module_tables,
            world_size,
            len(extra),
        )

    def remove(self) -> None:
        """Removes every hook of the monitor."""
        for monitor in self._monitors:
            monitor.remove()
        self._monitors = []

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The contract between live resharding and the torch and fbgemm bindings it
calls below their public collectives: every private or backend-level call the
package makes (:data:`CONTRACT`, what each must return or raise), driven
through the package's own code against the real bindings of this machine's
CPU build. What only the CUDA build has (``ProcessGroupNCCL``) is checked
against that build's own statement of its signatures: on a CUDA build the
bindings' own docstrings, read live, else the wheel's docstrings as
``shared/torch_bindings/torch-2.14.1-cu130-c10d.json`` states them (skipped
with the reason where the file is absent): the calls the package makes on a
real gloo backend, recorded as they pass through, and the connect of an NCCL
group, recorded by a stand-in that only writes down its calls, must each be
accepted by the CUDA binding. A scan of the package's sources fails on a
backend-level or private call that :data:`CONTRACT` does not list.
"""

import dataclasses
import datetime
import inspect
import json
import os
import re
import threading
import time
import unittest
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple
from unittest import mock

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding import exchange_group
from torchrec.distributed.resharding.device_memory import free_device_bytes, MemoryWatch
from torchrec.distributed.resharding.devices import synchronize_device
from torchrec.distributed.resharding.exchange_group import (
    ExchangeGroup,
    Message,
    open_exchange_group,
)
from torchrec.distributed.resharding.kernel_state import invalidate_caches, local_slots
from torchrec.distributed.resharding.optimizer_state import (
    apply_table_facts,
    local_table_facts,
)
from torchrec.distributed.resharding.retired import _use_count
from torchrec.distributed.test_utils.multi_process_utils import (
    grouped_config,
    single_rank_process_group,
)
from torchrec.distributed.test_utils.transaction_doubles import RecordingBackend

# Every private or backend-level call the package makes into torch and
# fbgemm (receiver.method as the sources write it), with what it must do.
CONTRACT: Dict[str, str] = {
    "backend._start_coalescing": "Backend._start_coalescing(self) takes no "
    "argument; gloo raises RuntimeError 'does not implement startCoalescing'; "
    "with a device it is a TypeError",
    "Backend._start_coalescing": "(the same call, named in a comment)",
    "backend._end_coalescing": "Backend._end_coalescing(self) -> Work; gloo "
    "raises RuntimeError 'does not implement endCoalescing'",
    "backend.eager_connect_single_device": "(device) -> None; gloo: no-op",
    "backend.set_timeout": "(timedelta) -> None, for works made afterwards",
    "backend.abort": "() -> None; gloo: no-op in torch 2.13, the group still "
    "works and peers are not told",
    "backend.shutdown": "() -> None; gloo: no-op in torch 2.13",
    "backend.send": "([tensor], dst, tag) -> Work; gloo cannot send to its own "
    "rank (RuntimeError 'not connected')",
    "backend.recv": "([tensor], src, tag) -> Work; as send",
    "backend.allreduce": "([tensor], AllreduceOptions) -> Work",
    "backend.broadcast": "([tensor], BroadcastOptions) -> Work",
    "work.wait": "(timedelta) or () -> True once done; raises the work's error",
    "work.is_completed": "() -> bool, without waiting; NCCL works and gloo's "
    "collectives report completion by themselves, gloo's point-to-point works "
    "only from wait()",
    "store.add": "(key, int) -> int, the new value",
    "store.append": "(key, bytes) -> None",
    "store.check": "([key]) -> bool",
    "store.compare_set": "(key, expected, desired) -> the value now stored",
    "store.delete_key": "(key) -> bool",
    "store.get": "(key) -> bytes",
    "store.multi_get": "([key]) -> [bytes]",
    "store.set": "(key, value) -> None",
    "store.wait": "([key], timedelta) -> None; DistStoreError past the timeout",
    "torch.cuda.current_device": "CPU build: AssertionError; called for "
    "an index-less cuda device only",
    "torch.cuda.synchronize": "CPU build: AssertionError; called for CUDA "
    "devices only",
    "torch.cuda.mem_get_info": "CPU build: AssertionError; called for CUDA "
    "devices only (free_device_bytes(cpu) is None)",
    "torch.cuda.memory_allocated": "CPU build: 0",
    "torch.cuda.memory_reserved": "CPU build: 0",
    "torch.cuda.max_memory_allocated": "CPU build: 0",
    "torch.cuda.Event": "CPU build: RuntimeError (a dummy class); the load "
    "monitor makes events on CUDA only: Event(enable_timing=True), then "
    "record(), query() -> bool without waiting, elapsed_time(end) -> ms",
    "torch.accelerator.empty_host_cache": "() -> None; CPU build: "
    "RuntimeError 'Cannot access accelerator device'; called only after an "
    "exchange pinned host memory",
    "torch._C._storage_Use_Count": "(storage._cdata) -> int, the storage's "
    "references",
    "ShardedTensor._init_from_local_shards_and_global_metadata": "(local_shards"
    "=, sharded_tensor_metadata=, process_group=) -> ShardedTensor",
    "batched.flush": "TorchRec's kernel: () -> None; fbgemm returns at once "
    "without a cache",
    "batched.purge": "TorchRec's kernel: () -> None (fbgemm reset_cache_states)",
    "batched.split_embedding_weights": "() -> [rows x dim views of the "
    "kernel's weights], one per table",
    "emb_module.get_optimizer_state": "() -> [{state key: view}] per table",
    "emb_module.get_learning_rate": "() -> float",
    "emb_module.set_learning_rate": "(float) -> None",
    "store.clone": "() -> Store, a connection of its own to the same keys (a "
    "PrefixStore's clone keeps its prefix): a thread's waits do not queue "
    "behind the training thread's",
    "torch.cuda.device_count": "() -> int; CPU build: 0",
    "group.set_timeout": "ProcessGroup.set_timeout(timedelta) -> None: fault "
    "tolerance bounds the training group's collectives (the user's group, gloo "
    "or NCCL); the group goes on working",
    "_group.abort": "ProcessGroup.abort() -> None: fault tolerance ends the "
    "training group's kernels on NCCL only; gloo: no-op, the group still works",
    "os._exit": "(status) -> never returns: ends the whole process from any "
    "thread, without the interpreter's teardown (the replan process's watcher "
    "thread, once its parent is gone; test_replan_process.py kills a parent)",
}

# Private methods of TorchRec's own classes the fork's patches add or that
# TorchRec defines (not torch or fbgemm): their patches' tests hold them.
TORCHREC_PRIVATE: Set[str] = {
    "model._release",
    "module._install_sharding_groups",
    "module._set_output_key_order",
    "module._wrap_data_parallel_lookup",
    "sharding._shard",
}

# The fork's own objects whose methods share a name with c10d's lifecycle
# calls (below), with the files that call them: an ExchangeGroup, a
# Participant, a KeptStorageStep. The same call elsewhere may be torch's.
OWN_LIFECYCLE_CALLS: Dict[str, Set[str]] = {
    "participant.abort": {"runner.py"},
    "group.abort": {"exchange_groups.py"},
    "evicted.abort": {"exchange_groups.py"},
    "kept.abort": {"reshard.py"},
    "_kept.abort": {"elastic.py"},
}

# c10d's lifecycle methods, on any receiver: a ProcessGroup's or a
# backend's, whatever the variable holding it is called
_LIFECYCLE_METHODS = ("abort", "set_timeout", "shutdown")

# receivers whose every method call is backend level
_BACKEND_RECEIVERS = (
    "backend",
    "work",
    "store",
    "batched",
    "emb_module",
    "torch.cuda",
    "torch._C",
    "torch.accelerator",
)
_CALL = re.compile(
    r"\b(torch\.(?:cuda|_C|accelerator)|[A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_]\w*)\("
)

TIMEOUT = timedelta(seconds=10)

# ------------------------------------------------------------ the CUDA build

BINDINGS_FILE = "torch-2.14.1-cu130-c10d.json"
CPU_BINDINGS_FILE = "torch-2.13.0-cpu-c10d.json"


def bindings_dir() -> Optional[Path]:
    """
    Where the wheels' statements of their c10d signatures are: the directory
    ``TORCHREC_TORCH_BINDINGS`` names, else ``../shared/torch_bindings`` of
    the working directory or of the checkout this file belongs to.

    Returns:
        Optional[Path]: the directory, None when absent.
    """
    candidates = [Path(os.environ.get("TORCHREC_TORCH_BINDINGS", "/nonexistent"))]
    here = Path(__file__).resolve()
    for root in [Path.cwd(), *here.parents]:
        candidates.append(root / ".." / "shared" / "torch_bindings")
    for candidate in candidates:
        if (candidate / BINDINGS_FILE).is_file():
            return candidate
    return None


def _split_params(text: str) -> List[str]:
    """Top-level comma-separated parts of a parameter list."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


@dataclasses.dataclass(frozen=True)
class Signature:
    """One overload as a wheel states it: its parameters after ``self``."""

    params: Tuple[Tuple[str, str, bool], ...]  # (name, annotation, has default)

    @staticmethod
    def parse(line: str) -> "Signature":
        line = re.sub(r"^\d+\.\s*", "", line.strip())
        inner = line[line.index("(") + 1 : line.rindex(")")]
        params = []
        for part in _split_params(inner):
            if part.startswith("*"):
                continue
            name, _, rest = part.partition(":")
            annotation, _, default = rest.partition("=")
            params.append((name.strip(), annotation.strip(), bool(default.strip())))
        if params and params[0][0] == "self":
            params = params[1:]
        return Signature(tuple(params))

    def accepts(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
        """Whether a call with these arguments binds to this overload."""
        if len(args) > len(self.params):
            return False
        names = [p[0] for p in self.params]
        if any(k not in names[len(args) :] for k in kwargs):
            return False
        for (_, annotation, _), value in zip(self.params, args):
            if not _matches(annotation, value):
                return False
        given = set(names[: len(args)]) | set(kwargs)
        return all(has_default or name in given for name, _, has_default in self.params)


def _matches(annotation: str, value: Any) -> bool:
    """A value against a binding's annotation (the types the package passes)."""
    if annotation == "torch.device":
        return isinstance(value, torch.device)
    if annotation == "datetime.timedelta":
        return isinstance(value, datetime.timedelta)
    if annotation.startswith("typing.SupportsInt"):
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation == "collections.abc.Sequence[torch.Tensor]":
        return isinstance(value, (list, tuple)) and all(
            isinstance(v, torch.Tensor) for v in value
        )
    if annotation.endswith("Options"):
        return type(value).__name__ in (annotation.split(".")[-1], "Options")
    if annotation.endswith("Store"):
        return isinstance(value, dist.Store)
    return True  # not a type the package passes: not checked


class Bindings:
    """One wheel's stated c10d signatures (see ``shared/torch_bindings``)."""

    def __init__(self, data: Dict[str, Any]) -> None:
        self.data: Dict[str, Any] = data

    @staticmethod
    def read(path: Path) -> "Bindings":
        """A wheel's statement, as a file of ``shared/torch_bindings`` holds it."""
        return Bindings(json.loads(path.read_text()))

    def overloads(self, cls: str, method: str) -> List[Signature]:
        lines = self.data["classes"][cls]["methods"].get(method)
        if lines is None:
            return []
        numbered = [line for line in lines if re.match(r"^\d+\.", line)]
        return [Signature.parse(line) for line in (numbered or lines[:1])]

    def attributes(self, cls: str, nested: str) -> List[str]:
        return list(self.data["classes"][cls]["methods"].get(nested, []))

    def accepts(
        self, cls: str, method: str, args: Sequence[Any], kwargs: Dict[str, Any]
    ) -> bool:
        return any(s.accepts(args, kwargs) for s in self.overloads(cls, method))


C10D_CLASSES: Tuple[str, ...] = (
    "Backend",
    "HashStore",
    "PrefixStore",
    "ProcessGroup",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "Store",
    "TCPStore",
    "Work",
)


def _signature_lines(name: str, doc: Optional[str]) -> List[str]:
    """The lines of a binding's docstring that state its overloads."""
    pattern = re.compile(rf"^(\d+\.\s*)?{re.escape(name)}\(")
    lines = (line.strip() for line in (doc or "").splitlines())
    return [line for line in lines if pattern.match(line)]


def live_bindings() -> Bindings:
    """
    This build's c10d signatures read from its bindings' docstrings, the way
    the files of ``shared/torch_bindings`` were read from their wheels: each
    method's signature lines, each nested class's attribute names.

    Returns:
        Bindings: the statement of the torch this process imported.
    """
    # the bound classes: ``dist.Backend`` is the Python enum of backend names
    bound = torch._C._distributed_c10d
    classes: Dict[str, Any] = {}
    for name in C10D_CLASSES:
        cls = getattr(bound, name, None)
        if cls is None:
            continue
        methods: Dict[str, List[str]] = {}
        for attr in dir(cls):
            if attr.startswith("__") and attr != "__init__":
                continue
            value = getattr(cls, attr)
            if isinstance(value, type):
                methods[attr] = [a for a in dir(value) if not a.startswith("__")]
            elif lines := _signature_lines(attr, getattr(value, "__doc__", None)):
                methods[attr] = lines
        bases = [base.__name__ for base in cls.__mro__[1:]]
        classes[name] = {"bases": bases, "methods": methods}
    return Bindings(
        {
            "torch": torch.__version__,
            "cuda_build": torch.version.cuda,
            "classes": classes,
        }
    )


def cuda_bindings() -> Bindings:
    """
    The CUDA build's bindings: this build's own on a CUDA build, else the
    file's statement of them (the test skips without the file).
    """
    if torch.version.cuda is not None and hasattr(
        torch._C._distributed_c10d, "ProcessGroupNCCL"
    ):
        return live_bindings()
    directory = bindings_dir()
    if directory is None:
        raise unittest.SkipTest(
            f"no {BINDINGS_FILE} (shared/torch_bindings, or set "
            "TORCHREC_TORCH_BINDINGS): the CUDA build's signatures are unknown here"
        )
    return Bindings.read(directory / BINDINGS_FILE)


class _NcclStandIn:
    """
    Stands for ``dist.ProcessGroupNCCL``, which the CPU build lacks: it does
    nothing but write down how the package constructs and calls it, for the
    CUDA build's signatures to judge.
    """

    made: List["_NcclStandIn"] = []

    class Options:
        def __init__(self) -> None:
            object.__setattr__(self, "written", [])

        def __setattr__(self, name: str, value: Any) -> None:
            self.written.append(name)
            object.__setattr__(self, name, value)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.log: List[Tuple[str, Tuple[Any, ...], Dict[str, Any]]] = [
            ("__init__", args, kwargs)
        ]
        _NcclStandIn.made.append(self)

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> None:
            self.log.append((name, args, kwargs))

        return call


# ------------------------------------------------------------------- tests


def _gloo_group() -> Tuple[ExchangeGroup, RecordingBackend]:
    """A one-rank exchange group over a real gloo backend, recorded."""
    group = open_exchange_group([0], "contract", TIMEOUT)
    backend = RecordingBackend(group.backend, [])
    return dataclasses.replace(group, backend=backend), backend


class CoalescingContractTest(unittest.TestCase):
    def test_a_backends_coalescing_takes_no_device(self) -> None:
        with single_rank_process_group():
            group, backend = _gloo_group()
            coalesced = dataclasses.replace(group, coalesced=True)
            with self.assertRaisesRegex(
                RuntimeError, "does not implement startCoalescing"
            ):
                coalesced.post([Message(torch.zeros(1), 0, 0, send=True)])
            self.assertEqual(backend.log, [("_start_coalescing", (), {})])
            with self.assertRaisesRegex(
                RuntimeError, "does not implement endCoalescing"
            ):
                group.backend._end_coalescing()
            # what the package must never do: a backend takes no device
            with self.assertRaises(TypeError):
                group.backend._start_coalescing(torch.device("cpu"))

    def test_a_process_groups_coalescing_takes_the_device(self) -> None:
        with single_rank_process_group() as pg:
            over = ExchangeGroup.over(pg, device=torch.device("cuda", 0))
            with self.assertRaisesRegex(
                RuntimeError, "does not implement startCoalescing"
            ):
                over.post([Message(torch.zeros(1), 0, 0, send=True)])
            with self.assertRaises(TypeError):
                pg._start_coalescing()


class BackendContractTest(unittest.TestCase):
    def test_lifecycle_calls_return_none_and_gloo_abort_does_nothing(self) -> None:
        with single_rank_process_group():
            group, backend = _gloo_group()
            owned = group.with_timeout(timedelta(seconds=7))
            self.assertIn(("set_timeout", (timedelta(seconds=7),), {}), backend.log)
            self.assertIsNone(backend.eager_connect_single_device(torch.device("cpu")))
            self.assertFalse(backend.supports_coalescing)
            owned.abort()
            self.assertIn("abort", backend.calls)
            # gloo's abort() is Backend::abort() {} in torch 2.13: the group
            # still works (so a peer is never told by it)
            self.assertEqual(owned.all_reduce_max([3, 1]), [3, 1])
            owned.close()
            self.assertIn("shutdown", backend.calls)
            self.assertEqual(owned.all_reduce_max([2]), [2])

    def test_a_training_groups_timeout_and_abort_return_none(self) -> None:
        # what fault tolerance calls on the user's training group (a real
        # gloo ProcessGroup): both return None and the group goes on working
        with single_rank_process_group():
            group = dist.new_group([0])
            self.assertIsNone(group.set_timeout(timedelta(seconds=5)))
            ones = torch.ones(2)
            dist.all_reduce(ones, group=group)
            self.assertTrue(torch.equal(ones, torch.ones(2)))
            self.assertIsNone(group.abort())
            dist.all_reduce(ones, group=group)  # gloo: abort does nothing
            self.assertTrue(torch.equal(ones, torch.ones(2)))
            with self.assertRaises(TypeError):
                group.set_timeout(5)  # seconds as a number: the binding refuses

    def test_messages_and_collectives_return_works(self) -> None:
        with single_rank_process_group():
            group, backend = _gloo_group()
            t = torch.arange(4.0)
            group.broadcast(t, 0)
            self.assertEqual(group.broadcast_object({"a": 1}, 0), {"a": 1})
            group.barrier()
            names = {name for name, _, _ in backend.log}
            self.assertEqual(
                names, {"broadcast", "allreduce", "work.is_completed", "work.wait"}
            )
            work = backend.allreduce([t], dist.AllreduceOptions())
            self.assertTrue(work.wait(TIMEOUT))
            # gloo never sends to its own rank (NCCL does, in a group call)
            with self.assertRaisesRegex(RuntimeError, "not connected"):
                group.post([Message(t, 0, 0, send=True)])
            self.assertEqual(backend.log[-1][0], "send")


def _gloo_pair() -> List[Any]:
    """Two gloo backends of one two-rank group, in this process."""
    store = dist.HashStore()
    backends: List[Any] = [None, None]

    def connect(rank: int) -> None:
        backends[rank] = dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)

    threads = [threading.Thread(target=connect, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return backends


class WorkContractTest(unittest.TestCase):
    def test_gloo_reports_a_messages_completion_only_from_wait(self) -> None:
        sender, receiver = _gloo_pair()
        received = torch.zeros(4)
        sent = sender.send([torch.ones(4)], 1, 0)
        pending = receiver.recv([received], 0, 0)
        time.sleep(0.2)
        # the message arrived, yet neither work says so before wait()
        self.assertFalse(sent.is_completed())
        self.assertFalse(pending.is_completed())
        self.assertTrue(pending.wait(TIMEOUT))
        self.assertTrue(sent.wait(TIMEOUT))
        self.assertTrue(pending.is_completed())
        self.assertTrue(torch.equal(received, torch.ones(4)))
        # a collective's work completes by itself
        works = [
            b.allreduce([torch.ones(2)], dist.AllreduceOptions())
            for b in (sender, receiver)
        ]
        deadline = time.monotonic() + 10
        while not all(w.is_completed() for w in works):
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.01)


class StoreContractTest(unittest.TestCase):
    def test_the_store_calls_of_the_agreement(self) -> None:
        with single_rank_process_group():
            store = dist.PrefixStore("contract/", exchange_group.job_store())
            self.assertIsInstance(store, dist.Store)
            self.assertEqual(store.add("n", 2), 2)
            self.assertFalse(store.check(["k"]))
            self.assertEqual(store.compare_set("k", "", "v"), b"v")
            self.assertEqual(store.compare_set("k", "x", "w"), b"v")
            self.assertIsNone(store.set("k", "u"))
            self.assertEqual(store.get("k"), b"u")
            self.assertIsNone(store.append("k", "2"))
            self.assertEqual(store.multi_get(["k", "n"]), [b"u2", b"2"])
            self.assertTrue(store.delete_key("k"))
            self.assertIsNone(store.wait(["n"], timedelta(seconds=1)))
            with self.assertRaises(dist.DistStoreError):
                store.wait(["absent"], timedelta(milliseconds=50))
            clone = store.clone()
            self.assertIsInstance(clone, dist.PrefixStore)
            self.assertIsNone(clone.set("c", "1"))
            self.assertEqual(store.get("c"), b"1")


class CudaWithoutAGpuTest(unittest.TestCase):
    @unittest.skipIf(torch.cuda.is_available(), "a machine without a GPU's behaviour")
    def test_cuda_calls_raise_and_the_package_makes_them_on_cuda_only(self) -> None:
        # the CPU build asserts it has no CUDA; a CUDA build on a machine
        # without a driver (the torch 2.14 lane) raises when it looks for one
        cpu_build = torch.version.cuda is None
        error = AssertionError if cpu_build else RuntimeError
        cuda = torch.device("cuda", 0)
        for call in (
            lambda: torch.cuda.mem_get_info(cuda),
            lambda: torch.cuda.synchronize(cuda),
            torch.cuda.current_device,
        ):
            with self.assertRaises(error):
                call()
        self.assertEqual(torch.cuda.memory_allocated(cuda), 0)
        self.assertEqual(torch.cuda.memory_reserved(cuda), 0)
        self.assertEqual(torch.cuda.max_memory_allocated(cuda), 0)
        self.assertEqual(torch.cuda.device_count(), 0)
        if cpu_build:
            with self.assertRaises(RuntimeError):  # a dummy class
                torch.cuda.Event(enable_timing=True)
        else:  # made, and one never recorded reads as done (no device asked)
            self.assertTrue(torch.cuda.Event(enable_timing=True).query())
        # the methods the load monitor calls on a CUDA event, as torch states them
        for method, params in (
            ("__new__", ["cls", "enable_timing"]),
            ("record", ["self", "stream"]),
            ("query", ["self"]),
            ("elapsed_time", ["self", "end_event"]),
        ):
            signature = inspect.signature(getattr(torch.cuda.Event, method))
            self.assertEqual(list(signature.parameters)[: len(params)], params)
        if cpu_build:
            with self.assertRaisesRegex(RuntimeError, "accelerator"):
                torch.accelerator.empty_host_cache()
        else:  # no pinned block was ever cached
            self.assertIsNone(torch.accelerator.empty_host_cache())
        # what the package does with a CPU device: none of those calls
        cpu = torch.device("cpu")
        self.assertIsNone(free_device_bytes(cpu))
        synchronize_device(cpu)
        self.assertEqual(MemoryWatch(cpu).kind, "host_rss")


class PrivateTorchTest(unittest.TestCase):
    def test_a_storages_use_count(self) -> None:
        t = torch.zeros(8)
        before = _use_count(t.untyped_storage())
        view = t[2:]
        self.assertEqual(_use_count(t.untyped_storage()), before + 1)
        del view
        self.assertEqual(_use_count(t.untyped_storage()), before)

    def test_sharded_tensor_from_local_shards_and_metadata(self) -> None:
        parameters = ShardedTensor._init_from_local_shards_and_global_metadata
        names = list(parameters.__code__.co_varnames[: parameters.__code__.co_argcount])
        for name in ("local_shards", "sharded_tensor_metadata", "process_group"):
            self.assertIn(name, names)


def _fused_kernel() -> nn.Module:
    fused = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": 0.25,
    }
    config = grouped_config(["a", "b"], fused, 8, 4, EmbeddingComputeKernel.FUSED)
    return BatchedFusedEmbeddingBag(config, device=torch.device("cpu"))


class FbgemmContractTest(unittest.TestCase):
    def test_a_kernel_is_flushed_then_read_as_views_of_its_weights(self) -> None:
        with single_rank_process_group():
            kernel = _fused_kernel()
            order: List[str] = []
            flush, split = kernel.flush, kernel.split_embedding_weights

            def flushed() -> None:
                order.append("flush")
                self.assertIsNone(flush())

            def read() -> List[torch.Tensor]:
                order.append("split_embedding_weights")
                return split()

            with (
                mock.patch.object(kernel, "flush", flushed),
                mock.patch.object(kernel, "split_embedding_weights", read),
            ):
                slots = local_slots([kernel])
            self.assertEqual(order, ["flush", "split_embedding_weights"])
            weights = kernel.emb_module.weights_host
            for slot in slots.values():
                self.assertEqual(tuple(slot.tensors["weight"].shape), (8, 4))
                self.assertEqual(
                    slot.tensors["weight"].untyped_storage().data_ptr(),
                    weights.untyped_storage().data_ptr(),
                )
                self.assertEqual(tuple(slot.tensors["sum"].shape), (8,))
            states = kernel.emb_module.get_optimizer_state()
            self.assertEqual(len(states), 2)
            self.assertEqual(sorted(states[0]), ["sum"])
            self.assertIsNone(kernel.purge())
            invalidate_caches([kernel])

    def test_learning_rate_round_trip(self) -> None:
        with single_rank_process_group():
            kernel = _fused_kernel()
            self.assertEqual(kernel.emb_module.get_learning_rate(), 0.25)
            facts = local_table_facts([kernel], ["a", "b"])
            other = _fused_kernel()
            other.emb_module.set_learning_rate(0.5)
            apply_table_facts([other], facts)
            self.assertEqual(other.emb_module.get_learning_rate(), 0.25)


def _no_addresses(lines: List[str]) -> List[str]:
    """Signature lines without the addresses of their default objects."""
    return [re.sub(r" at 0x[0-9a-f]+", "", line) for line in lines]


class LiveBindingsTest(unittest.TestCase):
    def test_the_live_read_states_what_the_wheels_file_states(self) -> None:
        # On a CUDA build the signature tests below judge by the live read:
        # here it must give, method by method, what the file made from this
        # CPU wheel's docstrings gives.
        directory = bindings_dir()
        if directory is None or not (directory / CPU_BINDINGS_FILE).is_file():
            self.skipTest(f"no {CPU_BINDINGS_FILE} (shared/torch_bindings)")
        stated = Bindings.read(directory / CPU_BINDINGS_FILE)
        if stated.data["torch"] != torch.__version__:
            self.skipTest(f"{CPU_BINDINGS_FILE} states another torch")
        live = live_bindings().data["classes"]
        compared = set()
        for cls, entry in stated.data["classes"].items():
            if entry is None:  # not in this build (ProcessGroupNCCL)
                self.assertNotIn(cls, live)
                continue
            for method, lines in entry["methods"].items():
                if lines and _signature_lines(method, "\n".join(lines)) == lines:
                    read = live[cls]["methods"].get(method, [])
                    self.assertEqual(_no_addresses(read), _no_addresses(lines))
                    compared.add((cls, method))
        self.assertIn(("Backend", "_start_coalescing"), compared)
        self.assertIn(("ProcessGroup", "_start_coalescing"), compared)
        self.assertGreater(len(compared), 100)


class CudaBuildSignatureTest(unittest.TestCase):
    def test_every_backend_call_of_a_transaction_binds_on_nccl(self) -> None:
        bindings = cuda_bindings()
        with single_rank_process_group():
            group, backend = _gloo_group()
            group = group.with_timeout(timedelta(seconds=5))
            group.all_reduce_max([1])
            group.broadcast_object("x", 0)
            coalesced = dataclasses.replace(group, coalesced=True)
            with self.assertRaises(RuntimeError):  # gloo: does not coalesce
                coalesced.post([Message(torch.zeros(1), 0, 0, send=True)])
            with self.assertRaises(RuntimeError):  # gloo: not to itself
                group.post([Message(torch.zeros(1), 0, 0, send=False)])
            group.abort()
            group.close()
        called = {name for name, _, _ in backend.log}
        self.assertLessEqual(
            {"set_timeout", "allreduce", "broadcast", "_start_coalescing", "recv"},
            called,
        )
        self.assertIn("work.is_completed", called)
        for name, args, kwargs in backend.log:
            cls, _, method = name.rpartition(".")
            cls = "Work" if cls == "work" else "ProcessGroupNCCL"
            self.assertTrue(
                bindings.accepts(cls, method, args, kwargs),
                f"{cls}.{method}{args} does not bind on the CUDA build: "
                f"{bindings.data['classes'][cls]['methods'].get(method)}",
            )

    def test_the_connect_of_an_nccl_group_binds(self) -> None:
        bindings = cuda_bindings()
        _NcclStandIn.made.clear()
        with (
            single_rank_process_group(),
            mock.patch.object(dist, "ProcessGroupNCCL", _NcclStandIn, create=True),
        ):
            store = dist.PrefixStore("contract/", exchange_group.job_store())
            exchange_group._connect(
                store, [0], 0, TIMEOUT, torch.device("cuda", 0), "t"
            )
        (made,) = _NcclStandIn.made
        options = made.log[0][1][3]
        self.assertLessEqual(
            set(options.written),
            set(bindings.attributes("ProcessGroupNCCL", "Options")),
        )
        self.assertGreater(len(made.log), 1)
        for name, args, kwargs in made.log:
            self.assertTrue(
                bindings.accepts("ProcessGroupNCCL", name, args, kwargs),
                f"ProcessGroupNCCL.{name}{args} does not bind on the CUDA build",
            )

    def test_the_training_groups_timeout_and_abort_bind(self) -> None:
        # fault tolerance's calls on the training group, a ProcessGroup
        bindings = cuda_bindings()
        self.assertTrue(bindings.accepts("ProcessGroup", "set_timeout", (TIMEOUT,), {}))
        self.assertFalse(bindings.accepts("ProcessGroup", "set_timeout", (5,), {}))
        self.assertTrue(bindings.accepts("ProcessGroup", "abort", (), {}))
        self.assertFalse(
            bindings.accepts("ProcessGroup", "abort", (torch.device("cuda", 0),), {})
        )

    def test_the_check_refuses_what_the_binding_refuses(self) -> None:
        bindings = cuda_bindings()
        device = torch.device("cuda", 0)
        self.assertFalse(
            bindings.accepts("ProcessGroupNCCL", "_start_coalescing", (device,), {})
        )
        self.assertFalse(bindings.accepts("ProcessGroupNCCL", "set_timeout", (5,), {}))
        self.assertTrue(
            bindings.accepts("ProcessGroup", "_start_coalescing", (device,), {})
        )


class SourceScanTest(unittest.TestCase):
    def test_every_backend_level_or_private_call_is_in_the_contract(self) -> None:
        package = Path(exchange_group.__file__).resolve().parent
        sources = [p for p in package.rglob("*.py") if "tests" not in p.parts]
        sources.append(package.parent / "sharding" / "dynamic_sharding.py")
        found: Dict[str, Set[str]] = {}
        for path in sources:
            for match in _CALL.finditer(path.read_text()):
                receiver, method = match.group(1), match.group(2)
                private = method.startswith("_") and not method.startswith("__")
                lifecycle = method in _LIFECYCLE_METHODS and receiver != "self"
                if (
                    receiver in _BACKEND_RECEIVERS
                    or lifecycle
                    or (private and receiver not in ("self", "cls"))
                ):
                    found.setdefault(f"{receiver}.{method}", set()).add(path.name)
        unknown = {
            call: sorted(files)
            for call, files in found.items()
            if call not in CONTRACT
            and call not in TORCHREC_PRIVATE
            and not files <= OWN_LIFECYCLE_CALLS.get(call, set())
        }
        self.assertEqual(unknown, {}, "add these calls to the contract")
        self.assertGreater(len(found), 20)


if __name__ == "__main__":
    unittest.main()

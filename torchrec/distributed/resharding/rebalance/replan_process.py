#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The full replan in a process of its own, so that no step of the training
process waits for the planner (pure Python: in a thread of the training
process it holds the interpreter lock and slows every step several times).

* ``ReplanJob`` is a ``ReplanRequest`` as plain data: the tables' configs
  per module, the sharders by class and fused parameters, the topology's
  sizes and bandwidths, the constraints' fields with the measured load and
  the current plan's shards; ``job_from_request`` and ``request_from_job``
  convert (the child rebuilds the meta definition itself), ``plan_to_data``
  and ``plan_from_data`` carry a plan both ways;
* ``ProcessReplanner`` (same calls as ``replan.BackgroundReplanner``:
  ``busy``, ``start``, ``ready``, ``take``, plus ``close``) spawns one child
  at its first replan and keeps it: a fresh interpreter at the lowest
  scheduling priority (``os.nice(19)`` and Linux's ``SCHED_IDLE`` class
  before it imports anything), one intra-op thread, fed over a pipe. ``start`` hands the bytes to a writer
  thread that only waits on the pipe; ``ready`` polls without blocking. The
  child exits on the pipe's end of file, on ``close``, or within a second of
  its parent's death (it watches its parent's pid), so it is never left
  orphaned.

The result comes back to group rank 0, which posts it at the next window as
before; every rank agrees on it there.
"""

import dataclasses
import enum
import importlib
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.resharding.model_build import module_tree
from torchrec.distributed.resharding.rebalance.replan import (
    full_replan,
    Replanner,
    ReplanRequest,
    ReplanResult,
)
from torchrec.distributed.resharding.whole_plan import plan_of, TableShape
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ParameterSharding,
    ShardingPlan,
)
from torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
)

# A plan as data: module path -> table -> the ParameterSharding's fields, its
# sharding spec as (offsets, sizes, placement) per shard.
PlanData = Dict[str, Dict[str, Dict[str, Any]]]

# How long ``close`` waits for an idle child to exit before it kills it.
CLOSE_WAIT_S: float = 5.0
# How often the child looks for its parent.
PARENT_POLL_S: float = 0.5


def _plain(value: Any) -> Any:
    """A constraint's or sharding's field as data: enums by value, lists."""
    if isinstance(value, enum.Enum):
        return (type(value).__module__, type(value).__qualname__, value.value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (
            type(value).__module__,
            type(value).__qualname__,
            {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)},
        )
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{type(value).__name__} is no plain data: {value!r}")


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _unplain(value: Any) -> Any:
    """The inverse of ``_plain``."""
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[2], dict):
        cls = _resolve(value[0], value[1])
        return cls(**{k: _unplain(v) for k, v in value[2].items()})
    if isinstance(value, tuple) and len(value) == 3:
        return _resolve(value[0], value[1])(value[2])
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict):
        return {k: _unplain(v) for k, v in value.items()}
    return value


def _sharding_to_data(sharding: ParameterSharding) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(sharding):
        value = getattr(sharding, f.name)
        if f.name == "sharding_spec":
            out[f.name] = (
                None
                if value is None
                else [
                    (list(s.shard_offsets), list(s.shard_sizes), str(s.placement))
                    for s in value.shards
                ]
            )
        else:
            out[f.name] = _plain(value)
    return out


def _sharding_from_data(data: Mapping[str, Any]) -> ParameterSharding:
    fields: Dict[str, Any] = {}
    for name, value in data.items():
        if name == "sharding_spec":
            fields[name] = (
                None
                if value is None
                else EnumerableShardingSpec(
                    [
                        ShardMetadata(
                            shard_offsets=list(o), shard_sizes=list(s), placement=p
                        )
                        for o, s, p in value
                    ]
                )
            )
        else:
            fields[name] = _unplain(value)
    return ParameterSharding(**fields)


def plan_to_data(plan: ShardingPlan) -> PlanData:
    """
    A plan as plain data (lists, numbers, strings).

    Args:
        plan (ShardingPlan): an embedding modules' plan.

    Returns:
        PlanData: module path -> table -> the sharding's fields.
    """
    out: PlanData = {}
    for path, module in plan.plan.items():
        assert isinstance(module, EmbeddingModuleShardingPlan), path
        out[path] = {t: _sharding_to_data(s) for t, s in module.items()}
    return out


def plan_from_data(data: PlanData) -> ShardingPlan:
    """
    The plan ``plan_to_data`` wrote.

    Args:
        data (PlanData): the plan as data.

    Returns:
        ShardingPlan: a new plan, equal to the one written.
    """
    return plan_of(
        {
            path: {t: _sharding_from_data(s) for t, s in tables.items()}
            for path, tables in data.items()
        }
    )


@dataclass(frozen=True)
class ModuleSpec:
    """
    An embedding module of the definition as data.

    Args:
        path (str): its path in the plan.
        bags (bool): an ``EmbeddingBagCollection`` (else an
            ``EmbeddingCollection``).
        flag (bool): its ``is_weighted`` (bags) or ``need_indices``.
        tables (Tuple[Dict[str, Any], ...]): each table's config fields.
    """

    path: str
    bags: bool
    flag: bool
    tables: Tuple[Dict[str, Any], ...]


@dataclass(frozen=True)
class SharderSpec:
    """
    A sharder as data: its class and fused parameters.

    Args:
        module (str): the class's module.
        qualname (str): the class's qualified name.
        fused_params (Optional[Dict[str, Any]]): its fused parameters.
    """

    module: str
    qualname: str
    fused_params: Optional[Dict[str, Any]]


@dataclass(frozen=True)
class TopologySpec:
    """
    A planner ``Topology`` as data.

    Args:
        world_size (int): ranks.
        compute_device (str): "cpu" or "cuda".
        local_world_size (int): ranks per host.
        hbm (Tuple[int, ...]): each device's HBM bytes.
        ddr (Tuple[int, ...]): each device's DDR bytes.
        scalars (Dict[str, float]): the constructor's bandwidths and
            multipliers the topology holds.
    """

    world_size: int
    compute_device: str
    local_world_size: int
    hbm: Tuple[int, ...]
    ddr: Tuple[int, ...]
    scalars: Dict[str, float]


# Topology constructor arguments, held as attributes of the same name with
# a leading underscore (on every base that has them).
_TOPOLOGY_SCALARS: Tuple[str, ...] = (
    "hbm_mem_bw",
    "ddr_mem_bw",
    "intra_host_bw",
    "inter_host_bw",
    "bwd_compute_multiplier",
    "weighted_feature_bwd_compute_multiplier",
    "uneven_sharding_perf_multiplier",
)


def topology_to_spec(topology: Topology) -> TopologySpec:
    """The topology as data (each device's storage as it is now)."""
    import inspect

    accepted = inspect.signature(Topology.__init__).parameters
    scalars = {
        name: float(getattr(topology, "_" + name))
        for name in _TOPOLOGY_SCALARS
        if name in accepted and isinstance(getattr(topology, "_" + name, None), float)
    }
    return TopologySpec(
        world_size=topology.world_size,
        compute_device=topology.compute_device,
        local_world_size=topology.local_world_size,
        hbm=tuple(int(d.storage.hbm) for d in topology.devices),
        ddr=tuple(int(d.storage.ddr) for d in topology.devices),
        scalars=scalars,
    )


def topology_from_spec(spec: TopologySpec) -> Topology:
    """The topology ``topology_to_spec`` described."""
    topology = Topology(
        world_size=spec.world_size,
        compute_device=spec.compute_device,
        local_world_size=spec.local_world_size,
        **spec.scalars,
    )
    for device, hbm, ddr in zip(topology.devices, spec.hbm, spec.ddr):
        device.storage.hbm, device.storage.ddr = hbm, ddr
    return topology


@dataclass(frozen=True)
class ReplanJob:
    """
    A ``ReplanRequest`` as plain data, what the replan process is sent.

    Args:
        step (int): the window's step.
        modules (Tuple[ModuleSpec, ...]): the definition's embedding modules.
        sharders (Tuple[SharderSpec, ...]): the sharders.
        topology (TopologySpec): the topology.
        batch_size (int): samples per rank and step.
        constraints (Dict[str, Dict[str, Any]]): per table, the fields of
            its ``ParameterConstraints`` (measured load in place).
        current (PlanData): the plan the model runs under.
        tables (Dict[str, List[TableShape]]): module path -> tables.
        element_bytes (Dict[str, int]): table key -> bytes per element.
        device_type (str): the shards' device type.
    """

    step: int
    modules: Tuple[ModuleSpec, ...]
    sharders: Tuple[SharderSpec, ...]
    topology: TopologySpec
    batch_size: int
    constraints: Dict[str, Dict[str, Any]]
    current: PlanData
    tables: Dict[str, List[TableShape]]
    element_bytes: Dict[str, int]
    device_type: str


def _table_fields(config: Any) -> Dict[str, Any]:
    out = {
        "name": config.name,
        "num_embeddings": int(config.num_embeddings),
        "embedding_dim": int(config.embedding_dim),
        "feature_names": list(config.feature_names),
        "data_type": config.data_type.value,
    }
    if isinstance(config, EmbeddingBagConfig):
        out["pooling"] = config.pooling.value
    return out


def _module_spec(path: str, module: nn.Module) -> ModuleSpec:
    if isinstance(module, EmbeddingBagCollection):
        configs = module.embedding_bag_configs()
        flag = module.is_weighted()
        bags = True
    elif isinstance(module, EmbeddingCollection):
        configs, flag, bags = module.embedding_configs(), module.need_indices(), False
    else:
        raise ValueError(
            f"{path}: a {type(module).__name__} cannot be replanned in a process"
        )
    return ModuleSpec(path, bags, flag, tuple(_table_fields(c) for c in configs))


def _sharder_spec(sharder: ModuleSharder[nn.Module]) -> SharderSpec:
    fused = getattr(sharder, "fused_params", None)
    return SharderSpec(
        type(sharder).__module__,
        type(sharder).__qualname__,
        None if fused is None else dict(_plain(fused)),
    )


def job_from_request(request: ReplanRequest) -> ReplanJob:
    """
    The request as plain data.

    Args:
        request (ReplanRequest): what to plan.

    Returns:
        ReplanJob: the same, as data.

    Raises:
        ValueError: for a module other than an EBC or EC, or a value that is
            no plain data.
    """
    return ReplanJob(
        step=request.step,
        modules=tuple(
            (
                _module_spec(path, request.definition.get_submodule(path))
                if path
                else _module_spec(path, request.definition)
            )
            for path in sorted(request.current.plan)
        ),
        sharders=tuple(_sharder_spec(s) for s in request.sharders),
        topology=topology_to_spec(request.topology),
        batch_size=request.batch_size,
        constraints={
            table: {f.name: _plain(getattr(c, f.name)) for f in dataclasses.fields(c)}
            for table, c in request.constraints.items()
        },
        current=plan_to_data(request.current),
        tables={p: [tuple(t) for t in ts] for p, ts in request.tables.items()},
        element_bytes=dict(request.element_bytes),
        device_type=request.device_type,
    )


def _build_module(spec: ModuleSpec) -> nn.Module:
    meta = torch.device("meta")
    configs = []
    for fields in spec.tables:
        kwargs = dict(fields, data_type=DataType(fields["data_type"]))
        if spec.bags:
            kwargs["pooling"] = PoolingType(fields["pooling"])
            configs.append(EmbeddingBagConfig(**kwargs))
        else:
            configs.append(EmbeddingConfig(**kwargs))
    if spec.bags:
        return EmbeddingBagCollection(
            tables=configs, is_weighted=spec.flag, device=meta
        )
    return EmbeddingCollection(tables=configs, need_indices=spec.flag, device=meta)


def _definition(modules: Sequence[ModuleSpec]) -> nn.Module:
    return module_tree({spec.path: _build_module(spec) for spec in modules})


def _sharder(spec: SharderSpec) -> ModuleSharder[nn.Module]:
    cls = _resolve(spec.module, spec.qualname)
    if spec.fused_params is None:
        return cls()
    return cls(fused_params=_unplain(spec.fused_params))


def request_from_job(job: ReplanJob) -> ReplanRequest:
    """
    The request a job describes (in the replan process).

    Args:
        job (ReplanJob): the job.

    Returns:
        ReplanRequest: the request, its definition rebuilt on the meta device.
    """
    return ReplanRequest(
        step=job.step,
        definition=_definition(job.modules),
        sharders=tuple(_sharder(s) for s in job.sharders),
        topology=topology_from_spec(job.topology),
        batch_size=job.batch_size,
        constraints={
            t: ParameterConstraints(**{k: _unplain(v) for k, v in c.items()})
            for t, c in job.constraints.items()
        },
        current=plan_from_data(job.current),
        tables={p: [tuple(t) for t in ts] for p, ts in job.tables.items()},
        element_bytes=dict(job.element_bytes),
        device_type=job.device_type,
    )


def _error_text(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


def run_job(replan: Replanner, job: ReplanJob) -> Tuple[int, Any, Optional[str], float]:
    """
    Plans a job: (step, plan as data or None, error or None, seconds).

    Args:
        replan (Replanner): plans a request.
        job (ReplanJob): what to plan.

    Returns:
        Tuple[int, Any, Optional[str], float]: the answer, as data.
    """
    start = time.perf_counter()
    try:
        plan = plan_to_data(replan(request_from_job(job)))
        return job.step, plan, None, time.perf_counter() - start
    except Exception as e:  # reported at the next window, on every rank
        return job.step, None, _error_text(e), time.perf_counter() - start


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(PARENT_POLL_S)


def serve(read_fd: int, write_fd: int, parent_pid: int) -> None:
    """
    The replan process's loop: read a (replanner, job), answer with
    ``run_job``'s tuple; exit on end of file, on None, or when the parent
    is gone.

    Args:
        read_fd (int): the pipe it reads jobs from.
        write_fd (int): the pipe it writes answers to.
        parent_pid (int): the training process.
    """
    torch.set_num_threads(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    jobs, answers = Connection(read_fd, writable=False), Connection(
        write_fd, readable=False
    )
    while True:
        try:
            message = pickle.loads(jobs.recv_bytes())
        except (EOFError, OSError):
            return
        if message is None:
            return
        replan, job = message
        answers.send(run_job(replan, job))


# The child: nice 19 and, where the OS has it, the idle scheduling class
# (it runs only on a core nothing else wants), before it imports torch.
_CHILD = """
import os, sys
os.nice(19)
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    pass
from torchrec.distributed.resharding.rebalance.replan_process import serve
serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
"""


def _stop(child: "subprocess.Popen[bytes]", jobs: Connection, wait_s: float) -> None:
    jobs.close()  # end of file: an idle child exits
    try:
        child.wait(wait_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


class ProcessReplanner:
    """
    At most one full replan at a time, in a child process spawned at the
    first ``start`` and kept: ``start`` returns at once, ``ready`` polls,
    ``take`` hands over the result (and frees the slot), ``close`` ends the
    child (also done when this object is collected or the interpreter exits).

    Args:
        replan (Replanner): plans a request in the child (default:
            ``full_replan``); a function importable by name.

    Raises:
        ValueError: for a replanner the child cannot import.
    """

    def __init__(self, replan: Replanner = full_replan) -> None:
        try:
            self._replan_bytes: bytes = pickle.dumps(replan)
        except Exception as e:
            raise ValueError(
                f"the replan process needs a function importable by name: {e}"
            ) from e
        self._replan = replan
        self._child: Optional["subprocess.Popen[bytes]"] = None
        self._jobs: Optional[Connection] = None
        self._answers: Optional[Connection] = None
        self._writer: Optional[threading.Thread] = None
        self._running: bool = False
        self._step: int = -1
        self._result: Optional[ReplanResult] = None
        self._finalizer: Optional[weakref.finalize] = None

    @property
    def pid(self) -> Optional[int]:
        """The child's pid (None before the first replan)."""
        return None if self._child is None else self._child.pid

    @property
    def busy(self) -> bool:
        """A replan runs or its result waits."""
        self.ready()
        return self._running or self._result is not None

    def _spawn(self) -> None:
        jobs_r, jobs_w = os.pipe()
        answers_r, answers_w = os.pipe()
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(jobs_r), str(answers_w)]
                + [str(os.getpid())],
                pass_fds=(jobs_r, answers_w),
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(jobs_r)
            os.close(answers_w)
        self._jobs = Connection(jobs_w, readable=False)
        self._answers = Connection(answers_r, writable=False)
        self._finalizer = weakref.finalize(
            self, _stop, self._child, self._jobs, CLOSE_WAIT_S
        )

    def start(self, request: ReplanRequest) -> None:
        """
        Sends a replan to the child (spawned now if none runs).

        Args:
            request (ReplanRequest): what to plan.

        Raises:
            RuntimeError: when one runs or its result waits, or the child died.
            ValueError: for a request that is no plain data.
        """
        if self.busy:
            raise RuntimeError("a full replan runs already")
        message = pickle.dumps((self._replan, job_from_request(request)))
        if self._child is None:
            self._spawn()
        elif self._child.poll() is not None:
            raise RuntimeError(
                f"the replan process exited with code {self._child.returncode}"
            )
        jobs = self._jobs
        assert jobs is not None
        self._running = True
        self._step = request.step
        # only waits on the pipe (no Python work), while the child starts
        self._writer = threading.Thread(
            target=jobs.send_bytes,
            args=(message,),
            name="rebalance-replan-writer",
            daemon=True,
        )
        self._writer.start()

    def ready(self) -> bool:
        """The result waits (polls the child without blocking)."""
        if self._result is not None:
            return True
        if not self._running:
            return False
        answers, child = self._answers, self._child
        assert answers is not None and child is not None
        if answers.poll(0):
            try:
                step, data, error, seconds = answers.recv()
                plan = None if data is None else plan_from_data(data)
            except (EOFError, OSError) as e:
                step, plan, error, seconds = self._step, None, _error_text(e), 0.0
            self._result = ReplanResult(step, plan, error, seconds)
            self._running = False
        elif child.poll() is not None:
            self._result = ReplanResult(
                self._step,
                None,
                f"the replan process exited with code {child.returncode}",
                0.0,
            )
            self._running = False
        return self._result is not None

    def take(self) -> Optional[ReplanResult]:
        """The finished replan's result (None if none), freeing the slot."""
        self.ready()
        result, self._result = self._result, None
        return result

    def close(self) -> None:
        """Ends the child: at once if it plans, else on end of file."""
        if self._finalizer is None or not self._finalizer.alive:
            return
        child = self._child
        assert child is not None
        if self._running and child.poll() is None:
            child.kill()
        self._finalizer()
        if self._answers is not None:
            self._answers.close()
        self._running = False

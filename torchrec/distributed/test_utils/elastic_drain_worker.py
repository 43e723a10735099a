#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Draining a host of a running job, across two torchrun nodes.

The scenario of ``test_elastic_two_nodes.py`` (``examples/drain_node_demo.py``,
``scripts/drain_demo.sh``, tells the same story with the public API only):

- :func:`launch_two_nodes` starts two torchrun agents on this machine as two
  nodes (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on the loopback
  address): TorchRec sees 2 hosts x 2 local ranks. Node 0's agent hosts the
  rendezvous store (``is_host=true``) and gets group rank 0 (its node address
  sorts first), so the job's store lives on the node that keeps running.
- :func:`run_worker` is one worker (a rank) of that job, on gloo:

  1. a ``DistributedModelParallel`` model (an ``EmbeddingBagCollection`` with
     data-parallel, table-wise, table-row-wise, grid, column-wise and
     row-wise tables, and a dense layer) on the 4 ranks trains a few steps
     under plan A, whose table-row-wise and grid tables span the hosts;
  2. ``model.reshard(plan B)`` moves table-row-wise and grid tables between
     the hosts (and changes a column-wise table to table-row-wise); the
     model must equal, bit for bit, one sharded directly with plan B from the
     global state gathered before the reshard, and train the same steps;
  3. host 1 is drained: ``move_model`` moves the model onto ranks [0, 1]
     (host 0) under plan C; ranks 2 and 3 hand their shards over, find
     their model released, and exit with code 0 (first, a drain onto host
     0's group without its node groups, which its table-row-wise and grid
     tables need, is refused on every rank and loses nothing);
  4. host 0 trains on, on its own group only (no collective of the world
     after the drain: the world's other ranks are gone), exactly like a
     model built directly on [0, 1] with plan C from the state gathered
     before the drain; then it reshards within host 0 (plan D), exactly too,
     and shuts down cleanly.

Every rank writes ``rank<r>.json`` into the result directory: its host, what
it checked, whether it left, and ``status`` ("ok", or "failed" with the
traceback). A worker that outlives its deadline exits with code 3, so that a
job can never hang.

Run as a worker under torchrun::

    python -m torchrec.distributed.test_utils.elastic_drain_worker --result-dir DIR
"""

import argparse
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, IO, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d
from torchrec.distributed.comm import new_intra_and_cross_node_pgs
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.resharding import ReshardError
from torchrec.distributed.resharding.elastic import move_model
from torchrec.distributed.test_utils.reshard_model_utils import (
    kernel_refs,
    load_model_state,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_dense_optimizer_states_equal,
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    global_optimizer_state,
    global_weights,
    make_plan,
    make_sharder,
    TableSpec,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

WORKER_MODULE = "torchrec.distributed.test_utils.elastic_drain_worker"
NODES = 2
LOCAL_SIZE = 2
WORLD = NODES * LOCAL_SIZE
HOST0: List[int] = [0, 1]  # the ranks that stay
HOST1: List[int] = [2, 3]  # the ranks of the drained host
# The node addresses torchrun's rendezvous sorts its nodes by: node 0's first.
NODE_ADDRESSES: Tuple[str, str] = ("127.0.0.1", "127.0.0.2")
AGENT_ENV = "ELASTIC_DRAIN_AGENT"  # which agent started a worker (0 or 1)
START_ENV = "ELASTIC_DRAIN_START"  # the launch's time.time(), for the printed clock
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
BATCH_SIZE = 3
STEPS = 3  # training steps in each phase
WARM_UP_STEP = 10_000  # batches of the references' warm-up

TABLES: List[EmbeddingBagConfig] = [
    EmbeddingBagConfig(
        name=f"t{i}",
        # the grid table has two column blocks of TorchRec's minimum 128
        embedding_dim=256 if i == 3 else (16 if i in (4, 5) else 8),
        num_embeddings=17 + 3 * i,
        feature_names=[f"f{i}"],
    )
    for i in range(6)
]

# (group size, table -> sharding); hosts and ranks are group-local.
PLANS: Dict[str, Tuple[int, Dict[str, TableSpec]]] = {
    # 2 hosts: table-row-wise on host 1, grid over both hosts
    "A": (
        WORLD,
        {
            "t0": ("data_parallel", None),
            "t1": ("table_wise", 3),
            "t2": ("table_row_wise", 1),
            "t3": ("grid_shard", [0, 1]),
            "t4": ("column_wise", [2, 1]),
            "t5": ("row_wise", None),
        },
    ),
    # within the 4 ranks: tables cross the hosts; t5 stays put
    "B": (
        WORLD,
        {
            "t0": ("data_parallel", None),
            "t1": ("table_wise", 0),
            "t2": ("table_row_wise", 0),
            "t3": ("grid_shard", [1, 0]),
            "t4": ("table_row_wise", 1),
            "t5": ("row_wise", None),
        },
    ),
    # host 0 only (ranks [0, 1]: one host of 2 ranks)
    "C": (
        len(HOST0),
        {
            "t0": ("data_parallel", None),
            "t1": ("table_wise", 1),
            "t2": ("table_row_wise", 0),
            "t3": ("grid_shard", [0, 0]),
            "t4": ("column_wise", [1, 0]),
            "t5": ("row_wise", None),
        },
    ),
    # within host 0 after the drain
    "D": (
        len(HOST0),
        {
            "t0": ("data_parallel", None),
            "t1": ("table_wise", 0),
            "t2": ("row_wise", None),
            "t3": ("column_wise", [0, 1]),
            "t4": ("table_row_wise", 0),
            "t5": ("table_wise", 1),
        },
    ),
}


# ------------------------------------------------------------------- model


class DrainModel(nn.Module):
    """An EmbeddingBagCollection and a linear layer over its pooled outputs."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(tables=TABLES, device=device)
        self.dense = nn.Linear(sum(t.embedding_dim for t in TABLES), 1, device=device)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(features).to_dict()  # by key: kernels order keys
        return self.dense(torch.cat([pooled[k] for k in sorted(pooled)], dim=1))


def definition(device: str = "meta") -> DrainModel:
    """The model: its initial weights on "cpu", only its shape on "meta"."""
    torch.manual_seed(0)
    return DrainModel(torch.device(device))


def plan(name: str) -> ShardingPlan:
    """Plan ``name`` of :data:`PLANS` (fused row-wise Adagrad kernels)."""
    size, specs = PLANS[name]
    sparse = make_plan(
        definition("cpu").sparse, specs, size, min(size, LOCAL_SIZE), "fused"
    )
    return ShardingPlan({"sparse": sparse})


def describe(name: str) -> str:
    """Plan ``name`` in a line."""
    short = {
        "data_parallel": "DP",
        "table_wise": "TW rank",
        "table_row_wise": "TWRW host",
        "grid_shard": "grid hosts",
        "column_wise": "CW ranks",
        "row_wise": "RW",
    }
    size, specs = PLANS[name]
    parts = []
    for table, (kind, arg) in specs.items():
        parts.append(f"{table} {short[kind]}{'' if arg is None else f' {arg}'}")
    return f"{name} ({size} ranks): " + ", ".join(parts)


def sharders() -> List[Any]:
    return [make_sharder("rowwise_adagrad")]


def make_optimizer(model: nn.Module) -> KeyedOptimizerWrapper:
    """SGD with momentum for what the fused kernels do not train."""
    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    )


def batch(step: int, index: int) -> Tuple[KeyedJaggedTensor, torch.Tensor]:
    """The batch of a group's ``index``-th rank at ``step``, and its targets."""
    gen = torch.Generator().manual_seed(1000 * step + index)
    lengths = torch.randint(0, 4, (len(TABLES), BATCH_SIZE), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, t.num_embeddings, (int(lengths[i].sum()),), generator=gen)
            for i, t in enumerate(TABLES)
        ]
    )
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(TABLES))],
        values=values,
        lengths=lengths.flatten(),
    )
    return features, torch.randn(BATCH_SIZE, 1, generator=gen)


def train_step(model: nn.Module, optimizer: Any, step: int, index: int) -> torch.Tensor:
    """One step (the fused tables step inside backward); returns the loss."""
    features, targets = batch(step, index)
    optimizer.zero_grad()
    loss = ((model(features) - targets) ** 2).mean()
    loss.backward()
    optimizer.step()
    return loss.detach()


# A model's whole state: weights, fused optimizer state, dense optimizer state.
GlobalState = Tuple[
    Dict[str, torch.Tensor], Dict[Tuple[str, str], torch.Tensor], Dict[str, Any]
]


def global_state(
    model: nn.Module, optimizer: Any, pg: dist.ProcessGroup
) -> GlobalState:
    """Gathered over ``pg`` with plain collectives (not the resharding code)."""
    weights = global_weights(model, pg)
    fused = global_optimizer_state(model, pg)
    return weights, fused, optimizer.state_dict()


def assert_global_states_equal(a: GlobalState, b: GlobalState) -> None:
    """Two gathered states are equal, bit for bit."""
    for x, y in zip(a[:2], b[:2]):
        assert sorted(x) == sorted(y), (sorted(x), sorted(y))
        for key, value in x.items():
            assert value.dtype == y[key].dtype and torch.equal(value, y[key]), key
    assert_state_dicts_equal(a[2]["state"], b[2]["state"])


def _warm_up(model: nn.Module, index: int) -> None:
    """
    Two forward/backward passes on other batches, so that the model's DDP
    rebuilds its gradient buckets as a DDP that has trained did: DDP lays a
    bucket out in parameter order at first and in the order the gradients
    became ready from its second or third iteration on, and on more than two
    ranks gloo's all-reduce sums an element in an order that depends on its
    position in the bucket (a last-bit difference). The state is loaded
    afterwards: the passes leave nothing behind.
    """
    for i in range(2):
        features, targets = batch(WARM_UP_STEP + i, index)
        ((model(features) - targets) ** 2).mean().backward()
    for p in model.parameters():
        p.grad = None


def reference(
    env: ShardingEnv, plan_name: str, state: GlobalState, warm_up: bool
) -> Tuple[nn.Module, Any]:
    """
    A model sharded directly with a plan on ``env``, loaded with ``state``;
    its DDP warmed up (see :func:`_warm_up`) to compare with a model whose DDP
    has trained, or fresh to compare with a model just built.
    """
    model = DistributedModelParallel(
        definition(),
        env=env,
        device=torch.device("cpu"),
        plan=plan(plan_name),
        sharders=sharders(),
    )
    if warm_up:
        _warm_up(model, dist.get_rank(env.process_group))
    return load_model_state(model, state, make_optimizer)


def assert_same_state(
    model: nn.Module, optimizer: Any, ref: nn.Module, ref_optimizer: Any
) -> None:
    """Weights, fused and dense optimizer state equal, bit for bit."""
    assert_state_dicts_equal(ref.state_dict(), model.state_dict())
    assert_optimizer_states_equal(ref, model)
    assert_dense_optimizer_states_equal(optimizer, ref_optimizer)


def assert_trains_like(
    model: nn.Module,
    optimizer: Any,
    ref: nn.Module,
    ref_optimizer: Any,
    steps: Sequence[int],
    index: int,
    say: Callable[[str], None],
) -> List[float]:
    """The same losses at every step, the same state afterwards."""
    losses = []
    for step in steps:
        loss = train_step(model, optimizer, step, index)
        expected = train_step(ref, ref_optimizer, step, index)
        assert torch.equal(loss, expected), (step, loss, expected)
        losses.append(loss.item())
        say(f"  step {step}: loss {loss.item():.6f} (reference {expected.item():.6f})")
    assert_same_state(model, optimizer, ref, ref_optimizer)
    return losses


# ------------------------------------------------------------------ worker


class _Printer:
    """Prints a rank's lines with its host and rank, seconds since the launch."""

    def __init__(self, node: int, rank: int) -> None:
        self._prefix = f"[host {node} rank {rank}]"
        self._start = float(os.environ.get(START_ENV, time.time()))

    def __call__(self, message: str) -> None:
        elapsed = time.time() - self._start
        print(f"{elapsed:6.2f}s {self._prefix} {message}", flush=True)


def _quiet() -> None:
    """Deprecation chatter of torch / torchrec / fbgemm, not about the job."""
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    for noisy in ("torchrec", "fbgemm_gpu", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _scenario(rank: int, node: int, result: Dict[str, Any]) -> None:
    """One rank's part of the scenario (see the module docstring)."""
    printer = _Printer(node, rank)

    def say(message: str) -> None:  # rank 0 speaks for the job
        if rank == 0:
            printer(message)

    checks: List[str] = result["checks"]
    cpu = torch.device("cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    assert dist.get_world_size() == WORLD, dist.get_world_size()
    assert int(os.environ["LOCAL_WORLD_SIZE"]) == LOCAL_SIZE
    # TorchRec's hosts are blocks of LOCAL_WORLD_SIZE ranks: the torchrun nodes
    assert node == rank // LOCAL_SIZE, (node, rank)
    say(
        f"world: {WORLD} gloo ranks on {NODES} torchrun nodes x {LOCAL_SIZE} "
        f"(host 0: ranks {HOST0}, host 1: ranks {HOST1})"
    )

    # every rank creates every group up front, in the same order
    world = c10d._get_default_group()
    host0_pg = dist.new_group(HOST0, timeout=COLLECTIVE_TIMEOUT)
    host0_node_pgs = new_intra_and_cross_node_pgs(HOST0, timeout=COLLECTIVE_TIMEOUT)
    world_env = ShardingEnv.from_process_group(world)
    host0_env = (
        ShardingEnv.from_process_group(host0_pg, node_pgs=host0_node_pgs)
        if rank in HOST0
        else None
    )
    store = c10d._get_default_store()
    left_key = f"elastic_drain/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/left"

    # 1. train on both hosts
    say(f"phase 1: train {STEPS} steps on both hosts under plan {describe('A')}")
    model = DistributedModelParallel(
        definition(), env=world_env, device=cpu, plan=plan("A"), sharders=sharders()
    )
    model.load_state_dict(definition("cpu").state_dict())
    optimizer = make_optimizer(model)
    step = 0
    for _ in range(STEPS):
        loss = train_step(model, optimizer, step, rank)
        say(f"  step {step}: loss {loss.item():.6f}")
        step += 1

    # 2. reshard within the world: tables cross the hosts
    say(f"phase 2: reshard live to plan {describe('B')}")
    state = global_state(model, optimizer, world)
    report = model.reshard(plan("B"))
    say(
        f"  moved {report.tables_moved.get('sparse', [])}: rank 0 sent "
        f"{report.bytes_sent} B, received {report.bytes_received} B in "
        f"{report.seconds:.3f} s"
    )
    ref, ref_optimizer = reference(world_env, "B", state, warm_up=True)
    assert_same_state(model, optimizer, ref, ref_optimizer)
    checks.append("reshard A->B on 2 hosts: state equals plan B sharded directly")
    say("  state equals a model sharded directly with plan B: weights, optimizer")
    assert_trains_like(
        model, optimizer, ref, ref_optimizer, range(step, step + 2), rank, say
    )
    checks.append("reshard A->B on 2 hosts: trains like plan B sharded directly")
    step += 2
    del ref, ref_optimizer

    # 3. drain host 1: the model moves onto host 0's ranks
    say(
        f"phase 3: drain host 1: move the model from ranks {HOST0 + HOST1} onto "
        f"{HOST0} under plan {describe('C')}"
    )
    state = global_state(model, optimizer, world)
    # a request TorchRec cannot build (table-row-wise and grid tables on host
    # 0's group without its node groups) is refused on every rank, nothing lost
    bare_env = ShardingEnv.from_process_group(host0_pg) if rank in HOST0 else None
    try:
        move_model(
            model,
            plan("C"),
            bare_env,
            participants=HOST0 + HOST1,
            optimizer=optimizer,
            make_optimizer=make_optimizer,
        )
    except ReshardError as e:
        assert "new_intra_and_cross_node_pgs" in str(e), e
    else:
        raise AssertionError("a move onto a group without node groups went through")
    unchanged = global_state(model, optimizer, world)  # the last world collective
    assert_global_states_equal(state, unchanged)
    checks.append("drain without node groups: refused on every rank, nothing lost")
    say("  (a drain onto host 0 without its node groups was refused, nothing lost)")
    refs = kernel_refs(model)
    gc.disable()  # the old model must be released at once, not by a collection
    try:
        moved = move_model(
            model,
            plan("C"),
            host0_env,
            participants=HOST0 + HOST1,
            optimizer=optimizer,
            make_optimizer=make_optimizer,
        )
        released = all(r() is None for r in refs)
    finally:
        gc.enable()
    assert refs and released, "the old model's kernels outlived the move"
    assert sum(p.numel() for p in model.parameters()) == 0, "the old model kept state"
    assert not model.fused_optimizer.state_dict()["state"], "fused state kept"
    del model, optimizer
    checks.append("drain: the old model was released")
    result["move"] = {
        "role": moved.report.role,
        "bytes_sent": moved.report.bytes_sent,
        "bytes_received": moved.report.bytes_received,
        "bytes_copied_locally": moved.report.bytes_copied_locally,
        "seconds": moved.report.seconds,
    }

    if rank in HOST1:
        assert moved.left and moved.model is None and moved.optimizer is None
        assert moved.report.role == "left", moved.report.role
        result["left"] = True
        printer(
            f"handed my shards to host 0 (sent {moved.report.bytes_sent} B in "
            f"{moved.report.seconds:.3f} s), model released; leaving with code 0"
        )
        store.set(f"{left_key}/{rank}", "1")
        dist.destroy_process_group()
        return

    # 4. host 0 trains on, on its own group only
    assert not moved.left and moved.report.role == "stayed", moved.report.role
    model, optimizer = moved.model, moved.optimizer
    assert model is not None and optimizer is not None
    assert dist.get_process_group_ranks(model._env.process_group) == HOST0
    store.wait([f"{left_key}/{r}" for r in HOST1], COLLECTIVE_TIMEOUT)
    result["host1_left_at"] = time.time()
    say(
        f"  host 1's ranks {HOST1} have left; rank 0 received "
        f"{moved.report.bytes_received} B, kept {moved.report.bytes_copied_locally} B "
        f"in {moved.report.seconds:.3f} s"
    )
    index = HOST0.index(rank)
    assert host0_env is not None
    # move_model built the model on host 0 afresh, DDP included
    ref, ref_optimizer = reference(host0_env, "C", state, warm_up=False)
    assert_same_state(model, optimizer, ref, ref_optimizer)
    checks.append("drain: state equals plan C built directly on host 0")
    say("  state equals a model built directly on host 0 with plan C")
    say(f"phase 4: host 0 trains on: {STEPS} steps on ranks {HOST0}")
    losses = assert_trains_like(
        model, optimizer, ref, ref_optimizer, range(step, step + STEPS), index, say
    )
    checks.append(f"drain: host 0 trains {STEPS} steps like plan C built directly")
    result["losses_after_drain"] = losses
    step += STEPS
    del ref, ref_optimizer

    say(f"  and reshards within host 0 to plan {describe('D')}")
    state = global_state(model, optimizer, host0_pg)
    report = model.reshard(plan("D"))
    say(
        f"  moved {report.tables_moved.get('sparse', [])}: rank 0 sent "
        f"{report.bytes_sent} B, received {report.bytes_received} B in "
        f"{report.seconds:.3f} s"
    )
    ref, ref_optimizer = reference(host0_env, "D", state, warm_up=True)
    assert_same_state(model, optimizer, ref, ref_optimizer)
    assert_trains_like(
        model, optimizer, ref, ref_optimizer, range(step, step + 2), index, say
    )
    checks.append("host 0 reshard C->D: trains like plan D built directly")
    say("  exact: state and training equal plan D built directly")
    result["exact_after_drain"] = True
    dist.destroy_process_group()


def _start_watchdog(deadline_s: float, rank: int) -> None:
    """Ends this worker with code 3 if it is still running at the deadline."""

    def expire() -> None:
        print(f"[rank {rank}] deadline of {deadline_s} s passed; exiting", flush=True)
        os._exit(3)

    timer = threading.Timer(deadline_s, expire)
    timer.daemon = True
    timer.start()


def run_worker(
    result_dir: str, deadline_s: float = 240.0, verbose: bool = False
) -> int:
    """
    One rank of the job, under torchrun (RANK, GROUP_RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE from the agent): runs the scenario and writes
    ``rank<r>.json`` into ``result_dir``.

    Returns:
        int: the exit code (0 when every check of this rank passed).
    """
    rank = int(os.environ["RANK"])
    node = int(os.environ["GROUP_RANK"])
    _start_watchdog(deadline_s, rank)
    if not verbose:
        _quiet()
    result: Dict[str, Any] = {
        "rank": rank,
        "node": node,
        "agent": os.environ.get(AGENT_ENV),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "pid": os.getpid(),
        "checks": [],
        "left": False,
        "status": "failed",
    }
    code = 0
    try:
        _scenario(rank, node, result)
        result["status"] = "ok"
    except BaseException:
        result["error"] = traceback.format_exc()
        print(f"[host {node} rank {rank}] FAILED\n{result['error']}", flush=True)
        code = 1
    result["exit_time"] = time.time()
    path = os.path.join(result_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    if code != 0:
        os._exit(code)  # peers may be stuck in a collective: no teardown
    return code


# ---------------------------------------------------------------- launcher


@dataclass
class AgentRun:
    """
    One torchrun agent of :func:`launch_two_nodes`.

    Args:
        node (int): 0 (hosts the store, keeps running) or 1 (drained).
        command (List[str]): its command line.
        returncode (Optional[int]): its exit code (None if it was stopped at
            the deadline).
        launched_at (float): when the job was launched (``time.time()``).
        seconds (Optional[float]): when it exited, in seconds since the
            launch.
    """

    node: int
    command: List[str]
    launched_at: float = 0.0
    returncode: Optional[int] = None
    seconds: Optional[float] = None


def free_port() -> int:
    """A TCP port free on the loopback address right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent_commands(
    entry: Sequence[str], port: int, run_id: str, python: str = sys.executable
) -> List[List[str]]:
    """
    The command lines of the two torchrun agents.

    Args:
        entry (Sequence[str]): what each worker runs (a script and its
            arguments, or "-m", a module and its arguments).
        port (int): the rendezvous port on 127.0.0.1.
        run_id (str): the rendezvous id (unique per job).
        python (str): the interpreter.

    Returns:
        List[List[str]]: node 0's command, node 1's command.
    """
    return [
        [
            python,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(NODES),
            "--nproc-per-node",
            str(LOCAL_SIZE),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            run_id,
            "--rdzv-conf",
            f"is_host={'true' if node == 0 else 'false'},join_timeout=120",
            "--local-addr",
            NODE_ADDRESSES[node],
            "--max-restarts",
            "0",
            "--monitor-interval",
            "0.2",
            *entry,
        ]
        for node in range(NODES)
    ]


def _stop(process: "subprocess.Popen[bytes]") -> None:
    """SIGTERM (the agent then stops its workers), SIGKILL if that hangs."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def launch_two_nodes(
    entry: Sequence[str],
    timeout_s: float,
    outputs: Sequence[Optional[IO[Any]]] = (None, None),
    cwd: Optional[str] = None,
    on_start: Optional[Callable[[AgentRun], None]] = None,
    env: Optional[Mapping[str, str]] = None,
) -> List[AgentRun]:
    """
    Runs a job of two torchrun agents on this machine as two nodes of 2
    ranks each, on the loopback address, and waits for both.

    Args:
        entry (Sequence[str]): what each worker runs.
        timeout_s (float): the whole job's deadline; agents still running then
            are stopped (SIGTERM, which stops their workers; then SIGKILL).
        outputs (Sequence[Optional[IO[Any]]]): where each agent's (and its
            workers') output goes (None: this process's stdout).
        cwd (Optional[str]): the agents' working directory.
        on_start (Optional[Callable[[AgentRun], None]]): called with each agent
            as it starts.
        env (Optional[Mapping[str, str]]): more environment for the agents and
            their workers.

    Returns:
        List[AgentRun]: node 0's and node 1's agent, with their exit codes
        (None for an agent stopped at the deadline).
    """
    port = free_port()
    run_id = f"elastic-drain-{uuid.uuid4().hex[:12]}"
    start = time.time()
    commands = agent_commands(entry, port, run_id)
    runs = [AgentRun(n, c, start) for n, c in enumerate(commands)]
    processes: List["subprocess.Popen[bytes]"] = []
    deadline = time.monotonic() + timeout_s
    try:
        for run, output in zip(runs, outputs):
            agent_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
            agent_env.update({AGENT_ENV: str(run.node), START_ENV: repr(start)})
            if on_start is not None:
                on_start(run)
            processes.append(
                subprocess.Popen(
                    run.command,
                    env=agent_env,
                    cwd=cwd,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        while time.monotonic() < deadline:
            for run, process in zip(runs, processes):
                if run.seconds is None and process.poll() is not None:
                    run.returncode = process.returncode
                    run.seconds = time.time() - start
            if all(run.seconds is not None for run in runs):
                break
            time.sleep(0.1)
    finally:
        for process in processes:
            _stop(process)
    return runs


def read_results(result_dir: str) -> Dict[int, Dict[str, Any]]:
    """The ``rank<r>.json`` files of a job, by rank."""
    out: Dict[int, Dict[str, Any]] = {}
    for rank in range(WORLD):
        path = os.path.join(result_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                out[rank] = json.load(f)
    return out


def job_failures(
    runs: Sequence[AgentRun], results: Mapping[int, Mapping[str, Any]]
) -> List[str]:
    """
    What went wrong in a drain job (empty when it did everything): both
    agents exit 0, every rank reports ok on its own host, host 1's ranks
    left, host 0's ranks passed the checks after the drain.
    """
    failures = []
    for run in runs:
        if run.returncode is None:
            failures.append(f"node {run.node}'s agent was stopped at the deadline")
        elif run.returncode != 0:
            failures.append(f"node {run.node}'s agent exited with {run.returncode}")
    for rank in range(WORLD):
        result = results.get(rank)
        if result is None:
            failures.append(f"rank {rank} wrote no result")
            continue
        if result["status"] != "ok":
            failures.append(f"rank {rank} failed:\n{result.get('error')}")
            continue
        node = rank // LOCAL_SIZE
        if result["node"] != node or result["agent"] != str(node):
            failures.append(
                f"rank {rank} ran on node {result['node']} (agent "
                f"{result['agent']}), expected {node}"
            )
        if rank in HOST1:
            if not result["left"] or "drain: the old model was released" not in (
                result["checks"]
            ):
                failures.append(f"rank {rank} of host 1 did not leave cleanly")
        elif not result.get("exact_after_drain"):
            failures.append(f"rank {rank} of host 0 did not check training on")
    return failures


def main(argv: Optional[Sequence[str]] = None) -> int:
    """A worker's entry point (under torchrun)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--result-dir", required=True)
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=240.0,
        help="a worker still running then exits with code 3",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show torch's and torchrec's warnings"
    )
    args = parser.parse_args(argv)
    return run_worker(args.result_dir, args.deadline_s, args.verbose)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Draining a host of a running TorchRec job: two torchrun nodes on this machine.

Starts two torchrun agents on the loopback address as two nodes of 2 ranks
(``--nnodes 2 --nproc-per-node 2``, c10d rendezvous; node 0 hosts the store),
each running this script as its workers (gloo on CPU), and prints what
happens:

1. the model trains on both hosts (table-row-wise and grid tables spanning
   them);
2. it reshards live within the 4 ranks, tables crossing the hosts, and is
   checked against a model sharded directly with the new plan;
3. host 1 is drained: ``move_model`` moves the model onto host 0's ranks;
   host 1's ranks hand over their shards, release their model and exit 0;
4. host 0 trains on, on its own ranks, exactly like a model built directly
   there from the state before the drain, and reshards within host 0.

Everything the job does is written out below, on the public API (the repo's
test ``test_elastic_two_nodes`` runs the same story from its test
utilities). Run it with ``bash scripts/drain_demo.sh`` (which sets up
``.venv``) or ``python examples/drain_node_demo.py``.

Exit status: 0 when every rank passed its checks and both agents exited 0,
1 otherwise.
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
import tempfile
import threading
import time
import traceback
import uuid
import warnings
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed import distributed_c10d as c10d
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed import sharding_plan
from torchrec.distributed.comm import new_intra_and_cross_node_pgs
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.resharding import move_model, MovedModel, ReshardError
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

NODES, LOCAL_SIZE = 2, 2
WORLD = NODES * LOCAL_SIZE
HOST0: List[int] = [0, 1]  # the ranks that stay
HOST1: List[int] = [2, 3]  # the ranks of the drained host
# torchrun's rendezvous numbers the nodes in the order of their addresses
ADDRESSES: Tuple[str, str] = ("127.0.0.1", "127.0.0.2")
NODE_ENV, START_ENV = "DRAIN_DEMO_NODE", "DRAIN_DEMO_START"
TIMEOUT = timedelta(seconds=120)  # of every collective
BATCH_SIZE, STEPS = 3, 3  # samples per rank and step; steps per phase
WARM_UP_STEP = 10_000  # the references' warm-up batches

# t3 is a grid table: two column blocks of TorchRec's minimum 128 columns.
TABLES: List[EmbeddingBagConfig] = [
    EmbeddingBagConfig(
        name=f"t{i}",
        embedding_dim={3: 256, 4: 16, 5: 16}.get(i, 8),
        num_embeddings=17 + 3 * i,
        feature_names=[f"f{i}"],
    )
    for i in range(6)
]
# A kind of sharding: how a plan's line says it, and TorchRec's generator of
# its placement; both get the kind's numbers in a plan (a rank, a host, the
# hosts of a grid's column blocks, the ranks of column shards).
KINDS: Dict[str, Tuple[Callable[[List[int]], str], Callable[[List[int]], Any]]] = {
    "DP": (lambda _: "DP", lambda _: sharding_plan.data_parallel()),
    "TW": (lambda n: f"TW rank {n[0]}", lambda n: sharding_plan.table_wise(rank=n[0])),
    "TWRW": (
        lambda n: f"TWRW host {n[0]}",
        lambda n: sharding_plan.table_row_wise(host_index=n[0]),
    ),
    "GRID": (
        lambda n: f"grid hosts {n}",
        lambda n: sharding_plan.grid_shard(host_indexes=n),
    ),
    "CW": (lambda n: f"CW ranks {n}", lambda n: sharding_plan.column_wise(ranks=n)),
    "RW": (lambda _: "RW", lambda _: sharding_plan.row_wise()),
}
# Each plan's ranks, and the sharding of t0, ..., t5 ("KIND numbers"); hosts
# and ranks count in the plan's own group (C and D: host 0's ranks [0, 1]).
PLANS: Dict[str, Tuple[int, str]] = {
    # 2 hosts: table-row-wise on host 1, grid over both hosts
    "A": (4, "DP, TW 3, TWRW 1, GRID 0 1, CW 2 1, RW"),
    # within the 4 ranks: tables cross the hosts; t5 stays put
    "B": (4, "DP, TW 0, TWRW 0, GRID 1 0, TWRW 1, RW"),
    # host 0 only
    "C": (2, "DP, TW 1, TWRW 0, GRID 0 0, CW 1 0, RW"),
    # within host 0 after the drain
    "D": (2, "DP, TW 0, RW, CW 0 1, TWRW 0, TW 1"),
}


def shardings(name: str) -> List[Tuple[str, List[int]]]:
    """Plan ``name``'s (kind, numbers) of every table, in table order."""
    entries = [entry.split() for entry in PLANS[name][1].split(", ")]
    return [(kind, [int(n) for n in numbers]) for kind, *numbers in entries]


# ------------------------------------------------------------------- model


class DrainModel(nn.Module):
    """The tables, and a linear layer over their pooled outputs."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(tables=TABLES, device=device)
        self.dense = nn.Linear(sum(t.embedding_dim for t in TABLES), 1, device=device)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(features).to_dict()  # the kernels order the keys
        return self.dense(torch.cat([pooled[k] for k in sorted(pooled)], dim=1))


def definition(device: str = "meta") -> DrainModel:
    """The model: its initial weights on "cpu" (seed 0), its shape on "meta"."""
    torch.manual_seed(0)
    return DrainModel(torch.device(device))


def plan(name: str) -> ShardingPlan:
    """Plan ``name`` of ``PLANS``: fused kernels but for data-parallel tables."""
    size = PLANS[name][0]
    sparse = sharding_plan.construct_module_sharding_plan(
        definition().sparse,
        {
            table.name: KINDS[kind][1](numbers)
            for table, (kind, numbers) in zip(TABLES, shardings(name))
        },
        local_size=min(size, LOCAL_SIZE),
        world_size=size,
        device_type="cpu",
    )
    for sharding in sparse.values():
        if sharding.sharding_type != "data_parallel":
            sharding.compute_kernel = "fused"
    return ShardingPlan({"sparse": sparse})


def describe(name: str) -> str:
    """Plan ``name`` in a line."""
    tables = [
        f"{table.name} {KINDS[kind][0](numbers)}"
        for table, (kind, numbers) in zip(TABLES, shardings(name))
    ]
    return f"{name} ({PLANS[name][0]} ranks): " + ", ".join(tables)


def sharders() -> List[Any]:
    """The tables' sharder: fused row-wise Adagrad."""
    fused = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": 0.05,
        "eps": 0.01,
    }
    return [EmbeddingBagCollectionSharder(fused_params=fused)]


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
    values = [
        torch.randint(0, t.num_embeddings, (int(n),), generator=gen)
        for t, n in zip(TABLES, lengths.sum(dim=1))
    ]
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=[t.feature_names[0] for t in TABLES],
        values=torch.cat(values),
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


# ------------------------------------------------------------------- state

# A model's state: by name, the full table (float64) of every sharded weight
# and fused optimizer state, the rest of its state dict as it is, and the
# dense optimizer's state dict.
State = Tuple[Dict[str, torch.Tensor], Dict[str, Any]]


def local_pieces(model: nn.Module) -> List[Tuple[str, Any, torch.Tensor]]:
    """
    This rank's pieces of the sharded tables: (name, its ShardedTensor's
    shard metadata, tensor) for every weight (named by its key) and fused
    optimizer state (named "key/state"). A row-wise state holds one value
    per row of its weight's shard.

    Args:
        model (nn.Module): the sharded model.

    Returns:
        List[Tuple[str, Any, torch.Tensor]]: the pieces.
    """
    pieces = []
    weights = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            weights[key] = value
            pieces += [(key, s.metadata, s.tensor) for s in value.local_shards()]
    fused = model.fused_optimizer
    for key, states in fused.state_dict()["state"].items():
        weight = fused.params.get(key)
        for state_name, value in states.items():
            if isinstance(value, ShardedTensor) and isinstance(weight, ShardedTensor):
                for w, s in zip(weight.local_shards(), value.local_shards()):
                    pieces.append((f"{key}/{state_name}", w.metadata, s.tensor))
    return pieces


def full_tables(model: nn.Module, pg: dist.ProcessGroup) -> Dict[str, torch.Tensor]:
    """
    The full tables of ``local_pieces``, assembled over ``pg`` with plain
    collectives (not the resharding code): each rank writes its pieces into
    zeros, a sum assembles them. A row-wise state is spread over its shard's
    columns.
    """
    sizes = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            sizes[key] = tuple(value.size())
    for key, states in model.fused_optimizer.state_dict()["state"].items():
        for state_name, value in states.items():
            if isinstance(value, ShardedTensor) and key in sizes:
                sizes[f"{key}/{state_name}"] = sizes[key]
    everyone: List[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, sizes, group=pg)
    tables = {
        name: torch.zeros(size, dtype=torch.float64)
        for rank_sizes in everyone
        for name, size in rank_sizes.items()
    }
    for name, meta, tensor in local_pieces(model):
        (row, col), (rows, cols) = meta.shard_offsets, meta.shard_sizes
        tables[name][row : row + rows, col : col + cols] = tensor.reshape(rows, -1)
    for name in sorted(tables):
        dist.all_reduce(tables[name], group=pg)
    return tables


def gather(model: nn.Module, optimizer: Any, pg: dist.ProcessGroup) -> State:
    """The model's whole state over ``pg`` (see ``State``)."""
    tables = full_tables(model, pg)
    for key, value in model.state_dict().items():
        if not isinstance(value, ShardedTensor):
            tables[key] = value.detach().clone()
    return tables, optimizer.state_dict()


def reference(
    env: ShardingEnv, plan_name: str, state: State, warm_up: bool
) -> Tuple[nn.Module, Any]:
    """
    A model sharded directly with a plan on ``env``, loaded with ``state``.
    With ``warm_up``, two passes on other batches first: DDP lays its
    gradient buckets out anew after its first iterations, and on more than
    two ranks gloo's sum of an element depends on its place in the bucket, so
    a reference compared with a model that has trained must have done so too
    (the passes leave nothing behind: the state is loaded after them).
    """
    model = DistributedModelParallel(
        definition(),
        env=env,
        device=torch.device("cpu"),
        plan=plan(plan_name),
        sharders=sharders(),
    )
    if warm_up:
        for i in range(2):
            features, targets = batch(
                WARM_UP_STEP + i, dist.get_rank(env.process_group)
            )
            ((model(features) - targets) ** 2).mean().backward()
        for p in model.parameters():
            p.grad = None
    tables, dense_state = state
    model.load_state_dict(
        {
            key: (
                tables[key].to(value.dtype)
                if isinstance(value, ShardedTensor)
                else tables[key]
            )
            for key, value in model.state_dict().items()
        }
    )
    with torch.no_grad():
        for name, meta, tensor in local_pieces(model):
            if "/" in name:
                (row, col), (rows, cols) = meta.shard_offsets, meta.shard_sizes
                full = tables[name][row : row + rows, col : col + cols]
                full = full.mean(dim=1) if tensor.numel() == rows else full
                tensor.copy_(full.reshape(tensor.shape))
    optimizer = make_optimizer(model)
    optimizer.init_state()
    optimizer.load_state_dict(dense_state)
    return model, optimizer


def assert_same_state(a: State, b: State) -> None:
    """Two gathered states are equal, bit for bit."""
    assert sorted(a[0]) == sorted(b[0]), (sorted(a[0]), sorted(b[0]))
    for name, table in a[0].items():
        assert table.dtype == b[0][name].dtype, name
        assert torch.equal(table, b[0][name]), name
    x, y = a[1]["state"], b[1]["state"]
    assert sorted(x) == sorted(y), (sorted(x), sorted(y))
    for name, values in x.items():
        for key, tensor in values.items():
            assert torch.equal(tensor, y[name][key]), (name, key)


def trains_like(
    model: nn.Module,
    optimizer: Any,
    ref: Tuple[nn.Module, Any],
    steps: Sequence[int],
    index: int,
    say: Callable[[str], None],
) -> List[float]:
    """The model and the reference lose the same at every step; the losses."""
    losses = []
    for step in steps:
        loss = train_step(model, optimizer, step, index)
        expected = train_step(*ref, step, index)
        assert torch.equal(loss, expected), (step, loss, expected)
        losses.append(loss.item())
        say(f"  step {step}: loss {loss.item():.6f} (reference {expected.item():.6f})")
    return losses


def reshard_checked(
    model: nn.Module,
    optimizer: Any,
    name: str,
    env: ShardingEnv,
    steps: Sequence[int],
    say: Callable[[str], None],
    equal_line: str = "",
) -> None:
    """
    Reshards ``model`` live to plan ``name`` on ``env``'s group and checks it
    against a reference sharded directly with that plan from the state
    gathered right before: the same state after the reshard (then
    ``equal_line`` is said, if any), the same losses at ``steps``, the same
    state after them.
    """
    pg = env.process_group
    state = gather(model, optimizer, pg)
    report = model.reshard(plan(name))
    say(
        f"  moved {report.tables_moved.get('sparse', [])}: rank 0 sent "
        f"{report.bytes_sent} B, received {report.bytes_received} B in "
        f"{report.seconds:.3f} s"
    )
    ref = reference(env, name, state, warm_up=True)
    assert_same_state(gather(model, optimizer, pg), gather(*ref, pg))
    if equal_line:
        say(equal_line)
    trains_like(model, optimizer, ref, steps, dist.get_rank(pg), say)
    assert_same_state(gather(model, optimizer, pg), gather(*ref, pg))


# ------------------------------------------------------------------ worker


def scenario(rank: int, node: int, result: Dict[str, Any]) -> None:
    """One rank's part of the job (see the module docstring)."""
    start = float(os.environ.get(START_ENV, time.time()))

    def tell(message: str) -> None:  # this rank's line, seconds since launch
        when = time.time() - start
        print(f"{when:6.2f}s [host {node} rank {rank}] {message}", flush=True)

    def say(message: str) -> None:  # rank 0 speaks for the job
        if rank == 0:
            tell(message)

    checks: List[str] = result["checks"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=TIMEOUT)
    assert dist.get_world_size() == WORLD, dist.get_world_size()
    # TorchRec's hosts are blocks of LOCAL_WORLD_SIZE ranks: the torchrun nodes
    assert node == rank // LOCAL_SIZE, (node, rank)
    say(
        f"world: {WORLD} gloo ranks on {NODES} torchrun nodes x {LOCAL_SIZE} "
        f"(host 0: ranks {HOST0}, host 1: ranks {HOST1})"
    )
    # every rank creates every group up front, in the same order
    world = c10d._get_default_group()
    host0_pg = dist.new_group(HOST0, timeout=TIMEOUT)
    host0_node_pgs = new_intra_and_cross_node_pgs(HOST0, timeout=TIMEOUT)
    world_env = ShardingEnv.from_process_group(world)
    host0_env = bare_env = None
    if rank in HOST0:
        host0_env = ShardingEnv.from_process_group(host0_pg, node_pgs=host0_node_pgs)
        bare_env = ShardingEnv.from_process_group(host0_pg)  # no node groups
    store = c10d._get_default_store()
    left_key = f"drain_demo/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/left"

    # 1. train on both hosts
    say(f"phase 1: train {STEPS} steps on both hosts under plan {describe('A')}")
    cpu = torch.device("cpu")
    model = DistributedModelParallel(
        definition(), env=world_env, device=cpu, plan=plan("A"), sharders=sharders()
    )
    model.load_state_dict(definition("cpu").state_dict())
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        say(
            f"  step {step}: loss {train_step(model, optimizer, step, rank).item():.6f}"
        )
    step = STEPS

    # 2. reshard within the world: tables cross the hosts
    say(f"phase 2: reshard live to plan {describe('B')}")
    equal = "  state equals a model sharded directly with plan B: weights, optimizer"
    reshard_checked(model, optimizer, "B", world_env, range(step, step + 2), say, equal)
    checks.append("reshard A->B on 2 hosts: state equals plan B sharded directly")
    checks.append("reshard A->B on 2 hosts: trains like plan B sharded directly")
    step += 2

    # 3. drain host 1: the model moves onto host 0's ranks
    say(
        f"phase 3: drain host 1: move the model from ranks {HOST0 + HOST1} onto "
        f"{HOST0} under plan {describe('C')}"
    )
    state = gather(model, optimizer, world)

    def drain_onto(env: Optional[ShardingEnv]) -> MovedModel:
        """Moves the model onto host 0 (``env`` there, None on host 1)."""
        return move_model(
            model,
            plan("C"),
            env,
            HOST0 + HOST1,  # every rank takes part: the ones that leave too
            optimizer=optimizer,
            make_optimizer=make_optimizer,
        )

    # TorchRec cannot build table-row-wise and grid tables on a group without
    # its node groups: the move is refused on every rank, nothing lost
    try:
        drain_onto(bare_env)
    except ReshardError as e:
        assert "new_intra_and_cross_node_pgs" in str(e), e
    else:
        raise AssertionError("a move onto a group without node groups went through")
    assert_same_state(state, gather(model, optimizer, world))  # the world's last
    checks.append("drain without node groups: refused on every rank, nothing lost")
    say("  (a drain onto host 0 without its node groups was refused, nothing lost)")
    kernels = [  # the batched kernels of the sharded modules' lookups
        weakref.ref(kernel.emb_module)
        for module in model.modules()
        for lookup in getattr(module, "_lookups", [])  # a list, not submodules
        for kernel in lookup.modules()
        if hasattr(kernel, "emb_module")
    ]
    gc.disable()  # the old model must be released at once, not by a collection
    try:
        moved = drain_onto(host0_env)
        released = all(k() is None for k in kernels)
    finally:
        gc.enable()
    assert kernels and released, "the old model's kernels outlived the move"
    assert sum(p.numel() for p in model.parameters()) == 0, "the old model kept state"
    assert not model.fused_optimizer.state_dict()["state"], "fused state kept"
    del model, optimizer
    checks.append("drain: the old model was released")
    report = moved.report
    result["move"] = {
        field: getattr(report, field)
        for field in (
            "role",
            "seconds",
            "bytes_sent",
            "bytes_received",
            "bytes_copied_locally",
        )
    }
    if rank in HOST1:
        assert moved.left and moved.model is None and moved.optimizer is None
        assert report.role == "left", report.role
        result["left"] = True
        tell(
            f"handed my shards to host 0 (sent {report.bytes_sent} B in "
            f"{report.seconds:.3f} s), model released; leaving with code 0"
        )
        store.set(f"{left_key}/{rank}", "1")
        dist.destroy_process_group()
        return

    # 4. host 0 trains on, on its own group only (the world's others are gone)
    assert not moved.left and report.role == "stayed", report.role
    model, optimizer = moved.model, moved.optimizer
    assert model is not None and optimizer is not None and host0_env is not None
    assert dist.get_process_group_ranks(model._env.process_group) == HOST0
    store.wait([f"{left_key}/{r}" for r in HOST1], TIMEOUT)
    result["host1_left_at"] = time.time()
    say(
        f"  host 1's ranks {HOST1} have left; rank 0 received "
        f"{report.bytes_received} B, kept {report.bytes_copied_locally} B "
        f"in {report.seconds:.3f} s"
    )
    index = HOST0.index(rank)
    # move_model built the model on host 0 afresh, DDP included: no warm-up
    ref = reference(host0_env, "C", state, warm_up=False)
    assert_same_state(gather(model, optimizer, host0_pg), gather(*ref, host0_pg))
    checks.append("drain: state equals plan C built directly on host 0")
    say("  state equals a model built directly on host 0 with plan C")
    say(f"phase 4: host 0 trains on: {STEPS} steps on ranks {HOST0}")
    steps = range(step, step + STEPS)
    result["losses_after_drain"] = trains_like(model, optimizer, ref, steps, index, say)
    assert_same_state(gather(model, optimizer, host0_pg), gather(*ref, host0_pg))
    checks.append(f"drain: host 0 trains {STEPS} steps like plan C built directly")
    step += STEPS
    del ref

    say(f"  and reshards within host 0 to plan {describe('D')}")
    reshard_checked(model, optimizer, "D", host0_env, range(step, step + 2), say)
    checks.append("host 0 reshard C->D: trains like plan D built directly")
    say("  exact: state and training equal plan D built directly")
    result["exact_after_drain"] = True
    dist.destroy_process_group()


def run_worker(result_dir: str, deadline_s: float, verbose: bool) -> int:
    """
    One rank of the job, under torchrun: runs the scenario and writes
    ``rank<r>.json`` into ``result_dir`` (its host, its checks, whether it
    left, ``status`` "ok" or "failed" with the traceback). A worker still
    running at ``deadline_s`` exits with code 3: the job never hangs.

    Args:
        result_dir (str): where the ranks write their results.
        deadline_s (float): this worker's deadline, in seconds.
        verbose (bool): keep torch's and torchrec's warnings.

    Returns:
        int: the exit code (0 when every check of this rank passed).
    """
    rank, node = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
    timer = threading.Timer(deadline_s, lambda: os._exit(3))
    timer.daemon = True
    timer.start()
    if not verbose:  # deprecation chatter, not about the job
        warnings.simplefilter("ignore")
        for noisy in ("torchrec", "fbgemm_gpu", "torch"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
    result: Dict[str, Any] = {
        "rank": rank,
        "node": node,
        "agent": os.environ.get(NODE_ENV),
        "checks": [],
        "left": False,
        "status": "failed",
    }
    code = 0
    try:
        scenario(rank, node, result)
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
    if code:
        os._exit(code)  # peers may be stuck in a collective: no teardown
    return code


# ---------------------------------------------------------------- launcher


@dataclass
class Agent:
    """
    One torchrun agent: its node, command line, when the job was launched
    (``time.time()``), its process, exit code and when it exited (seconds
    since the launch; None while it runs or if it was stopped at the
    deadline).
    """

    node: int
    command: List[str]
    launched_at: float
    process: Optional["subprocess.Popen[bytes]"] = None
    returncode: Optional[int] = None
    seconds: Optional[float] = None


def launch(worker_args: List[str], timeout_s: float, verbose: bool) -> List[Agent]:
    """
    Starts the two torchrun agents (node 0 hosts the rendezvous store), says
    so, and waits for both; agents still running at ``timeout_s`` are stopped
    (SIGTERM stops their workers; SIGKILL if that hangs).

    Args:
        worker_args (List[str]): what each worker runs: this script and its
            arguments.
        timeout_s (float): the whole job's deadline.
        verbose (bool): keep C++ warnings too.

    Returns:
        List[Agent]: node 0's agent and node 1's.
    """
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind((ADDRESSES[0], 0))
        port = s.getsockname()[1]
    run_id = f"drain-demo-{uuid.uuid4().hex[:12]}"
    start = time.time()
    agents = []
    for node in range(NODES):
        command = [sys.executable, "-m", "torch.distributed.run"]
        command += ["--nnodes", str(NODES), "--nproc-per-node", str(LOCAL_SIZE)]
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        command += ["--rdzv-id", run_id, "--rdzv-conf"]
        command += [f"is_host={'true' if node == 0 else 'false'},join_timeout=120"]
        command += ["--local-addr", ADDRESSES[node], "--max-restarts", "0"]
        command += ["--monitor-interval", "0.2", *worker_args]
        agents.append(Agent(node, command, start))
    # without --verbose, no C++ warnings either (e.g. torchelastic's last
    # agent closing the rendezvous after the store's host has gone)
    env = dict(os.environ, OMP_NUM_THREADS="1", **{START_ENV: repr(start)})
    if not verbose:
        env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    deadline = time.monotonic() + timeout_s
    try:
        for agent in agents:
            role = "hosts the store, trains on" if agent.node == 0 else "is drained"
            print(f"[launcher] node {agent.node} ({role}): {' '.join(agent.command)}")
            sys.stdout.flush()
            agent.process = subprocess.Popen(
                agent.command,
                env=dict(env, **{NODE_ENV: str(agent.node)}),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        while time.monotonic() < deadline:
            for agent in agents:
                if agent.seconds is None and agent.process.poll() is not None:
                    agent.returncode = agent.process.returncode
                    agent.seconds = time.time() - start
            if all(agent.seconds is not None for agent in agents):
                break
            time.sleep(0.1)
    finally:
        for agent in agents:
            if agent.process is not None and agent.process.poll() is None:
                agent.process.send_signal(signal.SIGTERM)
                try:
                    agent.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    agent.process.kill()
                    agent.process.wait()
    return agents


def failures(agents: Sequence[Agent], results: Dict[int, Dict[str, Any]]) -> List[str]:
    """
    What went wrong (nothing when the job did everything): both agents exit
    0, every rank reports ok on its own host, host 1's ranks left, host 0's
    ranks checked training on after the drain.
    """
    found = []
    for agent in agents:
        if agent.returncode is None:
            found.append(f"node {agent.node}'s agent was stopped at the deadline")
        elif agent.returncode != 0:
            found.append(f"node {agent.node}'s agent exited with {agent.returncode}")
    for rank in range(WORLD):
        result = results.get(rank)
        if result is None:
            found.append(f"rank {rank} wrote no result")
        elif result["status"] != "ok":
            found.append(f"rank {rank} failed:\n{result.get('error')}")
        elif (result["node"], result["agent"]) != (
            rank // LOCAL_SIZE,
            str(rank // LOCAL_SIZE),
        ):
            found.append(f"rank {rank} ran on node {result['node']}")
        elif rank in HOST1 and not result["left"]:
            found.append(f"rank {rank} of host 1 did not leave cleanly")
        elif rank in HOST0 and not result.get("exact_after_drain"):
            found.append(f"rank {rank} of host 0 did not check training on")
    return found


def launcher(argv: Sequence[str]) -> int:
    """Starts the job, waits for it, prints the summary; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="the whole job's deadline (s)"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show torch's and torchrec's warnings from the workers",
    )
    parser.add_argument(
        "--result-dir", help="keep the ranks' result files here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    result_dir = args.result_dir or tempfile.mkdtemp(prefix="drain-demo-")
    os.makedirs(result_dir, exist_ok=True)
    worker_args = [os.path.abspath(__file__), "--result-dir", result_dir]
    worker_args += ["--deadline-s", str(max(30.0, args.timeout - 30.0))]
    worker_args += ["--verbose"] if args.verbose else []

    print("Draining a host: 2 torchrun nodes x 2 ranks on 127.0.0.1 (gloo, CPU)")
    for name in PLANS:
        print(f"  plan {describe(name)}")
    agents = launch(worker_args, args.timeout, args.verbose)
    results: Dict[int, Dict[str, Any]] = {}
    for name in os.listdir(result_dir):  # rank<r>.json of every rank that wrote
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(result_dir, name)) as f:
                results[int(name[4:-5])] = json.load(f)

    print("\nsummary:")
    for agent in agents:
        when = "-" if agent.seconds is None else f"{agent.seconds:.2f}s"
        print(f"  node {agent.node}'s agent: exit code {agent.returncode} at {when}")
    for rank in range(WORLD):
        result = results.get(rank)
        if result is None:
            print(f"  rank {rank}: no result")
            continue
        role = "left (drained)" if result["left"] else "trained on"
        exited = result["exit_time"] - agents[0].launched_at
        print(
            f"  rank {rank} (host {result['node']}): {result['status']}, {role}, "
            f"{len(result['checks'])} checks passed, done at {exited:.2f}s"
        )
    print(
        "  (an agent whose workers are done waits in torchelastic's exit barrier "
        "for the other agent, up to 300 s)"
    )
    found = failures(agents, results)
    if found:
        print("\nRESULT: FAILED")
        for failure in found:
            print(f"  {failure}")
        return 1
    print(
        "\nRESULT: exact. Host 1's ranks handed their shards over and exited 0; "
        "host 0 trained on exactly like a model built directly on its ranks "
        f"(results in {result_dir})."
    )
    return 0


def worker(argv: Sequence[str]) -> int:
    """Under torchrun: one rank of the job."""
    parser = argparse.ArgumentParser(description="a worker of the drain demo")
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--deadline-s", type=float, default=240.0)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    return run_worker(args.result_dir, args.deadline_s, args.verbose)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The launcher, or under torchrun (TORCHELASTIC_RUN_ID) a worker."""
    argv = sys.argv[1:] if argv is None else argv
    return worker(argv) if "TORCHELASTIC_RUN_ID" in os.environ else launcher(argv)


if __name__ == "__main__":
    sys.exit(main())

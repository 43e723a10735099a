#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Jobs that lose ranks, for the fault-tolerance tests: the launcher and the
oracle.

:func:`run_job` starts a job's ranks as processes (gloo on CPU, one intra-op
thread each) whose store this process hosts, as a launcher's agent hosts it
(so it survives any rank); each rank runs a function of the test, which may
end it with ``os._exit`` (:data:`KILLED`) at a chosen point. Every rank
writes ``rank<r>.json`` with its result; a rank that outlives the job's
deadline exits with code 3, so no job hangs.

The oracle is independent of the code under test: a rank's own state
(:class:`LocalState`: its shards of weights and fused optimizer state, the
dense part and its optimizer) is read with plain state-dict calls, recorded
with ``torch.save`` (:func:`save_record`); :func:`assert_matches_direct`
builds a model directly on the survivors under the recovery's plan from the
survivors' own state and the lost ranks' recorded state, and checks bit for
bit that the recovered model equals it, that no survivor's shard changed a
byte, and that both train on alike.
"""

import json
import logging
import multiprocessing
import os
import pickle
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.test_utils.reshard_model_utils import (
    make_dense_optimizer,
    model_batch,
    model_definition,
    model_sharders,
)
from torchrec.distributed.test_utils.reshard_utils import (
    _optimizer_shard_pairs,
    assert_dense_optimizer_states_equal,
    assert_optimizer_states_equal,
    assert_state_dicts_equal,
    load_global_state,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan

KILLED = 9  # the exit code of a rank a test kills
DEADLINE_CODE = 3
STORE_PREFIX = "fault_test"

# rank, world size, the job's store, the output folder, the test's arguments
RankFunction = Callable[[int, int, dist.Store, str, Any], Dict[str, Any]]


# ------------------------------------------------------------------ oracle


@dataclass
class LocalState:
    """A rank's own state: shards of weights and fused state, dense part."""

    weights: Dict[str, List[Tuple[Tuple[int, int], torch.Tensor]]] = field(
        default_factory=dict
    )
    sizes: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    fused: List[Tuple[str, str, Tuple[int, int, int, int], torch.Tensor]] = field(
        default_factory=list
    )
    dense: Dict[str, torch.Tensor] = field(default_factory=dict)
    dense_optimizer: Any = None


def local_state(model: nn.Module, optimizer: Any) -> LocalState:
    """This rank's own state, read with plain state-dict calls."""
    state = LocalState()
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            state.sizes[key] = tuple(value.size())
            state.weights[key] = [
                (tuple(s.metadata.shard_offsets), s.tensor.detach().clone())
                for s in value.local_shards()
            ]
        else:
            state.dense[key] = value.detach().clone()
    state.fused = [
        (k, s, rect, t.detach().clone())
        for k, s, rect, t in _optimizer_shard_pairs(model)
    ]
    if optimizer is not None:
        state.dense_optimizer = pickle.loads(pickle.dumps(optimizer.state_dict()))
    return state


def record_path(out_dir: str, rank: int, step: int) -> str:
    """Where a rank's own state after a step is recorded."""
    return os.path.join(out_dir, f"state_r{rank}_s{step}.pt")


def save_record(model: nn.Module, optimizer: Any, out_dir: str, step: int) -> None:
    """Records this rank's own state after ``step`` (``torch.save``)."""
    torch.save(
        local_state(model, optimizer), record_path(out_dir, dist.get_rank(), step)
    )


def load_record(out_dir: str, rank: int, step: int) -> LocalState:
    """A rank's recorded state."""
    return torch.load(record_path(out_dir, rank, step), weights_only=False)


def global_state(
    pieces: Sequence[LocalState], dense_from: LocalState
) -> Tuple[Dict[str, torch.Tensor], Dict[Tuple[str, str], torch.Tensor], Any]:
    """
    The global weights and fused state assembled from the ranks' pieces (row
    state expanded over its shard's columns, as ``load_global_state`` reads
    it), the dense part and its optimizer from one rank.
    """
    weights: Dict[str, torch.Tensor] = {}
    fused: Dict[Tuple[str, str], torch.Tensor] = {}
    for state in pieces:
        for key, shards in state.weights.items():
            for (row, col), tensor in shards:
                full = weights.setdefault(
                    key, torch.zeros(state.sizes[key], dtype=tensor.dtype)
                )
                full[row : row + tensor.shape[0], col : col + tensor.shape[1]] = tensor
        for key, state_key, (row, col, rows, cols), tensor in state.fused:
            full = fused.setdefault(
                (key, state_key), torch.zeros(state.sizes[key], dtype=torch.float64)
            )
            target = full[row : row + rows, col : col + cols]
            if tensor.numel() == rows * cols:
                target.copy_(tensor.reshape(rows, cols))
            else:
                target.copy_(tensor.reshape(rows, 1).expand(rows, cols))
    weights.update(dense_from.dense)
    return weights, fused, dense_from.dense_optimizer


def train_step(model: nn.Module, optimizer: Any, step: int, index: int) -> torch.Tensor:
    """One step of the model of ``reshard_model_utils``; its outputs."""
    optimizer.zero_grad()
    out = model(model_batch(step, index))
    (out**2).sum().backward()
    optimizer.step()
    return out.detach()


def assert_matches_direct(
    model: nn.Module,
    optimizer: Any,
    plan: ShardingPlan,
    own: LocalState,
    lost: Sequence[LocalState],
    step: int,
) -> List[str]:
    """
    Run by every survivor after a recovery: the recovered model against one
    built directly on the survivors' group under ``plan`` and loaded with
    every survivor's own state at the failure (``own``, gathered) and the
    lost ranks' recorded state (``lost``): state, then no survivor's shard
    changed, then two training steps.

    Args:
        model (DistributedModelParallel): the recovered model.
        optimizer (Any): its dense optimizer.
        plan (ShardingPlan): the recovery's plan.
        own (LocalState): this survivor's state at the failure.
        lost (Sequence[LocalState]): the lost ranks' states of the source.
        step (int): a step number for the batches of the training check.

    Returns:
        List[str]: the checks made.
    """
    group = model._env.process_group
    survivors = dist.get_process_group_ranks(group)
    owns: List[Any] = [None] * len(survivors)
    dist.all_gather_object(owns, own, group=group)
    weights, fused, dense_optimizer = global_state(list(owns) + list(lost), owns[0])
    reference = DistributedModelParallel(
        model_definition(),
        env=ShardingEnv.from_process_group(group),
        device=torch.device("cpu"),
        plan=plan,
        sharders=model_sharders(),
    )
    load_global_state(reference, weights, fused)
    ref_optimizer = make_dense_optimizer(reference)
    ref_optimizer.init_state()
    ref_optimizer.load_state_dict(dense_optimizer)
    assert_state_dicts_equal(reference.state_dict(), model.state_dict())
    assert_optimizer_states_equal(reference, model)
    assert_dense_optimizer_states_equal(optimizer, ref_optimizer)
    checks = [f"equals the model built directly on {survivors}"]
    now: List[Any] = [None] * len(survivors)
    dist.all_gather_object(now, local_state(model, optimizer), group=group)
    full_now, _, _ = global_state(now, owns[0])
    for survivor in owns:
        for key, shards in survivor.weights.items():
            for (row, col), tensor in shards:
                rows, cols = tensor.shape
                piece = full_now[key][row : row + rows, col : col + cols]
                assert torch.equal(piece, tensor), (key, row, col)
    checks.append("no survivor's own shard changed a byte")
    index = survivors.index(dist.get_rank())
    for offset in range(2):
        out = train_step(model, optimizer, step + 1000 + offset, index)
        expected = train_step(reference, ref_optimizer, step + 1000 + offset, index)
        assert torch.equal(out, expected), ("training after the recovery", offset)
    assert_state_dicts_equal(reference.state_dict(), model.state_dict())
    assert_optimizer_states_equal(reference, model)
    checks.append("trains on like the model built directly")
    return checks


# -------------------------------------------------------------- processes


def quiet() -> None:
    """Deprecation chatter of torch / torchrec / fbgemm, not about the job."""
    warnings.filterwarnings("ignore")
    for noisy in ("torchrec", "fbgemm_gpu", "torch"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def die(store: dist.Store, out_dir: str, result: Mapping[str, Any]) -> None:
    """Ends this rank as a killed process would end (no teardown), after
    telling the store when (for the tests' timelines)."""
    rank = dist.get_rank()
    store.set(f"{STORE_PREFIX}/killed/{rank}", repr(time.time()))
    write_result(out_dir, rank, dict(result, status="killed"))
    os._exit(KILLED)


def killed_at(store: dist.Store, rank: int) -> Optional[float]:
    """When a rank was killed (``time.time()``), if it was."""
    key = f"{STORE_PREFIX}/killed/{rank}"
    return float(store.get(key).decode()) if store.check([key]) else None


def write_result(out_dir: str, rank: int, result: Mapping[str, Any]) -> None:
    """Writes a rank's result (atomically)."""
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def _rank_main(
    function: RankFunction,
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    args: Any,
    collective_timeout_s: float,
    deadline_s: float,
) -> None:
    timer = threading.Timer(deadline_s, lambda: os._exit(DEADLINE_CODE))
    timer.daemon = True
    timer.start()
    quiet()
    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    store = dist.TCPStore(
        "127.0.0.1", port, None, False, timedelta(seconds=60), wait_for_workers=False
    )
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout_s),
    )
    code = 0
    try:
        result = function(rank, world_size, store, out_dir, args)
    except BaseException:
        result = {"status": "failed", "error": traceback.format_exc()}
        code = 1
    write_result(out_dir, rank, dict(result, rank=rank))
    os._exit(code)  # peers may be gone: no teardown that waits on them


@dataclass
class JobResult:
    """
    A finished job.

    Args:
        results (Dict[int, Dict[str, Any]]): each rank's result, by rank.
        exit_codes (Dict[int, Optional[int]]): each rank's exit code.
        seconds (float): the job's wall time.
        out_dir (str): where its ranks wrote.
    """

    results: Dict[int, Dict[str, Any]]
    exit_codes: Dict[int, Optional[int]]
    seconds: float
    out_dir: str = ""

    def failures(self) -> List[str]:
        """What went wrong on ranks that were not killed."""
        out = []
        for rank, code in sorted(self.exit_codes.items()):
            result = self.results.get(rank)
            if result is None:
                out.append(f"rank {rank} wrote no result (exit code {code})")
            elif result.get("status") == "failed":
                out.append(f"rank {rank} failed:\n{result.get('error')}")
        return out


def run_job(
    function: RankFunction,
    world_size: int,
    args: Any = None,
    collective_timeout_s: float = 5.0,
    deadline_s: float = 240.0,
    out_dir: Optional[str] = None,
) -> JobResult:
    """
    Runs ``function`` on every rank of a job whose store this process hosts,
    and waits for all of them (at most ``deadline_s``).

    Args:
        function (RankFunction): a rank's part (importable: it runs in a
            process of its own); returns the rank's result.
        world_size (int): ranks.
        args (Any): the function's last argument (picklable).
        collective_timeout_s (float): the default group's timeout.
        deadline_s (float): the job's deadline (ranks still running then
            exit, or are killed).
        out_dir (Optional[str]): where the ranks write (default: a new
            temporary directory).

    Returns:
        JobResult: every rank's result and exit code.
    """
    out_dir = out_dir or tempfile.mkdtemp(prefix="fault_job_")
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False
    )
    ctx = multiprocessing.get_context("forkserver")
    start = time.time()
    processes = [
        ctx.Process(
            target=_rank_main,
            args=(
                function,
                rank,
                world_size,
                store.port,
                out_dir,
                args,
                collective_timeout_s,
                deadline_s,
            ),
        )
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    deadline = time.monotonic() + deadline_s + 10
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()
    results = {}
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[rank] = json.load(f)
    codes = {rank: p.exitcode for rank, p in enumerate(processes)}
    del store
    return JobResult(results, codes, time.time() - start, out_dir)

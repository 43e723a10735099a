#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Side by side: a stock torchrec release's own reshard against the fork on the
same release (1.8.0 or 1.9.2, the bases of base.json that have upstream's
own reshard; ``$TORCHREC_FORK_BASE`` selects it, else base.json's default).
Below, 1.8.0 stands for either.

Both sides run the same script, the same model and the same moves, through
upstream's public API only::

    _, delta = output_sharding_plan_delta_single(module.module_sharding_plan, new)
    sharder.reshard(module, delta, env, device)     # EmbeddingBagCollectionSharder

Stock runs upstream's implementation; the fork on 1.8.0 runs its own engine
behind the same call. Each side is a run of processes of its own Python; for
every size and move the driver runs the sides one after the other, ``--rounds``
times in turn:

* **floor**: a bare ``all_to_all_single`` of the same bytes per rank into a
  fresh buffer (``reshard_benchmark.py``'s ``a2a_fresh``), for scale;
* **stock**: ``.venv-1.8.0-stock``, a venv holding only the verified stock
  torchrec 1.8.0 wheel (base.json's pin) that borrows the rest of the stack
  (torch, fbgemm-gpu-cpu, tensordict, ...) from the fork's venv through a
  ``.pth`` file: the same interpreter and the same libraries on both sides,
  nothing downloaded. ``--setup-stock-venv`` creates it;
* **fork**: ``.venv-1.8.0`` (``TORCHREC_FORK_BASE=1.8.0 source scripts/_env.sh``);
* **fork_copy**: the same venv, the fork's own ``reshard_module`` with
  ``ReshardOptions(storage=StorageMode.COPY)`` (not upstream's API): one
  kernel per rebuilt group, as a module sharded directly has.

Every rank runs with ``PYTHONHASHSEED`` set (``--hash-seed``, default 0):
stock 1.8.0 tags its point-to-point messages with ``hash()`` of a tuple
holding a str, and gloo matches tags, so with the per-process random seed its
reshard never ends on gloo.

Scenario (as ``reshard_benchmark.py``): ``4 * world_size`` fp32 tables of dim
128, fused kernel with ``EXACT_ROWWISE_ADAGRAD``; ``size`` is the weight bytes
every rank sends (and receives) per move. Moves:

* ``table_wise``: table i on rank i // 4; the move sends 2 of every rank's 4
  tables to the next rank;
* ``column_wise``: every table column-wise over all ranks (128 / world_size
  columns per shard); the move rotates the shard owners of half the tables.

Repetitions alternate A -> B and B -> A (each moves the same bytes), after
``--warmup`` unmeasured ones. Per repetition, on every rank:

* **time**: between two barriers around ``sharder.reshard``;
* **peak extra memory**: the measure of ``reshard_benchmark.py`` (VmHWM after
  the move minus VmRSS just before it, with the high-water mark reset through
  ``/proc/self/clear_refs``), max over ranks;
* **forward**: a forward on a fixed batch right after the move, compared bit
  for bit with the output of a module sharded directly under the move's target
  plan holding the same weights (computed before any move);
* **weights**: every local weight shard (state dict) equals the known values
  the tables were filled with, and the local shards are the plan's.

A side that fails is reported as failed, with its error, never skipped.

Example::

    bash scripts/benchmark.sh --compare-upstream --sizes-mib 256,1024
"""

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from common import (  # noqa: E402 (the folder first)
    fmt,
    free_port,
    meta_ebc,
    MiB,
    table_head,
)

DIM = 128
TABLES_PER_RANK = 4
MOVED_PER_RANK = 2
CHUNK_ROWS = 1 << 16
BATCH_SIZE = 32
IDS_PER_SAMPLE = 4


def _selected_base() -> Tuple[str, bool]:
    """The version of the base the tools select (base.json, $TORCHREC_FORK_BASE)
    and whether it is base.json's default."""
    sys.path.insert(0, str(REPO))
    from tools import forklib  # pyre-ignore[21]

    base = forklib.load_base(REPO)
    return base.version, base.default


#: The release compared: the base of base.json that $TORCHREC_FORK_BASE
#: selects (else its default), one with upstream's own reshard (1.8.0, 1.9.2).
BASE, _DEFAULT_BASE = _selected_base()

SIDES = ["floor", "stock", "fork", "fork_copy"]
SIDE_LABELS = {
    "floor": "bare all_to_all_single of the same bytes per rank into a fresh "
    "buffer (reshard_benchmark.py's a2a_fresh): no reshard can beat it by much",
    "stock": f"stock torchrec {BASE}: EmbeddingBagCollectionSharder.reshard",
    "fork": f"the fork on {BASE}: the same call (its engine, default options)",
    "fork_copy": f"the fork on {BASE}: reshard_module(..., ReshardOptions(storage="
    "StorageMode.COPY)), the fork's own API (not upstream's)",
}
MOVES = ["table_wise", "column_wise"]
STOCK_VENV = REPO / f".venv-{BASE}-stock"
FORK_VENV = REPO / (".venv" if _DEFAULT_BASE else f".venv-{BASE}")
STACK_PTH = "zz-torchrec-compare-stack.pth"


# ----------------------------------------------------------- stock venv ----


def _purelib(python: Path) -> str:
    """
    Args:
        python (Path): an interpreter.

    Returns:
        str: its ``purelib`` site-packages folder.
    """
    return subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def stock_wheel() -> Path:
    """
    The verified stock torchrec wheel (of ``BASE``) base.json pins (from
    ``$TORCHREC_FORK_BASE_WHEEL``, the fork's wheel cache, or pip).

    Returns:
        Path: the wheel file.
    """
    sys.path.insert(0, str(REPO))
    from tools import forklib  # pyre-ignore[21]

    with forklib.selected_base(BASE):
        return forklib.fetch_base_wheel(REPO)


def ensure_stock_venv(venv: Path, stack_python: Path) -> Path:
    """
    Creates (or checks) the stock venv: a venv holding the stock torchrec
    wheel of ``BASE`` alone, which takes the rest of the stack from the
    site-packages of ``stack_python`` (the fork's venv on that base) through a
    ``.pth`` file. Idempotent; nothing is downloaded when the wheel is cached.

    Args:
        venv (Path): the stock venv.
        stack_python (Path): the interpreter of the venv that holds the stack.

    Returns:
        Path: the stock venv's interpreter.

    Raises:
        RuntimeError: when the venv does not import stock torchrec ``BASE``.
    """
    python = venv / "bin" / "python"
    wheel = stock_wheel()
    stack_site = _purelib(stack_python)
    stamp = f"{wheel.name} {file_sha256(wheel)} {stack_site}"
    stamp_file = venv / ".stock-stamp"
    if not (
        python.exists() and stamp_file.exists() and stamp_file.read_text() == stamp
    ):
        print(f"[compare-upstream] setting up {venv} (stock {wheel.name})", flush=True)
        if not python.exists():
            # the base interpreter of the stack's venv: same Python everywhere
            base = subprocess.run(
                [str(stack_python), "-c", "import sys; print(sys._base_executable)"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            subprocess.run([base, "-m", "venv", str(venv)], check=True)
        site = Path(_purelib(python))
        (site / STACK_PTH).write_text(f"import site; site.addsitedir({stack_site!r})\n")
        subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                "--no-index",
                "--force-reinstall",
                str(wheel),
            ],
            check=True,
        )
        stamp_file.write_text(stamp)
    check = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m, importlib.util as u, torchrec; "
            "print(m.version('torchrec'), "
            "u.find_spec('torchrec.distributed.resharding') is None, torchrec.__file__)",
        ],
        capture_output=True,
        text=True,
    )
    words = check.stdout.split()
    if check.returncode != 0 or words[:2] != [BASE, "True"]:
        raise RuntimeError(
            f"{venv} does not import stock torchrec {BASE}: {check.stdout} "
            f"{check.stderr}"
        )
    return python


def file_sha256(path: Path) -> str:
    """
    Args:
        path (Path): a file.

    Returns:
        str: its hex sha256 (part of the stock venv's stamp).
    """
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------- the model ----


def table_names(world_size: int) -> List[str]:
    """
    Args:
        world_size (int): ranks.

    Returns:
        List[str]: the names of the benchmark's tables.
    """
    return [f"t{i}" for i in range(TABLES_PER_RANK * world_size)]


def rows_for(size: int) -> int:
    """
    Args:
        size (int): weight bytes each rank sends per move.

    Returns:
        int: rows per table such that a move sends ``size`` bytes per rank.
    """
    return max(1, size // (MOVED_PER_RANK * DIM * 4))


def layout(move: str, world_size: int, moved: bool) -> Dict[str, List[int]]:
    """
    Ranks of every table's shards under plan A (``moved`` False) or B.

    Args:
        move (str): ``table_wise`` or ``column_wise``.
        world_size (int): ranks.
        moved (bool): plan B.

    Returns:
        Dict[str, List[int]]: table -> its shards' ranks (one for table-wise).
    """
    out: Dict[str, List[int]] = {}
    for i, name in enumerate(table_names(world_size)):
        if move == "table_wise":
            owner = i // TABLES_PER_RANK
            if moved and i % TABLES_PER_RANK >= TABLES_PER_RANK - MOVED_PER_RANK:
                owner = (owner + 1) % world_size
            out[name] = [owner]
        else:
            ranks = list(range(world_size))
            if moved and i % 2 == 1:
                ranks = ranks[1:] + ranks[:1]
            out[name] = ranks
    return out


def make_ebc(rows: int, world_size: int) -> Any:
    """
    Args:
        rows (int): rows per table.
        world_size (int): ranks.

    Returns:
        Any: the unsharded EmbeddingBagCollection, on the meta device (it
        never allocates).
    """
    return meta_ebc(table_names(world_size), rows, DIM)


def make_plan(ebc: Any, move: str, world_size: int, moved: bool) -> Any:
    """
    Args:
        ebc (Any): the unsharded module.
        move (str): ``table_wise`` or ``column_wise``.
        world_size (int): ranks.
        moved (bool): plan B (else A).

    Returns:
        Any: the ``EmbeddingModuleShardingPlan``, fused kernel.
    """
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        table_wise,
    )

    gens = {}
    for table, ranks in layout(move, world_size, moved).items():
        if move == "table_wise":
            gens[table] = table_wise(rank=ranks[0], compute_kernel="fused")
        else:
            gens[table] = column_wise(ranks=ranks, compute_kernel="fused")
    return construct_module_sharding_plan(
        ebc,
        gens,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )


def make_sharder(optimizer: str) -> Any:
    """
    Args:
        optimizer (str): an ``EmbOptimType`` name.

    Returns:
        Any: an ``EmbeddingBagCollectionSharder`` with that fused optimizer.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": getattr(EmbOptimType, optimizer),
            "learning_rate": 0.01,
        }
    )


def known_values(t: int, r0: int, r1: int, c0: int, c1: int) -> Any:
    """
    The known value of every weight, a function of (table, row, column);
    multiples of 1/64 below 1024, so sums of a few are exact in fp32.

    Args:
        t (int): the table's index.
        r0 (int): first row.
        r1 (int): end row.
        c0 (int): first column.
        c1 (int): end column.

    Returns:
        Any: the ``(r1 - r0) x (c1 - c0)`` fp32 block.
    """
    import torch

    r = torch.arange(r0, r1, dtype=torch.int64).unsqueeze(1)
    c = torch.arange(c0, c1, dtype=torch.int64).unsqueeze(0)
    return ((t * 131 + r * 7 + c * 13) % 65521).to(torch.float32) / 64.0


def local_weight_shards(module: Any) -> List[Tuple[int, int, int, Any]]:
    """
    Args:
        module (Any): a sharded EmbeddingBagCollection.

    Returns:
        List[Tuple[int, int, int, Any]]: (table index, row offset, column
        offset, tensor) of every local weight shard, through the public state
        dict (``embedding_bags.<t>.weight``).
    """
    out = []
    for key, value in module.state_dict().items():
        parts = key.split(".")
        if len(parts) != 3 or parts[0] != "embedding_bags" or parts[2] != "weight":
            continue
        t = int(parts[1][1:])
        for shard in value.local_shards():
            r0, c0 = shard.metadata.shard_offsets
            out.append((t, r0, c0, shard.tensor))
    return out


def fill(module: Any) -> None:
    """
    Writes the known values into every local weight shard (in place: the
    state dict's shards are views of the kernels' weights; a forward that
    does not see them fails the check).

    Args:
        module (Any): a sharded EmbeddingBagCollection.
    """
    import torch

    with torch.no_grad():
        for t, r0, c0, w in local_weight_shards(module):
            for a in range(0, w.shape[0], CHUNK_ROWS):
                b = min(w.shape[0], a + CHUNK_ROWS)
                w[a:b].copy_(known_values(t, r0 + a, r0 + b, c0, c0 + w.shape[1]))


def check_weights(
    module: Any, move: str, world_size: int, moved: bool, rank: int
) -> str:
    """
    Args:
        module (Any): the resharded module.
        move (str): the move.
        world_size (int): ranks.
        moved (bool): the module is under plan B (else A).
        rank (int): this rank.

    Returns:
        str: "exact" when the local weight shards are the plan's and hold the
        known values, else what is wrong.
    """
    import torch

    shards = local_weight_shards(module)
    cols = DIM // world_size
    want = set()
    for table, ranks in layout(move, world_size, moved).items():
        for i, r in enumerate(ranks):
            if r == rank:
                want.add((int(table[1:]), 0, 0 if move == "table_wise" else i * cols))
    got = {(t, r0, c0) for t, r0, c0, _ in shards}
    if got != want:
        return f"WRONG (local shards {sorted(got)}, plan says {sorted(want)})"
    worst = 0.0
    for t, r0, c0, w in shards:
        for a in range(0, w.shape[0], CHUNK_ROWS):
            b = min(w.shape[0], a + CHUNK_ROWS)
            ref = known_values(t, r0 + a, r0 + b, c0, c0 + w.shape[1])
            if not torch.equal(w[a:b], ref):
                worst = max(worst, float((w[a:b] - ref).abs().max()))
    return "exact" if worst == 0.0 else f"WRONG (max abs diff {worst:.3g})"


def fixed_batch(rows: int, world_size: int, rank: int) -> Any:
    """
    Args:
        rows (int): rows per table.
        world_size (int): ranks.
        rank (int): this rank.

    Returns:
        Any: the rank's fixed ``KeyedJaggedTensor``: ``BATCH_SIZE`` samples of
        ``IDS_PER_SAMPLE`` ids per feature, spread over every table's rows
        (first and last included).
    """
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = [f"f_{t}" for t in table_names(world_size)]
    n = BATCH_SIZE * IDS_PER_SAMPLE
    values = []
    for k in range(len(keys)):
        ids = (
            torch.arange(n, dtype=torch.int64) * (rows // n + 1) + 7 * k + rank
        ) % rows
        ids[0], ids[-1] = 0, rows - 1
        values.append(ids)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat(values),
        lengths=torch.full(
            (len(keys) * BATCH_SIZE,), IDS_PER_SAMPLE, dtype=torch.int32
        ),
    )


class Output:
    """
    A forward's output, what a ``KeyedTensor`` is made of (copied).

    Args:
        keys (List[str]): the features, in output order.
        values (Any): the pooled embeddings (batch x sum of the dims).
        lengths (List[int]): each feature's dim.
    """

    def __init__(self, keys: List[str], values: Any, lengths: List[int]) -> None:
        self.keys = keys
        self.values = values
        self.lengths = lengths

    def by_key(self) -> Dict[str, Any]:
        """
        Returns:
            Dict[str, Any]: each feature's columns.
        """
        import torch

        return dict(zip(self.keys, torch.split(self.values, self.lengths, dim=1)))


def forward(module: Any, batch: Any) -> Output:
    """
    Args:
        module (Any): a sharded EmbeddingBagCollection.
        batch (Any): this rank's batch.

    Returns:
        Output: the pooled embeddings (all features, this rank's samples).
    """
    import torch

    with torch.no_grad():
        out = module(batch)
        if hasattr(out, "wait"):
            out = out.wait()
        return Output(
            list(out.keys()), out.values().detach().clone(), list(out.length_per_key())
        )


def compare(out: Output, expected: Output) -> str:
    """
    Args:
        out (Output): the resharded module's output.
        expected (Output): the directly sharded module's.

    Returns:
        str: "exact" when keys and values are bit for bit ``expected``'s, else
        what differs: the key order (values equal by key), or the values.
    """
    import torch

    if out.keys == expected.keys and torch.equal(out.values, expected.values):
        return "exact"
    if sorted(out.keys) != sorted(expected.keys):
        return f"WRONG (features {out.keys} != {expected.keys})"
    got, want = out.by_key(), expected.by_key()
    diff = 0.0
    for key in want:
        if got[key].shape != want[key].shape:
            return f"WRONG ({key}: shape {tuple(got[key].shape)} != {tuple(want[key].shape)})"
        if not torch.equal(got[key], want[key]):
            diff = max(diff, float((got[key] - want[key]).abs().max()))
    if diff > 0:
        return f"WRONG (max abs diff {diff:.3g})"
    return "WRONG (feature order differs, values equal by key)"


def worst(results: List[str]) -> str:
    """
    Args:
        results (List[str]): every rank's result.

    Returns:
        str: the first that is not "exact", else "exact".
    """
    for r in results:
        if r != "exact":
            return r
    return "exact"


# ---------------------------------------------------------------- worker ----


def side_worker(
    rank: int, world_size: int, port: int, args: argparse.Namespace, out_path: str
) -> None:
    """
    One rank of one side: shard under plan A, compute the reference outputs,
    then ``warmup + reps`` moves, each timed and checked; rank 0 appends one
    JSON line per repetition to ``out_path``.

    Args:
        rank (int): this rank.
        world_size (int): ranks.
        port (int): the store's port.
        args (argparse.Namespace): the side's options.
        out_path (str): where rank 0 writes the results.
    """
    import faulthandler
    import importlib.metadata
    import importlib.util
    import logging
    import warnings

    import torch
    import torch.distributed as dist
    from reshard_benchmark import PeakMemory  # pyre-ignore[21]

    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=args.timeout_s),
    )
    pg = dist.group.WORLD
    size = int(args.size_mib * MiB)

    def emit(record: Dict[str, Any]) -> None:
        """Rank 0 appends ``record`` to the side's results."""
        if rank == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    if args.side == "floor":
        from reshard_benchmark import run_floor  # pyre-ignore[21]

        emit({"kind": "setup", "torchrec": None, "torchrec_file": None})
        floor = run_floor(
            "a2a_fresh", args, size, rank, world_size, pg, args.resettable
        )
        gathered_floor: List[Any] = [None] * world_size
        dist.all_gather_object(gathered_floor, floor, group=pg)
        for i, seconds in enumerate(floor["times"]):
            emit(
                {
                    "kind": "rep",
                    "rep": args.warmup + i,
                    "warmup": False,
                    "direction": "-",
                    "seconds": seconds,
                    "peak_bytes": max(g["peaks"][i] for g in gathered_floor),
                    "held_bytes": max(g["held"][i] for g in gathered_floor),
                    "forward": None,
                    "weights": None,
                    "phases_rank0": None,
                }
            )
        dist.destroy_process_group()
        return

    import torchrec
    from torchrec.distributed.sharding.dynamic_sharding import (
        output_sharding_plan_delta_single,
    )
    from torchrec.distributed.types import ShardingEnv

    # the side must be what it claims
    is_fork = importlib.util.find_spec("torchrec.distributed.resharding") is not None
    version = importlib.metadata.version("torchrec")
    if is_fork != (args.side != "stock") or not version.startswith(BASE):
        raise RuntimeError(
            f"side {args.side} imports torchrec {version} from {torchrec.__file__}"
        )

    env = ShardingEnv.from_process_group(pg)
    device = torch.device("cpu")
    rows = rows_for(size)
    ebc = make_ebc(rows, world_size)
    plans = [make_plan(ebc, args.move, world_size, m) for m in (False, True)]
    sharder = make_sharder(args.optimizer)
    batch = fixed_batch(rows, world_size, rank)
    emit(
        {
            "kind": "setup",
            "torchrec": version,
            "torchrec_file": torchrec.__file__,
            "rows": rows,
            "resettable": args.resettable,
            "hash_seed": os.environ.get("PYTHONHASHSEED"),
        }
    )

    reports: List[Any] = []
    if is_fork:
        # the fork's update_shards runs reshard_module and drops its report:
        # keep it (a pass-through; the phases are timed inside the fork)
        import torchrec.distributed.resharding as resharding  # pyre-ignore[21]

        engine = resharding.reshard_module

        def keep_report(*a: Any, **kw: Any) -> Any:
            """``reshard_module``, its report kept."""
            report = engine(*a, **kw)
            reports.append(report)
            return report

        resharding.reshard_module = keep_report

    def move(module: Any, delta: Any) -> None:
        """The timed call: upstream's API (``fork_copy``: the fork's own)."""
        if args.side == "fork_copy":
            from torchrec.distributed.resharding import (  # pyre-ignore[21]
                reshard_module,
                ReshardOptions,
                StorageMode,
            )

            reshard_module(
                module, delta, env, device, ReshardOptions(storage=StorageMode.COPY)
            )
        else:
            sharder.reshard(module, delta, env, device)

    # reference output under plan B: a module sharded directly under it
    t0 = time.perf_counter()
    reference = sharder.shard(ebc, copy.deepcopy(plans[1]), env, device)
    fill(reference)
    expected = [Output([], torch.empty(0), []), forward(reference, batch)]
    del reference
    gc.collect()
    # the module under plan A is plan A's reference before it moves
    module = sharder.shard(ebc, copy.deepcopy(plans[0]), env, device)
    fill(module)
    expected[0] = forward(module, batch)
    dist.barrier(group=pg)
    emit({"kind": "ready", "seconds": time.perf_counter() - t0})

    current = 0
    for rep in range(args.warmup + args.reps):
        target = 1 - current
        # upstream's helper; the plans are copied: stock updates the
        # module's plan in place
        _, delta = output_sharding_plan_delta_single(
            module.module_sharding_plan, copy.deepcopy(plans[target])
        )
        # a move that never ends (stock on gloo without PYTHONHASHSEED) fails
        # the side with every rank's stack instead of hanging
        faulthandler.dump_traceback_later(args.move_timeout_s, exit=True)
        with PeakMemory(args.resettable) as mem:
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            move(module, delta)
            dist.barrier(group=pg)
            seconds = time.perf_counter() - t0
        faulthandler.cancel_dump_traceback_later()
        current = target
        try:
            fwd = compare(forward(module, batch), expected[target])
        except Exception as e:  # reported, not raised: the run goes on
            fwd = f"WRONG (forward raised {type(e).__name__}: {e})"
        weights = check_weights(module, args.move, world_size, target == 1, rank)
        phases = None
        if reports:
            report = reports.pop()
            phases = {
                "agree": report.phases.agree,
                "build": report.phases.build,
                "exchange": report.phases.exchange,
                "commit": report.phases.commit,
                "total": report.seconds,
            }
        mine = {
            "phases": phases,
            "seconds": seconds,
            "peak": mem.extra_bytes,
            "held": mem.held_bytes,
            "forward": fwd,
            "weights": weights,
        }
        gathered: List[Any] = [None] * world_size
        dist.all_gather_object(gathered, mine, group=pg)
        emit(
            {
                "kind": "rep",
                "rep": rep,
                "warmup": rep < args.warmup,
                "direction": "A->B" if target == 1 else "B->A",
                "seconds": gathered[0]["seconds"],
                "seconds_per_rank": [g["seconds"] for g in gathered],
                "peak_bytes": max(g["peak"] for g in gathered),
                "held_bytes": max(g["held"] for g in gathered),
                "forward": worst([g["forward"] for g in gathered]),
                "weights": worst([g["weights"] for g in gathered]),
                "phases_rank0": gathered[0]["phases"],
            }
        )
    del module
    gc.collect()
    dist.barrier(group=pg)
    dist.destroy_process_group()


def run_side(args: argparse.Namespace) -> None:
    """
    Runs one side on ``--world-size`` gloo ranks (``--side`` mode).

    Args:
        args (argparse.Namespace): the side's options.
    """
    import torch.multiprocessing as mp
    from reshard_benchmark import reset_hwm  # pyre-ignore[21]

    args.resettable = reset_hwm()
    if args.hash_seed != "random":
        # read by the ranks' interpreters at start-up: stock 1.8.0 tags its
        # point-to-point messages with hash() of a tuple holding a str, which
        # only agrees across ranks with the same seed (gloo matches tags)
        os.environ["PYTHONHASHSEED"] = args.hash_seed
    mp.spawn(
        side_worker,
        args=(args.world_size, free_port(), args, args.out),
        nprocs=args.world_size,
        join=True,
    )


# ---------------------------------------------------------------- driver ----


def launch_side(
    side: str, python: Path, size_mib: float, move: str, args: argparse.Namespace
) -> Dict[str, Any]:
    """
    Runs one side in a process of its own interpreter and collects what it
    reported (also when it failed: the repetitions done and the error).

    Args:
        side (str): ``stock``, ``fork`` or ``fork_copy``.
        python (Path): the side's interpreter.
        size_mib (float): weight MiB each rank sends per move.
        move (str): ``table_wise`` or ``column_wise``.
        args (argparse.Namespace): the driver's options.

    Returns:
        Dict[str, Any]: ``setup`` (or None), ``reps`` (list), ``error`` (None
        or text), ``wall_s``.
    """
    fd, out = tempfile.mkstemp(prefix=f"compare_{side}_", suffix=".jsonl")
    os.close(fd)
    cmd = [str(python), str(Path(__file__).resolve()), "--side", side, "--out", out]
    cmd += ["--size-mib", str(size_mib), "--move", move, "--reps", str(args.reps)]
    cmd += ["--warmup", str(args.warmup), "--world-size", str(args.world_size)]
    cmd += ["--optimizer", args.optimizer, "--timeout-s", str(args.timeout_s)]
    cmd += ["--move-timeout-s", str(args.move_timeout_s), "--hash-seed", args.hash_seed]
    t0 = time.perf_counter()
    error: Optional[str] = None
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.side_timeout_s
        )
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            hung = [line for line in lines if line.startswith("Timeout (")]
            raised = [
                line
                for line in lines
                if not line.startswith(" ")
                and ("Error" in line or "Exception" in line)
                and "ProcessExitedException" not in line
                and "ProcessRaisedException" not in line
            ]
            if hung:
                why = f"a move did not end within {args.move_timeout_s} s (hung)"
            elif raised:
                why = raised[0]
            else:
                why = lines[-1] if lines else "?"
            error = f"exit {proc.returncode}: {why}"
            sys.stderr.write(f"--- {side} failed; the end of its stderr:\n")
            sys.stderr.write("\n".join(lines[-40:]) + "\n")
    except subprocess.TimeoutExpired:
        error = f"the side ran over {args.side_timeout_s} s"
    wall = time.perf_counter() - t0
    with open(out) as f:
        records = [json.loads(line) for line in f if line.strip()]
    os.unlink(out)
    setup = next((r for r in records if r["kind"] == "setup"), None)
    reps = [r for r in records if r["kind"] == "rep"]
    measured = [r for r in reps if not r["warmup"]]
    if error is None and len(measured) < args.reps:
        error = f"only {len(measured)} of {args.reps} repetitions reported"
    return {"setup": setup, "reps": reps, "error": error, "wall_s": wall}


def merge_runs(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """
    The runs of one side (one per round) as one: their repetitions in order,
    their errors, their wall time.

    Args:
        runs (List[Dict[str, Any]]): what :func:`launch_side` returned, per
            round.

    Returns:
        Dict[str, Any]: the same keys.
    """
    errors = [f"round {i + 1}: {r['error']}" for i, r in enumerate(runs) if r["error"]]
    return {
        "setup": next((r["setup"] for r in runs if r["setup"]), None),
        "reps": [rep for r in runs for rep in r["reps"]],
        "error": "; ".join(errors) if errors else None,
        "wall_s": sum(r["wall_s"] for r in runs),
    }


def summarise(
    size_mib: float, move: str, side: str, res: Dict[str, Any]
) -> Dict[str, Any]:
    """
    One table row from a side's results.

    Args:
        size_mib (float): the size.
        move (str): the move.
        side (str): the side.
        res (Dict[str, Any]): what :func:`launch_side` returned.

    Returns:
        Dict[str, Any]: the row.
    """
    measured = [r for r in res["reps"] if not r["warmup"]]
    times = [r["seconds"] for r in measured]
    return {
        "size_mib": size_mib,
        "move": move,
        "side": side,
        "times_s": times,
        "directions": [r["direction"] for r in measured],
        "min_s": min(times) if times else None,
        "median_s": statistics.median(times) if times else None,
        "peak_mib": max(r["peak_bytes"] for r in measured) / MiB if measured else None,
        "held_mib": max(r["held_bytes"] for r in measured) / MiB if measured else None,
        "forward": [r["forward"] for r in measured],
        "forward_warmup": [r["forward"] for r in res["reps"] if r["warmup"]],
        "weights": [r["weights"] for r in measured],
        "weights_warmup": [r["weights"] for r in res["reps"] if r["warmup"]],
        "phases_rank0": [r.get("phases_rank0") for r in measured],
        "error": res["error"],
        "wall_s": res["wall_s"],
        "setup": res["setup"],
    }


def checks_text(
    results: List[Optional[str]],
    directions: List[str],
    warmup: List[Optional[str]],
) -> str:
    """
    The repetitions' results, counted: "exact x4" when every one is exact,
    else per direction and result in order of appearance (e.g. "B->A exact
    x2; A->B WRONG (max abs diff 12) x2"); the warmup's are added when one
    was wrong.

    Args:
        results (List[Optional[str]]): the measured repetitions' results
            (None: not checked).
        directions (List[str]): their directions ("A->B" / "B->A").
        warmup (List[Optional[str]]): the warmup repetitions' results.

    Returns:
        str: the cell.
    """
    if not results:
        text = "-"
    elif all(r is None for r in results):
        text = "n/a"
    elif len(set(results)) == 1:
        text = f"{results[0]} x{len(results)}"
    else:
        counts: Dict[Tuple[str, Optional[str]], int] = {}
        for d, r in zip(directions, results):
            counts[(d, r)] = counts.get((d, r), 0) + 1
        text = "; ".join(f"{d} {r} x{n}" for (d, r), n in counts.items())
    wrong = [w for w in warmup if w not in ("exact", None)]
    if wrong and len(set(wrong)) == 1 and wrong[0] in results:
        text += f" (+ warmup x{len(wrong)})"
    elif wrong:
        text += f"; warmup: {wrong[0]} x{len(wrong)}"
        if len(set(wrong)) > 1 or len(wrong) < len(warmup):
            text += " (" + " | ".join(str(w) for w in warmup) + ")"
    return text


def table_text(rows: List[Dict[str, Any]]) -> str:
    """
    The side-by-side table, a legend and the failures.

    Args:
        rows (List[Dict[str, Any]]): the rows (:func:`summarise`).

    Returns:
        str: the text.
    """
    lines = table_head(
        [("size MiB", 8), ("move", -11), ("side", -9), ("min s", 7), ("median s", 8)]
        + [("x min", 6), ("x med", 6), ("peak MiB", 8), ("held MiB", 8)],
        f"  {'weights':<9} forward right after each move (vs direct shard)",
    )
    for r in rows:
        stock = next(
            (
                s
                for s in rows
                if s["side"] == "stock"
                and s["size_mib"] == r["size_mib"]
                and s["move"] == r["move"]
            ),
            None,
        )
        x_min = x_med = None
        if r["side"] != "stock" and stock and stock["min_s"] and r["min_s"]:
            x_min = stock["min_s"] / r["min_s"]
            x_med = stock["median_s"] / r["median_s"]
        weights = r["weights"]
        if not weights:
            w_cell = "-"
        elif all(w is None for w in weights):
            w_cell = "n/a"
        elif all(w == "exact" for w in weights + r["weights_warmup"]):
            w_cell = f"exact x{len(weights)}"
        else:
            w_cell = "WRONG"
        lines.append(
            f"{r['size_mib']:>8g} {r['move']:<11} {r['side']:<9} "
            f"{fmt(r['min_s'], '7.3f'):>7} {fmt(r['median_s'], '8.3f'):>8} "
            f"{fmt(x_min, '6.2f'):>6} {fmt(x_med, '6.2f'):>6} "
            f"{fmt(r['peak_mib'], '8.0f'):>8} {fmt(r['held_mib'], '8.0f'):>8}  "
            f"{w_cell:<9} {checks_text(r['forward'], r['directions'], r['forward_warmup'])}"
            + (f"  FAILED: {r['error']}" if r["error"] else "")
        )
    lines += [
        "",
        "x min / x med: stock's time over this side's (min / min, median / median "
        "over the measured reps; on the floor row: the most any reshard could "
        "gain over stock); peak MiB: max over ranks and reps of VmHWM after "
        "the move - VmRSS before it (reshard_benchmark.py's measure); held MiB: "
        "VmRSS after - before; weights: every local weight shard (state dict) "
        "against the known values; forward: a forward on a fixed batch right "
        "after each move against a module sharded directly under the new plan "
        "with the same weights, bit for bit (keys and values of the KeyedTensor); "
        "reps alternate A->B, B->A.",
    ]
    for side, label in SIDE_LABELS.items():
        if any(r["side"] == side for r in rows):
            lines.append(f"{side}: {label}")
    wrong_weights = [
        (r, w)
        for r in rows
        for w in r["weights_warmup"] + r["weights"]
        if w not in ("exact", None)
    ]
    for r, w in wrong_weights:
        lines.append(f"weights {r['size_mib']:g} MiB {r['move']} {r['side']}: {w}")
    return "\n".join(lines)


def breakdown_text(rows: List[Dict[str, Any]]) -> str:
    """
    Where the fork's time goes: the phases of its report (rank 0, the
    min-time repetition; stock reports none).

    Args:
        rows (List[Dict[str, Any]]): the rows (:func:`summarise`).

    Returns:
        str: the text ("" when no row has phases).
    """
    lines = []
    for r in rows:
        if not r["times_s"] or not r.get("phases_rank0"):
            continue
        phases = r["phases_rank0"][r["times_s"].index(r["min_s"])]
        if not phases:
            continue
        parts = ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
        lines.append(
            f"  {r['size_mib']:>6g} MiB {r['move']:<11} {r['side']:<9} {parts}"
        )
    if not lines:
        return ""
    return "\n".join(
        ["Where the fork's time goes (rank 0, min-time rep, seconds):"] + lines
    )


def run_driver(args: argparse.Namespace) -> int:
    """
    Sets up the stock venv (``--setup-stock-venv``), runs every side for every
    size and move, one after the other, and prints the table.

    Args:
        args (argparse.Namespace): the options.

    Returns:
        int: 0 when every side ran every repetition with exact weights and
        forwards, else 1.
    """
    sides = [s for s in SIDES if s in args.sides.split(",")]
    fork_python = Path(args.fork_python)
    pythons = {"floor": fork_python, "fork": fork_python, "fork_copy": fork_python}
    if "stock" in sides:
        pythons["stock"] = (
            ensure_stock_venv(Path(args.stock_venv), fork_python)
            if args.setup_stock_venv
            else Path(args.stock_venv) / "bin" / "python"
        )
    sizes = [float(s) for s in args.sizes_mib.split(",")]
    moves = [m for m in MOVES if m in args.moves.split(",")]
    header = (
        f"stock torchrec {BASE} vs the fork on {BASE}: {args.world_size} gloo ranks on "
        f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"1 thread per rank; {TABLES_PER_RANK * args.world_size} fp32 tables dim {DIM}, "
        f"fused kernel, {args.optimizer}; size = weight MiB each rank sends per move; "
        f"{args.rounds} round(s) of every side one after the other, each with "
        f"{args.reps} measured reps (+{args.warmup} warmup); "
        + (
            "PYTHONHASHSEED unset (random per process)"
            if args.hash_seed == "random"
            else f"PYTHONHASHSEED={args.hash_seed} on every rank"
        )
    )
    print(header, flush=True)
    rows = []
    for size in sizes:
        for move in moves:
            runs: Dict[str, List[Dict[str, Any]]] = {side: [] for side in sides}
            for rnd in range(args.rounds):
                for side in sides:
                    res = launch_side(side, pythons[side], size, move, args)
                    runs[side].append(res)
                    row = summarise(size, move, side, res)
                    print(
                        f"  {size:g} MiB {move} round {rnd + 1} {side}: times "
                        f"{[round(t, 3) for t in row['times_s']]}, forward "
                        f"{checks_text(row['forward'], row['directions'], row['forward_warmup'])}, "
                        f"{res['wall_s']:.0f} s in all"
                        + (f", FAILED: {row['error']}" if row["error"] else ""),
                        flush=True,
                    )
            for side in sides:
                rows.append(summarise(size, move, side, merge_runs(runs[side])))
    print()
    table = table_text(rows)
    print(table, flush=True)
    breakdown = breakdown_text(rows)
    if breakdown:
        print("\n" + breakdown, flush=True)
    for side in sides:
        setup = next(
            (r["setup"] for r in rows if r["side"] == side and r["setup"]), None
        )
        if setup and setup["torchrec"]:
            print(f"{side}: torchrec {setup['torchrec']} from {setup['torchrec_file']}")
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "upstream_compare_benchmark.json")
        with open(path, "w") as f:
            json.dump(
                {
                    "header": header,
                    "argv": sys.argv,
                    "rows": rows,
                    "table": table,
                    "breakdown": breakdown,
                },
                f,
                indent=1,
            )
        print(f"wrote {path}")
    bad = [
        r
        for r in rows
        if r["error"]
        or any(
            c not in ("exact", None)
            for c in r["forward"]
            + r["weights"]
            + r["forward_warmup"]
            + r["weights_warmup"]
        )
    ]
    return 1 if bad else 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """
    The command line (the driver's, and the ``--side`` mode it starts).

    Args:
        argv (Optional[List[str]]): the arguments (default: ``sys.argv``).

    Returns:
        argparse.Namespace: the options.
    """
    p = argparse.ArgumentParser(
        description=f"Stock torchrec {BASE}'s reshard against the fork on {BASE}, "
        "side by side (same model, same moves, upstream's public API).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--sizes-mib", default="256,1024", help="weight MiB each rank sends per move"
    )
    p.add_argument("--moves", default=",".join(MOVES), help="of " + ",".join(MOVES))
    p.add_argument("--sides", default=",".join(SIDES), help="of " + ",".join(SIDES))
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times every side runs, in turn (their reps are pooled)",
    )
    p.add_argument("--reps", type=int, default=3, help="measured moves per side run")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured moves first")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (CPU)")
    p.add_argument(
        "--optimizer", default="EXACT_ROWWISE_ADAGRAD", help="fused optimizer"
    )
    p.add_argument("--fork-python", default=str(FORK_VENV / "bin" / "python"))
    p.add_argument("--stock-venv", default=str(STOCK_VENV))
    p.add_argument(
        "--setup-stock-venv",
        action="store_true",
        help="create or refresh the stock venv first (see ensure_stock_venv)",
    )
    p.add_argument(
        "--hash-seed",
        default="0",
        help="PYTHONHASHSEED of every rank ('random': leave it unset; stock "
        "1.8.0's reshard then hangs on gloo)",
    )
    p.add_argument(
        "--out-dir", default=str(BENCH_DIR / "results"), help="'' writes nothing"
    )
    p.add_argument("--timeout-s", type=int, default=900, help="process group timeout")
    p.add_argument(
        "--move-timeout-s",
        type=float,
        default=600,
        help="a move taking longer fails its side (stacks on stderr)",
    )
    p.add_argument("--side-timeout-s", type=int, default=3600, help="limit per side")
    p.add_argument(
        "--print-saved",
        metavar="JSON",
        help="print the table of a saved run (its results JSON) and exit",
    )
    # --side mode (what the driver starts)
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--size-mib", type=float, help=argparse.SUPPRESS)
    p.add_argument("--move", choices=MOVES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, allowed in (("moves", MOVES), ("sides", SIDES)):
        unknown = set(getattr(args, name).split(",")) - set(allowed)
        if unknown:
            p.error(f"unknown {name} {sorted(unknown)}")
    return args


def print_saved(path: str) -> None:
    """
    Prints the table and the breakdown of a saved run again.

    Args:
        path (str): an ``upstream_compare_benchmark.json`` the driver wrote.
    """
    with open(path) as f:
        data = json.load(f)
    print(data["header"])
    print("command: python " + " ".join(data["argv"]))
    print()
    print(table_text(data["rows"]))
    breakdown = breakdown_text(data["rows"])
    if breakdown:
        print("\n" + breakdown)


def main(argv: Optional[List[str]] = None) -> None:
    """
    Entry point: the driver, or one side (``--side``).

    Args:
        argv (Optional[List[str]]): the arguments (default: ``sys.argv``).
    """
    args = parse_args(argv)
    if args.side:
        run_side(args)
        return
    if args.print_saved:
        print_saved(args.print_saved)
        return
    sys.exit(run_driver(args))


if __name__ == "__main__":
    main()

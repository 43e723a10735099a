#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Benchmark of elastic moves: a running
``DistributedModelParallel`` model shrinks from ranks [0, 1, 2, 3] to [0, 1]
and grows back, live (``move_model``) and by the checkpoint route (what users
do without this fork), in one run on 4 gloo ranks (CPU, one thread each).

The model: an ``EmbeddingBagCollection`` of ``--tw-tables`` table-wise and
``--rw-tables`` row-wise fp32 tables of dim ``--dim`` (``--size-mib`` of
weights in all), fused row-wise Adagrad (``--optimizer``), and a small dense
MLP. On 4 ranks table-wise table ``i`` lives on rank ``i % 4``, on 2 ranks on
rank ``i % 2`` (the tables of ranks 0 and 1 stay put); row-wise tables are
split over every rank of the group.

Per repetition, on every rank, the methods interleaved (their order alternates
between repetitions), each timed end to end between world barriers:

* ``live``  ``move_model`` from the old group to the new one (every rank of
  the union calls it; joining ranks pass the model definition on the meta
  device and the sharders);
* ``ckpt``  ``torch.distributed.checkpoint.save`` of the model's state dict
  and fused optimizer state on the old group (``process_group`` = old group),
  the old model dropped; then, on the new group, ``DistributedModelParallel``
  built from the definition with the new plan (the kernels' random init
  included, as users pay it; ``--ckpt-init skip`` skips it, as ``move_model``
  does, ``both`` measures both) and ``dcp.load`` + ``load_state_dict``.

After every move each rank of the new group checks a fingerprint of the
global state (every table's float64 row and column sums, every fused
optimizer state, the dense parameters; layout independent) against the one
taken before the first move: a lost or misplaced byte fails the run.

Bytes: the sum over ranks of the reports' ``bytes_sent`` must equal the bytes
the plans require, computed here without the library's move: for every table,
the rectangles whose owner (global rank) changes between the old layout and
the new one, weights plus fused optimizer state (``plan_group_move``, a pure
dry run of a group move; the run fails when they differ).

Example::

    python benchmarks/elastic_benchmark.py --size-mib 256 --reps 3
"""

import argparse
import copy
import gc
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import (
    benchmark_parser,
    fmt,
    free_port,
    gather_to_json,
    MiB,
    progress,
    save_figure,
    save_results,
    worker_setup,
)
from reshard_benchmark import reset_hwm, status_kib  # same folder
from torch import nn

WORLD: int = 4
OLD: Tuple[int, ...] = (0, 1, 2, 3)
SMALL: Tuple[int, ...] = (0, 1)
# (name, old group, new group)
MOVES: List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]] = [
    ("shrink 4->2", OLD, SMALL),
    ("grow 2->4", SMALL, OLD),
]
PATH = "ebc"
CHUNK_ROWS: int = 1 << 15

# fused optimizer -> (state bytes per element, state bytes per row) on the wire
OPTIMIZER_STATE_BYTES: Dict[str, Tuple[int, int]] = {
    "EXACT_SGD": (0, 0),
    "EXACT_ADAGRAD": (4, 0),
    "EXACT_ROWWISE_ADAGRAD": (0, 4),
}

# ------------------------------------------------------------- the dry run --

# table of a module: (name, rows, columns)
TableShape = Tuple[str, int, int]


@dataclass(frozen=True)
class TableBytes:
    """
    What one table's pieces cost on the wire.

    Args:
        per_element (int): bytes per element of a piece (weight and
            per-element optimizer state).
        per_row (int): bytes per row of a piece (row-wise optimizer state).
    """

    per_element: int
    per_row: int


@dataclass
class GroupMoveDryRun:
    """
    What a move of a model between groups of ranks sends, computed from the
    plans alone (nothing built, nothing moved, no collective).

    Args:
        bytes_sent (Dict[int, int]): global rank -> table bytes it sends.
        bytes_received (Dict[int, int]): global rank -> table bytes it receives.
        bytes_copied_locally (Dict[int, int]): global rank -> table bytes that
            stay on it (copied into the new model locally).
        tables_moved (List[str]): "path:table" of every table a piece of which
            changes owner.
        bytes_between (Dict[Tuple[int, int], int]): (sending, receiving)
            global rank -> table bytes.
    """

    bytes_sent: Dict[int, int] = field(default_factory=dict)
    bytes_received: Dict[int, int] = field(default_factory=dict)
    bytes_copied_locally: Dict[int, int] = field(default_factory=dict)
    tables_moved: List[str] = field(default_factory=list)
    bytes_between: Dict[Tuple[int, int], int] = field(default_factory=dict)

    @property
    def total_bytes_moved(self) -> int:
        """Table bytes that change owner (sent by all ranks together)."""
        return sum(self.bytes_sent.values())


def _global_layout(
    parameter_sharding: Any, rows: int, cols: int, group_ranks: Sequence[int]
) -> Any:
    from torchrec.distributed.resharding.plan import layout_from_parameter_sharding

    layout = layout_from_parameter_sharding(
        parameter_sharding, rows, cols, len(group_ranks)
    )
    return layout.remap_ranks(dict(enumerate(group_ranks)))


@dataclass(frozen=True)
class GroupMove:
    """
    A move of a model from ``old_ranks`` (under ``old_plan``) onto
    ``new_ranks`` (under ``new_plan``), as the dry runs read it.

    Args:
        old_plan (ShardingPlan): the plan on the old group (group-local ranks).
        old_ranks (Sequence[int]): the old group's global ranks, in group order.
        new_plan (ShardingPlan): the plan on the new group (group-local ranks).
        new_ranks (Sequence[int]): the new group's global ranks, in group order.
        tables (Mapping[str, Sequence[TableShape]]): module path -> its tables.
        table_bytes (Callable[[str, str], TableBytes]): (path, table) -> the
            table's bytes per element and per row on the wire.
    """

    old_plan: Any
    old_ranks: Sequence[int]
    new_plan: Any
    new_ranks: Sequence[int]
    tables: Mapping[str, Sequence[TableShape]]
    table_bytes: Callable[[str, str], TableBytes]

    def table_layouts(self) -> List[Tuple[str, str, Any, Any, TableBytes]]:
        """
        Every table, by path and name.

        Returns:
            List[Tuple[str, str, Any, Any, TableBytes]]: its path, name, old
            and new layouts (global ranks) and its bytes on the wire.
        """
        return [
            (
                path,
                name,
                _global_layout(
                    self.old_plan.plan[path][name], rows, cols, self.old_ranks
                ),
                _global_layout(
                    self.new_plan.plan[path][name], rows, cols, self.new_ranks
                ),
                self.table_bytes(path, name),
            )
            for path, shapes in sorted(self.tables.items())
            for name, rows, cols in shapes
        ]


def plan_group_move(move: GroupMove) -> GroupMoveDryRun:
    """
    The bytes ``move`` sends and receives per global rank: a pure dry run of
    ``move_model`` (candidate for the library).

    Args:
        move (GroupMove): the move.

    Returns:
        GroupMoveDryRun: bytes per global rank.
    """
    from torchrec.distributed.resharding.fields import TableKey
    from torchrec.distributed.resharding.transfer_plan import plan_table_transfers

    out = GroupMoveDryRun()
    for rank in sorted(set(move.old_ranks) | set(move.new_ranks)):
        out.bytes_sent[rank] = 0
        out.bytes_received[rank] = 0
        out.bytes_copied_locally[rank] = 0
    for path, name, old, new, cost in move.table_layouts():
        key = TableKey(path, name)
        moved = False
        for t in plan_table_transfers(key, old, new):
            nbytes = t.rect.numel * cost.per_element + t.rect.rows * cost.per_row
            if t.src_rank == t.dst_rank:
                out.bytes_copied_locally[t.dst_rank] += nbytes
            else:
                out.bytes_sent[t.src_rank] += nbytes
                out.bytes_received[t.dst_rank] += nbytes
                pair = (t.src_rank, t.dst_rank)
                out.bytes_between[pair] = out.bytes_between.get(pair, 0) + nbytes
                moved = True
        if moved:
            out.tables_moved.append(key)
    return out


def owner_change_bytes(move: GroupMove) -> int:
    """
    The same total as ``plan_group_move(move).total_bytes_moved``, by brute
    force over every pair (old shard, new shard) on different global ranks
    (no replicated tables): a check of the dry run that does not use the
    library's transfer planning.

    Args:
        move (GroupMove): the move.

    Returns:
        int: the table bytes that change owner.
    """
    total = 0
    for _, name, old, new, cost in move.table_layouts():
        assert not old.replicated and not new.replicated, name
        for a in old.shards:
            for b in new.shards:
                if a.rank == b.rank:
                    continue
                r0 = max(a.rect.row, b.rect.row)
                r1 = min(a.rect.row + a.rect.rows, b.rect.row + b.rect.rows)
                c0 = max(a.rect.col, b.rect.col)
                c1 = min(a.rect.col + a.rect.cols, b.rect.col + b.rect.cols)
                if r1 > r0 and c1 > c0:
                    total += (r1 - r0) * (c1 - c0) * cost.per_element
                    total += (r1 - r0) * cost.per_row
    return total


# ------------------------------------------------------------- the model ----


class Model(nn.Module):
    """An EmbeddingBagCollection and a small dense MLP over its pooled output."""

    def __init__(self, ebc: nn.Module, dim: int, hidden: int) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = nn.Sequential(
            nn.Linear(dim, hidden, device="meta"),
            nn.ReLU(),
            nn.Linear(hidden, 1, device="meta"),
        )

    def forward(self, features: Any) -> torch.Tensor:
        pooled = self.ebc(features).to_dict()
        x = torch.stack([pooled[k] for k in sorted(pooled)]).sum(0)
        return self.dense(x)


def table_names(args: argparse.Namespace) -> Tuple[List[str], List[str]]:
    """The table-wise and the row-wise tables."""
    return (
        [f"tw{i}" for i in range(args.tw_tables)],
        [f"rw{i}" for i in range(args.rw_tables)],
    )


def rows_per_table(args: argparse.Namespace) -> int:
    """Rows per table: ``--size-mib`` of fp32 weights in all, a multiple of 4."""
    n = args.tw_tables + args.rw_tables
    rows = int(args.size_mib * MiB) // (n * args.dim * 4)
    return max(4, rows - rows % 4)


def _leave_as_is(weight: torch.Tensor) -> None:
    """A table ``init_fn`` that does nothing."""


def definition(args: argparse.Namespace, initialise: bool = True) -> Model:
    """
    The unsharded model on the meta device (no weights). With ``initialise``
    False its tables' ``init_fn`` do nothing: the sharded module's
    ``reset_parameters`` then leaves its shards as the kernels allocated them.
    """
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tw, rw = table_names(args)
    rows = rows_per_table(args)
    tables = [
        EmbeddingBagConfig(
            name=name,
            embedding_dim=args.dim,
            num_embeddings=rows,
            feature_names=[f"f_{name}"],
            init_fn=None if initialise else _leave_as_is,
        )
        for name in tw + rw
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    return Model(ebc, args.dim, args.hidden)


def tables_of(args: argparse.Namespace) -> Dict[str, List[TableShape]]:
    tw, rw = table_names(args)
    rows = rows_per_table(args)
    return {PATH: [(name, rows, args.dim) for name in tw + rw]}


def table_bytes_of(args: argparse.Namespace) -> Callable[[str, str], TableBytes]:
    per_element, per_row = OPTIMIZER_STATE_BYTES[args.optimizer]

    def cost(path: str, table: str) -> TableBytes:
        return TableBytes(4 + per_element, per_row)  # fp32 weights

    return cost


def make_plan(args: argparse.Namespace, size: int) -> Any:
    """The plan on a group of ``size`` ranks (group-local placements)."""
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    tw, rw = table_names(args)
    generators: Dict[str, Any] = {
        name: table_wise(rank=i % size) for i, name in enumerate(tw)
    }
    generators.update({name: row_wise() for name in rw})
    module_plan = construct_module_sharding_plan(
        definition(args).ebc,
        generators,
        local_size=size,
        world_size=size,
        device_type="cpu",
    )
    for ps in module_plan.values():
        ps.compute_kernel = "fused"
    return ShardingPlan({PATH: module_plan})


def make_sharders(args: argparse.Namespace) -> List[Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return [
        EmbeddingBagCollectionSharder(
            fused_params={
                "optimizer": getattr(EmbOptimType, args.optimizer),
                "learning_rate": 0.01,
                "eps": 0.01,
            }
        )
    ]


def build(args: argparse.Namespace, env: Any, plan: Any, random_init: bool) -> Any:
    """
    ``DistributedModelParallel`` of the definition on ``env``'s group; without
    ``random_init`` neither the fused kernels (build hooks) nor the sharded
    module (``reset_parameters``, through the tables' ``init_fn``) initialise
    the tables.
    """
    import contextlib

    from torchrec.distributed.batched_embedding_kernel import (
        kernel_build_hooks,
        KernelBuildHooks,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel

    class _NoInit(KernelBuildHooks):
        # every weight is overwritten right after: skip the random init
        def init_parameters(self, config: Any) -> bool:
            return False

    ctx = contextlib.nullcontext() if random_init else kernel_build_hooks(_NoInit())
    with ctx:
        return DistributedModelParallel(
            definition(args, initialise=random_init),
            env=env,
            device=torch.device("cpu"),
            plan=copy.deepcopy(plan),
            sharders=make_sharders(args),
        )


# ---------------------------------------------------- known values, checks --


def _table_index(name: str) -> int:
    return (100 if name.startswith("rw") else 0) + int(name[2:])


def _weight_values(t: int, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    r = torch.arange(r0, r1, dtype=torch.int64).unsqueeze(1)
    c = torch.arange(c0, c1, dtype=torch.int64).unsqueeze(0)
    return ((t * 131 + r * 7 + c * 13) % 65521).to(torch.float32)


def _state_values(t: int, r0: int, r1: int) -> torch.Tensor:
    r = torch.arange(r0, r1, dtype=torch.int64)
    return ((t * 17 + r * 3) % 1009 + 1).to(torch.float32)


def _table_of_key(key: str) -> str:
    # "ebc.embedding_bags.<table>.weight"
    return key.split(".")[-2]


def fill(model: Any) -> None:
    """
    Known values in every local shard (weights from (table, row, column),
    row-wise state from (table, row), other state from (table, row, column)),
    and deterministic dense parameters (the same on every rank).
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    with torch.no_grad():
        for key, value in model.state_dict().items():
            if not isinstance(value, ShardedTensor):
                continue
            t = _table_index(_table_of_key(key))
            for shard in value.local_shards():
                (r0, c0), w = shard.metadata.shard_offsets, shard.tensor
                for i in range(0, w.shape[0], CHUNK_ROWS):
                    j = min(w.shape[0], i + CHUNK_ROWS)
                    w[i:j].copy_(_weight_values(t, r0 + i, r0 + j, c0, c0 + w.shape[1]))
        for key, states in model.fused_optimizer.state_dict()["state"].items():
            t = _table_index(_table_of_key(key))
            for value in states.values():
                for shard in value.local_shards():
                    x, offsets = shard.tensor, shard.metadata.shard_offsets
                    r0 = offsets[0]
                    if x.dim() == 1:
                        x.copy_(_state_values(t, r0, r0 + x.shape[0]))
                    else:
                        c0 = offsets[1]
                        x.copy_(
                            _weight_values(
                                t + 1000, r0, r0 + x.shape[0], c0, c0 + x.shape[1]
                            )
                        )
        generator = torch.Generator().manual_seed(1234)
        for _, p in sorted(model.module.dense.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=generator))


def _add_sums(
    buffer: torch.Tensor, offset: int, rows: int, x: torch.Tensor, r0: int, c0: int
) -> None:
    """Adds a 2D piece's float64 row sums (at its rows) and column sums."""
    for i in range(0, x.shape[0], CHUNK_ROWS):
        block = x[i : i + CHUNK_ROWS].to(torch.float64)
        buffer[offset + r0 + i : offset + r0 + i + block.shape[0]] += block.sum(1)
        cols = buffer[offset + rows + c0 : offset + rows + c0 + x.shape[1]]
        cols += block.sum(0)


def global_fingerprint(model: Any, pg: Any) -> Tuple[str, str]:
    """
    A fingerprint of the model's global state, the same for every layout:
    per table the float64 row and column sums of its weight (exact for the
    integer values of ``fill``), per fused optimizer state its values (row-wise)
    or row and column sums, summed over the group's ranks, and the dense
    parameters (equal on every rank). Every rank of ``pg`` calls it.

    Returns:
        Tuple[str, str]: the digests of the tables (with their optimizer
        state) and of the dense part.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    sd = model.state_dict()
    osd = model.fused_optimizer.state_dict()["state"]
    specs: List[Tuple[str, Tuple[int, ...]]] = []
    for key, value in sorted(sd.items()):
        if isinstance(value, ShardedTensor):
            specs.append((key, tuple(value.size())))
    local_states = {
        f"{key}/{name}": tuple(v.size())
        for key, states in osd.items()
        for name, v in states.items()
    }
    gathered: List[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(gathered, local_states, group=pg)
    state_specs = sorted({k: v for g in gathered for k, v in g.items()}.items())
    layout: Dict[str, int] = {}
    total = 0
    for key, shape in specs + state_specs:
        layout[key] = total
        total += shape[0] + (shape[1] if len(shape) == 2 else 0)
    buffer = torch.zeros(total, dtype=torch.float64)
    with torch.no_grad():
        for key, shape in specs:
            for shard in sd[key].local_shards():
                r0, c0 = shard.metadata.shard_offsets
                _add_sums(buffer, layout[key], shape[0], shard.tensor, r0, c0)
        for key, states in osd.items():
            for name, value in states.items():
                k = f"{key}/{name}"
                for shard in value.local_shards():
                    offsets = shard.metadata.shard_offsets
                    x = shard.tensor
                    if x.dim() == 1:
                        start = layout[k] + offsets[0]
                        buffer[start : start + x.shape[0]] += x.to(torch.float64)
                    else:
                        rows = dict(state_specs)[k][0]
                        _add_sums(buffer, layout[k], rows, x, offsets[0], offsets[1])
    dist.all_reduce(buffer, group=pg)
    h = hashlib.sha256()
    for key, value in sorted(sd.items()):
        if not isinstance(value, ShardedTensor):
            h.update(key.encode())
            h.update(value.detach().contiguous().numpy().tobytes())
    digest = (hashlib.sha256(buffer.numpy().tobytes()).hexdigest(), h.hexdigest())
    digests: List[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(digests, digest, group=pg)
    if any(d != digest for d in digests):
        raise AssertionError(f"ranks of the group disagree on the state: {digests}")
    return digest


def expected_fingerprint(args: argparse.Namespace) -> str:
    """The tables' digest of ``global_fingerprint`` for the values ``fill``
    writes, from the formulas."""
    tw, rw = table_names(args)
    rows, cols = rows_per_table(args), args.dim
    names = sorted(tw + rw)
    per_elem, per_row = OPTIMIZER_STATE_BYTES[args.optimizer]
    parts: List[torch.Tensor] = []
    for name in names:
        t = _table_index(name)
        row_sums, col_sums = [], torch.zeros(cols, dtype=torch.float64)
        for r0 in range(0, rows, CHUNK_ROWS):
            block = _weight_values(t, r0, min(rows, r0 + CHUNK_ROWS), 0, cols)
            block = block.to(torch.float64)
            row_sums.append(block.sum(1))
            col_sums += block.sum(0)
        parts += [torch.cat(row_sums), col_sums]
    if per_elem or per_row:
        for name in names:
            t = _table_index(name)
            if per_row:
                parts.append(_state_values(t, 0, rows).to(torch.float64))
            else:
                block = _weight_values(t + 1000, 0, rows, 0, cols).to(torch.float64)
                parts += [block.sum(1), block.sum(0)]
    return hashlib.sha256(torch.cat(parts).numpy().tobytes()).hexdigest()


# --------------------------------------------------------------- methods ----


@dataclass
class Ctx:
    """What a rank keeps for the whole run."""

    args: argparse.Namespace
    rank: int
    world: Any
    groups: Dict[Tuple[int, ...], Any]
    envs: Dict[Tuple[int, ...], Any]
    plans: Dict[Tuple[int, ...], Any]
    resettable: bool
    ckpt_base: str
    model: Any = None


def timed(ctx: Ctx, fn: Callable[[], Any]) -> Tuple[float, int, Any]:
    """Runs ``fn`` between world barriers: (seconds, peak extra bytes, result)."""
    gc.collect()
    rss = status_kib("VmRSS")
    if ctx.resettable:
        reset_hwm()
    dist.barrier(group=ctx.world)
    t0 = time.perf_counter()
    out = fn()
    dist.barrier(group=ctx.world)
    seconds = time.perf_counter() - t0
    peak = max(0, status_kib("VmHWM") - rss) * 1024
    return seconds, peak, out


def run_live(ctx: Ctx, old: Tuple[int, ...], new: Tuple[int, ...]) -> Dict[str, Any]:
    from torchrec.distributed.resharding import move_model

    args, rank = ctx.args, ctx.rank

    def step() -> Any:
        joining = rank not in old
        return move_model(
            ctx.model if rank in old else None,
            ctx.plans[new],
            ctx.envs[new],
            participants=sorted(set(old) | set(new)),
            definition=definition(args) if joining else None,
            sharders=make_sharders(args) if joining else None,
        )

    seconds, peak, moved = timed(ctx, step)
    ctx.model = moved.model
    report = moved.report
    return {
        "seconds": seconds,
        "peak_bytes": peak,
        "phases": {
            "agree": report.phases.agree,
            "build": report.phases.build,
            "exchange": report.phases.exchange,
            "commit": report.phases.commit,
        },
        "report": {
            "rank": report.rank,
            "role": report.role,
            "tables": sum(len(t) for t in report.tables_rebuilt.values()),
            "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received,
            "bytes_received_in_place": report.bytes_received_in_place,
            "bytes_copied_locally": report.bytes_copied_locally,
            "bytes_kept_in_place": report.bytes_kept_in_place,
            "bytes_released": report.bytes_released,
            "dense_bytes": report.dense_bytes,
            "seconds": report.seconds,
        },
    }


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


def run_ckpt(
    ctx: Ctx, old: Tuple[int, ...], new: Tuple[int, ...], random_init: bool
) -> Dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    args, rank = ctx.args, ctx.rank
    box: List[Any] = [
        (
            tempfile.mkdtemp(prefix="elastic_bench_", dir=ctx.ckpt_base)
            if rank == 0
            else None
        )
    ]
    dist.broadcast_object_list(box, src=0, group=ctx.world)
    path = box[0]
    phases: Dict[str, float] = {}

    def step() -> None:
        t0 = time.perf_counter()
        if rank in old:
            model = ctx.model
            ctx.model = None
            sd = {
                "model": model.state_dict(),
                "optim": model.fused_optimizer.state_dict(),
            }
            dcp.save(sd, checkpoint_id=path, process_group=ctx.groups[old])
            del sd, model
            gc.collect()
        # the old job is over once its checkpoint is complete
        dist.barrier(group=ctx.world)
        t1 = time.perf_counter()
        if rank in new:
            model = build(args, ctx.envs[new], ctx.plans[new], random_init)
            t2 = time.perf_counter()
            sd = {
                "model": model.state_dict(),
                "optim": model.fused_optimizer.state_dict(),
            }
            dcp.load(sd, checkpoint_id=path, process_group=ctx.groups[new])
            model.load_state_dict(sd["model"])
            model.fused_optimizer.load_state_dict(sd["optim"])
            del sd
            ctx.model = model
        else:
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        phases.update(save=t1 - t0, build=t2 - t1, load=t3 - t2)

    seconds, peak, _ = timed(ctx, step)
    written = _dir_bytes(path) if rank == 0 else 0
    dist.barrier(group=ctx.world)
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {
        "seconds": seconds,
        "peak_bytes": peak,
        "phases": phases,
        "checkpoint_bytes": written,
    }


def run_floor(ctx: Ctx, old: Tuple[int, ...], new: Tuple[int, ...]) -> Dict[str, Any]:
    """
    The wire floor of a move: one ``all_to_all_single`` over the union of the
    bytes every pair of ranks exchanges in the move (the dry run's), from a
    touched send buffer into a receive buffer allocated in the step (as the
    live move fills a newly built model). The model is not touched.
    """
    dry = plan_group_move(
        GroupMove(
            ctx.plans[old],
            old,
            ctx.plans[new],
            new,
            tables_of(ctx.args),
            table_bytes_of(ctx.args),
        )
    )
    ranks = sorted(set(old) | set(new))
    assert ranks == list(range(WORLD)), ranks  # the union is the world here
    # every piece is a multiple of 4 bytes (fp32 weights and state)
    send_splits = [dry.bytes_between.get((ctx.rank, r), 0) // 4 for r in ranks]
    recv_splits = [dry.bytes_between.get((r, ctx.rank), 0) // 4 for r in ranks]
    send = torch.ones(sum(send_splits))
    received: List[torch.Tensor] = []

    def step() -> None:
        recv = torch.empty(sum(recv_splits))
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=ctx.world)
        received.append(recv)

    seconds, peak, _ = timed(ctx, step)
    assert bool((received[0] == 1).all())
    return {"seconds": seconds, "peak_bytes": peak, "phases": {}}


METHODS: Dict[str, str] = {
    "a2a_fresh": "all_to_all_single of the move's bytes per pair of ranks, "
    "fresh receive buffer (the wire floor)",
    "live": "move_model (live, over the union's exchange group)",
    "ckpt": "dcp.save on the old group, DMP build (random init), dcp.load",
    "ckpt_noinit": "the same, tables' random init skipped (as move_model)",
}


def method_list(args: argparse.Namespace) -> List[str]:
    ckpt = {
        "random": ["ckpt"],
        "skip": ["ckpt_noinit"],
        "both": ["ckpt", "ckpt_noinit"],
    }
    return ["a2a_fresh", "live"] + ckpt[args.ckpt_init]


# ---------------------------------------------------------------- worker ----


def worker(
    rank: int, port: int, args: argparse.Namespace, out_path: str, ckpt_base: str
) -> None:
    worker_setup(port, args.verbose, loggers=("torchrec", "torch.distributed"))
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timeout)
    from torchrec.distributed.types import ShardingEnv

    world = dist.group.WORLD
    # every rank creates every group, in the same order
    groups = {g: dist.new_group(list(g), timeout=timeout) for g in (OLD, SMALL)}
    envs = {
        g: ShardingEnv.from_process_group(pg) if rank in g else None
        for g, pg in groups.items()
    }
    plans = {g: make_plan(args, len(g)) for g in (OLD, SMALL)}
    ctx = Ctx(args, rank, world, groups, envs, plans, reset_hwm(), ckpt_base)

    ctx.model = build(args, envs[OLD], plans[OLD], random_init=False)
    fill(ctx.model)
    reference = global_fingerprint(ctx.model, groups[OLD])
    if rank == 0 and reference[0] != expected_fingerprint(args):
        raise AssertionError("the tables do not hold the values fill writes")
    dist.barrier(group=world)

    methods = method_list(args)
    results: List[Dict[str, Any]] = []
    for rep in range(args.warmup + args.reps):
        order = methods if rep % 2 == 0 else methods[::-1]
        for method in order:
            for move, old, new in MOVES:
                if method == "a2a_fresh":
                    r = run_floor(ctx, old, new)
                elif method == "live":
                    r = run_live(ctx, old, new)
                else:
                    r = run_ckpt(ctx, old, new, random_init=method == "ckpt")
                if method == "a2a_fresh":
                    pass  # the model stays where it is
                elif rank in new:
                    got = global_fingerprint(ctx.model, groups[new])
                    if got != reference:
                        raise AssertionError(
                            f"rank {rank}: {method} {move} (rep {rep}) changed the "
                            "model's global state"
                        )
                else:
                    assert ctx.model is None, "a rank that left keeps a model"
                dist.barrier(group=world)
                r.update(rep=rep, method=method, move=move, rank=rank)
                r["warmup"] = rep < args.warmup
                results.append(r)
                progress(
                    rank,
                    args.verbose,
                    f"  rep {rep} {method:<11} {move}: {r['seconds']:.3f} s",
                )
    gather_to_json(results, out_path, world)
    ctx.model = None
    dist.destroy_process_group()


def launch(args: argparse.Namespace, ckpt_base: str) -> List[List[Dict[str, Any]]]:
    fd, out_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        mp.spawn(
            worker,
            args=(free_port(), args, out_path, ckpt_base),
            nprocs=WORLD,
            join=True,
        )
        with open(out_path) as f:
            return json.load(f)
    finally:
        os.unlink(out_path)


# ---------------------------------------------------------------- report ----


def required_bytes(args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    """The dry run of every move, checked against the brute-force count."""
    tables = tables_of(args)
    cost = table_bytes_of(args)
    out: Dict[str, Dict[str, Any]] = {}
    for move, old, new in MOVES:
        old_plan, new_plan = make_plan(args, len(old)), make_plan(args, len(new))
        group_move = GroupMove(old_plan, old, new_plan, new, tables, cost)
        dry = plan_group_move(group_move)
        brute = owner_change_bytes(group_move)
        if brute != dry.total_bytes_moved:
            raise AssertionError(
                f"{move}: the dry run says {dry.total_bytes_moved} B, the "
                f"brute-force count of changed owners {brute} B"
            )
        # JSON keys: global ranks as strings
        out[move] = {
            "total": dry.total_bytes_moved,
            "sent": {str(r): b for r, b in dry.bytes_sent.items()},
            "received": {str(r): b for r, b in dry.bytes_received.items()},
            "copied_locally": {str(r): b for r, b in dry.bytes_copied_locally.items()},
            "tables_moved": dry.tables_moved,
            "between": {f"{a}->{b}": n for (a, b), n in dry.bytes_between.items()},
        }
    return out


def summarise(
    per_rank: List[List[Dict[str, Any]]],
    required: Dict[str, Dict[str, Any]],
    methods: List[str],
) -> Tuple[List[Dict[str, Any]], List[str]]:
    """
    Rows per (move, method) and the list of byte-check failures (empty when
    every live move sent exactly what the plans require).
    """
    failures: List[str] = []
    rows: List[Dict[str, Any]] = []
    for move, _, _ in MOVES:
        by_method: Dict[str, Dict[str, Any]] = {}
        for method in methods:
            per_rep: Dict[int, List[Dict[str, Any]]] = {}
            for results in per_rank:
                for r in results:
                    if r["move"] == move and r["method"] == method and not r["warmup"]:
                        per_rep.setdefault(r["rep"], []).append(r)
            reps = sorted(per_rep)
            # between world barriers: every rank measures the same span
            times = [max(r["seconds"] for r in per_rep[i]) for i in reps]
            row: Dict[str, Any] = {
                "move": move,
                "method": method,
                "label": METHODS[method],
                "reps": reps,
                "times_s": times,
                "min_s": min(times),
                "median_s": statistics.median(times),
                "peak_extra_mib": max(r["peak_bytes"] for i in reps for r in per_rep[i])
                / MiB,
            }
            best = reps[times.index(min(times))]
            row["phases_min_rep"] = {
                r["rank"]: r["phases"] for r in per_rep[best] if r.get("phases")
            }
            if method == "live":
                want = required[move]
                sent = [
                    sum(r["report"]["bytes_sent"] for r in per_rep[i]) for i in reps
                ]
                row["bytes_sent_total"] = sent
                row["required_bytes"] = want["total"]
                row["dense_bytes"] = max(
                    r["report"]["dense_bytes"] for i in reps for r in per_rep[i]
                )
                row["moved_mib"] = max(sent) / MiB
                row["required_mib"] = want["total"] / MiB
                for i in reps:
                    for r in per_rep[i]:
                        rep_ = r["report"]
                        rank = str(rep_["rank"])
                        # bytes that stay on a rank are copied or kept in
                        # place (the new kernel took over the old storage)
                        stayed = rep_["bytes_copied_locally"] + rep_.get(
                            "bytes_kept_in_place", 0
                        )
                        for what, key, got in (
                            ("bytes_sent", "sent", rep_["bytes_sent"]),
                            ("bytes_received", "received", rep_["bytes_received"]),
                            ("bytes that stayed", "copied_locally", stayed),
                        ):
                            if got != want[key][rank]:
                                failures.append(
                                    f"{move} rep {i} rank {rank}: {what} "
                                    f"{got} != {want[key][rank]} required"
                                )
                    if sent[reps.index(i)] != want["total"]:
                        failures.append(
                            f"{move} rep {i}: {sent[reps.index(i)]} B sent in "
                            f"all != {want['total']} B required"
                        )
                row["bytes_equal"] = not any(f.startswith(move) for f in failures)
                row["per_rank_bytes"] = {
                    str(r["report"]["rank"]): {
                        k: r["report"][k]
                        for k in (
                            "role",
                            "bytes_sent",
                            "bytes_received",
                            "bytes_received_in_place",
                            "bytes_copied_locally",
                            "bytes_kept_in_place",
                            "bytes_released",
                        )
                    }
                    for r in per_rep[reps[0]]
                }
            elif method == "a2a_fresh":
                row["moved_mib"] = required[move]["total"] / MiB
            else:
                row["checkpoint_mib"] = (
                    max(r.get("checkpoint_bytes", 0) for i in reps for r in per_rep[i])
                    / MiB
                )
            by_method[method] = row
            rows.append(row)
        live = by_method.get("live")
        floor = by_method.get("a2a_fresh")
        for method, row in by_method.items():
            row["x_floor"] = row["min_s"] / floor["min_s"] if floor else None
            if live is None or not method.startswith("ckpt"):
                row.update(x_live_min=None, x_live_median=None, paired=None)
                continue
            row["x_live_min"] = row["min_s"] / live["min_s"]
            row["x_live_median"] = row["median_s"] / live["median_s"]
            common = [i for i in row["reps"] if i in live["reps"]]
            paired = [
                row["times_s"][row["reps"].index(i)]
                / live["times_s"][live["reps"].index(i)]
                for i in common
            ]
            row["paired"] = {
                "ratios": paired,
                "min": min(paired),
                "median": statistics.median(paired),
            }
    return rows, failures


def table_text(rows: List[Dict[str, Any]]) -> str:
    cols = (
        f"{'MiB':>5} {'move':<12} {'method':<12} {'min s':>7} {'median s':>8} "
        f"{'x live':>7} {'x live':>7} {'paired x':>12} {'x floor':>7} {'peak MiB':>8} "
        f"{'MiB':>7} {'req MiB':>7} {'bytes':>6}"
    )
    sub = (
        f"{'':>5} {'':<12} {'':<12} {'':>7} {'':>8} {'(min)':>7} {'(med)':>7} "
        f"{'min / med':>12} {'(min)':>7} {'per rank':>8} {'moved':>7} {'(plans)':>7} "
        f"{'equal':>6}"
    )
    lines = [cols, sub, "-" * len(cols)]
    for r in rows:
        paired = r.get("paired")
        pcol = f"{paired['min']:.2f} / {paired['median']:.2f}" if paired else "-"
        if r["method"] == "live":
            moved = fmt(r["moved_mib"], "7.1f")
            req = fmt(r["required_mib"], "7.1f")
            eq = "yes" if r["bytes_equal"] else "NO"
        elif r["method"] == "a2a_fresh":
            moved, req, eq = fmt(r["moved_mib"], "7.1f"), "-", "-"
        else:
            moved, req, eq = fmt(r.get("checkpoint_mib"), "7.1f") + "*", "-", "-"
        lines.append(
            f"{r['size_mib']:>5g} {r['move']:<12} {r['method']:<12} {r['min_s']:>7.3f} {r['median_s']:>8.3f} "
            f"{fmt(r['x_live_min'], '7.2f'):>7} {fmt(r['x_live_median'], '7.2f'):>7} "
            f"{pcol:>12} {fmt(r['x_floor'], '7.2f'):>7} {r['peak_extra_mib']:>8.0f} "
            f"{moved:>7} {req:>7} {eq:>6}"
        )
    lines.append(
        "x live: checkpoint time / live time of the same move (min / min, median "
        "/ median); paired x: the same per repetition (min / median); x floor: "
        "min time / min of a2a_fresh; MiB moved: table bytes sent by all ranks "
        "(the reports for live), * checkpoint size on disk"
    )
    return "\n".join(lines)


def phases_text(rows: List[Dict[str, Any]]) -> str:
    lines = ["Where the time goes (min-time repetition, seconds; rank: phases):"]
    for r in rows:
        phases = r["phases_min_rep"]
        for rank in sorted(phases, key=int):
            parts = ", ".join(f"{k} {v:.3f}" for k, v in phases[rank].items())
            lines.append(
                f"  {r['size_mib']:>5g} {r['move']:<12} {r['method']:<12} "
                f"rank {rank}: {parts}"
            )
    return "\n".join(lines)


def bytes_text(rows: List[Dict[str, Any]], required: Dict[str, Any]) -> str:
    """``required``: size -> move -> the dry run's bytes."""
    lines = ["Bytes of the live moves per global rank (report = dry run):"]
    for r in rows:
        if r["method"] != "live":
            continue
        want = required[f"{r['size_mib']:g}"][r["move"]]
        lines.append(
            f"  {r['size_mib']:g} MiB {r['move']}: {want['total']} B required, sent in all "
            f"{sorted(set(r['bytes_sent_total']))} B; dense part broadcast "
            f"{r['dense_bytes']} B; tables moved {len(want['tables_moved'])}"
        )
        for rank, b in sorted(r["per_rank_bytes"].items(), key=lambda x: int(x[0])):
            lines.append(
                f"    rank {rank} ({b['role']:<6}) sent {b['bytes_sent']:>11} "
                f"(dry run {want['sent'][rank]:>11}), received "
                f"{b['bytes_received']:>11} (dry run {want['received'][rank]:>11}; "
                f"{b['bytes_received_in_place']} straight into the new kernels), "
                f"stayed {b['bytes_copied_locally'] + b['bytes_kept_in_place']:>11} "
                f"(dry run {want['copied_locally'][rank]:>11}; copied "
                f"{b['bytes_copied_locally']}, kept in place "
                f"{b['bytes_kept_in_place']}), released {b['bytes_released']}"
            )
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], path: str, title: str) -> None:
    """Bars of the minimum time per (size, move) and method, ticks at medians."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["size_mib"], r["move"]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(groups)), 4.5))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        pts = [
            next(
                r
                for r in rows
                if (r["size_mib"], r["move"]) == g and r["method"] == method
            )
            for g in groups
        ]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [p["min_s"] for p in pts], width, label=method)
        ax.scatter(
            xs, [p["median_s"] for p in pts], color="k", marker="_", s=200, zorder=3
        )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{size:g} MiB\n{move}" for size, move in groups])
    ax.set_ylabel("seconds (bar: min, tick: median)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(title, 120)), fontsize=7)
    save_figure(fig, path)


def default_ckpt_dir() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = benchmark_parser(
        "Benchmark moving a running DistributedModelParallel model "
        "between groups of ranks (shrink 4 -> 2, grow 2 -> 4) live against the "
        "checkpoint route, on 4 gloo ranks (CPU).",
        argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--sizes-mib",
        default="256",
        help="fp32 weights of all tables together, MiB, comma separated (one "
        "run of fresh ranks per size)",
    )
    p.add_argument("--tw-tables", type=int, default=8, help="table-wise tables")
    p.add_argument("--rw-tables", type=int, default=4, help="row-wise tables")
    p.add_argument("--dim", type=int, default=128, help="embedding dim")
    p.add_argument("--hidden", type=int, default=256, help="dense MLP width")
    p.add_argument(
        "--optimizer",
        default="EXACT_ROWWISE_ADAGRAD",
        choices=sorted(OPTIMIZER_STATE_BYTES),
        help="fused optimizer (EmbOptimType name)",
    )
    p.add_argument("--reps", type=int, default=3, help="measured repetitions")
    p.add_argument(
        "--warmup", type=int, default=1, help="unmeasured repetitions before them"
    )
    p.add_argument(
        "--ckpt-init",
        choices=["random", "skip", "both"],
        default="both",
        help="checkpoint route: kernels' random init (as users pay it), skipped "
        "(as move_model does), or both as two methods",
    )
    p.add_argument(
        "--ckpt-dir",
        default=None,
        help="where the checkpoint route writes (default: /dev/shm when "
        "writable, else the temp dir)",
    )
    p.add_argument(
        "--target", type=float, default=5.0, help="target ratio checkpoint / live"
    )
    p.add_argument("--timeout-s", type=int, default=600, help="process group timeout")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.tw_tables + args.rw_tables < 1:
        p.error("at least one table")
    return args


def with_size(args: argparse.Namespace, size_mib: float) -> argparse.Namespace:
    """``args`` for one size of the run."""
    out = argparse.Namespace(**vars(args))
    out.size_mib = size_mib
    return out


def model_text(args: argparse.Namespace) -> str:
    rows = rows_per_table(args)
    weights = (args.tw_tables + args.rw_tables) * rows * args.dim * 4
    return (
        f"{args.tw_tables} table-wise + {args.rw_tables} row-wise fp32 tables of "
        f"{rows} x {args.dim} ({weights / MiB:.0f} MiB of weights)"
    )


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    sizes = [float(x) for x in args.sizes_mib.split(",")]
    ckpt_base = args.ckpt_dir or default_ckpt_dir()
    fs = "tmpfs" if ckpt_base.startswith("/dev/shm") else "disk or temp dir"
    header = (
        f"elastic benchmark: {WORLD} gloo ranks on CPU, {os.cpu_count()} cores "
        f"({platform.processor() or platform.machine()}), 1 thread per rank, "
        f"torch {torch.__version__}; "
        + "; ".join(model_text(with_size(args, size)) for size in sizes)
        + f"; fused {args.optimizer}, dense MLP {args.dim}-{args.hidden}-1; reps "
        f"{args.reps} (+{args.warmup} warmup), methods interleaved; checkpoints "
        f"in {ckpt_base} ({fs})"
    )
    print(header, flush=True)
    methods = method_list(args)
    rows: List[Dict[str, Any]] = []
    failures: List[str] = []
    required: Dict[str, Any] = {}
    for size in sizes:
        sized = with_size(args, size)
        need = required_bytes(sized)
        required[f"{size:g}"] = need
        t0 = time.perf_counter()
        per_rank = launch(sized, ckpt_base)
        print(f"  {size:g} MiB: ran in {time.perf_counter() - t0:.1f} s", flush=True)
        size_rows, size_failures = summarise(per_rank, need, methods)
        for row in size_rows:
            row["size_mib"] = size
            row["model"] = model_text(sized)
        rows += size_rows
        failures += [f"{size:g} MiB {f}" for f in size_failures]
    table = table_text(rows)
    bytes_block = bytes_text(rows, required)
    phases = phases_text(rows)
    print("\n" + table + "\n\n" + bytes_block + "\n\n" + phases, flush=True)
    verdicts = []
    for row in rows:
        if row["method"] == "ckpt":
            met = row["x_live_min"] >= args.target
            verdicts.append(
                f"{row['size_mib']:g} MiB {row['move']}: checkpoint / live = "
                f"{row['x_live_min']:.2f}x (min), {row['x_live_median']:.2f}x "
                f"(median), paired {row['paired']['min']:.2f}x / "
                f"{row['paired']['median']:.2f}x (min / median): target "
                f"{args.target:g}x {'met' if met else 'NOT met'}"
            )
    verdict = "\n".join(verdicts)
    if verdict:
        print("\n" + verdict, flush=True)
    save_results(
        args.out_dir,
        "elastic_benchmark",
        {
            "header": header,
            "argv": sys.argv,
            "args": vars(args),
            "cores": os.cpu_count(),
            "world_size": WORLD,
            "checkpoint_dir": ckpt_base,
            "required_bytes": required,
            "rows": rows,
            "table": table,
            "bytes": bytes_block,
            "phases": phases,
            "verdict": verdict,
            "byte_check_failures": failures,
        },
        None if args.no_plot else lambda path: plot(rows, path, header),
    )
    if failures:
        print("\nBYTES DIFFER FROM THE PLANS:\n  " + "\n  ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()

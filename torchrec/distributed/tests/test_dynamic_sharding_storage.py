#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Multi-process tests of how a reshard treats the memory of tables that stay put
(``torchrec.distributed.resharding.storage``): on CPU their kernels keep the old
storage (same addresses, nothing copied), the pages of departed tables go back
to the OS, and a group never holds more than ``MAX_KERNELS_PER_GROUP`` kernels.
Every case is also checked against a module sharded directly with the new plan
(state, optimizer state, training), as in test_dynamic_sharding.
"""

import mmap
import unittest
from typing import Dict, List, Optional, Tuple

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding import (
    reshard_module,
    ReshardOptions,
    StorageMode,
    TransactionReport,
)
from torchrec.distributed.resharding.kept_grouping import MAX_KERNELS_PER_GROUP
from torchrec.distributed.resharding.kernel_state import batched_kernels, local_slots
from torchrec.distributed.test_utils.reshard_scenario import (
    reshard_scenario,
    ReshardScenario,
)
from torchrec.distributed.test_utils.reshard_utils import (
    assert_optimizer_states_equal,
    assert_reshard_matches_direct,
    assert_same_training,
    assert_state_dicts_equal,
    delta,
    ReshardTestBase,
    TableSpec,
    train_step,
)

FUSED = EmbeddingComputeKernel.FUSED.value
DENSE = EmbeddingComputeKernel.DENSE.value
ROWS, DIM = 64, 64  # 16 KiB of fp32 weights per table: several whole pages


def _addresses(module: torch.nn.Module) -> Dict[str, Dict[str, int]]:
    """table -> {tensor name -> address} of every local table."""
    return {
        table: {name: t.data_ptr() for name, t in slot.tensors.items()}
        for (table, _), slot in local_slots(module._lookups).items()
    }


def _kernel_count(module: torch.nn.Module) -> int:
    return sum(1 for lookup in module._lookups for _ in batched_kernels(lookup))


def _reshard_and_compare(
    scenario: ReshardScenario,
    module: torch.nn.Module,
    old: Dict[str, object],
    new: Dict[str, object],
    batch: object,
    options: Optional[ReshardOptions] = None,
) -> TransactionReport:
    """Reshards ``module`` from ``old`` to ``new`` and checks it against a
    module sharded directly with ``new``, then trains both one step."""
    state = scenario.global_state(module)
    env, device = scenario.env, scenario.device
    report = reshard_module(module, delta(old, new), env, device, options)
    reference = scenario.reference(new, state)
    assert_state_dicts_equal(reference.state_dict(), module.state_dict())
    assert_optimizer_states_equal(reference, module)
    assert_same_training(reference, module, [batch], scenario.kernel, device)
    return report


def _assert_kept_and_released(
    module: torch.nn.Module,
    before: Dict[str, Dict[str, int]],
    stays: List[str],
    report: TransactionReport,
    departed: int,
    releases: bool,
) -> None:
    """
    After a reshard: the tables that stay kept their storage, and the rank
    released the pages of the table that left it, or none.

    Args:
        module (torch.nn.Module): the resharded module.
        before (Dict[str, Dict[str, int]]): its storage addresses before.
        stays (List[str]): the tables kept in place on this rank.
        report (TransactionReport): the reshard's report.
        departed (int): the bytes of the table that left.
        releases (bool): whether that table left this rank.

    Returns:
        None
    """
    after = _addresses(module)
    for table in stays:
        assert after[table] == before[table], (table, before, after)
    if releases:
        assert report.bytes_released >= departed - 2 * mmap.PAGESIZE, report
    else:
        assert report.bytes_released == 0, report


def _run_kept_in_place(rank: int, world_size: int, port: str, kernel: str) -> None:
    """
    t0, t1 on rank 0 and t2, t3 on rank 1; t1 moves to rank 1 and back. The
    tables that stay keep their addresses (weights and optimizer state) and
    are not copied; t1's pages on rank 0 are released when it leaves.
    """
    with reshard_scenario(
        rank, world_size, port, 4, dims=[DIM] * 4, rows=[ROWS] * 4, kernel=kernel
    ) as scenario:
        specs: List[Dict[str, TableSpec]] = [
            {
                "t0": ("table_wise", 0),
                "t1": ("table_wise", t1_rank),
                "t2": ("table_wise", 1),
                "t3": ("table_wise", 1),
            }
            for t1_rank in (0, 1, 0)
        ]
        plans = [scenario.plan(s) for s in specs]
        batches = scenario.batches(3, seed=2)
        module = scenario.shard(plans[0])
        train_step(module, batches[0])

        departed = ROWS * DIM * 4
        before = _addresses(module)
        report = _reshard_and_compare(scenario, module, plans[0], plans[1], batches[1])
        stays = ["t0"] if rank == 0 else ["t2", "t3"]
        assert sorted(report.tables_kept_in_place.get("", [])) == stays, report
        assert report.bytes_copied_locally == 0, report
        _assert_kept_and_released(module, before, stays, report, departed, rank == 0)
        if rank != 0:
            assert _kernel_count(module) == 2  # the kept kernel + t1's

        before = _addresses(module)
        report = _reshard_and_compare(scenario, module, plans[1], plans[2], batches[2])
        assert sorted(report.tables_kept_in_place.get("", [])) == stays, report
        # t1 leaves rank 1 with its whole kernel: its pages are released at
        # once, not when Python's cycle collector gets to the old kernel.
        _assert_kept_and_released(module, before, stays, report, departed, rank == 1)
        assert _kernel_count(module) == (2 if rank == 0 else 1)


def _run_without_storage_reuse(rank: int, world_size: int, port: str) -> None:
    """
    Where pages cannot be released (devices other than CPU, or when asked
    for), a rebuilt group is one kernel again and the tables that stay are
    copied locally; the result is the same.
    """
    copy = ReshardOptions(storage=StorageMode.COPY)
    with reshard_scenario(
        rank, world_size, port, 4, dims=[DIM] * 4, rows=[ROWS] * 4
    ) as scenario:
        specs: List[Dict[str, TableSpec]] = [
            {f"t{i}": ("table_wise", (i + shift) // 2 % 2) for i in range(4)}
            for shift in (0, 1)
        ]
        plans = [scenario.plan(s) for s in specs]
        batches = scenario.batches(2, seed=4)
        module = scenario.shard(plans[0])
        train_step(module, batches[0])
        report = _reshard_and_compare(
            scenario, module, plans[0], plans[1], batches[1], copy
        )
        assert report.tables_kept_in_place == {}, report
        assert report.bytes_copied_locally == ROWS * (DIM + 1) * 4, report
        assert report.bytes_released == 0, report
        assert _kernel_count(module) == 1


def _run_kernels_bounded(rank: int, world_size: int, port: str) -> None:
    """
    Tables move to rank 0 one reshard at a time; each arrival gets a kernel
    and the tables already there keep theirs (kept in place), until the group
    holds MAX_KERNELS_PER_GROUP kernels: then the smallest run of kept shards
    is copied into the arrivals' kernel, and the count stays at the cap.
    """
    moves = MAX_KERNELS_PER_GROUP + 1
    num_tables = moves + 2
    with reshard_scenario(
        rank,
        world_size,
        port,
        num_tables,
        dims=[DIM] * num_tables,
        rows=[ROWS] * num_tables,
    ) as scenario:
        specs = [
            {f"t{i}": ("table_wise", 0 if i < k else 1) for i in range(num_tables)}
            for k in range(moves + 1)
        ]
        plans = [scenario.plan(s) for s in specs]
        batches = scenario.batches(moves, seed=3)
        module = scenario.shard(plans[0])
        counts: List[int] = []
        reports: List[TransactionReport] = []
        for k in range(moves):
            reports.append(
                _reshard_and_compare(
                    scenario, module, plans[k], plans[k + 1], batches[k]
                )
            )
            counts.append(_kernel_count(module))
        assert max(counts) <= MAX_KERNELS_PER_GROUP, counts
        assert all(r.bytes_copied_locally == 0 for r in reports[:-1]), reports
        if rank == 0:
            # one kernel per arrival up to the cap; then the last kept run (t3,
            # as small as the others) is copied in with the arrival
            cap = MAX_KERNELS_PER_GROUP
            assert counts == list(range(1, cap + 1)) + [cap], counts
            kept = [f"t{i}" for i in range(cap - 1)]
            last = reports[-1]
            assert sorted(last.tables_kept_in_place.get("", [])) == kept, last
            assert reports[-1].bytes_copied_locally > 0, reports[-1]
        else:
            # the tables left on rank 1 all come from its one old kernel: kept
            assert counts == [1] * moves, counts
            left = [f"t{i}" for i in range(moves, num_tables)]
            last = reports[-1]
            assert sorted(last.tables_kept_in_place.get("", [])) == left, last
            assert reports[-1].bytes_copied_locally == 0, reports[-1]


# Moves after which the shards that stay on a rank are consecutive in their old
# kernel but not in the rank's new table order: their kernel of its own (the
# kept storage) would list the rank's tables in another order than a kernel
# built directly. (world size, plans)
_ORDER_CASES: Dict[str, Tuple[int, List[Dict[str, TableSpec]]]] = {
    # rank 0 keeps t0, t2 and gets t1
    "table_wise": (
        2,
        [
            {
                "t0": ("table_wise", 0),
                "t1": ("table_wise", 1),
                "t2": ("table_wise", 0),
                "t3": ("table_wise", 1),
            },
            {
                "t0": ("table_wise", 0),
                "t1": ("table_wise", 0),
                "t2": ("table_wise", 0),
                "t3": ("table_wise", 1),
            },
        ],
    ),
    # ranks 0 and 1 keep their shards of t0, t1, t3 and get t2's
    "column_wise": (
        4,
        [
            {
                "t0": ("column_wise", [0, 1]),
                "t1": ("column_wise", [0, 1]),
                "t2": ("column_wise", [2, 3]),
                "t3": ("column_wise", [0, 1]),
            },
            {
                "t0": ("column_wise", [0, 1]),
                "t1": ("column_wise", [0, 1]),
                "t2": ("column_wise", [0, 1]),
                "t3": ("column_wise", [0, 1]),
            },
        ],
    ),
    # every rank keeps its rows of t0, t2 and gets rows of t1
    "row_wise": (
        2,
        [
            {
                "t0": ("row_wise", None),
                "t1": ("table_wise", 1),
                "t2": ("row_wise", None),
            },
            {
                "t0": ("row_wise", None),
                "t1": ("row_wise", None),
                "t2": ("row_wise", None),
            },
        ],
    ),
}


def _run_output_order(
    rank: int, world_size: int, port: str, plans: List[Dict[str, TableSpec]]
) -> None:
    assert_reshard_matches_direct(rank, world_size, port, plans, train_each_step=True)


class ReshardStorageTest(ReshardTestBase):
    def test_kept_tables_keep_their_storage_fused(self) -> None:
        self.run_ranks(_run_kept_in_place, kernel=FUSED)

    def test_kept_tables_keep_their_storage_dense(self) -> None:
        self.run_ranks(_run_kept_in_place, kernel=DENSE)

    def test_kept_tables_copied_without_storage_reuse(self) -> None:
        self.run_ranks(_run_without_storage_reuse)

    def test_kernels_per_group_stay_bounded(self) -> None:
        self.run_ranks(_run_kernels_bounded)

    def test_kept_storage_keeps_the_output_order(self) -> None:
        """
        The forward's output lists its features in the order of a module
        sharded directly under the new plan (keys and positions), although
        the kept shards have kernels of their own.
        """
        for name, (world_size, plans) in _ORDER_CASES.items():
            with self.subTest(name):
                self.run_ranks(_run_output_order, world_size=world_size, plans=plans)


if __name__ == "__main__":
    unittest.main()

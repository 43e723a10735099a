#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of ``kept_step``: the options decide whether a transaction
keeps storage; a step finds the runs of kept shards of a real sharded module
(none when it keeps nothing), hands them to the build hooks it makes, and
releases or drops them at the end. (Every kind of transaction runs through
it: the reshard, move and recovery tests check the storage kept end to end.)
"""

import unittest
from typing import Dict, List, Tuple

import torch
from torch import nn
from torchrec.distributed.resharding.kept_grouping import BATCH_KEY
from torchrec.distributed.resharding.kept_step import KeptStorageStep
from torchrec.distributed.resharding.kernel_state import batched_kernels
from torchrec.distributed.resharding.module_adapters import adapter_for
from torchrec.distributed.resharding.options import ReshardOptions, StorageMode
from torchrec.distributed.resharding.storage import storage_reuse_supported
from torchrec.distributed.test_utils.multi_process_utils import (
    grouped_config,
    single_rank_process_group,
)
from torchrec.distributed.test_utils.reshard_utils import FUSED, one_rank_table_wise_ebc

CPU = torch.device("cpu")
PATH = "ebc"


def _groups(module: nn.Module) -> Dict[Tuple[str, str], List[nn.Module]]:
    """(path, sharding type) -> the module's batched kernels, as a participant sees them."""
    return {
        (PATH, sharding_type): list(batched_kernels(lookup))
        for sharding_type, _, lookup in adapter_for(module).groups()
    }


class KeptStorageStepOptionsTest(unittest.TestCase):
    def test_storage_is_kept_only_under_reuse_on_a_device_that_shares_it(
        self,
    ) -> None:
        reuse = ReshardOptions(storage=StorageMode.REUSE)
        copy = ReshardOptions(storage=StorageMode.COPY)
        self.assertEqual(
            KeptStorageStep.for_options(reuse, CPU).reuse,
            storage_reuse_supported(CPU),
        )
        self.assertFalse(KeptStorageStep.for_options(copy, CPU).reuse)
        # a model that changes device keeps nothing
        meta = torch.device("meta")
        self.assertFalse(KeptStorageStep.for_options(reuse, CPU, meta).reuse)
        self.assertEqual(
            KeptStorageStep.for_options(reuse, CPU, CPU).reuse,
            storage_reuse_supported(CPU),
        )


class KeptStorageStepTest(unittest.TestCase):
    """A step over a real one-rank module of three table-wise tables, one kernel."""

    def _module(self) -> nn.Module:
        return one_rank_table_wise_ebc(self._pg, FUSED, "sgd")

    def setUp(self) -> None:
        if not storage_reuse_supported(CPU):
            self.skipTest("this platform cannot share kernel storage")
        self._context = single_rank_process_group()
        self._pg = self._context.__enter__()

    def tearDown(self) -> None:
        self._context.__exit__(None, None, None)

    def test_a_step_that_keeps_nothing_finds_no_runs(self) -> None:
        module = self._module()
        step = KeptStorageStep(reuse=False)
        self.assertEqual(step.find_runs(_groups(module), {PATH: {"t0", "t1"}}), {})
        self.assertFalse(step.has_runs)

    def test_runs_are_the_kept_tables_at_consecutive_positions(self) -> None:
        module = self._module()
        # t1 changes: t0 and t2 are runs of their own, the larger (t2) first
        step = KeptStorageStep(reuse=True)
        facts = step.find_runs(_groups(module), {PATH: {"t0", "t2"}})
        self.assertEqual(facts, {PATH: [["t2"], ["t0"]]})
        # t2 changes: one run of the two first tables
        step = KeptStorageStep(reuse=True)
        self.assertEqual(
            step.find_runs(_groups(module), {PATH: {"t0", "t1"}}),
            {PATH: [["t0", "t1"]]},
        )
        self.assertTrue(step.has_runs)

    def test_the_runs_go_to_the_hooks_which_release_once(self) -> None:
        module = self._module()
        step = KeptStorageStep(reuse=True)
        facts = step.find_runs(_groups(module), {PATH: {"t0", "t1"}})
        placements = {PATH: {t: ("table_wise", (0,)) for t in ("t0", "t1", "t2")}}
        keys = KeptStorageStep.agree([(0, facts)], placements, {})
        self.assertEqual(set(keys[PATH]), {"t0", "t1"})
        old = [b for kernels in _groups(module).values() for b in kernels]
        hooks, grouping = step.build_hooks(old, keys, {PATH: {}})
        self.assertIs(step.hooks, hooks)
        self.assertFalse(step.has_runs)  # the hooks hold the old kernels now
        config = grouped_config(["t0", "t1"], {BATCH_KEY: keys[PATH]["t0"]})
        found = hooks._kept_run(config, type(old[0].emb_module))
        self.assertIsNotNone(found)
        self.assertIs(found[0], old[0].emb_module)
        # nothing was swapped: the old module holds its storage, nothing is
        # given back, and the step lets go of the hooks
        self.assertEqual(step.release([module]), 0)
        self.assertIsNone(step.hooks)
        self.assertEqual(step.release([module]), 0)

    def test_abort_drops_runs_and_hooks(self) -> None:
        module = self._module()
        step = KeptStorageStep(reuse=True)
        step.find_runs(_groups(module), {PATH: {"t0"}})
        step.abort()
        self.assertFalse(step.has_runs)
        step.find_runs(_groups(module), {PATH: {"t0"}})
        step.build_hooks([], {}, {})
        step.abort()
        self.assertIsNone(step.hooks)


if __name__ == "__main__":
    unittest.main()

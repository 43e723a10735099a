#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of ``kept_grouping``: the batch keys that give runs of kept
shards kernels of their own (the same on every rank, keeping the user's own
key, and each module's runs apart from another's of equally named tables),
the cap on kernels per group, and the keys a rebuilt group's tables get;
and of ``retired``'s holders: they are every reference a sharded module holds
to its kernels' storage. (The release of pages itself is tested in
test_memory.py.)
"""

import gc
import unittest
from collections import OrderedDict
from typing import Any, Dict, Optional

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding.kept_grouping import (
    BATCH_KEY,
    batch_keys,
    KeptBatchKey,
    KeptGrouping,
    KeptRun,
    key_rebuilt_groups,
    MAX_KERNELS_PER_GROUP,
    user_batch_key,
    with_batch_key,
)
from torchrec.distributed.resharding.kernel_state import batched_kernels
from torchrec.distributed.resharding.retired import (
    _table_state,
    _use_count,
    module_holders,
    tensors_per_storage,
)
from torchrec.distributed.resharding.storage import KeptStorage
from torchrec.distributed.test_utils.multi_process_utils import (
    grouped_config,
    single_rank_process_group,
)
from torchrec.distributed.test_utils.reshard_utils import one_rank_table_wise_ebc
from torchrec.distributed.types import ParameterSharding
from torchrec.modules.embedding_configs import EmbeddingBagConfig

TW = "table_wise"


class _Kernel:
    """An old kernel, as a run of kept shards names it."""


def _info(name: str, batch_key: Any = None) -> EmbeddingShardingInfo:
    config = EmbeddingBagConfig(
        name=name, embedding_dim=4, num_embeddings=8, feature_names=[f"f_{name}"]
    )
    fused: Dict[str, Any] = {"learning_rate": 0.1}
    if batch_key is not None:
        fused[BATCH_KEY] = batch_key
    return EmbeddingShardingInfo(
        embedding_config=config,
        param_sharding=ParameterSharding(
            sharding_type=TW, compute_kernel="fused", ranks=[0]
        ),
        param=torch.empty(0),
        fused_params=fused,
    )


class BatchKeysTest(unittest.TestCase):
    def test_tables_of_one_run_share_a_key_on_every_rank(self) -> None:
        # rank 0 keeps a run [a, b], rank 1 a run [b] and a run [c]
        runs = [(0, {"m": [["a", "b"]]}), (1, {"m": [["b"], ["c"]]})]
        placements = {"m": {t: (TW, (0, 1)) for t in "abcd"}}
        keys = batch_keys(runs, placements, {"m": {"a": "user"}})
        self.assertEqual(keys["m"]["a"], KeptBatchKey("user", ((0, 0),), "m"))
        self.assertEqual(keys["m"]["b"], KeptBatchKey(None, ((0, 0), (1, 0)), "m"))
        self.assertEqual(keys["m"]["c"], KeptBatchKey(None, ((1, 1),), "m"))
        self.assertNotIn("d", keys["m"])  # changed: no key of a run
        # the same facts in another order give the same keys
        self.assertEqual(
            batch_keys(list(reversed(runs)), placements, {"m": {"a": "user"}}), keys
        )

    def test_equally_named_tables_of_two_modules_keep_their_own_storage(
        self,
    ) -> None:
        # an EBC's and an EC's table "t1", each the first run of its module on
        # rank 0: equal runs, and only the module's path tells whose kernel a
        # new kernel takes over (it took the other's storage before)
        runs = [(0, {"ebc": [["t1"]], "ec": [["t1"]]})]
        placements = {p: {"t1": (TW, (0,))} for p in ("ebc", "ec")}
        keys = batch_keys(runs, placements, {})
        self.assertNotEqual(keys["ebc"]["t1"], keys["ec"]["t1"])
        kernels = {p: _Kernel() for p in ("ebc", "ec")}
        shards = [("t1", (0, 0))]
        storage = KeptStorage(
            runs=[KeptRun(p, kernels[p], 0, shards) for p in ("ec", "ebc")],
            keys=keys,
        )
        for path in ("ebc", "ec"):
            config = grouped_config(["t1"], {BATCH_KEY: keys[path]["t1"]})
            found = storage._kept_run(config, _Kernel)
            self.assertIsNotNone(found)
            self.assertIs(found[0], kernels[path], path)

    def test_too_many_kernels_give_no_keys(self) -> None:
        names = [f"t{i}" for i in range(MAX_KERNELS_PER_GROUP + 1)]
        # every table a run of its own on rank 0: one kernel each, plus the rest
        runs = [(0, {"m": [[n] for n in names]})]
        placements = {"m": {n: (TW, (0,)) for n in names + ["x"]}}
        self.assertEqual(batch_keys(runs, placements, {}), {"m": {}})
        # within the cap, every run keeps its key
        placements = {"m": {n: (TW, (0,)) for n in names[:2] + ["x"]}}
        runs = [(0, {"m": [[n] for n in names[:2]]})]
        self.assertEqual(set(batch_keys(runs, placements, {})["m"]), set(names[:2]))

    def test_user_keys_survive(self) -> None:
        key = KeptBatchKey("user", ((0, 0),))
        self.assertEqual(user_batch_key({BATCH_KEY: key}), "user")
        self.assertEqual(user_batch_key({BATCH_KEY: "mine"}), "mine")
        self.assertIsNone(user_batch_key(None))
        self.assertEqual(with_batch_key({BATCH_KEY: key, "x": 1}, None), {"x": 1})


class KeyRebuiltGroupsTest(unittest.TestCase):
    def test_tables_of_rebuilt_groups_get_the_agreed_keys(self) -> None:
        stale = KeptBatchKey(None, ((3, 3),))  # from an earlier transaction
        infos = OrderedDict(
            [
                (TW, [_info("a"), _info("b", stale), _info("c", "user")]),
                ("row_wise", [_info("d", stale)]),
            ]
        )
        kept = KeptBatchKey(None, ((0, 0),))
        params = {"m": {i.embedding_config.name: i.param for i in infos[TW]}}
        hooks = KeptGrouping(keys={"m": {"a": kept, "c": kept}}, params=params)
        untouched = infos["row_wise"][0]
        key_rebuilt_groups(infos, [TW], hooks)
        keys: Dict[str, Optional[Any]] = {
            i.embedding_config.name: (i.fused_params or {}).get(BATCH_KEY)
            for group in infos.values()
            for i in group
        }
        self.assertEqual(keys["a"], kept)
        self.assertIsNone(keys["b"])  # a stale key of a run is dropped
        self.assertEqual(keys["c"], KeptBatchKey("user", ((0, 0),)))  # path kept
        self.assertIs(infos["row_wise"][0], untouched)  # not rebuilt
        self.assertEqual(infos[TW][0].fused_params["learning_rate"], 0.1)


def _references(module: torch.nn.Module) -> Dict[int, int]:
    """
    Storage address -> references to it (its use count), for the storage of
    every table's state in the module's kernels.
    """
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage()
        for lookup in module._lookups
        for batched in batched_kernels(lookup)
        for t in _table_state(batched.emb_module)
    }
    gc.collect()  # garbage is nobody's reference
    # (less this function's own storage object)
    return {ptr: _use_count(storage) - 1 for ptr, storage in storages.items()}


class ModuleHoldersTest(unittest.TestCase):
    """
    ``module_holders`` are all the references a sharded module holds to its
    kernels' storage, and nothing a caller holds: for a module nobody else
    references, each storage's use count is exactly its holders' count.
    """

    def _assert_holders_are_the_references(self, kernel: str) -> None:
        with single_rank_process_group() as pg:
            module = one_rank_table_wise_ebc(pg, kernel, "rowwise_adagrad")

            references = _references(module)
            self.assertTrue(references)
            held = tensors_per_storage(module_holders(module))
            self.assertEqual(held, references)

            # what a caller takes (its parameters, a view of a state-dict
            # tensor) is not the module's: the holders stay as they were
            params = dict(module.named_parameters())
            local = module.state_dict()["embedding_bags.t1.weight"].local_shards()[0]
            view = local.tensor.view(-1)
            after = _references(module)
            self.assertEqual(tensors_per_storage(module_holders(module)), held)
            ptr = view.untyped_storage().data_ptr()
            self.assertGreater(after[ptr], held[ptr])
            del params, local, view

    def test_holders_of_a_fused_module(self) -> None:
        self._assert_holders_are_the_references(EmbeddingComputeKernel.FUSED.value)

    def test_holders_of_a_dense_module(self) -> None:
        self._assert_holders_are_the_references(EmbeddingComputeKernel.DENSE.value)


if __name__ == "__main__":
    unittest.main()

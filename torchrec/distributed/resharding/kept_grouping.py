#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Kept shards and their grouping: which shards a transaction leaves exactly
where they are, and how TorchRec is made to give them kernels of their own.
Everything here goes through TorchRec's :class:`ShardingBuildHooks` (a patch
of the series), scoped to the building call in the building thread.

On each rank, the shards that stay exactly where they are form *runs*,
maximal sequences at consecutive positions of one old kernel
(:func:`kept_runs`). Every rank states its runs in the agreement; the
coordinator gives every table in a run the same batch key on every rank
(:func:`batch_keys`): a :class:`KeptBatchKey` in TorchRec's ``_batch_key``
grouping fused param, keeping the user's own key. TorchRec then groups the
shards of a run into a kernel of their own (:class:`KeptGrouping`), which
``storage.KeptStorage`` builds on a view of the old kernel's storage. The key
is an object, looked up by equality: no string is ever parsed back. A module
with such kernels lists its output as one sharded directly under its plan
would (:func:`direct_output_order`).

Every sharding group keeps at most ``MAX_KERNELS_PER_GROUP`` kernels per rank:
runs beyond it are copied.
"""

from dataclasses import dataclass, replace
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo, group_tables
from torchrec.distributed.embedding_types import ShardingBuildHooks

BATCH_KEY = "_batch_key"
MAX_KERNELS_PER_GROUP = 4

# A run of kept shards: (rank in the transaction, index of the run on it)
RunId = Tuple[int, int]
ShardKey = Tuple[str, Tuple[int, ...]]


@dataclass(frozen=True)
class KeptBatchKey:
    """
    The batch key (TorchRec's ``_batch_key`` grouping fused param, which only
    decides which tables share a kernel) of a table in runs of kept shards.

    Args:
        user (Any): the user's own batch key, kept (None for none).
        runs (Tuple[RunId, ...]): the runs the table's shards are in, on every
            rank: tables of equal runs share kernels, others do not.
        path (str): the sharded module's path: runs are numbered per module,
            so two modules' runs of equally named tables (an EBC's and an
            EC's "t1", say) have equal ``runs``, and only the path tells
            whose storage a new kernel takes over.
    """

    user: Any
    runs: Tuple[RunId, ...]
    path: str = ""


def user_batch_key(fused_params: Optional[Mapping[str, Any]]) -> Any:
    """The user's own batch key in a table's fused params (None for none)."""
    key = (fused_params or {}).get(BATCH_KEY)
    return key.user if isinstance(key, KeptBatchKey) else key


def with_batch_key(
    fused_params: Optional[Mapping[str, Any]], key: Any
) -> Dict[str, Any]:
    """A table's fused params with ``key`` as its batch key (None: no key)."""
    out = dict(fused_params or {})
    out.pop(BATCH_KEY, None)
    if key is not None:
        out[BATCH_KEY] = key
    return out


def user_fused_params(fused_params: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """A table's fused params with the user's own batch key only (no kept one)."""
    return with_batch_key(fused_params, user_batch_key(fused_params))


def shard_key(table: Any) -> ShardKey:
    """(table name, shard offsets) of a kernel's table shard."""
    metadata = table.local_metadata
    offsets = tuple(metadata.shard_offsets) if metadata is not None else ()
    return table.name, offsets


@dataclass
class KeptRun:
    """
    Shards of tables that a transaction leaves exactly where they are, at
    consecutive positions of one old batched kernel of this rank: the new
    kernel for them can be built on a view of the old kernel's storage.

    Args:
        path (str): the sharded module's path.
        kernel (nn.Module): the old fbgemm kernel.
        first (int): the position of the first shard in it.
        shards (List[ShardKey]): the shards, in kernel order.
    """

    path: str
    kernel: nn.Module
    first: int
    shards: List[ShardKey]


def kept_runs(
    groups: Mapping[Tuple[str, str], Sequence[nn.Module]],
    kept: Mapping[str, AbstractSet[str]],
) -> List[KeptRun]:
    """
    This rank's runs of kept shards: maximal runs of consecutive shards of
    kept tables in each old batched kernel, the ``MAX_KERNELS_PER_GROUP - 1``
    largest per sharding group (the rest of a rebuilt group takes one more
    kernel).

    Args:
        groups (Mapping[Tuple[str, str], Sequence[nn.Module]]): (module path,
            sharding type) -> the group's old TorchRec batched kernels.
        kept (Mapping[str, AbstractSet[str]]): module path -> the tables whose
            shards stay exactly where they are.

    Returns:
        List[KeptRun]: the runs, by group, largest first.
    """
    out: List[KeptRun] = []
    for (path, _), kernels in groups.items():
        tables_kept = kept.get(path, set())
        group_runs: List[Tuple[int, KeptRun]] = []
        for batched in kernels:
            tables = list(batched.config.embedding_tables)
            position = 0
            while position < len(tables):
                if tables[position].name not in tables_kept:
                    position += 1
                    continue
                first = position
                while position < len(tables) and tables[position].name in tables_kept:
                    position += 1
                run = tables[first:position]
                size = sum(t.local_rows * t.local_cols for t in run)
                shards = [shard_key(t) for t in run]
                group_runs.append(
                    (size, KeptRun(path, batched.emb_module, first, shards))
                )
        group_runs.sort(key=lambda x: -x[0])
        out += [run for _, run in group_runs[: MAX_KERNELS_PER_GROUP - 1]]
    return out


def run_facts(runs: Sequence[KeptRun]) -> Dict[str, List[List[str]]]:
    """
    What the others need of this rank's runs: per module, the tables of each
    run (a run's position in its module's list numbers it).
    """
    out: Dict[str, List[List[str]]] = {}
    for run in runs:
        out.setdefault(run.path, []).append([name for name, _ in run.shards])
    return out


# (sharding type, the ranks holding shards) of a table under the new plan
TablePlacement = Tuple[str, Tuple[int, ...]]


def batch_keys(
    all_runs: Sequence[Tuple[int, Mapping[str, List[List[str]]]]],
    placements: Mapping[str, Mapping[str, TablePlacement]],
    user_keys: Mapping[str, Mapping[str, Any]],
) -> Dict[str, Dict[str, KeptBatchKey]]:
    """
    The batch key of every table in a run of kept shards, the same on every
    rank (pure: the coordinator computes it from every rank's run facts): the
    runs it is in, so the shards of one run get a kernel of their own on its
    rank and the tables of each rank group alike everywhere. A module's
    sharding type that would get more than ``MAX_KERNELS_PER_GROUP`` kernels
    on a rank gets no keys (one kernel, kept shards copied).

    Args:
        all_runs (Sequence[Tuple[int, Mapping[str, List[List[str]]]]]): (rank,
            its :func:`run_facts`) for every rank that has runs.
        placements (Mapping[str, Mapping[str, TablePlacement]]): module path ->
            table -> its sharding type and ranks under the new plan.
        user_keys (Mapping[str, Mapping[str, Any]]): module path -> table ->
            the user's own batch key (None for none).

    Returns:
        Dict[str, Dict[str, KeptBatchKey]]: module path -> table -> its key.
    """
    runs: Dict[str, Dict[str, List[RunId]]] = {}
    for rank, rank_runs in all_runs:
        for path, path_runs in sorted(rank_runs.items()):
            for index, tables in enumerate(path_runs):
                for table in tables:
                    ids = runs.setdefault(path, {}).setdefault(table, [])
                    if (rank, index) not in ids:
                        ids.append((rank, index))
    keys: Dict[str, Dict[str, KeptBatchKey]] = {}
    for path, tables in sorted(runs.items()):
        path_keys = {
            table: KeptBatchKey(
                user_keys.get(path, {}).get(table), tuple(sorted(ids)), path
            )
            for table, ids in tables.items()
        }
        kernels: Dict[Tuple[str, int], Set[Any]] = {}
        for table, (sharding_type, ranks) in placements[path].items():
            key = path_keys.get(table, user_keys.get(path, {}).get(table))
            for rank in ranks:
                kernels.setdefault((sharding_type, rank), set()).add(key)
        crowded = {
            sharding_type
            for (sharding_type, _), ks in kernels.items()
            if len(ks) > MAX_KERNELS_PER_GROUP
        }
        keys[path] = {
            table: key
            for table, key in path_keys.items()
            if placements[path][table][0] not in crowded
        }
    return keys


def key_rebuilt_groups(
    infos: Dict[str, List[EmbeddingShardingInfo]],
    rebuilt_types: Sequence[str],
    hooks: "KeptGrouping",
) -> None:
    """
    Gives every table of a rebuilt group the batch key the transaction agreed
    on (runs of kept shards get keys of their own; the others only the user's
    key, whatever an earlier transaction gave them), as a module's ``__init__``
    would under the same hooks.

    Args:
        infos (OrderedDict[str, List[EmbeddingShardingInfo]]): the module's
            infos after the transaction; changed in place.
        rebuilt_types (Sequence[str]): sharding types whose group is rebuilt.
        hooks (KeptGrouping): the transaction's batch keys.

    Returns:
        None
    """
    for sharding_type in rebuilt_types:
        group = infos.get(sharding_type, [])
        for i, info in enumerate(group):
            fused_params = hooks.table_fused_params(
                info.embedding_config.name,
                info.param,
                user_fused_params(info.fused_params),
            )
            if fused_params != info.fused_params:
                group[i] = replace(info, fused_params=fused_params)


def direct_output_order(
    groups: Sequence[Tuple[Any, Sequence[EmbeddingShardingInfo]]],
) -> Optional[List[str]]:
    """
    The output keys (embedding names) of a module whose tables in runs of kept
    shards have kernels of their own, in the order a module sharded directly
    under the same plan lists them. A sharding lists its keys in the order of
    its tables' grouping into kernels, rank after rank (a key once, for
    column shards); a kept run's batch key makes a kernel of its own, so it
    may list the rank's tables in another order than the grouping without
    it, which this one follows. Pure: the shardings' own ``_shard`` and
    TorchRec's ``group_tables``.

    Args:
        groups (Sequence[Tuple[Any, Sequence[EmbeddingShardingInfo]]]): the
            module's (sharding, its tables' infos) per group, in group order.

    Returns:
        Optional[List[str]]: the keys, or None when no table has a kept
        batch key (the module lists them in that order already).
    """
    if not any(
        isinstance((info.fused_params or {}).get(BATCH_KEY), KeptBatchKey)
        for _, infos in groups
        for info in infos
    ):
        return None
    keys: List[str] = []
    for sharding, infos in groups:
        direct = [
            replace(info, fused_params=user_fused_params(info.fused_params))
            for info in infos
        ]
        names = (
            name
            for rank_groups in group_tables(sharding._shard(direct))
            for config in rank_groups
            for name in config.embedding_names()
        )
        keys += list(dict.fromkeys(names))
    return keys


class KeptGrouping(ShardingBuildHooks):
    """
    The sharding build hooks of a transaction: tables in runs of kept shards
    get their agreed batch key (so that TorchRec gives each run a kernel of
    its own, see ``storage.KeptStorage``), and, when the transaction asks for it,
    modules make their ShardedTensors from their (agreed) plan's metadata.

    Args:
        keys (Mapping[str, Mapping[str, KeptBatchKey]]): module path -> table
            -> its agreed batch key.
        params (Mapping[str, Mapping[str, torch.Tensor]]): module path ->
            table -> the parameter the sharded module is built from (table
            names repeat across modules; the hook gets the parameter).
        sharded_tensors_from_metadata (bool): modules built meanwhile make
            their ShardedTensors from their plan's metadata.
    """

    def __init__(
        self,
        keys: Optional[Mapping[str, Mapping[str, KeptBatchKey]]] = None,
        params: Optional[Mapping[str, Mapping[str, torch.Tensor]]] = None,
        sharded_tensors_from_metadata: bool = False,
    ) -> None:
        keys = keys or {}
        params = params or {}
        self._from_metadata = sharded_tensors_from_metadata
        # table -> (parameter, key) per module that has it: a table name is
        # unique within a module, the parameter tells the modules apart
        self._keys: Dict[str, List[Tuple[torch.Tensor, KeptBatchKey]]] = {}
        for path, table_keys in keys.items():
            for table, key in table_keys.items():
                if table in params.get(path, {}):
                    self._keys.setdefault(table, []).append((params[path][table], key))

    def table_fused_params(
        self, table: str, param: torch.Tensor, fused_params: Dict[str, Any]
    ) -> Dict[str, Any]:
        """
        Args:
            table (str): a table of a module being sharded.
            param (torch.Tensor): its parameter in the unsharded module.
            fused_params (Dict[str, Any]): the fused params of its kernel.

        Returns:
            Dict[str, Any]: them with the table's agreed batch key, if any.
        """
        key = next((k for p, k in self._keys.get(table, []) if p is param), None)
        if key is None:
            return fused_params
        user = user_batch_key(fused_params)
        return with_batch_key(fused_params, KeptBatchKey(user, key.runs, key.path))

    def sharded_tensors_from_metadata(self) -> bool:
        return self._from_metadata

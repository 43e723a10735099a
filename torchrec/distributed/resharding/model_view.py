#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A ``DistributedModelParallel`` model as the moves between groups of ranks read
it (``elastic``, ``unshard``, ``rebalance``, ``fault``): its env and sharders,
its sharded modules and their tables, its dense (replicated) part, its shards
as slots, the facts a move agrees on. Reading only: building models is
``model_build``'s, and the dense part travels with ``exchange.broadcast_dense``.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding.elastic_plan import (
    MoveFacts,
    ranks_digest,
    tables_digest,
)
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.module_adapters import adapter_for
from torchrec.distributed.resharding.optimizer_state import local_table_facts
from torchrec.distributed.resharding.plan import ReshardError
from torchrec.distributed.resharding.slots import keyed_slots, LocalSlot, SlotKey
from torchrec.distributed.resharding.whole_plan import plan_digest, TableShape
from torchrec.distributed.train_pipeline.utils import BaseForward
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import data_type_to_dtype
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
)


def sharded_modules(root: nn.Module) -> Dict[str, nn.Module]:
    """
    Args:
        root (nn.Module): a model (``DistributedModelParallel.module``).

    Returns:
        Dict[str, nn.Module]: its sharded embedding modules by path.
    """
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    kinds = (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)
    return {p: m for p, m in root.named_modules() if isinstance(m, kinds)}


def model_env(model: nn.Module) -> ShardingEnv:
    """The sharding env (process group) of a ``DistributedModelParallel``."""
    return model._env


def model_sharders(model: nn.Module) -> List[Any]:
    """The sharders a ``DistributedModelParallel`` was sharded with."""
    return list(model._sharder_map.values())


def plain_tables(module: nn.Module) -> List[TableShape]:
    """The tables of an unsharded EmbeddingBagCollection / EmbeddingCollection."""
    return [(c.name, c.num_embeddings, c.embedding_dim) for c in plain_configs(module)]


def sharded_tables(module: nn.Module) -> List[TableShape]:
    """The tables of a sharded embedding module."""
    adapter = adapter_for(module)
    return [(c.name, *adapter.table_shape(c.name)) for c in adapter.configs()]


def is_dense(name: str, sharded_paths: Sequence[str]) -> bool:
    """Whether a parameter or buffer lies outside the sharded modules."""
    return not any(name.startswith(p + ".") for p in sharded_paths)


def dense_tensors(
    root: nn.Module, paths: Optional[Sequence[str]] = None
) -> Dict[str, torch.Tensor]:
    """
    Args:
        root (nn.Module): a model.
        paths (Optional[Sequence[str]]): the paths of its sharded (or planned)
            modules (default: its sharded modules).

    Returns:
        Dict[str, torch.Tensor]: its parameters and buffers outside those
        modules, by name (sorted): the replicated, dense part.
    """
    paths = list(sharded_modules(root)) if paths is None else list(paths)
    out: Dict[str, torch.Tensor] = {}
    for name, t in list(root.named_parameters()) + list(root.named_buffers()):
        if is_dense(name, paths):
            out[name] = t
    return dict(sorted(out.items()))


def sharded_lookups(root: nn.Module) -> List[nn.Module]:
    """The lookups of every sharded module of ``root``, in module order."""
    return [
        lookup
        for module in sharded_modules(root).values()
        for lookup in adapter_for(module).lookups()
    ]


def sharded_slots(root: nn.Module) -> Dict[SlotKey, LocalSlot]:
    """This rank's shards of every sharded module, keyed by "path:table"."""
    out: Dict[SlotKey, LocalSlot] = {}
    for path, module in sharded_modules(root).items():
        adapter = adapter_for(module)
        slots = adapter.local_slots(adapter.lookups())
        out.update(keyed_slots(slots, lambda t, p=path: TableKey(p, t)))
    return out


def plain_weight(module: nn.Module, table: str) -> torch.Tensor:
    """The weight of a table of an unsharded module."""
    if isinstance(module, EmbeddingBagCollection):
        return module.embedding_bags[table].weight
    return module.embeddings[table].weight


def table_weights(
    definition: nn.Module, tables: Mapping[str, Sequence[str]]
) -> Dict[str, Dict[str, torch.Tensor]]:
    """The definition's weight of each named table, by module path."""
    return {
        path: {t: plain_weight(definition.get_submodule(path), t) for t in names}
        for path, names in tables.items()
    }


def attached_to_pipeline(module: nn.Module) -> bool:
    """
    Whether a train pipeline has replaced the module's forward: its batches in
    flight ran the input dist over the old group, which a move replaces.
    """
    return isinstance(module.__dict__.get("forward"), BaseForward)


def defined_tables(
    definition: nn.Module, plan: ShardingPlan
) -> Dict[str, List[TableShape]]:
    """The tables of the modules a plan shards, in an unsharded definition."""
    if not isinstance(plan, ShardingPlan):
        raise ReshardError(f"expected a ShardingPlan, got {type(plan).__name__}")
    out: Dict[str, List[TableShape]] = {}
    for path in sorted(plan.plan):
        try:
            module = definition.get_submodule(path)
        except AttributeError:
            raise ReshardError(
                f"the plan shards module '{path}', which the definition lacks"
            ) from None
        if not isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
            raise ReshardError(
                f"module '{path}' of the definition is a {type(module).__name__}, "
                "not an EmbeddingBagCollection or EmbeddingCollection"
            )
        out[path] = plain_tables(module)
    return out


def model_facts(model: nn.Module) -> MoveFacts:
    """
    What a rank holding a model states in a move: digests of its group, plan
    and tables and the facts of its table shards; the group's first rank adds
    the group, the plan and the tables themselves.

    Args:
        model (DistributedModelParallel): the model.

    Returns:
        MoveFacts: the facts (the move adds its own).
    """
    ranks = dist.get_process_group_ranks(model._env.process_group)
    modules = sharded_modules(model.module)
    tables = {path: sharded_tables(m) for path, m in modules.items()}
    facts = MoveFacts(
        old_group=ranks_digest(ranks),
        plan=plan_digest(model.plan),
        model=tables_digest(tables),
        table_facts={
            path: local_table_facts(
                adapter_for(m).lookups(), [name for name, _, _ in tables[path]]
            )
            for path, m in modules.items()
        },
    )
    if dist.get_rank() == ranks[0]:
        facts.old_ranks = ranks
        facts.old_plan = model.plan
        facts.tables = tables
    return facts


def plain_configs(module: nn.Module) -> List[Any]:
    """The table configs of an unsharded EBC / EC, in module order."""
    if isinstance(module, EmbeddingBagCollection):
        return module.embedding_bag_configs()
    return module.embedding_configs()


def plain_weight_dtypes(
    definition: nn.Module, tables: Mapping[str, Sequence[TableShape]]
) -> List[Tuple[str, str, torch.dtype]]:
    """(module path, table, the dtype its weight travels in) of every table."""
    out = []
    for path, shapes in sorted(tables.items()):
        configs = {c.name: c for c in plain_configs(definition.get_submodule(path))}
        for name, _, _ in shapes:
            out.append((path, name, data_type_to_dtype(configs[name].data_type)))
    return out

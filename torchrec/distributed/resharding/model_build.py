#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Building the models a move needs, from what ``model_view`` reads: a plain
(unsharded) twin of a sharded module, the unsharded definition a model was
built from (its tables on the meta device), a ``DistributedModelParallel``
built from a definition with every table left uninitialised (every byte is
moved in, under the transaction's build hooks), and releasing a model's
kernels and groups. Nothing here runs a collective.
"""

import contextlib
import copy
from typing import Any, Iterator, List, Mapping, Optional, Sequence

import torch
from torch import nn
from torchrec.distributed.batched_embedding_kernel import (
    kernel_build_hooks,
    KernelBuildHooks,
)
from torchrec.distributed.embedding_types import (
    sharding_build_hooks,
    ShardingBuildHooks,
)
from torchrec.distributed.resharding.model_view import plain_configs, sharded_modules
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingCollection,
)


def plain_twin(module: nn.Module, device: torch.device) -> nn.Module:
    """An unsharded module of the same tables as a sharded one."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    if isinstance(module, ShardedEmbeddingCollection):
        return EmbeddingCollection(
            tables=copy.deepcopy(module._embedding_configs),
            device=device,
            need_indices=module._need_indices,
        )
    return EmbeddingBagCollection(
        tables=copy.deepcopy(module._embedding_bag_configs),
        is_weighted=module._is_weighted,
        device=device,
    )


def _meta_twin(module: nn.Module) -> nn.Module:
    """A module of the same tables on the meta device (no weights)."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    meta = torch.device("meta")
    if isinstance(module, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)):
        return plain_twin(module, meta)
    if isinstance(module, EmbeddingCollection):
        return EmbeddingCollection(
            tables=copy.deepcopy(module.embedding_configs()),
            device=meta,
            need_indices=module.need_indices(),
        )
    return EmbeddingBagCollection(
        tables=copy.deepcopy(module.embedding_bag_configs()),
        is_weighted=module.is_weighted(),
        device=meta,
    )


def meta_definition(root: nn.Module, paths: Sequence[str]) -> nn.Module:
    """
    The definition of a model on the meta device: the embedding modules at
    ``paths`` (sharded or not) as unsharded ones of the same tables, the rest
    copied. Building a ``DistributedModelParallel`` from it leaves ``root``
    untouched (a model is sharded in place of the module it is built from).
    """
    embeddings = {path: root.get_submodule(path) for path in paths}
    parents = {
        path: (root.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2])
        for path in paths
    }
    try:
        for path, (parent, name) in parents.items():
            setattr(parent, name, nn.Module())  # not copied: swapped back below
        definition = copy.deepcopy(root).to("meta")
    finally:
        for path, (parent, name) in parents.items():
            setattr(parent, name, embeddings[path])
    for path, module in embeddings.items():
        parent_path, _, name = path.rpartition(".")
        setattr(definition.get_submodule(parent_path), name, _meta_twin(module))
    return definition


def module_tree(modules: Mapping[str, nn.Module]) -> nn.Module:
    """
    A model that holds each module at its path, under empty parent modules
    made for it (the module itself where its path is "", the whole model).

    Args:
        modules (Mapping[str, nn.Module]): the modules, by dotted path.

    Returns:
        nn.Module: the model.
    """
    if list(modules) == [""]:
        return modules[""]
    root = nn.Module()
    for path, module in modules.items():
        parent = root
        *parents, leaf = path.split(".")
        for name in parents:
            if not hasattr(parent, name):
                parent.add_module(name, nn.Module())
            parent = parent.get_submodule(name)
        parent.add_module(leaf, module)
    return root


def unsharded_definition(model: nn.Module) -> nn.Module:
    """
    The definition of a sharded model on the meta device: its sharded modules
    as unsharded ones of the same tables, the rest copied.
    """
    return meta_definition(model.module, list(sharded_modules(model.module)))


def _no_init(weight: torch.Tensor) -> None:
    """A table ``init_fn`` that leaves the weight as it is."""


@contextlib.contextmanager
def _tables_not_initialised(definition: nn.Module) -> Iterator[None]:
    """
    While a model is built from ``definition``, its tables' ``init_fn`` do
    nothing, and are put back afterwards. A sharded module's
    ``reset_parameters`` (called once it is built) initialises every local
    shard with them; the kernel build hooks do not reach it, and every byte is
    moved in afterwards.
    """
    configs: List[Any] = []
    for module in definition.modules():
        if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
            configs += plain_configs(module)
    saved = [(config, config.init_fn) for config in configs]
    try:
        for config in configs:
            config.init_fn = _no_init
        yield
    finally:
        for config, init_fn in saved:
            config.init_fn = init_fn


def build_model(
    definition: nn.Module,
    env: ShardingEnv,
    plan: ShardingPlan,
    sharders: Optional[List[Any]],
    device: torch.device,
    hooks: KernelBuildHooks,
    sharding_hooks: Optional[ShardingBuildHooks] = None,
) -> nn.Module:
    """
    A ``DistributedModelParallel`` over ``env`` from an unsharded definition,
    its tables uninitialised (every byte is moved in), its kernels built under
    ``hooks`` and its sharded modules under ``sharding_hooks``.

    Args:
        definition (nn.Module): the unsharded model (its tables on any device).
        env (ShardingEnv): the group the model is sharded over.
        plan (ShardingPlan): its plan (copied).
        sharders (Optional[List[Any]]): the sharders (None: TorchRec's).
        device (torch.device): the model's device.
        hooks (KernelBuildHooks): the kernel build hooks (e.g. none that
            initialise: every byte is moved in).
        sharding_hooks (Optional[ShardingBuildHooks]): the sharding build
            hooks (default: TorchRec's defaults).

    Returns:
        nn.Module: the ``DistributedModelParallel``.
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel

    sharding_hooks = (
        sharding_hooks if sharding_hooks is not None else ShardingBuildHooks()
    )
    with (
        kernel_build_hooks(hooks),
        sharding_build_hooks(sharding_hooks),
        _tables_not_initialised(definition),
    ):
        return DistributedModelParallel(
            definition,
            env=env,
            device=device,
            plan=copy.deepcopy(plan),
            sharders=sharders,
        )


def release_model(model: nn.Module) -> None:
    """Releases a model's kernels and groups (``DistributedModelParallel``)."""
    model._release()

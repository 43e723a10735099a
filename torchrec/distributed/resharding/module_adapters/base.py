#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
What the generic reshard (``reshard``) needs to know about one kind of sharded
embedding module: the abstract :class:`ShardedModuleAdapter`. An adapter reads
the module (its tables, plan, sharding groups and the state of its lookups),
builds shardings for new groups and installs them through the module's own
methods (added by the patch series), never by setting the module's
attributes. Each module type's adapter is in the module named as upstream's
(``embeddingbag``, ``embedding``).
"""

import abc
import gc
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.resharding.devices import normalized_device
from torchrec.distributed.resharding.kernel_state import (
    batched_kernels,
    local_slots,
    LocalSlot,
    SlotKey,
)
from torchrec.distributed.resharding.plan import (
    layout_from_parameter_sharding,
    ReshardError,
    TableLayout,
)
from torchrec.distributed.resharding.plan_validation import (
    MOVABLE_COMPUTE_KERNELS,
    MOVABLE_SHARDING_TYPES,
    validate_parameter_sharding,
)
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingEnv,
)

# How long a graph that only finished collectives still hold may take to go.
COLLECTIVE_RELEASE_GRACE_S = 2.0


class ShardedModuleAdapter(abc.ABC):
    """
    One kind of sharded embedding module, as live resharding sees it. A third
    module type plugs in with a subclass (and an entry in ``adapters``).

    Args:
        module (nn.Module): the sharded module.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    # ------------------------------------------------------------- the module

    @abc.abstractmethod
    def configs(self) -> Sequence[Any]:
        """The module's table configs, in module order."""

    def plan(self) -> EmbeddingModuleShardingPlan:
        """The module's current sharding, per table."""
        return self.module.module_sharding_plan

    def table_shape(self, table: str) -> Tuple[int, int]:
        """(rows, columns) of a table of the module."""
        config = self.module._table_name_to_config[table]
        return config.num_embeddings, config.embedding_dim

    def device(self) -> Optional[torch.device]:
        """The module's device."""
        return self.module._device

    def sharder_fused_params(self) -> Optional[Dict[str, Any]]:
        """The fused params of the sharder that built the module."""
        return self.module._fused_params

    def has_pending_backward(self) -> bool:
        """
        Whether a forward left an autograd graph through the module's lookups
        that backward has not run through. A graph nothing references but its
        own reference cycles (TorchRec's collective awaitables make some) is
        collected first.
        """
        if not self.module.has_pending_backward():
            return False
        gc.collect()
        # A collective that completed may hold the lookup outputs a moment
        # longer: gloo's worker thread drops its work item (and the tensors in
        # it) only after marking it complete and taking its queue lock again,
        # which under load can come well after ``wait()`` returned. Nobody can
        # run backward through such a graph; give that moment, bounded.
        deadline = time.monotonic() + COLLECTIVE_RELEASE_GRACE_S
        while self.module.has_pending_backward():
            if time.monotonic() > deadline:
                return True
            time.sleep(0.005)
        return False

    def sharding_infos(self) -> Mapping[str, List[EmbeddingShardingInfo]]:
        """The module's tables per sharding type, in group order."""
        return self.module.sharding_type_to_sharding_infos

    @abc.abstractmethod
    def groups(self) -> List[Tuple[str, Any, nn.Module]]:
        """(sharding type, sharding, lookup) of every group, in group order."""

    def lookups(self) -> List[nn.Module]:
        """The module's lookups, in group order."""
        return [lookup for _, _, lookup in self.groups()]

    # ------------------------------------------------------------ state access

    def local_slots(self, lookups: Sequence[nn.Module]) -> Dict[SlotKey, LocalSlot]:
        """Every local shard of ``lookups`` with its weight and optimizer state."""
        return local_slots(lookups)

    def kernels(self, lookups: Sequence[nn.Module]) -> List[nn.Module]:
        """The batched kernels of ``lookups``."""
        return [b for lookup in lookups for b in batched_kernels(lookup)]

    # ------------------------------------------------------ build and install

    def create_sharding(
        self,
        infos: List[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: Optional[torch.device],
    ) -> Any:
        """A sharding object for one group of tables of one sharding type."""
        return self.sharding_factory(infos)(
            sharding_infos=infos,
            env=env,
            device=device,
            qcomm_codecs_registry=self.module.qcomm_codecs_registry,
        )

    @abc.abstractmethod
    def sharding_factory(
        self, infos: List[EmbeddingShardingInfo]
    ) -> Callable[..., Any]:
        """
        TorchRec's function that creates the module's shardings, with what a
        group needs besides its tables, environment, device and codecs bound.

        Args:
            infos (List[EmbeddingShardingInfo]): the group's tables.

        Returns:
            Callable[..., Any]: called with ``sharding_infos``, ``env``,
            ``device`` and ``qcomm_codecs_registry``.
        """

    def wrap_lookup(self, sharding_type: str, lookup: nn.Module) -> nn.Module:
        """A new lookup as the module wraps it (DDP for data parallel)."""
        return self.module._wrap_data_parallel_lookup(sharding_type, lookup)

    # Whether the module's output is read by position too (then it lists its
    # outputs in the order of a module sharded directly under its plan,
    # whatever kernels the tables that stayed put keep).
    positional_output: bool = False

    def install(
        self,
        infos: Mapping[str, List[EmbeddingShardingInfo]],
        shardings: List[Any],
        lookups: List[nn.Module],
        output_order: Optional[List[str]] = None,
    ) -> None:
        """
        Installs the new groups through the module's own method.

        Args:
            infos (Mapping[str, List[EmbeddingShardingInfo]]): the tables per
                sharding type, in group order.
            shardings (List[Any]): a sharding per group.
            lookups (List[nn.Module]): a lookup per group.
            output_order (Optional[List[str]]): the order the module lists its
                outputs in (None: its groups' order).
        """
        self.module._install_sharding_groups(dict(infos), shardings, lookups)
        self.set_output_order(output_order)

    def set_output_order(self, order: Optional[List[str]]) -> None:
        """
        Has the module's forward list its outputs in ``order`` (None: its
        groups' order). Nothing to do for a module whose output is keyed only
        (a dict).
        """

    # ------------------------------------------------------------- validation

    def validate_delta(
        self,
        changed_sharding_params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device],
    ) -> Dict[str, TableLayout]:
        """
        Checks a delta against the module without touching it.

        Args:
            changed_sharding_params (Mapping[str, ParameterSharding]): the delta.
            env (ShardingEnv): the module's sharding environment.
            device (Optional[torch.device]): the module's device.

        Returns:
            Dict[str, TableLayout]: the new layout of every table in the delta.

        Raises:
            ReshardError: naming the table and the reason.
        """
        if not isinstance(changed_sharding_params, Mapping):
            raise ReshardError(
                "changed_sharding_params must map table names to ParameterSharding, "
                f"got {type(changed_sharding_params).__name__}"
            )
        if env.process_group is None:
            raise ReshardError("resharding needs the module's process group")
        if changed_sharding_params and self.has_pending_backward():
            raise ReshardError(
                "a forward through the module left an autograd graph that backward "
                "has not run through yet: call backward (or drop the graph) first, "
                "then reshard"
            )
        world_size = dist.get_world_size(env.process_group)
        here = normalized_device(device or self.device() or torch.device("cpu"))
        rank = dist.get_rank(env.process_group)
        plan = self.plan()
        layouts: Dict[str, TableLayout] = {}
        for table, ps in changed_sharding_params.items():
            if table not in plan:
                names = ", ".join(c.name for c in self.configs())
                raise ReshardError(
                    f"table '{table}' is not in this module (tables: {names})"
                )
            old = plan[table]
            if old.sharding_type not in MOVABLE_SHARDING_TYPES:
                raise ReshardError(
                    f"table '{table}': its current sharding type "
                    f"'{old.sharding_type}' cannot be resharded"
                )
            if old.compute_kernel not in MOVABLE_COMPUTE_KERNELS:
                raise ReshardError(
                    f"table '{table}': its current compute kernel "
                    f"'{old.compute_kernel}' cannot be resharded"
                )
            rows, cols = self.table_shape(table)
            layouts[table] = validate_parameter_sharding(
                table, ps, rows, cols, world_size, here.type, rank, here.index
            )
        return layouts

    def layouts(self, tables: Sequence[str], world_size: int) -> Dict[str, TableLayout]:
        """The current layout of ``tables``."""
        plan = self.plan()
        return {
            t: layout_from_parameter_sharding(plan[t], *self.table_shape(t), world_size)
            for t in tables
        }

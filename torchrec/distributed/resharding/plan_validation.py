#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Checking a requested sharding before anything moves, and the digests every
rank compares to agree on a request.

``validate_parameter_sharding`` checks that a table can move to a new
``ParameterSharding`` (a movable sharding type and compute kernel, shards on
the group's ranks and the module's device type, tiling the table) and reads
its layout; ``describe_parameter_sharding``, ``sharding_plan_text`` and the
digests give the canonical text of a request, equal on every rank that holds
an equal one. Pure: nothing in this module talks to other ranks.
"""

import hashlib
from typing import Any, Mapping, Optional, Tuple

from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torch.distributed._shard.sharding_spec._internals import (
    check_tensor,
    validate_non_overlapping_shards_metadata,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.plan import (
    layout_from_parameter_sharding,
    ReshardError,
    TableLayout,
)
from torchrec.distributed.types import ParameterSharding, ShardingType

MOVABLE_SHARDING_TYPES: Tuple[str, ...] = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.GRID_SHARD.value,
    ShardingType.DATA_PARALLEL.value,
)

# ParameterSharding fields a kernel is built with: a reshard that changes one
# rebuilds the table's kernel with it (its state carried over).
KERNEL_OPTIONS: Tuple[str, ...] = (
    "cache_params",
    "enforce_hbm",
    "stochastic_rounding",
    "bounds_check_mode",
    "output_dtype",
    "key_value_params",
)

# The kernels upstream reshards: weights in HBM (FUSED), in unified memory
# (FUSED_UVM) and in unified memory behind an HBM cache (FUSED_UVM_CACHING,
# flushed before any read; on CPU all three hold their weights on the host).
# Key-value and SSD kernels keep rows outside the kernel: they cannot move.
MOVABLE_COMPUTE_KERNELS: Tuple[str, ...] = (
    EmbeddingComputeKernel.DENSE.value,
    EmbeddingComputeKernel.FUSED.value,
    EmbeddingComputeKernel.FUSED_UVM.value,
    EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
)


def _check_tiling(
    table: str, spec: EnumerableShardingSpec, rows: int, cols: int
) -> None:
    for metadata in spec.shards:
        if len(metadata.shard_offsets) != 2 or len(metadata.shard_sizes) != 2:
            raise ReshardError(f"table '{table}': shard {metadata} is not 2D")
        if min(metadata.shard_sizes) < 0 or min(metadata.shard_offsets) < 0:
            raise ReshardError(f"table '{table}': shard {metadata} has negative size")
    try:
        validate_non_overlapping_shards_metadata(spec.shards)
    except ValueError as e:
        raise ReshardError(f"table '{table}': shards overlap: {e}") from None
    try:
        check_tensor(spec.shards, [rows, cols])
    except ValueError as e:
        raise ReshardError(
            f"table '{table}': shards do not tile the {rows}x{cols} table: {e}"
        ) from None


def _check_shape_matches_type(
    table: str, sharding_type: str, layout: TableLayout
) -> None:
    rects = [s.rect for s in layout.shards]
    if sharding_type == ShardingType.TABLE_WISE.value and len(rects) != 1:
        raise ReshardError(
            f"table '{table}': table_wise sharding needs exactly one shard, "
            f"got {len(rects)}"
        )
    whole_rows = sharding_type in (
        ShardingType.COLUMN_WISE.value,
        ShardingType.TABLE_COLUMN_WISE.value,
    )
    whole_cols = sharding_type in (
        ShardingType.ROW_WISE.value,
        ShardingType.TABLE_ROW_WISE.value,
    )
    if whole_rows and any(r.rows != layout.rows for r in rects):
        raise ReshardError(
            f"table '{table}': {sharding_type} shards must span all "
            f"{layout.rows} rows"
        )
    if whole_cols and any(r.cols != layout.cols for r in rects):
        raise ReshardError(
            f"table '{table}': {sharding_type} shards must span all "
            f"{layout.cols} columns"
        )


def validate_parameter_sharding(
    table: str,
    parameter_sharding: ParameterSharding,
    rows: int,
    cols: int,
    world_size: int,
    device_type: str,
    group_rank: Optional[int] = None,
    device_index: Optional[int] = None,
) -> TableLayout:
    """
    Checks that a new ParameterSharding can be moved to, and reads its layout.

    Args:
        table (str): table name (for messages).
        parameter_sharding (ParameterSharding): the requested sharding.
        rows (int): rows of the table.
        cols (int): columns of the table.
        world_size (int): size of the process group.
        device_type (str): device type of the module ("cpu", "cuda", ...).
        group_rank (Optional[int]): this rank in the group: its shards must
            be placed on its own device index (``device_index``), which
            TorchRec checks when it builds them.
        device_index (Optional[int]): the index of this rank's device.

    Returns:
        TableLayout: the new layout.

    Raises:
        ReshardError: naming the table and the reason.
    """
    if not isinstance(parameter_sharding, ParameterSharding):
        raise ReshardError(
            f"table '{table}': expected a ParameterSharding, "
            f"got {type(parameter_sharding).__name__}"
        )
    sharding_type = parameter_sharding.sharding_type
    if sharding_type not in MOVABLE_SHARDING_TYPES:
        raise ReshardError(
            f"table '{table}': sharding type '{sharding_type}' cannot be resharded "
            f"(movable: {', '.join(MOVABLE_SHARDING_TYPES)})"
        )
    if parameter_sharding.compute_kernel not in MOVABLE_COMPUTE_KERNELS:
        raise ReshardError(
            f"table '{table}': compute kernel '{parameter_sharding.compute_kernel}' "
            f"cannot be resharded (movable: {', '.join(MOVABLE_COMPUTE_KERNELS)})"
        )
    if sharding_type != ShardingType.DATA_PARALLEL.value:
        spec = parameter_sharding.sharding_spec
        if not isinstance(spec, EnumerableShardingSpec) or not spec.shards:
            raise ReshardError(
                f"table '{table}': {sharding_type} needs an EnumerableShardingSpec "
                "with at least one shard"
            )
        for metadata in spec.shards:
            placement = metadata.placement
            rank = placement.rank() if placement is not None else None
            if rank is None or not 0 <= rank < world_size:
                raise ReshardError(
                    f"table '{table}': shard placement {placement} is outside the "
                    f"process group of {world_size} ranks"
                )
            if placement.device().type != device_type:
                raise ReshardError(
                    f"table '{table}': shard placement {placement} is not on the "
                    f"module's device type '{device_type}'"
                )
            if (
                rank == group_rank
                and device_index is not None
                and placement.device().index != device_index
            ):
                raise ReshardError(
                    f"table '{table}': shard placement {placement} is not on "
                    f"rank {rank}'s device {device_type}:{device_index}"
                )
        _check_tiling(table, spec, rows, cols)
    if parameter_sharding.ranks is not None and any(
        not 0 <= r < world_size for r in parameter_sharding.ranks
    ):
        raise ReshardError(
            f"table '{table}': ranks {parameter_sharding.ranks} are outside the "
            f"process group of {world_size} ranks"
        )
    layout = layout_from_parameter_sharding(parameter_sharding, rows, cols, world_size)
    _check_shape_matches_type(table, sharding_type, layout)
    return layout


def describe_parameter_sharding(parameter_sharding: ParameterSharding) -> str:
    """
    Args:
        parameter_sharding (ParameterSharding): a sharding.

    Returns:
        str: a canonical text of everything that decides where bytes go and
        how the kernel is built, equal on every rank that holds an equal
        ParameterSharding.
    """
    spec = parameter_sharding.sharding_spec
    shards = ""
    if isinstance(spec, EnumerableShardingSpec):
        shards = ";".join(
            f"{list(m.shard_offsets)}+{list(m.shard_sizes)}@{m.placement}"
            for m in spec.shards
        )
    options = "|".join(
        repr(getattr(parameter_sharding, name, None)) for name in KERNEL_OPTIONS
    )
    return (
        f"{parameter_sharding.sharding_type}|{parameter_sharding.compute_kernel}|"
        f"{parameter_sharding.ranks}|{shards}|{options}"
    )


def delta_digest(changed_sharding_params: Mapping[str, ParameterSharding]) -> int:
    """
    Args:
        changed_sharding_params (Mapping[str, ParameterSharding]): a delta.

    Returns:
        int: a 63-bit digest, the same on every rank for the same delta (never
        derived from Python's per-process ``hash``).
    """
    return text_digest(
        "\n".join(
            f"{name}={describe_parameter_sharding(ps) if isinstance(ps, ParameterSharding) else repr(ps)}"
            for name, ps in sorted(changed_sharding_params.items())
        )
    )


def sharding_plan_text(plan: Any) -> str:
    """
    Args:
        plan (ShardingPlan): a plan.

    Returns:
        str: a canonical text of every table's sharding, equal on every rank
        that holds an equal plan.
    """
    return "\n".join(
        f"{TableKey(path, table)}={describe_parameter_sharding(ps)}"
        for path in sorted(plan.plan)
        for table, ps in sorted(plan.plan[path].items())
    )


def text_digest(text: str) -> int:
    """
    Args:
        text (str): a canonical text of a request.

    Returns:
        int: a 63-bit digest of it, the same on every rank (never derived
        from Python's per-process ``hash``).
    """
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The ``Rebalancer``'s settings besides its policy, in two small frozen
groups: ``ReplanOptions`` (what TorchRec's full planner plans with) and
``MoveOptions`` (how the reshards run and what a rank may hold).
``legacy_options`` maps the keywords the constructor took before (and their
positions after ``policy``) onto them, with a ``DeprecationWarning``.
"""

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.rebalance.replan import Replanner
from torchrec.distributed.types import ModuleSharder


@dataclass(frozen=True)
class ReplanOptions:
    """
    What the full replan plans with.

    Args:
        batch_size (Optional[int]): samples per rank and step (default:
            measured).
        constraints (Optional[Mapping[str, ParameterConstraints]]): the
            user's constraints per table; measured load replaces their
            pooling figures, and a table is split by the window's search only
            if they allow column-wise sharding.
        sharders (Optional[Sequence[ModuleSharder[nn.Module]]]): the
            planner's sharders (default: the model's).
        keep_kernels (bool): tables without kernel constraints keep theirs.
        allow_data_parallel (bool): tables without sharding-type constraints
            may become data-parallel.
        replanner (Optional[Replanner]): by default TorchRec's planner in a
            process of its own; a callable given here runs in a thread of the
            training process (for one that waits, not one that computes).
    """

    batch_size: Optional[int] = None
    constraints: Optional[Mapping[str, ParameterConstraints]] = None
    sharders: Optional[Sequence[ModuleSharder[nn.Module]]] = None
    keep_kernels: bool = True
    allow_data_parallel: bool = False
    replanner: Optional[Replanner] = None


@dataclass(frozen=True)
class MoveOptions:
    """
    How the rebalancer's reshards run, and what a rank may hold.

    Args:
        reshard (Optional[ReshardOptions]): how reshards and dry runs run;
            the rebalancer keeps its exchange groups connected between its
            reshards (in the options' ``ExchangeGroups``, else in its own).
        rebuild_optimizer (Optional[Callable[[nn.Module], None]]): called
            with the model after a reshard that rebuilt dense or
            data-parallel tables; without it such candidates are refused.
        state_factor (float): bytes a rank holds per byte of a table's
            weights (weights and optimizer state), for its memory.
    """

    reshard: Optional[ReshardOptions] = None
    rebuild_optimizer: Optional[Callable[[nn.Module], None]] = None
    state_factor: float = 2.0


# The constructor's keywords before the groups, in their positional order
# after ``policy``: (group, field).
LEGACY_KEYWORDS: Dict[str, Tuple[str, str]] = {
    "batch_size": ("replan", "batch_size"),
    "constraints": ("replan", "constraints"),
    "sharders": ("replan", "sharders"),
    "options": ("moves", "reshard"),
    "rebuild_optimizer": ("moves", "rebuild_optimizer"),
    "keep_kernels": ("replan", "keep_kernels"),
    "allow_data_parallel": ("replan", "allow_data_parallel"),
    "state_factor": ("moves", "state_factor"),
    "replanner": ("replan", "replanner"),
}


def legacy_options(
    args: Sequence[Any],
    keywords: Mapping[str, Any],
    replan: Optional[ReplanOptions],
    moves: Optional[MoveOptions],
) -> Tuple[ReplanOptions, MoveOptions]:
    """
    The option groups, with the old positional arguments and keywords put
    in them (a ``DeprecationWarning`` when there are any).

    Args:
        args (Sequence[Any]): positional arguments after ``policy``.
        keywords (Mapping[str, Any]): the old keywords given.
        replan (Optional[ReplanOptions]): the replan group given.
        moves (Optional[MoveOptions]): the moves group given.

    Returns:
        Tuple[ReplanOptions, MoveOptions]: the groups.

    Raises:
        TypeError: for too many positional arguments, an unknown keyword, a
            setting given twice, or a group of the wrong type.
    """
    names = list(LEGACY_KEYWORDS)
    if len(args) > len(names):
        raise TypeError(
            f"Rebalancer takes at most {3 + len(names)} positional arguments"
        )
    given: Dict[str, Any] = dict(zip(names, args))
    for name, value in keywords.items():
        if name not in LEGACY_KEYWORDS:
            raise TypeError(f"Rebalancer got an unexpected keyword argument {name!r}")
        if name in given:
            raise TypeError(f"Rebalancer got multiple values for argument {name!r}")
        given[name] = value
    if replan is not None and not isinstance(replan, ReplanOptions):
        raise TypeError(f"replan must be a ReplanOptions, got {type(replan).__name__}")
    if moves is not None and not isinstance(moves, MoveOptions):
        raise TypeError(f"moves must be a MoveOptions, got {type(moves).__name__}")
    groups: Dict[str, Dict[str, Any]] = {"replan": {}, "moves": {}}
    for name, value in given.items():
        group, field = LEGACY_KEYWORDS[name]
        groups[group][field] = value
    for group, passed in (("replan", replan), ("moves", moves)):
        twice = sorted(groups[group]) if passed is not None else []
        if twice:
            raise TypeError(
                f"Rebalancer got {', '.join(twice)} both in {group}= and as "
                "old keywords"
            )
    if given:
        warnings.warn(
            f"Rebalancer({', '.join(sorted(given))}=...) is deprecated: pass "
            "replan=ReplanOptions(...) and moves=MoveOptions(...)",
            DeprecationWarning,
            stacklevel=3,
        )
    return (
        replace(replan or ReplanOptions(), **groups["replan"]),
        replace(moves or MoveOptions(), **groups["moves"]),
    )

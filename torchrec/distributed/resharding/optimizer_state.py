#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Fused optimizer state across a reshard. The per-element and per-row state
travels with the pieces (see ``kernel_state``); what is per kernel — which
state a table carries, its learning rate and the optimizer's step count — is
shared by every rank in the agreement (:class:`TableFacts`) and set on the new
kernels before they are filled.
"""

from typing import Sequence

import torch
from torch import nn
from torchrec.distributed.resharding.fields import TableFacts
from torchrec.distributed.resharding.kernel_state import (
    batched_kernels,
    is_fused,
    local_slots,
)


def local_table_facts(
    lookups: Sequence[nn.Module], tables: Sequence[str]
) -> TableFacts:
    """
    Args:
        lookups (Sequence[nn.Module]): the module's current lookups.
        tables (Sequence[str]): the tables the reshard plans.

    Returns:
        TableFacts: what this rank knows of them.
    """
    wanted = set(tables)
    facts = TableFacts()
    for (name, _), slot in local_slots(lookups).items():
        if name in wanted:
            facts.fields.setdefault(name, slot.fields())
    for lookup in lookups:
        for batched in batched_kernels(lookup):
            if not is_fused(batched):
                continue
            lr = batched.emb_module.get_learning_rate()
            for table in batched.config.embedding_tables:
                facts.learning_rates[table.name] = lr
            it = getattr(batched.emb_module, "iter", None)
            if isinstance(it, torch.Tensor):
                facts.optimizer_iter = max(facts.optimizer_iter, int(it.item()))
    return facts


def apply_table_facts(new_lookups: Sequence[nn.Module], facts: TableFacts) -> None:
    """
    Gives the fused kernels of new lookups the learning rate of their tables
    and the optimizer's step count.

    Args:
        new_lookups (Sequence[nn.Module]): lookups the reshard built.
        facts (TableFacts): the merged facts.

    Returns:
        None
    """
    for lookup in new_lookups:
        for batched in batched_kernels(lookup):
            if not is_fused(batched):
                continue
            names = [t.name for t in batched.config.embedding_tables]
            lrs = [facts.learning_rates[n] for n in names if n in facts.learning_rates]
            if lrs:
                batched.emb_module.set_learning_rate(lrs[0])
                batched.fused_optimizer.param_groups[0]["lr"] = lrs[0]
            it = getattr(batched.emb_module, "iter", None)
            if isinstance(it, torch.Tensor):
                it.fill_(facts.optimizer_iter)

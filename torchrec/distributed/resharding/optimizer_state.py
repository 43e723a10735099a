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

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Sequence, Tuple

import torch
from torch import nn
from torchrec.distributed.resharding.exchange import Field
from torchrec.distributed.resharding.kernel_state import (
    batched_kernels,
    describe_fields,
    fields_from_description,
    is_fused,
    local_slots,
)


@dataclass
class TableFacts:
    """
    What a rank tells the others about the tables it holds before any data
    moves (plain picklable values).

    Args:
        fields (Dict[str, List[Tuple[str, str, str]]]): per table, the tensors
            that travel with its pieces (name, kind, dtype).
        learning_rates (Dict[str, float]): per table, its fused kernel's rate.
        optimizer_iter (int): the highest step count of the fused kernels.
    """

    fields: Dict[str, List[Tuple[str, str, str]]] = field(default_factory=dict)
    learning_rates: Dict[str, float] = field(default_factory=dict)
    optimizer_iter: int = 0

    def fields_of(self, table: str) -> List[Field]:
        """The fields of a table's pieces (none for a table nobody holds)."""
        return fields_from_description(self.fields.get(table, []))


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
            facts.fields.setdefault(name, describe_fields(slot))
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


def merge_table_facts(all_facts: Sequence[TableFacts]) -> TableFacts:
    """
    Args:
        all_facts (Sequence[TableFacts]): every rank's facts, by rank.

    Returns:
        TableFacts: the union (the lowest rank's entry wins for a table).
    """
    merged = TableFacts()
    for facts in all_facts:
        for table, table_fields in facts.fields.items():
            merged.fields.setdefault(table, table_fields)
        for table, lr in facts.learning_rates.items():
            merged.learning_rates.setdefault(table, lr)
        merged.optimizer_iter = max(merged.optimizer_iter, facts.optimizer_iter)
    return merged


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


def fields_by_table(
    facts: TableFacts, tables: Sequence[str]
) -> Mapping[str, List[Field]]:
    """The fields of every planned table."""
    return {t: facts.fields_of(t) for t in tables}

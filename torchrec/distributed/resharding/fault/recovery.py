#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The recovery move: a model on a group that lost ranks, moved onto its
survivors by the engine's one transaction runner.

It is the elastic move (``elastic.ModelMove``: agree, build the new model on
the survivors' group, exchange, commit) with two differences: its
participants are the survivors only, and its old layout shows every lost
shard as the pieces of its source (``sources.recovery_old_layouts``) on the
survivors that hold their bytes: a buddy's snapshot, or the pieces a
survivor read from the checkpoint. The runner plans and moves those like
any shard: the survivors' own shards stay where they are (their kernels keep
their storage where the plan leaves the table as it was), the dense part
comes from the first survivor, the fused and dense optimizers carry on. The
old model is untouched until the commit: a recovery that fails (another rank
lost) leaves it whole for the next attempt.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding.elastic import ModelMove
from torchrec.distributed.resharding.elastic_plan import dense_specs, MoveFacts
from torchrec.distributed.resharding.fault.recovery_plan import RecoveryPlan
from torchrec.distributed.resharding.fault.sources import (
    AgreedSources,
    recovery_old_layouts,
)
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.model_view import (
    dense_tensors,
    sharded_modules,
    sharded_tables,
)
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import TableLayout
from torchrec.distributed.resharding.runner import run_transaction, Slots
from torchrec.distributed.resharding.slots import LocalSlot, SlotKey
from torchrec.distributed.resharding.transaction_report import TransactionReport
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.keyed import KeyedOptimizer


class Recovery(ModelMove):
    """
    A survivor's part of moving a model that lost ranks onto the survivors
    (see :func:`recover_model` for the arguments).
    """

    kind = "recovery"

    def __init__(
        self,
        model: nn.Module,
        recovery: RecoveryPlan,
        sources: AgreedSources,
        source_slots: Dict[SlotKey, LocalSlot],
        new_env: ShardingEnv,
        optimizer: Optional[KeyedOptimizer] = None,
        make_optimizer: Optional[Callable[[nn.Module], KeyedOptimizer]] = None,
        options: Optional[ReshardOptions] = None,
    ) -> None:
        super().__init__(
            model,
            recovery.plan,
            new_env,
            list(recovery.survivors),
            optimizer=optimizer,
            make_optimizer=make_optimizer,
            options=options,
        )
        self._sources = sources
        self._source_slots = source_slots
        self._old_group: List[int] = dist.get_process_group_ranks(
            model._env.process_group
        )
        self.role = "survivor"

    def request(self) -> List[str]:
        return super().request() + [self._sources.text()]

    def _model_facts(self, model: nn.Module) -> MoveFacts:
        # The old group's first rank may be lost: the first survivor states
        # the plan, the tables and the dense part for the old group, which
        # the recovery sees as the survivors.
        facts = super()._model_facts(model)
        first = self._me == self._union[0]
        facts.old_ranks = list(self._union) if first else None
        facts.old_plan = model.plan if first else None
        facts.tables = (
            {p: sharded_tables(m) for p, m in sharded_modules(model.module).items()}
            if first
            else None
        )
        facts.dense = dense_specs(dense_tensors(model.module)) if first else None
        # the fields of lost tables come with the pieces this rank provides
        for piece in self._sources.held_by(self._me):
            parsed = TableKey.parse(piece.key)
            path, name = parsed.path, parsed.table
            table_facts = facts.table_facts
            assert table_facts is not None
            table_facts[path].fields.setdefault(
                name, self._sources.fields_of(piece.key)
            )
        return facts

    def _old_layouts(
        self, old_plan: ShardingPlan, tables: Dict[str, Any], old_ranks: Sequence[int]
    ) -> Dict[str, TableLayout]:
        # the old group has lost ranks: a lost shard stands as the pieces of
        # its source on the survivors
        return recovery_old_layouts(
            old_plan, tables, self._old_group, self._union, self._sources
        )

    def slots(self) -> Tuple[Slots, Slots]:
        old, new = super().slots()
        return {**old, **self._source_slots}, new

    def unchanged(self) -> str:
        return "the model is as it was at the failure, and its sources are kept"


def recover_model(
    model: nn.Module,
    recovery: RecoveryPlan,
    sources: AgreedSources,
    source_slots: Dict[SlotKey, LocalSlot],
    new_env: ShardingEnv,
    optimizer: Optional[KeyedOptimizer] = None,
    make_optimizer: Optional[Callable[[nn.Module], KeyedOptimizer]] = None,
    options: Optional[ReshardOptions] = None,
) -> Tuple[nn.Module, Optional[KeyedOptimizer], TransactionReport]:
    """
    Moves a model that lost ranks onto its survivors: every survivor calls
    it, with the same plan and sources.

    Args:
        model (DistributedModelParallel): the model on its old group.
        recovery (RecoveryPlan): the plan on the survivors.
        sources (AgreedSources): where the lost shards' bytes are.
        source_slots (Dict[SlotKey, LocalSlot]): the pieces whose bytes this
            rank holds (``sources.held_by(rank)``), by table key and piece.
        new_env (ShardingEnv): the environment over the survivors' group.
        optimizer (Optional[KeyedOptimizer]): the dense optimizer (its state
            travels from the first survivor).
        make_optimizer (Optional[Callable]): builds the new dense optimizer.
        options (Optional[ReshardOptions]): timeout and in-flight cap.

    Returns:
        Tuple[nn.Module, Optional[KeyedOptimizer], TransactionReport]: the
        model on the survivors, its dense optimizer, and what this rank did.

    Raises:
        ReshardError: on every survivor, before anything moves, for a request
            they disagree on.
        ReshardAbortedError: on every survivor when another rank is lost or
            the move fails; the old model is unchanged.
    """
    participant = Recovery(
        model,
        recovery,
        sources,
        source_slots,
        new_env,
        optimizer,
        make_optimizer,
        options,
    )
    report = run_transaction(participant, options)
    new_model = participant.new_model
    assert new_model is not None
    return new_model, participant.new_optimizer, report

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The one object a training loop holds to survive a lost rank.

::

    ft = FaultTolerance(model, optimizer, make_optimizer, options)
    for batch in batches:
        ft.step(lambda model, optimizer: train_step(model, optimizer, batch))
        if ft.steps % 1000 == 0:
            ft.save_checkpoint(f"/checkpoints/{ft.steps}")

:meth:`FaultTolerance.step` runs one training step on the current model.
When a rank is lost (the step raises, or the watcher saw the fault), every
survivor, inside ``step``:

1. **agrees** on the new members through the store (``membership``): the
   same verdict everywhere; a rank left out is fenced;
2. **builds** a process group of the survivors (``dist.new_group`` among
   them: no second ``init_process_group``, nothing written into torch's
   registries) and a ``ShardingEnv`` on it;
3. **plans** the model on the survivors (``recovery_plan``: their shards
   stay where they are) and agrees on the sources of the lost shards
   (``sources``: replica, buddy snapshot, checkpoint, best first); a loss no
   source covers stops every survivor with :class:`UnrecoverableLossError`
   naming the tables;
4. **moves** the model onto the survivors (``recovery``: the engine's
   transaction), and carries on with the new model and dense optimizer
   (:attr:`FaultTolerance.model`, :attr:`FaultTolerance.optimizer`).

A rank lost during a recovery makes it fail on every survivor with the old
model whole; the survivors agree again and recover onto fewer ranks. Each
recovery leaves a :class:`RecoveryReport` (:attr:`FaultTolerance.reports`).
The step that failed is not replayed (its updates may be partly applied on
the survivors, as they were when the rank died).
"""

import logging
import time
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.resharding.agreement import agree_among_ranks, job_store
from torchrec.distributed.resharding.fault.checkpoint import (
    load_pieces,
    save_checkpoint,
)
from torchrec.distributed.resharding.fault.detector import FaultDetector
from torchrec.distributed.resharding.fault.membership import (
    agree_on_members,
    Membership,
    store_lost,
    StoreKeys,
)
from torchrec.distributed.resharding.fault.options import (
    CHECKPOINT,
    FaultOptions,
    FaultToleranceError,
    SNAPSHOT,
)
from torchrec.distributed.resharding.fault.recovery import recover_model
from torchrec.distributed.resharding.fault.recovery_plan import (
    check_recoverable,
    plan_for_survivors,
    RecoveryPlan,
)
from torchrec.distributed.resharding.fault.report import Failure, RecoveryReport
from torchrec.distributed.resharding.fault.snapshot import BuddySnapshot
from torchrec.distributed.resharding.fault.sources import (
    AgreedSources,
    CheckpointRecord,
    choose_sources,
    SourceFacts,
)
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.model_build import unsharded_definition
from torchrec.distributed.resharding.model_view import (
    plain_weight_dtypes,
    sharded_modules,
    sharded_tables,
)
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan_validation import (
    sharding_plan_text,
    text_digest,
)
from torchrec.distributed.resharding.slots import LocalSlot, SlotKey
from torchrec.distributed.resharding.whole_plan import plan_digest, TableShape
from torchrec.distributed.types import ShardingEnv, ShardingPlan, ShardingType
from torchrec.optim.keyed import KeyedOptimizer

logger: logging.Logger = logging.getLogger(__name__)

T = TypeVar("T")


class FaultTolerance:
    """
    Keeps a training job running when ranks are lost (see the module
    docstring). Every rank of the model's group makes one, at the same
    point, once the model is built.

    Args:
        model (DistributedModelParallel): the model.
        optimizer (Optional[KeyedOptimizer]): the dense optimizer (the fused
            one lives in the model).
        make_optimizer (Optional[Callable[[nn.Module], KeyedOptimizer]]):
            builds the dense optimizer for a recovered model (it gets the old
            one's state); needed with ``optimizer``.
        options (Optional[FaultOptions]): bounds and sources.
        on_failure (Optional[Callable[[Failure], None]]): called on every
            survivor before a recovery moves anything.
        make_pipeline (Optional[Callable[[nn.Module, Any], Any]]): builds a
            train pipeline for a model and its dense optimizer; the pipeline
            (:attr:`pipeline`) is rebuilt on the recovered model (batches in
            flight through the lost group are dropped).

    Raises:
        ReshardError: for a plan a recovery cannot place (table-row-wise or
            grid tables) or bad options.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optional[KeyedOptimizer] = None,
        make_optimizer: Optional[Callable[[nn.Module], KeyedOptimizer]] = None,
        options: Optional[FaultOptions] = None,
        on_failure: Optional[Callable[[Failure], None]] = None,
        make_pipeline: Optional[Callable[[nn.Module, Any], Any]] = None,
    ) -> None:
        check_recoverable(model.plan)
        if optimizer is not None and make_optimizer is None:
            raise FaultToleranceError(
                "a dense optimizer needs make_optimizer to be rebuilt on the "
                "recovered model"
            )
        self.model: nn.Module = model
        self.optimizer: Optional[KeyedOptimizer] = optimizer
        self._make_optimizer = make_optimizer
        self._options: FaultOptions = options or FaultOptions()
        self._on_failure = on_failure
        self._make_pipeline = make_pipeline
        self.pipeline: Any = (
            make_pipeline(model, optimizer) if make_pipeline is not None else None
        )
        self._rank: int = dist.get_rank()
        self._store: dist.Store = job_store()
        group = model._env.process_group
        # the group's name sets this object's keys apart from another's (one
        # made later in the job, on a recovered model, say)
        self._keys = StoreKeys(f"{self._options.name}/{group.group_name}")
        self._group: dist.ProcessGroup = group
        self._set_collective_timeout(group)
        ranks = sorted(dist.get_process_group_ranks(group))
        self._membership = Membership(0, tuple(ranks))
        self._detector = FaultDetector(
            self._store, self._keys, self._rank, self._options, self._abort_group
        )
        self._detector.watch(0, ranks)
        self.steps: int = 0
        self._checkpoint: Optional[CheckpointRecord] = None
        self._snapshot: Optional[BuddySnapshot] = (
            BuddySnapshot(model, self._options)
            if self._options.snapshot_every
            else None
        )
        self._awaiting_first_step: Optional[Tuple[RecoveryReport, float]] = None
        self.reports: List[RecoveryReport] = []

    # ---------------------------------------------------------------- public

    @property
    def members(self) -> Tuple[int, ...]:
        """The job's ranks now (global ranks)."""
        return self._membership.members

    @property
    def generation(self) -> int:
        """How many times the members were agreed since the start."""
        return self._membership.generation

    def step(
        self, fn: Callable[[nn.Module, Optional[KeyedOptimizer]], T]
    ) -> Optional[T]:
        """
        Runs one training step on the current model, and recovers when a
        rank was lost.

        Args:
            fn (Callable): the step, given the current model and dense
                optimizer (both change at a recovery).

        Returns:
            Optional[T]: what ``fn`` returned; None when the step failed
            because a rank was lost (the job then goes on with the
            survivors).

        Raises:
            UnrecoverableLossError: on every survivor, for a loss no source
                covers (the model is as it was: save it with
                :meth:`save_checkpoint`).
            RankFencedError: on a rank the others went on without.
            FaultToleranceError: when a step failed on some rank though no
                rank was lost, or the store is gone.
        """
        self._raise_if_store_lost()
        if self._detector.fault_seen:
            self._recover("another rank reported a fault")
            return None
        try:
            out = fn(self.model, self.optimizer)
        except (FaultToleranceError, KeyboardInterrupt):
            raise
        except Exception as e:
            self._recover(f"the step raised {type(e).__name__}: {e}")
            return None
        self.steps += 1
        self._note_first_step()
        snapshot = self._snapshot
        if snapshot is not None and self.steps % self._options.snapshot_every == 0:
            try:
                snapshot.take(self.model, self.steps)
            except Exception as e:
                self._recover(f"the snapshot raised {type(e).__name__}: {e}")
                return out
        if self._detector.fault_seen:
            self._recover("another rank reported a fault")
        return out

    def save_checkpoint(self, checkpoint_id: str) -> CheckpointRecord:
        """
        Saves every shard of the model with its fused optimizer state (DCP):
        the checkpoint source of later recoveries. Every member calls it; after
        an :class:`UnrecoverableLossError` the survivors save what they hold.

        Args:
            checkpoint_id (str): a directory.

        Returns:
            CheckpointRecord: what was saved.
        """
        record = save_checkpoint(self.model, checkpoint_id, self.steps, self._group)
        if self._options.uses(CHECKPOINT):
            self._checkpoint = record
        return record

    def close(self) -> None:
        """Stops the watcher; this rank leaves without being taken as lost."""
        self._detector.leave()

    # ------------------------------------------------------------- recovery

    def _raise_if_store_lost(self) -> None:
        error = self._detector.store_error
        if error is not None:
            raise store_lost(error) from error

    def _set_collective_timeout(self, group: dist.ProcessGroup) -> None:
        timeout = self._options.collective_timeout
        if timeout is not None:
            group.set_timeout(timeout)

    def _abort_group(self) -> None:
        # NCCL: end the training group's kernels at once (a survivor waiting
        # in a collective with the lost rank is freed); gloo has no abort.
        if dist.get_backend(self._group) == dist.Backend.NCCL:
            self._group.abort()

    def _note_first_step(self) -> None:
        waiting = self._awaiting_first_step
        if waiting is not None:
            report, start = waiting
            report.first_step_seconds = time.monotonic() - start
            self._awaiting_first_step = None
            logger.info("rank %d: recovered\n%s", self._rank, report.timeline())

    def _recover(self, reason: str) -> None:
        start = time.monotonic()
        report = RecoveryReport(reason=reason, detected_at=time.time())
        current = self._membership
        while True:
            report.attempts += 1
            if report.attempts > self._options.max_recoveries:
                raise FaultToleranceError(
                    f"rank {self._rank}: {report.attempts - 1} recoveries in a row "
                    f"failed (last: {reason}); the job stops"
                )
            began = time.monotonic()
            membership = agree_on_members(
                self._store, self._keys, self._rank, current, self._options, reason
            )
            report.agree_seconds += time.monotonic() - began
            # watch the survivors' ring from now: a rank lost during the
            # recovery is reported in this generation
            self._detector.watch(membership.generation, membership.members)
            if report.fault is None and membership.fault is not None:
                report.fault = membership.fault
                report.detect_seconds = max(
                    0.0, report.detected_at - membership.fault.posted_at
                )
            if not membership.lost:
                self._membership = membership
                self._detector.watch(membership.generation, membership.members)
                fault = membership.fault
                raise FaultToleranceError(
                    f"rank {fault.rank if fault else '?'} saw a failure "
                    f"({fault.reason if fault else reason}) but no rank was lost: "
                    "the job stops on every rank"
                )
            try:
                self._recover_onto(membership, report)
            except (FaultToleranceError, KeyboardInterrupt):
                raise
            except Exception as e:  # a rank lost during the recovery
                logger.warning(
                    "rank %d: the recovery onto %s failed: %s",
                    self._rank,
                    list(membership.members),
                    e,
                )
                current = membership
                reason = f"the recovery failed ({type(e).__name__}: {e})"
                continue
            break
        self._membership = membership
        self._detector.watch(membership.generation, membership.members)
        report.generation = membership.generation
        self.reports.append(report)
        self._awaiting_first_step = (report, start)

    def _recover_onto(self, membership: Membership, report: RecoveryReport) -> None:
        survivors = list(membership.members)
        began = time.monotonic()
        group = dist.new_group(survivors, timeout=self._group_timeout())
        env = ShardingEnv.from_process_group(group)
        report.group_seconds += time.monotonic() - began

        began = time.monotonic()
        recovery, sources = self._agree_on_sources(survivors)
        report.sources_seconds += time.monotonic() - began
        report.members = tuple(survivors)
        report.lost_ranks = sources.lost_ranks
        report.lost_tables = tuple(recovery.lost_tables())
        report.failure_step = sources.failure_step
        report.plan = recovery.plan
        if sources.uncovered:
            # the survivors' group saves what they hold (save_checkpoint)
            self._group = group
            sources.check_covered()
        if self._on_failure is not None:
            self._on_failure(
                Failure(
                    membership,
                    recovery,
                    sources,
                    self.model,
                    self.optimizer,
                    self.steps,
                )
            )
        source_slots, read_seconds = self._source_slots(sources)
        if self.pipeline is not None:
            self.pipeline.detach()
        options = ReshardOptions(exchange_timeout=self._options.recovery_timeout)
        model, optimizer, move = recover_model(
            self.model,
            recovery,
            sources,
            source_slots,
            env,
            self.optimizer,
            self._make_optimizer,
            options,
        )
        # committed: the old model is released
        self.model, self.optimizer, self._group = model, optimizer, group
        if self._make_pipeline is not None:
            self.pipeline = self._make_pipeline(model, optimizer)
        if self._snapshot is not None:
            self._snapshot = BuddySnapshot(model, self._options)
        report.move = move
        report.move_seconds = move.seconds
        report.bytes_by_source = sources.bytes_by_source()
        report.steps_lost = sources.steps_lost()
        report.restore_seconds = {
            source: move.phases.exchange + (read_seconds if source == CHECKPOINT else 0)
            for source in report.bytes_by_source
        }

    def _group_timeout(self) -> timedelta:
        return self._options.collective_timeout or self._options.recovery_timeout

    def _agree_on_sources(
        self, survivors: List[int]
    ) -> Tuple[RecoveryPlan, AgreedSources]:
        model = self.model
        modules = sharded_modules(model.module)
        tables = {path: sharded_tables(m) for path, m in modules.items()}
        definition = unsharded_definition(model)
        old_ranks = dist.get_process_group_ranks(model._env.process_group)
        device_type = torch.device(model.device).type
        recovery = plan_for_survivors(
            model.plan,
            tables,
            old_ranks,
            survivors,
            definition,
            _element_bytes(definition, tables),
            device_type,
            _devices_of(model.plan, old_ranks, survivors, device_type),
        )
        digest = plan_digest(model.plan)
        snapshot = self._snapshot
        facts = SourceFacts(
            step=self.steps,
            plan=digest,
            snapshots=snapshot.offers() if snapshot is not None else (),
            checkpoint=self._checkpoint,
        )
        request = text_digest(
            f"recovery {self._membership.generation} {survivors} "
            + sharding_plan_text(recovery.plan)
        )
        agreement = agree_among_ranks(
            survivors,
            request,
            None,
            facts,
            self._options.recovery_timeout,
            merge=partial(
                _merge_sources,
                recovery,
                tuple(self._options.sources),
                digest,
                _replica_bytes(recovery, tables, definition, old_ranks),
            ),
        )
        return recovery, agreement.merged

    def _source_slots(
        self, sources: AgreedSources
    ) -> Tuple[Dict[SlotKey, LocalSlot], float]:
        held = sources.held_by(self._rank)
        slots: Dict[SlotKey, LocalSlot] = {}
        seconds = 0.0
        from_checkpoint = [p for p in held if p.kind == CHECKPOINT]
        if from_checkpoint:
            record = sources.checkpoint
            assert record is not None
            fields = {k: sources.fields_of(k) for k in {p.key for p in from_checkpoint}}
            read, _, seconds = load_pieces(record, from_checkpoint, fields)
            slots.update(read)
        from_snapshot = [p for p in held if p.kind == SNAPSHOT]
        if from_snapshot:
            snapshot = self._snapshot
            assert snapshot is not None
            slots.update(snapshot.slots_for(from_snapshot))
        return slots, seconds


def _merge_sources(
    recovery: RecoveryPlan,
    sources: Tuple[str, ...],
    plan: int,
    replica_bytes: int,
    facts: List[SourceFacts],
) -> AgreedSources:
    return choose_sources(recovery, facts, sources, plan, replica_bytes)


def _element_bytes(
    definition: nn.Module, tables: Dict[str, List[TableShape]]
) -> Dict[str, int]:
    """Bytes per element of each table's weight (to balance lost shards)."""
    return {
        TableKey(path, name): dtype.itemsize
        for path, name, dtype in plain_weight_dtypes(definition, tables)
    }


def _replica_bytes(
    recovery: RecoveryPlan,
    tables: Dict[str, List[TableShape]],
    definition: nn.Module,
    old_ranks: List[int],
) -> int:
    """Bytes of the data-parallel replicas the lost ranks held."""
    lost = len(set(old_ranks) - set(recovery.survivors))
    sizes = {
        TableKey(p, n): rows * cols
        for p, shapes in tables.items()
        for n, rows, cols in shapes
    }
    per_element = _element_bytes(definition, tables)
    return lost * sum(sizes[k] * per_element[k] for k in recovery.replicated)


def _devices_of(
    plan: ShardingPlan, old_ranks: List[int], survivors: List[int], device_type: str
) -> Callable[[int], str]:
    """
    The device of each survivor's shards, by its rank in the survivors'
    group: on CUDA the device its shards were on (its own GPU), read from
    the old plan's placements.
    """
    if device_type != "cuda":
        return lambda rank: device_type
    found: Dict[int, str] = {}
    for module_plan in plan.plan.values():
        for ps in module_plan.values():  # pyre-ignore[16]
            if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
                continue
            for shard in getattr(ps.sharding_spec, "shards", []) or []:
                placement = shard.placement
                if placement is not None and placement.rank() is not None:
                    global_rank = old_ranks[placement.rank()]
                    found.setdefault(global_rank, str(placement.device()))
    count = max(torch.cuda.device_count(), 1)
    devices = [found.get(g, f"cuda:{g % count}") for g in survivors]
    return lambda rank: devices[rank]

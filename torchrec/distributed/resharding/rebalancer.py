#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A running job that rebalances itself: ``Rebalancer`` measures the load of a
``DistributedModelParallel`` model (``load.LoadMonitor``), asks TorchRec's
planner for a plan under the measured load (``replan``), relabels it to keep
the most bytes in place (``relabel``) and reshards live when the policy says
the predicted saving pays for the move (``policy``)::

    rebalancer = Rebalancer(model, planner, RebalancePolicy(window=50))
    for batch in ...:
        pipeline.progress(it)     # or a plain training step
        rebalancer.step()         # every rank, once per step

Every ``window`` steps (and only then) the ranks all-reduce their counters
once; group rank 0 plans and broadcasts the candidate with a digest of the
statistics it planned from (every rank checks it); dry runs give the bytes
the raw and the relabelled candidate would move. A reshard that fails or
aborts leaves the model on its old plan and backs the policy off; nothing
else in the model changes. ``history`` keeps every decision.
"""

import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
from torchrec.distributed.resharding.load import LoadMonitor, LoadStatistics
from torchrec.distributed.resharding.model import dry_run
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import ReshardAbortedError, ReshardError
from torchrec.distributed.resharding.policy import (
    after_failure,
    after_reshard,
    blocked_reason,
    judge_move,
    PolicyState,
    RebalancePolicy,
    screen,
    with_bandwidth,
)
from torchrec.distributed.resharding.relabel import relabel_plan, table_blocks
from torchrec.distributed.resharding.replan import (
    align_with_current,
    changed_tables,
    measured_constraints,
    model_skeleton,
    needs_dense_rebuild,
    plan_candidate,
    PlanCost,
    predict_rank_costs,
)
from torchrec.distributed.resharding.runner import TransactionReport
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.modules.embedding_configs import data_type_to_dtype

logger: logging.Logger = logging.getLogger(__name__)


class RebalanceError(RuntimeError):
    """
    Raised on every rank when the ranks' statistics differ (impossible after
    one all-reduce; a guard) or the rebalancer is misused. The model is
    unchanged.
    """


@dataclass(frozen=True)
class Proposal:
    """
    Group rank 0's candidate for a window, broadcast to every rank.

    Args:
        digest (str): digest of the statistics it was planned from.
        raw (Optional[ShardingPlan]): the planner's plan (aligned with the
            current plan where a table keeps its layout).
        candidate (Optional[ShardingPlan]): ``raw`` relabelled.
        current_cost (Optional[PlanCost]): predicted, current plan.
        candidate_cost (Optional[PlanCost]): predicted, candidate.
        permutation (Tuple[int, ...]): the relabelling.
        error (Optional[str]): why there is no candidate.
    """

    digest: str
    raw: Optional[ShardingPlan] = None
    candidate: Optional[ShardingPlan] = None
    current_cost: Optional[PlanCost] = None
    candidate_cost: Optional[PlanCost] = None
    permutation: Tuple[int, ...] = ()
    error: Optional[str] = None


@dataclass(frozen=True)
class RebalanceDecision:
    """
    One window's decision, identical on every rank.

    Args:
        step (int): the step count at the end of the window.
        action (str): ``"reshard"``, ``"keep"`` or ``"failed"``.
        reason (str): why.
        imbalance (float): measured: the slowest rank's embedding seconds
            over the mean.
        embedding_seconds (Tuple[float, ...]): measured per rank and step.
        step_seconds (float): measured step time of the window.
        current_cost (Tuple[float, ...]): predicted per rank, current plan.
        candidate_cost (Tuple[float, ...]): predicted per rank, candidate.
        predicted_gain (float): 1 - candidate's slowest / current slowest.
        saving_per_step (float): predicted seconds saved per step.
        bytes_raw (Optional[int]): the dry run's bytes (sent + received, all
            ranks) of the raw candidate.
        bytes_relabelled (Optional[int]): the same, relabelled candidate.
        max_rank_bytes (Optional[int]): the busiest rank's bytes, relabelled.
        move_seconds (Optional[float]): the move's predicted seconds.
        tables (Tuple[str, ...]): tables the candidate changes.
        plan (Optional[ShardingPlan]): the plan resharded to.
        reshard_seconds (Optional[float]): the reshard's seconds (this rank).
        predicted_step_seconds (Optional[float]): predicted step time after.
    """

    step: int
    action: str
    reason: str
    imbalance: float
    embedding_seconds: Tuple[float, ...]
    step_seconds: float
    current_cost: Tuple[float, ...] = ()
    candidate_cost: Tuple[float, ...] = ()
    predicted_gain: float = 0.0
    saving_per_step: float = 0.0
    bytes_raw: Optional[int] = None
    bytes_relabelled: Optional[int] = None
    max_rank_bytes: Optional[int] = None
    move_seconds: Optional[float] = None
    tables: Tuple[str, ...] = ()
    plan: Optional[ShardingPlan] = field(default=None, compare=False, repr=False)
    reshard_seconds: Optional[float] = field(default=None, compare=False)
    predicted_step_seconds: Optional[float] = None

    def line(self) -> str:
        """The decision as one log line."""
        parts = [
            f"step {self.step}: {self.action.upper()} ({self.reason})",
            f"measured imbalance {self.imbalance:.2f}",
            "embedding ms/step per rank "
            + "/".join(f"{1e3 * s:.1f}" for s in self.embedding_seconds),
            f"step {self.step_seconds * 1e3:.1f} ms",
        ]
        if self.current_cost:
            parts.append(
                "predicted slowest rank "
                f"{max(self.current_cost):.3g} -> {max(self.candidate_cost):.3g} "
                f"(gain {self.predicted_gain:.1%}, {self.saving_per_step * 1e3:.2f} "
                "ms/step)"
            )
        if self.bytes_relabelled is not None:
            parts.append(
                f"bytes raw {self.bytes_raw} relabelled {self.bytes_relabelled}"
            )
        if self.move_seconds is not None:
            parts.append(f"move ~{self.move_seconds:.3f} s")
        if self.tables:
            parts.append(f"tables {', '.join(self.tables)}")
        return "; ".join(parts)


@dataclass(frozen=True)
class ReshardOutcome:
    """
    A reshard's prediction against the step time measured after it.

    Args:
        step (int): the reshard's step.
        step_seconds_before (float): measured in the window before it.
        predicted_step_seconds (float): predicted for after it.
        measured_step_seconds (float): measured in the first window after it.
    """

    step: int
    step_seconds_before: float
    predicted_step_seconds: float
    measured_step_seconds: float


def exchange_seconds(report: TransactionReport) -> float:
    """
    The seconds a reshard's bytes took, for the bandwidth estimate: its
    exchange phase (the agreement and the build cost the same whatever moves).
    """
    return report.phases.exchange


PlannerOrTopology = Union[EmbeddingShardingPlanner, Topology]


class Rebalancer:
    """
    Rebalances a ``DistributedModelParallel`` model from its measured load.
    Call ``step()`` once per training step on every rank, between steps (after
    ``pipeline.progress(...)`` or after a plain loop's optimizer step).

    Args:
        model (DistributedModelParallel): the sharded model.
        planner_or_topology (Union[EmbeddingShardingPlanner, Topology]): the
            planner that made the model's plan (its topology, batch size and
            constraints are reused; a fresh planner of the same settings plans
            each candidate) or the job's topology.
        policy (Optional[RebalancePolicy]): when to reshard.
        constraints (Optional[Mapping[str, ParameterConstraints]]): the user's
            own constraints (default: the planner's); measured load replaces
            their pooling figures.
        batch_size (Optional[int]): samples per rank and step (default: the
            planner's, else measured).
        sharders (Optional[Sequence[ModuleSharder[nn.Module]]]): default: the
            model's.
        options (Optional[ReshardOptions]): how reshards (and dry runs) run.
        rebuild_optimizer (Optional[Callable[[nn.Module], None]]): called with
            the model after a reshard that rebuilt dense or data-parallel
            tables; without it such candidates are refused.
        keep_kernels (bool): tables without kernel constraints keep theirs.
        allow_data_parallel (bool): tables without sharding-type constraints
            may become data-parallel.

    Raises:
        ValueError: for a bad policy or budget, a topology of another size.
    """

    def __init__(
        self,
        model: nn.Module,
        planner_or_topology: PlannerOrTopology,
        policy: Optional[RebalancePolicy] = None,
        constraints: Optional[Mapping[str, ParameterConstraints]] = None,
        batch_size: Optional[int] = None,
        sharders: Optional[Sequence[ModuleSharder[nn.Module]]] = None,
        options: Optional[ReshardOptions] = None,
        rebuild_optimizer: Optional[Callable[[nn.Module], None]] = None,
        keep_kernels: bool = True,
        allow_data_parallel: bool = False,
    ) -> None:
        if not hasattr(model, "plan") or not hasattr(model, "reshard"):
            raise ValueError("Rebalancer needs a DistributedModelParallel model")
        policy = policy if policy is not None else RebalancePolicy()
        if not isinstance(policy, RebalancePolicy):
            raise ValueError(f"policy must be a RebalancePolicy, got {type(policy)}")
        if isinstance(planner_or_topology, EmbeddingShardingPlanner):
            topology = planner_or_topology._topology
            batch_size = batch_size or planner_or_topology._batch_size
            if constraints is None:
                constraints = planner_or_topology._constraints
        elif isinstance(planner_or_topology, Topology):
            topology = planner_or_topology
        else:
            raise ValueError(
                "planner_or_topology must be an EmbeddingShardingPlanner or a "
                f"Topology, got {type(planner_or_topology).__name__}"
            )
        self._pg: dist.ProcessGroup = model._env.process_group
        self._rank: int = dist.get_rank(self._pg)
        self._world_size: int = dist.get_world_size(self._pg)
        if topology.world_size != self._world_size:
            raise ValueError(
                f"the topology has {topology.world_size} ranks, the model's "
                f"process group {self._world_size}"
            )
        self.policy: RebalancePolicy = policy
        self._model = model
        self._topology: Topology = topology
        self._batch_size: Optional[int] = batch_size
        self._constraints: Dict[str, ParameterConstraints] = dict(constraints or {})
        self._sharders: List[ModuleSharder[nn.Module]] = list(
            sharders if sharders is not None else model._sharder_map.values()
        )
        self._options = options
        self._rebuild_optimizer = rebuild_optimizer
        self._keep_kernels = keep_kernels
        self._allow_data_parallel = allow_data_parallel
        self._shapes: Dict[Tuple[str, str], Tuple[int, int, int]] = _table_shapes(model)
        _check_budget(policy, model.plan, self._shapes)
        self._skeleton: nn.Module = model_skeleton(model)
        self._monitor: LoadMonitor = LoadMonitor.for_model(model)
        self._state: PolicyState = PolicyState()
        self._step: int = 0
        self._pending: Optional[RebalanceDecision] = None
        self.history: List[RebalanceDecision] = []
        self.outcomes: List[ReshardOutcome] = []
        self.statistics: List[LoadStatistics] = []

    @property
    def state(self) -> PolicyState:
        return self._state

    @property
    def monitor(self) -> LoadMonitor:
        return self._monitor

    def close(self) -> None:
        """Removes the monitor's hooks; ``step()`` must not be called after."""
        self._monitor.remove()

    def step(self) -> Optional[RebalanceDecision]:
        """
        Ends a training step; at the end of a window, measures, decides and
        maybe reshards. Every rank calls it after the same step.

        Returns:
            Optional[RebalanceDecision]: the window's decision, else None.

        Raises:
            RebalanceError: when the ranks' statistics differ (every rank).
        """
        self._monitor.end_step()
        self._step += 1
        if self._step % self.policy.window:
            return None
        try:
            decision = self._window()
        finally:
            self._monitor.pause()  # the next step starts after this work
        self.history.append(decision)
        if self._rank == 0:
            logger.info("rebalance %s", decision.line())
        return decision

    def history_table(self) -> str:
        """Every decision so far, one line each."""
        return "\n".join(d.line() for d in self.history)

    def _window(self) -> RebalanceDecision:
        try:
            stats = self._monitor.collect(self._pg)
        except ValueError as e:  # the same sums on every rank: the same error
            raise RebalanceError(
                f"step {self._step}: the ranks' load statistics differ: {e}; "
                "the model is unchanged"
            ) from None
        self.statistics.append(stats)
        self._state = with_bandwidth(
            self._state, max(stats.reshard_bytes), max(stats.reshard_seconds)
        )
        self._note_outcome(stats)
        base = dict(
            step=self._step,
            imbalance=stats.imbalance,
            embedding_seconds=stats.embedding_seconds,
            step_seconds=stats.step_time,
        )
        blocked = blocked_reason(self.policy, self._state, self._step)
        if blocked is not None:
            return RebalanceDecision(action="keep", reason=blocked, **base)
        proposal = self._agree_on_proposal(stats)
        if proposal.error is not None:
            return RebalanceDecision(action="keep", reason=proposal.error, **base)
        candidate, raw = proposal.candidate, proposal.raw
        current_cost, candidate_cost = proposal.current_cost, proposal.candidate_cost
        assert candidate is not None and raw is not None
        assert current_cost is not None and candidate_cost is not None
        tables = tuple(changed_tables(self._model.plan, candidate))
        gain = (
            1.0 - candidate_cost.slowest / current_cost.slowest
            if current_cost.slowest > 0
            else 0.0
        )
        saving = self._saving_per_step(stats, current_cost, candidate_cost)
        base.update(
            current_cost=current_cost.per_rank,
            candidate_cost=candidate_cost.per_rank,
            predicted_gain=gain,
            saving_per_step=saving,
            tables=tables,
        )
        if not tables:
            self._state = screen(self.policy, self._state, 0.0)[1]
            return RebalanceDecision(
                action="keep", reason="the candidate equals the current plan", **base
            )
        reason, self._state = screen(self.policy, self._state, gain)
        if reason is not None:
            return RebalanceDecision(action="keep", reason=reason, **base)
        dense = needs_dense_rebuild(self._model.plan, candidate)
        if dense and self._rebuild_optimizer is None:
            return RebalanceDecision(
                action="keep",
                reason=(
                    f"the candidate rebuilds dense or data-parallel tables "
                    f"({', '.join(dense)}), whose optimizer must be rebuilt: pass "
                    "rebuild_optimizer to the Rebalancer"
                ),
                **base,
            )
        try:
            raw_run = dry_run(self._model, raw, self._options)
            new_run = (
                raw_run
                if raw is candidate
                else dry_run(self._model, candidate, self._options)
            )
        except (ReshardError, ReshardAbortedError) as e:
            self._state = after_failure(self.policy, self._state, self._step)
            return RebalanceDecision(
                action="failed", reason=f"dry run refused: {e}", **base
            )
        max_rank_bytes = _max_rank_bytes(new_run)
        base.update(
            bytes_raw=sum(raw_run.bytes_sent_by_rank.values()),
            bytes_relabelled=sum(new_run.bytes_sent_by_rank.values()),
            max_rank_bytes=max_rank_bytes,
        )
        reason, cost = judge_move(self.policy, self._state, saving, max_rank_bytes)
        base.update(move_seconds=cost)
        if reason is not None:
            return RebalanceDecision(action="keep", reason=reason, **base)
        return self._reshard(candidate, stats, saving, base)

    def _reshard(
        self,
        candidate: ShardingPlan,
        stats: LoadStatistics,
        saving: float,
        base: Dict[str, object],
    ) -> RebalanceDecision:
        dense = needs_dense_rebuild(self._model.plan, candidate)
        try:
            report = self._model.reshard(candidate, self._options)
        except (ReshardError, ReshardAbortedError) as e:
            self._state = after_failure(self.policy, self._state, self._step)
            logger.warning(
                "rebalance step %d: reshard failed, training goes on with the "
                "current plan: %s",
                self._step,
                e,
            )
            return RebalanceDecision(  # pyre-ignore[6]
                action="failed", reason=f"{type(e).__name__}: {e}", **base
            )
        seconds = exchange_seconds(report)
        self._monitor.record_reshard(report.bytes_sent + report.bytes_received, seconds)
        if dense and self._rebuild_optimizer is not None:
            self._rebuild_optimizer(self._model)
        self._state = after_reshard(self.policy, self._state, self._step)
        decision = RebalanceDecision(  # pyre-ignore[6]
            action="reshard",
            reason="the predicted saving over the horizon exceeds the move's cost",
            plan=candidate,
            reshard_seconds=report.seconds,
            predicted_step_seconds=max(stats.step_time - saving, 0.0),
            **base,
        )
        self._pending = decision
        return decision

    def _note_outcome(self, stats: LoadStatistics) -> None:
        pending, self._pending = self._pending, None
        if pending is None or pending.predicted_step_seconds is None:
            return
        outcome = ReshardOutcome(
            step=pending.step,
            step_seconds_before=pending.step_seconds,
            predicted_step_seconds=pending.predicted_step_seconds,
            measured_step_seconds=stats.step_time,
        )
        self.outcomes.append(outcome)
        if self._rank == 0:
            logger.info(
                "rebalance: after the reshard at step %d the step takes %.1f ms "
                "(predicted %.1f ms, before %.1f ms)",
                outcome.step,
                outcome.measured_step_seconds * 1e3,
                outcome.predicted_step_seconds * 1e3,
                outcome.step_seconds_before * 1e3,
            )

    def _saving_per_step(
        self, stats: LoadStatistics, current: PlanCost, candidate: PlanCost
    ) -> float:
        """
        Predicted seconds per step saved: the estimators' cut of the slowest
        rank, scaled to seconds by this window's measured embedding time over
        the predicted one (the estimators model other hardware than the job's).
        """
        measured = sum(stats.embedding_seconds)
        predicted = sum(current.per_rank)
        if measured > 0 and predicted > 0:
            return measured / predicted * (current.slowest - candidate.slowest)
        gain = 1.0 - candidate.slowest / current.slowest if current.slowest else 0.0
        return gain * stats.step_time

    def _agree_on_proposal(self, stats: LoadStatistics) -> Proposal:
        digest = stats.digest()
        payload: List[Optional[Proposal]] = [None]
        if self._rank == 0:
            payload[0] = self._propose(stats, digest)
        dist.broadcast_object_list(
            payload, src=dist.get_global_rank(self._pg, 0), group=self._pg
        )
        proposal = payload[0]
        assert proposal is not None
        same = torch.tensor([int(proposal.digest == digest)], device=self._model.device)
        dist.all_reduce(same, op=dist.ReduceOp.MIN, group=self._pg)
        if not int(same.item()):
            raise RebalanceError(
                f"step {self._step}: the ranks' load statistics differ (rank "
                f"{self._rank}: {digest[:12]}, group rank 0: {proposal.digest[:12]}); "
                "the model is unchanged"
            )
        return proposal

    def _propose(self, stats: LoadStatistics, digest: str) -> Proposal:
        current = self._model.plan
        try:
            batch_size = self._batch_size or _measured_batch_size(stats)
            constraints = measured_constraints(
                stats,
                current,
                batch_size,
                self._constraints,
                self._keep_kernels,
                self._allow_data_parallel,
            )
            raw = align_with_current(
                current,
                plan_candidate(
                    self._skeleton,
                    self._sharders,
                    self._topology,
                    batch_size,
                    constraints,
                ),
            )
            relabelled = relabel_plan(
                current,
                raw,
                self._shapes,
                self._world_size,
                self._topology.local_world_size,
            )
            candidate = (
                raw
                if relabelled.permutation == tuple(range(self._world_size))
                else align_with_current(current, relabelled.plan)
            )
            current_cost, candidate_cost = predict_rank_costs(
                [current, candidate],
                self._skeleton,
                self._sharders,
                self._topology,
                batch_size,
                constraints,
            )
        except PlannerError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return Proposal(
                digest, error=f"the planner found no feasible plan: {first}"
            )
        except Exception as e:  # the other ranks wait for the broadcast
            logger.exception("rebalance: planning failed")
            return Proposal(digest, error=f"planning failed: {type(e).__name__}: {e}")
        return Proposal(
            digest,
            raw=raw,
            candidate=candidate,
            current_cost=current_cost,
            candidate_cost=candidate_cost,
            permutation=relabelled.permutation,
        )


def _measured_batch_size(stats: LoadStatistics) -> int:
    sizes = [s for load in stats.tables for s in load.samples_per_rank_step]
    return max(1, round(max(sizes, default=1.0)))


def _max_rank_bytes(report: TransactionReport) -> int:
    sent, received = report.bytes_sent_by_rank, report.bytes_received_by_rank
    return max(
        (sent.get(r, 0) + received.get(r, 0) for r in set(sent) | set(received)),
        default=0,
    )


def _table_shapes(model: nn.Module) -> Dict[Tuple[str, str], Tuple[int, int, int]]:
    """(path, table) -> (rows, columns, bytes per element) of every table."""
    shapes = {}
    for path in model.plan.plan:
        sharded = model.module.get_submodule(path) if path else model.module
        configs = getattr(sharded, "_embedding_bag_configs", None)
        if configs is None:
            configs = sharded._embedding_configs
        for c in configs:
            itemsize = torch.empty(
                (), dtype=data_type_to_dtype(c.data_type)
            ).element_size()
            shapes[(path, c.name)] = (c.num_embeddings, c.embedding_dim, itemsize)
    return shapes


def _check_budget(
    policy: RebalancePolicy,
    plan: ShardingPlan,
    shapes: Mapping[Tuple[str, str], Tuple[int, int, int]],
) -> None:
    """A budget below the smallest shard of the model fits no move at all."""
    if policy.move_budget_bytes is None:
        return
    smallest = min(
        b.rows * b.cols * shapes[(path, table)][2]
        for (path, table) in shapes
        for b in table_blocks(
            plan.plan[path][table],  # pyre-ignore[16]
            shapes[(path, table)][0],
            shapes[(path, table)][1],
        )
    )
    if policy.move_budget_bytes < smallest:
        raise ValueError(
            f"bad RebalancePolicy: move_budget_bytes {policy.move_budget_bytes} B "
            f"is below the smallest shard of the model ({smallest} B): no reshard "
            "could ever fit"
        )

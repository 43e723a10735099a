#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A running job that rebalances itself: ``Rebalancer`` measures the load of a
``DistributedModelParallel`` model (``load.LoadMonitor``), searches for shard
moves that cut the slowest rank (``search``, every window, on every rank),
predicts the step time they leave from what it measured (``costs``) and
reshards live when the policy says the saving pays for the move
(``policy``)::

    rebalancer = Rebalancer(model, topology, RebalancePolicy(window=50))
    for batch in ...:
        pipeline.progress(it)     # or a plain training step
        rebalancer.step()         # every rank, once per step

Every ``window`` steps (and only then) the ranks all-reduce their counters
once; with them each rank posts a digest of what it decides from (the plan,
the policy's state, the settings), so that every rank sees whether they all
decide from the same. Every rank then runs the same deterministic search on
the same statistics and reaches the same candidate: no plan is broadcast.
When moving whole shards cannot reach the policy's gain but splitting them
could, group rank 0 starts TorchRec's full planner in a process of its own;
a later window's all-reduce says its result is ready, and the ranks agree on
it through the engine's agreement before they consider it. A reshard that
fails or aborts leaves the model on its old plan and backs the policy off;
nothing else in the model changes. ``history`` keeps every decision and
``outcomes`` every reshard's predicted against its measured step time (in
the first window after it, and the median of the windows until the policy
may reshard again).
With ``split_shards``, the first searches also measure, on every rank at the
same point, what a split adds outside the kernels
(``measure_exchange_price``: an all-to-all of the group, small and large,
and TorchRec's bucketization of ids by row block; the slowest rank's
figures; the first ``EXCHANGE_CALIBRATIONS`` windows that search measure it
once each, and the median of those so far is the price, so that a burst of
load during one calibration does not price every later split): a split is
then taken only where the slowest rank's kernel plus priced exchange seconds
fall.
"""

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.resharding.agreement import agree_among_ranks
from torchrec.distributed.resharding.fields import TableKey
from torchrec.distributed.resharding.model import dry_run
from torchrec.distributed.resharding.model_view import (
    model_env,
    model_sharders,
    sharded_tables,
)
from torchrec.distributed.resharding.module_adapters import adapter_for
from torchrec.distributed.resharding.options import ReshardOptions
from torchrec.distributed.resharding.plan import ReshardAbortedError, ReshardError
from torchrec.distributed.resharding.plan_validation import (
    sharding_plan_text,
    text_digest,
)
from torchrec.distributed.resharding.rebalance.candidates import (
    Candidate,
    changed_tables,
    FULL_REPLAN,
    over_memory,
    screen_candidate,
    search_candidate,
)
from torchrec.distributed.resharding.rebalance.costs import (
    calibrate,
    predict_placement,
    propose,
    StepPrediction,
    window_elements,
)
from torchrec.distributed.resharding.rebalance.decisions import (  # noqa: F401
    RebalanceDecision,
    ReshardOutcome,
)
from torchrec.distributed.resharding.rebalance.exchange_calibration import (
    EXCHANGE_CALIBRATIONS,
    measure_exchange_price,
)
from torchrec.distributed.resharding.rebalance.exchange_price import (
    ExchangePrice,
    median_price,
)
from torchrec.distributed.resharding.rebalance.monitor import LoadMonitor
from torchrec.distributed.resharding.rebalance.options import (
    legacy_options,
    MoveOptions,
    ReplanOptions,
)
from torchrec.distributed.resharding.rebalance.placement import (
    device_for_rank,
    Placement,
    placement_of,
)
from torchrec.distributed.resharding.rebalance.policy import (
    after_failure,
    after_replan,
    after_replan_started,
    after_reshard,
    blocked_reason,
    byte_price,
    judge_move,
    may_replan,
    PolicyState,
    RebalancePolicy,
    with_bandwidth,
)
from torchrec.distributed.resharding.rebalance.replan import (
    measured_constraints,
    needs_dense_rebuild,
    planning_definition,
    ReplanRequest,
    ThreadReplanner,
)
from torchrec.distributed.resharding.rebalance.replan_process import ProcessReplanner
from torchrec.distributed.resharding.rebalance.row_splits import ROW_TYPES
from torchrec.distributed.resharding.rebalance.statistics import LoadStatistics
from torchrec.distributed.resharding.transaction_report import TransactionReport
from torchrec.distributed.resharding.whole_plan import (
    plan_delta,
    plan_with_delta,
    TableShape,
)
from torchrec.distributed.types import (
    ModuleSharder,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)
from torchrec.modules.embedding_configs import data_type_to_dtype

logger: logging.Logger = logging.getLogger(__name__)

Delta = Dict[str, Dict[str, ParameterSharding]]


@dataclass(frozen=True)
class _ModelView:
    """What the rebalancer reads of the model's plan (once per plan)."""

    plan: ShardingPlan
    tables: Dict[str, List[TableShape]]
    itemsize: Dict[str, int]
    element_bytes: Dict[str, int]
    placement: Placement
    digest: int


def _first_post(facts: List[Any]) -> Any:
    """The agreement's merge: group rank 0's facts."""
    return facts[0]


def _measured_batch_size(stats: LoadStatistics) -> int:
    sizes = [s for load in stats.tables for s in load.samples_per_rank_step]
    return max(1, round(max(sizes, default=1.0)))


def _max_rank_bytes(report: TransactionReport) -> int:
    sent, received = report.bytes_sent_by_rank, report.bytes_received_by_rank
    return max(
        (sent.get(r, 0) + received.get(r, 0) for r in set(sent) | set(received)),
        default=0,
    )


def move_seconds(report: TransactionReport) -> float:
    """
    The seconds a reshard's bytes took: its exchange phase without
    connecting the exchange group (paid once per kept group, not per byte).

    Args:
        report (TransactionReport): the reshard's report.

    Returns:
        float: seconds.
    """
    return max(0.0, report.phases.exchange - report.connect_seconds)


class Rebalancer:
    """
    Rebalances a ``DistributedModelParallel`` model from its measured load.
    Call ``step()`` once per training step on every rank, between steps (after
    ``pipeline.progress(...)`` or after a plain loop's optimizer step).

    Args:
        model (DistributedModelParallel): the sharded model.
        topology (Topology): the job's topology (each rank's memory bounds the
            moves; the full planner plans on it).
        policy (Optional[RebalancePolicy]): when to reshard.
        replan (Optional[ReplanOptions]): what the full replan plans with
            (batch size, constraints, sharders, kernels, the replanner).
        moves (Optional[MoveOptions]): how the reshards run (its
            ``ReshardOptions``), the optimizer rebuild, the state factor.

    The keywords the constructor took before the groups (``batch_size``,
    ``constraints``, ``sharders``, ``options``, ``rebuild_optimizer``,
    ``keep_kernels``, ``allow_data_parallel``, ``state_factor``,
    ``replanner``, also by position after ``policy``) still work, with a
    ``DeprecationWarning``.

    Raises:
        ValueError: for a bad policy or budget, a topology of another size.
    """

    def __init__(
        self,
        model: nn.Module,
        topology: Topology,
        policy: Optional[RebalancePolicy] = None,
        *args: Any,
        replan: Optional[ReplanOptions] = None,
        moves: Optional[MoveOptions] = None,
        **legacy: Any,
    ) -> None:
        replan, moves = legacy_options(args, legacy, replan, moves)
        self.replan_options: ReplanOptions = replan
        self.move_options: MoveOptions = moves
        state_factor = moves.state_factor
        if not hasattr(model, "plan") or not hasattr(model, "reshard"):
            raise ValueError("Rebalancer needs a DistributedModelParallel model")
        policy = policy if policy is not None else RebalancePolicy()
        if not isinstance(policy, RebalancePolicy):
            raise ValueError(f"policy must be a RebalancePolicy, got {type(policy)}")
        if not isinstance(topology, Topology):
            raise ValueError(
                f"topology must be a planner Topology, got {type(topology).__name__}"
            )
        if not state_factor >= 1.0:
            raise ValueError(f"state_factor must be >= 1, got {state_factor!r}")
        self._pg: dist.ProcessGroup = model_env(model).process_group
        self._rank: int = dist.get_rank(self._pg)
        self._world_size: int = dist.get_world_size(self._pg)
        if topology.world_size != self._world_size:
            raise ValueError(
                f"the topology has {topology.world_size} ranks, the model's "
                f"process group {self._world_size}"
            )
        # a move's assumed bandwidth before one was measured: the device's
        self.policy: RebalancePolicy = policy.on_device(model.device.type)
        self._model = model
        self._topology = topology
        self._batch_size: Optional[int] = replan.batch_size
        self._constraints: Dict[str, ParameterConstraints] = dict(
            replan.constraints or {}
        )
        self._sharders: List[ModuleSharder[nn.Module]] = list(
            replan.sharders if replan.sharders is not None else model_sharders(model)
        )
        # its reshards keep their exchange groups in the model's ShardingEnv
        # (exchange_groups.kept_exchange_groups): each set of ranks connects once
        self._options: ReshardOptions = moves.reshard or ReshardOptions()
        self._rebuild_optimizer = moves.rebuild_optimizer
        self._keep_kernels: bool = replan.keep_kernels
        self._allow_data_parallel: bool = replan.allow_data_parallel
        self._state_factor: float = state_factor
        self._settings: str = repr((policy, state_factor, replan.keep_kernels))
        self._capacity: List[float] = [
            float(d.storage.hbm if topology.compute_device == "cuda" else d.storage.ddr)
            for d in topology.devices
        ]
        self._global_ranks: List[int] = dist.get_process_group_ranks(self._pg)
        self._view: _ModelView = self._read_model()
        _check_budget(policy, self._view)
        self._monitor: LoadMonitor = LoadMonitor.for_model(model)
        self._background: Union[ProcessReplanner, ThreadReplanner] = (
            ProcessReplanner()
            if replan.replanner is None
            else ThreadReplanner(replan.replanner)
        )
        self._replan_digest: int = 0
        self._state: PolicyState = PolicyState()
        self._seconds_per_element: Optional[float] = None
        self._exchange_prices: List[ExchangePrice] = []
        self._step: int = 0
        self._pending: Optional[RebalanceDecision] = None
        # the last step whose window the last reshard's outcome settles on
        self._settling_until: int = -1
        self.history: List[RebalanceDecision] = []
        self.outcomes: List[ReshardOutcome] = []

    @property
    def state(self) -> PolicyState:
        return self._state

    @property
    def exchange_price(self) -> Optional[ExchangePrice]:
        """
        What the work outside the kernels that a split adds costs: the
        median of the calibrations before the first searches that may split
        (one each, ``EXCHANGE_CALIBRATIONS`` in all; None before the first).
        """
        if not self._exchange_prices:
            return None
        return median_price(self._exchange_prices)

    @property
    def exchange_calibrations(self) -> Tuple[ExchangePrice, ...]:
        """Each calibration ``exchange_price`` is the median of, in order."""
        return tuple(self._exchange_prices)

    @property
    def monitor(self) -> LoadMonitor:
        return self._monitor

    @property
    def replan_ready(self) -> bool:
        """This rank's full replan has finished; the next window takes it."""
        return self._background.ready()

    def close(self) -> None:
        """
        Removes the monitor's hooks and ends the replan process; ``step()``
        must not be called after. The exchange groups of its reshards stay
        with the model's ``ShardingEnv``
        (``exchange_groups.kept_exchange_groups(env).close()`` ends them).
        """
        self._monitor.remove()
        self._background.close()

    def step(self) -> Optional[RebalanceDecision]:
        """
        Ends a training step; at the end of a window, measures, decides and
        maybe reshards. Every rank calls it after the same step.

        Returns:
            Optional[RebalanceDecision]: the window's decision, else None.
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

    def _read_model(self) -> _ModelView:
        """The model's tables and placement under its current plan."""
        model = self._model
        plan: ShardingPlan = model.plan
        tables: Dict[str, List[TableShape]] = {}
        itemsize: Dict[str, int] = {}
        for path in sorted(plan.plan):
            module = model.module.get_submodule(path) if path else model.module
            tables[path] = sharded_tables(module)
            for c in adapter_for(module).configs():
                dtype = data_type_to_dtype(c.data_type)
                itemsize[TableKey(path, c.name)] = dtype.itemsize
        element_bytes = {
            k: int(round(v * self._state_factor)) for k, v in itemsize.items()
        }
        placement = placement_of(plan, tables, element_bytes, self._world_size)
        digest = text_digest(sharding_plan_text(plan))
        return _ModelView(plan, tables, itemsize, element_bytes, placement, digest)

    def _current_view(self) -> _ModelView:
        if self._view.plan is not self._model.plan:  # resharded since
            self._view = self._read_model()
        return self._view

    def _state_digest(self, view: _ModelView) -> float:
        """What this rank decides from, as a float the all-reduce keeps exact."""
        text = (
            f"{view.digest}|{self._state}|{self._seconds_per_element!r}|"
            f"{self.exchange_price!r}"
        )
        return float(text_digest(text + "|" + self._settings) >> 11)

    def _device_of(self, rank: int) -> str:
        return device_for_rank(
            self._model.device.type, rank, self._topology.local_world_size
        )

    def _window(self) -> RebalanceDecision:
        view = self._current_view()
        ready = self._rank == 0 and self._background.ready()
        extra = (self._state_digest(view), 1.0 if ready else 0.0)
        try:
            stats = self._monitor.collect(self._pg, extra)
        except ValueError as e:  # read from the reduced counters: every rank
            return self._disagreement(f"the ranks' load statistics differ: {e}")
        self._state = with_bandwidth(
            self._state, max(stats.reshard_bytes), max(stats.reshard_seconds)
        )
        self._note_outcome(stats)
        decision = RebalanceDecision(
            step=self._step,
            action="keep",
            reason="",
            imbalance=stats.imbalance,
            kernel_seconds=stats.compute_seconds,
            step_seconds=stats.step_time,
        )
        if len({values[0] for values in stats.extra}) > 1:
            return self._disagreement(
                "the ranks decide from different plans, policy states or settings",
                decision,
            )
        lookup = self.policy.shard_lookup_columns()
        elements = window_elements(stats, view.placement, lookup)
        slope = calibrate(stats.compute_seconds, elements, self._seconds_per_element)
        self._seconds_per_element = slope
        if stats.extra[0][1] > 0:  # group rank 0's full replan is ready
            return self._take_replan(stats, view, slope, decision)
        blocked = blocked_reason(self.policy, self._state, self._step)
        if blocked is not None:
            return replace(decision, reason=blocked)
        if slope is None:
            return replace(decision, reason="no kernel time measured yet")
        return self._search(stats, view, slope, decision)

    def _disagreement(
        self, why: str, decision: Optional[RebalanceDecision] = None
    ) -> RebalanceDecision:
        self._state = after_failure(self.policy, self._state, self._step)
        reason = (
            f"{why}: training goes on with the current plan; backing off until "
            f"step {self._state.blocked_until}"
        )
        logger.warning("rebalance step %d: %s", self._step, reason)
        base = decision or RebalanceDecision(step=self._step, action="keep", reason="")
        return replace(base, reason=reason)

    def _search(
        self,
        stats: LoadStatistics,
        view: _ModelView,
        slope: float,
        decision: RebalanceDecision,
    ) -> RebalanceDecision:
        split = self.policy.split_shards
        if split and len(self._exchange_prices) < EXCHANGE_CALIBRATIONS:
            # every rank, same window
            price = measure_exchange_price(self._pg, self._model.device)
            self._exchange_prices.append(price)
            if self._rank == 0:
                logger.info(
                    "rebalance: split prices %s (calibration %d: %s)",
                    self.exchange_price,
                    len(self._exchange_prices),
                    price,
                )
        start = time.perf_counter()
        proposal = propose(
            stats,
            view.placement,
            slope,
            self._capacity,
            byte_price(self.policy, self._state),
            self.policy.move_budget_bytes,
            self._splittable(view) if self.policy.split_shards else None,
            self.policy.shard_lookup_columns(),
            self._row_splittable(view) if split else None,
            self._topology.local_world_size,
            self.exchange_price,
        )
        candidate = search_candidate(
            proposal,
            view.plan,
            view.placement,
            self._device_of,
            time.perf_counter() - start,
        )
        if proposal.row_splits is not None and proposal.row_splits.layouts:
            exchange = proposal.row_splits.exchange_seconds
            decision = replace(decision, exchange_seconds=exchange)
        return self._judge(candidate, stats, decision)

    def _judge(
        self,
        candidate: Candidate,
        stats: LoadStatistics,
        decision: RebalanceDecision,
    ) -> RebalanceDecision:
        """
        Every candidate's one path, whatever its source: the policy's screen,
        the dry run, the move's price, the reshard.
        """
        decision = replace(
            self._with_prediction(
                decision, candidate.prediction, candidate.decision_source
            ),
            tables=candidate.tables,
            search_seconds=candidate.seconds,
        )
        screening = screen_candidate(self.policy, self._state, candidate)
        self._state = screening.state
        plan = candidate.plan
        if screening.reason is not None or plan is None:
            reason = screening.reason or "no plan"
            if not candidate.per_window:
                return self._replan_done(decision, reason)
            if screening.below_bar and candidate.gain_bound is not None:
                reason += self._maybe_replan(stats, candidate.gain_bound)
            return replace(decision, reason=reason)
        outcome = self._try_reshard(plan, candidate.prediction, decision)
        if not candidate.per_window:
            self._state = after_replan(
                self.policy, self._state, self._step, outcome.action == "reshard"
            )
        return outcome

    def _splittable(self, view: _ModelView) -> Set[str]:
        """Keys of the tables the user's constraints let become column-wise."""
        column_wise = ShardingType.COLUMN_WISE.value
        out = set()
        for table in view.placement.tables:
            constraint = self._constraints.get(table.name)
            types = None if constraint is None else constraint.sharding_types
            if types is None or column_wise in types:
                out.add(table.key)
        return out

    def _row_splittable(self, view: _ModelView) -> Dict[str, Tuple[str, ...]]:
        """Per table key, the row sharding types the user's constraints allow."""
        out = {}
        for table in view.placement.tables:
            constraint = self._constraints.get(table.name)
            types = None if constraint is None else constraint.sharding_types
            allowed = tuple(t for t in ROW_TYPES if types is None or t in types)
            if allowed:
                out[table.key] = allowed
        return out

    def _with_prediction(
        self, decision: RebalanceDecision, prediction: StepPrediction, source: str
    ) -> RebalanceDecision:
        return replace(
            decision,
            source=source,
            predicted_kernel_seconds=prediction.predicted_kernels,
            predicted_step_seconds=prediction.predicted_step,
            predicted_gain=prediction.gain,
            saving_per_step=prediction.saving,
        )

    def _maybe_replan(self, stats: LoadStatistics, gain_bound: float) -> str:
        """Starts a full replan when the policy allows it; says so."""
        if self._state.replan_pending:
            return "; a full replan runs in the background"
        if not may_replan(self.policy, self._state, self._step, gain_bound):
            return ""
        self._state = after_replan_started(self._state)
        if self._rank == 0:
            view = self._view
            batch_size = self._batch_size or _measured_batch_size(stats)
            request = ReplanRequest(
                step=self._step,
                definition=planning_definition(self._model),
                sharders=tuple(self._sharders),
                topology=self._topology,
                batch_size=batch_size,
                constraints=measured_constraints(
                    stats,
                    view.plan,
                    batch_size,
                    self._constraints,
                    self._keep_kernels,
                    self._allow_data_parallel,
                ),
                current=view.plan,
                tables=view.tables,
                element_bytes=view.element_bytes,
                device_type=self._model.device.type,
            )
            self._replan_digest = view.digest
            if not self._background.busy:
                self._background.start(request)
        return (
            f"; splitting shards could gain {gain_bound:.1%}: full replan started "
            "in the background"
        )

    def _posted_replan(self, view: _ModelView) -> Tuple[int, Optional[str], Delta]:
        """Group rank 0's finished replan, as it posts it: (step, error, delta)."""
        result = self._background.take()
        if result is None:
            return -1, "the full replan's result went missing", {}
        if result.plan is None:
            return result.step, f"failed: {result.error}", {}
        if self._replan_digest != view.digest:
            return result.step, "stale: the model was resharded since", {}
        try:
            return result.step, None, plan_delta(view.plan, result.plan)
        except ReshardError as e:
            return result.step, f"refused: {e}", {}

    def _take_replan(
        self,
        stats: LoadStatistics,
        view: _ModelView,
        slope: Optional[float],
        decision: RebalanceDecision,
    ) -> RebalanceDecision:
        start = time.perf_counter()
        posted = self._posted_replan(view) if self._rank == 0 else None
        timeout = self._options.exchange_timeout
        try:
            agreement = agree_among_ranks(
                self._global_ranks,
                text_digest(f"rebalance full replan at step {self._step}"),
                None,
                posted,
                timeout,
                merge=_first_post,
            )
        except (ReshardError, ReshardAbortedError) as e:
            return self._replan_done(decision, f"its result was not agreed on: {e}")
        planned_at, error, delta = agreement.merged
        if error is not None:
            return self._replan_done(decision, f"(from step {planned_at}) {error}")
        blocked = blocked_reason(self.policy, self._state, self._step)
        if blocked is not None or slope is None:
            why = blocked or "no kernel time measured"
            return self._replan_done(decision, f"ignored: {why}")
        plan = plan_with_delta(view.plan, delta)
        after = placement_of(plan, view.tables, view.element_bytes, self._world_size)
        prediction = predict_placement(
            stats,
            view.placement,
            after,
            slope,
            self.policy.shard_lookup_columns(),
            self.exchange_price,
        )
        candidate = Candidate(
            source=FULL_REPLAN,
            plan=plan,
            prediction=prediction,
            tables=changed_tables(delta),
            over_memory=over_memory(
                view.placement.rank_bytes(), after.rank_bytes(), self._capacity
            ),
            seconds=time.perf_counter() - start,
        )
        return self._judge(candidate, stats, decision)

    def _replan_done(self, decision: RebalanceDecision, why: str) -> RebalanceDecision:
        self._state = after_replan(self.policy, self._state, self._step, False)
        reason = f"full replan {why}; training goes on with the current plan"
        logger.info("rebalance step %d: %s", self._step, reason)
        return replace(decision, reason=reason)

    def _try_reshard(
        self,
        candidate: ShardingPlan,
        prediction: StepPrediction,
        decision: RebalanceDecision,
    ) -> RebalanceDecision:
        current = self._model.plan
        dense = needs_dense_rebuild(current, candidate)
        if dense and self._rebuild_optimizer is None:
            return replace(
                decision,
                reason=(
                    f"the candidate rebuilds dense or data-parallel tables "
                    f"({', '.join(dense)}), whose optimizer must be rebuilt: pass "
                    "rebuild_optimizer to the Rebalancer"
                ),
            )
        try:
            report = dry_run(self._model, candidate, self._options)
        except (ReshardError, ReshardAbortedError) as e:
            self._state = after_failure(self.policy, self._state, self._step)
            logger.warning("rebalance step %d: dry run refused: %s", self._step, e)
            return replace(decision, action="failed", reason=f"dry run refused: {e}")
        max_rank_bytes = _max_rank_bytes(report)
        reason, cost = judge_move(
            self.policy, self._state, prediction.saving, max_rank_bytes
        )
        decision = replace(
            decision,
            max_rank_bytes=max_rank_bytes,
            bytes_moved=sum(report.bytes_sent_by_rank.values()),
            move_seconds=cost,
        )
        if reason is not None:
            return replace(decision, reason=reason)
        try:
            done = self._model.reshard(candidate, self._options)
        except (ReshardError, ReshardAbortedError) as e:
            self._state = after_failure(self.policy, self._state, self._step)
            logger.warning(
                "rebalance step %d: reshard failed, training goes on with the "
                "current plan: %s",
                self._step,
                e,
            )
            return replace(decision, action="failed", reason=f"{type(e).__name__}: {e}")
        # the bandwidth from the exchange phase: the agreement and the build
        # cost the same whatever moves
        moved = done.bytes_sent + done.bytes_received
        self._monitor.record_reshard(moved, move_seconds(done))
        if dense and self._rebuild_optimizer is not None:
            self._rebuild_optimizer(self._model)
        self._state = after_reshard(self.policy, self._state, self._step)
        decision = replace(
            decision,
            action="reshard",
            reason="the predicted saving over the horizon exceeds the move's cost",
            plan=candidate,
            reshard_seconds=done.seconds,
        )
        self._pending = decision
        return decision

    def _note_outcome(self, stats: LoadStatistics) -> None:
        """
        The last reshard's outcome: made from the first window after it, then
        each window until ``min_interval`` steps past it added to its
        settling windows.
        """
        pending, self._pending = self._pending, None
        if pending is not None and pending.predicted_step_seconds is not None:
            outcome = ReshardOutcome(
                step=pending.step,
                step_seconds_before=pending.step_seconds,
                predicted_step_seconds=pending.predicted_step_seconds,
                measured_step_seconds=stats.step_time,
                settling_step_seconds=(stats.step_time,),
            )
            self.outcomes.append(outcome)
            self._settling_until = pending.step + self.policy.min_interval
            if self._rank == 0:
                logger.info(
                    "rebalance: after the reshard at step %d the step takes %.2f ms: "
                    "predicted %.2f ms (%+.1f%%), before %.2f ms",
                    outcome.step,
                    outcome.measured_step_seconds * 1e3,
                    outcome.predicted_step_seconds * 1e3,
                    outcome.error * 100,
                    outcome.step_seconds_before * 1e3,
                )
            return
        if not self.outcomes or self._step > self._settling_until:
            return
        outcome = self.outcomes[-1].with_window(stats.step_time)
        self.outcomes[-1] = outcome
        if self._rank == 0 and self._step + self.policy.window > self._settling_until:
            logger.info(
                "rebalance: over the %d windows after the reshard at step %d the "
                "step takes %.2f ms (median): predicted %.2f ms (%+.1f%%)",
                len(outcome.settling_step_seconds),
                outcome.step,
                outcome.settled_step_seconds * 1e3,
                outcome.predicted_step_seconds * 1e3,
                outcome.settled_error * 100,
            )


def _check_budget(policy: RebalancePolicy, view: _ModelView) -> None:
    """A budget below the smallest shard's weights fits no move at all."""
    if policy.move_budget_bytes is None:
        return
    smallest = min(
        shard.rect.numel * view.itemsize[table.key]
        for table in view.placement.tables
        for shard in table.layout.shards
    )
    if policy.move_budget_bytes < smallest:
        raise ValueError(
            f"bad RebalancePolicy: move_budget_bytes {policy.move_budget_bytes} B "
            f"is below the smallest shard of the model ({smallest} B): no reshard "
            "could ever fit"
        )

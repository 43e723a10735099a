#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Live resharding of sharded embedding modules: move tables or table shards
between ranks (and between sharding types, and between sets of ranks) inside
a running job.

* ``plan`` — pure: layouts as rectangles, each rank's transfers, validation;
* ``fields`` — pure: the state that travels with a table (fields, facts);
* ``options`` — how a transaction runs;
* ``agreement`` — the bounded agreement of the participants on the job's
  store (a coordinator merges, everyone reads one decision);
* ``exchange`` — the one executor: a rank's part of the plan over the
  transaction's own process group;
* ``runner`` / ``slots`` — the one transaction runner: agree, build,
  exchange, commit, and the shards it reads and writes;
* ``kernel_state`` / ``optimizer_state`` — a kernel's shards and fused
  optimizer state as slots the executor reads and writes;
* ``kept_grouping`` / ``storage`` / ``retired`` — kernel memory: kept shards
  keep their storage, old storage is released only where nobody else can see
  it;
* ``install`` / ``install_ec`` / ``adapters`` / ``groups`` — module surgery:
  what a reshard needs to know about a ``ShardedEmbeddingBagCollection`` /
  ``ShardedEmbeddingCollection``, and building its new groups;
* ``transaction`` — a reshard within a process group (modules of one group);
* ``model`` — ``DistributedModelParallel``: a whole new plan in one
  transaction, and its dry run;
* ``elastic_plan`` — pure: a move between groups of ranks, its layouts and the
  checks of the shared facts;
* ``model_view`` — a model as the moves see it;
* ``elastic`` — a model onto another set of ranks (shrink, grow, any set);
* ``unshard`` — a model unsharded onto one rank, or sharded from the one rank
  holding its weights;
* ``load`` — the load a running model measures (ids per feature, time per
  rank), ``replan`` — TorchRec's planner on the measured load and its cost
  predictions, ``relabel`` — the candidate's ranks relabelled to keep the most
  bytes in place, ``policy`` — when a reshard pays (pure), ``rebalancer`` —
  the loop that measures, decides and reshards while the job trains.
"""

from torchrec.distributed.resharding.elastic import (  # noqa
    dry_run_move,
    move_model,
    MovedModel,
)
from torchrec.distributed.resharding.load import (  # noqa
    LoadMonitor,
    LoadStatistics,
    TableLoad,
)
from torchrec.distributed.resharding.model import (  # noqa
    dry_run,
    plan_delta,
    reshard_model,
)
from torchrec.distributed.resharding.options import ReshardOptions, StorageMode  # noqa
from torchrec.distributed.resharding.plan import (  # noqa
    ReshardAbortedError,
    ReshardError,
)
from torchrec.distributed.resharding.policy import PolicyState, RebalancePolicy  # noqa
from torchrec.distributed.resharding.rebalancer import (  # noqa
    RebalanceDecision,
    RebalanceError,
    Rebalancer,
    ReshardOutcome,
)
from torchrec.distributed.resharding.relabel import relabel_plan, Relabelling  # noqa
from torchrec.distributed.resharding.replan import (  # noqa
    measured_constraints,
    PlanCost,
    predict_rank_costs,
)
from torchrec.distributed.resharding.runner import (  # noqa
    PhaseTimes,
    TransactionReport,
)
from torchrec.distributed.resharding.transaction import reshard_module  # noqa
from torchrec.distributed.resharding.unshard import (  # noqa
    shard_from_rank,
    unshard_model,
    UnshardedModel,
)

__all__ = [
    "PhaseTimes",
    "TransactionReport",
    "MovedModel",
    "UnshardedModel",
    "ReshardAbortedError",
    "ReshardError",
    "ReshardOptions",
    "StorageMode",
    "dry_run",
    "dry_run_move",
    "move_model",
    "plan_delta",
    "reshard_model",
    "reshard_module",
    "shard_from_rank",
    "unshard_model",
    "LoadMonitor",
    "LoadStatistics",
    "PlanCost",
    "PolicyState",
    "RebalanceDecision",
    "RebalanceError",
    "RebalancePolicy",
    "Rebalancer",
    "Relabelling",
    "ReshardOutcome",
    "TableLoad",
    "measured_constraints",
    "predict_rank_costs",
    "relabel_plan",
]

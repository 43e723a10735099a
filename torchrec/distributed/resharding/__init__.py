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
* ``runner`` — the one transaction runner: agree, build, exchange, commit;
* ``kernel_state`` / ``optimizer_state`` — a kernel's shards and fused
  optimizer state as slots the executor reads and writes;
* ``storage`` — kernel memory: kept shards keep their storage, old storage is
  released only where nobody else can see it;
* ``install`` / ``install_ec`` / ``groups`` — module surgery: what a reshard
  needs to know about a ``ShardedEmbeddingBagCollection`` /
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
* ``rebalance`` — a running job that rebalances itself (a consumer of the
  engine, its own package): the load it measures, the shards it moves, when
  a move pays, and the loop that measures, decides and reshards.
"""

from torchrec.distributed.resharding.elastic import (  # noqa
    dry_run_move,
    move_model,
    MovedModel,
    MoveDryRun,
    MoveReport,
)
from torchrec.distributed.resharding.model import (  # noqa
    dry_run,
    ModelReshardReport,
    plan_delta,
    reshard_model,
)
from torchrec.distributed.resharding.options import ReshardOptions, StorageMode  # noqa
from torchrec.distributed.resharding.plan import (  # noqa
    ReshardAbortedError,
    ReshardError,
)
from torchrec.distributed.resharding.rebalance.load import (  # noqa
    LoadMonitor,
    LoadStatistics,
    TableLoad,
)
from torchrec.distributed.resharding.rebalance.policy import (  # noqa
    PolicyState,
    RebalancePolicy,
)
from torchrec.distributed.resharding.rebalance.rebalancer import (  # noqa
    RebalanceDecision,
    Rebalancer,
    ReshardOutcome,
)
from torchrec.distributed.resharding.rebalance.relabel import (  # noqa
    relabel_plan,
    Relabelling,
)
from torchrec.distributed.resharding.rebalance.replan import (  # noqa
    full_replan,
    measured_constraints,
    ReplanRequest,
)
from torchrec.distributed.resharding.rebalance.search import (  # noqa
    search_moves,
    SearchResult,
)
from torchrec.distributed.resharding.runner import PhaseTimes  # noqa
from torchrec.distributed.resharding.transaction import (  # noqa
    DryRunReport,
    reshard_module,
    ReshardReport,
)
from torchrec.distributed.resharding.unshard import (  # noqa
    shard_from_rank,
    unshard_model,
    UnshardedModel,
)

__all__ = [
    "DryRunReport",
    "ModelReshardReport",
    "PhaseTimes",
    "MoveDryRun",
    "MovedModel",
    "MoveReport",
    "UnshardedModel",
    "ReshardAbortedError",
    "ReshardError",
    "ReshardOptions",
    "ReshardReport",
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
    "PolicyState",
    "RebalanceDecision",
    "RebalancePolicy",
    "Rebalancer",
    "Relabelling",
    "ReplanRequest",
    "ReshardOutcome",
    "SearchResult",
    "TableLoad",
    "full_replan",
    "measured_constraints",
    "relabel_plan",
    "search_moves",
]

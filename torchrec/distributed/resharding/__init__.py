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
a running job, over the job's own collectives.

The public API is exported here. Each module's docstring says what it does;
``runner`` says how every kind of transaction runs (agree, build, exchange,
commit), ``transfer_plan`` how a rank plans its part, and ``rebalance`` is
the subpackage of a job that rebalances itself. ``fault`` is the subpackage
of a job that survives a lost rank (``FaultTolerance``; its names are
exported there).
"""

from torchrec.distributed.resharding.elastic import (  # noqa
    dry_run_move,
    move_model,
    MovedModel,
)
from torchrec.distributed.resharding.exchange_groups import (  # noqa
    ExchangeGroups,
    keep_exchange_groups,
    kept_exchange_groups,
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
from torchrec.distributed.resharding.rebalance.load import (  # noqa
    LoadMonitor,
    LoadStatistics,
    TableLoad,
)
from torchrec.distributed.resharding.rebalance.options import (  # noqa
    MoveOptions,
    ReplanOptions,
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
from torchrec.distributed.resharding.reshard import reshard_module  # noqa
from torchrec.distributed.resharding.transaction_report import (  # noqa
    PhaseTimes,
    TransactionReport,
)
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
    "ExchangeGroups",
    "keep_exchange_groups",
    "kept_exchange_groups",
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
    "MoveOptions",
    "PolicyState",
    "RebalanceDecision",
    "RebalancePolicy",
    "Rebalancer",
    "Relabelling",
    "ReplanOptions",
    "ReplanRequest",
    "ReshardOutcome",
    "SearchResult",
    "TableLoad",
    "full_replan",
    "measured_constraints",
    "relabel_plan",
    "search_moves",
]

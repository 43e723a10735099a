#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Live resharding of sharded embedding modules: move tables or table shards
between ranks (and between sharding types) inside a running job.

* ``plan`` — pure: layouts as rectangles, transfers, validation;
* ``exchange`` — collectives: the bounded agreement and the all-to-all of the
  pieces on a process group of the transaction's own;
* ``transaction`` — the driver: prepare (validate, build, agree, plan), then
  execute (exchange, swap);
* ``install`` / ``install_ec`` — module surgery: what the driver needs to know
  about a ``ShardedEmbeddingBagCollection`` / ``ShardedEmbeddingCollection``;
* ``groups`` — building a module's new sharding groups, detached from it;
* ``kernel_state`` — reading and writing the state of a kernel's shards;
* ``optimizer_state`` — the fused optimizer's per-kernel state;
* ``storage`` — kernel memory: kept tables keep their storage, old storage is
  released only where nobody else can see it;
* ``model`` — ``DistributedModelParallel``: a whole new plan in one
  transaction, and its dry run;
* ``elastic_plan`` — pure: a move between groups of ranks, its layouts in
  global ranks and the checks every participant runs on the shared facts;
* ``elastic`` — a model onto another set of ranks (shrink, grow, any set);
* ``unshard`` — a model unsharded onto one rank, or sharded from the one rank
  holding its weights.
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
    DryRunReport,
    ModelReshardReport,
    plan_delta,
    prepare_model_reshard,
    reshard_model,
)
from torchrec.distributed.resharding.plan import (  # noqa
    ReshardAbortedError,
    ReshardError,
)
from torchrec.distributed.resharding.storage import StorageMode  # noqa
from torchrec.distributed.resharding.transaction import (  # noqa
    prepare_reshard,
    PreparedReshard,
    reshard_module,
    ReshardOptions,
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
    "MoveDryRun",
    "MovedModel",
    "MoveReport",
    "UnshardedModel",
    "PreparedReshard",
    "ReshardAbortedError",
    "ReshardError",
    "ReshardOptions",
    "ReshardReport",
    "StorageMode",
    "dry_run",
    "dry_run_move",
    "move_model",
    "plan_delta",
    "prepare_model_reshard",
    "prepare_reshard",
    "reshard_model",
    "reshard_module",
    "shard_from_rank",
    "unshard_model",
]

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Surviving a lost rank: the survivors notice, agree on who is left, build a
group among themselves, restore the lost rank's shards from the best source
(a replica, a buddy snapshot, the last checkpoint) and train on, with no
restart. A consumer of the resharding engine: the recovery is one of its
transactions.

* ``options`` — the bounds, the sources and the errors;
* ``membership`` — heartbeats, the fault signal and the survivors' agreement
  on the new members, through the job's store;
* ``detector`` — each rank's watcher thread (its heartbeat, the next
  member's, the fault key);
* ``recovery_plan`` — pure: the plan on the survivors (their shards stay);
* ``sources`` — pure: the best source of every lost shard;
* ``snapshot`` — the buddy snapshot of touched rows;
* ``checkpoint`` — the checkpoint source (DCP, only lost shards read back);
* ``recovery`` — the recovery move (the engine's transaction), and
  ``report`` what a recovery reports;
* ``tolerance`` — :class:`FaultTolerance`, the one object a training loop
  holds.

See ``docs/faults.md`` for what a deployment needs.
"""

from torchrec.distributed.resharding.fault.options import (  # noqa
    FaultOptions,
    FaultToleranceError,
    RankFencedError,
    UnrecoverableLossError,
)
from torchrec.distributed.resharding.fault.report import Failure, RecoveryReport  # noqa
from torchrec.distributed.resharding.fault.tolerance import FaultTolerance  # noqa

__all__ = [
    "Failure",
    "FaultOptions",
    "FaultTolerance",
    "FaultToleranceError",
    "RankFencedError",
    "RecoveryReport",
    "UnrecoverableLossError",
]

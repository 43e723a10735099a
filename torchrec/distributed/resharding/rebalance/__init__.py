#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A running job that rebalances itself: a consumer of the resharding engine
(it reads layouts through ``plan``, the model through ``model_view``, the
delta through ``model.plan_delta``, agrees through ``agreement`` and moves
through ``DistributedModelParallel.reshard``), never a part of it.

* ``monitor`` — what a running model measures: ids per feature, seconds
  per rank, one all-reduce per window; ``statistics`` — pure: the window's
  figures from the reduced vector (``load`` gives both under its old name);
* ``placement`` — pure: the model's shards as units of work on ranks (the
  engine's ``TableLayout``), and moves of them as a new plan;
* ``search`` — pure: the incremental local search (move or swap shards off
  the slowest rank), fast enough for every window;
* ``replan`` — TorchRec's full planner on the measured load, only on one
  rank, in a process of its own (``replan_process``); ``relabel`` — its
  candidate's ranks renamed to keep the most bytes in place;
* ``costs`` — pure: per-shard costs calibrated from measured kernel time, the
  predicted step time after a move, and the window's proposal;
* ``policy`` — pure: when a reshard pays;
* ``rebalancer`` — the loop: measure, propose, decide, reshard
  (``options``: its settings in two groups).

The public names are exported by ``torchrec.distributed.resharding``.
"""

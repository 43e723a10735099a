#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The Rebalancer's settings in two frozen groups: the old keywords and
positions land in the same fields, with a DeprecationWarning; the groups
given alone warn nothing; a setting given twice, an unknown keyword or a
group of the wrong type is refused; a Rebalancer built either way holds the
same options and refuses the same bad state factor.
"""

import unittest
import warnings
from dataclasses import FrozenInstanceError

from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.resharding import MoveOptions, ReplanOptions, ReshardOptions
from torchrec.distributed.resharding.rebalance.options import legacy_options
from torchrec.distributed.resharding.rebalance.policy import RebalancePolicy
from torchrec.distributed.resharding.rebalance.rebalancer import Rebalancer
from torchrec.distributed.test_utils.rebalance_utils import (
    cpu_topology,
    one_rank_rebalance_model,
)

NUM_TABLES, ROWS, DIM, BATCH = 2, 16, 8, 4
CONSTRAINTS = {"t0": ParameterConstraints(sharding_types=["table_wise"])}


class LegacyOptionsTest(unittest.TestCase):
    def test_old_keywords_and_positions_fill_the_groups_with_a_warning(self) -> None:
        reshard = ReshardOptions()
        with self.assertWarnsRegex(DeprecationWarning, "replan=ReplanOptions"):
            replan, moves = legacy_options(
                (BATCH, CONSTRAINTS),
                {"options": reshard, "state_factor": 3.0, "keep_kernels": False},
                None,
                None,
            )
        self.assertEqual(
            replan,
            ReplanOptions(
                batch_size=BATCH, constraints=CONSTRAINTS, keep_kernels=False
            ),
        )
        self.assertEqual(moves, MoveOptions(reshard=reshard, state_factor=3.0))

    def test_the_groups_alone_warn_nothing(self) -> None:
        replan, moves = ReplanOptions(batch_size=BATCH), MoveOptions(state_factor=4.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            self.assertEqual(legacy_options((), {}, replan, moves), (replan, moves))
            self.assertEqual(
                legacy_options((), {}, None, None), (ReplanOptions(), MoveOptions())
            )
        with self.assertRaises(FrozenInstanceError):
            replan.batch_size = 8  # pyre-ignore[41]

    def test_bad_combinations_are_refused(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with self.assertRaisesRegex(TypeError, "batch_size both in replan="):
                legacy_options((), {"batch_size": 2}, ReplanOptions(), None)
            with self.assertRaisesRegex(TypeError, "multiple values for argument"):
                legacy_options((BATCH,), {"batch_size": 2}, None, None)
            with self.assertRaisesRegex(TypeError, "unexpected keyword argument"):
                legacy_options((), {"batchsize": 2}, None, None)
            with self.assertRaisesRegex(TypeError, "at most 12 positional"):
                legacy_options((None,) * 10, {}, None, None)
            with self.assertRaisesRegex(TypeError, "must be a MoveOptions"):
                legacy_options((), {}, None, ReplanOptions())  # pyre-ignore[6]


class RebalancerOptionsTest(unittest.TestCase):
    def test_a_rebalancer_built_either_way_holds_the_same_options(self) -> None:
        with one_rank_rebalance_model(NUM_TABLES, ROWS, DIM, BATCH) as (model, _):
            topology, policy = cpu_topology(1), RebalancePolicy(window=5)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                new = Rebalancer(
                    model,
                    topology,
                    policy,
                    replan=ReplanOptions(batch_size=BATCH, constraints=CONSTRAINTS),
                    moves=MoveOptions(state_factor=3.0),
                )
            new.close()
            with self.assertWarns(DeprecationWarning):
                old = Rebalancer(
                    model, topology, policy, BATCH, CONSTRAINTS, state_factor=3.0
                )
            old.close()
            self.assertEqual(old.replan_options, new.replan_options)
            self.assertEqual(old.move_options, new.move_options)
            with self.assertRaisesRegex(ValueError, "state_factor must be >= 1"):
                Rebalancer(model, topology, moves=MoveOptions(state_factor=0.5))
            with self.assertWarns(DeprecationWarning):
                with self.assertRaisesRegex(ValueError, "state_factor must be >= 1"):
                    Rebalancer(model, topology, state_factor=0.5)

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The hooks that measure a running model live in ``rebalance.monitor``;
``rebalance.load`` still gives every name it had (the statistics' too) as
the same object, and the public ``torchrec.distributed.resharding`` names
are those objects. The timers' kind follows the device.
"""

import unittest

import torch
from torchrec.distributed import resharding
from torchrec.distributed.resharding.rebalance import load, monitor, statistics
from torchrec.distributed.test_utils.rebalance_utils import LOAD_STATISTICS_NAMES

MONITOR_NAMES = (
    "module_tables",
    "timer_type",
    "LoadMonitor",
    "_Timer",
    "_EventTimer",
    "_ModuleMonitor",
    "_kernels",
)


class MonitorModuleTest(unittest.TestCase):
    def test_the_old_module_gives_the_same_objects(self) -> None:
        for name in MONITOR_NAMES:
            self.assertIs(getattr(load, name), getattr(monitor, name), name)
        for name in LOAD_STATISTICS_NAMES:
            self.assertIs(getattr(load, name), getattr(statistics, name), name)
        self.assertIs(resharding.LoadMonitor, monitor.LoadMonitor)
        self.assertIs(resharding.LoadStatistics, statistics.LoadStatistics)
        self.assertIs(resharding.TableLoad, statistics.TableLoad)

    def test_host_timers_on_cpu(self) -> None:
        self.assertIs(monitor.timer_type(torch.device("cpu")), monitor._Timer)

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Load measurement of a running sharded model, under its first module name:
the window's figures are in ``statistics`` (pure), the hooks that measure a
running model in ``monitor`` (``LoadMonitor``). Every name stays importable
from here and is the same object.
"""

from torchrec.distributed.resharding.rebalance.monitor import (  # noqa: F401
    _EventTimer,
    _kernels,
    _ModuleMonitor,
    _Timer,
    LoadMonitor,
    module_tables,
    timer_type,
)
from torchrec.distributed.resharding.rebalance.statistics import (  # noqa: F401
    feature_slots,
    FeatureSlot,
    LoadStatistics,
    RANK_FIELDS,
    statistics_from_vector,
    TableLoad,
)

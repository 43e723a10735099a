#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Deprecated: the reshard of a module or of a model's modules is in
``torchrec.distributed.resharding.reshard`` (this name said "transaction",
which every kind of move is). Importing this module warns; it goes in the
next release.
"""

import warnings

from torchrec.distributed.resharding.reshard import (
    ModuleReshard,
    reshard_module,
    ReshardOptions,
)

__all__ = ["ModuleReshard", "reshard_module", "ReshardOptions"]

warnings.warn(
    "torchrec.distributed.resharding.transaction is deprecated: import from "
    "torchrec.distributed.resharding.reshard",
    DeprecationWarning,
    stacklevel=2,
)

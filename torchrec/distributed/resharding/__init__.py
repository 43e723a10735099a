#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""
Live resharding of sharded embedding modules.

* ``plan`` — pure: layouts as rectangles, transfers, validation;
* ``exchange`` — collectives: agreement and the all-to-all of the pieces;
* ``install`` — module surgery: build the new groups, fill them, swap them in;
* ``storage`` — kernel memory: no initialisation of new lookups, kept tables
  keep their storage, pages of departed tables go back to the OS.
"""

from torchrec.distributed.resharding.plan import (  # noqa
    ReshardAbortedError,
    ReshardError,
)

__all__ = ["ReshardAbortedError", "ReshardError"]

#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Deprecated: the EmbeddingCollection adapter is in
``torchrec.distributed.resharding.module_adapters`` (the module adapters are
one package, a module per upstream module type). Importing this module
warns; it goes in the next release.
"""

import warnings

from torchrec.distributed.resharding.module_adapters import EmbeddingCollectionAdapter

__all__ = ["EmbeddingCollectionAdapter"]

warnings.warn(
    "torchrec.distributed.resharding.install_ec is deprecated: import from "
    "torchrec.distributed.resharding.module_adapters",
    DeprecationWarning,
    stacklevel=2,
)

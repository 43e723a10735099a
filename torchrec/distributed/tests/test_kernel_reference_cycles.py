#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
A retired batched kernel is freed as soon as it is dropped, without Python's
cycle collector: ``break_reference_cycles()`` drops the references between its
per-table weights and their fused optimizers, which otherwise keep the fbgemm
module (and its storage) alive until a garbage collection.
"""

import gc
import unittest
import weakref
from typing import List

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.batched_embedding_kernel import (
    BatchedDenseEmbeddingBag,
    BatchedFusedEmbeddingBag,
)
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
)
from torchrec.distributed.test_utils.multi_process_utils import (
    grouped_config,
    single_rank_process_group,
)


def _config(names: List[str], kernel: EmbeddingComputeKernel) -> GroupedEmbeddingConfig:
    """One kernel's worth of whole 8 x 4 tables."""
    return grouped_config(
        names,
        {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1},
        kernel=kernel,
    )


class KernelReferenceCyclesTest(unittest.TestCase):
    def _fbgemm_module_freed_on_drop(
        self, kernel_type: type, kernel: EmbeddingComputeKernel, retire: bool
    ) -> bool:
        """Builds a kernel with the cycle collector off, optionally retires it,
        drops it and tells whether its fbgemm module went with it."""
        config = _config(["a", "b"], kernel)
        with single_rank_process_group():
            gc.collect()
            gc.disable()
            try:
                batched: nn.Module = kernel_type(config, device=torch.device("cpu"))
                fbgemm = weakref.ref(batched.emb_module)
                if retire:
                    batched.break_reference_cycles()
                del batched
                freed = fbgemm() is None
            finally:
                gc.enable()
                gc.collect()
        return freed

    def test_retired_fused_kernel_is_freed_without_gc(self) -> None:
        self.assertTrue(
            self._fbgemm_module_freed_on_drop(
                BatchedFusedEmbeddingBag, EmbeddingComputeKernel.FUSED, retire=True
            )
        )

    def test_fused_kernel_not_retired_waits_for_gc(self) -> None:
        # What break_reference_cycles() is for: without it the weights and their
        # per-table optimizers keep the fbgemm module until a collection.
        self.assertFalse(
            self._fbgemm_module_freed_on_drop(
                BatchedFusedEmbeddingBag, EmbeddingComputeKernel.FUSED, retire=False
            )
        )

    def test_retired_dense_kernel_is_freed_without_gc(self) -> None:
        self.assertTrue(
            self._fbgemm_module_freed_on_drop(
                BatchedDenseEmbeddingBag, EmbeddingComputeKernel.DENSE, retire=True
            )
        )


if __name__ == "__main__":
    unittest.main()

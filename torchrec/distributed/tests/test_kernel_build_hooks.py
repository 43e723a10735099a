#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Call-scoped kernel build hooks: a batched kernel built inside
``kernel_build_hooks(...)`` skips its initialisation when the hooks say so and
uses the host buffers (fused kernel) or flat weights (dense kernel) the hooks
give it; kernels built outside the context, or by another thread while it is
active, see nothing of the hooks.
"""

import threading
import unittest
from typing import Any, Dict, List, Optional

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.batched_embedding_kernel import (
    BatchedDenseEmbeddingBag,
    BatchedFusedEmbeddingBag,
    kernel_build_hooks,
    KernelBuildHooks,
)
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
)
from torchrec.distributed.test_utils.multi_process_utils import (
    grouped_config,
    single_rank_process_group,
)

ROWS: int = 8
DIM: int = 4
# A value random initialisation never produces.
MARK: float = 12345.0


def _config(kernel: EmbeddingComputeKernel) -> GroupedEmbeddingConfig:
    """One kernel of two whole ROWS x DIM tables (fused: SGD, no state)."""
    return grouped_config(
        ["a", "b"],
        {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1},
        ROWS,
        DIM,
        kernel,
    )


class _Hooks(KernelBuildHooks):
    """Skips initialisation; hands out marked buffers and records the calls."""

    def __init__(self) -> None:
        self.calls: List[str] = []
        self.buffers: Dict[str, torch.Tensor] = {}

    def init_parameters(self, config: GroupedEmbeddingConfig) -> bool:
        self.calls.append("init_parameters")
        return False

    def host_buffers(
        self, config: GroupedEmbeddingConfig, tbe_kwargs: Dict[str, Any]
    ) -> Optional[Dict[str, torch.Tensor]]:
        self.calls.append("host_buffers")
        numel = sum(t.local_rows * t.local_cols for t in config.embedding_tables)
        self.buffers["weights"] = torch.full((numel,), MARK)
        return dict(self.buffers)

    def dense_weights(
        self,
        config: GroupedEmbeddingConfig,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Optional[torch.Tensor]:
        self.calls.append("dense_weights")
        self.buffers["dense"] = torch.full((numel,), MARK, dtype=dtype, device=device)
        return self.buffers["dense"]


def _weights(kernel: nn.Module) -> List[torch.Tensor]:
    return [w.detach() for w in kernel.split_embedding_weights()]


class KernelBuildHooksTest(unittest.TestCase):
    def _build(self, kernel: EmbeddingComputeKernel) -> nn.Module:
        kernel_type = (
            BatchedFusedEmbeddingBag
            if kernel == EmbeddingComputeKernel.FUSED
            else BatchedDenseEmbeddingBag
        )
        return kernel_type(_config(kernel), device=torch.device("cpu"))

    def _check_kernel_under_hooks(
        self, kernel: EmbeddingComputeKernel, buffer: str, call: str
    ) -> None:
        hooks = _Hooks()
        with single_rank_process_group():
            with kernel_build_hooks(hooks):
                built = self._build(kernel)
            plain = self._build(kernel)
        self.assertIn(call, hooks.calls)
        self.assertIn("init_parameters", hooks.calls)
        # the kernel's weights are the hooks' buffer, untouched by any init
        storage = hooks.buffers[buffer].untyped_storage().data_ptr()
        for weight in _weights(built):
            self.assertEqual(weight.untyped_storage().data_ptr(), storage)
            self.assertTrue(torch.all(weight == MARK))
        # outside the context nothing changes: initialised, own storage
        for weight in _weights(plain):
            self.assertNotEqual(weight.untyped_storage().data_ptr(), storage)
            self.assertFalse(torch.any(weight == MARK))

    def test_fused_kernel_takes_host_buffers_and_skips_init(self) -> None:
        self._check_kernel_under_hooks(
            EmbeddingComputeKernel.FUSED, "weights", "host_buffers"
        )

    def test_dense_kernel_takes_weights_and_skips_init(self) -> None:
        self._check_kernel_under_hooks(
            EmbeddingComputeKernel.DENSE, "dense", "dense_weights"
        )

    def test_default_hooks_change_nothing(self) -> None:
        with single_rank_process_group():
            torch.manual_seed(0)
            plain = _weights(self._build(EmbeddingComputeKernel.DENSE))
            torch.manual_seed(0)
            with kernel_build_hooks(KernelBuildHooks()):
                hooked = _weights(self._build(EmbeddingComputeKernel.DENSE))
        for a, b in zip(plain, hooked):
            self.assertTrue(torch.equal(a, b))

    def test_other_threads_do_not_see_the_hooks(self) -> None:
        hooks = _Hooks()
        inside = threading.Event()
        built = threading.Event()
        other: List[nn.Module] = []

        def build_elsewhere() -> None:
            inside.wait(timeout=60)
            for kernel in (EmbeddingComputeKernel.FUSED, EmbeddingComputeKernel.DENSE):
                other.append(self._build(kernel))
            built.set()

        with single_rank_process_group():
            thread = threading.Thread(target=build_elsewhere)
            thread.start()
            with kernel_build_hooks(hooks):
                inside.set()  # the other thread builds while the hooks are active
                self.assertTrue(built.wait(timeout=120))
            thread.join(timeout=60)
        self.assertEqual(hooks.calls, [])
        self.assertEqual(len(other), 2)
        for kernel in other:
            for weight in _weights(kernel):
                self.assertFalse(torch.any(weight == MARK))


if __name__ == "__main__":
    unittest.main()

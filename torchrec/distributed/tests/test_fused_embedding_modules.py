#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""The unsharded fused embedding modules on fbgemm-gpu 1.8.

fbgemm 1.8 removed the OptimizerArgs field FusedEmbeddingBagCollection and
FusedEmbeddingCollection read their learning rate from. Trains a
FusedEmbeddingBagCollection (fbgemm kernels with their optimizer fused into
the backward, two kernels at once) against a plain EmbeddingBagCollection and
the matching torch optimizer, including a learning-rate change through the
fused optimizer's param groups, and builds a FusedEmbeddingCollection.
"""

import unittest
from typing import Any, Dict, List, Type

import torch
from torchrec.modules.embedding_configs import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.fused_embedding_modules import (
    FusedEmbeddingBagCollection,
    FusedEmbeddingCollection,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

BATCH_SIZE: int = 4

# Two pooling modes: FusedEmbeddingBagCollection builds one fbgemm kernel per
# (pooling, data type), so these tables exercise two fused kernels at once.
# Tables of one kernel come first and in table order: the base concatenates
# the outputs kernel by kernel but labels them in table order, so interleaved
# pooling modes would mislabel its outputs (a TorchRec 1.1.0 bug that does not
# depend on fbgemm).
FUSED_TABLES: List[EmbeddingBagConfig] = [
    EmbeddingBagConfig(
        name=name,
        embedding_dim=dim,
        num_embeddings=rows,
        feature_names=features,
        pooling=pooling,
    )
    for name, dim, rows, features, pooling in (
        ("s0", 4, 11, ["g0", "g1"], PoolingType.SUM),
        ("s1", 4, 5, ["g2"], PoolingType.SUM),
        ("m0", 8, 7, ["g3"], PoolingType.MEAN),
    )
]
# Learning rate per step; the change before step 2 goes through the fused
# optimizer's param group, as an LR scheduler would set it.
FUSED_LRS: List[float] = [0.25, 0.25, 0.0625, 0.0625]


def _fused_batch(step: int) -> KeyedJaggedTensor:
    """A deterministic batch with repeated ids (exact optimizers must sum the
    gradients of a row before updating it) and empty bags."""
    gen = torch.Generator().manual_seed(3000 + step)
    keys: List[str] = []
    lengths: List[torch.Tensor] = []
    values: List[torch.Tensor] = []
    for table in FUSED_TABLES:
        for feature in table.feature_names:
            lens = torch.randint(0, 5, (BATCH_SIZE,), generator=gen)
            keys.append(feature)
            lengths.append(lens)
            values.append(
                torch.randint(
                    0, table.num_embeddings, (int(lens.sum()),), generator=gen
                )
            )
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
    )


def _fused_loss_weights(step: int) -> torch.Tensor:
    """Per-output weights so that every pooled value gets its own gradient."""
    gen = torch.Generator().manual_seed(4000 + step)
    width = sum(t.embedding_dim * len(t.feature_names) for t in FUSED_TABLES)
    return torch.randn(BATCH_SIZE, width, generator=gen)


class FusedEmbeddingModulesHealthTest(unittest.TestCase):
    """The unsharded fused modules build and train on this stack (fbgemm 1.8
    removed the OptimizerArgs field they read their learning rate from)."""

    def _train(
        self,
        fused_optimizer: Type[torch.optim.Optimizer],
        optimizer_kwargs: Dict[str, Any],
        reference_optimizer: Type[torch.optim.Optimizer],
        reference_kwargs: Dict[str, Any],
        state_key: str,
    ) -> None:
        """Train a FusedEmbeddingBagCollection and, from the same weights, a
        plain EmbeddingBagCollection with ``reference_optimizer``; compare
        outputs, weights and (when ``state_key`` is set) optimizer state after
        every step.

        Args:
            fused_optimizer: the optimizer type fused into the fbgemm kernel.
            optimizer_kwargs: its arguments (without "lr").
            reference_optimizer: the torch optimizer doing the same math.
            reference_kwargs: its arguments (without "lr").
            state_key: name of the reference optimizer's per-parameter state
                that the fused optimizer keeps as "momentum_1" ("" for none).
        """
        torch.manual_seed(0)
        fused = FusedEmbeddingBagCollection(
            tables=FUSED_TABLES,
            optimizer_type=fused_optimizer,
            optimizer_kwargs={"lr": FUSED_LRS[0], **optimizer_kwargs},
        )
        optimizer = fused.fused_optimizer()
        # The param groups show the rate the kernels hold (a float32 tensor).
        self.assertEqual(len(optimizer.param_groups), 2)
        for group in optimizer.param_groups:
            self.assertEqual(
                group["lr"], torch.tensor(FUSED_LRS[0], dtype=torch.float32).item()
            )
        ref = EmbeddingBagCollection(tables=FUSED_TABLES)
        ref.load_state_dict(fused.state_dict())
        ref_params = dict(ref.named_parameters())
        self.assertEqual(set(ref_params), set(fused.state_dict()))
        ref_opt = reference_optimizer(
            list(ref_params.values()), lr=FUSED_LRS[0], **reference_kwargs
        )
        before = {k: v.detach().clone() for k, v in ref_params.items()}

        for step, lr in enumerate(FUSED_LRS):
            for group in optimizer.param_groups:  # one group per fused kernel
                group["lr"] = lr
            optimizer.step()  # pushes each group's rate into its kernel
            for group in ref_opt.param_groups:
                group["lr"] = lr
            kjt = _fused_batch(step)
            out = fused(kjt)
            want = ref(kjt)
            self.assertEqual(out.keys(), want.keys())
            if step == 0:
                # Same weights, same pooling: bit-equal outputs.
                torch.testing.assert_close(out.values(), want.values(), rtol=0, atol=0)
            else:
                # fbgemm sums a row's gradients in another order than autograd:
                # the weights (and outputs) may differ in the last bits.
                torch.testing.assert_close(out.values(), want.values())
            (out.values() * _fused_loss_weights(step)).sum().backward()
            ref_opt.zero_grad()
            (want.values() * _fused_loss_weights(step)).sum().backward()
            ref_opt.step()

            got = fused.state_dict()
            for name, param in ref_params.items():
                torch.testing.assert_close(
                    got[name], param.detach(), msg=f"step {step} {name}"
                )
            if state_key:
                states = optimizer.state_dict()["state"]
                for name, param in ref_params.items():
                    table = name.split(".")[1]
                    key = f"{table}.weight"
                    torch.testing.assert_close(
                        states[key][f"{key}.momentum_1"],
                        ref_opt.state[param][state_key],
                        msg=f"step {step} {name} optimizer state",
                    )
        for name, param in ref_params.items():
            # Every table was looked up, so training changed each of them.
            self.assertFalse(torch.equal(before[name], param.detach()), name)

    def test_fused_ebc_trains_exact_sgd(self) -> None:
        self._train(torch.optim.SGD, {}, torch.optim.SGD, {}, "")

    def test_fused_ebc_trains_exact_adagrad(self) -> None:
        self._train(
            torch.optim.Adagrad,
            {"eps": 1e-8},
            torch.optim.Adagrad,
            {"eps": 1e-8},
            "sum",
        )

    def test_fused_ec_builds(self) -> None:
        # FusedEmbeddingCollection accepts only cuda and meta devices; on meta
        # it builds its fused optimizer through the same code path.
        fused = FusedEmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="e0", embedding_dim=4, num_embeddings=6, feature_names=["h0"]
                )
            ],
            optimizer_type=torch.optim.SGD,
            optimizer_kwargs={"lr": 0.5},
            device=torch.device("meta"),
        )
        self.assertEqual(fused.fused_optimizer().param_groups[0]["lr"], 0.5)
        self.assertEqual(
            fused.state_dict()["embeddings.e0.weight"].shape, torch.Size([6, 4])
        )


if __name__ == "__main__":
    unittest.main()

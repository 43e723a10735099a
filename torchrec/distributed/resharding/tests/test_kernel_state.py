#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of ``kernel_state``, ``slots`` and ``optimizer_state``: the local
shards of batched kernels as slots whose weight and fused optimizer state are
views of the kernels' storage, pieces read from one slot and written into
another (per element, per row, row-wise state merged from column pieces), the
state no piece delivers, and the per-table facts (state fields, learning
rate, step count) ranks share and set on new kernels.
"""

import unittest
from typing import List

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.batched_embedding_kernel import (
    BatchedDenseEmbeddingBag,
    BatchedFusedEmbeddingBag,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding.fields import (
    Field,
    FieldKind,
    merge_table_facts,
    TableFacts,
)
from torchrec.distributed.resharding.kernel_state import (
    batched_kernels,
    is_fused,
    local_slots,
    optimizer_state_layout,
)
from torchrec.distributed.resharding.optimizer_state import (
    apply_table_facts,
    local_table_facts,
)
from torchrec.distributed.resharding.plan import Rect, ReshardError, Transfer
from torchrec.distributed.resharding.slots import (
    kept_in_place,
    LocalSlot,
    read_piece,
    RowwiseMerges,
    target_piece,
    write_piece,
    zero_undelivered_state,
)
from torchrec.distributed.test_utils.multi_process_utils import (
    grouped_config,
    single_rank_process_group,
)

ROWS: int = 16
COLS: int = 16


def _kernel(
    names: List[str],
    kernel: EmbeddingComputeKernel = EmbeddingComputeKernel.FUSED,
    optimizer: EmbOptimType = EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    learning_rate: float = 0.25,
) -> nn.Module:
    """One batched kernel holding whole ROWS x COLS tables."""
    fused_params = {"optimizer": optimizer, "learning_rate": learning_rate}
    config = grouped_config(names, fused_params, ROWS, COLS, kernel)
    kernel_type = (
        BatchedFusedEmbeddingBag
        if kernel == EmbeddingComputeKernel.FUSED
        else BatchedDenseEmbeddingBag
    )
    return kernel_type(config, device=torch.device("cpu"))


def _transfer(table: str, rect: Rect, src: Rect, dst: Rect) -> Transfer:
    return Transfer(table, 0, 0, rect, src, dst)


class KernelStateTest(unittest.TestCase):
    def test_slots_are_views_of_the_kernel_storage(self) -> None:
        with single_rank_process_group():
            kernel = _kernel(["a", "b"])
            slots = local_slots([kernel])
            whole = Rect(0, 0, ROWS, COLS)
            self.assertEqual(sorted(slots), [("a", whole), ("b", whole)])
            self.assertEqual(list(batched_kernels(kernel)), [kernel])
            self.assertTrue(is_fused(kernel))
            slot = slots[("b", whole)]
            self.assertEqual(set(slot.tensors), {"weight", "sum"})
            self.assertEqual(slot.tensors["weight"].shape, (ROWS, COLS))
            self.assertEqual(slot.tensors["sum"].shape, (ROWS,))
            slot.tensors["weight"].fill_(3.0)
            slot.tensors["sum"].fill_(5.0)
            weight = kernel.split_embedding_weights()[1]
            self.assertTrue(torch.all(weight == 3.0))
            state = kernel.emb_module.get_optimizer_state()[1]["sum"]
            self.assertTrue(torch.all(state == 5.0))
            other = slots[("a", whole)]
            self.assertFalse(torch.any(other.tensors["weight"] == 3.0))

    def test_dense_kernel_has_weights_only(self) -> None:
        with single_rank_process_group():
            kernel = _kernel(["a"], EmbeddingComputeKernel.DENSE)
            (slot,) = local_slots([kernel]).values()
            self.assertEqual(set(slot.tensors), {"weight"})
            self.assertFalse(is_fused(kernel))

    def test_pieces_move_between_slots(self) -> None:
        # an old shard of rows 0..15 and a new one of rows 4..11
        old = LocalSlot(
            "a",
            Rect(0, 0, ROWS, COLS),
            {
                "weight": torch.arange(ROWS * COLS, dtype=torch.float32).view(
                    ROWS, COLS
                ),
                "sum": torch.arange(ROWS, dtype=torch.float32) + 1000,
                "step": torch.tensor([7.0]),
            },
        )
        new = LocalSlot(
            "a",
            Rect(4, 0, 8, COLS),
            {
                "weight": torch.zeros(8, COLS),
                "sum": torch.zeros(8),
                "step": torch.zeros(1),
            },
        )
        transfer = _transfer("a", Rect(6, 0, 4, COLS), old.rect, new.rect)
        merges = RowwiseMerges()
        for field in (
            Field("weight", FieldKind.RECT, torch.float32),
            Field("sum", FieldKind.ROWS, torch.float32),
            Field("step", FieldKind.SCALAR, torch.float32),
        ):
            data = read_piece(old, transfer, field).clone()
            target = target_piece(new, transfer, field)
            assert target is not None
            write_piece(new, transfer, field, data, merges)
            self.assertTrue(torch.equal(target.reshape(-1), data.reshape(-1)))
        merges.finish()
        self.assertTrue(
            torch.equal(new.tensors["weight"][2:6], old.tensors["weight"][6:10])
        )
        self.assertTrue(torch.equal(new.tensors["sum"][2:6], old.tensors["sum"][6:10]))
        self.assertEqual(new.tensors["step"].item(), 7.0)
        self.assertTrue(torch.all(new.tensors["weight"][:2] == 0))
        # a field the new kernel does not keep (fused -> dense) is skipped
        write_piece(
            LocalSlot("a", new.rect, {}),
            transfer,
            Field("sum", FieldKind.ROWS, torch.float32),
            old.tensors["sum"][6:10],
            merges,
        )

    def test_rowwise_state_of_column_pieces_is_their_weighted_mean(self) -> None:
        left = LocalSlot("a", Rect(0, 0, ROWS, 4), {"sum": torch.full((ROWS,), 1.0)})
        right = LocalSlot("a", Rect(0, 4, ROWS, 12), {"sum": torch.full((ROWS,), 3.0)})
        target = LocalSlot("a", Rect(0, 0, ROWS, COLS), {"sum": torch.zeros(ROWS)})
        field = Field("sum", FieldKind.ROWS, torch.float32)
        merges = RowwiseMerges()
        for source in (left, right):
            transfer = _transfer("a", source.rect, source.rect, target.rect)
            self.assertIsNone(target_piece(target, transfer, field))
            data = read_piece(source, transfer, field)
            write_piece(target, transfer, field, data, merges)
        merges.finish()
        # (1 * 4 + 3 * 12) / 16
        self.assertTrue(torch.all(target.tensors["sum"] == 2.5))

    def test_undelivered_state_is_zeroed_unless_kept_in_place(self) -> None:
        with single_rank_process_group():
            old = _kernel(["a", "k"])
            fresh = _kernel(["a"])
            for slot in [*local_slots([old]).values(), *local_slots([fresh]).values()]:
                for tensor in slot.tensors.values():
                    tensor.fill_(1.0)
            whole = Rect(0, 0, ROWS, COLS)
            old_slots = local_slots([old])
            # "k" stays in the old kernel's storage, "a" gets a new kernel
            new_slots = {**local_slots([fresh]), ("k", whole): old_slots[("k", whole)]}
            self.assertEqual(kept_in_place(old_slots, new_slots), [("k", whole)])
            weight = Field("weight", FieldKind.RECT, torch.float32)
            zero_undelivered_state(
                new_slots, {"a": [weight], "k": [weight]}, {("k", whole)}
            )
            fresh_slot = new_slots[("a", whole)]
            self.assertTrue(torch.all(fresh_slot.tensors["sum"] == 0))
            self.assertTrue(torch.all(fresh_slot.tensors["weight"] == 1.0))
            kept_slot = new_slots[("k", whole)]
            self.assertTrue(torch.all(kept_slot.tensors["sum"] == 1.0))


class OptimizerStateLayoutTest(unittest.TestCase):
    def test_kinds_come_from_the_optimizer_not_from_shapes(self) -> None:
        # A 16 x 16 shard: row-wise Adagrad's "sum" has 16 values, as many as a
        # row has columns, so its shape alone could not tell rows from columns.
        with single_rank_process_group():
            rowwise = _kernel(["a"], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
            exact = _kernel(["a"], optimizer=EmbOptimType.EXACT_ADAGRAD)
            self.assertEqual(optimizer_state_layout(rowwise)["sum"], FieldKind.ROWS)
            self.assertEqual(optimizer_state_layout(exact)["sum"], FieldKind.RECT)
            (slot,) = local_slots([exact]).values()
            self.assertEqual(slot.kinds["sum"], FieldKind.RECT)
            self.assertEqual(tuple(slot.tensors["sum"].shape), (ROWS, COLS))

    def test_a_state_of_an_unknown_layout_is_refused(self) -> None:
        with single_rank_process_group():
            kernel = _kernel(["a"], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD)
            layout = dict(optimizer_state_layout(kernel))
            layout.pop("sum")
            from torchrec.distributed.resharding import kernel_state

            with self.assertRaisesRegex(ReshardError, "sum"):
                kernel_state._state_kind(kernel, layout, "sum")


class OptimizerStateTest(unittest.TestCase):
    def test_facts_are_gathered_merged_and_applied(self) -> None:
        with single_rank_process_group():
            old = _kernel(["a", "b"])
            old.emb_module.iter.fill_(7)
            lr = old.emb_module.get_learning_rate()
            facts = local_table_facts([old], ["a"])
            self.assertEqual(set(facts.fields), {"a"})
            self.assertEqual(
                [(f.name, f.kind) for f in facts.fields_of("a")],
                [("weight", FieldKind.RECT), ("sum", FieldKind.ROWS)],
            )
            self.assertEqual(facts.learning_rates["a"], lr)
            self.assertEqual(facts.optimizer_iter, 7)
            self.assertEqual(facts.fields_of("nobody_holds_it"), ())
            # dtypes travel as torch.dtype
            self.assertEqual(facts.fields_of("a")[0].dtype, torch.float32)

            other = TableFacts(
                fields={
                    "a": (Field("weight", FieldKind.RECT, torch.float16),),
                    "c": (),
                },
                learning_rates={"a": 1.0, "c": 2.0},
                optimizer_iter=9,
            )
            merged = merge_table_facts([facts, other])  # rank 0 wins
            self.assertEqual(merged.fields["a"], facts.fields["a"])
            self.assertEqual(merged.learning_rates, {"a": lr, "b": lr, "c": 2.0})
            self.assertEqual(merged.optimizer_iter, 9)
            self.assertEqual(
                {t: len(f) for t, f in merged.fields_by_table(["a", "c"]).items()},
                {"a": 2, "c": 0},
            )

            new = _kernel(["c"], learning_rate=0.5)
            apply_table_facts([new], merged)
            self.assertEqual(new.emb_module.get_learning_rate(), 2.0)
            self.assertEqual(new.fused_optimizer.param_groups[0]["lr"], 2.0)
            self.assertEqual(int(new.emb_module.iter.item()), 9)


if __name__ == "__main__":
    unittest.main()

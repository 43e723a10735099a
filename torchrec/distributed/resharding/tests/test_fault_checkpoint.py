#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The checkpoint source in one process (a one-rank gloo group): a trained
model's shards are saved with DCP; after more training, pieces of some
shards (cut across saved shards' rows and columns) read back equal, bit for
bit, the shards as they were at the save (the oracle: copies taken right
before it with the model's own state dict and fused optimizer state), and
only the saved shards the pieces are cut from are read.
"""

import tempfile
import unittest
from typing import Dict, List, Tuple

import torch
from torchrec.distributed.resharding.fault.checkpoint import (
    load_pieces,
    save_checkpoint,
)
from torchrec.distributed.resharding.fault.options import CHECKPOINT
from torchrec.distributed.resharding.fault.sources import SourcePiece
from torchrec.distributed.resharding.model_view import sharded_slots
from torchrec.distributed.resharding.plan import Rect
from torchrec.distributed.test_utils.multi_process_utils import (
    single_rank_process_group,
)
from torchrec.distributed.test_utils.reshard_model_utils import (
    make_dense_optimizer,
    model_plan,
    sharded_model,
    train_model,
)
from torchrec.distributed.types import ShardingEnv


def _halves(rect: Rect) -> List[Rect]:
    """The shard cut in two, by rows (or columns for a one-row shard)."""
    if rect.rows > 1:
        top = rect.rows // 2
        return [
            Rect(rect.row, rect.col, top, rect.cols),
            Rect(rect.row + top, rect.col, rect.rows - top, rect.cols),
        ]
    left = rect.cols // 2
    return [
        Rect(rect.row, rect.col, 1, left),
        Rect(rect.row, rect.col + left, 1, rect.cols - left),
    ]


class CheckpointSourceTest(unittest.TestCase):
    def test_pieces_read_back_as_saved_and_only_their_shards(self) -> None:
        with single_rank_process_group() as pg, tempfile.TemporaryDirectory() as d:
            model = sharded_model(ShardingEnv.from_process_group(pg), model_plan(1, 0))
            optimizer = make_dense_optimizer(model)
            for step in range(2):
                train_model(model, optimizer, step, 0)
            saved: Dict[Tuple[str, Rect], Dict[str, torch.Tensor]] = {
                key: {n: t.detach().clone() for n, t in slot.tensors.items()}
                for key, slot in sharded_slots(model.module).items()
            }
            record = save_checkpoint(model, d, step=2, group=pg)
            self.assertEqual(set(record.shards), set(saved))
            for step in range(2, 4):  # the shards move on
                train_model(model, optimizer, step, 0)
            changed = sharded_slots(model.module)
            self.assertFalse(
                all(
                    torch.equal(changed[k].tensors["weight"], v["weight"])
                    for k, v in saved.items()
                )
            )
            fields = dict(record.fields)
            # pieces of the column-wise and row-wise tables only
            wanted = [k for k in saved if k[0] in ("ebc:t2", "ec:t1")]
            pieces = [
                SourcePiece(key, half, rect, CHECKPOINT, 0, rect, 2)
                for key, rect in wanted
                for half in _halves(rect)
            ]
            slots, nbytes, _ = load_pieces(record, pieces, fields)
        self.assertEqual(len(slots), len(pieces))
        for piece in pieces:
            slot = slots[(piece.key, piece.rect)]
            local = piece.rect.relative_to(piece.origin)
            for f in fields[piece.key]:
                expected = saved[(piece.key, piece.origin)][f.name]
                if expected.dim() == 2:
                    expected = expected[
                        local.row : local.row + local.rows,
                        local.col : local.col + local.cols,
                    ]
                elif expected.numel() > 1:
                    expected = expected[local.row : local.row + local.rows]
                self.assertTrue(torch.equal(slot.tensors[f.name], expected), piece)
        read = sum(
            sum(t.numel() * t.element_size() for t in saved[k].values()) for k in wanted
        )
        self.assertEqual(nbytes, read)  # only the shards the pieces need


if __name__ == "__main__":
    unittest.main()

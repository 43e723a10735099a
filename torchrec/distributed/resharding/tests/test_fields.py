#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of the state model: how each field of a table follows a
piece's rectangle, what a piece costs on the wire, and the union of the
ranks' table facts.
"""

import pickle
import unittest
from typing import Dict, List, Tuple

import torch
from hypothesis import given, settings, strategies as st
from torchrec.distributed.resharding.fields import (
    Field,
    FieldKind,
    merge_table_facts,
    piece_cost,
    table_key,
    TableFacts,
    TableKey,
)
from torchrec.distributed.resharding.plan import Rect, Transfer

RECT, ROWS, SCALAR = FieldKind.RECT, FieldKind.ROWS, FieldKind.SCALAR

FIELDS: Dict[str, List[Field]] = {
    "a": [Field("weight", RECT, torch.float32)],
    "b": [Field("weight", RECT, torch.float16), Field("sum", ROWS, torch.float32)],
    "c": [Field("weight", RECT, torch.float32), Field("iter", SCALAR, torch.int64)],
}


def _transfer(rows: int, cols: int) -> Transfer:
    rect = Rect(0, 0, rows, cols)
    return Transfer("a", 0, 1, rect, rect, rect)


class FieldsTest(unittest.TestCase):
    def test_numel_shape_and_cost(self) -> None:
        t = _transfer(3, 4)
        self.assertEqual(Field("w", RECT, torch.float32).numel(t), 12)
        self.assertEqual(Field("s", ROWS, torch.float32).numel(t), 3)
        self.assertEqual(Field("c", SCALAR, torch.float32).numel(t), 1)
        self.assertEqual(Field("s", ROWS, torch.float32).shape(3, 4), (3,))
        cost = piece_cost(FIELDS["b"] + FIELDS["c"][1:])
        self.assertEqual((cost.per_element, cost.per_row, cost.per_piece), (2, 4, 8))
        self.assertEqual(cost.of(t.rect), 12 * 2 + 3 * 4 + 8)

    def test_facts_merge_by_union_lowest_rank_first(self) -> None:
        weight = Field("weight", RECT, torch.float32)
        half = Field("weight", RECT, torch.float16)
        a = TableFacts({"x": (weight,)}, {"x": 0.1}, 3)
        b = TableFacts({"x": (half,), "y": (half,)}, {"x": 0.2, "y": 0.3}, 5)
        merged = merge_table_facts([a, b])
        self.assertEqual(merged.fields, {"x": (weight,), "y": (half,)})
        self.assertEqual(merged.learning_rates, {"x": 0.1, "y": 0.3})
        self.assertEqual(merged.optimizer_iter, 5)
        renamed = merged.renamed({"y": "m:y"})
        self.assertEqual(renamed.fields, {"m:y": (half,)})
        self.assertEqual(renamed.fields_of("x"), ())


# module paths and table names as models name them ("" is the root module)
paths: st.SearchStrategy[str] = st.sampled_from(
    ["", "ebc", "sparse.ebc", "a:b", "sparse.ebc_2", "z"]
)
names: st.SearchStrategy[str] = st.sampled_from(["t", "t0", "t_1", "big.t", "u"])


class TableKeyTest(unittest.TestCase):
    @settings(max_examples=60, deadline=None)
    # pyre-ignore[56]
    @given(st.lists(st.tuples(paths, names), min_size=1, max_size=8))
    def test_the_string_form_orders_hashes_and_parses(
        self, pairs: List[Tuple[str, str]]
    ) -> None:
        keys = [TableKey(p, t) for p, t in pairs]
        texts = [p + ":" + t for p, t in pairs]  # the form callers built by hand
        self.assertEqual([str(k) for k in keys], texts)
        self.assertEqual(keys, texts)
        self.assertEqual(sorted(keys), sorted(texts))
        self.assertEqual({hash(k) for k in keys}, {hash(t) for t in texts})
        self.assertEqual(repr(keys), repr(texts))  # digests of a repr stay equal
        for key, (p, t) in zip(keys, pairs):
            self.assertEqual((key.path, key.table), (p, t))
            parsed = TableKey.parse(str(key))
            self.assertIsInstance(parsed, TableKey)
            self.assertEqual((parsed.path, parsed.table), (p, t))
            again = pickle.loads(pickle.dumps(key))
            self.assertIsInstance(again, TableKey)
            self.assertEqual((again.path, again.table), (p, t))
            self.assertEqual(table_key(p, t), key)
            self.assertIsInstance(table_key(p, t), TableKey)

    def test_malformed(self) -> None:
        with self.assertRaisesRegex(ValueError, "holds ':'"):
            TableKey("ebc", "a:b")
        with self.assertRaisesRegex(ValueError, "not a table key"):
            TableKey.parse("no-separator")
        with self.assertRaises(AttributeError):
            TableKey("ebc", "t").path = "other"  # pyre-ignore[41]


if __name__ == "__main__":
    unittest.main()

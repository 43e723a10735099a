#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
The state model of live resharding (pure: no collectives, no kernels).

Every piece of a table that moves carries the same tensors as the table's
shards: the weight and the fused optimizer's state. A :class:`Field` names one
of them with how it follows the table's rectangles (:class:`FieldKind`) and
its dtype. :class:`TableFacts` is what a rank tells the others about the
tables it holds before anything moves: the fields, the learning rates and the
optimizer's step count. It merges by union, so the agreement of many ranks
stays as large as the tables, not as the world.
"""

import enum
from dataclasses import dataclass, field
from typing import Dict, Iterable, Mapping, Sequence, Tuple

import torch
from torchrec.distributed.resharding.plan import Transfer
from torchrec.distributed.resharding.transfer_bytes import PieceCost

WEIGHT = "weight"


class TableKey(str):
    """
    A module's table within a transaction or a plan: its module path and its
    table name.

    The key is its own stable string form, "path:table" (the path may hold
    ":" itself, the table name may not), so it hashes, sorts, digests, logs
    and travels between ranks exactly as that string: every rank orders and
    digests keys the same way, and a key equals the string form older callers
    built by hand. ``TableKey.parse`` reads the form back.

    Args:
        path (str): the sharded module's path in the model ("" for the root).
        table (str): the table's name in that module.
    """

    __slots__ = ()

    def __new__(cls, path: str, table: str) -> "TableKey":
        if ":" in table:
            raise ValueError(f"table name {table!r} of a TableKey holds ':'")
        return super().__new__(cls, f"{path}:{table}")

    def __getnewargs__(self) -> Tuple[str, str]:  # type: ignore[override]
        return (self.path, self.table)

    @property
    def path(self) -> str:
        """The module path."""
        return str.rpartition(self, ":")[0]

    @property
    def table(self) -> str:
        """The table name."""
        return str.rpartition(self, ":")[2]

    @classmethod
    def parse(cls, text: str) -> "TableKey":
        """
        The key whose string form is ``text``.

        Args:
            text (str): "path:table", as ``str(key)`` writes it.

        Returns:
            TableKey: the key, equal to ``text``.

        Raises:
            ValueError: when ``text`` has no ":".
        """
        path, sep, table = str(text).rpartition(":")
        if not sep:
            raise ValueError(f"{text!r} is not a table key 'path:table'")
        return cls(path, table)


def table_key(path: str, table: str) -> TableKey:
    """
    The key of a module's table: ``TableKey(path, table)``.

    Args:
        path (str): the module path.
        table (str): the table name.

    Returns:
        TableKey: the key (a ``str`` "path:table", as before).
    """
    return TableKey(path, table)


class FieldKind(enum.Enum):
    """How a tensor that travels with a table follows the table's rectangles."""

    RECT = "rect"  # a value per element of the shard (weights, Adam moments)
    ROWS = "rows"  # a value per row of the shard (e.g. row-wise Adagrad)
    SCALAR = "scalar"  # a single value per shard (e.g. an iteration count)


@dataclass(frozen=True)
class Field:
    """
    One tensor that travels with every piece of a table.

    Args:
        name (str): "weight" or an optimizer state key.
        kind (FieldKind): how it follows the table's rectangles.
        dtype (torch.dtype): element type on the wire.
    """

    name: str
    kind: FieldKind
    dtype: torch.dtype

    def numel(self, transfer: Transfer) -> int:
        """Elements of this field in one piece."""
        if self.kind == FieldKind.RECT:
            return transfer.rect.numel
        if self.kind == FieldKind.ROWS:
            return transfer.rect.rows
        return 1

    def nbytes(self, transfer: Transfer) -> int:
        """Bytes of this field in one piece."""
        return self.numel(transfer) * self.dtype.itemsize

    def shape(self, rows: int, cols: int) -> Tuple[int, ...]:
        """The shape of this field for a ``rows`` x ``cols`` shard."""
        if self.kind == FieldKind.RECT:
            return (rows, cols)
        if self.kind == FieldKind.ROWS:
            return (rows,)
        return (1,)


def piece_cost(fields: Iterable[Field]) -> PieceCost:
    """
    Args:
        fields (Iterable[Field]): the fields of a table.

    Returns:
        PieceCost: the bytes a piece of the table costs on the wire.
    """
    per_element = per_row = per_piece = 0
    for f in fields:
        if f.kind == FieldKind.RECT:
            per_element += f.dtype.itemsize
        elif f.kind == FieldKind.ROWS:
            per_row += f.dtype.itemsize
        else:
            per_piece += f.dtype.itemsize
    return PieceCost(per_element, per_row, per_piece)


@dataclass
class TableFacts:
    """
    What a rank tells the others about the tables it holds before any data
    moves (picklable values; dtypes travel as ``torch.dtype``).

    Args:
        fields (Dict[str, Tuple[Field, ...]]): per table, the tensors that
            travel with its pieces.
        learning_rates (Dict[str, float]): per table, its fused kernel's rate.
        optimizer_iter (int): the highest step count of the fused kernels.
    """

    fields: Dict[str, Tuple[Field, ...]] = field(default_factory=dict)
    learning_rates: Dict[str, float] = field(default_factory=dict)
    optimizer_iter: int = 0

    def fields_of(self, table: str) -> Tuple[Field, ...]:
        """The fields of a table's pieces (none for a table nobody holds)."""
        return self.fields.get(table, ())

    def fields_by_table(self, tables: Iterable[str]) -> Dict[str, Tuple[Field, ...]]:
        """The fields of every table of ``tables``."""
        return {t: self.fields_of(t) for t in tables}

    def renamed(self, rename: Mapping[str, str]) -> "TableFacts":
        """The facts of the tables ``rename`` maps, under their new names
        (e.g. "path:table")."""
        return TableFacts(
            {rename[t]: f for t, f in self.fields.items() if t in rename},
            {rename[t]: lr for t, lr in self.learning_rates.items() if t in rename},
            self.optimizer_iter,
        )


def merge_table_facts(all_facts: Sequence[TableFacts]) -> TableFacts:
    """
    Args:
        all_facts (Sequence[TableFacts]): facts of several ranks, by rank.

    Returns:
        TableFacts: the union (the lowest rank's entry wins for a table); as
        large as the tables, whatever the number of ranks.
    """
    merged = TableFacts()
    for facts in all_facts:
        for table, table_fields in facts.fields.items():
            merged.fields.setdefault(table, table_fields)
        for table, lr in facts.learning_rates.items():
            merged.learning_rates.setdefault(table, lr)
        merged.optimizer_iter = max(merged.optimizer_iter, facts.optimizer_iter)
    return merged

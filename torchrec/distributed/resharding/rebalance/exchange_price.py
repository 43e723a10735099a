#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
Pure: the bytes a table's lookups exchange per step on each rank, by its
layout, and what a row split adds to them.

A row split cuts kernel time but adds work outside the kernels: every rank
bucketizes its own ids of the table by row block before the ids'
all-to-all (TorchRec's ``bucketize_kjt_before_all2all``), the row sharding
runs collectives of its own, and every rank of a row group holds partial
sums of every sample's pooled output, reduce-scattered forward and
all-gathered backward. The row split search (``row_splits``) prices that
at the figures the job measured (``ExchangePrice``: the ``Rebalancer``
times an all-to-all of its process group, small and large, and the
bucketization of a batch of ids, and the ranks agree on the slowest
rank's figures): a split is taken only where the slowest rank's kernel
plus exchange seconds fall.

Per step and rank, bytes sent plus received (``ids`` and ``samples`` the
table's ids and samples per step over the group of ``W`` ranks; each rank
holds ``1/W`` of them):

* ids in: each shard receives the ids of its rows from the other ranks
  (``ids x rows share x (W - 1) / W``), and each rank sends its own ids of
  the shard's rows (``ids x rows share / W``) to every shard it does not
  hold (a column shard reads every id of its rows);
* pooled output out, gradients back: a column block of ``c`` columns whose
  rows one rank holds sends the output of the other ranks' samples
  (``samples x (W - 1) / W x c``) and receives their gradients; a block
  spread by rows over ``n`` ranks reduce-scatters every sample's partial
  sums among them (``2 x samples x (n - 1) / n x c`` sent plus received)
  and sends its slice to the samples of ranks outside the group
  (``samples / n x (W - n) / W x c``), the same again backward; every other
  rank receives its own samples' output (``samples / W x c``) and sends
  back their gradients.

A column split or merge changes the same bytes (``column_shard_seconds``:
a shard's holder receives every id of its table, and exchanges its
columns' output; every rank sends its ids to one shard more or fewer);
the column split search (``splits``) prices them as the row split search
prices its own. A split that makes its module's first column-wise table
also adds the column-wise sharding's collectives on every rank (TorchRec
runs each sharding type's dists apart): on 2 gloo ranks, a split priced
without them was predicted to cut the step by 3% and made it 17% slower
(``benchmarks/rebalance_benchmark.py --split``).

Ids are ``ID_BYTES`` each, output values and gradients ``VALUE_BYTES``.
Only the difference between two layouts is used, so what every layout
exchanges alike (lengths, the dense part) cancels.
"""

import statistics
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple, Union

from torchrec.distributed.resharding.plan import TableLayout

ID_BYTES: int = 8  # an id (int64) of the input dist
VALUE_BYTES: int = 4  # a pooled output value or its gradient (fp32)
# A row sharding's own collectives per step: the ids' all-to-all, the
# output's reduce-scatter, the gradient's all-gather.
ROW_COLLECTIVES: int = 3
# The collectives per step a module's first column-wise table adds on every
# rank (TorchRec runs a sharding type's input and output dists apart from
# the others'): its ids' all-to-alls (splits, lengths, values), the
# output's forward and its gradient's backward.
COLUMN_SHARDING_COLLECTIVES: int = 5


@dataclass(frozen=True)
class ExchangePrice:
    """
    What the work outside the kernels that a row split adds costs, as the
    job measured it.

    Args:
        seconds_per_byte (float): seconds per byte a rank sends or receives
            in a collective.
        seconds_per_collective (float): a collective's seconds however
            small (its latency).
        seconds_per_id (float): seconds a rank spends bucketizing one of its
            ids by row block.
    """

    seconds_per_byte: float = 0.0
    seconds_per_collective: float = 0.0
    seconds_per_id: float = 0.0

    @property
    def priced(self) -> bool:
        """Whether any figure was measured above zero."""
        return (
            self.seconds_per_byte > 0
            or self.seconds_per_collective > 0
            or self.seconds_per_id > 0
        )


def median_price(prices: Sequence[ExchangePrice]) -> ExchangePrice:
    """
    Per figure, the median of several calibrations: a burst of load on a
    shared host during one of three is left out.

    Args:
        prices (Sequence[ExchangePrice]): the calibrations (at least one).

    Returns:
        ExchangePrice: their figures' medians.
    """
    if not prices:
        raise ValueError("median_price needs at least one calibration")
    return ExchangePrice(
        seconds_per_byte=statistics.median(p.seconds_per_byte for p in prices),
        seconds_per_collective=statistics.median(
            p.seconds_per_collective for p in prices
        ),
        seconds_per_id=statistics.median(p.seconds_per_id for p in prices),
    )


@dataclass(frozen=True)
class TableExchange:
    """
    One table's bytes sent plus received per step, per rank.

    Args:
        holders (Dict[int, float]): rank -> bytes, for the ranks holding a
            shard of the table.
        others (float): bytes of every other rank.
    """

    holders: Dict[int, float]
    others: float

    def of(self, rank: int) -> float:
        """Bytes per step of ``rank``."""
        return self.holders.get(rank, self.others)


# A layout by column block: per block (its first column, its columns) the
# (rank, rows) of each of its shards.
Blocks = Sequence[Tuple[Tuple[int, int], Sequence[Tuple[int, int]]]]


def layout_blocks(layout: TableLayout) -> Blocks:
    """A layout's shards by column block (``Blocks``)."""
    blocks: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
    for shard in layout.shards:
        key = (shard.rect.col, shard.rect.cols)
        blocks.setdefault(key, []).append((shard.rank, shard.rect.rows))
    return sorted(blocks.items())


def table_exchange(
    layout: TableLayout, world_size: int, ids: float, samples: float
) -> TableExchange:
    """
    The bytes a table's lookups exchange per step on each rank (ids of
    ``ID_BYTES``, output values and gradients of ``VALUE_BYTES``).

    Args:
        layout (TableLayout): the table's layout.
        world_size (int): ranks of the group.
        ids (float): the table's ids per step over all ranks.
        samples (float): its samples per step over all ranks.

    Returns:
        TableExchange: per rank, bytes sent plus received per step.
    """
    return blocks_exchange(layout_blocks(layout), layout.rows, world_size, ids, samples)


def blocks_exchange(
    blocks: Blocks,
    rows: int,
    world_size: int,
    ids: float,
    samples: float,
    id_bytes: float = ID_BYTES,
    value_bytes: float = VALUE_BYTES,
) -> TableExchange:
    """
    ``table_exchange`` of a layout given by column block (``Blocks``) of a
    table of ``rows`` rows.
    """
    held = sum(count for _, shards in blocks for _, count in shards)
    widths = [cols for (_, cols), _ in blocks]
    others = others_bytes(
        held, widths, rows, world_size, ids, samples, id_bytes, value_bytes
    )
    holders: Dict[int, float] = {}
    for (_, cols), shards in blocks:
        extra = block_output_bytes(len(shards), cols, world_size, samples, value_bytes)
        for rank, count in shards:
            received = rows_ids_bytes(count, rows, world_size, ids, id_bytes)
            holders[rank] = holders.get(rank, others) + received + extra
    return TableExchange(holders, others)


def others_bytes(
    held: int,
    widths: Sequence[int],
    rows: int,
    world_size: int,
    ids: float,
    samples: float,
    id_bytes: float = ID_BYTES,
    value_bytes: float = VALUE_BYTES,
) -> float:
    """
    ``blocks_exchange``'s bytes of a rank holding none of a table whose
    blocks of ``widths`` columns hold ``held`` rows in all: its ids to
    every block's rows, and its own samples' output of every column.
    """
    w = float(world_size)
    sent_ids = ids * held / max(rows, 1) / w * id_bytes
    own_output = sum(2.0 * samples / w * cols * value_bytes for cols in widths)
    return sent_ids + own_output


def block_output_bytes(
    ranks: int,
    cols: int,
    world_size: int,
    samples: float,
    value_bytes: float = VALUE_BYTES,
) -> float:
    """
    ``blocks_exchange``'s output bytes a holder of a column block of
    ``cols`` columns over ``ranks`` ranks exchanges more than a rank
    holding none: the block's output (and its gradient) as its row group
    reduces and gathers it.
    """
    w, n = float(world_size), float(ranks)
    group = 2.0 * samples * (n - 1.0) / n + samples / n * (w - n) / w
    return 2.0 * (group - samples / w) * cols * value_bytes


def rows_ids_bytes(
    count: int, rows: int, world_size: int, ids: float, id_bytes: float = ID_BYTES
) -> float:
    """
    ``blocks_exchange``'s id bytes a holder of ``count`` of a table's
    ``rows`` rows exchanges more than a rank holding none: it receives the
    other ranks' ids of its rows instead of sending its own.
    """
    w = float(world_size)
    return ids * count / max(rows, 1) * (w - 2.0) / w * id_bytes


def exchange_delta(
    before: TableExchange, after: TableExchange
) -> Tuple[Dict[int, float], float]:
    """
    What a change of layout adds to each rank's bytes per step.

    Args:
        before (TableExchange): the table's exchange before.
        after (TableExchange): after.

    Returns:
        Tuple[Dict[int, float], float]: per rank holding a shard before or
        after, bytes added (negative: saved); and the bytes added to every
        other rank.
    """
    ranks = sorted(set(before.holders) | set(after.holders))
    return (
        {r: after.of(r) - before.of(r) for r in ranks},
        after.others - before.others,
    )


def row_blocks_spread(layout: TableLayout) -> int:
    """Column blocks of a layout whose rows more than one rank holds."""
    return _spread(layout_blocks(layout))


def _spread(blocks: Blocks) -> int:
    return sum(1 for _, shards in blocks if len(shards) > 1)


def row_split_seconds(
    before: TableLayout,
    after: Union[TableLayout, Blocks],
    world_size: int,
    ids: float,
    samples: float,
    price: ExchangePrice,
) -> Tuple[Dict[int, float], float]:
    """
    Seconds per step a table's change of layout (whole or column shards to
    row blocks) adds outside the kernels on each rank: the bytes' change,
    and on every rank the bucketization of its own ids (``ids / W`` per
    column block spread by rows) and the row sharding's collectives.

    Args:
        before (TableLayout): the table's layout now.
        after (Union[TableLayout, Blocks]): its layout after (or its
            shards by column block).
        world_size (int): ranks of the group.
        ids (float): the table's ids per step over all ranks.
        samples (float): its samples per step over all ranks.
        price (ExchangePrice): the measured figures.

    Returns:
        Tuple[Dict[int, float], float]: per rank holding a shard before or
        after, seconds added; and the seconds added to every other rank.
    """
    blocks = layout_blocks(after) if isinstance(after, TableLayout) else after
    old = layout_blocks(before)
    delta, others = exchange_delta(
        blocks_exchange(old, before.rows, world_size, ids, samples),
        blocks_exchange(blocks, before.rows, world_size, ids, samples),
    )
    spread = _spread(blocks) - _spread(old)
    fixed = 0.0
    if spread > 0:
        fixed = (
            price.seconds_per_id * ids / world_size * spread
            + price.seconds_per_collective * ROW_COLLECTIVES
        )
    per_byte = price.seconds_per_byte
    return (
        {r: v * per_byte + fixed for r, v in delta.items()},
        others * per_byte + fixed,
    )


@dataclass(frozen=True)
class ColumnShardSeconds:
    """
    What a column shard of one table (spanning every row) adds outside the
    kernels, in seconds per step, as ``blocks_exchange`` counts it: what a
    column split or merge changes.

    Args:
        shard (float): its holder, per shard: the other ranks' ids it
            receives in place of sending its own.
        column (float): its holder, per column: the output of the other
            ranks' samples it sends and their gradients it receives.
        everyone (float): every rank, per shard of the table: its own ids
            sent to it.
        sharding (float): every rank, once, where the split makes its
            module's first column-wise table: the column-wise sharding's own
            collectives.
    """

    shard: float = 0.0
    column: float = 0.0
    everyone: float = 0.0
    sharding: float = 0.0


def column_shard_seconds(
    world_size: int, ids: float, samples: float, price: ExchangePrice
) -> ColumnShardSeconds:
    """
    ``ColumnShardSeconds`` of a table of ``ids`` ids and ``samples``
    samples per step over ``world_size`` ranks, at ``price``.
    """
    per_byte = price.seconds_per_byte
    # a shard spanning every row: a one-block row group of one rank, its
    # bytes per shard and per column as ``blocks_exchange`` counts them
    return ColumnShardSeconds(
        shard=rows_ids_bytes(1, 1, world_size, ids) * per_byte,
        column=block_output_bytes(1, 1, world_size, samples) * per_byte,
        everyone=ids / float(world_size) * ID_BYTES * per_byte,
        sharding=price.seconds_per_collective * COLUMN_SHARDING_COLLECTIVES,
    )


def exchange_price_of(
    small_seconds: float,
    large_seconds: float,
    small_bytes: float,
    large_bytes: float,
    bucketize_seconds: float,
    bucketized_ids: float,
) -> ExchangePrice:
    """
    The figures of a calibration: two exchanges of different sizes give
    the seconds per byte (their difference's; where noise hides it, the
    large one's seconds over its bytes, an upper bound) and per collective
    (the small one's, less its bytes); a timed bucketization the seconds
    per id.

    Args:
        small_seconds (float): the slowest rank's seconds for the small
            exchange.
        large_seconds (float): the same for the large one.
        small_bytes (float): bytes a rank sent plus received in the small.
        large_bytes (float): the same in the large.
        bucketize_seconds (float): the slowest rank's seconds to bucketize
            ``bucketized_ids`` ids.
        bucketized_ids (float): ids bucketized.

    Returns:
        ExchangePrice: the figures (none negative).
    """
    per_byte = 0.0
    if large_bytes > small_bytes:
        per_byte = max(large_seconds - small_seconds, 0.0) / (large_bytes - small_bytes)
    if per_byte <= 0 and large_bytes > 0:
        per_byte = max(large_seconds, 0.0) / large_bytes
    latency = max(small_seconds - per_byte * small_bytes, 0.0)
    per_id = bucketize_seconds / bucketized_ids if bucketized_ids > 0 else 0.0
    return ExchangePrice(per_byte, latency, max(per_id, 0.0))

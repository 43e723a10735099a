#!/usr/bin/env python3
# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# pyre-strict

"""
One-process tests of the validation of a requested sharding (a clear
ReshardError naming the table and the reason, before any data moves) and of
the digest of a request that ranks compare to agree on it. Shardings that
TorchRec's plan helpers build, and the hand-built uneven ones the transfer
tests use, validate to the layout they describe.
"""

import os
import subprocess
import sys
import unittest
from typing import Dict, List, Sequence

from hypothesis import given, HealthCheck, settings
from torch.distributed._shard.metadata import ShardMetadata
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.resharding.plan import (
    layout_from_parameter_sharding,
    ReshardError,
)
from torchrec.distributed.resharding.plan_validation import (
    delta_digest,
    describe_parameter_sharding,
    validate_parameter_sharding,
)
from torchrec.distributed.test_utils.plan_layouts import (
    constructed_sharding,
    DENSE,
    FUSED,
    grid_tables,
    GridTable,
    one_table_ebc,
    sharding_by_hand,
    ShardTuple,
    TABLE_COLS,
    TABLE_ROWS,
    TYPE_GENERATORS,
    WORLD,
)
from torchrec.distributed.types import ParameterSharding


class ValidLayoutsTest(unittest.TestCase):
    """What the transfer tests plan with is valid, and validation reads the
    same layout from it as layout_from_parameter_sharding."""

    def assert_valid(
        self, ps: ParameterSharding, rows: int, cols: int, world_size: int
    ) -> None:
        self.assertEqual(
            validate_parameter_sharding("t", ps, rows, cols, world_size, "cpu"),
            layout_from_parameter_sharding(ps, rows, cols, world_size),
        )

    def test_every_constructed_type(self) -> None:
        for kind in TYPE_GENERATORS:
            with self.subTest(kind=kind):
                self.assert_valid(
                    constructed_sharding(kind), TABLE_ROWS, TABLE_COLS, WORLD
                )

    def test_hand_built_uneven_and_empty_shards(self) -> None:
        cases = [
            (
                sharding_by_hand(
                    "grid_shard",
                    [
                        (0, 0, 7, 4, 1),
                        (7, 0, 3, 4, 0),
                        (0, 4, 2, 12, 0),
                        (2, 4, 8, 12, 1),
                    ],
                ),
                10,
                16,
                2,
            ),
            (
                sharding_by_hand(
                    "row_wise", [(0, 0, 4, 16, 2), (4, 0, 5, 16, 1), (9, 0, 1, 16, 0)]
                ),
                10,
                16,
                3,
            ),
            (
                sharding_by_hand("column_wise", [(0, 0, 10, 4, 1), (0, 4, 10, 12, 2)]),
                10,
                16,
                3,
            ),
            (
                sharding_by_hand(
                    "table_column_wise", [(0, 0, 10, 12, 0), (0, 12, 10, 4, 0)]
                ),
                10,
                16,
                3,
            ),
            (
                sharding_by_hand(
                    "row_wise", [(0, 0, 2, 16, 0), (2, 0, 0, 16, 1), (2, 0, 8, 16, 1)]
                ),
                10,
                16,
                2,
            ),
            (sharding_by_hand("table_wise", [(0, 0, 3, 8, 3)]), 3, 8, WORLD),
            (constructed_sharding("RW", one_table_ebc(rows=3, cols=8)), 3, 8, WORLD),
        ]
        for ps, rows, cols, world_size in cases:
            with self.subTest(ps=ps):
                self.assert_valid(ps, rows, cols, world_size)

    # pyre-ignore[56]
    @settings(
        max_examples=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(table=grid_tables())
    def test_random_tilings(self, table: GridTable) -> None:
        (shards,) = table.tilings
        self.assert_valid(
            sharding_by_hand("grid_shard", shards),
            table.rows,
            table.cols,
            table.world_size,
        )


# --------------------------------------------------------------------------
# Validation.


class ValidationTest(unittest.TestCase):
    NAME = "my_table"

    def assert_rejected(
        self,
        ps: object,
        reason: str,
        rows: int = 10,
        cols: int = 16,
        world_size: int = 2,
        device_type: str = "cpu",
    ) -> None:
        with self.assertRaises(ReshardError) as ctx:
            validate_parameter_sharding(
                self.NAME, ps, rows, cols, world_size, device_type  # pyre-ignore
            )
        message = str(ctx.exception)
        self.assertIn(f"'{self.NAME}'", message)
        self.assertRegex(message, reason)

    def test_valid_shardings_pass(self) -> None:
        for ps in (
            sharding_by_hand("table_wise", [(0, 0, 10, 16, 1)]),
            sharding_by_hand("table_wise", [(0, 0, 10, 16, 0)], kernel=FUSED),
            sharding_by_hand("column_wise", [(0, 0, 10, 4, 1), (0, 4, 10, 12, 0)]),
            sharding_by_hand("row_wise", [(0, 0, 9, 16, 1), (9, 0, 1, 16, 0)]),
            ParameterSharding(
                sharding_type="data_parallel", compute_kernel=DENSE, ranks=None
            ),
        ):
            layout = validate_parameter_sharding(self.NAME, ps, 10, 16, 2, "cpu")
            self.assertEqual((layout.rows, layout.cols), (10, 16))

    def test_gap(self) -> None:
        self.assert_rejected(
            sharding_by_hand("row_wise", [(0, 0, 4, 16, 0), (5, 0, 5, 16, 1)]), "tile"
        )

    def test_overlap(self) -> None:
        # EnumerableShardingSpec rejects overlaps at construction: overlap a
        # valid spec afterwards (as a hand-edited plan could).
        ps = sharding_by_hand("row_wise", [(0, 0, 5, 16, 0), (5, 0, 5, 16, 1)])
        ps.sharding_spec.shards[0].shard_sizes = [6, 16]
        self.assert_rejected(ps, "overlap")
        ps = sharding_by_hand("row_wise", [(0, 0, 5, 16, 0), (5, 0, 5, 16, 1)])
        ps.sharding_spec.shards.append(
            ShardMetadata(
                shard_offsets=[0, 0], shard_sizes=[5, 16], placement="rank:1/cpu"
            )
        )
        self.assert_rejected(ps, "overlap")

    def test_wrong_total_size(self) -> None:
        tw = sharding_by_hand("table_wise", [(0, 0, 10, 16, 0)])
        # The shards tile a 10x16 table, not the module's 12x16 / 10x20 one.
        self.assert_rejected(tw, "tile", rows=12)
        self.assert_rejected(tw, "tile", cols=20)
        # Larger than the table.
        self.assert_rejected(
            sharding_by_hand("table_wise", [(0, 0, 11, 16, 0)]), "tile"
        )
        self.assert_rejected(
            sharding_by_hand(
                "row_wise", [(0, 0, 5, 16, 0), (5, 0, 5, 16, 1), (10, 0, 1, 16, 1)]
            ),
            "tile",
        )

    def test_rank_out_of_range(self) -> None:
        self.assert_rejected(
            sharding_by_hand("table_wise", [(0, 0, 10, 16, 2)]),
            "outside the process group",
        )
        self.assert_rejected(
            sharding_by_hand("column_wise", [(0, 0, 10, 8, 0), (0, 8, 10, 8, 7)]),
            "outside the process group",
        )
        # Valid placements, but an out-of-range rank in ``ranks``.
        self.assert_rejected(
            sharding_by_hand("table_wise", [(0, 0, 10, 16, 1)], ranks=[3]),
            "outside the process group",
        )

    def test_wrong_device_type(self) -> None:
        self.assert_rejected(
            sharding_by_hand("table_wise", [(0, 0, 10, 16, 0)], device="cuda:0"),
            "device type",
        )
        self.assert_rejected(
            sharding_by_hand("table_wise", [(0, 0, 10, 16, 0)]),
            "device type",
            device_type="cuda",
        )

    def test_unsupported_sharding_type(self) -> None:
        self.assert_rejected(
            sharding_by_hand("fancy_wise", [(0, 0, 10, 16, 0)]),
            "sharding type 'fancy_wise'",
        )

    def test_unsupported_compute_kernel(self) -> None:
        for kernel in (
            EmbeddingComputeKernel.QUANT.value,
            EmbeddingComputeKernel.QUANT_UVM_CACHING.value,
            EmbeddingComputeKernel.KEY_VALUE.value,
        ):
            self.assert_rejected(
                sharding_by_hand("table_wise", [(0, 0, 10, 16, 0)], kernel=kernel),
                f"compute kernel '{kernel}'",
            )

    def test_every_kernel_upstream_reshards_is_accepted(self) -> None:
        for kernel in (
            EmbeddingComputeKernel.FUSED.value,
            EmbeddingComputeKernel.FUSED_UVM.value,
            EmbeddingComputeKernel.FUSED_UVM_CACHING.value,
        ):
            ps = sharding_by_hand("table_wise", [(0, 0, 10, 16, 0)], kernel=kernel)
            layout = validate_parameter_sharding("t", ps, 10, 16, 2, "cpu")
            self.assertEqual(layout.shards[0].rank, 0)

    def test_table_wise_with_two_shards(self) -> None:
        self.assert_rejected(
            sharding_by_hand("table_wise", [(0, 0, 5, 16, 0), (5, 0, 5, 16, 1)]),
            "exactly one shard",
        )

    def assert_rejected_as(
        self, kinds: Sequence[str], shards: List[ShardTuple], reason: str
    ) -> None:
        """``shards`` are rejected for ``reason`` as a sharding of each kind."""
        for kind in kinds:
            self.assert_rejected(sharding_by_hand(kind, shards), reason)

    def test_column_wise_not_spanning_rows(self) -> None:
        shards = [(0, 0, 10, 8, 0), (0, 8, 5, 8, 1), (5, 8, 5, 8, 1)]
        kinds = ("column_wise", "table_column_wise")
        self.assert_rejected_as(kinds, shards, "span all 10 rows")

    def test_row_wise_not_spanning_columns(self) -> None:
        shards = [(0, 0, 5, 16, 0), (5, 0, 5, 8, 1), (5, 8, 5, 8, 1)]
        kinds = ("row_wise", "table_row_wise")
        self.assert_rejected_as(kinds, shards, "span all 16 columns")

    def test_missing_spec_and_wrong_object(self) -> None:
        self.assert_rejected(
            ParameterSharding(
                sharding_type="table_wise", compute_kernel=DENSE, ranks=[0]
            ),
            "EnumerableShardingSpec",
        )
        self.assert_rejected("table_wise", "ParameterSharding")


# --------------------------------------------------------------------------
# Delta digest.

# Built identically in this process and in a fresh interpreter.
_DELTA_SOURCE = """
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torchrec.distributed.resharding.plan_validation import delta_digest
from torchrec.distributed.types import ParameterSharding


def build_delta():
    def ps(kind, shards, kernel="fused"):
        return ParameterSharding(
            sharding_type=kind,
            compute_kernel=kernel,
            ranks=[s[4] for s in shards],
            sharding_spec=EnumerableShardingSpec(
                [
                    ShardMetadata([r, c], [nr, nc], f"rank:{k}/cpu")
                    for r, c, nr, nc, k in shards
                ]
            ),
        )

    return {
        "t1": ps("column_wise", [(0, 0, 10, 8, 1), (0, 8, 10, 8, 0)]),
        "t0": ps("table_wise", [(0, 0, 10, 16, 1)]),
        "t2": ParameterSharding(
            sharding_type="data_parallel", compute_kernel="dense", ranks=None
        ),
    }
"""


def _build_delta() -> Dict[str, ParameterSharding]:
    namespace: Dict[str, object] = {}
    exec(_DELTA_SOURCE, namespace)
    return namespace["build_delta"]()  # pyre-ignore


class DeltaDigestTest(unittest.TestCase):
    def test_equal_for_equal_deltas_built_separately(self) -> None:
        a, b = _build_delta(), _build_delta()
        self.assertIsNot(a["t0"], b["t0"])
        self.assertEqual(delta_digest(a), delta_digest(b))
        # Also through TorchRec's own plan construction.
        self.assertEqual(
            delta_digest({"t": constructed_sharding("GRID")}),
            delta_digest({"t": constructed_sharding("GRID")}),
        )

    def test_independent_of_dict_order(self) -> None:
        a = _build_delta()
        reordered = {k: a[k] for k in reversed(list(a))}
        self.assertNotEqual(list(a), list(reordered))
        self.assertEqual(delta_digest(a), delta_digest(reordered))

    def test_different_for_different_deltas(self) -> None:
        base = delta_digest(_build_delta())
        variants = []
        d = _build_delta()
        d["t0"] = sharding_by_hand("table_wise", [(0, 0, 10, 16, 0)], kernel=FUSED)
        variants.append(d)  # another rank
        d = _build_delta()
        d["t0"].compute_kernel = DENSE
        variants.append(d)  # another kernel
        d = _build_delta()
        d["t1"] = sharding_by_hand(
            "column_wise", [(0, 0, 10, 4, 1), (0, 4, 10, 12, 0)], FUSED
        )
        variants.append(d)  # other column cuts
        d = _build_delta()
        d["t1"].sharding_type = "table_column_wise"
        variants.append(d)  # another type, same shards
        d = _build_delta()
        del d["t2"]
        variants.append(d)  # a table fewer
        d = _build_delta()
        d["t3"] = d.pop("t2")
        variants.append(d)  # another table name
        digests = [delta_digest(v) for v in variants]
        self.assertNotIn(base, digests)
        self.assertEqual(len(set(digests)), len(digests))
        self.assertNotEqual(delta_digest({}), base)
        for digest in digests + [base]:
            self.assertIsInstance(digest, int)
            self.assertTrue(0 <= digest < 2**63)

    def test_describe_is_canonical(self) -> None:
        a, b = _build_delta(), _build_delta()
        for name in a:
            self.assertEqual(
                describe_parameter_sharding(a[name]),
                describe_parameter_sharding(b[name]),
            )

    def test_stable_across_processes(self) -> None:
        script = _DELTA_SOURCE + "\nprint(delta_digest(build_delta()))\n"
        env = dict(os.environ, PYTHONHASHSEED="12345")
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(
            int(result.stdout.strip().splitlines()[-1]), delta_digest(_build_delta())
        )


if __name__ == "__main__":
    unittest.main()

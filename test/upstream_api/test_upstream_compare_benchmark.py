# pyre-strict

"""
Smoke test of ``benchmarks/upstream_compare_benchmark.py`` (stock torchrec's
reshard against the fork on the same release, the installed fork's base): a
tiny run of both sides, one move, one repetition, and the checks that judge
them.

The stock side needs no download: its venv (made in a temporary folder)
holds the stock wheel the fork's build already fetched and
verified (the fork's wheel cache), and takes the rest of the stack from this
interpreter's venv.
"""

import sys
from pathlib import Path
from typing import Any, Dict, List

import torch

REPO: Path = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import upstream_compare_benchmark as bench  # noqa: E402  # pyre-ignore[21]


def _output(keys: List[str], blocks: Dict[str, List[float]]) -> Any:
    values = torch.tensor([[x for k in keys for x in blocks[k]]])
    return bench.Output(keys, values, [len(blocks[k]) for k in keys])


def test_compare_tells_what_differs() -> None:
    blocks = {"a": [1.0, 2.0], "b": [3.0, 4.0]}
    want = _output(["a", "b"], blocks)
    assert bench.compare(_output(["a", "b"], blocks), want) == "exact"
    assert bench.compare(_output(["b", "a"], blocks), want) == (
        "WRONG (feature order differs, values equal by key)"
    )
    off = {"a": [1.0, 2.0], "b": [3.0, 4.5]}
    assert bench.compare(_output(["a", "b"], off), want) == ("WRONG (max abs diff 0.5)")
    assert bench.compare(_output(["a"], blocks), want).startswith("WRONG (features")


def test_layouts_move_the_same_bytes() -> None:
    # every rank sends MOVED_PER_RANK tables' worth of weights in both moves
    for move in bench.MOVES:
        for world_size in (2, 4):
            a = bench.layout(move, world_size, False)
            b = bench.layout(move, world_size, True)
            cols = bench.DIM // len(a["t0"])
            sent = [0] * world_size
            for table in a:
                for i, (old, new) in enumerate(zip(a[table], b[table])):
                    if old != new:
                        sent[old] += cols
            assert sent == [bench.MOVED_PER_RANK * bench.DIM] * world_size, move


def test_both_sides_run_and_are_judged(tmp_path: Path) -> None:
    stock_python = bench.ensure_stock_venv(tmp_path / "stock", Path(sys.executable))
    args = bench.parse_args(
        [
            "--sizes-mib",
            "1",
            "--moves",
            "table_wise",
            "--sides",
            "stock,fork",
            "--reps",
            "1",
            "--warmup",
            "0",
            "--out-dir",
            "",
            "--move-timeout-s",
            "120",
            "--side-timeout-s",
            "240",
        ]
    )
    rows = {}
    for side, python in (("stock", stock_python), ("fork", Path(sys.executable))):
        res = bench.launch_side(side, python, 1.0, "table_wise", args)
        rows[side] = bench.summarise(1.0, "table_wise", side, res)
    for side, row in rows.items():
        assert row["error"] is None, (side, row["error"])
        assert len(row["times_s"]) == 1 and row["peak_mib"] is not None, side
        assert row["setup"]["torchrec"].startswith(bench.BASE), side
    assert rows["stock"]["setup"]["torchrec"] == bench.BASE
    assert "+reshard" in rows["fork"]["setup"]["torchrec"]
    # the fork's move is exact; stock's is judged (whatever it gives)
    assert rows["fork"]["forward"] == ["exact"]
    assert rows["fork"]["weights"] == ["exact"]
    assert all(f.startswith(("exact", "WRONG (")) for f in rows["stock"]["forward"])
    table = bench.table_text([rows["stock"], rows["fork"]])
    assert "table_wise  stock" in table and "table_wise  fork" in table

"""The main-job demo (examples/live_reshard_demo.py) end to end, 2 gloo ranks on CPU."""

import subprocess
import sys
from typing import List

from conftest import REPO

DEMO = REPO / "examples" / "live_reshard_demo.py"
SMALL: List[str] = [
    "--rows",
    "64",
    "--dim",
    "8",
    "--batch-size",
    "8",
    "--steps-before",
    "2",
    "--steps-after",
    "2",
]


def run_demo(*args: str) -> subprocess.CompletedProcess:
    """Runs the demo as a user would; fails the test if it hangs."""
    return subprocess.run(
        [sys.executable, str(DEMO), *SMALL, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_demo_mixed_plan_is_exact() -> None:
    """Several tables change in different ways (incl. a type change and
    data-parallel) under row-wise Adagrad: training continues exactly."""
    proc = run_demo(
        "--plan", "mixed", "--num-tables", "7", "--optimizer", "rowwise_adagrad"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "training continues exactly as the reference: YES" in proc.stdout, out
    assert "tables moved: t0, t1, t2, t3, t4, t5" in proc.stdout, out
    for phase in range(6):
        assert f"phase {phase}/5" in proc.stdout, out


def test_demo_detects_a_difference() -> None:
    """A reference one ulp away is reported as NO with exit status 1."""
    proc = run_demo("--perturb-reference")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "training continues exactly as the reference: NO" in proc.stdout, out


def test_demo_help() -> None:
    """--help explains the options and the plans."""
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for word in (
        "--plan",
        "--optimizer",
        "--kernel",
        "--world-size",
        "tw-to-cw",
        "mixed",
    ):
        assert word in proc.stdout

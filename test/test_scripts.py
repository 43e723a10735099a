"""The scripts' own behaviour: a ``-k`` given to ``scripts/test.sh`` narrows
the run and keeps the base's deselects (.ci/bases.txt), which pytest would
drop if the caller's ``-k`` simply came after them (it keeps the last)."""

import subprocess

from conftest import REPO
from test_bisect import deselected


def test_a_callers_k_keeps_the_bases_deselects() -> None:
    removed = deselected("1.9.2")
    assert removed, "the default base deselects a test (.ci/bases.txt)"
    # the caller asks for a deselected test and for one other test
    wanted = f"{removed[0]} or (test_wire and test_kept_groups_serve)"
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "test.sh"), "--co", "-q", "-k", wanted],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "1/" in out and "tests collected" in out, out
    assert removed[0] not in out.split("tests collected")[0], out

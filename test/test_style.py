"""House style: black and usort, with the repository's configuration, leave every
Python file we write as it is (the overlay files, tools, benchmarks, examples,
scripts and these tests)."""

import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from conftest import REPO
from tools import forklib

#: Folders of our own besides the overlay files the series lists.
OURS = ("tools", "benchmarks", "examples", "scripts", "test")


def our_python_files() -> List[str]:
    """Every Python file of ours, relative to the repository."""
    # an overlay file a later entry deletes is listed, but no longer ours
    overlay = {
        rel
        for entry in forklib.parse_series(REPO, every_base=True)
        for rel in entry.files
        if rel.endswith(".py") and (REPO / rel).is_file()
    }
    others = {
        str(path.relative_to(REPO))
        for folder in OURS
        for path in (REPO / folder).rglob("*.py")
    }
    return sorted(overlay | others | {"setup.py"})


@pytest.mark.parametrize(
    "tool", [["usort", "check"], ["black", "--check", "--quiet"]], ids=lambda t: t[0]
)
def test_the_formatter_leaves_every_file_as_it_is(tool: List[str]) -> None:
    files = our_python_files()
    assert len(files) > 100, "the series lists the overlay files"
    done = subprocess.run(
        [sys.executable, "-m", *tool, *files],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, (
        f"{tool[0]} would change files (run 'python -m usort format FILES' and "
        f"'python -m black FILES'):\n{done.stdout}{done.stderr}"
    )

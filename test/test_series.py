"""The patch series: applies to pristine upstream, is refreshed, fails loudly."""

import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from conftest import REPO
from tools import fork, forklib


def run_fork(repo: Path, *args: str) -> subprocess.CompletedProcess:
    """Run tools/fork.py of ``repo`` as a user would."""
    return subprocess.run(
        [sys.executable, str(repo / "tools" / "fork.py"), *args],
        cwd=repo,
        capture_output=True,
        text=True,
    )


def break_first_patch(repo: Path) -> str:
    """Corrupt a context line of the first patch so it no longer applies;
    returns the patch's name."""
    name = forklib.read_series(repo)[0]
    path = repo / "patches" / name
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("@@"))
    for i in range(start + 1, len(lines)):
        if lines[i].startswith(" ") and lines[i].strip():
            lines[i] = " # context that upstream does not have\n"
            break
    path.write_text("".join(lines))
    return name


def touched_files(repo: Path, name: str) -> List[str]:
    """Files a patch changes."""
    patch = forklib.parse_patch(repo / "patches" / name)
    return [
        line.split(" b/", 1)[1]
        for line in patch.diff.splitlines()
        if line.startswith("diff --git ")
    ]


def test_series_is_not_empty_and_starts_with_compat_fix() -> None:
    names = forklib.read_series(REPO)
    assert names, "patches/series lists no patch"
    assert names[0] == "compat-fbgemm-1.8-optimizer-learning-rate.patch"
    for name in names:
        patch = forklib.parse_patch(REPO / "patches" / name)
        assert patch.subject and patch.body, f"{name} needs a subject and a body"


def test_series_applies_and_is_refreshed() -> None:
    assert fork.check_repo(REPO) == forklib.read_series(REPO)


def test_refresh_is_a_noop(repo_copy: Path) -> None:
    before = {
        p.name: p.read_text() for p in (repo_copy / "patches").iterdir() if p.is_file()
    }
    tree = repo_copy / ".fork" / "tree"
    assert run_fork(repo_copy, "materialize", str(tree)).returncode == 0
    proc = run_fork(repo_copy, "refresh", "--dir", str(tree))
    assert proc.returncode == 0, proc.stderr
    after = {
        p.name: p.read_text() for p in (repo_copy / "patches").iterdir() if p.is_file()
    }
    assert after == before


def test_refresh_folds_edits_into_the_named_patch(repo_copy: Path) -> None:
    tree = repo_copy / ".fork" / "tree"
    assert run_fork(repo_copy, "materialize", str(tree)).returncode == 0
    name = forklib.read_series(repo_copy)[0]
    target = tree / touched_files(repo_copy, name)[0]
    target.write_text(target.read_text() + "# refreshed\n")
    proc = run_fork(repo_copy, "refresh", name, "--dir", str(tree))
    assert proc.returncode == 0, proc.stderr
    patch = forklib.parse_patch(repo_copy / "patches" / name)
    assert "+# refreshed" in patch.diff
    old = forklib.parse_patch(REPO / "patches" / name)
    assert (patch.subject, patch.body) == (old.subject, old.body)
    assert run_fork(repo_copy, "check").returncode == 0


def test_broken_patch_fails_check_with_its_name(repo_copy: Path) -> None:
    name = break_first_patch(repo_copy)
    proc = run_fork(repo_copy, "check")
    assert proc.returncode != 0
    assert name in proc.stderr
    assert touched_files(repo_copy, name)[0] in proc.stderr


def test_broken_patch_fails_build_with_its_name(
    repo_copy: Path, tmp_path: Path
) -> None:
    name = break_first_patch(repo_copy)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path / "wheels"), str(repo_copy)],
        capture_output=True,
        text=True,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert name in output
    assert touched_files(repo_copy, name)[0] in output
    assert not list(tmp_path.glob("wheels/*.whl"))


@pytest.mark.parametrize(
    "command", ["materialize", "develop", "refresh", "new", "check", "export"]
)
def test_every_subcommand_has_help(command: str) -> None:
    proc = run_fork(REPO, command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout

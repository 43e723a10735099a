"""The patch series: applies to pristine upstream, is refreshed, fails loudly."""

import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
from conftest import REPO, run_fork
from tools import fork, forklib

#: These tests work on the default base, whose patches are the shared ones.
pytestmark = pytest.mark.usefixtures("default_base")


def break_first_patch(repo: Path) -> str:
    """Corrupt a context line of the first patch the selected base applies so
    it no longer applies; returns the patch's name."""
    patch = forklib.load_series(repo)[0]
    name = patch.name
    path = repo / patch.source
    lines = path.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("@@"))
    for i in range(start + 1, len(lines)):
        if lines[i].startswith(" ") and lines[i].strip():
            lines[i] = " # context that upstream does not have\n"
            break
    path.write_text("".join(lines))
    return name


def touched_files(repo: Path, name: str) -> List[str]:
    """Files a patch changes on the selected base."""
    patch = forklib.load_patch(repo, name)
    return [
        line.split(" b/", 1)[1]
        for line in patch.diff.splitlines()
        if line.startswith("diff --git ")
    ]


def test_series_is_not_empty_and_starts_with_compat_fix() -> None:
    entries = forklib.parse_series(REPO, every_base=True)
    assert entries, "patches/series lists no patch"
    assert entries[0].name == "compat-fbgemm-1.8-optimizer-learning-rate.patch"
    for entry in entries:
        patch = forklib.parse_patch(REPO / "patches" / entry.name)
        assert patch.subject and patch.body, f"{entry.name} needs a subject and a body"


def test_series_applies_and_is_refreshed() -> None:
    assert fork.check_repo(REPO) == forklib.read_series(REPO)


def patch_files(repo: Path) -> Dict[str, str]:
    """Every file under patches/, by path."""
    folder = repo / "patches"
    return {
        p.relative_to(folder).as_posix(): p.read_text()
        for p in folder.rglob("*")
        if p.is_file()
    }


def test_refresh_is_a_noop(repo_copy: Path) -> None:
    before = patch_files(repo_copy)
    tree = repo_copy / ".fork" / "tree"
    assert run_fork(repo_copy, "materialize", str(tree)).returncode == 0
    proc = run_fork(repo_copy, "refresh", "--dir", str(tree))
    assert proc.returncode == 0, proc.stderr
    assert patch_files(repo_copy) == before


def test_refresh_on_an_older_base_leaves_the_other_bases_files(
    repo_copy: Path,
) -> None:
    """A refresh on 1.8.0 with no edit changes no file, though most patches it
    reads were made on 1.9.2 (other line numbers and blob ids)."""
    before = patch_files(repo_copy)
    tree = repo_copy / ".fork" / "tree-1.8.0"
    proc = run_fork(repo_copy, "--base", "1.8.0", "materialize", str(tree))
    assert proc.returncode == 0, proc.stderr
    proc = run_fork(repo_copy, "--base", "1.8.0", "refresh", "--dir", str(tree))
    assert proc.returncode == 0 and "already up to date" in proc.stdout, proc.stderr
    assert patch_files(repo_copy) == before


def test_refresh_variant_gives_a_base_its_own_patch(repo_copy: Path) -> None:
    """refresh --variant -m WHY on 1.8.0 writes the edit as 1.8.0's variant
    of a patch it reads from the shared folder (1.9.2's); the shared file and
    1.1.0's own variant stay as they were."""
    name = "reshard-dmp-whole-plan.patch"
    shared = (repo_copy / "patches" / name).read_text()
    old11 = (repo_copy / "patches" / "base-1.1.0" / name).read_text()
    assert not (repo_copy / "patches" / "base-1.8.0" / name).exists()
    tree = repo_copy / ".fork" / "tree-1.8.0"
    assert (
        run_fork(repo_copy, "--base", "1.8.0", "materialize", str(tree)).returncode == 0
    )
    with forklib.selected_base("1.8.0"):
        target = tree / touched_files(repo_copy, name)[0]
    target.write_text(target.read_text() + "# on 1.8.0 only\n")
    proc = run_fork(
        repo_copy,
        "--base",
        "1.8.0",
        "refresh",
        name,
        "--dir",
        str(tree),
        "--variant",
        "-m",
        "Why it differs on 1.8.0.",
    )
    assert proc.returncode == 0, proc.stderr
    variant = (repo_copy / "patches" / "base-1.8.0" / name).read_text()
    assert variant.startswith("Why it differs on 1.8.0.\n\ndiff --git ")
    assert "+# on 1.8.0 only" in variant
    assert (repo_copy / "patches" / name).read_text() == shared
    assert (repo_copy / "patches" / "base-1.1.0" / name).read_text() == old11
    proc = run_fork(repo_copy, "check")
    assert proc.returncode == 0, proc.stderr


def test_refresh_folds_edits_into_the_named_patch(repo_copy: Path) -> None:
    """An edit in the default base's tree goes into the named (shared) patch;
    main's variant of it, which now makes another change, is named by check
    until it gets the edit too."""
    tree = repo_copy / ".fork" / "tree"
    assert run_fork(repo_copy, "materialize", str(tree)).returncode == 0
    names = forklib.read_series(repo_copy)
    touched = [touched_files(repo_copy, name) for name in names]
    # the first patch with a file no later patch changes: an edit at its end
    # cannot conflict with them
    name, rel = next(
        (name, rel)
        for k, name in enumerate(names)
        for rel in touched[k]
        if not any(rel in files for files in touched[k + 1 :])
    )
    target = tree / rel
    target.write_text(target.read_text() + "# refreshed\n")
    proc = run_fork(repo_copy, "refresh", name, "--dir", str(tree))
    assert proc.returncode == 0, proc.stderr
    patch = forklib.load_patch(repo_copy, name)
    assert patch.source == f"patches/{name}" and "+# refreshed" in patch.diff
    old = forklib.load_patch(REPO, name)
    assert (patch.subject, patch.body) == (old.subject, old.body)
    with forklib.selected_base("1.9.2"):
        assert name in fork.check_repo(repo_copy)
    assert (repo_copy / "patches" / "base-main" / name).is_file()
    proc = run_fork(repo_copy, "check")
    assert proc.returncode == 1
    assert f"base-main/{name}: a target's variant makes the change" in proc.stderr


def test_broken_patch_fails_check_with_its_name(repo_copy: Path) -> None:
    name = break_first_patch(repo_copy)
    proc = run_fork(repo_copy, "check")
    assert proc.returncode != 0
    assert name in proc.stderr
    assert touched_files(repo_copy, name)[0] in proc.stderr
    # 1.8.0 reads the shared patch too (it has no variant of it)
    proc = run_fork(repo_copy, "--base", "1.8.0", "check")
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
    "command", ["materialize", "develop", "refresh", "new", "check", "export", "port"]
)
def test_every_subcommand_has_help(command: str) -> None:
    proc = run_fork(REPO, command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout

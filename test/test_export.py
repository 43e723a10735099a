"""The exported series: git am on pristine upstream reproduces the fork."""

from pathlib import Path
from typing import Dict

from conftest import REPO
from tools import fork, forklib


def snapshot(tree: Path) -> Dict[str, bytes]:
    """Relative path -> content of every file of a tree (symlinks followed)."""
    return {
        rel.as_posix(): (tree / rel).read_bytes()
        for rel in forklib.iter_tree_files(tree)
    }


def test_export_applies_with_git_am_and_reproduces_the_tree(tmp_path: Path) -> None:
    out = tmp_path / "export"
    files = fork.export_series(REPO, out)
    names = forklib.read_series(REPO)
    has_overlay = bool(forklib.overlay_files(REPO))
    assert len(files) == len(names) + int(has_overlay)
    assert [f.name[:5] for f in files] == [
        f"{i:04d}-" for i in range(1, len(files) + 1)
    ]
    upstream = tmp_path / "upstream"
    forklib.init_upstream_repo(upstream, REPO)
    proc = forklib.git(["am", "-q", *map(str, files)], upstream, check=False)
    assert proc.returncode == 0, proc.stderr
    log = forklib.git(
        ["log", "--reverse", "--format=%B%x00", f"{forklib.UPSTREAM_TAG}..HEAD"],
        upstream,
    )
    messages = [m.strip() for m in log.stdout.split("\0") if m.strip()]
    expected = [forklib.OVERLAY_COMMIT_SUBJECT] if has_overlay else []
    expected += [
        forklib.parse_patch(REPO / "patches" / name).message.strip() for name in names
    ]
    assert [m.splitlines()[0] for m in messages[: int(has_overlay)]] == expected[
        : int(has_overlay)
    ]
    assert messages[int(has_overlay) :] == expected[int(has_overlay) :]

    materialized = tmp_path / "tree"
    fork.materialize_tree(materialized, REPO)
    assert snapshot(upstream) == snapshot(materialized)


def test_materialized_tree_history(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    commits = fork.materialize_tree(tree, REPO)
    names = forklib.read_series(REPO)
    assert len(commits) == len(names)
    for name, commit in zip(names, commits):
        message = forklib.git(["log", "-1", "--format=%B", commit], tree).stdout
        assert (
            message.strip()
            == forklib.parse_patch(REPO / "patches" / name).message.strip()
        )
    # the overlay is present (linked to the repo), but not part of the history
    for rel in forklib.overlay_files(REPO):
        assert (tree / rel).resolve() == (REPO / rel).resolve()
    status = forklib.git(["status", "--porcelain"], tree).stdout
    assert status == ""
    first = forklib.git(["rev-list", "--max-parents=0", "HEAD"], tree).stdout.strip()
    assert (
        first == forklib.git(["rev-parse", forklib.UPSTREAM_TAG], tree).stdout.strip()
    )

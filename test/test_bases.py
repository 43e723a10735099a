"""Two bases, one overlay: base.json pins torchrec 1.1.0 (the default, series
in patches/) and torchrec 1.8.0 (series in patches/base-1.8.0/), selected with
TORCHREC_FORK_BASE or tools/fork.py --base."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from conftest import REPO
from tools import fork, forklib, stack


def run_fork(repo: Path, *args: str, env_base: str = "") -> subprocess.CompletedProcess:
    """Run tools/fork.py of ``repo`` as a user would (TORCHREC_FORK_BASE as given)."""
    env = dict(os.environ)
    env.pop(forklib.BASE_ENV, None)
    if env_base:
        env[forklib.BASE_ENV] = env_base
    return subprocess.run(
        [sys.executable, str(repo / "tools" / "fork.py"), *args],
        cwd=repo,
        capture_output=True,
        text=True,
        env=env,
    )


@pytest.fixture
def no_base_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(forklib.BASE_ENV, raising=False)


def test_base_json_pins_both_wheels(no_base_env: None) -> None:
    bases = forklib.load_bases(REPO)
    assert [(b.version, b.patches, b.default) for b in bases] == [
        ("1.1.0", "patches", True),
        ("1.8.0", "patches/base-1.8.0", False),
    ]
    for base in bases:
        assert base.name == "torchrec"
        assert base.wheel == f"torchrec-{base.version}-py311-none-any.whl"
        assert len(base.sha256) == 64
    assert forklib.load_base(REPO).version == "1.1.0"
    assert forklib.patches_dir(REPO) == REPO / "patches"


def test_environment_selects_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(forklib.BASE_ENV, "1.8.0")
    base = forklib.load_base(REPO)
    assert base.version == "1.8.0" and not base.default
    assert forklib.patches_dir(REPO) == REPO / "patches" / "base-1.8.0"
    assert forklib.upstream_tree_file(REPO).name == "upstream-v1.8.0-tree.txt"
    local = (REPO / "version.txt").read_text().strip().split("+", 1)[1]
    assert forklib.fork_version(REPO) == f"1.8.0+{local}"
    assert forklib.load_upstream_tree(REPO).tag == "release/v1.8.0"
    # an explicit version wins over the environment
    assert forklib.load_base(REPO, "1.1.0").version == "1.1.0"


def test_unknown_base_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(forklib.BASE_ENV, "9.9.9")
    with pytest.raises(forklib.ForkError, match="no base 9.9.9 in base.json"):
        forklib.load_base(REPO)
    proc = run_fork(REPO, "check", env_base="9.9.9")
    assert proc.returncode == 1 and "no base 9.9.9" in proc.stderr


def test_each_base_has_its_own_trees(no_base_env: None) -> None:
    default, other = forklib.load_bases(REPO)
    assert fork.base_dir(fork.DEFAULT_TREE, default) == fork.DEFAULT_TREE
    assert fork.base_dir(fork.DEFAULT_TREE, other).name == "tree-1.8.0"


def test_both_series_map_the_same_entries_and_overlay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One overlay: the 1.8.0 series has the 1.1.0 series' entries, in order,
    each introducing the same overlay files. Besides them it may have entries
    of its own (changes to 1.8.0's files only, such as the removal of
    upstream's resharding): plain patches with no overlay file and no overlay
    diff, each with tests its patch adds."""
    monkeypatch.delenv(forklib.BASE_ENV, raising=False)
    default = [(e.name, e.files) for e in forklib.parse_series(REPO)]
    monkeypatch.setenv(forklib.BASE_ENV, "1.8.0")
    entries = forklib.load_stack(REPO)
    names = {name for name, _ in default}
    other = [(e.name, e.files) for e in entries if e.name in names]
    assert other == default
    own = [e for e in entries if e.name not in names]
    assert [e.name for e in own] == ["remove-upstream-dynamic-sharding.patch"]
    for entry in own:
        assert not entry.header_only and entry.patch.diff, entry.name
        assert not entry.files and not entry.overlay_diff, entry.name
        assert stack.entry_tests({}, entry.patch.diff), entry.name
        assert "1.8.0 only" in entry.patch.body, entry.name


def test_1_8_0_series_applies_and_is_refreshed() -> None:
    """tools/fork.py --base 1.8.0 check: the 1.8.0 series applies to the
    1.8.0 wheel, is refreshed, covers the overlay and applies upstream."""
    proc = run_fork(REPO, "--base", "1.8.0", "check")
    assert proc.returncode == 0, proc.stderr
    series = (REPO / "patches" / "base-1.8.0" / "series").read_text().splitlines()
    patches = [line for line in series if line.strip() and not line.startswith("#")]
    assert f"{len(patches)} patch(es) apply cleanly" in proc.stdout
    proc = run_fork(REPO, "check", env_base="1.8.0")
    assert proc.returncode == 0, proc.stderr


def test_replaces_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """base.json's 'replaces' exempts an overlay file from the 'exists
    upstream' check only when it is an overlay file of the stack that
    upstream's tree has and the wheel lacks."""
    monkeypatch.setenv(forklib.BASE_ENV, "1.8.0")
    stack = forklib.load_stack(REPO)
    upstream = forklib.load_upstream_tree(REPO)
    wheel = forklib.wheel_contents(forklib.fetch_base_wheel(REPO))
    replaces = forklib.load_base(REPO).replaces
    assert replaces == ("torchrec/distributed/tests/test_dynamic_sharding.py",)
    assert forklib.upstream_problems(REPO, stack, upstream, wheel, replaces) == []
    problems = forklib.upstream_problems(REPO, stack, upstream, wheel, ())
    assert len(problems) == 1 and replaces[0] in problems[0]
    bad = ("torchrec/not_overlay.py", "torchrec/distributed/embeddingbag.py")
    problems = forklib.upstream_problems(REPO, stack, upstream, wheel, replaces + bad)
    assert any("names torchrec/not_overlay.py, no overlay file" in p for p in problems)
    # not an overlay file either, so that is the message: both are refused
    assert any("torchrec/distributed/embeddingbag.py" in p for p in problems)


def test_upstream_deletions_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A '#-' line deletes a file of upstream's tree that the wheel lacks, no
    later than the entry that brings the overlay file replacing it."""
    monkeypatch.setenv(forklib.BASE_ENV, "1.8.0")
    entries = forklib.load_stack(REPO)
    upstream = forklib.load_upstream_tree(REPO)
    wheel = forklib.wheel_contents(forklib.fetch_base_wheel(REPO))
    replaces = forklib.load_base(REPO).replaces
    rel = replaces[0]
    index = {e.name: k for k, e in enumerate(entries)}
    remove = index["remove-upstream-dynamic-sharding.patch"]
    adds = index["reshard-ebc-seed-api.patch"]
    assert entries[remove].deletes == (rel,)

    def problems(deletes: Dict[int, Tuple[str, ...]]) -> List[str]:
        stack = [
            dataclasses.replace(e, deletes=deletes.get(k, ()))
            for k, e in enumerate(entries)
        ]
        return forklib.upstream_problems(REPO, stack, upstream, wheel, replaces)

    assert problems({remove: (rel,)}) == []
    assert problems({adds: (rel,)}) == []  # deleted and replaced in one commit
    (missing,) = problems({})
    assert f"add '#- {rel}'" in missing
    (late,) = problems({adds + 1: (rel,)})
    assert "reshard-ebc-seed-api.patch introduces" in late
    (twice,) = problems({remove: (rel,), adds: (rel,)})
    assert "already deletes" in twice
    (in_wheel,) = problems({remove: (rel, "torchrec/distributed/embeddingbag.py")})
    assert "the wheel has it" in in_wheel
    (lacking,) = problems({remove: (rel, "torchrec/no_such_file.py")})
    assert "lacks it" in lacking


def test_ci_runs_every_in_package_test_module_on_1_8_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """.ci/tests-1.8.0.txt lists every in-package test module of the overlay
    (a test that does not pass there is deselected by name, with its reason),
    so that a new test module cannot silently skip the 1.8.0 base."""
    listed = set()
    for line in (REPO / ".ci" / "tests-1.8.0.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("!"):
            listed.add(line)
    modules = {
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for path in (REPO / "torchrec").rglob("tests/test_*.py")
    }
    assert modules, "no in-package test module found"
    # and the test modules the 1.8.0 series' own patches add
    monkeypatch.setenv(forklib.BASE_ENV, "1.8.0")
    for entry in forklib.load_stack(REPO):
        for rel in stack.entry_tests({}, entry.patch.diff):
            modules.add(rel[: -len(".py")].replace("/", "."))
    assert sorted(modules - listed) == []
    assert sorted(listed - modules) == []


def test_1_8_0_stack_tree_round_trip(
    repo_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stack-tree and refresh-stack on 1.8.0, where an entry of the series
    deletes upstream's dynamic_sharding.py and a later one brings the
    overlay's file of that name: the overlay diffs come back unchanged."""
    tree = tmp_path / "stack"
    proc = run_fork(repo_copy, "--base", "1.8.0", "stack-tree", str(tree))
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setenv(forklib.BASE_ENV, "1.8.0")
    folder = forklib.patches_dir(repo_copy)
    diffs = sorted(folder.glob("*" + forklib.OVERLAY_DIFF_SUFFIX))
    assert diffs
    before = {p.name: p.read_text() for p in diffs}
    for path in diffs:
        path.unlink()
    proc = run_fork(repo_copy, "--base", "1.8.0", "refresh-stack", str(tree))
    assert proc.returncode == 0, proc.stderr
    after = sorted(folder.glob("*" + forklib.OVERLAY_DIFF_SUFFIX))
    assert {p.name: p.read_text() for p in after} == before
    proc = run_fork(repo_copy, "--base", "1.8.0", "refresh-stack", str(tree))
    assert proc.returncode == 0 and "already up to date" in proc.stdout, proc.stderr


def test_1_8_0_export_deletes_upstreams_test_before_the_fork_adds_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upstream's tests/test_dynamic_sharding.py (in its git tree, not in the
    wheel) is deleted, by its blob id, with the code it tests; the fork's
    file of that name comes later, with the fork's update_shards."""
    monkeypatch.setenv(forklib.BASE_ENV, "1.8.0")
    rel = "torchrec/distributed/tests/test_dynamic_sharding.py"
    blob = forklib.load_upstream_tree(REPO).blobs[rel]
    export = stack.export_stack(REPO, tmp_path / "out", cover_letter=False)
    names = [c.entry.name for c in export.commits]
    touching = {
        commit.entry.name: [
            change
            for change in forklib.diff_changes(path.read_text())
            if change.path == rel
        ]
        for path, commit in zip(export.patches, export.commits)
    }
    (deletion,) = touching["remove-upstream-dynamic-sharding.patch"]
    assert deletion.new_path is None and deletion.old_blob == blob
    (creation,) = touching["reshard-ebc-seed-api.patch"]
    assert creation.old_path is None
    assert creation.new_blob == forklib.git_blob_id((REPO / rel).read_bytes())
    assert [n for n in names if touching[n]] == [
        "remove-upstream-dynamic-sharding.patch",
        "reshard-ebc-seed-api.patch",
    ]
    text = export.patches[names.index("remove-upstream-dynamic-sharding.patch")]
    assert (
        stack.upstream_deletion(rel, forklib.load_upstream_tree(REPO))
        in text.read_text()
    )

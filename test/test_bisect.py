"""Every commit of the stack works on its own, on every release: at each entry
of patches/series the fork imports and the entry's own tests pass
(``tools/fork.py bisect-check``).

The checks run from this environment's interpreter with the stack's tree
first on ``sys.path`` (its torch and fbgemm serve every base). Bounded to
fit CI's budget on 2 cores (.ci/bases.txt says why):

- every release: the fork imports at every commit (a commit that changes no
  module imports as the one before it did);
- the tests of an entry run at its commit when the entry's own commit on
  that base (a fingerprint of its diff, overlay diff and files,
  tools/stack.py's entry_fingerprints) is not the one .ci/bisect-verified.json
  records as passing there: a new or changed entry is tested at its commit
  in CI;
- and, on 1.1.0 and 1.8.0, only when its commit differs from 1.9.2's (a
  variant of theirs, or an entry 1.9.2 lacks): 1.9.2's check covers the
  same change.

scripts/release_check.sh runs every entry's tests on every base (main
too, from a clone of upstream) before a release and records what passed;
an edit of an earlier entry that breaks a later one only at its commit is
found there.
"""

from pathlib import Path
from typing import List, Optional, Set

import pytest
from conftest import release_versions, REPO
from tools import forklib, stack

#: base -> the base whose check covers the commits it has in common with it
#: (None: none; run the tests of every unverified entry).
BISECT_PLAN = {"1.1.0": "1.9.2", "1.8.0": "1.9.2", "1.9.2": None}
VERIFIED: Path = REPO / stack.VERIFIED_FILE


def insert_below_entry(repo: Path, name: str, lines: List[str]) -> None:
    """Insert ``lines`` into patches/series right below the entry ``name``."""
    series = repo / "patches" / "series"
    text = series.read_text().splitlines()
    index = next(
        i for i, line in enumerate(text) if line.strip() in (name, f"#= {name}")
    )
    series.write_text("\n".join(text[: index + 1] + lines + text[index + 1 :]) + "\n")


def deselected(version: str) -> List[str]:
    """The tests .ci/bases.txt deselects on ``version`` (``!NAME`` lines of
    its section, each with its reason: a premise that base lacks)."""
    names: List[str] = []
    current = None
    for line in (REPO / ".ci" / "bases.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
        elif line.startswith("!") and current == version:
            names.append(line[1:].strip())
    return names


def entries_to_test(version: str) -> Set[str]:
    """The entries whose tests the bisect check runs on ``version`` (see the
    module's docstring)."""
    other: Optional[str] = BISECT_PLAN[version]
    with forklib.selected_base(version):
        wanted = {e.name for e in forklib.load_stack(REPO)}
        wanted -= set(stack.verified_entries(REPO, VERIFIED))
        if other is not None:
            wanted &= set(stack.entries_differing_from(REPO, other))
    return wanted


@pytest.mark.parametrize("version", sorted(BISECT_PLAN, key=forklib.version_key))
def test_every_commit_of_the_stack_works_on_its_own(version: str) -> None:
    assert set(BISECT_PLAN) == set(release_versions())
    lines: List[str] = []
    names = deselected(version)
    pytest_args = ["-k", " and ".join(f"not {n}" for n in names)] if names else []
    wanted = entries_to_test(version)
    with forklib.selected_base(version):
        results = stack.bisect_check(
            REPO,
            pytest_args=pytest_args,
            log=lines.append,
            run_tests=lambda entry: entry.name in wanted,
        )
        entries = forklib.load_stack(REPO)
    assert [r.name for r in results] == [e.name for e in entries]
    failed = [r for r in results if not r.ok]
    assert not failed, (
        "\n".join(lines)
        + "\n\n"
        + "\n\n".join(f"==== {r.name}: {r.reason}\n{r.output[-4000:]}" for r in failed)
    )
    tested = {r.name for r in results if not r.reason.startswith("imports only")}
    assert tested == wanted, "\n".join(lines)


def test_verified_entries_follow_their_own_commit(repo_copy: Path) -> None:
    """An entry's record holds while its own commit stays the same, and is
    lost when the entry changes (not when another one does)."""
    path = repo_copy / "verified.json"
    with forklib.selected_base("1.9.2"):
        entries = forklib.load_stack(repo_copy)
        results = [
            stack.BisectResult(k, e.name, [], True, "", 0.0, "")
            for k, e in enumerate(entries, start=1)
        ]
        results[0] = stack.BisectResult(
            1, entries[0].name, [], True, "imports only", 0.0, ""
        )
        recorded = stack.record_verified(repo_copy, path, results)
        assert recorded == [e.name for e in entries[1:]]
        assert stack.verified_entries(repo_copy, path) == recorded
        # an overlay file of one entry (no later entry changes it) changes:
        # that entry alone loses its record
        staged = {c.path for e in entries for c in forklib.diff_changes(e.overlay_diff)}
        entry, rel = next(
            (e, f) for e in entries[1:] for f in e.files if f not in staged
        )
        (repo_copy / rel).write_text((repo_copy / rel).read_text() + "\n# edited\n")
        verified = stack.verified_entries(repo_copy, path)
    assert set(recorded) - set(verified) == {entry.name}
    with forklib.selected_base("1.8.0"):
        assert stack.verified_entries(repo_copy, path) == []


def test_bisect_check_fails_a_commit_whose_module_needs_a_later_one(
    repo_copy: Path,
) -> None:
    """A module that imports code of a later entry breaks its commit, even when
    no test of that commit imports it (and where only imports are checked)."""
    entries = forklib.load_stack(repo_copy)
    early = next(e for e in entries if any(f.endswith("/__init__.py") for f in e.files))
    package = next(f for f in early.files if f.endswith("/__init__.py"))
    late = next(
        forklib.module_name(f)
        for e in reversed(entries)
        for f in e.files
        if f.endswith(".py") and not forklib.is_test_file(f)
    )
    assert late is not None and early is not entries[-1]
    rel = package.replace("__init__.py", "zz_bisect_probe.py")
    (repo_copy / rel).write_text(f"import {late}  # noqa: F401\n")
    insert_below_entry(repo_copy, early.name, [f"#+ {rel}"])
    for run_tests in (None, lambda entry: False):
        results = stack.bisect_check(repo_copy, only=[early.name], run_tests=run_tests)
        assert [(r.name, r.ok) for r in results] == [(early.name, False)]
        output = results[0].output
        assert "ModuleNotFoundError: No module named 'torchrec." in output, output[
            -3000:
        ]
        assert f"import {late}" in output, output[-3000:]


def test_bisect_check_fails_a_commit_without_tests(repo_copy: Path) -> None:
    entries = forklib.load_stack(repo_copy)
    package = next(f for e in entries for f in e.files if f.endswith("/__init__.py"))
    rel = package.replace("__init__.py", "zz_untested.py")
    (repo_copy / rel).write_text('"""A module without tests."""\n')
    (repo_copy / "patches" / "zz-untested.patch").write_text(
        "Subject: Add a module without tests\n\nIt has no tests, so its commit "
        "cannot show that it works.\n"
    )
    series = repo_copy / "patches" / "series"
    series.write_text(series.read_text() + f"#= zz-untested.patch\n#+ {rel}\n")
    assert forklib.stack_problems(repo_copy) == []
    (result,) = stack.bisect_check(repo_copy, only=["zz-untested.patch"])
    assert not result.ok and result.reason == "no tests of its own"


def test_bisect_check_stops_a_commit_that_hangs(
    repo_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit whose tests never end is stopped at the timeout, with every
    process it started, and reported; the check goes on."""
    entries = forklib.load_stack(repo_copy)
    staged = {c.path for e in entries for c in forklib.diff_changes(e.overlay_diff)}
    entry, test = next(
        (e, f)
        for e in entries
        for f in e.files
        if forklib.is_test_file(f) and f not in staged
    )
    (repo_copy / test).write_text(
        "import subprocess, sys, time\n\n\n"
        "def test_hangs() -> None:\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "    time.sleep(600)\n"
    )
    monkeypatch.setattr(stack, "BISECT_ENTRY_TIMEOUT_S", 20.0)
    (result,) = stack.bisect_check(repo_copy, only=[entry.name])
    assert not result.ok and result.reason == "timed out after 20 s"
    assert result.seconds < 60

"""Every commit of the stack works on its own, on every base: at each entry of
patches/series the fork imports and the entry's own tests pass
(``tools/fork.py bisect-check``).

The checks run from this environment's interpreter with the stack's tree
first on ``sys.path`` (its torch and fbgemm serve every base). Bounded to
fit CI's budget on 2 cores:

- torchrec 1.9.2, the default base, whose patches are the shared ones (and,
  through it, upstream main's): every entry's tests at its commit (so every
  in-package test runs once more, on 1.9.2, at the commit that introduces it);
- torchrec 1.8.0 and 1.1.0: the fork imports at every commit (a commit that
  changes no module imports as the one before it did), and the tests run at
  the commits whose change differs from 1.9.2's (a variant of their own, or
  an entry 1.9.2 lacks). Every other commit of theirs is the same change as
  on 1.9.2, and the installed suites (.ci/bases.txt) test where the stacks
  end. main, a target, is bisect-checked from a clone of upstream
  (tools/fork.py --base main bisect-check).
"""

from pathlib import Path
from typing import List, Optional

import pytest
from conftest import release_versions, REPO
from tools import forklib, stack

#: base -> the base whose commits its bisect check does not run again (None:
#: run every entry's tests).
BISECT_PLAN = {"1.1.0": "1.9.2", "1.8.0": "1.9.2", "1.9.2": None}


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


@pytest.mark.parametrize("version", sorted(BISECT_PLAN, key=forklib.version_key))
def test_every_commit_of_the_stack_works_on_its_own(version: str) -> None:
    assert set(BISECT_PLAN) == set(release_versions())
    other: Optional[str] = BISECT_PLAN[version]
    lines: List[str] = []
    names = deselected(version)
    pytest_args = ["-k", " and ".join(f"not {n}" for n in names)] if names else []
    with forklib.selected_base(version):
        run_tests = None
        if other is not None:
            differing = set(stack.entries_differing_from(REPO, other))
            assert differing, f"{version} has no commit of its own against {other}"
            run_tests = lambda entry: entry.name in differing  # noqa: E731
        results = stack.bisect_check(
            REPO, pytest_args=pytest_args, log=lines.append, run_tests=run_tests
        )
        entries = forklib.load_stack(REPO)
    assert [r.name for r in results] == [e.name for e in entries]
    failed = [r for r in results if not r.ok]
    assert not failed, (
        "\n".join(lines)
        + "\n\n"
        + "\n\n".join(f"==== {r.name}: {r.reason}\n{r.output[-4000:]}" for r in failed)
    )
    tested = [r for r in results if not r.reason.startswith("imports only")]
    assert tested, "\n".join(lines)
    if other is None:
        assert len(tested) == len(results)


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

"""Every commit of the stack works on its own: at each entry of patches/series
the fork imports and the entry's own tests pass (``tools/fork.py bisect-check``).

The full check runs every in-package test once more, each at the commit that
introduces it (a few minutes on 2 cores); it is part of ``.ci/run``.
"""

from pathlib import Path
from typing import List

from conftest import REPO
from tools import forklib, stack


def insert_below_entry(repo: Path, name: str, lines: List[str]) -> None:
    """Insert ``lines`` into patches/series right below the entry ``name``."""
    series = repo / "patches" / "series"
    text = series.read_text().splitlines()
    index = next(
        i for i, line in enumerate(text) if line.strip() in (name, f"#= {name}")
    )
    series.write_text("\n".join(text[: index + 1] + lines + text[index + 1 :]) + "\n")


def test_every_commit_of_the_stack_passes_its_own_tests() -> None:
    lines: List[str] = []
    results = stack.bisect_check(REPO, log=lines.append)
    assert [r.name for r in results] == [e.name for e in forklib.load_stack(REPO)]
    failed = [r for r in results if not r.ok]
    assert not failed, (
        "\n".join(lines)
        + "\n\n"
        + "\n\n".join(f"==== {r.name}: {r.reason}\n{r.output[-4000:]}" for r in failed)
    )


def test_bisect_check_fails_a_commit_whose_module_needs_a_later_one(
    repo_copy: Path,
) -> None:
    """A module that imports code of a later entry breaks its commit, even when
    no test of that commit imports it."""
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
    results = stack.bisect_check(repo_copy, only=[early.name])
    assert [(r.name, r.ok) for r in results] == [(early.name, False)]
    output = results[0].output
    assert "ModuleNotFoundError: No module named 'torchrec." in output, output[-3000:]
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

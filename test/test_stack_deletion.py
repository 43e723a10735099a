"""An entry that deletes an overlay file, on a small repository of its own:
the base wheel, three header-only entries and a few overlay files. The
third entry moves a test module into a sub-package (it introduces the new
path with a ``#+`` line; its overlay diff deletes the old one, as ``git
diff --no-renames`` writes a deletion) and deletes a module. Every consumer
of the stack sees the file before that entry and not after: the versions
of the files, the stack repository and its sizes, the export, the
materialised tree, the build and the bisect check; and the stack refuses
what it cannot express."""

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from conftest import REPO, run_fork
from tools import fork, forklib, stack

#: These tests work on the default base, whose patches are the shared ones.
pytestmark = pytest.mark.usefixtures("default_base")

PKG = "torchrec/zzfork"
OLD_TEST = f"{PKG}/tests/test_moved.py"
NEW_TEST = f"{PKG}/sub/tests/test_moved.py"
OLD_MODULE = f"{PKG}/old.py"

OLD_TEST_V1 = '''"""The first version of the test the third entry moves."""


def test_one() -> None:
    assert 1 + 1 == 2
'''
OLD_TEST_V2 = OLD_TEST_V1 + """

def test_two() -> None:
    assert 2 + 2 == 4
"""
# At its commit the old test module and the deleted module are gone.
NEW_TEST_TEXT = '''"""The moved test: the tree at its commit lacks the old path."""

import importlib.util
from pathlib import Path


def test_one() -> None:
    assert 1 + 1 == 2


def test_two() -> None:
    assert 2 + 2 == 4


def test_the_old_paths_are_gone() -> None:
    package = Path(__file__).resolve().parents[2]
    assert not (package / "tests" / "test_moved.py").exists()
    assert importlib.util.find_spec("torchrec.zzfork.old") is None
'''
OLD_MODULE_TEXT = '"""A module the third entry deletes."""\n\nANSWER = 42\n'


def git_diff(before: Dict[str, str], after: Dict[str, Optional[str]]) -> str:
    """The ``git diff --no-renames`` of files from ``before`` to ``after``
    (None: deleted), as ``git diff HEAD -- torchrec/`` writes it."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        forklib.git(["init", "-q"], root)
        for rel, text in before.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        forklib.git(["add", "-A"], root)
        for rel, text in after.items():
            if text is None:
                (root / rel).unlink()
            else:
                (root / rel).write_text(text)
        args = ["diff", "--no-color", "--no-renames", "--src-prefix=a/"]
        return forklib.git(args + ["--dst-prefix=b/"], root).stdout


def header(subject: str) -> str:
    """A header-only patch file."""
    return f"Subject: {subject}\n\nWhy: a synthetic entry of the deletion tests.\n"


@pytest.fixture
def small_repo(tmp_path: Path) -> Path:
    """The repository: the tools and base.json of this one, its own series
    and overlay."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("setup.py", "pyproject.toml", "base.json", "version.txt"):
        shutil.copy2(REPO / name, repo / name)
    shutil.copytree(
        REPO / "tools", repo / "tools", ignore=shutil.ignore_patterns("__pycache__")
    )
    files = {
        f"{PKG}/__init__.py": '"""A package of the deletion tests."""\n',
        f"{PKG}/tests/__init__.py": "",
        f"{PKG}/sub/__init__.py": "",
        f"{PKG}/sub/tests/__init__.py": "",
        NEW_TEST: NEW_TEST_TEXT,
    }
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    patches = repo / "patches"
    patches.mkdir()
    (patches / "one.patch").write_text(header("zzfork: a package, a module, a test"))
    (patches / "two.patch").write_text(header("zzfork: a second test"))
    (patches / "three.patch").write_text(header("zzfork: the test in sub/tests"))
    (patches / "two.overlay.diff").write_text(
        git_diff({OLD_TEST: OLD_TEST_V1}, {OLD_TEST: OLD_TEST_V2})
    )
    (patches / "three.overlay.diff").write_text(
        git_diff(
            {OLD_TEST: OLD_TEST_V2, OLD_MODULE: OLD_MODULE_TEXT},
            {OLD_TEST: None, OLD_MODULE: None},
        )
    )
    (patches / "series").write_text(
        "#= one.patch\n"
        f"#+ {PKG}/__init__.py\n"
        f"#+ {OLD_MODULE}\n"
        f"#+ {PKG}/tests/__init__.py\n"
        f"#+ {OLD_TEST}\n"
        "\n#= two.patch\n"
        "\n#= three.patch\n"
        f"#+ {PKG}/sub/__init__.py\n"
        f"#+ {PKG}/sub/tests/__init__.py\n"
        f"#+ {NEW_TEST}\n"
    )
    return repo


def append_entry(repo: Path, name: str, lines: List[str], diff: str = "") -> None:
    """Add a header-only entry at the end of the series."""
    (repo / "patches" / name).write_text(header(f"zzfork: {name}"))
    if diff:
        forklib.overlay_diff_path(repo, name).write_text(diff)
    series = repo / "patches" / "series"
    series.write_text(series.read_text() + f"\n#= {name}\n" + "".join(lines))


def test_the_file_is_there_until_the_entry_that_deletes_it(small_repo: Path) -> None:
    entries = forklib.load_stack(small_repo)
    assert forklib.stack_problems(small_repo, entries) == []
    assert [e.overlay_deletions for e in entries] == [
        (),
        (),
        (OLD_MODULE, OLD_TEST),
    ]
    assert forklib.overlay_deletions(small_repo, entries) == {
        OLD_MODULE: 2,
        OLD_TEST: 2,
    }
    one, two, three = forklib.stack_file_versions(small_repo, entries)
    assert one[OLD_TEST] == OLD_TEST_V1.encode()
    assert one[OLD_MODULE] == OLD_MODULE_TEXT.encode()
    assert two == {OLD_TEST: OLD_TEST_V2.encode()}
    assert OLD_TEST not in three and OLD_MODULE not in three
    assert three[NEW_TEST] == NEW_TEST_TEXT.encode()
    # the entry's tests are the moved ones, not the deleted
    assert stack.entry_tests(three) == [NEW_TEST]


def tree_at(tree: Path, commit: str) -> Dict[str, bytes]:
    """The package's files at a commit of a git repository."""
    names = forklib.git(
        ["ls-tree", "-r", "--name-only", commit, "--", PKG], tree
    ).stdout.split()
    return {
        rel: subprocess.run(
            ["git", "show", f"{commit}:{rel}"], cwd=tree, capture_output=True
        ).stdout
        for rel in names
    }


def test_the_stack_commit_deletes_it_and_counts_its_lines(
    small_repo: Path, tmp_path: Path
) -> None:
    tree = tmp_path / "stack"
    commits = stack.build_stack_repo(tree, small_repo)
    before, after = tree_at(tree, commits[1].sha), tree_at(tree, commits[2].sha)
    assert before[OLD_TEST] == OLD_TEST_V2.encode() and OLD_MODULE in before
    assert OLD_TEST not in after and OLD_MODULE not in after
    assert NEW_TEST not in before and after[NEW_TEST] == NEW_TEST_TEXT.encode()
    # a deletion counts as the diff shows it: every line removed
    sizes = {path: (added, removed) for path, added, removed in commits[2].files}
    assert sizes[OLD_TEST] == (0, len(OLD_TEST_V2.splitlines()))
    assert sizes[OLD_MODULE] == (0, len(OLD_MODULE_TEXT.splitlines()))
    assert sizes[NEW_TEST] == (len(NEW_TEST_TEXT.splitlines()), 0)
    assert commits[2].changed_lines == sum(a + r for a, r in sizes.values())
    assert f"{commits[2].changed_lines:5d}" in stack.stack_table(commits)
    # read back, the history gives the same overlay diffs
    diffs = sorted((small_repo / "patches").glob("*" + forklib.OVERLAY_DIFF_SUFFIX))
    saved = {path: path.read_text() for path in diffs}
    for path in diffs:
        path.unlink()
    written = stack.refresh_overlay_diffs(tree, small_repo)
    assert {path: path.read_text() for path in written} == saved
    # the overlay diffs apply: absorb has nothing to do
    assert stack.absorb_overlay_changes(small_repo) == []


def test_the_export_deletes_it_and_applies(small_repo: Path, tmp_path: Path) -> None:
    export = stack.export_stack(small_repo, tmp_path / "out")
    third = export.patches[2].read_text()
    assert f"diff --git a/{OLD_TEST} b/{OLD_TEST}\ndeleted file mode" in third
    assert f" delete mode 100644 {OLD_TEST}" in third
    assert NEW_TEST in export.cover_letter.read_text()
    assert OLD_TEST not in export.cover_letter.read_text()
    upstream = tmp_path / "upstream"
    forklib.extract_base(small_repo, upstream)
    forklib.git(["init", "-q"], upstream)
    forklib.commit_all(upstream, "upstream")
    proc = forklib.git(
        ["am", "--empty=drop", "-q", *map(str, export.files)], upstream, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    materialized = tmp_path / "tree"
    fork.materialize_tree(materialized, small_repo)
    mine = {
        rel.as_posix(): (materialized / rel).read_bytes()
        for rel in forklib.iter_tree_files(materialized)
        if rel.as_posix().startswith(PKG)
    }
    assert tree_at(upstream, "HEAD") == mine
    assert OLD_TEST not in mine and NEW_TEST in mine


def test_the_build_and_the_materialised_tree_lack_it(
    small_repo: Path, tmp_path: Path
) -> None:
    built = forklib.build_source_tree(tmp_path / "built", small_repo)
    assert (built / NEW_TEST).is_file()
    assert not (built / OLD_TEST).exists() and not (built / OLD_MODULE).exists()
    # a tree materialised while the overlay had the file loses its link
    tree = tmp_path / "tree"
    (small_repo / OLD_TEST).write_text(OLD_TEST_V2)
    fork.materialize_tree(tree, small_repo)
    assert (tree / OLD_TEST).is_symlink()
    (small_repo / OLD_TEST).unlink()
    fork.sync_overlay(small_repo, tree)
    assert not (tree / OLD_TEST).is_symlink() and (tree / NEW_TEST).is_symlink()
    assert forklib.git(["status", "--porcelain"], tree).stdout == ""


def test_bisect_check_runs_each_entry_on_its_own_tree(small_repo: Path) -> None:
    """At the third commit the old test module and the deleted module are gone
    (the moved test checks it, and the check imports only the modules
    present); before, the old test runs where it was."""
    results = stack.bisect_check(small_repo)
    assert [(r.name, r.ok, r.reason) for r in results] == [
        ("one.patch", True, ""),
        ("two.patch", True, ""),
        ("three.patch", True, ""),
    ], "\n".join(r.output[-3000:] for r in results)
    assert [r.tests for r in results] == [[OLD_TEST], [OLD_TEST], [NEW_TEST]]
    assert "3 passed" in results[2].output
    # the recorded fingerprint of an entry follows its deletion's content,
    # and so does the one of the entry that introduces the file
    prints = stack.entry_fingerprints(small_repo)
    diff = forklib.overlay_diff_path(small_repo, "three.patch")
    diff.write_text(
        git_diff(
            {OLD_TEST: OLD_TEST_V2, OLD_MODULE: OLD_MODULE_TEXT + "\n"},
            {OLD_TEST: None, OLD_MODULE: None},
        )
    )
    changed = stack.entry_fingerprints(small_repo)
    assert [n for n in prints if prints[n] != changed[n]] == [
        "one.patch",
        "three.patch",
    ]


def test_a_later_entry_may_not_touch_a_deleted_file(small_repo: Path) -> None:
    append_entry(
        small_repo,
        "four.patch",
        [],
        git_diff({OLD_TEST: OLD_TEST_V2}, {OLD_TEST: OLD_TEST_V2 + "# more\n"}),
    )
    problems = forklib.stack_problems(small_repo)
    assert problems == [
        f"patches/four.overlay.diff: changes {OLD_TEST}, which three.patch "
        f"deletes: no later entry may touch a deleted overlay file"
    ]
    proc = run_fork(small_repo, "stack")
    assert proc.returncode == 1 and "which three.patch deletes" in proc.stderr


def test_a_deleted_file_cannot_come_back(small_repo: Path) -> None:
    append_entry(small_repo, "four.patch", [f"#+ {OLD_TEST}\n"])
    (small_repo / OLD_TEST).write_text(OLD_TEST_V1)
    problems = "\n".join(forklib.stack_problems(small_repo))
    assert (
        f"four.patch: '#+ {OLD_TEST}' introduces a file that three.patch "
        f"deletes: a deleted overlay file cannot come back" in problems
    )
    assert f"{OLD_TEST} is introduced twice: by one.patch and four.patch" in problems


def test_the_overlay_must_lack_a_deleted_file(small_repo: Path) -> None:
    (small_repo / OLD_TEST).write_text(OLD_TEST_V2)
    assert forklib.stack_problems(small_repo) == [
        f"{OLD_TEST}: three.patch deletes it, but the overlay still has the "
        f"file: remove it from torchrec/ (the overlay is the state after the "
        f"last entry)"
    ]


def test_only_a_file_an_earlier_entry_introduces_can_be_deleted(
    small_repo: Path,
) -> None:
    # a file of upstream's (the wheel's): a patch deletes those
    rel = "torchrec/distributed/utils.py"
    text = forklib.base_files(small_repo)[rel].decode()
    append_entry(small_repo, "four.patch", [], git_diff({rel: text}, {rel: None}))
    assert forklib.stack_problems(small_repo) == [
        f"patches/four.overlay.diff: deletes {rel}, which no earlier entry of "
        f"patches/series introduces (an upstream file is deleted by a patch, or "
        f"by a '#- PATH' line where the wheel lacks it)"
    ]
    # nor one the entry itself introduces
    series = small_repo / "patches" / "series"
    series.write_text(series.read_text() + f"#+ {PKG}/extra.py\n")
    extra = f"{PKG}/extra.py"
    (small_repo / "patches" / "four.overlay.diff").write_text(
        git_diff({extra: "X = 1\n"}, {extra: None})
    )
    assert forklib.stack_problems(small_repo) == [
        f"patches/four.overlay.diff: deletes {extra}, which no earlier entry of "
        f"patches/series introduces (an upstream file is deleted by a patch, or "
        f"by a '#- PATH' line where the wheel lacks it)"
    ]


def test_a_deletion_whose_content_is_not_the_files_is_refused(
    small_repo: Path,
) -> None:
    """The deletion keeps the file's last content: it must be the content the
    earlier entries give the file."""
    (small_repo / "patches" / "three.overlay.diff").write_text(
        git_diff(
            {OLD_TEST: OLD_TEST_V1, OLD_MODULE: OLD_MODULE_TEXT},
            {OLD_TEST: None, OLD_MODULE: None},
        )
    )
    problems = forklib.stack_problems(small_repo)
    assert len(problems) == 1, problems
    assert "patches/two.overlay.diff does not apply in reverse" in problems[0]

"""The stack mapping in patches/series: every overlay file in exactly one
entry, header-only entries marked as such, overlay diffs that apply, and the
round trip through a stack repository."""

import re
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest
from conftest import release_versions, REPO, run_fork
from tools import forklib, stack

#: These tests work on the default base, whose patches are the shared ones.
pytestmark = pytest.mark.usefixtures("default_base")


def add_to_series(repo: Path, after: str, lines: List[str]) -> None:
    """Insert ``lines`` into patches/series right after the line ``after``."""
    series = repo / "patches" / "series"
    text = series.read_text().splitlines()
    index = text.index(after)
    series.write_text("\n".join(text[: index + 1] + lines + text[index + 1 :]) + "\n")


def test_every_overlay_file_is_in_exactly_one_entry() -> None:
    """Every overlay file is listed once, and every listed file is in the
    overlay unless a later entry deletes it."""
    entries = forklib.load_stack(REPO)
    assert forklib.stack_problems(REPO, entries) == []
    listed = [rel for e in entries for rel in e.files]
    deleted = [rel for e in entries for rel in e.overlay_deletions]
    overlay = [rel.as_posix() for rel in forklib.overlay_files(REPO)]
    assert sorted(set(listed) - set(deleted)) == sorted(overlay)
    assert set(deleted) <= set(listed)
    assert len(set(listed)) == len(listed)


def test_every_entry_has_a_message_and_tests_with_its_code() -> None:
    versions = forklib.stack_file_versions(REPO)
    for entry, writes in zip(forklib.load_stack(REPO), versions):
        assert entry.patch.subject and entry.patch.body, entry.name
        assert stack.entry_tests(
            writes, entry.patch.diff
        ), f"{entry.name} has no tests of its own"


def test_overlay_diffs_rebuild_the_overlay() -> None:
    """The last version of every file is the overlay's; a file an overlay diff
    changes had another version before; a file one deletes is gone after."""
    entries = forklib.load_stack(REPO)
    versions = forklib.stack_file_versions(REPO, entries)
    seen = {}
    for entry, writes in zip(entries, versions):
        for change in forklib.diff_changes(entry.overlay_diff):
            assert change.path in seen, (entry.name, change.path)
            if change.new_path is None:
                assert change.path not in writes, (entry.name, change.path)
            else:
                assert writes[change.path] != seen[change.path], (
                    entry.name,
                    change.path,
                )
        seen.update(writes)
        for rel in entry.overlay_deletions:
            del seen[rel]
    assert seen == {
        rel.as_posix(): (REPO / rel).read_bytes() for rel in forklib.overlay_files(REPO)
    }


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
@pytest.mark.parametrize("version", release_versions())
def test_plain_patches_in_order_build_the_fork(version: str, tmp_path: Path) -> None:
    """Without the tools: a base's patches (the file each entry reads there)
    applied in order with GNU patch to the extracted wheel, plus the overlay,
    are the fork the build makes."""
    with forklib.selected_base(version):
        tree = tmp_path / "tree"
        forklib.extract_upstream(forklib.fetch_base_wheel(REPO), tree)
        for patch in forklib.load_series(REPO):
            proc = subprocess.run(
                [
                    "patch",
                    "-p1",
                    "--batch",
                    "--fuzz=0",
                    "--no-backup-if-mismatch",
                    "--forward",
                    "-i",
                    str(REPO / patch.source),
                ],
                cwd=tree,
                capture_output=True,
                text=True,
            )
            assert proc.returncode == 0, patch.source + proc.stdout + proc.stderr
        forklib.copy_overlay(REPO, tree)
        built = forklib.build_source_tree(tmp_path / "built", REPO)
    files = {p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file()}
    assert files == {
        p.relative_to(built).as_posix() for p in built.rglob("*") if p.is_file()
    }
    for rel in files:
        assert (tree / rel).read_bytes() == (built / rel).read_bytes(), rel


def test_parse_series_grammar() -> None:
    entries = forklib.parse_series_text(
        "# comment\n"
        "a.patch -p1\n"
        "#+ torchrec/x.py\n"
        "\n"
        "# section\n"
        "#= b.patch\n"
        "#+ torchrec/y.py\n"
        "#+ torchrec/tests/test_y.py\n"
        "c.patch  # trailing comment\n"
        "#- torchrec/tests/test_upstream.py\n"
    )
    assert [(e.name, e.header_only, e.files) for e in entries] == [
        ("a.patch", False, ("torchrec/x.py",)),
        ("b.patch", True, ("torchrec/y.py", "torchrec/tests/test_y.py")),
        ("c.patch", False, ()),
    ]
    assert [e.deletes for e in entries] == [
        (),
        (),
        ("torchrec/tests/test_upstream.py",),
    ]
    with pytest.raises(forklib.ForkError, match="before any patch"):
        forklib.parse_series_text("#+ torchrec/x.py\na.patch\n")
    with pytest.raises(forklib.ForkError, match="before any patch"):
        forklib.parse_series_text("#- torchrec/x.py\na.patch\n")
    with pytest.raises(forklib.ForkError, match="listed twice"):
        forklib.parse_series_text("a.patch\n#= a.patch\n")


def test_unlisted_overlay_file_is_reported(repo_copy: Path) -> None:
    rel = "torchrec/distributed/resharding/zz_new_module.py"
    (repo_copy / rel).write_text('"""A new module."""\n')
    problems = forklib.stack_problems(repo_copy)
    assert len(problems) == 1 and rel in problems[0], problems
    proc = run_fork(repo_copy, "check")
    assert proc.returncode == 1 and rel in proc.stderr, proc.stderr


def test_tool_caches_are_not_overlay_files(repo_copy: Path) -> None:
    """Caches that linters and test runners leave under torchrec/ are never
    overlay files: not listed, not reported, not installed."""
    package = repo_copy / "torchrec" / "distributed" / "resharding"
    for cache in (".ruff_cache", ".mypy_cache", ".pytest_cache", ".hypothesis"):
        (package / cache / "sub").mkdir(parents=True)
        (package / cache / "sub" / "data.py").write_text("# cache\n")
    overlay = [rel.as_posix() for rel in forklib.overlay_files(repo_copy)]
    assert not any("_cache" in rel or ".hypothesis" in rel for rel in overlay)
    assert forklib.stack_problems(repo_copy) == []


def test_overlay_file_listed_twice_or_missing_is_reported(repo_copy: Path) -> None:
    entries = forklib.load_stack(repo_copy)
    rel = next(e for e in reversed(entries) if e.files).files[0]
    add_to_series(
        repo_copy,
        entries[0].name,
        [f"#+ {rel}", "#+ torchrec/distributed/no_such_file.py"],
    )
    problems = "\n".join(forklib.stack_problems(repo_copy))
    assert f"{rel} is introduced twice" in problems
    assert "no_such_file.py" in problems


def test_header_only_and_plain_lines_must_match_the_patch(repo_copy: Path) -> None:
    series = repo_copy / "patches" / "series"
    entries = forklib.load_stack(repo_copy)
    plain = next(e for e in entries if not e.header_only and e.patch.diff.strip())
    header_only = next(e for e in entries if e.header_only)
    text = series.read_text()
    text = text.replace(f"\n{plain.name}\n", f"\n#= {plain.name}\n", 1)
    text = text.replace(f"#= {header_only.name}", header_only.name, 1)
    series.write_text(text)
    problems = "\n".join(forklib.stack_problems(repo_copy))
    assert f"{plain.name}: has a diff to upstream files" in problems
    assert f"{header_only.name}: has no diff on any base" in problems
    # a plain entry without a diff on this base is fine where a base's
    # variant has one (the compat entries: a fix on 1.1.0, tests on 1.9.2)
    compat = next(e for e in entries if not e.header_only and not e.patch.diff)
    assert compat.name.startswith("compat-") and compat.name not in problems


def test_a_subject_too_long_for_a_mail_is_reported(repo_copy: Path) -> None:
    """Exported commits are mails: check refuses a subject over 100
    characters before an export would carry it."""
    entry = forklib.load_stack(repo_copy)[-1]
    path = repo_copy / "patches" / entry.name
    subject = "resharding: " + "x" * 89
    text = path.read_text().replace(entry.patch.subject, subject, 1)
    path.write_text(text)
    problems = "\n".join(forklib.stack_problems(repo_copy))
    assert f"{entry.name}: its subject has 101 characters" in problems
    path.write_text(text.replace(subject, subject[:-1], 1))
    assert forklib.stack_problems(repo_copy) == []


def test_overlay_diff_that_no_longer_applies_is_reported(repo_copy: Path) -> None:
    # The last entry whose overlay diff changes a file (deletions aside): no
    # later diff changes its files, so the final file's lines are that
    # diff's post-image.
    entry = [
        e
        for e in forklib.load_stack(repo_copy)
        if any(c.new_path for c in forklib.diff_changes(e.overlay_diff))
    ][-1]
    section = next(
        part
        for part in re.split(r"^(?=diff --git )", entry.overlay_diff, flags=re.M)
        if part and forklib.diff_changes(part)[0].new_path is not None
    )
    target = forklib.diff_changes(section)[0].path
    # an edit of the final file right where the diff has its context
    path = repo_copy / target
    lines = path.read_text().splitlines(keepends=True)
    hunk = next(line for line in section.splitlines() if line.startswith("@@"))
    start = int(hunk.split("+", 1)[1].split(",", 1)[0].split(" ", 1)[0])
    lines[start - 1] = "# an edit the overlay diff does not know\n"
    path.write_text("".join(lines))
    problems = forklib.stack_problems(repo_copy)
    name = forklib.overlay_diff_path(repo_copy, entry.name).name
    assert any(name in p and "does not apply" in p for p in problems), problems


def test_absorb_folds_an_edit_into_the_last_overlay_diff(repo_copy: Path) -> None:
    """An edit of a file that breaks its overlay diffs goes into the last
    entry that changes the file; the file's earlier versions stay."""
    forklib.git(["init", "-q"], repo_copy)
    forklib.commit_all(repo_copy, "the fork")
    entries = forklib.load_stack(repo_copy)
    before = forklib.stack_file_versions(repo_copy, entries)
    entry = next(e for e in entries if e.overlay_diff)
    target = forklib.diff_changes(entry.overlay_diff)[0].path
    last = max(
        i
        for i, e in enumerate(entries)
        if any(c.path == target for c in forklib.diff_changes(e.overlay_diff))
    )
    path = repo_copy / target
    hunk = next(
        line for line in entry.overlay_diff.splitlines() if line.startswith("@@")
    )
    start = int(hunk.split("+", 1)[1].split(",", 1)[0].split(" ", 1)[0])
    lines = path.read_text().splitlines(keepends=True)
    lines[start - 1] = "# an edit the overlay diffs do not know\n"
    path.write_text("".join(lines))
    assert forklib.stack_problems(repo_copy)

    proc = run_fork(repo_copy, "absorb")
    assert proc.returncode == 0, proc.stderr
    assert forklib.stack_problems(repo_copy) == []
    after = forklib.stack_file_versions(repo_copy)
    assert after[last][target] == path.read_bytes()
    for i in range(last):
        assert after[i] == before[i], entries[i].name
    assert run_fork(repo_copy, "absorb").stdout.strip() == "every overlay diff applies"


def test_overlay_diff_without_an_entry_is_reported(repo_copy: Path) -> None:
    (repo_copy / "patches" / "gone.overlay.diff").write_text("")
    problems = forklib.stack_problems(repo_copy)
    assert problems == [
        "patches/gone.overlay.diff belongs to no entry of patches/series"
    ]


def test_stack_tree_round_trip_rewrites_the_overlay_diffs(
    repo_copy: Path, tmp_path: Path
) -> None:
    """refresh-stack reads a stack repository back into overlay diffs: from the
    stack's own tree it gives back the files it was built from."""
    tree = tmp_path / "stack"
    proc = run_fork(repo_copy, "stack-tree", str(tree))
    assert proc.returncode == 0, proc.stderr
    diffs = sorted((repo_copy / "patches").glob("*" + forklib.OVERLAY_DIFF_SUFFIX))
    assert diffs, "no entry has an overlay diff"
    before = {p.name: p.read_text() for p in diffs}
    for path in diffs:
        path.unlink()
    written = stack.refresh_overlay_diffs(tree, repo_copy)
    assert sorted(p.name for p in written) == sorted(before)
    assert {p.name: p.read_text() for p in written} == before
    assert stack.refresh_overlay_diffs(tree, repo_copy) == []
    # a history that ends elsewhere than the overlay is refused
    entries = forklib.load_stack(repo_copy)
    rel = next(e for e in reversed(entries) if e.files).files[0]
    (repo_copy / rel).write_text((repo_copy / rel).read_text() + "# edited\n")
    with pytest.raises(forklib.ForkError, match=rel):
        stack.refresh_overlay_diffs(tree, repo_copy)


def test_stack_command_reports_sizes() -> None:
    proc = run_fork(REPO, "stack")
    assert proc.returncode in (0, 1), proc.stderr
    for entry in forklib.load_stack(REPO):
        assert entry.name in proc.stdout
    assert (proc.returncode == 1) == ("changed lines >" in proc.stderr)


@pytest.mark.parametrize(
    "command",
    ["export", "stack", "stack-tree", "refresh-stack", "absorb", "bisect-check"],
)
def test_stack_subcommands_have_help(command: str) -> None:
    proc = run_fork(REPO, command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout

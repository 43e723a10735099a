"""The exported stack: ``git am`` on upstream's git tree at the base's tag
reproduces the fork, and every commit is a reviewable change. Every test runs
on each base of base.json: the 1.1.0 stack against upstream's tag v1.1.0, the
1.8.0 stack against upstream's release/v1.8.0, the main stack against
upstream's main at 376cac6a (tools/upstream-*-tree.txt lists the three
trees), and the 1.9.2 stack against the tree of its wheel (no git tree of
1.9.2 is at hand).

The layout of upstream's tree is the base's files plus an empty placeholder
for every other file of the list. For main, the base's files are main's own,
read from a clone of upstream ($TORCHREC_FORK_UPSTREAM_GIT) when there is
one; without it (CI) they are the stand-in's, the 1.9.2 wheel's (see
tools/forklib.py's is_stand_in): the export then checks the blob ids main's
variants carry, and test_main_export_applies_to_upstreams_main, which needs
the clone, skips."""

import os
import re
import subprocess
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest
from conftest import REPO
from tools import fork, forklib, stack

#: Pre-image id git writes for a file a patch creates.
NO_BLOB = "0" * 40
#: The blob id of an empty file (an upstream_layout placeholder).
EMPTY_BLOB = forklib.git_blob_id(b"")
BASES = [base.version for base in forklib.load_bases(REPO)]


@pytest.fixture(scope="module", autouse=True, params=BASES)
def base(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test of this module runs once per base: $TORCHREC_FORK_BASE
    selects it for the tools while the base's tests run."""
    saved = os.environ.get(forklib.BASE_ENV)
    os.environ[forklib.BASE_ENV] = request.param
    try:
        yield request.param
    finally:
        if saved is None:
            os.environ.pop(forklib.BASE_ENV, None)
        else:
            os.environ[forklib.BASE_ENV] = saved


def upstream_deletions() -> Set[str]:
    """The files of upstream's tree the wheel lacks that the stack deletes
    (``#-`` lines of the series)."""
    return {rel for entry in forklib.load_stack(REPO) for rel in entry.deletes}


def snapshot(tree: Path) -> Dict[str, bytes]:
    """Relative path -> content of every file of a tree (symlinks followed)."""
    return {
        rel.as_posix(): (tree / rel).read_bytes()
        for rel in forklib.iter_tree_files(tree)
    }


def upstream_layout(dest: Path) -> Set[str]:
    """
    A git repository with the layout of upstream's git tree at the base's tag:
    the base wheel's files plus an empty placeholder for every file of
    upstream's tree (tools/upstream-v*-tree.txt) the wheel lacks. Returns the
    placeholders.
    """
    upstream = forklib.load_upstream_tree(REPO)
    forklib.extract_base(REPO, dest)
    placeholders: Set[str] = set()
    for rel in upstream.blobs:
        path = dest / rel
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")
            placeholders.add(rel)
    forklib.git(["init", "-q"], dest)
    forklib.commit_all(dest, f"upstream {upstream.tag} layout (wheel + placeholders)")
    forklib.git(["tag", forklib.UPSTREAM_TAG], dest)
    return placeholders


def mail_message(path: Path) -> Tuple[str, str]:
    """Subject (without its ``[PATCH n/m]`` prefix) and body of an exported patch."""
    text = path.read_text()
    header, _, rest = text.partition("\n\n")
    match = re.search(r"^Subject: (.*(?:\n .*)*)", header, flags=re.MULTILINE)
    assert match is not None, f"{path.name}: no Subject header"
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", " ".join(match.group(1).split()))
    body = rest.split("\n---\n", 1)[0].strip()
    return subject, body


@pytest.fixture(scope="module")
def exported(
    base: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[stack.Export]:
    """The base's stack, exported once for the module's tests (main's
    stand-in's where upstream's files of main are not at hand)."""
    yield stack.export_stack(
        REPO, tmp_path_factory.mktemp(f"export-{base}"), stand_in=True
    )


def test_export_writes_a_cover_letter_and_one_patch_per_entry(
    exported: stack.Export,
) -> None:
    entries = forklib.load_stack(REPO)
    assert exported.cover_letter is not None
    assert exported.cover_letter.name == "0000-cover-letter.patch"
    assert len(exported.patches) == len(entries) == len(exported.commits)
    assert [f.name[:5] for f in exported.patches] == [
        f"{i:04d}-" for i in range(1, len(entries) + 1)
    ]
    for path, entry in zip(exported.patches, entries):
        assert mail_message(path) == (entry.patch.subject, entry.patch.body)


def test_export_preimages_are_upstreams_blobs(exported: stack.Export) -> None:
    """Every file the export modifies has upstream's blob as pre-image (and so
    do the wheel's copies the build patches); every file it creates is new to
    upstream's tree. Checked through the full blob ids of the index lines."""
    upstream = forklib.load_upstream_tree(REPO)
    wheel = forklib.base_files(REPO)
    lacking = upstream_deletions()
    current = dict(upstream.blobs)
    # main's stand-in has the 1.9.2 wheel's files, some of which main has
    # with other content: the export changes those from the wheel's blobs,
    # and the patch files main reads carry main's (checked here too)
    stand_in = set()
    if forklib.is_stand_in(REPO):
        stand_in = {
            rel
            for rel, data in wheel.items()
            if rel in upstream.blobs
            and forklib.git_blob_id(data) != upstream.blobs[rel]
        }
        current.update({rel: forklib.git_blob_id(wheel[rel]) for rel in stand_in})
        assert forklib.target_blob_problems(REPO, upstream) == []
    created: List[str] = []
    deleted: List[str] = []
    for path in exported.patches:
        for change in forklib.diff_changes(path.read_text()):
            where = f"{path.name}: {change.path}"
            assert change.old_blob and change.new_blob, f"{where}: no full index"
            if change.old_path is None:
                assert change.path not in current, f"{where}: exists upstream"
                assert change.old_blob == NO_BLOB, where
                created.append(change.path)
            else:
                assert change.old_path in current, f"{where}: not in upstream's tree"
                assert change.old_blob == current[change.old_path], where
                if change.old_path in stand_in:
                    pass  # main's own blob: target_blob_problems above
                elif change.old_path not in created and change.old_path not in lacking:
                    assert change.old_path in wheel, where
                    assert forklib.git_blob_id(wheel[change.old_path]) == (
                        upstream.blobs[change.old_path]
                    ), f"{where}: the wheel's copy is not upstream's"
            if change.new_path is None:
                del current[change.old_path or ""]
                deleted.append(change.old_path or "")
            else:
                current[change.new_path] = change.new_blob
    assert created, "the export creates no file"
    # Files upstream already has are never created, even when the build needs
    # them from the overlay (the wheel lacks them), unless the export deleted
    # upstream's file first (the overlay's replaces it).
    for rel in (r.as_posix() for r in forklib.overlay_files(REPO)):
        if rel in upstream.blobs and rel not in deleted:
            assert rel not in created, rel
    # what base.json says the overlay replaces is deleted upstream, then created
    for rel in forklib.load_base(REPO).replaces:
        assert rel in lacking and rel in deleted and rel in created, rel
        assert deleted.index(rel) <= created.index(rel), rel


def test_export_applies_with_git_am_and_reproduces_the_fork(
    exported: stack.Export, tmp_path: Path
) -> None:
    upstream = tmp_path / "upstream"
    placeholders = upstream_layout(upstream)
    # A file of upstream's tree the wheel lacks is an empty placeholder here,
    # so the deletion of one (by the blob id of upstream's tree, which git am
    # checks) is pointed at the placeholder's blob instead.
    blobs = forklib.load_upstream_tree(REPO).blobs
    mails = tmp_path / "mails"
    mails.mkdir()
    files = []
    for path in exported.files:
        text = path.read_text()
        for rel in upstream_deletions():
            line = f"index {blobs[rel]}..{NO_BLOB}\n"
            section = f"diff --git a/{rel} b/{rel}\ndeleted file mode "
            if section in text:
                assert line in text, f"{path.name}: {rel}"
                text = text.replace(line, f"index {EMPTY_BLOB}..{NO_BLOB}\n")
        files.append(mails / path.name)
        files[-1].write_text(text)
    proc = forklib.git(
        ["am", "--empty=drop", "-q", *map(str, files)], upstream, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = forklib.git(
        ["log", "--reverse", "--format=%B%x00", f"{forklib.UPSTREAM_TAG}..HEAD"],
        upstream,
    )
    messages = [m.strip() for m in log.stdout.split("\0") if m.strip()]
    assert messages == [e.patch.message.strip() for e in forklib.load_stack(REPO)]

    materialized = tmp_path / "tree"
    fork.materialize_tree(materialized, REPO)
    applied = snapshot(upstream)
    fork_files = snapshot(materialized)
    only_placeholders = {
        rel for rel in applied if rel in placeholders and rel not in fork_files
    }
    assert {k: v for k, v in applied.items() if k not in only_placeholders} == (
        fork_files
    )
    for rel in only_placeholders:
        assert applied[rel] == b"", f"{rel}: a placeholder the export changed"
    # the files the stack deletes upstream are gone, or the overlay's
    for rel in upstream_deletions():
        assert applied.get(rel) == fork_files.get(rel), rel


def test_no_exported_commit_is_over_the_limit(exported: stack.Export) -> None:
    sizes = []
    for path, commit in zip(exported.patches, exported.commits):
        changes = forklib.diff_changes(path.read_text())
        lines = sum(c.added + c.removed for c in changes)
        assert lines == commit.changed_lines, path.name
        sizes.append(lines)
    too_big = stack.oversized(exported.commits)
    assert not too_big, (
        f"commits over {stack.MAX_CHANGED_LINES} changed lines (split the files "
        f"named, or stage one with a later entry's overlay diff; see "
        f"CONTRIBUTING.md):\n" + "\n".join(too_big)
    )
    assert all(0 < n <= stack.MAX_CHANGED_LINES for n in sizes)


def test_every_exported_commit_says_what_and_why(exported: stack.Export) -> None:
    for path in exported.patches:
        subject, body = mail_message(path)
        assert subject, f"{path.name}: no subject"
        assert len(subject) <= 100, f"{path.name}: subject longer than 100 chars"
        assert len(body.split()) >= 20, f"{path.name}: the body says too little"


def test_cover_letter_summarises_the_stack(exported: stack.Export) -> None:
    assert exported.cover_letter is not None
    text = exported.cover_letter.read_text()
    assert "*** SUBJECT HERE ***" not in text and "*** BLURB HERE ***" not in text
    subject, blurb = mail_message(exported.cover_letter)
    assert subject and len(blurb.split()) > 100
    upstream = forklib.load_upstream_tree(REPO)
    if upstream.commit:
        assert f"base-commit: {upstream.commit}" in text
    else:
        assert "base-commit:" not in text and "no git tree of" in blurb
    assert "git am --empty=drop" in text
    for name in ("plan", "exchange", "install"):
        assert f"- {name} (" in blurb, name
    for entry in forklib.load_stack(REPO):
        assert entry.patch.subject in blurb, entry.name
    # the benchmark table, extracted from the results the repo keeps
    table = stack.benchmark_summary(REPO).splitlines()
    assert any("a2a_fresh" in line for line in table), table
    for line in table:
        assert line.rstrip() in text, line
    # the test modules of the final tree are named; one a later commit
    # deletes (or moves) is not
    present: Dict[str, bool] = {}
    for path in exported.patches:
        for change in forklib.diff_changes(path.read_text()):
            present[change.path] = change.new_path is not None
    for test, there in present.items():
        if forklib.is_test_file(test):
            assert (test in blurb) == there, test


def test_export_refuses_an_overlay_file_that_differs_from_upstreams(
    repo_copy: Path, tmp_path: Path
) -> None:
    """An overlay file at a path upstream's tree has must be upstream's file."""
    upstream = forklib.load_upstream_tree(repo_copy)
    rel = "torchrec/distributed/test_utils/__init__.py"
    assert rel in upstream.blobs and not (repo_copy / rel).exists()
    (repo_copy / rel).write_text("# not upstream's\n")
    series = forklib.series_dir(repo_copy) / "series"
    first = forklib.read_series(repo_copy)[0]
    series.write_text(series.read_text().replace(first, f"{first}\n#+ {rel}", 1))
    with pytest.raises(stack.StackError, match=re.escape(rel)):
        stack.export_stack(repo_copy, tmp_path / "out", stand_in=True)


def test_materialized_tree_history(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    commits = fork.materialize_tree(tree, REPO)
    names = forklib.read_series(REPO)
    assert len(commits) == len(names)
    for name, commit in zip(names, commits):
        message = forklib.git(["log", "-1", "--format=%B", commit], tree).stdout
        assert message.strip() == forklib.load_patch(REPO, name).message.strip()
    # the overlay is present (linked to the repo), but not part of the history;
    # a file the base's tree has already (main's tests/__init__.py) is the same
    base_files = forklib.base_files(REPO)
    for rel in forklib.overlay_files(REPO):
        if base_files.get(rel.as_posix()) == (REPO / rel).read_bytes():
            assert not (tree / rel).is_symlink(), rel
        else:
            assert (tree / rel).resolve() == (REPO / rel).resolve()
    status = forklib.git(["status", "--porcelain"], tree).stdout
    assert status == ""
    first = forklib.git(["rev-list", "--max-parents=0", "HEAD"], tree).stdout.strip()
    assert (
        first == forklib.git(["rev-parse", forklib.UPSTREAM_TAG], tree).stdout.strip()
    )


def test_main_export_applies_to_upstreams_main(base: str, tmp_path: Path) -> None:
    """With a clone of upstream at hand ($TORCHREC_FORK_UPSTREAM_GIT): the
    main export, made from main's own files, applies with one ``git am`` to
    upstream's main at the listed commit, and the result is the fork
    materialised on main. Without one (CI) it skips."""
    if base != "main":
        pytest.skip("upstream's own tree at a commit: the main target only")
    git_dir = forklib.upstream_git_dir()
    if git_dir is None:
        pytest.skip(
            f"{forklib.UPSTREAM_GIT_ENV} is unset: no clone of upstream with "
            f"main's commit to apply the export to"
        )
    commit = forklib.load_upstream_tree(REPO).commit
    export = stack.export_stack(REPO, tmp_path / "export")
    clone = tmp_path / "main"
    subprocess.run(
        ["git", "clone", "-q", "--shared", "--no-checkout", str(git_dir), str(clone)],
        check=True,
    )
    forklib.git(["checkout", "-q", "-b", "live-resharding", commit], clone)
    proc = forklib.git(
        ["am", "--empty=drop", "-q", *map(str, export.files)], clone, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = forklib.git(["rev-list", "--count", f"{commit}..HEAD"], clone).stdout
    assert int(log) == len(forklib.load_stack(REPO))
    tree = tmp_path / "tree"
    fork.materialize_tree(tree, REPO)
    files = forklib.git(["ls-files", forklib.PACKAGE], clone).stdout.split()
    assert {rel: (clone / rel).read_bytes() for rel in files} == snapshot(tree)

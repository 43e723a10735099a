"""The fork as a stack of upstream commits: build it, export it, bisect-check it.

``patches/series`` is the one mapping (see :func:`tools.forklib.parse_series`):
each entry is one commit made of its patch file (message and diff to upstream
files), the overlay files it introduces and its changes to overlay files
introduced earlier. From it this module

* builds the stack as a git repository on top of upstream (:func:`build_stack_repo`);
* exports it as a ``git format-patch`` series with a cover letter
  (:func:`export_stack`) that applies with ``git am`` to upstream's git tree at
  the base's tag;
* checks that every commit of the stack works on its own: the fork at that
  commit imports and the commit's own tests pass (:func:`bisect_check`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import selectors
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools import forklib as fl  # noqa: E402

#: No commit of the exported stack may change more lines than this.
MAX_CHANGED_LINES: int = 1200
#: Results of the repository's benchmark, quoted in the cover letter.
BENCHMARK_RESULTS: str = "benchmarks/results/reshard_benchmark.json"
#: Seconds one entry's tests may take in the bisect check.
BISECT_ENTRY_TIMEOUT_S: float = 1200.0


class StackError(fl.ForkError):
    """The stack mapping is inconsistent or does not apply upstream."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems: List[str] = list(problems)
        super().__init__(
            "the stack in patches/series is not sound:\n  - "
            + "\n  - ".join(self.problems)
        )


@dataclasses.dataclass(frozen=True)
class StackCommit:
    """
    One commit of the built stack.

    Args:
        entry (fl.StackEntry): the entry it was made from.
        sha (str): the commit in the stack repository.
        files (List[Tuple[str, int, int]]): (path, added, removed) per file.
    """

    entry: fl.StackEntry
    sha: str
    files: List[Tuple[str, int, int]]

    @property
    def changed_lines(self) -> int:
        """Lines added plus lines removed."""
        return sum(added + removed for _, added, removed in self.files)

    @property
    def file_count(self) -> int:
        """Files the commit changes, upstream's it deletes (``#-``) included."""
        return len(self.files) + len(self.entry.deletes)


@dataclasses.dataclass(frozen=True)
class Export:
    """
    An exported stack.

    Args:
        cover_letter (Optional[Path]): ``0000-cover-letter.patch``, if written.
        patches (List[Path]): ``0001-*.patch`` ..., one per commit, in order.
        commits (List[StackCommit]): the commits they were made from.
    """

    cover_letter: Optional[Path]
    patches: List[Path]
    commits: List[StackCommit]

    @property
    def files(self) -> List[Path]:
        """Every file written, in ``git am`` order (cover letter first)."""
        return ([self.cover_letter] if self.cover_letter else []) + self.patches


# --------------------------------------------------------------------------- build


def export_identity(repo: Path) -> Dict[str, str]:
    """
    Author and committer of the exported commits: the repository's git
    identity (``user.name``, ``user.email``) when it has one, else the tools'
    one; dated like the repository's HEAD commit (so an export is reproducible).
    """
    identity = dict(fl.GIT_IDENTITY)

    def config(key: str) -> str:
        proc = fl.git(["config", "--get", key], repo, check=False)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    name, email = config("user.name"), config("user.email")
    if name and email:
        for role in ("AUTHOR", "COMMITTER"):
            identity[f"GIT_{role}_NAME"] = name
            identity[f"GIT_{role}_EMAIL"] = email
    head = fl.git(["log", "-1", "--format=%cI"], repo, check=False)
    if head.returncode == 0 and head.stdout.strip():
        for role in ("AUTHOR", "COMMITTER"):
            identity[f"GIT_{role}_DATE"] = head.stdout.strip()
    return identity


def parse_author(text: str) -> Dict[str, str]:
    """``"Name <email>"`` as git's author and committer environment."""
    match = re.fullmatch(r"\s*(.+?)\s*<([^<>]+)>\s*", text)
    if match is None:
        raise fl.ForkError(f"--author must look like 'Name <email>', got {text!r}")
    env: Dict[str, str] = {}
    for role in ("AUTHOR", "COMMITTER"):
        env[f"GIT_{role}_NAME"] = match.group(1)
        env[f"GIT_{role}_EMAIL"] = match.group(2)
    return env


def checked_stack(
    repo: Path,
) -> Tuple[List[fl.StackEntry], fl.UpstreamTree, Dict[str, bytes]]:
    """
    The stack, upstream's tree and the wheel's files, after checking that the
    mapping is sound and that the stack applies to upstream's tree.

    Raises:
        StackError: listing every problem found.
    """
    stack = fl.load_stack(repo)
    problems = fl.stack_problems(repo, stack)
    upstream = fl.load_upstream_tree(repo)
    wheel = fl.base_files(repo)
    problems += fl.upstream_problems(
        repo, stack, upstream, wheel, fl.load_base(repo).replaces
    )
    problems += fl.target_blob_problems(repo, upstream)
    if problems:
        raise StackError(problems)
    return stack, upstream, wheel


def _commit(tree: Path, message: str, identity: Dict[str, str]) -> str:
    fl.git(["add", "-A"], tree)
    if not fl.git(["status", "--porcelain"], tree).stdout.strip():
        raise fl.ForkError(
            f"the commit '{message.splitlines()[0]}' would change nothing in "
            f"upstream's tree"
        )
    fl.git(["commit", "-q", "-F", "-"], tree, input=message, extra_env=identity)
    return fl.git(["rev-parse", "HEAD"], tree).stdout.strip()


def _numstat(tree: Path, sha: str) -> List[Tuple[str, int, int]]:
    out = fl.git(["show", "--numstat", "--format=", "--no-renames", sha], tree).stdout
    files: List[Tuple[str, int, int]] = []
    for line in out.splitlines():
        if not line.strip():
            continue
        added, removed, path = line.split("\t", 2)
        if added == "-":
            raise fl.ForkError(f"{path}: binary files cannot be exported as text")
        files.append((path, int(added), int(removed)))
    return files


def build_stack_repo(
    tree: Path, repo: Path = fl.REPO_ROOT, identity: Optional[Dict[str, str]] = None
) -> List[StackCommit]:
    """
    Create ``tree`` as a git repository: a first commit (tag ``upstream``)
    with the base wheel's files plus the overlay files upstream's git tree
    already has (identical; the wheel lacks them), then one commit per stack
    entry: its upstream diff, the overlay files it introduces and its changes
    to earlier ones, with the patch's subject and body as message. Files of
    upstream's tree the wheel lacks are not in it, so the deletions of
    ``#-`` lines are not either: :func:`export_stack` adds them.

    Args:
        tree (Path): where to create the repository (must not exist).
        repo (Path): the fork repository.
        identity (Optional[Dict[str, str]]): git author/committer environment
            of the stack's commits (default: the tools' identity).

    Returns:
        List[StackCommit]: the commits, in order.

    Raises:
        StackError: when the mapping is not sound or does not apply upstream.
    """
    stack, upstream, _ = checked_stack(repo)
    versions = fl.stack_file_versions(repo, stack)
    base = fl.load_base(repo)
    tree.mkdir(parents=True)
    fl.git(["init", "-q"], tree)
    fl.extract_base(repo, tree)
    # Overlay files upstream's tree has and the wheel lacks stand for
    # upstream's identical files (the check verified it); an upstream file the
    # wheel has stays upstream's (a patch of the stack deletes it), and one the
    # base declares replaced ('replaces') is left to the entry that adds it.
    restored = sorted(
        rel
        for entry in stack
        for rel in entry.files
        if rel in upstream.blobs
        and not (tree / rel).exists()
        and rel not in base.replaces
    )
    for rel in restored:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / rel, tree / rel)
    listing = "".join(f"\n- {rel}" for rel in restored)
    where = f"{upstream.tag}, {upstream.commit}" if upstream.commit else upstream.tag
    fl.commit_all(
        tree,
        f"{base.name} {base.version}: upstream ({where})\n\nThe files of "
        f"{fl.describe_base(repo)}, plus the files of upstream's git tree the "
        f"fork needs and those lack:{listing or ' none'}\n",
    )
    fl.git(["tag", fl.UPSTREAM_TAG], tree)
    commits: List[StackCommit] = []
    for entry, writes in zip(stack, versions):
        fl.apply_patch(tree, entry.patch)
        write_overlay_state(tree, writes, entry.overlay_deletions)
        sha = _commit(tree, entry.patch.message, identity or dict(fl.GIT_IDENTITY))
        commits.append(StackCommit(entry, sha, _numstat(tree, sha)))
    return commits


def write_overlay_state(
    tree: Path, writes: Mapping[str, bytes], deletions: Sequence[str]
) -> None:
    """
    Bring a tree's overlay files to their state at one entry: write the
    files it introduces or changes and delete those it deletes.

    Args:
        tree (Path): the tree.
        writes (Mapping[str, bytes]): the entry's files, path -> content (see
            :func:`tools.forklib.stack_file_versions`).
        deletions (Sequence[str]): the overlay files it deletes
            (:attr:`tools.forklib.StackEntry.overlay_deletions`).
    """
    for rel, data in writes.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    for rel in deletions:
        (tree / rel).unlink()


def _diff(tree: Path, sha: str, paths: Sequence[str]) -> str:
    if not paths:
        return ""
    args = ["diff", "--no-color", "--no-ext-diff", "--no-renames"]
    args += ["--src-prefix=a/", "--dst-prefix=b/", f"{sha}^", sha, "--", *paths]
    return fl.git(args, tree).stdout


def refresh_overlay_diffs(tree: Path, repo: Path = fl.REPO_ROOT) -> List[Path]:
    """
    Read back a stack repository (made by :func:`build_stack_repo`, its history
    then edited with git: say, an early commit introducing a smaller version of
    a file and a later one completing it) and rewrite every entry's
    ``patches/NAME.overlay.diff`` from it: the commit's changes to overlay files
    introduced by earlier entries. The commits must still match the entries
    one to one, introduce the files the mapping says, change upstream files
    exactly as the patch files do, and end with the repository's overlay files.

    Args:
        tree (Path): the stack repository.
        repo (Path): the fork repository.

    Returns:
        List[Path]: the overlay-diff files written or removed.

    Raises:
        fl.ForkError: when the history does not match the mapping.
    """
    stack = fl.load_stack(repo)
    commits = fl.entry_commits(tree, len(stack))
    overlay = {rel for entry in stack for rel in entry.files}
    earlier: List[str] = []
    pending: Dict[Path, str] = {}
    for entry, sha in zip(stack, commits):
        out = fl.git(
            ["diff", "--name-status", "--no-renames", f"{sha}^", sha], tree
        ).stdout
        changed: Dict[str, str] = {}
        for line in out.splitlines():
            status, _, rel = line.partition("\t")
            changed[rel] = status
        # Upstream files the patch changes, at an overlay file's path too (a
        # base's series may delete an upstream file whose place an overlay file
        # takes, in this commit or a later one).
        patched = {c.path: c for c in fl.diff_changes(entry.patch.diff)}
        replaced = {
            rel: patched[rel]
            for rel in entry.files
            if rel in patched and patched[rel].new_path is None
        }
        upstream_paths = sorted(
            p
            for p in changed
            if (p not in overlay or p in patched) and p not in replaced
        )
        expected = entry.patch.diff
        if replaced:
            sections = _sections(expected)
            expected = "".join(sections[p] for p in sections if p not in replaced)
        # Compared as check compares: blob ids and hunk positions differ
        # between the bases that read one shared patch file.
        actual = _diff(tree, sha, upstream_paths)
        if fl.normalized_diff(actual) != fl.normalized_diff(expected) or any(
            not _has_blob(tree, f"{sha}^", rel, change.old_blob or "")
            for rel, change in replaced.items()
        ):
            raise fl.ForkError(
                f"commit {sha[:12]} ({entry.name}) changes upstream files unlike "
                f"patches/{entry.name}; change those with materialize and refresh"
            )
        for rel in entry.files:
            if changed.get(rel, "A") != ("M" if rel in replaced else "A"):
                raise fl.ForkError(
                    f"commit {sha[:12]} ({entry.name}) must add {rel}, not change it"
                )
        stray = [
            p
            for p in changed
            if p in overlay
            and p not in entry.files
            and p not in earlier
            and p not in patched
        ]
        if stray:
            raise fl.ForkError(
                f"commit {sha[:12]} ({entry.name}) touches {', '.join(stray)}, "
                f"which a later entry introduces or an earlier one deleted"
            )
        diff = _diff(tree, sha, sorted(p for p in changed if p in earlier))
        pending[fl.overlay_diff_path(repo, entry.name)] = diff
        earlier += [rel for rel in entry.files if rel not in earlier]
        earlier = [rel for rel in earlier if changed.get(rel) != "D"]
    head = commits[-1] if commits else fl.UPSTREAM_TAG
    for rel in sorted(overlay):
        shown = subprocess.run(
            ["git", "show", f"{head}:{rel}"], cwd=tree, capture_output=True
        )
        final = (repo / rel).read_bytes() if (repo / rel).is_file() else None
        if (shown.stdout if shown.returncode == 0 else None) != final:
            raise fl.ForkError(
                f"{rel} at the top of {tree} differs from the repository's file "
                f"(or only one of them has it): the overlay holds the final "
                f"state of every file"
            )
    written: List[Path] = []
    for path, diff in pending.items():
        if diff and (not path.exists() or path.read_text() != diff):
            path.write_text(diff)
            written.append(path)
        elif not diff and path.exists():
            path.unlink()
            written.append(path)
    return written


def _has_blob(tree: Path, rev: str, rel: str, blob: str) -> bool:
    """Whether ``rel`` at ``rev`` is the blob ``blob`` (an abbreviated id)."""
    proc = fl.git(["rev-parse", f"{rev}:{rel}"], tree, check=False)
    return bool(blob) and proc.returncode == 0 and proc.stdout.strip().startswith(blob)


def _file_diff(rel: str, before: bytes, after: bytes) -> str:
    """``git diff`` of one file between two contents, as the overlay diffs
    keep it (``a/``, ``b/`` prefixes)."""
    with tempfile.TemporaryDirectory(prefix="torchrec-fork-diff-") as tmp:
        root = Path(tmp)
        fl.git(["init", "-q"], root)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(before)
        fl.git(["add", "-A"], root)
        (root / rel).write_bytes(after)
        args = ["diff", "--no-color", "--no-ext-diff", "--no-renames"]
        return fl.git(args + ["--src-prefix=a/", "--dst-prefix=b/"], root).stdout


def _sections(diff: str) -> Dict[str, str]:
    """A diff's ``diff --git`` sections, by file."""
    parts = re.split(r"^(?=diff --git )", diff, flags=re.MULTILINE)
    out: Dict[str, str] = {}
    for part in parts:
        changes = fl.diff_changes(part)
        if changes:
            out[changes[0].path] = part
    return out


def absorb_overlay_changes(repo: Path = fl.REPO_ROOT, depth: int = 200) -> List[Path]:
    """
    After overlay files changed, rewrite the overlay diffs that no longer
    apply: a change to a file goes into the last entry whose overlay diff
    changes that file, and the file's earlier versions stay as they were.
    The file's previous final version is found in the repository's git
    history (the newest one, among the last ``depth`` commits that touched
    the file, on which the overlay diffs apply); so commit overlay diffs
    together with the files they fit.

    Args:
        repo (Path): the fork repository (a git checkout).
        depth (int): how many commits of each file's history to try.

    Returns:
        List[Path]: the overlay-diff files rewritten.

    Raises:
        fl.ForkError: when no earlier version of a file fits its overlay diffs.
    """
    stack = fl.load_stack(repo)
    chains: Dict[str, List[int]] = {}
    for k, entry in enumerate(stack):
        for change in fl.diff_changes(entry.overlay_diff):
            chains.setdefault(change.path, []).append(k)
    # A deleted file has no final version to absorb: its deletion in an
    # overlay diff holds its last content (edit that diff instead).
    for entry in stack:
        for rel in entry.overlay_deletions:
            chains.pop(rel, None)
    rewritten: Dict[int, Dict[str, str]] = {}
    for rel, ks in sorted(chains.items()):
        final = (repo / rel).read_bytes()
        diffs = [_sections(stack[k].overlay_diff)[rel] for k in ks]

        def undo(content: bytes, diffs: Sequence[str] = diffs) -> bytes:
            for diff in reversed(diffs):
                content = fl._apply_to_files(
                    {rel: content}, diff, reverse=True, what=rel
                )[rel]
            return content

        try:
            undo(final)
            continue  # the diffs still apply
        except fl.ForkError:
            pass
        log = fl.git(
            ["log", f"-{depth}", "--format=%H", "--", rel], repo, check=False
        ).stdout.split()
        before_last: Optional[bytes] = None
        for sha in log:
            shown = subprocess.run(
                ["git", "show", f"{sha}:{rel}"], cwd=repo, capture_output=True
            )
            if shown.returncode != 0:
                continue
            try:
                undo(shown.stdout)
            except fl.ForkError:
                continue
            before_last = undo(shown.stdout, diffs[-1:])
            break
        if before_last is None:
            raise fl.ForkError(
                f"{rel}: no version in the last {depth} commits that touched it "
                f"fits the overlay diffs; rebuild them with stack-tree and "
                f"refresh-stack"
            )
        rewritten.setdefault(ks[-1], {})[rel] = _file_diff(rel, before_last, final)
    written: List[Path] = []
    for k, new_sections in sorted(rewritten.items()):
        entry = stack[k]
        sections = _sections(entry.overlay_diff)
        sections.update(new_sections)
        text = "".join(sections[rel] for rel in sorted(sections) if sections[rel])
        path = fl.overlay_diff_path(repo, entry.name)
        path.write_text(text)
        written.append(path)
    return written


# --------------------------------------------------------------------------- export


def benchmark_summary(repo: Path) -> str:
    """The latest benchmark table of the repository (its results JSON), as
    plain text: the machine, the command, the table."""
    path = repo / BENCHMARK_RESULTS
    if not path.is_file():
        return f"(no benchmark results in {BENCHMARK_RESULTS})"
    data = json.loads(path.read_text())
    lines = textwrap.wrap(str(data.get("header", "")).strip(), width=72)
    argv = data.get("argv")
    if argv:
        lines.append("command: python " + " ".join(str(a) for a in argv))
    lines.append("")
    lines += [
        line.rstrip() for line in str(data.get("table", "")).strip("\n").split("\n")
    ]
    return "\n".join(lines).strip("\n")


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line.strip() else "" for line in text.split("\n"))


def for_base(template: str, version: str) -> str:
    """
    The lines of ``template`` that are for torchrec ``version``: a line
    ``#if VERSION ...`` keeps what follows, up to ``#else`` or ``#endif``,
    only on those bases, and ``#else`` keeps what follows up to ``#endif``
    on the others (no nesting). One template so serves every base, its
    differences side by side.

    Raises:
        fl.ForkError: on an ``#else`` or ``#endif`` without ``#if``, or an
            ``#if`` never closed.
    """
    kept: List[str] = []
    state: Optional[bool] = None  # None: outside #if; else: keep the lines?
    for number, line in enumerate(template.split("\n"), start=1):
        words = line.split()
        if words[:1] == ["#if"]:
            if state is not None:
                raise fl.ForkError(f"cover letter:{number}: #if inside #if")
            state = version in words[1:]
        elif words == ["#else"] or words == ["#endif"]:
            if state is None:
                raise fl.ForkError(f"cover letter:{number}: {words[0]} without #if")
            state = (not state) if words == ["#else"] else None
        elif state is None or state:
            kept.append(line)
    if state is not None:
        raise fl.ForkError("cover letter: an #if is never closed")
    return "\n".join(kept)


def cover_letter_text(
    repo: Path, commits: Sequence[StackCommit], upstream: fl.UpstreamTree
) -> Tuple[str, str]:
    """
    The cover letter's subject and blurb, from ``patches/cover-letter.txt``
    (one template for every base, see :func:`for_base`; first line: the
    subject; the rest: the blurb, where ``$stack``, ``$benchmark``,
    ``$tests``, ``$base_version``, ``$base_tag``, ``$base_commit``,
    ``$base_wheel``, ``$applies_to``, ``$checkout`` and ``$max_lines`` are
    filled in).
    """
    base = fl.load_base(repo)
    path = fl.series_dir(repo) / fl.COVER_LETTER
    if path.is_file():
        text = for_base(path.read_text(), base.version)
        subject, _, blurb = text.partition("\n")
    else:
        subject, blurb = "Live resharding of sharded embedding modules", "$stack\n"
    total = len(commits)
    width = len(str(total))
    stack = "\n".join(
        f"  {i:0{width}d}/{total} {c.entry.patch.subject} "
        f"({c.file_count} file{'s' if c.file_count != 1 else ''}, "
        f"{c.changed_lines} lines)"
        for i, c in enumerate(commits, start=1)
    )
    deleted = {rel for c in commits for rel in c.entry.overlay_deletions}
    tests = sorted(
        {
            path
            for c in commits
            for path, _, _ in c.files
            if fl.is_test_file(path)
            and (path not in upstream.blobs or path in base.replaces)
            and path not in deleted
        }
    )
    if upstream.commit:
        applies_to = f"upstream's {upstream.tag} (commit {upstream.commit})"
        checkout = (
            f"    git checkout -b live-resharding {upstream.commit}   "
            f"# {upstream.tag}"
        )
    else:
        applies_to = (
            f"the tree of upstream's {base.wheel} (no git tree of {base.version} "
            f"was at hand to check it against: on upstream's tree, files the "
            f"wheel lacks may need the same changes)"
        )
        checkout = (
            f"    # a git repository of upstream's tree at {base.version}, or of "
            f"its wheel's files"
        )
    text = string.Template(blurb.strip("\n")).substitute(
        stack=stack,
        upstream_changes=upstream_changes(commits, upstream),
        base_ref=upstream.commit[:12] if upstream.commit else "BASE",
        tests=" \\\n".join(["    pytest"] + [f"        {t}" for t in tests]),
        benchmark=_indent(benchmark_summary(repo)),
        base_version=base.version,
        base_tag=upstream.tag,
        base_commit=upstream.commit,
        base_wheel=base.wheel,
        applies_to=applies_to,
        checkout=checkout,
        max_lines=MAX_CHANGED_LINES,
    )
    return string.Template(subject.strip()).substitute(base_version=base.version), text


def upstream_changes(commits: Sequence[StackCommit], upstream: fl.UpstreamTree) -> str:
    """
    The stack's changes to files upstream's tree has (the hooks), one line
    per file: lines added and removed, and the commits that change it (by
    their number in the stack); for the cover letter.
    """
    per_file: Dict[str, List[int]] = {}
    numbers: Dict[str, List[int]] = {}
    # upstream's files the stack deletes by blob id ('#-') and replaces
    replaced = {rel for commit in commits for rel in commit.entry.deletes}
    for i, commit in enumerate(commits, start=1):
        for path, added, removed in commit.files:
            if path not in upstream.blobs or path in replaced:
                continue
            lines = per_file.setdefault(path, [0, 0])
            lines[0] += added
            lines[1] += removed
            numbers.setdefault(path, []).append(i)
    width = len(str(len(commits)))
    rows = [
        f"    {path} (+{added} -{removed}; "
        f"{', '.join(f'{n:0{width}d}' for n in numbers[path])})"
        for path, (added, removed) in sorted(per_file.items())
    ]
    return "\n".join(rows) or "    (none)"


def export_stack(
    repo: Path,
    out: Path,
    *,
    cover_letter: bool = True,
    identity: Optional[Dict[str, str]] = None,
    stand_in: bool = False,
) -> Export:
    """
    Write the stack as a numbered ``git format-patch`` series into ``out``
    (old ``*.patch`` files there are removed): ``0000-cover-letter.patch``,
    then one patch per stack entry. ``git am`` applies it to upstream's git
    tree at the base's tag (cover letter included with ``--empty=drop``).

    Args:
        repo (Path): the fork repository.
        out (Path): the output directory.
        cover_letter (bool): also write the cover letter.
        identity (Optional[Dict[str, str]]): author and committer (default:
            :func:`export_identity`).
        stand_in (bool): on a target without its files at hand (see
            :func:`tools.forklib.is_stand_in`), export the stand-in's stack
            (the release's files and diffs where the target's differ: for
            checks, never to send) instead of refusing.

    Returns:
        Export: the files written and the commits.

    Raises:
        fl.ForkError: on a stand-in, unless ``stand_in``.
    """
    if not stand_in:
        fl.require_own_files(repo, "export")
    identity = identity or export_identity(repo)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.patch"):
        old.unlink()
    upstream = fl.load_upstream_tree(repo)
    with tempfile.TemporaryDirectory(prefix="torchrec-fork-export-") as tmp:
        tree = Path(tmp) / "tree"
        commits = build_stack_repo(tree, repo, identity)
        args = ["format-patch", "-q", "--numbered", "--zero-commit"]
        args += ["--no-signature", "--full-index", "--no-renames", "-o", str(out)]
        if cover_letter:
            args.append("--cover-letter")
        fl.git(args + [f"{fl.UPSTREAM_TAG}..HEAD"], tree, extra_env=identity)
    files = sorted(out.glob("*.patch"))
    letter = out / "0000-cover-letter.patch" if cover_letter else None
    numbered = [f for f in files if f != letter]
    for path, commit in zip(numbered, commits):
        if commit.entry.deletes:
            path.write_text(
                add_upstream_deletions(path.read_text(), commit.entry.deletes, upstream)
            )
    if letter is not None:
        subject, blurb = cover_letter_text(repo, commits, upstream)
        text = letter.read_text()
        text = text.replace("*** SUBJECT HERE ***", subject, 1)
        text = text.replace("*** BLURB HERE ***", blurb, 1)
        text = text.rstrip("\n") + "\n"
        if upstream.commit:
            text += f"\nbase-commit: {upstream.commit}\n"
        letter.write_text(text)
    patches = [f for f in files if f != letter]
    return Export(letter, patches, commits)


#: The ``GIT binary patch`` of an empty post-image (``literal 0``).
_EMPTY_BINARY_HUNK: str = "literal 0\nHcmV?d00001\n\n"


def upstream_deletion(rel: str, upstream: fl.UpstreamTree) -> str:
    """
    A ``diff --git`` section that deletes ``rel`` from upstream's git tree
    without knowing its content: a binary patch to an empty file, whose full
    ``index`` line names upstream's blob. ``git apply`` (and so ``git am``)
    checks that the file it deletes has exactly that blob id.
    """
    return (
        f"diff --git a/{rel} b/{rel}\n"
        f"deleted file mode {upstream.modes.get(rel, '100644')}\n"
        f"index {upstream.blobs[rel]}..{'0' * 40}\n"
        f"GIT binary patch\n{_EMPTY_BINARY_HUNK}"
    )


def _stat_name(rel: str, width: int) -> str:
    """``rel`` as ``git diff --stat`` shows it in a column ``width`` wide:
    whole, or its tail after a ``/`` behind ``...``."""
    if len(rel) <= width:
        return rel.ljust(width)
    tail = rel[len(rel) - width + 3 :]
    if "/" in tail:
        tail = tail[tail.index("/") :]
    return ("..." + tail).ljust(width)


def add_upstream_deletions(
    mail: str, deletes: Sequence[str], upstream: fl.UpstreamTree
) -> str:
    """
    Add to a ``git format-patch`` mail the deletion of upstream files that
    the stack repository never had (the wheel lacks them; ``#-`` lines of
    the series): a section per file (see :func:`upstream_deletion`) in git's
    path order (before a section that creates the same path), and a line per
    file in the diffstat and its summary.
    """
    message, sep, body = mail.partition("\n---\n")
    stat, sep2, diff = body.partition("\ndiff --git ")
    if not sep or not sep2:
        raise fl.ForkError("not a git format-patch mail with a diff")
    parts = re.split(r"^(?=diff --git )", "diff --git " + diff, flags=re.MULTILINE)
    parts = [part if part.endswith("\n") else part + "\n" for part in parts if part]
    stat_lines = stat.split("\n")
    rows = [i for i, line in enumerate(stat_lines) if " | " in line]
    if not rows or len(rows) != len(parts):
        raise fl.ForkError("the diffstat does not list one line per file")
    width = stat_lines[rows[0]].index(" | ") - 1
    # (path, section, its diffstat line), in git's order
    sections = [
        (fl.diff_changes(part)[0].path, part, stat_lines[row])
        for part, row in zip(parts, rows)
    ]
    for rel in sorted(deletes):
        at = next((k for k, s in enumerate(sections) if s[0] >= rel), len(sections))
        line = f" {_stat_name(rel, width)} | Bin"
        sections.insert(at, (rel, upstream_deletion(rel, upstream), line))
    first, last = rows[0], rows[-1]
    head = stat_lines[:first] + [section[2] for section in sections]
    tail = stat_lines[last + 1 :]
    for k, line in enumerate(tail):
        match = re.match(r" (\d+) files? changed", line)
        if match:
            count = int(match.group(1)) + len(deletes)
            tail[k] = re.sub(
                r"^ \d+ files? changed",
                f" {count} file{'s' if count != 1 else ''} changed",
                line,
            )
            modes = [
                k + 1 + j
                for j, mode in enumerate(tail[k + 1 :])
                if re.match(r" (create|delete) mode ", mode)
            ]
            new_modes = [
                f" delete mode {upstream.modes.get(rel, '100644')} {rel}"
                for rel in deletes
            ]
            old_modes = [tail[j] for j in modes]
            merged = sorted(  # by path; a deletion before a creation of it
                old_modes + new_modes,
                key=lambda m: (m.split(" ", 4)[-1], m.split()[0] != "delete"),
            )
            at = modes[0] if modes else k + 1
            tail[at : at + len(modes)] = merged
            break
    text = "".join(section[1] for section in sections)
    return message + "\n---\n" + "\n".join(head + tail) + "\n" + text


def oversized(
    commits: Sequence[StackCommit], limit: int = MAX_CHANGED_LINES
) -> List[str]:
    """One message per commit over ``limit`` changed lines, naming its biggest
    files (the candidates to split, or to stage with an overlay diff)."""
    messages: List[str] = []
    for i, commit in enumerate(commits, start=1):
        if commit.changed_lines <= limit:
            continue
        biggest = sorted(commit.files, key=lambda f: -(f[1] + f[2]))[:4]
        files = ", ".join(
            f"{path} ({added + removed})" for path, added, removed in biggest
        )
        messages.append(
            f"{i:02d} {commit.entry.name}: {commit.changed_lines} changed lines "
            f"> {limit}; biggest files: {files}"
        )
    return messages


def stack_table(commits: Sequence[StackCommit]) -> str:
    """A table of the stack: number, entry, files, lines, subject."""
    rows = [f"{'#':>2}  {'lines':>5}  {'files':>5}  entry: subject"]
    for i, commit in enumerate(commits, start=1):
        flag = "  << over the limit" if commit.changed_lines > MAX_CHANGED_LINES else ""
        rows.append(
            f"{i:02d}  {commit.changed_lines:5d}  {commit.file_count:5d}  "
            f"{commit.entry.name}: {commit.entry.patch.subject}{flag}"
        )
    return "\n".join(rows)


# --------------------------------------------------------------------------- bisect


@dataclasses.dataclass(frozen=True)
class BisectResult:
    """
    The check of one commit of the stack.

    Args:
        index (int): 1-based position in the stack.
        name (str): the entry's patch file.
        tests (List[str]): the entry's own test files.
        ok (bool): the fork at this commit imports and the tests pass.
        reason (str): why not, when not ok.
        seconds (float): wall time of the check.
        output (str): output of the test run.
    """

    index: int
    name: str
    tests: List[str]
    ok: bool
    reason: str
    seconds: float
    output: str


# Runs in a process forked from the zygote below, with the prefix tree first
# on sys.path: imports every module of the fork present at this commit, then
# the commit's tests (cfg["pytest"]; None: imports only).
_BISECT_RUNNER: str = """
import importlib, os, sys
sys.path.insert(0, cfg["tree"])
import torchrec
where = os.path.realpath(torchrec.__file__)
if not where.startswith(os.path.realpath(cfg["tree"]) + os.sep):
    sys.exit("torchrec imports from %s, not from the stack's tree" % where)
for name in cfg["modules"]:
    importlib.import_module(name)
if cfg["pytest"] is None:
    sys.exit(0)
import pytest
sys.exit(pytest.main(cfg["pytest"]))
"""

# A process that imports the heavy dependencies once (torch, fbgemm, pytest:
# never torchrec, whose tree changes between commits) and forks one child per
# commit, each in its own session and with its output in a file: every commit
# is checked in a fresh process without paying for those imports again.
_BISECT_ZYGOTE: str = """
import json, os, sys, traceback
for name in ("torch", "torch.distributed", "fbgemm_gpu", "numpy", "pytest"):
    try:
        __import__(name)
    except Exception:
        pass
RUNNER = sys.argv[1]
for line in sys.stdin:
    cfg = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            fd = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            os.chdir(cfg["cwd"])
            os.environ.update(cfg["env"])
            try:
                exec(RUNNER, {"__name__": "__main__", "cfg": cfg})
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class _Zygote:
    """The bisect check's process forker (see ``_BISECT_ZYGOTE``)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen = subprocess.Popen(
            [sys.executable, "-c", _BISECT_ZYGOTE, _BISECT_RUNNER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def run(
        self, config: Dict[str, object], timeout: float
    ) -> Tuple[Optional[int], str]:
        """
        Run the runner in a forked child with ``config`` (``cwd``, ``env``,
        ``log`` and the runner's own keys).

        Returns:
            Tuple[Optional[int], str]: the exit status (None: killed after
            ``timeout`` seconds) and the output.
        """
        stdin, stdout = self._proc.stdin, self._proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(config) + "\n")
        stdin.flush()
        pid = json.loads(self._readline(stdout, 60.0))["pid"]
        try:
            line = self._readline(stdout, timeout)
            code: Optional[int] = json.loads(line)["code"]
        except TimeoutError:
            _kill_group(pid)
            self._readline(stdout, 60.0)
            code = None
        except BaseException:
            _kill_group(pid)
            raise
        log = Path(str(config["log"]))
        return code, log.read_text(errors="replace") if log.exists() else ""

    def _readline(self, stream: object, timeout: float) -> str:
        with selectors.DefaultSelector() as selector:
            selector.register(stream, selectors.EVENT_READ)  # pyre-ignore[6]
            if not selector.select(timeout):
                raise TimeoutError
        line = stream.readline()  # pyre-ignore[16]
        if not line:
            raise fl.ForkError(
                f"the bisect check's process forker died (exit {self._proc.wait()})"
            )
        return line

    def close(self) -> None:
        """Stop the forker."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill_group(self._proc.pid)
            self._proc.wait()


def _invalidate_bytecode(tree: Path, rels: Sequence[str]) -> None:
    # The tree changes in place between commits, sometimes within a second: a
    # cached .pyc validated by mtime and size could outlive its source.
    for rel in rels:
        path = tree / rel
        for cached in path.parent.joinpath("__pycache__").glob(path.stem + ".*.pyc"):
            cached.unlink()


def entry_tests(writes: Mapping[str, bytes], patch_diff: str = "") -> List[str]:
    """
    The tests an entry owns: the test modules it introduces or changes, as
    overlay files (``writes``, see :func:`tools.forklib.stack_file_versions`)
    or with its patch (``patch_diff``: a test module a base's series adds to
    upstream's tree, or an upstream test it changes).
    """
    patched = {
        change.new_path
        for change in fl.diff_changes(patch_diff)
        if change.new_path is not None
    }
    return sorted(rel for rel in {*writes, *patched} if fl.is_test_file(rel))


def entries_differing_from(repo: Path, version: str) -> List[str]:
    """
    The entries of the selected base whose commit may differ from the one
    they make on base ``version``: entries ``version`` does not have, and
    those whose patch comes from another file (a base's variant) there.
    The others are the same change on both bases.

    Args:
        repo (Path): the fork repository.
        version (str): the other base.

    Returns:
        List[str]: the entries' names, in stack order.
    """
    mine = {e.name: e.patch.source for e in fl.load_stack(repo)}
    with fl.selected_base(version):
        theirs = {e.name: e.patch.source for e in fl.load_stack(repo)}
    return [name for name, source in mine.items() if theirs.get(name) != source]


#: Where the bisect checks record the entries whose tests passed at their
#: commit, by fingerprint (see :func:`entry_fingerprints`), per base.
VERIFIED_FILE: str = ".ci/bisect-verified.json"


def entry_fingerprints(repo: Path = fl.REPO_ROOT) -> Dict[str, str]:
    """
    A fingerprint of each entry's own commit on the selected base: the
    base (its wheel's sha256, or the commit of upstream's tree), the diff to
    upstream files it reads there, its overlay diff, the files it writes
    with their content at that commit, and the upstream files it deletes.
    It changes when the entry itself does, not when an earlier one does
    (a full bisect check, before a release, covers those).

    Returns:
        Dict[str, str]: entry name -> sha256 (hex).
    """
    base = fl.load_base(repo)
    where = base.sha256 or fl.load_upstream_tree(repo).commit
    stack = fl.load_stack(repo)
    prints: Dict[str, str] = {}
    for entry, writes in zip(stack, fl.stack_file_versions(repo, stack)):
        digest = hashlib.sha256()
        for part in (base.version, where, entry.name, entry.patch.diff):
            digest.update(part.encode() + b"\0")
        digest.update(entry.overlay_diff.encode() + b"\0")
        for rel in sorted(writes):
            digest.update(rel.encode() + b"\0" + writes[rel] + b"\0")
        for rel in entry.deletes:
            digest.update(b"-" + rel.encode() + b"\0")
        prints[entry.name] = digest.hexdigest()
    return prints


def load_verified(path: Path) -> Dict[str, Dict[str, str]]:
    """The recorded fingerprints (base -> entry -> fingerprint); empty when
    the file does not exist."""
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def verified_entries(repo: Path, path: Path) -> List[str]:
    """The entries of the selected base whose own commit is the one whose
    tests passed when the bisect check last recorded them in ``path``."""
    recorded = load_verified(path).get(fl.load_base(repo).version, {})
    return [
        name
        for name, print_ in entry_fingerprints(repo).items()
        if recorded.get(name) == print_
    ]


def record_verified(
    repo: Path, path: Path, results: Sequence["BisectResult"]
) -> List[str]:
    """
    Record in ``path`` the fingerprints of the entries whose tests ran and
    passed at their commit on the selected base (``results`` of
    :func:`bisect_check`); entries no longer in the stack are dropped, the
    other bases' records are kept.

    Returns:
        List[str]: the entries recorded.
    """
    version = fl.load_base(repo).version
    prints = entry_fingerprints(repo)
    data = load_verified(path)
    mine = {n: p for n, p in data.get(version, {}).items() if prints.get(n) == p}
    recorded = [r.name for r in results if r.ok and not r.reason]
    mine.update({name: prints[name] for name in recorded})
    data[version] = {name: mine[name] for name in prints if name in mine}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return recorded


def bisect_check(
    repo: Path = fl.REPO_ROOT,
    *,
    only: Optional[Sequence[str]] = None,
    pytest_args: Sequence[str] = (),
    stop_first: bool = False,
    keep: Optional[Path] = None,
    log: Optional[Callable[[str], None]] = None,
    run_tests: Optional[Callable[[fl.StackEntry], bool]] = None,
) -> List[BisectResult]:
    """
    Prove every commit of the stack works on its own. One tree, built once
    from the wheel, advances commit by commit (the entry's upstream diff, its
    overlay files at that commit); at each commit a fresh interpreter with the
    tree first on ``sys.path`` (instead of installing it into the environment)
    imports every module of the fork present so far and runs the entry's own
    tests with pytest. An entry without tests of its own fails.

    Args:
        repo (Path): the fork repository.
        only (Optional[Sequence[str]]): check only these entries (patch file
            names); the others are still applied.
        pytest_args (Sequence[str]): extra pytest arguments.
        stop_first (bool): stop at the first failing entry.
        keep (Optional[Path]): build the tree there (kept) instead of in a
            temporary directory.
        log (Optional[Callable[[str], None]]): called with one line per entry.
        run_tests (Optional[Callable[[fl.StackEntry], bool]]): whether an
            entry's tests run (default: every entry's); at the others the
            fork is only imported (their tests must still exist).

    Returns:
        List[BisectResult]: one per checked entry, in stack order.

    Raises:
        StackError: when the mapping is not sound.
    """
    stack = fl.load_stack(repo)
    problems = fl.stack_problems(repo, stack)
    if problems:
        raise StackError(problems)
    unknown = sorted(set(only or ()) - {e.name for e in stack})
    if unknown:
        raise fl.ForkError(f"no such stack entries: {', '.join(unknown)}")
    versions = fl.stack_file_versions(repo, stack)
    fl.require_own_files(repo, "bisect-check")
    with tempfile.TemporaryDirectory(prefix="torchrec-fork-bisect-") as tmp:
        scratch = Path(tmp)
        tree = (keep or scratch / "tree").resolve()
        if tree.exists():
            shutil.rmtree(tree)
        fl.extract_base(repo, tree)
        zygote = _Zygote()
        try:
            run = _BisectRun(
                scratch, tree, only, pytest_args, stop_first, log, run_tests, zygote
            )
            return _advance(run, stack, versions)
        finally:
            zygote.close()


@dataclasses.dataclass
class _BisectRun:
    """What one bisect check needs while it advances the tree."""

    scratch: Path
    tree: Path
    only: Optional[Sequence[str]]
    pytest_args: Sequence[str]
    stop_first: bool
    log: Optional[Callable[[str], None]]
    run_tests: Optional[Callable[[fl.StackEntry], bool]]
    zygote: "_Zygote"


def _advance(
    run: _BisectRun,
    stack: Sequence[fl.StackEntry],
    versions: Sequence[Dict[str, bytes]],
) -> List[BisectResult]:
    """Apply the entries one by one to ``run.tree``, checking each asked for."""
    results: List[BisectResult] = []
    present: List[str] = []
    for index, (entry, writes) in enumerate(zip(stack, versions), start=1):
        fl.apply_patch(run.tree, entry.patch)
        write_overlay_state(run.tree, writes, entry.overlay_deletions)
        changed = [c.path for c in fl.diff_changes(entry.patch.diff)]
        changed += entry.overlay_deletions
        _invalidate_bytecode(run.tree, changed + list(writes))
        present += [rel for rel in writes if rel not in present]
        present = [rel for rel in present if rel not in entry.overlay_deletions]
        if run.only and entry.name not in run.only:
            continue
        with_tests = run.run_tests is None or run.run_tests(entry)
        if (
            not with_tests
            and results
            and results[-1].ok
            and results[-1].index == index - 1
            and not _changes_a_module(changed + list(writes))
            and entry_tests(writes, entry.patch.diff)
        ):
            # the same modules as the commit before, which imported them
            result = BisectResult(
                index,
                entry.name,
                entry_tests(writes, entry.patch.diff),
                True,
                "imports only, as the commit before: no module changed",
                0.0,
                "",
            )
        else:
            result = _check_entry(run, index, entry, writes, present, with_tests)
        results.append(result)
        if run.log is not None:
            status = (
                ("ok" + (f" ({result.reason})" if result.reason else ""))
                if result.ok
                else f"FAILED ({result.reason})"
            )
            run.log(
                f"{index:02d} {entry.name}: {status} in {result.seconds:.0f} s "
                f"[{', '.join(Path(t).name for t in result.tests) or 'no tests'}]"
            )
        if run.stop_first and not result.ok:
            break
    return results


def _changes_a_module(paths: Sequence[str]) -> bool:
    """Whether a commit that changes ``paths`` changes a module the fork
    imports (a ``.py`` file that is not a test module)."""
    return any(p.endswith(".py") and not fl.is_test_file(p) for p in paths)


def _check_entry(
    run: _BisectRun,
    index: int,
    entry: fl.StackEntry,
    writes: Dict[str, bytes],
    present: Sequence[str],
    with_tests: bool,
) -> BisectResult:
    tests = entry_tests(writes, entry.patch.diff)
    if not tests:
        return BisectResult(
            index, entry.name, [], False, "no tests of its own", 0.0, ""
        )
    modules = [
        name
        for rel in present
        if not fl.is_test_file(rel)
        for name in [fl.module_name(rel)]
        if name is not None
    ]
    config: Dict[str, object] = {
        "tree": str(run.tree),
        "modules": modules,
        "pytest": (
            ["-q", "-p", "no:cacheprovider", f"--rootdir={run.tree}"]
            + list(run.pytest_args)
            + [str(run.tree / rel) for rel in tests]
            if with_tests
            else None
        ),
    }
    pythonpath = os.environ.get("PYTHONPATH")
    config["env"] = {
        "PYTHONPATH": os.pathsep.join(
            [str(run.tree)] + ([pythonpath] if pythonpath else [])
        )
    }
    workdir = run.scratch / f"run-{index:02d}"
    workdir.mkdir(exist_ok=True)
    config["cwd"] = str(workdir)
    config["log"] = str(workdir / "output.txt")
    start = time.monotonic()
    code, output = run.zygote.run(config, BISECT_ENTRY_TIMEOUT_S)
    seconds = time.monotonic() - start
    if code is None:
        return BisectResult(
            index,
            entry.name,
            tests,
            False,
            f"timed out after {BISECT_ENTRY_TIMEOUT_S:.0f} s",
            seconds,
            output,
        )
    if code == 0:
        reason = "" if with_tests else "imports only"
        return BisectResult(index, entry.name, tests, True, reason, seconds, output)
    reason = "tests failed" if code == 1 else f"exit {code}"
    if code == 5:
        reason = "pytest collected no test"
    return BisectResult(index, entry.name, tests, False, reason, seconds, output)


def _kill_group(pid: int) -> None:
    """Stop a process group (a forked check and whatever its tests started)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

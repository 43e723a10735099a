"""Command-line entry point of the fork's patch workflow.

Run ``python tools/fork.py --help`` (or ``python -m tools.fork --help``) from the
repository root. Subcommands: ``materialize``, ``develop``, ``refresh``, ``new``,
``port``, ``check``, ``export``, ``stack``, ``stack-tree``, ``refresh-stack``, ``absorb``
and ``bisect-check``; each has its own ``--help``. See CONTRIBUTING.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Set

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools import forklib as fl, stack as st  # noqa: E402

DEFAULT_TREE: Path = fl.REPO_ROOT / ".fork" / "tree"
DEFAULT_EXPORT: Path = fl.REPO_ROOT / ".fork" / "export"
TREE_SETUP_PY: str = '''"""Written by tools/fork.py develop: editable install of this working tree."""
from setuptools import find_packages, setup

setup(
    name="torchrec",
    version={version!r},
    packages=find_packages(include=["torchrec", "torchrec.*"]),
)
'''


# --------------------------------------------------------------------------- helpers


def base_dir(default: Path, base: fl.BaseSpec) -> Path:
    """A default directory under ``.fork/`` for ``base``: ``default`` itself
    on the default base, ``default-VERSION`` on another (so that the trees
    of the two bases never mix)."""
    return (
        default if base.default else default.with_name(f"{default.name}-{base.version}")
    )


def sync_overlay(repo: Path, tree: Path) -> None:
    """(Re)link the repo's overlay files into ``tree`` and keep git blind to them."""
    for path in tree.joinpath(fl.PACKAGE).rglob("*"):
        if path.is_symlink() and not path.exists():
            path.unlink()  # the overlay file was removed from the repo
    placed = fl.copy_overlay(repo, tree, symlink=True)
    exclude = tree / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# written by tools/fork.py: build by-products and overlay links"]
    lines += fl.TREE_EXCLUDES + ["/" + rel.as_posix() for rel in placed]
    exclude.write_text("\n".join(lines) + "\n")


def materialize_tree(
    tree: Path, repo: Path = fl.REPO_ROOT, *, symlink_overlay: bool = True
) -> List[str]:
    """Create ``tree``: a git repo with pristine upstream as the first commit
    and one commit per patch, plus the overlay files. Returns the commits."""
    fl.init_upstream_repo(tree, repo)
    commits: List[str] = []
    for patch in fl.load_series(repo):
        fl.apply_patch(tree, patch)
        commits.append(fl.commit_all(tree, patch.message, allow_empty=True))
    # The overlay goes in after the series: a base's series may delete an
    # upstream file that an overlay file replaces.
    if symlink_overlay:
        sync_overlay(repo, tree)
    else:
        fl.copy_overlay(repo, tree)
    return commits


def require_tree(tree: Path, repo: Path) -> List[str]:
    """The tree's patch commits, checked against the series."""
    if not (tree / ".git").is_dir():
        raise fl.ForkError(f"{tree} is not materialised; run 'materialize' first")
    return fl.entry_commits(tree, len(fl.read_series(repo)))


def is_dirty(tree: Path) -> bool:
    """Whether ``tree`` has changes not yet committed (ignored files aside)."""
    return bool(fl.git(["status", "--porcelain"], tree).stdout.strip())


def write_patch_file(path: Path, diff: str, header: Optional[str] = None) -> bool:
    """
    Write a patch file with a new diff: its header (a shared patch's
    ``Subject:`` and body, or a variant's note) is kept, or ``header`` when
    given; returns whether the file changed.
    """
    if header is None:
        header = fl._split_header(path)[0] if path.exists() else ""
    header = header.rstrip("\n") + "\n\n" if header.strip() else ""
    text = header + diff
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True


def paragraphs(messages: Sequence[str]) -> str:
    """``-m`` messages as a patch header: one paragraph each, wrapped at 72
    columns as commit messages are."""
    return "\n\n".join(textwrap.fill(" ".join(m.split()), 72) for m in messages)


def commit_diffs(tree: Path, commits: Sequence[str]) -> List[str]:
    """The diff of each commit, as patch files keep it."""
    return [fl.diff_commit(tree, commit) for commit in commits]


# --------------------------------------------------------------------------- commands


def fresh_dir(args: argparse.Namespace) -> Path:
    """
    ``args.dir``, removed first if it exists and ``--force`` is given.

    Returns:
        Path: the directory, absolute.

    Raises:
        fl.ForkError: it exists and ``--force`` is not given.
    """
    tree: Path = args.dir.resolve()
    if tree.exists():
        if not args.force:
            raise fl.ForkError(f"{tree} exists; pass --force to rebuild it")
        shutil.rmtree(tree)
    return tree


def cmd_materialize(args: argparse.Namespace) -> int:
    """Build the working tree."""
    fl.require_own_files(args.repo, "materialize")
    tree = fresh_dir(args)
    commits = materialize_tree(tree, args.repo, symlink_overlay=not args.copy)
    print(f"materialised {tree}: upstream + {len(commits)} patch commit(s)")
    return 0


def cmd_develop(args: argparse.Namespace) -> int:
    """Editable install of the working tree into this Python environment."""
    base = fl.load_base(args.repo)
    if base.is_target:
        raise fl.ForkError(
            f"torchrec {base.version} is upstream's git tree, a target of the "
            f"export: nothing installs it (materialize it and put the tree first "
            f"on sys.path, as bisect-check does)"
        )
    tree: Path = args.dir.resolve()
    if not (tree / ".git").is_dir():
        materialize_tree(tree, args.repo)
    sync_overlay(args.repo, tree)
    (tree / "setup.py").write_text(
        TREE_SETUP_PY.format(version=fl.fork_version(args.repo))
    )
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps"]
    cmd += ["--no-build-isolation", "-e", str(tree)]
    subprocess.run(cmd, check=True)
    # scripts/_env.sh records what it built in the venv; forget it so that the
    # scripts reinstall the regular build instead of testing the editable tree.
    Path(sys.prefix, ".fork-build").unlink(missing_ok=True)
    print(f"torchrec now imports from {tree} (overlay files link to {args.repo})")
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    """Fold the tree's uncommitted edits into PATCH and rewrite the patch
    files whose diff changed."""
    repo: Path = args.repo
    fl.require_own_files(repo, "refresh")
    tree: Path = args.dir.resolve()
    names = fl.read_series(repo)
    commits = require_tree(tree, repo)
    if not names:
        raise fl.ForkError("the series is empty; use 'new' to start a patch")
    target = args.patch or names[-1]
    if target not in names:
        raise fl.ForkError(
            f"{target} has no diff on torchrec {fl.load_base(repo).version} "
            f"(or is not in patches/series)"
        )
    if args.variant and not args.message:
        raise fl.ForkError("--variant needs -m: why the patch differs on this base")
    index = names.index(target)
    sync_overlay(repo, tree)
    if is_dirty(tree):
        fl.git(["add", "-A"], tree)
        if index == len(names) - 1:
            fl.git(["commit", "-q", "--amend", "--no-edit"], tree)
        else:
            fl.git(["commit", "-q", f"--fixup={commits[index]}"], tree)
            proc = fl.git(
                ["rebase", "-q", "-i", "--autosquash", fl.UPSTREAM_TAG],
                tree,
                check=False,
                extra_env={"GIT_SEQUENCE_EDITOR": "true", "GIT_EDITOR": "true"},
            )
            if proc.returncode != 0:
                fl.git(["rebase", "--abort"], tree, check=False)
                fl.git(["reset", "-q", "--soft", "HEAD^"], tree)
                raise fl.PatchError(
                    target,
                    "folding the edits in conflicts with a later patch; "
                    "edit with git rebase -i in the tree, then refresh",
                )
        commits = require_tree(tree, repo)
    after = commit_diffs(tree, commits)
    changed = 0
    base = fl.load_base(repo)
    for name, new in zip(names, after):
        patch = fl.load_patch(repo, name)
        if name == target and args.variant:
            path = repo / base.patches / name
            header = paragraphs(args.message)
            if path == fl.series_dir(repo) / name:
                raise fl.ForkError(
                    f"torchrec {base.version} is the default base: its patches "
                    f"are the shared ones, not variants"
                )
        elif fl.normalized_diff(new) != fl.normalized_diff(patch.diff) or (
            new != patch.diff and fl.readers(repo, patch.source) == [base.version]
        ):
            # a change, or new line numbers of a file this base alone reads
            # (a file other bases read keeps the numbers it was made with)
            path, header = repo / patch.source, None
        else:
            continue
        if write_patch_file(path, new, header):
            print(f"refreshed {path.relative_to(repo)}")
            changed += 1
    if not changed:
        print("patches already up to date")
    return 0


def cmd_new(args: argparse.Namespace) -> int:
    """Turn the tree's uncommitted edits into a new patch at the end of the series."""
    repo: Path = args.repo
    tree: Path = args.dir.resolve()
    name: str = args.name if args.name.endswith(".patch") else args.name + ".patch"
    if (fl.series_dir(repo) / name).exists():
        raise fl.ForkError(f"patches/{name} already exists")
    require_tree(tree, repo)
    sync_overlay(repo, tree)
    if not is_dirty(tree):
        raise fl.ForkError(f"no uncommitted edits to upstream files in {tree}")
    body = "\n\n".join(args.message or [])
    patch = fl.Patch(name, args.subject, body, "")
    commit = fl.commit_all(tree, patch.message)
    patch = dataclasses.replace(patch, diff=fl.diff_commit(tree, commit))
    (fl.series_dir(repo) / name).write_text(patch.render())
    series = fl.series_dir(repo) / "series"
    text = series.read_text() if series.exists() else ""
    if text and not text.endswith("\n"):
        text += "\n"
    tag = f"  [{' '.join(args.bases)}]" if args.bases else ""
    series.write_text(text + name + tag + "\n")
    print(f"wrote patches/{name} and appended it to patches/series")
    return 0


def apply_what_applies(tree: Path, patch: fl.Patch) -> None:
    """Apply the hunks of ``patch`` that apply to ``tree``, where the code
    around them moved or changed a little too (GNU patch's fuzz, when it is
    installed; else git's exact context), and leave the others in ``.rej``
    files, for a developer who reviews the result."""
    if shutil.which("patch"):
        subprocess.run(
            ["patch", "-p1", "--fuzz=3", "--no-backup-if-mismatch", "-s"],
            cwd=tree,
            input=patch.diff,
            text=True,
            capture_output=True,
        )
        return
    fl.git(
        ["apply", "--reject", "--whitespace=nowarn", "-p1", "-"],
        tree,
        check=False,
        input=patch.diff,
        isolate=True,
    )


def cmd_port(args: argparse.Namespace) -> int:
    """Apply the selected base's series in DIR entry by entry, stopping at
    a patch that does not apply so that its base gets a variant."""
    repo: Path = args.repo
    fl.require_own_files(repo, "port")
    tree: Path = args.dir.resolve()
    base = fl.load_base(repo)
    patches = fl.load_series(repo)
    if args.resume:
        if not (tree / ".git").is_dir():
            raise fl.ForkError(f"{tree} is not being ported; run 'port' first")
    elif (tree / ".git").is_dir():
        raise fl.ForkError(
            f"{tree} exists; pass --continue, or remove it to start over"
        )
    else:
        fl.init_upstream_repo(tree, repo)
    done = len(fl.series_commits(tree))
    if args.resume and done < len(patches) and is_dirty(tree):
        patch = patches[done]
        if not args.message:
            raise fl.ForkError(
                f"-m WHY: say why {patch.name} differs on torchrec {base.version}"
            )
        for leftover in [*tree.rglob("*.rej"), *tree.rglob("*.orig")]:
            leftover.unlink()
        commit = fl.commit_all(tree, patch.message)
        path = repo / base.patches / patch.name
        header = paragraphs(args.message)
        if base.default:
            path, header = fl.series_dir(repo) / patch.name, None
        write_patch_file(path, fl.diff_commit(tree, commit), header)
        print(f"wrote {path.relative_to(repo)}")
        done += 1
    for patch in patches[done:]:
        try:
            fl.apply_patch(tree, patch)
        except fl.PatchError as exc:
            apply_what_applies(tree, patch)
            rejects = sorted(
                p.relative_to(tree).as_posix() for p in tree.rglob("*.rej")
            )
            print(f"{exc}\n")
            print(
                f"{patch.name} is applied in {tree} but for the hunks in "
                f"{', '.join(rejects) or '(none)'}. Make the change by hand "
                f"there, then run\n  tools/fork.py --base {base.version} port "
                f"--continue -m 'why it differs on torchrec {base.version}'\n"
                f"to write it as {base.patches}/{patch.name} and go on."
            )
            return 1
        fl.commit_all(tree, patch.message, allow_empty=True)
    sync_overlay(repo, tree)
    print(
        f"every patch applies on torchrec {base.version} in {tree}; "
        f"run 'tools/fork.py --base {base.version} check'"
    )
    return 0


def check_repo(repo: Path) -> List[str]:
    """
    Check the selected base: apply its series to pristine upstream in a
    temporary tree and verify that refresh would change nothing (a patch
    file several bases read is in refreshed form on each when a fresh diff
    there is the same but for line numbers and blob ids), that the stack
    mapping is sound (every overlay file in exactly one entry, overlay diffs
    apply) and that the stack applies to upstream's tree (its git tree, or
    the wheel's where none is at hand).

    Returns:
        List[str]: the names of the patches applied.

    Raises:
        fl.PatchError: naming the patch, the base and the hunk that fails.
        st.StackError: listing the stack's problems.
    """
    fl.fork_version(repo)
    patches = fl.load_series(repo)
    version = fl.load_base(repo).version
    with tempfile.TemporaryDirectory(prefix="torchrec-fork-check-") as tmp:
        tree = Path(tmp) / "tree"
        commits = materialize_tree(tree, repo, symlink_overlay=False)
        for patch, commit in zip(patches, commits):
            fresh = fl.normalized_diff(fl.diff_commit(tree, commit))
            if fresh != fl.normalized_diff(patch.diff):
                raise fl.PatchError(
                    patch.name,
                    f"applies on torchrec {version} ({patch.source}) but is not in "
                    f"refreshed form there; run refresh",
                )
    stack = fl.load_stack(repo)
    problems = fl.stack_problems(repo, stack)
    upstream = fl.load_upstream_tree(repo)
    problems += fl.upstream_problems(
        repo, stack, upstream, fl.base_files(repo), fl.load_base(repo).replaces
    )
    problems += fl.target_blob_problems(repo, upstream)
    if problems:
        raise st.StackError([f"on torchrec {version}: {p}" for p in problems])
    return [patch.name for patch in patches]


def cmd_check(args: argparse.Namespace) -> int:
    """Verify the one series on every base (or the one --base names)."""
    problems = fl.series_problems(args.repo)
    if problems:
        raise st.StackError(problems)
    versions = (
        [args.base] if args.base else [b.version for b in fl.load_bases(args.repo)]
    )
    for version in versions:
        with fl.selected_base(version):
            names = check_repo(args.repo)
            entries = len(fl.parse_series(args.repo))
            where = (
                f" ({fl.describe_base(args.repo)}: the changes to the files it "
                f"lacks checked by blob id)"
                if fl.is_stand_in(args.repo)
                else ""
            )
        print(
            f"OK on torchrec {version}{where}: {len(names)} patch(es) apply "
            f"cleanly and are refreshed; the stack's {entries} entries cover every "
            f"overlay file"
        )
    return 0


def export_series(repo: Path, out: Path) -> List[Path]:
    """Write the stack as a numbered ``git format-patch`` series into ``out``
    (cover letter first); see :func:`tools.stack.export_stack`."""
    return st.export_stack(repo, out).files


def cmd_export(args: argparse.Namespace) -> int:
    """Export the stack as an upstream-ready series."""
    fl.require_own_files(args.repo, "export")
    identity = st.export_identity(args.repo)
    if args.author:
        identity.update(st.parse_author(args.author))
    export = st.export_stack(
        args.repo,
        args.dir.resolve(),
        cover_letter=not args.no_cover_letter,
        identity=identity,
    )
    for path in export.files:
        print(path)
    print(st.stack_table(export.commits), file=sys.stderr)
    for message in st.oversized(export.commits):
        print(f"warning: {message}", file=sys.stderr)
    return 0


def cmd_stack(args: argparse.Namespace) -> int:
    """Show the stack with the size of every commit."""
    with tempfile.TemporaryDirectory(prefix="torchrec-fork-stack-") as tmp:
        commits = st.build_stack_repo(Path(tmp) / "tree", args.repo)
    if fl.is_stand_in(args.repo):
        print(
            f"on {fl.describe_base(args.repo)}: the sizes are the target's but "
            f"for what its variants add in files it has with other content",
            file=sys.stderr,
        )
    print(st.stack_table(commits))
    too_big = st.oversized(commits)
    for message in too_big:
        print(f"error: {message}", file=sys.stderr)
    if too_big:
        print(
            f"split the files named above into modules that belong to different "
            f"entries, or introduce a smaller version of one early and complete "
            f"it in a later entry's patches/NAME{fl.OVERLAY_DIFF_SUFFIX} "
            f"(see CONTRIBUTING.md)",
            file=sys.stderr,
        )
    return 1 if too_big else 0


def cmd_stack_tree(args: argparse.Namespace) -> int:
    """Build the stack as a git repository."""
    tree = fresh_dir(args)
    commits = st.build_stack_repo(tree, args.repo)
    print(f"built {tree}: upstream + {len(commits)} stack commit(s)")
    return 0


def cmd_refresh_stack(args: argparse.Namespace) -> int:
    """Rewrite the overlay diffs from an edited stack repository."""
    written = st.refresh_overlay_diffs(args.dir.resolve(), args.repo)
    for path in written:
        print(f"{'wrote' if path.exists() else 'removed'} {path}")
    problems = fl.stack_problems(args.repo)
    if problems:
        raise st.StackError(problems)
    if not written:
        print("overlay diffs already up to date")
    return 0


def cmd_absorb(args: argparse.Namespace) -> int:
    """Fold changes of overlay files into the overlay diffs that no longer apply."""
    for path in st.absorb_overlay_changes(args.repo):
        print(f"rewrote {path}")
    problems = fl.stack_problems(args.repo)
    if problems:
        raise st.StackError(problems)
    print("every overlay diff applies")
    return 0


def cmd_bisect_check(args: argparse.Namespace) -> int:
    """Check every commit of the stack on its own."""
    fl.require_own_files(args.repo, "bisect-check")
    wanted: Optional[Set[str]] = None
    if args.differing_from:
        wanted = set(st.entries_differing_from(args.repo, args.differing_from))
    if args.unverified:
        done = set(st.verified_entries(args.repo, args.unverified))
        stack_names = {e.name for e in fl.load_stack(args.repo)}
        wanted = (stack_names if wanted is None else wanted) - done
    run_tests = None
    if wanted is not None:
        chosen = wanted
        run_tests = lambda entry: entry.name in chosen  # noqa: E731
    results = st.bisect_check(
        args.repo,
        only=args.entry or None,
        pytest_args=args.pytest_args,
        stop_first=args.exitfirst,
        keep=args.keep,
        log=lambda line: print(line, flush=True),
        run_tests=run_tests,
    )
    failed = [r for r in results if not r.ok]
    for result in failed:
        print(f"\n==== {result.name}: {result.reason}\n{result.output[-6000:]}")
    if args.record:
        recorded = st.record_verified(args.repo, args.record, results)
        print(f"recorded {len(recorded)} entries whose tests passed in {args.record}")
    total = sum(r.seconds for r in results)
    print(
        f"{len(results) - len(failed)} of {len(results)} commit(s) pass their own "
        f"tests ({total:.0f} s)"
    )
    return 1 if failed else 0


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of the CLI."""
    parser = argparse.ArgumentParser(
        prog="tools/fork.py",
        description="Patch workflow of the TorchRec fork (see CONTRIBUTING.md).",
    )
    parser.add_argument(
        "--repo",
        type=Path,
        default=fl.REPO_ROOT,
        help="fork repository root (default: this checkout)",
    )
    parser.add_argument(
        "--base",
        metavar="VERSION",
        help=f"the base of base.json to work on (default: ${fl.BASE_ENV}, else "
        "base.json's default; 'check' without --base checks every base); the "
        "one series is read for that base (its variants in "
        "patches/base-VERSION/), and a base other than the default has its own "
        ".fork/NAME-VERSION default directories",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def tree_arg(p: argparse.ArgumentParser, default: Path = DEFAULT_TREE) -> None:
        p.add_argument(
            "dir",
            nargs="?",
            type=Path,
            default=None,
            metavar="DIR",
            help=f"working tree (default: {default.relative_to(fl.REPO_ROOT)}, "
            f"with -VERSION on another base)",
        )
        p.set_defaults(default_dir=default)

    def dir_option(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--dir",
            type=Path,
            default=None,
            help="working tree (default: .fork/tree, with -VERSION on another base)",
        )

    def message_option(p: argparse.ArgumentParser, help: str) -> None:
        p.add_argument("-m", "--message", action="append", help=help)

    def command(
        name: str,
        func: Callable[[argparse.Namespace], int],
        help: str,
        description: str,
        **defaults: Any,
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=description)
        p.set_defaults(func=func, **defaults)
        return p

    p = command(
        "materialize",
        cmd_materialize,
        help="build a git working tree: upstream, one commit per patch, overlay",
        description="Create DIR as a git repo whose first commit (tag 'upstream') "
        "is the pristine base, followed by one commit per patch of the series "
        "(message = patch header). Overlay files are symlinked to the repo's "
        "torchrec/ files (ignored by git in DIR), so edits to them take effect.",
    )
    tree_arg(p)
    p.add_argument("--force", action="store_true", help="replace an existing DIR")
    p.add_argument(
        "--copy", action="store_true", help="copy overlay files instead of linking"
    )

    p = command(
        "develop",
        cmd_develop,
        help="editable install of the working tree into this environment",
        description="Materialise DIR if needed, re-link the overlay and "
        "'pip install -e' it (no deps, no build isolation) into the running "
        "Python's environment. Edits to the repo's torchrec/ files and to "
        "upstream files in DIR take effect without reinstalling.",
    )
    tree_arg(p)

    p = command(
        "refresh",
        cmd_refresh,
        help="fold edits in the working tree into a patch and rewrite patch files",
        description="Commit the uncommitted edits to upstream files in DIR into "
        "the commit of PATCH (default: the last patch of the series), then "
        "regenerate every patch file from its commit, keeping its header.",
        default_dir=DEFAULT_TREE,
    )
    p.add_argument("patch", nargs="?", metavar="PATCH", help="patch file name")
    dir_option(p)
    p.add_argument(
        "--variant",
        action="store_true",
        help="write PATCH as the selected base's own variant "
        "(patches/base-VERSION/PATCH) instead of changing the file it reads",
    )
    message_option(p, "with --variant: why it differs")

    p = command(
        "new",
        cmd_new,
        help="turn the working tree's edits into a new patch at the end of the series",
        description="Commit the uncommitted edits to upstream files in DIR as a "
        "new patch NAME (appended to patches/series) with the given subject and "
        "body paragraphs.",
        default_dir=DEFAULT_TREE,
    )
    p.add_argument("name", metavar="NAME", help="patch file name, e.g. fix-x.patch")
    p.add_argument("-s", "--subject", required=True, help="one-line subject")
    p.add_argument(
        "--bases",
        nargs="+",
        metavar="VERSION",
        help="the bases the entry is on (default: every base)",
    )
    message_option(p, "body paragraph (repeatable)")
    dir_option(p)

    p = command(
        "port",
        cmd_port,
        help="apply the series to a base entry by entry, making variants where needed",
        description="Build DIR (a git repo from the selected base's wheel) one "
        "entry at a time. At a patch that does not apply, apply what does, "
        "leave the rest as .rej files and stop: make the change by hand, then "
        "'port --continue -m WHY' commits it as that base's variant "
        "(patches/base-VERSION/NAME.patch: WHY, then the diff) and goes on. "
        "Finish with 'check' on every base.",
    )
    tree_arg(p, fl.REPO_ROOT / ".fork" / "port")
    p.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="commit the hand-made change of the stopped patch and go on",
    )
    message_option(p, "why it differs (repeatable)")

    p = command(
        "check",
        cmd_check,
        help="verify the series applies, is refreshed, and the stack mapping is sound",
        description="Apply every patch to a pristine upstream tree in a temporary "
        "directory; fail (exit 1, naming the patch) if one does not apply or if "
        "refresh would change it. Then check the stack mapping of patches/series "
        "(every overlay file introduced by exactly one entry, plain entries with "
        "a diff and '#=' entries without, overlay diffs that apply) and that the "
        "stack applies to upstream's git tree (tools/upstream-v*-tree.txt): every "
        "patched file has upstream's blob as pre-image, no created file exists.",
    )

    p = command(
        "export",
        cmd_export,
        help="write the stack as a numbered git format-patch series",
        description="Write DIR/0000-cover-letter.patch, DIR/0001-*.patch ...: one "
        "commit per entry of patches/series (its upstream diff, the overlay files "
        "it introduces, its overlay diff), message = the patch's header. 'git am "
        "--empty=drop DIR/*.patch' applies it to upstream's git tree at the base's "
        "tag (the cover letter has no diff: --empty=drop skips it). A '#- PATH' "
        "line of the series (a file of upstream's tree the wheel lacks) becomes "
        "the deletion of PATH by upstream's blob id, which git am checks.",
    )
    tree_arg(p, DEFAULT_EXPORT)
    p.add_argument(
        "--no-cover-letter", action="store_true", help="write no 0000 cover letter"
    )
    p.add_argument(
        "--author",
        metavar="'NAME <EMAIL>'",
        help="author of the commits (default: this repo's git user, else the tools')",
    )

    p = command(
        "stack",
        cmd_stack,
        help="list the stack's commits with their sizes; fail on an oversized one",
        description="Build the stack in a temporary repository and print every "
        f"commit with its changed lines. Exit 1 when one changes more than "
        f"{st.MAX_CHANGED_LINES} lines, naming its biggest files.",
    )

    p = command(
        "stack-tree",
        cmd_stack_tree,
        help="build the stack as a git repository (one commit per entry)",
        description="Create DIR as a git repo: upstream (the wheel plus the "
        "files of upstream's git tree the overlay restores, tag 'upstream'), then "
        "one commit per entry of patches/series, as 'export' writes them. Use it "
        "to review the stack, or to run git bisect by hand.",
    )
    tree_arg(p, fl.REPO_ROOT / ".fork" / "stack")
    p.add_argument("--force", action="store_true", help="replace an existing DIR")

    p = command(
        "refresh-stack",
        cmd_refresh_stack,
        help="rewrite the entries' overlay diffs from an edited stack-tree",
        description="Read DIR (made by 'stack-tree', its history edited with git, "
        "e.g. an early commit introducing a smaller version of a file that a "
        f"later commit completes) and rewrite each patches/NAME{fl.OVERLAY_DIFF_SUFFIX} "
        "from the commit's changes to overlay files introduced by earlier "
        "entries. The commits must match the entries one to one, change upstream "
        "files as the patch files do and end with the repository's overlay files.",
    )
    tree_arg(p, fl.REPO_ROOT / ".fork" / "stack")

    p = command(
        "absorb",
        cmd_absorb,
        help="fold edits of overlay files into the overlay diffs they broke",
        description="When an edit of an overlay file makes an overlay diff "
        f"(patches/NAME{fl.OVERLAY_DIFF_SUFFIX}) stop applying, rewrite the diff "
        "of the last entry that changes the file so that it ends with the edited "
        "file: the edit goes into that entry, earlier versions stay as they were. "
        "The file's previous version comes from this checkout's git history.",
    )

    p = command(
        "bisect-check",
        cmd_bisect_check,
        help="prove every commit of the stack imports and passes its own tests",
        description="Advance one tree from the wheel commit by commit; at every "
        "entry of patches/series, with the tree first on sys.path, import every "
        "module of the fork present so far and run the entry's own tests (the "
        "test modules it introduces or changes) with pytest. Fails for an entry "
        "without tests. Uses the current environment (no install).",
    )
    p.add_argument(
        "--entry",
        action="append",
        metavar="NAME.patch",
        help="check only this entry (repeatable); the others are still applied",
    )
    p.add_argument(
        "-x", "--exitfirst", action="store_true", help="stop at the first failure"
    )
    p.add_argument(
        "--keep", type=Path, metavar="DIR", help="build the tree in DIR and keep it"
    )
    p.add_argument(
        "--differing-from",
        metavar="VERSION",
        help="run the tests only of the entries whose commit may differ from "
        "the one they make on base VERSION (a variant, or an entry VERSION "
        "lacks); at the others only import the fork (for a base whose every "
        "other commit VERSION's full check covers)",
    )
    p.add_argument(
        "--unverified",
        type=Path,
        metavar="FILE",
        help="run the tests only of the entries whose own commit is not the one "
        f"FILE records as passing on this base (CI: {st.VERIFIED_FILE}); with "
        "--differing-from, of those that are both",
    )
    p.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="record in FILE the entries whose tests ran and passed (by a "
        "fingerprint of their own commit on this base), for --unverified",
    )
    p.add_argument(
        "pytest_args",
        nargs="*",
        metavar="PYTEST_ARG",
        help="extra pytest arguments (after --)",
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; errors print one line to stderr and return 1."""
    args = build_parser().parse_args(argv)
    args.repo = args.repo.resolve()
    if args.base:
        # The environment, not a parameter: the interpreters and pip builds the
        # commands start (bisect-check, develop) build on the same base.
        os.environ[fl.BASE_ENV] = args.base
    try:
        base = fl.load_base(args.repo)
        if getattr(args, "default_dir", None) is not None and args.dir is None:
            args.dir = base_dir(args.default_dir, base)
        return int(args.func(args))
    except fl.ForkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

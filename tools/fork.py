"""Command-line entry point of the fork's patch workflow.

Run ``python tools/fork.py --help`` (or ``python -m tools.fork --help``) from the
repository root. Subcommands: ``materialize``, ``develop``, ``refresh``, ``new``,
``check`` and ``export``; each has its own ``--help``. See CONTRIBUTING.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools import forklib as fl  # noqa: E402

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
    if symlink_overlay:
        sync_overlay(repo, tree)
    commits: List[str] = []
    for patch in fl.load_series(repo):
        fl.apply_patch(tree, patch)
        commits.append(fl.commit_all(tree, patch.message))
    if not symlink_overlay:
        fl.copy_overlay(repo, tree)
    return commits


def require_tree(tree: Path, repo: Path) -> List[str]:
    """The tree's patch commits, checked against the series."""
    if not (tree / ".git").is_dir():
        raise fl.ForkError(f"{tree} is not materialised; run 'materialize' first")
    commits = fl.series_commits(tree)
    names = fl.read_series(repo)
    if len(commits) != len(names):
        raise fl.ForkError(
            f"{tree} has {len(commits)} commits over upstream but patches/series "
            f"lists {len(names)} patches; re-run 'materialize --force'"
        )
    return commits


def is_dirty(tree: Path) -> bool:
    """Whether ``tree`` has changes not yet committed (ignored files aside)."""
    return bool(fl.git(["status", "--porcelain"], tree).stdout.strip())


def write_patch(repo: Path, name: str, patch: fl.Patch) -> bool:
    """Write ``patches/NAME``; returns whether its content changed."""
    path = repo / "patches" / name
    text = patch.render()
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


# --------------------------------------------------------------------------- commands


def cmd_materialize(args: argparse.Namespace) -> int:
    """Build the working tree."""
    tree: Path = args.dir.resolve()
    if tree.exists():
        if not args.force:
            raise fl.ForkError(f"{tree} exists; pass --force to rebuild it")
        shutil.rmtree(tree)
    commits = materialize_tree(tree, args.repo, symlink_overlay=not args.copy)
    print(f"materialised {tree}: upstream + {len(commits)} patch commit(s)")
    return 0


def cmd_develop(args: argparse.Namespace) -> int:
    """Editable install of the working tree into this Python environment."""
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
    """Fold the tree's uncommitted edits into PATCH and rewrite the patch files."""
    repo: Path = args.repo
    tree: Path = args.dir.resolve()
    names = fl.read_series(repo)
    commits = require_tree(tree, repo)
    if not names:
        raise fl.ForkError("the series is empty; use 'new' to start a patch")
    target = args.patch or names[-1]
    if target not in names:
        raise fl.ForkError(f"{target} is not in patches/series")
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
    changed = 0
    for name, commit in zip(names, commits):
        old = fl.parse_patch(repo / "patches" / name)
        new = fl.Patch(name, old.subject, old.body, fl.diff_commit(tree, commit))
        if write_patch(repo, name, new):
            print(f"refreshed patches/{name}")
            changed += 1
    if not changed:
        print("patches already up to date")
    return 0


def cmd_new(args: argparse.Namespace) -> int:
    """Turn the tree's uncommitted edits into a new patch at the end of the series."""
    repo: Path = args.repo
    tree: Path = args.dir.resolve()
    name: str = args.name if args.name.endswith(".patch") else args.name + ".patch"
    if name in fl.read_series(repo) or (repo / "patches" / name).exists():
        raise fl.ForkError(f"patches/{name} already exists")
    require_tree(tree, repo)
    sync_overlay(repo, tree)
    if not is_dirty(tree):
        raise fl.ForkError(f"no uncommitted edits to upstream files in {tree}")
    body = "\n\n".join(args.message or [])
    patch = fl.Patch(name, args.subject, body, "")
    commit = fl.commit_all(tree, patch.message)
    patch = dataclasses.replace(patch, diff=fl.diff_commit(tree, commit))
    write_patch(repo, name, patch)
    series = repo / "patches" / "series"
    text = series.read_text() if series.exists() else ""
    if text and not text.endswith("\n"):
        text += "\n"
    series.write_text(text + name + "\n")
    print(f"wrote patches/{name} and appended it to patches/series")
    return 0


def check_repo(repo: Path) -> List[str]:
    """Apply the series to pristine upstream in a temporary tree and verify that
    refresh would change nothing. Raises :class:`fl.PatchError` otherwise."""
    fl.fork_version(repo)
    patches = fl.load_series(repo)
    with tempfile.TemporaryDirectory(prefix="torchrec-fork-check-") as tmp:
        tree = Path(tmp) / "tree"
        commits = materialize_tree(tree, repo, symlink_overlay=False)
        for patch, commit in zip(patches, commits):
            if fl.diff_commit(tree, commit) != patch.diff:
                raise fl.PatchError(
                    patch.name, "applies but is not in refreshed form; run refresh"
                )
    return [patch.name for patch in patches]


def cmd_check(args: argparse.Namespace) -> int:
    """Verify the series."""
    names = check_repo(args.repo)
    print(f"OK: {len(names)} patch(es) apply cleanly and are refreshed")
    return 0


def export_series(repo: Path, out: Path) -> List[Path]:
    """Write the fork as a numbered ``git format-patch`` series into ``out``:
    first the overlay files, then each patch of the series."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.patch"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="torchrec-fork-export-") as tmp:
        tree = Path(tmp) / "tree"
        fl.init_upstream_repo(tree, repo)
        placed = fl.copy_overlay(repo, tree)
        if placed:
            listing = "\n".join(f"- {rel.as_posix()}" for rel in placed)
            fl.commit_all(
                tree,
                f"{fl.OVERLAY_COMMIT_SUBJECT}\n\nNew files of the fork, at their "
                f"upstream paths:\n\n{listing}\n",
            )
        for patch in fl.load_series(repo):
            fl.apply_patch(tree, patch)
            fl.commit_all(tree, patch.message)
        fl.git(
            [
                "format-patch",
                "-q",
                "--zero-commit",
                "--no-signature",
                "-o",
                str(out),
                f"{fl.UPSTREAM_TAG}..HEAD",
            ],
            tree,
        )
    return sorted(out.glob("*.patch"))


def cmd_export(args: argparse.Namespace) -> int:
    """Export the fork as an upstream-ready series."""
    files = export_series(args.repo, args.dir.resolve())
    for path in files:
        print(path)
    return 0


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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def tree_arg(p: argparse.ArgumentParser, default: Path = DEFAULT_TREE) -> None:
        p.add_argument(
            "dir",
            nargs="?",
            type=Path,
            default=default,
            metavar="DIR",
            help=f"working tree (default: {default.relative_to(fl.REPO_ROOT)})",
        )

    p = sub.add_parser(
        "materialize",
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
    p.set_defaults(func=cmd_materialize)

    p = sub.add_parser(
        "develop",
        help="editable install of the working tree into this environment",
        description="Materialise DIR if needed, re-link the overlay and "
        "'pip install -e' it (no deps, no build isolation) into the running "
        "Python's environment. Edits to the repo's torchrec/ files and to "
        "upstream files in DIR take effect without reinstalling.",
    )
    tree_arg(p)
    p.set_defaults(func=cmd_develop)

    p = sub.add_parser(
        "refresh",
        help="fold edits in the working tree into a patch and rewrite patch files",
        description="Commit the uncommitted edits to upstream files in DIR into "
        "the commit of PATCH (default: the last patch of the series), then "
        "regenerate every patch file from its commit, keeping its header.",
    )
    p.add_argument("patch", nargs="?", metavar="PATCH", help="patch file name")
    p.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_TREE,
        help="working tree (default: .fork/tree)",
    )
    p.set_defaults(func=cmd_refresh)

    p = sub.add_parser(
        "new",
        help="turn the working tree's edits into a new patch at the end of the series",
        description="Commit the uncommitted edits to upstream files in DIR as a "
        "new patch NAME (appended to patches/series) with the given subject and "
        "body paragraphs.",
    )
    p.add_argument("name", metavar="NAME", help="patch file name, e.g. fix-x.patch")
    p.add_argument("-s", "--subject", required=True, help="one-line subject")
    p.add_argument(
        "-m", "--message", action="append", help="body paragraph (repeatable)"
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_TREE,
        help="working tree (default: .fork/tree)",
    )
    p.set_defaults(func=cmd_new)

    p = sub.add_parser(
        "check",
        help="verify the series applies to pristine upstream and is refreshed",
        description="Apply every patch to a pristine upstream tree in a temporary "
        "directory; fail (exit 1, naming the patch) if one does not apply or if "
        "refresh would change it.",
    )
    p.set_defaults(func=cmd_check)

    p = sub.add_parser(
        "export",
        help="write the fork as a numbered git format-patch series",
        description="Write DIR/0001-*.patch ...: first a commit adding the overlay "
        "files, then one commit per patch of the series. 'git am DIR/*.patch' on "
        "a git repo of pristine upstream reproduces the materialised tree.",
    )
    tree_arg(p, DEFAULT_EXPORT)
    p.set_defaults(func=cmd_export)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI; errors print one line to stderr and return 1."""
    args = build_parser().parse_args(argv)
    args.repo = args.repo.resolve()
    try:
        return int(args.func(args))
    except fl.ForkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

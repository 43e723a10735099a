"""Core of the fork's patch workflow, shared by ``setup.py`` and ``tools/fork.py``.

The fork is three things on top of a pinned upstream release wheel:

* ``base.json``: the upstream wheel (name, version, file name, sha256);
* ``torchrec/``: files the fork adds, at their upstream paths (the *overlay*);
* ``patches/series`` + ``patches/*.patch``: changes to existing upstream files.

This module only uses the standard library and the ``git`` executable, so that
``setup.py`` can import it without any extra build requirement.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

REPO_ROOT: Path = Path(__file__).resolve().parent.parent
PACKAGE: str = "torchrec"
WHEEL_ENV: str = "TORCHREC_FORK_BASE_WHEEL"
CACHE_ENV: str = "TORCHREC_FORK_CACHE_DIR"
OVERLAY_COMMIT_SUBJECT: str = "Add the modules the fork adds to TorchRec"
IGNORED_PARTS: frozenset = frozenset({"__pycache__", ".pytest_cache", ".hypothesis"})
IGNORED_SUFFIXES: tuple = (".pyc", ".pyo")
# Identity used for the throw-away commits the tools make in working trees.
GIT_IDENTITY: Dict[str, str] = {
    "GIT_AUTHOR_NAME": "torchrec-fork tools",
    "GIT_AUTHOR_EMAIL": "torchrec-fork@localhost",
    "GIT_COMMITTER_NAME": "torchrec-fork tools",
    "GIT_COMMITTER_EMAIL": "torchrec-fork@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
GIT_CONFIG: List[str] = [
    "-c",
    "commit.gpgsign=false",
    "-c",
    "core.autocrlf=false",
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "init.defaultBranch=main",
    "-c",
    "advice.detachedHead=false",
]
UPSTREAM_TAG: str = "upstream"


class ForkError(Exception):
    """An error the tools report to the user as a one-line message."""


class BaseWheelError(ForkError):
    """The upstream base wheel is missing or does not match its pinned sha256."""


class PatchError(ForkError):
    """A patch of the series does not apply or is not in refreshed form."""

    def __init__(self, patch: str, message: str, file: Optional[str] = None) -> None:
        self.patch: str = patch
        self.file: Optional[str] = file
        where = f" (file {file})" if file else ""
        super().__init__(f"patch {patch}{where}: {message}")


@dataclasses.dataclass(frozen=True)
class BaseSpec:
    """The pinned upstream release wheel."""

    name: str
    version: str
    wheel: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class Patch:
    """One patch of the series: a header (subject and body) and a unified diff."""

    name: str
    subject: str
    body: str
    diff: str

    @property
    def message(self) -> str:
        """The commit message the patch stands for: subject, blank line, body."""
        return self.subject + ("\n\n" + self.body if self.body else "") + "\n"

    def render(self) -> str:
        """The patch file's text."""
        header = f"Subject: {self.subject}\n\n"
        if self.body:
            header += self.body.rstrip("\n") + "\n\n"
        return header + self.diff


# --------------------------------------------------------------------------- repo


def load_base(repo: Path = REPO_ROOT) -> BaseSpec:
    """Read the base pin from ``base.json``."""
    data = json.loads((repo / "base.json").read_text())
    return BaseSpec(
        name=data["name"],
        version=data["version"],
        wheel=data["wheel"],
        sha256=data["sha256"].lower(),
    )


def fork_version(repo: Path = REPO_ROOT) -> str:
    """The fork's version from ``version.txt``; it must start with the base's version."""
    version = (repo / "version.txt").read_text().strip()
    base = load_base(repo)
    if not version.startswith(base.version + "+"):
        raise ForkError(
            f"version.txt ({version}) must be a local version of the base "
            f"({base.version}+...)"
        )
    return version


def read_series(repo: Path = REPO_ROOT) -> List[str]:
    """Patch file names from ``patches/series``, in order of application."""
    series = repo / "patches" / "series"
    if not series.exists():
        return []
    names: List[str] = []
    for raw in series.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def parse_patch(path: Path) -> Patch:
    """Split a patch file into its ``Subject:`` header, body and diff."""
    text = path.read_text()
    match = re.search(r"^diff --git ", text, flags=re.MULTILINE)
    if match is None:
        raise PatchError(path.name, "no 'diff --git' section found")
    header, diff = text[: match.start()], text[match.start() :]
    lines = header.splitlines()
    if not lines or not lines[0].startswith("Subject:"):
        raise PatchError(path.name, "the first line must be 'Subject: ...'")
    subject = lines[0][len("Subject:") :].strip()
    body = "\n".join(lines[1:]).strip("\n")
    return Patch(name=path.name, subject=subject, body=body, diff=diff)


def load_series(repo: Path = REPO_ROOT) -> List[Patch]:
    """Parse every patch named in the series."""
    patches: List[Patch] = []
    for name in read_series(repo):
        path = repo / "patches" / name
        if not path.exists():
            raise PatchError(name, "listed in patches/series but the file is missing")
        patches.append(parse_patch(path))
    return patches


def _ignored(rel: Path) -> bool:
    return any(part in IGNORED_PARTS for part in rel.parts) or rel.name.endswith(
        IGNORED_SUFFIXES
    )


def overlay_files(repo: Path = REPO_ROOT) -> List[Path]:
    """Files the fork adds, relative to the repo root (e.g. ``torchrec/x/y.py``)."""
    root = repo / PACKAGE
    if not root.is_dir():
        return []
    files = [
        path.relative_to(repo)
        for path in root.rglob("*")
        if path.is_file() and not _ignored(path.relative_to(repo))
    ]
    return sorted(files)


def overlay_modules(repo: Path = REPO_ROOT) -> List[str]:
    """Dotted names of the Python modules the overlay adds."""
    modules: List[str] = []
    for rel in overlay_files(repo):
        if rel.suffix != ".py":
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append(".".join(parts))
    return modules


# --------------------------------------------------------------------------- base


def cache_dir() -> Path:
    """Where the verified base wheel is kept between builds."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "torchrec-fork"


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_wheel(path: Path, base: BaseSpec) -> None:
    """Refuse a wheel whose sha256 is not the pinned one."""
    actual = sha256_of(path)
    if actual != base.sha256:
        raise BaseWheelError(
            f"refusing to build: base wheel {path} has sha256 {actual}, but "
            f"base.json pins {base.sha256} for {base.wheel}. The file is corrupt or "
            f"tampered with; delete it (or fix {WHEEL_ENV}) and build again."
        )


def _download(base: BaseSpec, dest: Path) -> Path:
    """Fetch the pinned wheel with pip (which uses its own configured index/cache)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        f"{base.name}=={base.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = dest / base.wheel
    if proc.returncode != 0 or not wheel.exists():
        raise BaseWheelError(
            f"could not download {base.wheel} with pip "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}\n"
            f"Set {WHEEL_ENV} to a local copy of the wheel to build offline."
        )
    return wheel


def fetch_base_wheel(repo: Path = REPO_ROOT) -> Path:
    """A verified copy of the base wheel: from $TORCHREC_FORK_BASE_WHEEL, the
    cache, or pip (then cached). Raises :class:`BaseWheelError` on a mismatch."""
    base = load_base(repo)
    explicit = os.environ.get(WHEEL_ENV)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise BaseWheelError(f"{WHEEL_ENV}={explicit} is not a file")
        verify_wheel(path, base)
        return path
    cached = cache_dir() / base.wheel
    if cached.is_file():
        verify_wheel(cached, base)
        return cached
    with tempfile.TemporaryDirectory(prefix="torchrec-fork-dl-") as tmp:
        wheel = _download(base, Path(tmp))
        verify_wheel(wheel, base)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".part")
        shutil.copyfile(wheel, partial)
        os.replace(partial, cached)
    return cached


def extract_upstream(wheel: Path, dest: Path) -> None:
    """Unpack the wheel's files (without its ``.dist-info``) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            top = info.filename.split("/", 1)[0]
            if top.endswith(".dist-info") or info.is_dir():
                continue
            target = dest / info.filename
            if dest.resolve() not in target.resolve().parents:
                raise BaseWheelError(f"unsafe path in wheel: {info.filename}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)


# --------------------------------------------------------------------------- git


def git(
    args: Sequence[str],
    cwd: Path,
    *,
    check: bool = True,
    input: Optional[str] = None,
    isolate: bool = False,
    extra_env: Optional[Dict[str, str]] = None,
) -> subprocess.CompletedProcess:
    """Run git with the tools' identity; ``isolate`` stops git from discovering
    a repository above ``cwd`` (so ``git apply`` treats paths as plain files)."""
    env = dict(os.environ)
    env.update(GIT_IDENTITY)
    if isolate:
        env["GIT_CEILING_DIRECTORIES"] = str(Path(cwd).resolve().parent)
        env.pop("GIT_DIR", None)
        env.pop("GIT_WORK_TREE", None)
    if extra_env:
        env.update(extra_env)
    proc = subprocess.run(
        ["git", *GIT_CONFIG, *args],
        cwd=str(cwd),
        input=input,
        capture_output=True,
        text=True,
        env=env,
    )
    if check and proc.returncode != 0:
        raise ForkError(
            f"git {' '.join(args)} failed in {cwd}: "
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    return proc


def _failing_file(stderr: str) -> Optional[str]:
    for pattern in (
        r"patch failed: ([^:\n]+):\d+",
        r"error: ([^:\n]+): does not exist in index",
        r"error: ([^:\n]+): No such file or directory",
        r"error: ([^:\n]+): already exists in working directory",
        r"error: ([^:\n]+): patch does not apply",
        r"corrupt patch at line \d+",
    ):
        match = re.search(pattern, stderr)
        if match:
            return match.group(1) if match.groups() else None
    return None


def apply_patch(tree: Path, patch: Patch, *, index: bool = False) -> None:
    """Apply one patch to ``tree``; raise :class:`PatchError` naming the patch and
    the failing file when it does not apply cleanly."""
    if not patch.diff.strip():
        return
    args = ["apply", "--whitespace=nowarn", "-p1"]
    if index:
        args.append("--index")
    proc = git(args + ["-"], tree, check=False, input=patch.diff, isolate=not index)
    if proc.returncode != 0:
        stderr = proc.stderr.strip()
        raise PatchError(
            patch.name, f"does not apply: {stderr}", file=_failing_file(stderr)
        )


def apply_series(tree: Path, patches: Sequence[Patch]) -> None:
    """Apply the patches in order; stop at the first that fails."""
    for patch in patches:
        apply_patch(tree, patch)


def copy_overlay(repo: Path, tree: Path, *, symlink: bool = False) -> List[Path]:
    """Place the overlay files into ``tree`` (copies, or symlinks to the repo's
    files). An overlay file must not replace an upstream file."""
    placed: List[Path] = []
    for rel in overlay_files(repo):
        target = tree / rel
        if target.is_symlink():
            target.unlink()
        elif target.exists():
            raise ForkError(
                f"overlay file {rel} already exists upstream; changes to upstream "
                f"files belong in patches/, not in the overlay"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        if symlink:
            target.symlink_to((repo / rel).resolve())
        else:
            shutil.copy2(repo / rel, target)
        placed.append(rel)
    return placed


def build_source_tree(dest: Path, repo: Path = REPO_ROOT) -> Path:
    """Materialise the fork (upstream + patches + overlay) as plain files in
    ``dest`` (wiped first). Used by ``setup.py``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    patches = load_series(repo)
    extract_upstream(fetch_base_wheel(repo), dest)
    apply_series(dest, patches)
    copy_overlay(repo, dest)
    return dest


def diff_commit(tree: Path, commit: str) -> str:
    """The diff a commit introduces, in the form the patch files keep."""
    proc = git(
        [
            "diff",
            "--no-color",
            "--no-ext-diff",
            "--no-renames",
            "--src-prefix=a/",
            "--dst-prefix=b/",
            f"{commit}^",
            commit,
        ],
        tree,
    )
    return proc.stdout


def commit_all(tree: Path, message: str, *, allow_empty: bool = False) -> str:
    """Stage everything not ignored in ``tree`` and commit it; returns the sha."""
    git(["add", "-A"], tree)
    args = ["commit", "-q", "-F", "-"]
    if allow_empty:
        args.append("--allow-empty")
    git(args, tree, input=message)
    return git(["rev-parse", "HEAD"], tree).stdout.strip()


TREE_EXCLUDES: List[str] = [
    "/setup.py",
    "/build/",
    "*.egg-info/",
    "__pycache__/",
    "*.py[cod]",
    ".pytest_cache/",
    ".hypothesis/",
]


def init_upstream_repo(tree: Path, repo: Path = REPO_ROOT) -> None:
    """Create a git repo in ``tree`` whose first commit is pristine upstream,
    tagged ``upstream``."""
    base = load_base(repo)
    tree.mkdir(parents=True, exist_ok=True)
    git(["init", "-q"], tree)
    extract_upstream(fetch_base_wheel(repo), tree)
    commit_all(
        tree,
        f"{base.name} {base.version}: pristine upstream\n\n"
        f"Contents of {base.wheel} (sha256 {base.sha256}) without its .dist-info.\n",
    )
    git(["tag", UPSTREAM_TAG], tree)


def series_commits(tree: Path) -> List[str]:
    """Commits on top of the ``upstream`` tag, oldest first."""
    out = git(
        ["rev-list", "--reverse", "--first-parent", f"{UPSTREAM_TAG}..HEAD"], tree
    ).stdout
    return out.split()


def iter_tree_files(tree: Path) -> Iterator[Path]:
    """Files of a materialised tree (following symlinks), excluding git and
    build/cache by-products; relative paths."""
    for path in sorted(tree.rglob("*")):
        rel = path.relative_to(tree)
        if rel.parts[0] in {".git", "build"} or rel.as_posix() == "setup.py":
            continue
        if _ignored(rel) or rel.parts[0].endswith(".egg-info"):
            continue
        if path.is_file():
            yield rel

"""Core of the fork's patch workflow, shared by ``setup.py`` and ``tools/fork.py``.

The fork is three things on top of a pinned upstream release wheel:

* ``base.json``: the upstream wheels it is built on, the *bases* (name,
  version, file name, sha256), oldest first, and the default one;
* ``torchrec/``: files the fork adds, at their upstream paths (the *overlay*);
* ``patches/series`` + ``patches/*.patch``: changes to existing upstream files,
  one series for every base; where upstream's code differs on a base, that
  base's variant of a patch in ``patches/base-VERSION/`` (see
  :func:`load_patch`).

``patches/series`` is also the *stack*: the ordered list of commits the fork is
exported as (``tools/fork.py export``). Each entry is one patch file (a header
and a diff to upstream files, or a header only) plus the overlay files it
introduces (``#+ PATH`` lines below it) and, optionally, a diff to overlay
files introduced by earlier entries (``patches/NAME.overlay.diff``). See
:func:`parse_series`.

This module only uses the standard library and the ``git`` executable, so that
``setup.py`` can import it without any extra build requirement.
"""

from __future__ import annotations

import contextlib
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
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

REPO_ROOT: Path = Path(__file__).resolve().parent.parent
PACKAGE: str = "torchrec"
WHEEL_ENV: str = "TORCHREC_FORK_BASE_WHEEL"
# Which base of base.json to build on (its version, e.g. 1.8.0); unset: the
# default base.
BASE_ENV: str = "TORCHREC_FORK_BASE"
CACHE_ENV: str = "TORCHREC_FORK_CACHE_DIR"
# A git repository of upstream TorchRec (a clone): where the tools read a
# target's files (base.json's targets, e.g. main); unset: a stand-in.
UPSTREAM_GIT_ENV: str = "TORCHREC_FORK_UPSTREAM_GIT"
# Tool caches that may appear under torchrec/: never part of the overlay.
IGNORED_PARTS: frozenset = frozenset(
    {"__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", ".mypy_cache"}
)
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
    """
    An upstream tree the fork is built on or exported for: a pinned release
    wheel (a *base* proper), or upstream's git tree at a commit (a *target*,
    e.g. ``main``: no wheel, so nothing installs it; the stack is exported,
    checked and bisected there).

    Every base shares one series (``patches/series``) and one overlay. A
    patch is written once, in ``patches/``, for the default base (the newest
    release: what users install and, through it, upstream's main); where
    upstream's code differs on another base, its variant lives in that base's
    folder ``patches/base-VERSION/`` and serves that base and the older ones
    on the way from it, until one of them has a variant of its own (see
    :func:`base_chain`).

    Args:
        name (str): the distribution's name (``torchrec``).
        version (str): the release, e.g. ``1.1.0`` (a target: its name, e.g.
            ``main``).
        wheel (str): the wheel's file name (empty for a target).
        sha256 (str): the wheel's sha256 (hex; empty for a target).
        index (int): its place in ``base.json``: the releases oldest first,
            then the targets.
        default (bool): whether it is the base built when
            ``$TORCHREC_FORK_BASE`` is unset (its patches are the shared ones
            in ``patches/``).
        replaces (Tuple[str, ...]): overlay files that replace a file of the
            same path in upstream's git tree which the wheel lacks (e.g. a
            test module of upstream code the series removes on this base):
            the build never sees upstream's file, the export must replace it.
        requires (Tuple[str, ...]): what the base's wheel needs at run time
            besides what every base needs (``setup.py``'s install_requires).
        upstream_tree (Optional[str]): the list of upstream's git tree at the
            release (``tools/upstream-vVERSION-tree.txt``) that the exported
            stack applies to; None: no git tree is at hand and the wheel's
            tree is the reference.
        on (Optional[str]): for a target, the release whose patches it reads
            after its own variants and whose environment runs its code (the
            default base); None for a release.
    """

    name: str
    version: str
    wheel: str
    sha256: str
    index: int = 0
    default: bool = True
    replaces: Tuple[str, ...] = ()
    requires: Tuple[str, ...] = ()
    upstream_tree: Optional[str] = None
    on: Optional[str] = None

    @property
    def patches(self) -> str:
        """The folder of its own patches, relative to the repository: the
        shared ``patches`` for the default base, ``patches/base-VERSION``
        (its variants) for the others."""
        return SERIES_DIR if self.default else f"{SERIES_DIR}/base-{self.version}"

    @property
    def is_target(self) -> bool:
        """Whether it is upstream's git tree at a commit (no wheel)."""
        return self.on is not None


@dataclasses.dataclass(frozen=True)
class Patch:
    """
    One patch of the series as a base sees it: a header (subject and body)
    and a unified diff.

    Args:
        name (str): the entry's file name (``NAME.patch``).
        subject (str): the commit subject.
        body (str): the commit body.
        diff (str): the diff to upstream files (empty: a header-only entry).
        source (str): the file the diff comes from, relative to the
            repository (``patches/NAME.patch`` or a base's variant); empty
            for a patch made in memory.
    """

    name: str
    subject: str
    body: str
    diff: str
    source: str = ""

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

#: The folder of the series, the shared patches and the overlay diffs.
SERIES_DIR: str = "patches"


def load_bases(repo: Path = REPO_ROOT) -> List[BaseSpec]:
    """
    Every base ``base.json`` names: its ``bases`` list, the releases oldest
    first (each with ``name``, ``version``, ``wheel``, ``sha256`` and,
    optionally, ``requires``, ``replaces`` and ``upstream_tree``), then the
    targets (upstream's git tree at a commit: ``version``, ``on`` the
    release whose patches and environment it uses, ``upstream_tree``, and
    optionally ``replaces``), and its ``default``, the release built when
    nothing else is asked for.

    Args:
        repo (Path): the fork repository.

    Returns:
        List[BaseSpec]: the bases, in the file's order.

    Raises:
        ForkError: when two bases have the same version, the default is not
            a release of them, the releases are not listed oldest first, or
            a target is not listed after them, names no upstream tree or is
            not on the default release.
    """
    data = json.loads((repo / "base.json").read_text())
    default = data.get("default")
    bases = [
        BaseSpec(
            name=entry["name"],
            version=entry["version"],
            wheel=entry.get("wheel", ""),
            sha256=entry.get("sha256", "").lower(),
            index=k,
            default=entry["version"] == default,
            replaces=tuple(entry.get("replaces", ())),
            requires=tuple(entry.get("requires", ())),
            upstream_tree=entry.get("upstream_tree"),
            on=entry.get("on"),
        )
        for k, entry in enumerate(data["bases"])
    ]
    versions = [base.version for base in bases]
    releases = [base.version for base in bases if not base.is_target]
    if len(set(versions)) != len(versions):
        raise ForkError(f"base.json pins a version twice: {versions}")
    if default not in releases:
        raise ForkError(f"base.json: its default {default!r} is none of {releases}")
    if versions[: len(releases)] != sorted(releases, key=version_key):
        raise ForkError(
            f"base.json: list the releases oldest first, then the targets, not "
            f"{versions}"
        )
    for base in bases:
        if base.is_target and (base.on != default or not base.upstream_tree):
            raise ForkError(
                f"base.json: the target {base.version} must be 'on' the default "
                f"release {default} and name its 'upstream_tree'"
            )
        if not base.is_target and not (base.wheel and base.sha256):
            raise ForkError(f"base.json: the release {base.version} needs a wheel")
    return bases


def version_key(version: str) -> Tuple[int, ...]:
    """``1.10.0`` after ``1.9.2``: a release's numbers as a tuple."""
    return tuple(int(part) for part in re.findall(r"\d+", version))


def selected_base_version() -> Optional[str]:
    """The base ``$TORCHREC_FORK_BASE`` selects (None: the default base)."""
    return os.environ.get(BASE_ENV) or None


def load_base(repo: Path = REPO_ROOT, version: Optional[str] = None) -> BaseSpec:
    """
    The base to build on: ``version``, else the one ``$TORCHREC_FORK_BASE``
    names, else the default base of ``base.json``.

    Args:
        repo (Path): the fork repository.
        version (Optional[str]): a base's version (e.g. ``1.8.0``).

    Returns:
        BaseSpec: the base.

    Raises:
        ForkError: when ``base.json`` pins no base of that version.
    """
    bases = load_bases(repo)
    wanted = version or selected_base_version()
    if wanted is None:
        return next(base for base in bases if base.default)
    for base in bases:
        if base.version == wanted:
            return base
    raise ForkError(
        f"no base {wanted} in base.json (pinned: "
        f"{', '.join(base.version for base in bases)}); check {BASE_ENV} or --base"
    )


@contextlib.contextmanager
def selected_base(version: str) -> Iterator[None]:
    """Select a base for the tools (``$TORCHREC_FORK_BASE``) while the block
    runs, then restore the selection; for commands that work on every base."""
    saved = os.environ.get(BASE_ENV)
    os.environ[BASE_ENV] = version
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(BASE_ENV, None)
        else:
            os.environ[BASE_ENV] = saved


def series_dir(repo: Path = REPO_ROOT) -> Path:
    """``patches/``: the series, the shared patches and the overlay diffs."""
    return repo / SERIES_DIR


def patches_dir(repo: Path = REPO_ROOT) -> Path:
    """The folder of the selected base's own patches (see
    :attr:`BaseSpec.patches`): ``patches/`` for the default base."""
    return repo / load_base(repo).patches


def base_chain(repo: Path = REPO_ROOT, version: Optional[str] = None) -> List[BaseSpec]:
    """
    The base (``version``, else the selected one) and the bases whose
    patches it reads when it has no variant of its own, first match wins:
    itself, then the releases on the way to the default, then the default
    (whose patches are the shared ones). On 1.1.0: 1.1.0, 1.8.0, 1.9.2; on
    a target such as main: main, then the release it is on. A variant made
    for a base so serves the bases further from the default too, until one
    of them has its own.

    Args:
        repo (Path): the fork repository.
        version (Optional[str]): the base (default: the selected one).

    Returns:
        List[BaseSpec]: the chain, ending with the default base.
    """
    base = load_base(repo, version)
    bases = load_bases(repo)
    default = next(b for b in bases if b.default)
    if base.is_target:
        return [base] + base_chain(repo, base.on)
    step = 1 if base.index < default.index else -1
    return [
        b for b in bases[base.index : default.index + step : step] if not b.is_target
    ]


def patch_folders(repo: Path = REPO_ROOT) -> List[Path]:
    """
    Where the selected base looks for an entry's patch, first match wins:
    the folders of :func:`base_chain`, ending with the shared ``patches/``.
    """
    return [repo / b.patches for b in base_chain(repo)]


def fork_version(repo: Path = REPO_ROOT) -> str:
    """
    The fork's version on the selected base: the base's version with
    ``version.txt`` (the fork's own, e.g. ``reshard.0.2.0``) as its local
    part, e.g. ``1.9.2+reshard.0.2.0``.
    """
    local = (repo / "version.txt").read_text().strip()
    if not re.fullmatch(r"[a-z0-9]+(\.[a-z0-9]+)*", local):
        raise ForkError(
            f"version.txt ({local!r}) must be a PEP 440 local version label "
            f"(e.g. reshard.0.2.0): the base's version goes before it"
        )
    return f"{load_base(repo).version}+{local}"


@dataclasses.dataclass(frozen=True)
class SeriesEntry:
    """One entry of ``patches/series``: a patch file and the overlay files it
    introduces.

    Args:
        name (str): the patch file's name in ``patches/``.
        header_only (bool): listed as ``#= NAME`` (its file has a header and no
            diff on any base) instead of a plain ``NAME`` line.
        files (Tuple[str, ...]): overlay files (``torchrec/...``, as the ``#+``
            lines below the entry name them) the entry introduces.
        line (int): line number of the entry in ``patches/series``.
        deletes (Tuple[str, ...]): files of upstream's git tree that the base
            wheel lacks (tests, say) which the entry's exported commit deletes
            (``#-`` lines): no patch can, the build never sees them.
        bases (Optional[Tuple[str, ...]]): the bases the entry is on (a
            ``[VERSION ...]`` tag on its line); None: every base.
    """

    name: str
    header_only: bool
    files: Tuple[str, ...]
    line: int
    deletes: Tuple[str, ...] = ()
    bases: Optional[Tuple[str, ...]] = None


SERIES_HEADER_ONLY: str = "#="
#: The cover letter's template, beside the series (one for every base).
COVER_LETTER: str = "cover-letter.txt"
SERIES_FILE: str = "#+"
SERIES_DELETE: str = "#-"
OVERLAY_DIFF_SUFFIX: str = ".overlay.diff"
_BASE_TAG_RE = re.compile(r"\[([^\]]*)\]\s*$")


def _split_base_tag(text: str) -> Tuple[str, Optional[Tuple[str, ...]]]:
    """``'NAME [1.8.0 1.9.2]'`` -> ``('NAME', ('1.8.0', '1.9.2'))``; no tag:
    ``(text, None)``."""
    match = _BASE_TAG_RE.search(text)
    if match is None:
        return text.strip(), None
    return text[: match.start()].strip(), tuple(
        match.group(1).replace(",", " ").split()
    )


def parse_series_text(
    text: str, origin: str = "patches/series", base: Optional[str] = None
) -> List[SeriesEntry]:
    """
    Parse the text of ``patches/series``, one list for every base:

    * ``NAME.patch`` — an entry whose patch has a diff to upstream files
      (on some bases at least: a base's variant may be a header only);
    * ``#= NAME.patch`` — an entry whose patch file is a header only on
      every base (a commit that only adds or changes overlay files);
    * ``#+ PATH`` — an overlay file the entry above introduces;
    * ``#- PATH`` — a file of upstream's git tree that the base wheel lacks
      (so no patch can delete it), which the entry above deletes upstream:
      its exported commit removes it, by the blob id of upstream's tree;
    * a ``[VERSION ...]`` tag at the end of an entry's or a ``#-`` line: the
      bases it is on (none: every base);
    * any other ``#`` line, and blank lines, are comments.

    Args:
        text (str): the series file's text.
        origin (str): name used in error messages.
        base (Optional[str]): keep only what is on this base (None: every
            entry, with its tag).

    Returns:
        List[SeriesEntry]: the entries, in order.

    Raises:
        ForkError: on a ``#+`` or ``#-`` line before any entry, a repeated
            entry name, an empty tag, or a tag on an entry with overlay files.
    """
    entries: List[SeriesEntry] = []
    names: Set[str] = set()
    files: List[str] = []
    deletes: List[str] = []
    current: List[SeriesEntry] = []  # the entry whose lines are being read

    def on_base(tag: Optional[Tuple[str, ...]]) -> bool:
        return base is None or tag is None or base in tag

    def close() -> None:
        if current:
            entry = current.pop()
            if entry.bases is not None and files:
                raise ForkError(
                    f"{origin}:{entry.line}: {entry.name} is on some bases only, so "
                    f"it cannot introduce overlay files (the overlay is every "
                    f"base's): list them under an entry of every base"
                )
            if on_base(entry.bases):
                entries.append(
                    dataclasses.replace(
                        entry, files=tuple(files), deletes=tuple(deletes)
                    )
                )
        files.clear()
        deletes.clear()

    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        marker = next(
            (m for m in (SERIES_FILE, SERIES_DELETE) if stripped.startswith(m)), None
        )
        if marker is not None:
            if not current:
                raise ForkError(f"{origin}:{number}: '{stripped}' before any patch")
            path, tag = _split_base_tag(stripped[len(marker) :])
            if tag == ():
                raise ForkError(f"{origin}:{number}: an empty base tag")
            if path and (marker == SERIES_FILE or on_base(tag)):
                (files if marker == SERIES_FILE else deletes).append(path)
            continue
        header_only = stripped.startswith(SERIES_HEADER_ONLY)
        if header_only:
            rest = stripped[len(SERIES_HEADER_ONLY) :]
        elif stripped.startswith("#"):
            continue
        else:
            rest = stripped
        rest, tag = _split_base_tag(rest.split("#", 1)[0])
        name = rest.split()[0] if rest.split() else ""
        if not name:
            continue
        if tag == ():
            raise ForkError(f"{origin}:{number}: an empty base tag")
        if name in names:
            raise ForkError(f"{origin}:{number}: {name} is listed twice")
        names.add(name)
        close()
        current.append(SeriesEntry(name, header_only, (), number, (), tag))
    close()
    return entries


def parse_series(repo: Path = REPO_ROOT, every_base: bool = False) -> List[SeriesEntry]:
    """The entries of ``patches/series`` on the selected base (see
    :func:`parse_series_text`); with ``every_base``, every entry with its tag."""
    series = series_dir(repo) / "series"
    if not series.exists():
        return []
    base = None if every_base else load_base(repo).version
    return parse_series_text(series.read_text(), base=base)


#: The longest commit subject an entry may have (the exported mails' subjects).
MAX_SUBJECT = 100


def series_problems(repo: Path = REPO_ROOT) -> List[str]:
    """
    What is wrong with the one series across the bases, one message each:
    a base tag naming no base of ``base.json``, a patch file no entry (or no
    base) reads, a folder of no base, and a variant that is a copy of the
    file it stands in for.

    Args:
        repo (Path): the fork repository.

    Returns:
        List[str]: the problems (empty when the series is sound).
    """
    problems: List[str] = []
    bases = load_bases(repo)
    versions = {base.version for base in bases}
    text = (series_dir(repo) / "series").read_text()
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        marker = next(
            (
                m
                for m in (SERIES_HEADER_ONLY, SERIES_FILE, SERIES_DELETE)
                if stripped.startswith(m)
            ),
            None,
        )
        if marker is None and stripped.startswith("#"):
            continue
        body = stripped[len(marker) :] if marker else stripped
        _, tag = _split_base_tag(body.split("#", 1)[0])
        for version in tag or ():
            if version not in versions:
                problems.append(
                    f"patches/series:{number}: the tag names {version}, no base of "
                    f"base.json ({', '.join(sorted(versions, key=version_key))})"
                )
    entries = parse_series(repo, every_base=True)
    names = {entry.name for entry in entries}
    read: Set[Path] = set()
    for base in bases:
        with selected_base(base.version):
            for entry in parse_series(repo):
                try:
                    read.add(patch_file(repo, entry.name).resolve())
                except PatchError as exc:
                    problems.append(f"on torchrec {base.version}: {exc}")
    folders = {repo / base.patches: base for base in bases}
    for path in sorted(series_dir(repo).rglob("*")):
        rel = path.relative_to(repo).as_posix()
        if path.is_dir():
            if path not in folders:
                problems.append(f"{rel}/ is the folder of no base of base.json")
            continue
        if path.name == "series" or path.name.endswith(OVERLAY_DIFF_SUFFIX):
            continue
        if path.parent == series_dir(repo) and path.name == COVER_LETTER:
            continue
        if path.name not in names:
            problems.append(f"{rel} is no entry of patches/series")
        elif path.parent != series_dir(repo) and path.resolve() not in read:
            problems.append(f"{rel}: no base reads it (the entry is not on its base)")
    for base in bases:
        if base.default:
            continue
        folder = repo / base.patches
        behind = base_chain(repo, base.version)[1]
        for path in sorted(folder.glob("*.patch")):
            with selected_base(behind.version):
                try:
                    other = patch_file(repo, path.name)
                except PatchError:
                    continue
            if other.read_text() == path.read_text() or (
                _split_header(other)[1] == _split_header(path)[1]
                and not path.read_text().startswith("Subject:")
            ):
                problems.append(
                    f"{path.relative_to(repo)} is a copy of "
                    f"{other.relative_to(repo)}: a variant exists only where "
                    f"the diff differs; delete it"
                )
            elif base.is_target:
                with selected_base(base.version):
                    differing = target_differing_files(repo)
                problems += target_variant_problems(path, other, differing)
    return problems


def changed_lines_by_file(diff: str) -> Dict[str, List[str]]:
    """The lines a diff adds and removes (with their ``+``/``-``), by file,
    in order: what the diff changes, without where."""
    lines: Dict[str, List[str]] = {}
    current: Optional[List[str]] = None
    for line in diff.splitlines():
        header = _DIFF_GIT_RE.match(line)
        if header:
            current = lines.setdefault(header.group(2), [])
        elif current is not None and line[:1] in "+-":
            if not line.startswith(("+++ ", "--- ")):
                current.append(line)
    return lines


def target_variant_problems(
    variant: Path, other: Path, differing: Optional[Set[str]] = None
) -> List[str]:
    """
    A target's variant (main's, say) must make the change of the patch it
    stands in for, only against other code around it: the same lines added
    and removed in each file that patch changes. It may also change files
    the target has with other content than the release it is on
    (``differing``: a fix of upstream's the release has and the target
    lacks, say), and no others. Without upstream's files of the target at
    hand (CI), the target's stack is built with the patch it stands in for
    (see :func:`is_stand_in`), and what it checks holds for the variant
    too; the changes to the other files are checked by their blob ids
    (:func:`target_blob_problems`).

    Returns:
        List[str]: one message when they differ (empty when they do not).
    """
    mine = changed_lines_by_file(_split_header(variant)[1])
    theirs = changed_lines_by_file(_split_header(other)[1])
    extra = set(mine) - set(theirs) - (differing or set())
    if (
        variant.read_text().startswith("Subject:")
        or any(mine.get(rel) != lines for rel, lines in theirs.items())
        or extra
    ):
        return [
            f"{variant.parent.name}/{variant.name}: a target's variant makes "
            f"the change of {other.parent.name}/{other.name} against other "
            f"context (the same lines added and removed in its files, and "
            f"changes only to files the target has with other content; no "
            f"Subject: of its own): it differs"
            + (f" (it also changes {', '.join(sorted(extra))})" if extra else "")
        ]
    return []


def patch_file(repo: Path, name: str) -> Path:
    """
    The file of the entry ``name`` on the selected base: its variant in
    the base's folder or an older base's (see :func:`patch_folders`), else
    the shared ``patches/NAME``.

    Raises:
        PatchError: when there is none.
    """
    for folder in patch_folders(repo):
        if (folder / name).is_file():
            return folder / name
    raise PatchError(name, "listed in patches/series but the file is missing")


def readers(repo: Path, source: str) -> List[str]:
    """The bases that read the patch file ``source`` (relative to the
    repository), oldest first."""
    name = Path(source).name
    found: List[str] = []
    for base in load_bases(repo):
        with selected_base(base.version):
            if name not in {entry.name for entry in parse_series(repo)}:
                continue
            if patch_file(repo, name).relative_to(repo).as_posix() == source:
                found.append(base.version)
    return found


def parse_patch(path: Path) -> Patch:
    """Split a patch file into its ``Subject:`` header, body and diff (empty
    for a header-only patch)."""
    header, diff = _split_header(path)
    lines = header.splitlines()
    if not lines or not lines[0].startswith("Subject:"):
        raise PatchError(path.name, "the first line must be 'Subject: ...'")
    subject = lines[0][len("Subject:") :].strip()
    body = "\n".join(lines[1:]).strip("\n")
    return Patch(name=path.name, subject=subject, body=body, diff=diff)


def _split_header(path: Path) -> Tuple[str, str]:
    text = path.read_text()
    match = re.search(r"^diff --git ", text, flags=re.MULTILINE)
    if match is None:
        return text, ""
    return text[: match.start()], text[match.start() :]


def load_patch(repo: Path, name: str, *, stand_in: Optional[bool] = None) -> Patch:
    """
    The entry ``name``'s patch on the selected base. The shared
    ``patches/NAME`` (the default base's) holds its subject and body; each
    base's variant on the way to the selected base (see :func:`base_chain`)
    says why it differs in its header: paragraphs the commit message gets
    after the body so far, or a whole ``Subject:`` header of its own where
    the commit does something else on that base (tests only, say, where
    upstream already has the change). The diff is the last variant's.

    Args:
        repo (Path): the fork repository.
        name (str): the entry's patch file name.
        stand_in (Optional[bool]): on a target whose upstream files are not
            at hand (:func:`is_stand_in`; None: whether it is), read a
            variant of the target's own with the diff of the file it stands
            in for (its change, against the release's code: what the
            stand-in tree has); False: the target's own diff.

    Raises:
        PatchError: when a file is missing or a variant's header is empty.
    """
    shared_path = series_dir(repo) / name
    if not shared_path.is_file():
        raise PatchError(name, "listed in patches/series but the file is missing")
    patch = parse_patch(shared_path)
    source = shared_path
    folders = patch_folders(repo)
    for folder in reversed(folders[:-1]):
        path = folder / name
        if not path.is_file():
            continue
        source = path
        header, diff = _split_header(path)
        if header.startswith("Subject:"):
            patch = parse_patch(path)
            continue
        note = header.strip("\n")
        if not note.strip():
            raise PatchError(
                name,
                f"{path.relative_to(repo)} is a base's variant: its header must say "
                f"why it differs (paragraphs before the diff, or a Subject: header "
                f"of its own)",
            )
        body = (patch.body + "\n\n" if patch.body else "") + note
        patch = Patch(name, patch.subject, body, diff)
    if source.parent == folders[0] and (
        is_stand_in(repo) if stand_in is None else stand_in
    ):
        base = load_base(repo)
        if base.is_target:
            with selected_base(base.on or ""):
                other = load_patch(repo, name)
            patch = dataclasses.replace(patch, diff=other.diff)
            source = repo / other.source
    return dataclasses.replace(patch, source=source.relative_to(repo).as_posix())


def read_series(repo: Path = REPO_ROOT) -> List[str]:
    """Names of the patches with a diff on the selected base, in order of
    application."""
    return [patch.name for patch in load_series(repo)]


def load_series(repo: Path = REPO_ROOT) -> List[Patch]:
    """Every patch of the selected base's entries that has a diff, in order."""
    patches = [load_patch(repo, entry.name) for entry in parse_series(repo)]
    return [patch for patch in patches if patch.diff.strip()]


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


# --------------------------------------------------------------------------- stack


@dataclasses.dataclass(frozen=True)
class StackEntry:
    """
    One commit of the exported stack: an entry of ``patches/series`` with its
    contents.

    Args:
        patch (Patch): the patch file: commit message and diff to upstream files.
        header_only (bool): listed as ``#= NAME`` (no diff; quilt skips it).
        files (Tuple[str, ...]): overlay files the commit introduces.
        overlay_diff (str): the commit's changes to overlay files introduced by
            earlier entries (``patches/NAME.overlay.diff``; empty if none).
        deletes (Tuple[str, ...]): files of upstream's git tree the wheel
            lacks that the commit deletes upstream (``#-`` lines).
    """

    patch: Patch
    header_only: bool
    files: Tuple[str, ...]
    overlay_diff: str
    deletes: Tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The patch file's name."""
        return self.patch.name

    @property
    def overlay_deletions(self) -> Tuple[str, ...]:
        """Overlay files introduced by earlier entries that the commit deletes:
        the ``deleted file mode`` sections of its overlay diff (which keep the
        file's last content), in order."""
        return tuple(
            change.path
            for change in diff_changes(self.overlay_diff)
            if change.new_path is None
        )


@dataclasses.dataclass(frozen=True)
class FileChange:
    """
    What a diff does to one file.

    Args:
        old_path (Optional[str]): the file before (None: the diff creates it).
        new_path (Optional[str]): the file after (None: the diff deletes it).
        old_blob (Optional[str]): the pre-image blob id of the ``index`` line.
        new_blob (Optional[str]): the post-image blob id of the ``index`` line.
        added (int): lines added.
        removed (int): lines removed.
    """

    old_path: Optional[str]
    new_path: Optional[str]
    old_blob: Optional[str]
    new_blob: Optional[str]
    added: int
    removed: int

    @property
    def path(self) -> str:
        """The file's path (the old one for a deletion)."""
        return self.new_path or self.old_path or ""


_DIFF_GIT_RE = re.compile(r"^diff --git a/(.+?) b/(.+)$")
_HUNK_RE = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_INDEX_RE = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)")


def diff_changes(diff: str) -> List[FileChange]:
    """
    Args:
        diff (str): a ``git diff``-style diff (``diff --git`` sections); text
            before the first section (an e-mail header) is skipped.

    Returns:
        List[FileChange]: one per file, in order.
    """
    changes: List[FileChange] = []
    for section in re.split(r"^(?=diff --git )", diff, flags=re.MULTILINE):
        lines = section.splitlines()
        match = _DIFF_GIT_RE.match(lines[0]) if lines else None
        if match is None:
            continue
        old: Optional[str] = match.group(1)
        new: Optional[str] = match.group(2)
        old_blob: Optional[str] = None
        new_blob: Optional[str] = None
        added = removed = old_left = new_left = 0
        for line in lines[1:]:
            if old_left > 0 or new_left > 0:
                if line.startswith("+"):
                    added, new_left = added + 1, new_left - 1
                elif line.startswith("-"):
                    removed, old_left = removed + 1, old_left - 1
                elif not line.startswith("\\"):
                    old_left, new_left = old_left - 1, new_left - 1
                continue
            hunk = _HUNK_RE.match(line)
            index = _INDEX_RE.match(line)
            if hunk:
                old_left = int(hunk.group(1) if hunk.group(1) is not None else 1)
                new_left = int(hunk.group(2) if hunk.group(2) is not None else 1)
            elif index:
                old_blob, new_blob = index.group(1), index.group(2)
            elif line.startswith("new file mode"):
                old = None
            elif line.startswith("deleted file mode"):
                new = None
            elif line.startswith("-- "):
                break  # the e-mail signature after the last file
        changes.append(FileChange(old, new, old_blob, new_blob, added, removed))
    return changes


def overlay_diff_path(repo: Path, name: str) -> Path:
    """Where the entry ``name`` keeps its diff to overlay files introduced by
    earlier entries: ``patches/STEM.overlay.diff`` (one for every base: the
    overlay is every base's)."""
    stem = name[: -len(".patch")] if name.endswith(".patch") else name
    return series_dir(repo) / (stem + OVERLAY_DIFF_SUFFIX)


def load_stack(repo: Path = REPO_ROOT) -> List[StackEntry]:
    """Every entry of ``patches/series`` on the selected base, with its patch
    (see :func:`load_patch`) and overlay diff."""
    stack: List[StackEntry] = []
    for entry in parse_series(repo):
        extra = overlay_diff_path(repo, entry.name)
        stack.append(
            StackEntry(
                patch=load_patch(repo, entry.name),
                header_only=entry.header_only,
                files=entry.files,
                overlay_diff=extra.read_text() if extra.exists() else "",
                deletes=entry.deletes,
            )
        )
    return stack


def _apply_to_files(
    files: Mapping[str, bytes],
    diff: str,
    *,
    reverse: bool,
    what: str,
    paths: Sequence[str] = (),
) -> Dict[str, bytes]:
    """Apply ``diff`` (or its reverse) to ``files`` (path -> content) in a
    scratch directory; returns the new contents of the same paths and of
    ``paths`` (files the diff may create), those that exist afterwards (a
    file the diff deletes is left out)."""
    with tempfile.TemporaryDirectory(prefix="torchrec-fork-apply-") as tmp:
        root = Path(tmp)
        for rel, data in files.items():
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        args = ["apply", "--whitespace=nowarn", "-p1"] + (["-R"] if reverse else [])
        proc = git(args + ["-"], root, check=False, input=diff, isolate=True)
        if proc.returncode != 0:
            how = "in reverse to the overlay's files" if reverse else "forwards"
            raise ForkError(f"{what} does not apply {how}: {proc.stderr.strip()}")
        return {
            rel: (root / rel).read_bytes()
            for rel in (*files, *paths)
            if (root / rel).is_file()
        }


def overlay_deletions(
    repo: Path = REPO_ROOT, stack: Optional[Sequence[StackEntry]] = None
) -> Dict[str, int]:
    """
    The overlay files the stack deletes, each with the index of the entry
    whose overlay diff deletes it (a ``deleted file mode`` section), after
    checking the life of every overlay file: an entry introduces it (a
    ``#+`` line), later entries' overlay diffs may change it, and one may
    delete it; after that no entry touches it again or introduces it anew,
    and the overlay (the state after the last entry) no longer has it.

    Args:
        repo (Path): the fork repository.
        stack (Optional[Sequence[StackEntry]]): its stack (default: loaded).

    Returns:
        Dict[str, int]: path -> index in ``stack`` of the entry deleting it.

    Raises:
        ForkError: when an overlay diff creates a file, changes or deletes
            one that no earlier entry introduces or that an earlier entry
            deleted, or when an entry introduces a deleted file again or the
            overlay still has a deleted file.
    """
    stack = load_stack(repo) if stack is None else stack
    alive: Set[str] = set()
    deleted: Dict[str, int] = {}
    for k, entry in enumerate(stack):
        what = f"patches/{overlay_diff_path(repo, entry.name).name}"
        for rel in entry.files:
            if rel in deleted:
                raise ForkError(
                    f"{entry.name}: '{SERIES_FILE} {rel}' introduces a file that "
                    f"{stack[deleted[rel]].name} deletes: a deleted overlay file "
                    f"cannot come back; give the new file another path, or keep "
                    f"the old one instead of deleting it"
                )
        for change in diff_changes(entry.overlay_diff):
            rel = change.path
            does = "deletes" if change.new_path is None else "changes"
            if change.old_path is None:
                raise ForkError(
                    f"{what}: creates {rel}; an entry introduces a file with a "
                    f"'{SERIES_FILE} PATH' line in patches/series instead"
                )
            if rel in deleted:
                raise ForkError(
                    f"{what}: {does} {rel}, which {stack[deleted[rel]].name} "
                    f"deletes: no later entry may touch a deleted overlay file"
                )
            if rel in entry.files or rel not in alive:
                upstream = (
                    f" (an upstream file is deleted by a patch, or by a "
                    f"'{SERIES_DELETE} PATH' line where the wheel lacks it)"
                    if change.new_path is None
                    else ""
                )
                raise ForkError(
                    f"{what}: {does} {rel}, which no earlier entry of "
                    f"patches/series introduces{upstream}"
                )
            if change.new_path is None:
                alive.discard(rel)
                deleted[rel] = k
        alive.update(entry.files)
    for rel, k in deleted.items():
        if (repo / rel).exists():
            raise ForkError(
                f"{rel}: {stack[k].name} deletes it, but the overlay still has "
                f"the file: remove it from {PACKAGE}/ (the overlay is the state "
                f"after the last entry)"
            )
    return deleted


def stack_file_versions(
    repo: Path = REPO_ROOT, stack: Optional[Sequence[StackEntry]] = None
) -> List[Dict[str, bytes]]:
    """
    The overlay files each entry writes, with their content right after that
    entry: the files it introduces and those its overlay diff changes (not
    those it deletes: :attr:`StackEntry.overlay_deletions`). The
    repository's ``torchrec/`` files are the state after the last entry; an
    earlier state is the later one with the later overlay diffs undone (a
    deleted file comes back with the content its deletion shows).

    Args:
        repo (Path): the fork repository.
        stack (Optional[Sequence[StackEntry]]): its stack (default: loaded).

    Returns:
        List[Dict[str, bytes]]: per entry, path -> content.

    Raises:
        ForkError: when an overlay diff touches a file no earlier entry
            introduces (or one deleted before), creates a file, or does not
            apply, and where :func:`overlay_deletions` refuses the stack.
    """
    stack = load_stack(repo) if stack is None else stack
    overlay_deletions(repo, stack)
    current: Dict[str, bytes] = {}
    for entry in stack:
        for rel in entry.files:
            if (repo / rel).is_file():
                current[rel] = (repo / rel).read_bytes()
    writes: List[Dict[str, bytes]] = [{} for _ in stack]
    for k in reversed(range(len(stack))):
        entry = stack[k]
        what = f"patches/{overlay_diff_path(repo, entry.name).name}"
        changes = diff_changes(entry.overlay_diff)
        if entry.overlay_diff.strip() and not changes:
            raise ForkError(f"{what}: no 'diff --git' section found")
        changed = [c.path for c in changes if c.new_path is not None]
        removed = [c.path for c in changes if c.new_path is None]
        writes[k] = {
            rel: current[rel] for rel in (*entry.files, *changed) if rel in current
        }
        if changes:
            after = {rel: current[rel] for rel in changed if rel in current}
            before = _apply_to_files(
                after, entry.overlay_diff, reverse=True, what=what, paths=removed
            )
            again = _apply_to_files(
                before, entry.overlay_diff, reverse=False, what=what, paths=removed
            )
            if again != after:
                raise ForkError(
                    f"{what}: applying it does not give the overlay's files"
                )
            current.update(before)
        for rel in entry.files:
            current.pop(rel, None)
    return writes


def stack_problems(
    repo: Path = REPO_ROOT, stack: Optional[Sequence[StackEntry]] = None
) -> List[str]:
    """
    Everything wrong with the selected base's stack mapping, one message
    each: every overlay file must be introduced by exactly one entry (a
    file a later entry deletes too, which the overlay then lacks), plain
    entries must have a diff (but where a base's variant is a header only)
    and ``#=`` entries none, every entry needs a
    subject and a body and must change something, overlay diffs must apply.

    Args:
        repo (Path): the fork repository.
        stack (Optional[Sequence[StackEntry]]): its stack (default: loaded).

    Returns:
        List[str]: the problems (empty when the stack is sound).
    """
    stack = load_stack(repo) if stack is None else stack
    problems: List[str] = []
    overlay = {rel.as_posix() for rel in overlay_files(repo)}
    deleted = {rel for entry in stack for rel in entry.overlay_deletions}
    owner: Dict[str, str] = {}
    for entry in stack:
        name = entry.name
        for rel in entry.files:
            if rel in owner:
                problems.append(
                    f"{rel} is introduced twice: by {owner[rel]} and {name}"
                )
            owner.setdefault(rel, name)
            if rel not in overlay and rel not in deleted:
                problems.append(
                    f"{name}: '{SERIES_FILE} {rel}' names no file of the overlay "
                    f"(paths start with {PACKAGE}/)"
                )
        has_diff = bool(entry.patch.diff.strip())
        if entry.header_only and has_diff:
            problems.append(
                f"{name}: has a diff to upstream files ({entry.patch.source}), so "
                f"list it as a plain '{name}' line, not '{SERIES_HEADER_ONLY} {name}'"
            )
        if (
            not entry.header_only
            and not has_diff
            and not _diff_on_some_base(repo, name)
        ):
            problems.append(
                f"{name}: has no diff on any base, so list it as "
                f"'{SERIES_HEADER_ONLY} {name}' (a plain entry is header-only only "
                f"on the bases where upstream has its change)"
            )
        if not entry.patch.subject or not entry.patch.body:
            problems.append(f"{name}: needs a subject and a body (what and why)")
        if len(entry.patch.subject) > MAX_SUBJECT:
            problems.append(
                f"{name}: its subject has {len(entry.patch.subject)} characters, "
                f"more than {MAX_SUBJECT} (a commit subject says what in one line)"
            )
        if not has_diff and not entry.files and not entry.overlay_diff.strip():
            problems.append(f"{name}: changes nothing")
    for rel in sorted(overlay - set(owner)):
        problems.append(
            f"{rel} is in no stack entry: add '{SERIES_FILE} {rel}' below the "
            f"entry that introduces it in patches/series"
        )
    known = {
        overlay_diff_path(repo, entry.name).name
        for entry in parse_series(repo, every_base=True)
    }
    for path in sorted(series_dir(repo).glob("*" + OVERLAY_DIFF_SUFFIX)):
        if path.name not in known:
            problems.append(
                f"patches/{path.name} belongs to no entry of patches/series"
            )
    try:
        stack_file_versions(repo, stack)
    except ForkError as exc:
        problems.append(str(exc))
    return problems


def _diff_on_some_base(repo: Path, name: str) -> bool:
    """Whether the entry ``name``'s shared patch or a variant has a diff."""
    files = [series_dir(repo) / name]
    files += [path / name for path in sorted(series_dir(repo).glob("base-*"))]
    return any(path.is_file() and _split_header(path)[1].strip() for path in files)


def is_test_file(rel: str) -> bool:
    """Whether an overlay file is a test module pytest collects (``test_*.py``
    in a ``tests`` package)."""
    parts = rel.split("/")
    return (
        len(parts) >= 2
        and parts[-2] == "tests"
        and parts[-1].startswith("test_")
        and parts[-1].endswith(".py")
    )


def module_name(rel: str) -> Optional[str]:
    """The dotted module name of a ``.py`` file (``a/b/__init__.py`` -> ``a.b``)."""
    if not rel.endswith(".py"):
        return None
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


# --------------------------------------------------------------------------- upstream


@dataclasses.dataclass(frozen=True)
class UpstreamTree:
    """
    Upstream's git tree at the base's tag, as ``git ls-tree -r`` lists it.

    Args:
        tag (str): the tag (e.g. ``v1.1.0``).
        commit (str): the tag's commit.
        blobs (Dict[str, str]): path -> blob id of every file.
        modes (Dict[str, str]): path -> git file mode of every file
            (``100644``, ``100755``, ...).
    """

    tag: str
    commit: str
    blobs: Dict[str, str]
    modes: Dict[str, str] = dataclasses.field(default_factory=dict)


def upstream_tree_file(repo: Path = REPO_ROOT) -> Optional[Path]:
    """The list of upstream's git tree at the selected base's version,
    ``tools/upstream-v<version>-tree.txt``, if ``base.json`` says there is one
    (its ``upstream_tree``); None: no git tree of that release is at hand and
    the wheel's tree is the reference (see :func:`load_upstream_tree`)."""
    base = load_base(repo)
    if not base.upstream_tree:
        return None
    return repo / base.upstream_tree


def load_upstream_tree(repo: Path = REPO_ROOT) -> UpstreamTree:
    """
    Upstream's tree at the selected base: :func:`upstream_tree_file` (a
    header comment naming the tag and its commit, then ``mode type
    blob<TAB>path`` lines), or, for a base without one, the tree of its
    wheel (``commit`` empty: the export then names no base commit).

    Raises:
        ForkError: when the file is missing or malformed.
    """
    path = upstream_tree_file(repo)
    if path is None:
        base = load_base(repo)
        files = wheel_contents(fetch_base_wheel(repo))
        return UpstreamTree(
            tag=f"{base.name} {base.version} (its wheel; no git tree at hand)",
            commit="",
            blobs={rel: git_blob_id(data) for rel, data in files.items()},
            modes={rel: "100644" for rel in files},
        )
    if not path.is_file():
        raise ForkError(
            f"{path.relative_to(repo)} is missing: it lists upstream's git tree at "
            f"the base's tag (git ls-tree -r TAG, with a '# ... tag TAG (commit "
            f"SHA)' header)"
        )
    text = path.read_text()
    tag = re.search(r"\b(?:tag|branch) (\S+)", text)
    commit = re.search(r"\bcommit ([0-9a-f]{40})\b", text)
    if tag is None or commit is None:
        raise ForkError(f"{path.name}: the header must name 'tag TAG (commit SHA)'")
    blobs: Dict[str, str] = {}
    modes: Dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        meta, _, rel = line.partition("\t")
        fields = meta.split()
        if len(fields) != 3 or not rel:
            raise ForkError(f"{path.name}: malformed line {line!r}")
        if fields[1] == "blob":
            blobs[rel] = fields[2]
            modes[rel] = fields[0]
    return UpstreamTree(
        tag=tag.group(1), commit=commit.group(1), blobs=blobs, modes=modes
    )


def git_blob_id(data: bytes) -> str:
    """The id git gives a file with this content (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def upstream_problems(
    repo: Path,
    stack: Sequence[StackEntry],
    upstream: UpstreamTree,
    wheel_files: Mapping[str, bytes],
    replaces: Sequence[str] = (),
) -> List[str]:
    """
    Whether the stack applies to upstream's git tree: every file a patch
    changes must exist there with the wheel's content as its blob (the
    pre-image the patches were made against), no patch may create a file
    upstream has, and an overlay file upstream has must be identical to it
    (the export then leaves it out; the build needs it because the wheel
    lacks it) unless the stack deletes upstream's file first (the overlay's
    then replaces it): with a patch, or, for a file the wheel lacks, with a
    ``#-`` line, and then the base must declare that the overlay file
    replaces upstream's (``replaces``: an overlay file of the stack, in
    upstream's tree and not in the wheel). A ``#-`` line names a file of
    upstream's tree the wheel lacks, deleted once; an overlay diff deletes
    only overlay files upstream's tree lacks.

    Args:
        repo (Path): the fork repository.
        stack (Sequence[StackEntry]): its stack.
        upstream (UpstreamTree): upstream's tree at the base's tag.
        wheel_files (Mapping[str, bytes]): the base wheel's files.
        replaces (Sequence[str]): the base's ``replaces`` (base.json).

    Returns:
        List[str]: the problems (empty when the stack applies upstream).
    """
    problems: List[str] = []
    at = f"upstream's git tree at {upstream.tag}"
    # a stand-in's files (see is_stand_in) differ from upstream's where the
    # release's do: target_blob_problems checks the changes to those instead
    stand_in = is_stand_in(repo)
    created: Set[str] = set()
    # upstream files the stack deletes (a patch, or '#-' for files the wheel
    # lacks) -> the index of the entry that deletes them
    deleted: Dict[str, int] = {}
    for k, entry in enumerate(stack):
        for change in diff_changes(entry.patch.diff):
            if change.old_path is None:
                created.add(change.path)
                if change.path in upstream.blobs and change.path not in deleted:
                    problems.append(
                        f"{entry.name} creates {change.path}, which {at} already has"
                    )
                continue
            rel = change.old_path
            if change.new_path is None and rel not in created:
                deleted.setdefault(rel, k)
            if rel in created:
                continue
            if rel not in upstream.blobs:
                problems.append(f"{entry.name} changes {rel}, which {at} lacks")
            elif rel in wheel_files:
                blob = git_blob_id(wheel_files[rel])
                if blob != upstream.blobs[rel] and not stand_in:
                    problems.append(
                        f"{entry.name} changes {rel}: the wheel's copy (blob {blob}) "
                        f"is not the one in {at} (blob {upstream.blobs[rel]})"
                    )
        for rel in entry.deletes:
            where = f"{entry.name}: '{SERIES_DELETE} {rel}'"
            if rel in deleted or rel in created:
                problems.append(f"{where}: the stack already deletes or creates it")
            elif rel not in upstream.blobs:
                problems.append(f"{where}: {at} lacks it")
            elif rel in wheel_files:
                problems.append(
                    f"{where}: the wheel has it, so delete it with a patch instead"
                )
            else:
                deleted[rel] = k
    introduced = {rel: k for k, entry in enumerate(stack) for rel in entry.files}
    for entry in stack:
        for rel in entry.overlay_deletions:
            if rel in upstream.blobs:
                problems.append(
                    f"{entry.name} deletes the overlay file {rel}, which {at} "
                    f"has: delete upstream's file with a patch or a "
                    f"'{SERIES_DELETE} PATH' line instead"
                )
    for rel in replaces:
        if rel not in introduced:
            problems.append(f"base.json: 'replaces' names {rel}, no overlay file")
        elif rel not in upstream.blobs:
            problems.append(f"base.json: 'replaces' names {rel}, which {at} lacks")
        elif rel in wheel_files:
            problems.append(
                f"base.json: 'replaces' names {rel}, which the wheel has: delete "
                f"upstream's file with a patch instead"
            )
        elif rel not in deleted:
            problems.append(
                f"base.json: 'replaces' names {rel}, but no entry deletes upstream's "
                f"file: add '{SERIES_DELETE} {rel}' below the entry that removes "
                f"what it tests, or below {stack[introduced[rel]].name}"
            )
    for k, entry in enumerate(stack):
        for rel in entry.files:
            if rel not in upstream.blobs or not (repo / rel).is_file():
                continue
            if rel in deleted and (rel in replaces or rel in wheel_files):
                # the fork's file replaces upstream's, once that is gone
                if deleted[rel] > k:
                    problems.append(
                        f"{entry.name} introduces {rel} before "
                        f"{stack[deleted[rel]].name} deletes upstream's file"
                    )
                continue
            if rel in replaces:
                continue  # reported above: nothing deletes upstream's file
            blob = git_blob_id((repo / rel).read_bytes())
            if blob == upstream.blobs[rel]:
                continue
            if rel in deleted:
                problems.append(
                    f"overlay file {rel} replaces upstream's, which "
                    f"{stack[deleted[rel]].name} deletes: name it in base.json's "
                    f"'replaces'"
                )
            else:
                problems.append(
                    f"overlay file {rel} exists in {at} with other content "
                    f"(blob {upstream.blobs[rel]}): change it with a patch"
                )
    return problems


def target_differing_files(repo: Path = REPO_ROOT) -> Set[str]:
    """
    The files the selected target's tree has with other content than the
    wheel of the release it is on (empty for a release): where its stand-in
    differs from it (see :func:`is_stand_in`).
    """
    base = load_base(repo)
    if not base.is_target:
        return set()
    upstream = load_upstream_tree(repo)
    with selected_base(base.on or ""):
        release = wheel_contents(fetch_base_wheel(repo))
    return {
        rel
        for rel, data in release.items()
        if rel in upstream.blobs and git_blob_id(data) != upstream.blobs[rel]
    }


def target_blob_problems(repo: Path, upstream: UpstreamTree) -> List[str]:
    """
    On a target (see :attr:`BaseSpec.is_target`), for each file that
    upstream's tree has with other content than the release it is on: every
    patch of the target's series that changes it was made against the
    target's own file (a variant of the target's): its ``index`` line's
    pre-image is upstream's blob (the file's first change) or the post-image
    of the change before. Read from the patch files alone, so it holds on a
    stand-in too (:func:`is_stand_in`), where those files are not at hand.

    Args:
        repo (Path): the fork repository, a target selected.
        upstream (UpstreamTree): the target's tree.

    Returns:
        List[str]: the problems (none on a release).
    """
    base = load_base(repo)
    if not base.is_target:
        return []
    current = {rel: upstream.blobs[rel] for rel in target_differing_files(repo)}
    problems: List[str] = []
    for entry in parse_series(repo):
        patch = load_patch(repo, entry.name, stand_in=False)
        for change in diff_changes(patch.diff):
            rel = change.old_path
            if rel is None or rel not in current:
                continue
            before, expected = change.old_blob or "", current[rel]
            if not before or not (
                expected.startswith(before) or before.startswith(expected)
            ):
                problems.append(
                    f"{entry.name} ({patch.source}) changes {rel} from blob "
                    f"{before or '?'}, not from {expected[:12]}: {rel} differs "
                    f"between {base.on} and {base.version}, so the change is "
                    f"{base.version}'s own variant, made on its file (refresh "
                    f"--variant in a tree materialised with {UPSTREAM_GIT_ENV})"
                )
            current[rel] = change.new_blob or ""
    return problems


def wheel_contents(wheel: Path) -> Dict[str, bytes]:
    """The wheel's files (without its ``.dist-info``), path -> content."""
    contents: Dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            top = info.filename.split("/", 1)[0]
            if info.is_dir() or top.endswith(".dist-info"):
                continue
            contents[info.filename] = archive.read(info)
    return contents


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
    if base.is_target:
        raise BaseWheelError(
            f"torchrec {base.version} is upstream's git tree, a target of the "
            f"export: it has no wheel to build on (build on torchrec {base.on})"
        )
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


def upstream_git_dir() -> Optional[Path]:
    """A git repository of upstream's history (``$TORCHREC_FORK_UPSTREAM_GIT``:
    a clone, bare or not), from which a target's files are read; None when
    the variable is unset."""
    value = os.environ.get(UPSTREAM_GIT_ENV)
    return Path(value) if value else None


def is_stand_in(repo: Path = REPO_ROOT) -> bool:
    """
    Whether the selected base is a target (upstream's git tree at a commit,
    e.g. main) whose files are not at hand (no ``$TORCHREC_FORK_UPSTREAM_GIT``).
    Its tree is then a stand-in: the files of the release it is on, and its
    own variants read with the diffs they stand in for (they make the same
    changes, :func:`target_variant_problems`). What does not depend on
    upstream's content is checked as for any base (the series, the stack,
    its sizes, the blob ids of upstream's tree); exporting, materialising
    and bisect-checking need the target's own files.
    """
    return load_base(repo).is_target and upstream_git_dir() is None


def require_own_files(repo: Path, what: str) -> None:
    """
    Refuse ``what`` on a stand-in (see :func:`is_stand_in`).

    Raises:
        ForkError: naming the variable that gives the target's files.
    """
    if is_stand_in(repo):
        base = load_base(repo)
        raise ForkError(
            f"{what} on torchrec {base.version} needs upstream's files of that "
            f"tree: set {UPSTREAM_GIT_ENV} to a clone of upstream TorchRec that "
            f"has commit {load_upstream_tree(repo).commit}"
        )


def read_git_blobs(git_dir: Path, blobs: Mapping[str, str]) -> Dict[str, bytes]:
    """
    The contents of ``blobs`` (path -> blob id) from the git repository
    ``git_dir`` (one ``git cat-file --batch``).

    Raises:
        ForkError: when the repository lacks one of them.
    """
    paths = sorted(blobs)
    proc = subprocess.run(
        ["git", f"--git-dir={git_dir}", "cat-file", "--batch"],
        input="".join(blobs[rel] + "\n" for rel in paths).encode(),
        capture_output=True,
    )
    if proc.returncode != 0:
        raise ForkError(
            f"git cat-file failed in {git_dir}: {proc.stderr.decode().strip()}"
        )
    out = proc.stdout
    contents: Dict[str, bytes] = {}
    at = 0
    for rel in paths:
        end = out.index(b"\n", at)
        header = out[at:end].decode().split()
        if len(header) != 3 or header[1] != "blob":
            raise ForkError(
                f"{git_dir} lacks blob {blobs[rel]} ({rel}); fetch upstream's "
                f"history into it"
            )
        size = int(header[2])
        contents[rel] = out[end + 1 : end + 1 + size]
        at = end + 1 + size + 1
    return contents


def base_files(repo: Path = REPO_ROOT) -> Dict[str, bytes]:
    """
    The selected base's upstream files (path -> content), the tree the
    series applies to: a release's wheel (without its ``.dist-info``); a
    target's ``torchrec/`` files of upstream's git tree, read by their blob
    ids from ``$TORCHREC_FORK_UPSTREAM_GIT``, but the ones its series
    deletes with ``#-`` lines (as the wheels lack them: the export deletes
    them by blob id), or, without that repository, the stand-in (see
    :func:`is_stand_in`): the wheel of the release it is on.

    Raises:
        ForkError: when the wheel or a blob cannot be had.
    """
    base = load_base(repo)
    if not base.is_target:
        return wheel_contents(fetch_base_wheel(repo))
    git_dir = upstream_git_dir()
    if git_dir is None:
        with selected_base(base.on or ""):
            return wheel_contents(fetch_base_wheel(repo))
    upstream = load_upstream_tree(repo)
    deleted = {rel for entry in parse_series(repo) for rel in entry.deletes}
    wanted = {
        rel: blob
        for rel, blob in upstream.blobs.items()
        if rel.startswith(PACKAGE + "/") and rel not in deleted
    }
    return read_git_blobs(git_dir, wanted)


def extract_base(repo: Path, dest: Path) -> None:
    """Write the selected base's upstream files (:func:`base_files`) into
    ``dest``, executables as such."""
    base = load_base(repo)
    if not base.is_target:
        extract_upstream(fetch_base_wheel(repo), dest)
        return
    modes = load_upstream_tree(repo).modes if not is_stand_in(repo) else {}
    for rel, data in base_files(repo).items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        if modes.get(rel) == "100755":
            target.chmod(0o755)


def describe_base(repo: Path = REPO_ROOT) -> str:
    """What the selected base's tree is, for commit messages and logs."""
    base = load_base(repo)
    if not base.is_target:
        return f"{base.wheel} (sha256 {base.sha256}) without its .dist-info"
    upstream = load_upstream_tree(repo)
    if is_stand_in(repo):
        on = load_base(repo, base.on)
        return (
            f"a stand-in for upstream's {upstream.tag} (commit {upstream.commit}): "
            f"{on.wheel}'s files ({UPSTREAM_GIT_ENV} is unset)"
        )
    return (
        f"upstream's git tree at {upstream.tag} (commit {upstream.commit}), its "
        f"{PACKAGE}/ files, from {upstream_git_dir()}"
    )


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
    """Apply one patch to ``tree``; raise :class:`PatchError` naming the patch,
    the base, the failing file and hunk when it does not apply cleanly."""
    if not patch.diff.strip():
        return
    args = ["apply", "--whitespace=nowarn", "-p1"]
    if index:
        args.append("--index")
    proc = git(args + ["-"], tree, check=False, input=patch.diff, isolate=not index)
    if proc.returncode != 0:
        stderr = proc.stderr.strip()
        where = f"on torchrec {load_base().version}"
        source = f" ({patch.source})" if patch.source else ""
        hunk = failing_hunk(patch.diff, stderr)
        raise PatchError(
            patch.name,
            f"does not apply {where}{source}"
            + (f", hunk {hunk}" if hunk else "")
            + f": {stderr}",
            file=_failing_file(stderr),
        )


def failing_hunk(diff: str, stderr: str) -> Optional[str]:
    """The ``@@`` line of the hunk ``git apply`` names in ``stderr`` (its
    "patch failed: FILE:LINE"), or None."""
    match = re.search(r"patch failed: ([^:\n]+):(\d+)", stderr)
    if match is None:
        return None
    rel, line = match.group(1), int(match.group(2))
    current = None
    for text in diff.splitlines():
        header = _DIFF_GIT_RE.match(text)
        if header:
            current = header.group(2)
            continue
        hunk = re.match(r"^@@ -(\d+)", text)
        if hunk and current == rel and int(hunk.group(1)) == line:
            return text
    return None


def normalized_diff(diff: str) -> str:
    """
    A diff without what depends on where upstream's lines sit: ``index``
    lines (blob ids) and the ranges and function names of ``@@`` lines. Two
    bases whose code around a change is the same read one patch file; it is
    in refreshed form on each when a fresh diff there normalises to the same.
    """
    lines = []
    for line in diff.splitlines():
        if line.startswith("index ") or line.startswith("@@ "):
            lines.append(line.split(" ", 1)[0])
        else:
            lines.append(line)
    return "\n".join(lines)


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
        elif target.is_file() and target.read_bytes() == (repo / rel).read_bytes():
            continue  # upstream's tree has the file (a package's __init__.py)
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
    base = load_base(repo)
    if base.is_target:
        raise ForkError(
            f"torchrec {base.version} is upstream's git tree, a target of the "
            f"export: the fork builds on a release (torchrec {base.on})"
        )
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    patches = load_series(repo)
    extract_base(repo, dest)
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
    ".ruff_cache/",
    ".mypy_cache/",
]


def init_upstream_repo(tree: Path, repo: Path = REPO_ROOT) -> None:
    """Create a git repo in ``tree`` whose first commit is pristine upstream,
    tagged ``upstream``."""
    base = load_base(repo)
    tree.mkdir(parents=True, exist_ok=True)
    git(["init", "-q"], tree)
    extract_base(repo, tree)
    commit_all(
        tree,
        f"{base.name} {base.version}: pristine upstream\n\n"
        f"Contents of {describe_base(repo)}.\n",
    )
    git(["tag", UPSTREAM_TAG], tree)


def series_commits(tree: Path) -> List[str]:
    """Commits on top of the ``upstream`` tag, oldest first."""
    out = git(
        ["rev-list", "--reverse", "--first-parent", f"{UPSTREAM_TAG}..HEAD"], tree
    ).stdout
    return out.split()


def entry_commits(tree: Path, entries: int) -> List[str]:
    """
    The commits on top of the ``upstream`` tag, oldest first, one per entry
    of the series.

    Args:
        tree (Path): a materialised tree (or the stack as a git repository).
        entries (int): how many entries the series has on this base.

    Returns:
        List[str]: the commits.

    Raises:
        ForkError: when the tree has another number of commits.
    """
    commits = series_commits(tree)
    if len(commits) != entries:
        raise ForkError(
            f"{tree} has {len(commits)} commits over '{UPSTREAM_TAG}' but "
            f"patches/series has {entries} entries; re-run 'materialize --force' "
            "(or rebuild the stack)"
        )
    return commits


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

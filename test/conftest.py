"""Fixtures of the fork-level tests (series integrity, packaging, tooling)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

REPO: Path = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools import forklib  # noqa: E402


def has_upstream_reshard() -> bool:
    """Whether the installed fork's base (the one the scripts build:
    $TORCHREC_FORK_BASE, else base.json's default) has upstream's own reshard
    API, which the series then runs on the fork's engine (1.8.0 and later:
    the bases with the entry that removes upstream's implementation)."""
    entries = forklib.parse_series(REPO)
    return any(e.name == "remove-upstream-dynamic-sharding.patch" for e in entries)


#: test/upstream_api/ calls upstream's public reshard API on the installed
#: fork: collected on the bases that have it only. (A conftest.py of its own
#: would shadow this module, which the tests import as ``conftest``.)
collect_ignore_glob: List[str] = [] if has_upstream_reshard() else ["upstream_api/*"]

#: What a build of the fork reads from the repository.
BUILD_INPUTS = (
    "setup.py",
    "pyproject.toml",
    "base.json",
    "version.txt",
    "README.md",
    "tools",
    "patches",
    "torchrec",
)


def copy_repo(dest: Path) -> Path:
    """Copy the build inputs of this checkout into ``dest``."""
    ignore = shutil.ignore_patterns(
        "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache", ".mypy_cache"
    )
    dest.mkdir(parents=True, exist_ok=True)
    for name in BUILD_INPUTS:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture
def repo_copy(tmp_path: Path) -> Iterator[Path]:
    """A throw-away copy of the repository's build inputs."""
    yield copy_repo(tmp_path / "repo")


@pytest.fixture(scope="session")
def base_wheel() -> Path:
    """The verified upstream wheel (fetched or from the cache)."""
    return forklib.fetch_base_wheel(REPO)


def run_fork(
    repo: Path, *args: str, env_base: Optional[str] = None
) -> subprocess.CompletedProcess:
    """
    Run tools/fork.py of ``repo`` as a user would.

    Args:
        repo (Path): the repository (or a copy of its build inputs).
        *args (str): the command line.
        env_base (Optional[str]): $TORCHREC_FORK_BASE for the run ("": unset);
            None keeps this process's.

    Returns:
        subprocess.CompletedProcess: the finished run, output captured.
    """
    env = dict(os.environ)
    if env_base is not None:
        env.pop(forklib.BASE_ENV, None)
        if env_base:
            env[forklib.BASE_ENV] = env_base
    return subprocess.run(
        [sys.executable, str(repo / "tools" / "fork.py"), *args],
        cwd=repo,
        capture_output=True,
        text=True,
        env=env,
    )


@pytest.fixture
def default_base(monkeypatch: pytest.MonkeyPatch) -> None:
    """Select the default base, whose patches are the shared ones in patches/
    (a test names another base with --base)."""
    default = next(b for b in forklib.load_bases(REPO) if b.default)
    monkeypatch.setenv(forklib.BASE_ENV, default.version)


def release_versions() -> List[str]:
    """The releases of base.json (its bases with a wheel), oldest first."""
    return [b.version for b in forklib.load_bases(REPO) if not b.is_target]


def all_versions() -> List[str]:
    """Every base of base.json: the releases, then the targets (main)."""
    return [b.version for b in forklib.load_bases(REPO)]

"""The installed fork and the base pin."""

import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from conftest import REPO
from tools import forklib


def test_version_names_the_base() -> None:
    base = forklib.load_base(REPO)
    version = forklib.fork_version(REPO)
    assert version.startswith(f"{base.version}+")
    assert base.wheel.startswith(f"{base.name}-{base.version}-")


def test_installed_torchrec_is_the_fork() -> None:
    assert importlib.metadata.version("torchrec") == forklib.fork_version(REPO)
    import torchrec

    location = Path(torchrec.__file__).resolve()
    for source_dir in (REPO / "torchrec", REPO / "build"):
        assert source_dir not in location.parents, f"not the installed fork: {location}"


def test_installed_fork_imports_every_added_module() -> None:
    modules = forklib.overlay_modules(REPO)
    assert modules, "the overlay adds no module"
    for name in modules:
        module = importlib.import_module(name)
        rel = Path(*name.split("."))
        src = REPO / (
            rel / "__init__.py" if (REPO / rel).is_dir() else rel.with_suffix(".py")
        )
        installed = Path(module.__file__)
        assert (
            installed.read_bytes() == src.read_bytes()
        ), f"{name}: the installed module differs from {src}; rebuild the fork"


def test_installed_fork_lacks_the_deleted_overlay_files() -> None:
    """An overlay file that an entry of the stack deletes (or moves away) is
    not installed."""
    import torchrec

    root = Path(torchrec.__file__).resolve().parent.parent
    deleted = [rel for e in forklib.load_stack(REPO) for rel in e.overlay_deletions]
    assert deleted, "no entry deletes an overlay file"
    for rel in deleted:
        assert not (REPO / rel).exists(), rel
        assert not (root / rel).exists(), f"{rel} is installed; rebuild the fork"


def build_wheel(repo: Path, out: Path) -> Dict[str, bytes]:
    """Build the fork's wheel with pip into ``out``; returns its files."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["-q", "-w", str(out), str(repo)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("torchrec-*.whl")
    return forklib.wheel_contents(wheel)


def test_a_rebuild_leaves_out_a_file_the_overlay_no_longer_has(
    repo_copy: Path, tmp_path: Path
) -> None:
    """A build after an overlay file is deleted does not pack the copy an
    earlier build left in the build folders."""
    rel = "torchrec/distributed/resharding/zz_deleted.py"
    (repo_copy / rel).write_text('"""Deleted before the second build."""\n')
    assert rel in build_wheel(repo_copy, tmp_path / "first")
    (repo_copy / rel).unlink()
    files = build_wheel(repo_copy, tmp_path / "second")
    assert rel not in files
    kept = "torchrec/distributed/resharding/__init__.py"
    assert files[kept] == (repo_copy / kept).read_bytes()


def _changed_lines(diff: str) -> List[Tuple[str, str, str]]:
    """(file, "+" or "-", line) of every added or removed line of a diff."""
    out: List[Tuple[str, str, str]] = []
    current = None
    for line in diff.splitlines():
        if line.startswith("+++ b/"):
            current = line[len("+++ b/") :]
        elif line.startswith(("+++", "---")):
            continue
        elif line.startswith(("+", "-")) and line[1:].strip():
            assert current is not None
            out.append((current, line[0], line[1:]))
    return out


def test_installed_fork_carries_the_patches() -> None:
    """Every line a patch adds is in the installed file, unless a later patch
    of the series takes that very line out again (a stack may revise in a
    later commit what an earlier one added)."""
    import torchrec

    root = Path(torchrec.__file__).resolve().parent.parent
    series = forklib.load_series(REPO)
    patches = [_changed_lines(patch.diff) for patch in series]
    for i, (name, changes) in enumerate(zip([p.name for p in series], patches)):
        revised = {
            (f, line)
            for later in patches[i + 1 :]
            for f, op, line in later
            if op == "-"
        }
        for rel, op, line in changes:
            if op != "+" or (rel, line) in revised:
                continue
            assert line in (root / rel).read_text(), f"{name}: {line!r} missing"


def test_metadata_pulls_no_torch_or_fbgemm() -> None:
    requires = importlib.metadata.requires("torchrec") or []
    unconditional = [r for r in requires if "extra ==" not in r]
    for req in unconditional:
        name = (
            req.split(";")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower()
        )
        assert not name.startswith(("torch", "fbgemm")) or name == "torchmetrics", req


def tampered_copy(base_wheel: Path, dest: Path) -> Path:
    """The base wheel with one extra byte, under its pinned file name."""
    dest.mkdir(parents=True, exist_ok=True)
    copy = dest / base_wheel.name
    shutil.copyfile(base_wheel, copy)
    with open(copy, "ab") as handle:
        handle.write(b"\0")
    return copy


def test_tampered_wheel_is_refused(
    base_wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tampered_copy(base_wheel, tmp_path / "explicit")
    monkeypatch.setenv(forklib.WHEEL_ENV, str(bad))
    with pytest.raises(forklib.BaseWheelError, match="sha256"):
        forklib.fetch_base_wheel(REPO)
    monkeypatch.delenv(forklib.WHEEL_ENV)
    tampered_copy(base_wheel, tmp_path / "cache")
    monkeypatch.setenv(forklib.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(forklib.BaseWheelError, match="refusing"):
        forklib.fetch_base_wheel(REPO)


def test_build_refuses_tampered_wheel(
    base_wheel: Path, repo_copy: Path, tmp_path: Path
) -> None:
    bad = tampered_copy(base_wheel, tmp_path / "bad")
    env = dict(os.environ, **{forklib.WHEEL_ENV: str(bad)})
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path / "wheels"), str(repo_copy)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "refusing to build" in output and forklib.load_base(REPO).sha256 in output


@pytest.mark.parametrize(
    "version",
    [b.version for b in forklib.load_bases(REPO) if not (b.default or b.is_target)],
)
def test_every_other_base_builds(version: str, repo_copy: Path, tmp_path: Path) -> None:
    """pip builds the fork on each base besides the installed default one
    (TORCHREC_FORK_BASE selects it): a wheel versioned <base>+<local> with the
    overlay's modules and every line the base's patches add."""
    env = dict(os.environ, **{forklib.BASE_ENV: version})
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["-q", "-w", str(tmp_path / "wheels"), str(repo_copy)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with forklib.selected_base(version):
        expected = forklib.fork_version(REPO)
        series = forklib.load_series(REPO)
    (wheel,) = (tmp_path / "wheels").glob("torchrec-*.whl")
    assert wheel.name.startswith(f"torchrec-{expected}-")
    files = forklib.wheel_contents(wheel)
    for rel in forklib.overlay_files(REPO):
        if rel.suffix == ".py":
            assert files[rel.as_posix()] == (REPO / rel).read_bytes(), rel
    for patch in series:
        for rel, op, line in _changed_lines(patch.diff):
            if op == "+" and rel in files and line not in files[rel].decode():
                # a later patch of the series may take the line out again
                later = series[series.index(patch) + 1 :]
                assert any(
                    (rel, "-", line) in _changed_lines(p.diff) for p in later
                ), f"{patch.name}: {line!r} missing in {rel}"

"""Build the TorchRec fork: pinned upstream wheel + overlay + patch series.

``pip install .`` runs this file: it fetches the wheel of base.json's default
base (from $TORCHREC_FORK_BASE_WHEEL, ~/.cache/torchrec-fork/ or pip),
verifies its sha256, extracts it into build/fork-src/, applies the patches of
patches/series in order (each entry's variant for that base where it has
one), copies the files under torchrec/ and packages the result as
``torchrec``, versioned ``<base>+<version.txt>``.

``TORCHREC_FORK_BASE=1.1.0 pip install .`` builds on another base of
base.json instead: its wheel, the same series read for that base, the same
overlay, in build/fork-src-1.1.0/.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Dict, List

from setuptools import find_packages, setup

HERE: Path = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tools import forklib  # noqa: E402


def source_dir(base: forklib.BaseSpec) -> Path:
    """Where the fork is materialised for ``base`` (one folder per base)."""
    name = "fork-src" if base.default else f"fork-src-{base.version}"
    return HERE / "build" / name


def package_data(src: Path, packages: List[str]) -> Dict[str, List[str]]:
    """Non-Python files shipped inside each package (as upstream ships them)."""
    data: Dict[str, List[str]] = {}
    for package in packages:
        pkg_dir = src.joinpath(*package.split("."))
        files = [
            path.name
            for path in pkg_dir.iterdir()
            if path.is_file() and path.suffix not in (".py", ".pyc")
        ]
        if files:
            data[package] = sorted(files)
    return data


def main() -> None:
    """Materialise the fork and hand it to setuptools."""
    try:
        base = forklib.load_base(HERE)
        src = source_dir(base)
        forklib.build_source_tree(src, HERE)
        version = forklib.fork_version(HERE)
    except forklib.ForkError as exc:
        sys.exit(f"torchrec fork build failed: {exc}")
    # setuptools' build folder keeps what earlier builds copied into it and
    # packs it all: a file the overlay no longer has would be installed again
    build_base = src.parent / f"setuptools-{src.name}"
    if build_base.exists():
        shutil.rmtree(build_base)
    readme = HERE / "README.md"
    packages = find_packages(str(src), include=["torchrec", "torchrec.*"])
    setup(
        name="torchrec",
        version=version,
        description=f"TorchRec {base.version} with live resharding of sharded embeddings",
        long_description=readme.read_text() if readme.exists() else "",
        long_description_content_type="text/markdown",
        license="BSD-3-Clause",
        python_requires=">=3.11",
        package_dir={"": str(src.relative_to(HERE))},
        packages=packages,
        package_data=package_data(src, packages),
        # setuptools' own build folder, one per base too: build/lib would
        # otherwise carry the other base's modules into this one's wheel
        options={"build": {"build_base": str(build_base)}},
        # torch and fbgemm come from the extras (or are installed beforehand), so
        # that a CPU machine never pulls a CUDA build.
        install_requires=[
            "torchmetrics==1.0.3",
            "tqdm",
            "pyre-extensions",
            "iopath",
            "scipy",  # the rebalancer's rank relabelling (linear_sum_assignment)
        ]
        + list(base.requires),
        extras_require={
            "cpu": ["torch==2.13.0", "fbgemm-gpu-cpu==1.8.0"],
            "cuda": ["torch==2.13.0", "fbgemm-gpu==1.8.0"],
            "test": ["pytest", "hypothesis", "numpy", "scipy"],
        },
    )


main()

"""What the example and benchmark scripts may import, read from their source
with ``ast`` (nothing is imported or run): an example is what a user copies,
so it uses the public API only, never TorchRec's or the fork's test code; and
every benchmark script builds on ``benchmarks/common.py``."""

import ast
from pathlib import Path
from typing import List

import pytest
from conftest import REPO

EXAMPLES: List[Path] = sorted((REPO / "examples").glob("*.py"))
BENCHMARKS: List[Path] = sorted(
    p for p in (REPO / "benchmarks").glob("*.py") if p.name != "common.py"
)
#: package names that hold test code, not API
TEST_PACKAGES = frozenset({"test_utils", "tests"})


def imported_modules(path: Path) -> List[str]:
    """
    Every module a script imports, anywhere in it (functions included): for
    ``from a.b import c`` both ``a.b`` and ``a.b.c`` (``c`` may be a module).

    Args:
        path (Path): the script.

    Returns:
        List[str]: the dotted names.
    """
    names: List[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_there_are_examples_and_benchmarks() -> None:
    assert EXAMPLES and BENCHMARKS


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_imports_no_test_code(path: Path) -> None:
    """No module of a ``test_utils`` or ``tests`` package, however imported."""
    test_code = [
        name for name in imported_modules(path) if TEST_PACKAGES & set(name.split("."))
    ]
    assert not test_code, f"{path.name} imports test code: {test_code}"


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_imports_common(path: Path) -> None:
    """Output options, results files and rank set-up come from ``common``."""
    assert "common" in {
        name.split(".")[0] for name in imported_modules(path)
    }, f"{path.name} does not import benchmarks/common.py"


def test_the_check_sees_test_code(tmp_path: Path) -> None:
    """The import parse catches each way of naming test code."""
    script = tmp_path / "script.py"
    for line, caught in (
        ("from torchrec.distributed.test_utils.reshard_utils import x", True),
        ("from torchrec.distributed import test_utils", True),
        ("import torchrec.distributed.tests.test_model as m", True),
        ("def f():\n    from torchrec.distributed.test_utils import y", True),
        ("from torchrec.distributed.resharding import dry_run", False),
    ):
        script.write_text(line + "\n")
        names = imported_modules(script)
        assert bool([n for n in names if TEST_PACKAGES & set(n.split("."))]) == (
            caught
        ), line

"""
Every commit of the 1.8.0 stack works on its own (``tools/fork.py --base
1.8.0 bisect-check``): at each entry of patches/base-1.8.0/series, on torchrec
1.8.0, the fork imports and the entry's own tests pass, those of the entries
the 1.8.0 series has of its own (the removal of upstream's resharding) too.

Bounded as on 1.1.0 (test/test_bisect.py): every in-package test runs once
more, at the commit that introduces it, each entry within
``stack.BISECT_ENTRY_TIMEOUT_S``; it runs in the 1.8.0 part of ``.ci/run``
(collected on that base only, with its venv's interpreter). The tests that
.ci/tests-1.8.0.txt deselects on 1.8.0 (``!NAME`` lines, each with its
reason) are deselected here too.
"""

from typing import List

from conftest import REPO
from tools import forklib, stack


def deselected() -> List[str]:
    """The tests .ci/tests-1.8.0.txt deselects on 1.8.0."""
    names: List[str] = []
    for line in (REPO / ".ci" / "tests-1.8.0.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("!"):
            names.append(line[1:].strip())
    return names


def test_every_commit_of_the_1_8_0_stack_passes_its_own_tests() -> None:
    assert forklib.load_base(REPO).version == "1.8.0"
    names = deselected()
    pytest_args = ["-k", " and ".join(f"not {n}" for n in names)] if names else []
    lines: List[str] = []
    results = stack.bisect_check(REPO, pytest_args=pytest_args, log=lines.append)
    assert [r.name for r in results] == [e.name for e in forklib.load_stack(REPO)]
    failed = [r for r in results if not r.ok]
    assert not failed, (
        "\n".join(lines)
        + "\n\n"
        + "\n\n".join(f"==== {r.name}: {r.reason}\n{r.output[-4000:]}" for r in failed)
    )

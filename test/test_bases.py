"""Three releases and a target, one series, one overlay: base.json pins
torchrec 1.1.0, 1.8.0 and 1.9.2 (oldest first; its "default", 1.9.2, is built
when nothing else is asked for) and names upstream's main at a commit (a
target: exported, checked and bisected, never installed), selected with
TORCHREC_FORK_BASE or tools/fork.py --base. Every entry's patch is written
once in patches/, for the default base; where upstream's code differs, a
base's variant in patches/base-VERSION/ serves that base and the older ones
on the way from it (main: its own variants, then the shared patches)."""

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from conftest import all_versions, REPO, run_fork
from tools import fork, forklib, stack

VERSIONS = ["1.1.0", "1.8.0", "1.9.2"]
#: The releases and the target the series is exported for.
EVERY = VERSIONS + ["main"]


@pytest.fixture
def no_base_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(forklib.BASE_ENV, raising=False)


def test_base_json_pins_three_wheels_oldest_first_then_main(no_base_env: None) -> None:
    bases = forklib.load_bases(REPO)
    assert [(b.version, b.patches, b.index) for b in bases] == [
        ("1.1.0", "patches/base-1.1.0", 0),
        ("1.8.0", "patches/base-1.8.0", 1),
        ("1.9.2", "patches", 2),
        ("main", "patches/base-main", 3),
    ]
    releases = [b for b in bases if not b.is_target]
    for base in releases:
        assert base.name == "torchrec" and base.on is None
        assert base.wheel == f"torchrec-{base.version}-py311-none-any.whl"
        assert len(base.sha256) == 64
    (main,) = [b for b in bases if b.is_target]
    assert (main.on, main.wheel, main.sha256, main.default) == ("1.9.2", "", "", False)
    assert [b.version for b in bases if b.default] == [forklib.load_base(REPO).version]
    assert forklib.load_base(REPO).version == "1.9.2"
    assert [b.upstream_tree for b in bases] == [
        "tools/upstream-v1.1.0-tree.txt",
        "tools/upstream-v1.8.0-tree.txt",
        None,  # no git tree of 1.9.2 is at hand: its wheel is the reference
        "tools/upstream-main-376cac6a-tree.txt",
    ]
    with forklib.selected_base("main"):
        tree = forklib.load_upstream_tree(REPO)
    assert (tree.tag, tree.commit) == (
        "main",
        "376cac6ad13c3a6e7fd43cc0fe432abbc7c39f7d",
    )


def test_base_json_refuses_a_bad_target(repo_copy: Path) -> None:
    """A target is listed after the releases, on the default release, with
    the list of upstream's tree it is."""
    path = repo_copy / "base.json"
    data = json.loads(path.read_text())
    good = json.dumps(data)
    data["bases"][3]["on"] = "1.8.0"
    path.write_text(json.dumps(data))
    with pytest.raises(forklib.ForkError, match="must be 'on' the default"):
        forklib.load_bases(repo_copy)
    data = json.loads(good)
    data["bases"].insert(0, data["bases"].pop())
    path.write_text(json.dumps(data))
    with pytest.raises(forklib.ForkError, match="releases oldest first, then"):
        forklib.load_bases(repo_copy)


def test_a_target_has_no_wheel_and_builds_nothing(
    monkeypatch: pytest.MonkeyPatch, repo_copy: Path, tmp_path: Path
) -> None:
    monkeypatch.setenv(forklib.BASE_ENV, "main")
    with pytest.raises(forklib.BaseWheelError, match="no wheel"):
        forklib.fetch_base_wheel(REPO)
    with pytest.raises(forklib.ForkError, match="builds on a release"):
        forklib.build_source_tree(tmp_path / "src", REPO)
    proc = run_fork(repo_copy, "develop", env_base="main")
    assert proc.returncode == 1 and "nothing installs it" in proc.stderr


def test_environment_selects_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    local = (REPO / "version.txt").read_text().strip()
    for version in VERSIONS:
        monkeypatch.setenv(forklib.BASE_ENV, version)
        base = forklib.load_base(REPO)
        assert base.version == version
        assert forklib.fork_version(REPO) == f"{version}+{local}"
    monkeypatch.setenv(forklib.BASE_ENV, "1.8.0")
    assert forklib.load_upstream_tree(REPO).tag == "release/v1.8.0"
    assert forklib.patch_folders(REPO) == [
        REPO / "patches" / "base-1.8.0",
        REPO / "patches",
    ]
    chains = {v: [b.version for b in forklib.base_chain(REPO, v)] for v in EVERY}
    assert chains == {
        "1.1.0": ["1.1.0", "1.8.0", "1.9.2"],
        "1.8.0": ["1.8.0", "1.9.2"],
        "1.9.2": ["1.9.2"],
        "main": ["main", "1.9.2"],
    }
    # an explicit version wins over the environment
    assert forklib.load_base(REPO, "1.1.0").version == "1.1.0"


def test_a_base_without_a_git_tree_has_its_wheel_as_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(forklib.BASE_ENV, "1.9.2")
    assert forklib.upstream_tree_file(REPO) is None
    tree = forklib.load_upstream_tree(REPO)
    wheel = forklib.wheel_contents(forklib.fetch_base_wheel(REPO))
    assert tree.commit == "" and "wheel" in tree.tag
    assert tree.blobs == {rel: forklib.git_blob_id(data) for rel, data in wheel.items()}


def test_unknown_base_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(forklib.BASE_ENV, "9.9.9")
    with pytest.raises(forklib.ForkError, match="no base 9.9.9 in base.json"):
        forklib.load_base(REPO)
    proc = run_fork(REPO, "check", env_base="9.9.9")
    assert proc.returncode == 1 and "no base 9.9.9" in proc.stderr


def test_each_base_has_its_own_trees(no_base_env: None) -> None:
    for base in forklib.load_bases(REPO):
        tree = fork.base_dir(fork.DEFAULT_TREE, base)
        if base.default:
            assert tree == fork.DEFAULT_TREE
        else:
            assert tree.name == f"tree-{base.version}"


def test_one_series_no_copies(no_base_env: None) -> None:
    """One list of entries; a variant exists only where its diff differs from
    the file it stands in for, and every patch file is read by some base."""
    assert not (REPO / "patches" / "base-1.8.0" / "series").exists()
    assert forklib.series_problems(REPO) == []
    texts: Dict[str, Path] = {}
    for path in sorted((REPO / "patches").rglob("*")):
        if path.is_file():
            other = texts.setdefault(path.read_text(), path)
            assert other == path, f"{path} is a copy of {other}"


def test_the_same_entries_on_every_base_but_the_tagged_ones() -> None:
    """Every base has the entries of the series in its order, each introducing
    the same overlay files; an entry tagged for some bases (the removal of
    upstream's resharding, which 1.1.0 lacks) is on those only, introduces no
    overlay file and has tests its patch adds."""
    every = forklib.parse_series(REPO, every_base=True)
    for version in EVERY:
        with forklib.selected_base(version):
            entries = forklib.load_stack(REPO)
        on = [e for e in every if e.bases is None or version in e.bases]
        assert [(e.name, e.files) for e in entries] == [(e.name, e.files) for e in on]
    tagged = [e for e in every if e.bases is not None]
    assert [(e.name, e.bases) for e in tagged] == [
        ("remove-upstream-dynamic-sharding.patch", ("1.8.0", "1.9.2", "main"))
    ]
    with forklib.selected_base("1.9.2"):
        (entry,) = [e for e in forklib.load_stack(REPO) if e.name == tagged[0].name]
    assert entry.patch.diff and not entry.files and not entry.overlay_diff
    assert stack.entry_tests({}, entry.patch.diff)
    # the '#-' line is on 1.8.0 only: 1.9.2's reference, its wheel, lacks the file
    assert entry.deletes == ()
    for version in ("1.8.0", "main"):
        with forklib.selected_base(version):
            stack_ = forklib.load_stack(REPO)
        (entry,) = [e for e in stack_ if e.name == tagged[0].name]
        assert entry.deletes == (
            "torchrec/distributed/tests/test_dynamic_sharding.py",
        ), version


def test_variants_serve_older_bases_and_say_why(
    no_base_env: None, repo_copy: Path
) -> None:
    """The shared patch is the default base's (1.9.2); 1.1.0 reads 1.8.0's
    variant where it has none of its own; a variant's commit message is the
    shared one plus why it differs, or a header of its own."""
    name = "reshard-dmp-whole-plan.patch"
    messages = {}
    for version in VERSIONS:
        with forklib.selected_base(version):
            messages[version] = forklib.load_patch(REPO, name)
    assert messages["1.9.2"].source == messages["1.8.0"].source == f"patches/{name}"
    assert messages["1.1.0"].source == f"patches/base-1.1.0/{name}"
    assert messages["1.8.0"].diff == messages["1.9.2"].diff != messages["1.1.0"].diff
    shared = messages["1.9.2"]
    assert messages["1.1.0"].subject == shared.subject
    assert messages["1.1.0"].body.startswith(shared.body + "\n\nOn torchrec 1.1.0")
    # a chain: 1.1.0's own variant adds its reason after 1.8.0's
    name = "train-pipeline-sparse-dist-across-reshards.patch"
    with forklib.selected_base("1.8.0"):
        body18 = forklib.load_patch(REPO, name).body
    with forklib.selected_base("1.1.0"):
        patch = forklib.load_patch(REPO, name)
    assert body18.startswith(
        forklib.load_patch(REPO, name).body + "\n\nOn torchrec 1.8.0"
    )
    assert patch.source == f"patches/base-1.1.0/{name}"
    assert patch.body.startswith(body18 + "\n\nOn torchrec 1.1.0")
    # 1.8.0's variant serves 1.1.0 where 1.1.0 has none of its own
    (repo_copy / "patches" / "base-1.1.0" / name).unlink()
    with forklib.selected_base("1.1.0"):
        patch = forklib.load_patch(repo_copy, name)
    assert patch.source == f"patches/base-1.8.0/{name}" and patch.body == body18
    # a header of its own: on 1.1.0 the compat entry makes the fix; on the
    # releases after it, upstream has it and the entry only adds its tests
    name = "compat-fbgemm-1.8-optimizer-learning-rate.patch"
    with forklib.selected_base("1.9.2"):
        patch = forklib.load_patch(REPO, name)
    assert patch.diff == "" and patch.subject.startswith("Test the base")
    with forklib.selected_base("1.1.0"):
        patch = forklib.load_patch(REPO, name)
    assert patch.diff and patch.subject.startswith("Read the fused optimizer")


def test_main_reads_its_own_variants_or_stands_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """main reads its own variant where main's code around a change differs
    from 1.9.2's (the same lines added and removed, another context); without
    upstream's files at hand the stand-in reads the diff it stands in for."""
    name = "batched-kernels-build-hooks.patch"
    monkeypatch.setenv(forklib.BASE_ENV, "main")
    monkeypatch.setenv(forklib.UPSTREAM_GIT_ENV, "/no/such/repository")
    own = forklib.load_patch(REPO, name)
    assert own.source == f"patches/base-main/{name}"
    assert own.body.endswith("the new imports sit among other lines.")
    monkeypatch.delenv(forklib.UPSTREAM_GIT_ENV)
    assert forklib.is_stand_in(REPO)
    stand_in = forklib.load_patch(REPO, name)
    with forklib.selected_base("1.9.2"):
        shared = forklib.load_patch(REPO, name)
    assert stand_in.source == f"patches/{name}"
    assert (stand_in.message, stand_in.diff) == (own.message, shared.diff)
    assert forklib.changed_lines_by_file(own.diff) == forklib.changed_lines_by_file(
        shared.diff
    )
    assert own.diff != shared.diff


def test_a_target_variant_must_make_the_same_change(repo_copy: Path) -> None:
    """A main variant that adds a line the patch it stands in for does not is
    refused: the stand-in could not vouch for it."""
    path = repo_copy / "patches" / "base-main" / "batched-kernels-build-hooks.patch"
    text = path.read_text()
    path.write_text(
        text.replace("+import contextlib\n", "+import contextlib\n+import os\n")
    )
    problems = forklib.series_problems(repo_copy)
    assert any("a target's variant makes the change" in p for p in problems), problems


def test_a_target_variant_may_bring_a_fix_the_target_lacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """main lacks a fix of upstream's that the 1.9.2 wheel has
    (collective_utils.py broadcasts from a global rank there): main's
    variant of fix-broadcast-source-on-subgroup changes that file too. A
    variant may change more than the patch it stands in for only in files
    main has with other content than 1.9.2."""
    name = "fix-broadcast-source-on-subgroup.patch"
    variant = REPO / "patches" / "base-main" / name
    rel = "torchrec/distributed/collective_utils.py"
    assert rel in forklib.changed_lines_by_file(forklib._split_header(variant)[1])
    monkeypatch.setenv(forklib.BASE_ENV, "main")
    differing = forklib.target_differing_files(REPO)
    assert rel in differing
    shared = REPO / "patches" / name
    assert forklib.target_variant_problems(variant, shared, differing) == []
    (problem,) = forklib.target_variant_problems(variant, shared, set())
    assert f"it also changes {rel}" in problem


def test_main_variants_carry_mains_blob_ids(
    monkeypatch: pytest.MonkeyPatch, repo_copy: Path
) -> None:
    """Every change main makes to a file upstream's main has with other
    content than 1.9.2's starts from main's blob (the tree's list), or from
    the change before: checked from the patch files alone (CI has no copy of
    main's files). A shared patch read there instead is named."""
    monkeypatch.setenv(forklib.BASE_ENV, "main")
    monkeypatch.delenv(forklib.UPSTREAM_GIT_ENV, raising=False)
    upstream = forklib.load_upstream_tree(REPO)
    assert forklib.target_blob_problems(REPO, upstream) == []
    name = "reshard-dmp-whole-plan.patch"
    (repo_copy / "patches" / "base-main" / name).unlink()
    problems = forklib.target_blob_problems(repo_copy, upstream)
    assert problems and name in problems[0] and "model_parallel.py" in problems[0]
    assert all("model_parallel.py" in p for p in problems)


def test_series_applies_and_is_refreshed_on_every_base() -> None:
    """tools/fork.py check: the one series applies to every base's wheel, is
    refreshed there, covers the overlay and applies upstream."""
    proc = run_fork(REPO, "check", env_base="")
    assert proc.returncode == 0, proc.stderr
    for version in VERSIONS:
        assert f"OK on torchrec {version}:" in proc.stdout
    assert "OK on torchrec main" in proc.stdout
    proc = run_fork(REPO, "--base", "1.9.2", "check")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("OK on torchrec") == 1


def readers(repo: Path) -> Dict[str, List[str]]:
    """Patch file (relative path) -> the bases that read it, for the files
    with a diff."""
    found: Dict[str, List[str]] = {}
    for version in EVERY:
        with forklib.selected_base(version):
            for patch in forklib.load_series(repo):
                found.setdefault(patch.source, []).append(version)
    return found


def test_a_broken_shared_patch_fails_check_naming_the_base_and_hunk(
    repo_copy: Path,
) -> None:
    """A patch file several bases read (the removal of upstream's resharding,
    and shared patches 1.8.0 has no variant of), broken: check fails on each
    of those bases, naming it, the patch and the hunk; the bases that do not
    read it pass (main reads the shared file where it has no variant, or as
    the stand-in it is without upstream's files)."""
    shared = {rel: bases for rel, bases in readers(repo_copy).items() if len(bases) > 1}
    assert "patches/remove-upstream-dynamic-sharding.patch" in shared
    assert "patches/reshard-dmp-whole-plan.patch" in shared
    for rel in (
        "patches/remove-upstream-dynamic-sharding.patch",
        "patches/reshard-dmp-whole-plan.patch",
    ):
        original = (repo_copy / rel).read_text()
        first = forklib.diff_changes(original)[0].path
        hunk = break_hunk(repo_copy / rel, first)
        name = Path(rel).name
        for version in EVERY:
            proc = run_fork(repo_copy, "--base", version, "check")
            if version not in shared[rel]:
                assert proc.returncode == 0, (rel, version, proc.stderr)
                continue
            assert proc.returncode == 1, (rel, version)
            assert f"patch {name}" in proc.stderr, proc.stderr
            assert f"does not apply on torchrec {version} ({rel})" in proc.stderr
            assert f"hunk {hunk}" in proc.stderr, proc.stderr
        proc = run_fork(repo_copy, "check")  # every base: stops at the first
        assert proc.returncode == 1 and f"on torchrec {shared[rel][0]}" in proc.stderr
        (repo_copy / rel).write_text(original)


def break_hunk(patch: Path, path: str) -> str:
    """Corrupt a context line of the first hunk of ``path`` in ``patch``;
    returns that hunk's ``@@`` line."""
    lines = patch.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith(f"+++ b/{path}"))
    hunk = next(i for i in range(start, len(lines)) if lines[i].startswith("@@"))
    for i in range(hunk + 1, len(lines)):
        if lines[i].startswith(" ") and lines[i].strip():
            lines[i] = " # context that upstream does not have\n"
            break
    patch.write_text("".join(lines))
    return lines[hunk].rstrip("\n")


def test_copies_and_orphans_are_reported(repo_copy: Path) -> None:
    name = "reshard-generation.patch"
    (repo_copy / "patches" / "base-1.8.0" / name).write_text(
        (repo_copy / "patches" / name).read_text()
    )
    (repo_copy / "patches" / "base-1.8.0" / "no-such-entry.patch").write_text("x\n")
    (repo_copy / "patches" / "base-9.9.9").mkdir()
    problems = forklib.series_problems(repo_copy)
    assert any("base-1.8.0/reshard-generation.patch is a copy" in p for p in problems)
    assert any("no-such-entry.patch is no entry" in p for p in problems)
    assert any("base-9.9.9/ is the folder of no base" in p for p in problems)
    proc = run_fork(repo_copy, "check")
    assert proc.returncode == 1 and "is a copy of" in proc.stderr


def test_series_grammar_of_base_tags() -> None:
    text = (
        "a.patch\n"
        "#+ torchrec/a.py\n"
        "b.patch  [1.8.0 1.9.2]\n"
        "#- torchrec/tests/test_old.py  [1.8.0]\n"
        "#= c.patch\n"
        "#+ torchrec/c.py\n"
    )
    every = forklib.parse_series_text(text)
    assert [(e.name, e.bases, e.deletes) for e in every] == [
        ("a.patch", None, ()),
        ("b.patch", ("1.8.0", "1.9.2"), ("torchrec/tests/test_old.py",)),
        ("c.patch", None, ()),
    ]
    on = {v: forklib.parse_series_text(text, base=v) for v in VERSIONS}
    assert [e.name for e in on["1.1.0"]] == ["a.patch", "c.patch"]
    assert on["1.1.0"][0].files == ("torchrec/a.py",)
    assert on["1.1.0"][1].files == ("torchrec/c.py",)
    assert [(e.name, e.deletes) for e in on["1.9.2"]] == [
        ("a.patch", ()),
        ("b.patch", ()),
        ("c.patch", ()),
    ]
    assert on["1.8.0"][1].deletes == ("torchrec/tests/test_old.py",)
    with pytest.raises(forklib.ForkError, match="cannot introduce overlay files"):
        forklib.parse_series_text("a.patch [1.8.0]\n#+ torchrec/a.py\n")
    with pytest.raises(forklib.ForkError, match="empty base tag"):
        forklib.parse_series_text("a.patch []\n")


def test_port_makes_a_variant_where_a_patch_does_not_apply(
    repo_copy: Path, tmp_path: Path
) -> None:
    """tools/fork.py port: applies a base's series entry by entry; at a patch
    that does not apply it stops with what applies in place; --continue -m
    writes the hand-made change as the base's variant, which check accepts."""
    name = "reshard-ebc-seed-api.patch"
    variant = repo_copy / "patches" / "base-1.8.0" / name
    variant.unlink()  # 1.8.0 now reads 1.9.2's patch, which does not apply there
    tree = tmp_path / "port"
    proc = run_fork(repo_copy, "--base", "1.8.0", "port", str(tree))
    assert proc.returncode == 1
    assert f"{name} is applied in" in proc.stdout, proc.stdout + proc.stderr
    # do by hand what the 1.8.0 variant did: apply it over what applied
    forklib.git(["checkout", "-q", "--", "."], tree)
    forklib.git(["clean", "-fdq"], tree)
    proc = subprocess.run(
        ["git", "apply", "-p1", "-"],
        cwd=tree,
        input=forklib._split_header(REPO / "patches" / "base-1.8.0" / name)[1],
        text=True,
        capture_output=True,
    )
    assert proc.returncode == 0, proc.stderr
    proc = run_fork(
        repo_copy, "--base", "1.8.0", "port", str(tree), "--continue", "-m", "Why."
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert variant.read_text().startswith("Why.\n\ndiff --git ")
    proc = run_fork(repo_copy, "--base", "1.8.0", "check")
    assert proc.returncode == 0, proc.stderr


def test_replaces_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """base.json's 'replaces' exempts an overlay file from the 'exists
    upstream' check only when it is an overlay file of the stack that
    upstream's tree has and the wheel lacks."""
    monkeypatch.setenv(forklib.BASE_ENV, "1.8.0")
    stack_ = forklib.load_stack(REPO)
    upstream = forklib.load_upstream_tree(REPO)
    wheel = forklib.wheel_contents(forklib.fetch_base_wheel(REPO))
    replaces = forklib.load_base(REPO).replaces
    assert replaces == ("torchrec/distributed/tests/test_dynamic_sharding.py",)
    assert forklib.upstream_problems(REPO, stack_, upstream, wheel, replaces) == []
    problems = forklib.upstream_problems(REPO, stack_, upstream, wheel, ())
    assert len(problems) == 1 and replaces[0] in problems[0]
    bad = ("torchrec/not_overlay.py", "torchrec/distributed/embeddingbag.py")
    problems = forklib.upstream_problems(REPO, stack_, upstream, wheel, replaces + bad)
    assert any("names torchrec/not_overlay.py, no overlay file" in p for p in problems)
    # not an overlay file either, so that is the message: both are refused
    assert any("torchrec/distributed/embeddingbag.py" in p for p in problems)


def test_upstream_deletions_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A '#-' line deletes a file of upstream's tree that the wheel lacks, no
    later than the entry that brings the overlay file replacing it."""
    monkeypatch.setenv(forklib.BASE_ENV, "1.8.0")
    entries = forklib.load_stack(REPO)
    upstream = forklib.load_upstream_tree(REPO)
    wheel = forklib.wheel_contents(forklib.fetch_base_wheel(REPO))
    replaces = forklib.load_base(REPO).replaces
    rel = replaces[0]
    index = {e.name: k for k, e in enumerate(entries)}
    remove = index["remove-upstream-dynamic-sharding.patch"]
    adds = index["reshard-ebc-seed-api.patch"]
    assert entries[remove].deletes == (rel,)

    def problems(deletes: Dict[int, Tuple[str, ...]]) -> List[str]:
        stack_ = [
            dataclasses.replace(e, deletes=deletes.get(k, ()))
            for k, e in enumerate(entries)
        ]
        return forklib.upstream_problems(REPO, stack_, upstream, wheel, replaces)

    assert problems({remove: (rel,)}) == []
    assert problems({adds: (rel,)}) == []  # deleted and replaced in one commit
    (missing,) = problems({})
    assert f"add '#- {rel}'" in missing
    (late,) = problems({adds + 1: (rel,)})
    assert "reshard-ebc-seed-api.patch introduces" in late
    (twice,) = problems({remove: (rel,), adds: (rel,)})
    assert "already deletes" in twice
    (in_wheel,) = problems({remove: (rel, "torchrec/distributed/embeddingbag.py")})
    assert "the wheel has it" in in_wheel
    (lacking,) = problems({remove: (rel, "torchrec/no_such_file.py")})
    assert "lacks it" in lacking


def test_ci_names_every_in_package_test_module() -> None:
    """.ci/bases.txt says what .ci/run runs on each base; every in-package
    test module runs on some base installed (the default base's suite), and
    every module it names exists (a test module the series' patches add
    counts too)."""
    modules = {
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for path in (REPO / "torchrec").rglob("tests/test_*.py")
    }
    for version in VERSIONS:
        with forklib.selected_base(version):
            for entry in forklib.load_stack(REPO):
                for rel in stack.entry_tests({}, entry.patch.diff):
                    modules.add(rel[: -len(".py")].replace("/", "."))
    plan = ci_plan()
    assert {section.split()[0] for section in plan} == set(EVERY)

    def covers(line: str, module: str) -> bool:
        name = line.split("::", 1)[0]
        return module == name or module.startswith(name + ".")

    for version, lines in plan.items():
        for line in lines:
            if line.startswith("torchrec."):
                assert any(covers(line, m) for m in modules), f"{version}: {line}"
            elif not line.startswith("!"):
                assert (REPO / line).exists(), f"{version}: {line}"
    default = forklib.load_base(REPO, None).version
    uncovered = [
        m for m in modules if not any(covers(line, m) for line in plan[default])
    ]
    assert uncovered == [], f"the default base ({default}) does not run {uncovered}"


def ci_plan() -> Dict[str, List[str]]:
    """.ci/bases.txt: per base (a '[VERSION]' line), what .ci/run runs."""
    plan: Dict[str, List[str]] = {}
    current = None
    for line in (REPO / ".ci" / "bases.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            plan[current] = []
        else:
            assert current is not None, line
            plan[current].append(line)
    return plan


def test_1_8_0_stack_tree_round_trip(
    repo_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stack-tree and refresh-stack on 1.8.0, where an entry of the series
    deletes upstream's dynamic_sharding.py and a later one brings the
    overlay's file of that name: the overlay diffs come back unchanged."""
    tree = tmp_path / "stack"
    proc = run_fork(repo_copy, "--base", "1.8.0", "stack-tree", str(tree))
    assert proc.returncode == 0, proc.stderr
    folder = forklib.series_dir(repo_copy)
    diffs = sorted(folder.glob("*" + forklib.OVERLAY_DIFF_SUFFIX))
    assert diffs
    before = {p.name: p.read_text() for p in diffs}
    for path in diffs:
        path.unlink()
    proc = run_fork(repo_copy, "--base", "1.8.0", "refresh-stack", str(tree))
    assert proc.returncode == 0, proc.stderr
    after = sorted(folder.glob("*" + forklib.OVERLAY_DIFF_SUFFIX))
    assert {p.name: p.read_text() for p in after} == before
    proc = run_fork(repo_copy, "--base", "1.8.0", "refresh-stack", str(tree))
    assert proc.returncode == 0 and "already up to date" in proc.stdout, proc.stderr


@pytest.mark.parametrize("version", ["1.8.0", "main"])
def test_export_deletes_upstreams_test_before_the_fork_adds_its_own(
    version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upstream's tests/test_dynamic_sharding.py (in its git tree at
    release/v1.8.0 and at main, not in the wheels) is deleted, by its blob
    id, with the code it tests; the fork's file of that name comes later,
    with the fork's update_shards."""
    monkeypatch.setenv(forklib.BASE_ENV, version)
    rel = "torchrec/distributed/tests/test_dynamic_sharding.py"
    blob = forklib.load_upstream_tree(REPO).blobs[rel]
    export = stack.export_stack(
        REPO, tmp_path / "out", cover_letter=False, stand_in=True
    )
    names = [c.entry.name for c in export.commits]
    touching = {
        commit.entry.name: [
            change
            for change in forklib.diff_changes(path.read_text())
            if change.path == rel
        ]
        for path, commit in zip(export.patches, export.commits)
    }
    (deletion,) = touching["remove-upstream-dynamic-sharding.patch"]
    assert deletion.new_path is None and deletion.old_blob == blob
    (creation,) = touching["reshard-ebc-seed-api.patch"]
    assert creation.old_path is None
    assert creation.new_blob == forklib.git_blob_id((REPO / rel).read_bytes())
    assert [n for n in names if touching[n]] == [
        "remove-upstream-dynamic-sharding.patch",
        "reshard-ebc-seed-api.patch",
    ]
    text = export.patches[names.index("remove-upstream-dynamic-sharding.patch")]
    assert (
        stack.upstream_deletion(rel, forklib.load_upstream_tree(REPO))
        in text.read_text()
    )

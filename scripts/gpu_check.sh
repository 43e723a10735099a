#!/usr/bin/env bash
# The one-GPU check of the GPU path, for a machine with one CUDA device
# (docs/gpu.md): sets up the CUDA venv (TORCHREC_FORK_STACK=cuda, in
# .venv-cuda unless TORCHREC_FORK_VENV names another) if needed, then runs,
# through the real code paths, in one pytest run bounded to 5 minutes:
#
#   self-send     a coalesced NCCL round through ExchangeGroup (a send and a
#                 receive to itself: the one round one GPU can post)
#   kernels       one-rank reshards between FUSED, FUSED_UVM and
#                 FUSED_UVM_CACHING, the cache's hot rows compared with a twin
#   abort         the abort path in a one-rank group: the process lives 5 s
#                 on, no exception_dump key on the job's store
#   preflight     the pre-flight's bound against max_memory_allocated; an
#                 unshard onto host modules with no free HBM
#   staging       pinned staging pooled and given back to the OS
#   timing        the load monitor's CUDA-event timings against the profiler,
#                 no synchronisation added to a step
#   contract      the torch/fbgemm contract test, on this machine's build
#
# One PASS/FAIL line per item (a skipped test fails: the check needs the
# GPU; only the contract's two CPU-build tests skip there by design); exit
# status 1 when one fails. Extra arguments go to pytest. The venv is
# installed from the package registry (torch and fbgemm-gpu's CUDA builds):
# a machine without one needs the venv made beforehand (docs/gpu.md).
set -euo pipefail
export TORCHREC_FORK_STACK="${TORCHREC_FORK_STACK:-cuda}"
REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TORCHREC_FORK_VENV="${TORCHREC_FORK_VENV:-$REPO_DIR/.venv-cuda}"
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"

GPU=torchrec.distributed.tests.test_dynamic_sharding_gpu
ONE=OneGpuTest
items=(
    "self-send $ONE::test_a_coalesced_round_sends_to_itself_over_nccl"
    "kernels $ONE::test_a_cached_kernels_hot_rows_move_with_it"
    "kernels $ONE::test_tables_move_between_hbm_uvm_and_the_cache"
    "abort $ONE::test_an_aborted_group_leaves_the_process_alive_and_posts_no_dump"
    "preflight $ONE::test_the_preflight_bounds_refuses_and_reports"
    "preflight $ONE::test_an_unshard_onto_host_modules_needs_no_free_hbm"
    "staging $ONE::test_pinned_staging_is_pooled_and_given_back"
    "timing $ONE::test_event_timings_agree_with_the_profiler"
    "timing $ONE::test_the_load_monitor_adds_no_synchronisation"
)
report="$(mktemp -d)/gpu_check.xml"
"$PYBIN" -c 'import torch; print("[gpu_check]", torch.__version__,
    "cuda", torch.version.cuda, torch.cuda.get_device_name(0)
    if torch.cuda.is_available() else "no CUDA device")'
start=$SECONDS
set +e
timeout 300 "$VENV/bin/pytest" -p no:cacheprovider -q -rs --junitxml="$report" \
    --pyargs "$GPU" torchrec.distributed.resharding.tests.test_torch_contract \
    ${@+"$@"}
status=$?
set -e
echo "[gpu_check] pytest exit status $status after $((SECONDS - start)) s"

"$PYBIN" - "$report" "${items[@]}" <<'PY'
import sys
import xml.etree.ElementTree as ET

path, items = sys.argv[1], sys.argv[2:]
outcomes = {}
try:
    cases = ET.parse(path).getroot().iter("testcase")
except (OSError, ET.ParseError):
    cases = []
skipped = set()
for case in cases:
    failed = any(case.find(tag) is not None for tag in ("failure", "error", "skipped"))
    key = f"{case.get('classname', '')}::{case.get('name', '')}"
    outcomes[key] = not failed
    if case.find("skipped") is not None:
        skipped.add(key)
by_item = {}
for entry in items:
    item, test = entry.split(" ", 1)
    cls, name = test.split("::")
    ok = any(k.endswith(f"{cls}::{name}") and v for k, v in outcomes.items())
    by_item.setdefault(item, []).append((name, ok))
# Two contract tests skip on a GPU machine by design: torch.cuda's answers
# on a machine without a GPU (CudaWithoutAGpuTest) and the live reader
# checked against the CPU wheel's recorded signatures (LiveBindingsTest: that
# file states another torch). The rest must pass, the CUDA signatures judged
# by this build's own bindings.
CPU_BUILD_ONLY = ("CudaWithoutAGpuTest", "LiveBindingsTest")
contract = [k for k in outcomes if "test_torch_contract" in k]
passed = [k for k in contract if outcomes[k]]
cpu_only = [
    k for k in contract if k in skipped and any(c in k for c in CPU_BUILD_ONLY)
]
by_item["contract"] = [
    (
        f"{len(passed)} tests passed, {len(cpu_only)} skipped (the CPU build's)",
        bool(passed) and len(passed) + len(cpu_only) == len(contract),
    )
]
failed = 0
for item, tests in by_item.items():
    ok = all(passed for _, passed in tests)
    failed += not ok
    names = ", ".join(f"{n}{'' if p else ' (did not pass)'}" for n, p in tests)
    print(f"{'PASS' if ok else 'FAIL'} {item}: {names}")
sys.exit(1 if failed else 0)
PY

#!/usr/bin/env bash
# The reshard benchmark on a fresh machine: set up .venv (stack + fork) if
# needed, then run benchmarks/reshard_benchmark.py on 2 gloo ranks. Extra
# arguments go to the benchmark (see --help).
#
# With --compare-upstream: a stock torchrec release's own reshard against the
# fork on the same release, side by side (benchmarks/upstream_compare_benchmark.py;
# the other arguments go to it): the default base (1.9.2), or 1.8.0 with
# TORCHREC_FORK_BASE=1.8.0.
# It sets up .venv-<base> (the stack and the fork) and .venv-<base>-stock (the
# stock wheel, the same stack; TORCHREC_STOCK_VENV overrides where) if needed.
set -euo pipefail
compare=0
args=()
for arg in "$@"; do
    if [ "$arg" = --compare-upstream ]; then
        compare=1
    else
        args+=("$arg")
    fi
done
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
if [ "$compare" = 1 ]; then
    exec "$PYBIN" benchmarks/upstream_compare_benchmark.py --setup-stock-venv \
        --fork-python "$PYBIN" --stock-venv "${TORCHREC_STOCK_VENV:-$VENV-stock}" \
        ${args[@]+"${args[@]}"}
fi
exec "$PYBIN" benchmarks/reshard_benchmark.py ${args[@]+"${args[@]}"}

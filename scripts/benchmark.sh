#!/usr/bin/env bash
# The reshard benchmark on a fresh machine: set up .venv (stack + fork) if
# needed, then run benchmarks/reshard_benchmark.py on 2 gloo ranks. Extra
# arguments go to the benchmark (see --help).
#
# With --compare-upstream: stock torchrec 1.8.0's own reshard against the fork
# on 1.8.0, side by side (benchmarks/upstream_compare_benchmark.py; the other
# arguments go to it). It sets up .venv-1.8.0 (TORCHREC_FORK_BASE=1.8.0: the
# stack and the fork) and .venv-1.8.0-stock (the stock 1.8.0 wheel, the same
# stack; TORCHREC_STOCK_VENV overrides where) if needed.
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
if [ "$compare" = 1 ]; then
    export TORCHREC_FORK_BASE=1.8.0
fi
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
if [ "$compare" = 1 ]; then
    exec "$PYBIN" benchmarks/upstream_compare_benchmark.py --setup-stock-venv \
        --fork-python "$PYBIN" --stock-venv "${TORCHREC_STOCK_VENV:-$VENV-stock}" \
        ${args[@]+"${args[@]}"}
fi
exec "$PYBIN" benchmarks/reshard_benchmark.py ${args[@]+"${args[@]}"}

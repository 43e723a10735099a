#!/usr/bin/env bash
# The rebalance benchmark on a fresh machine: set up .venv (stack + fork) if
# needed, then run benchmarks/rebalance_benchmark.py on 2 gloo ranks (static,
# oracle, rebalanced and a stationary control, taking turns block by block
# between barriers). Extra arguments go to the benchmark (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
exec "$PYBIN" benchmarks/rebalance_benchmark.py "$@"

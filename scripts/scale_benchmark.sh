#!/usr/bin/env bash
# The scale benchmark on a fresh machine: set up .venv (stack + fork) if
# needed, then run benchmarks/scale_benchmark.py (one process: the pure
# planner, and the store agreement of benchmarks/scale_agreement.py driven by
# threads). Extra arguments go to the benchmark (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
exec "$PYBIN" benchmarks/scale_benchmark.py "$@"

#!/usr/bin/env bash
# The reshard benchmark on a fresh machine: set up .venv (stack + fork) if
# needed, then run benchmarks/reshard_benchmark.py on 2 gloo ranks. Extra
# arguments go to the benchmark (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
exec "$PYBIN" benchmarks/reshard_benchmark.py "$@"

#!/usr/bin/env bash
# The elastic benchmark on a fresh machine: set up .venv (stack + fork) if
# needed, then run benchmarks/elastic_benchmark.py on 4 gloo ranks (shrink
# 4 -> 2 and grow 2 -> 4, live against the checkpoint route). Extra arguments
# go to the benchmark (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
exec "$PYBIN" benchmarks/elastic_benchmark.py "$@"

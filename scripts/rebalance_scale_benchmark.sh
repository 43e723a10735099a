#!/usr/bin/env bash
# Rebalancing at scale by simulation, on a fresh machine: set up .venv (stack +
# fork) if needed, then run benchmarks/rebalance_scale_benchmark.py (no
# processes: the rebalancer's pure parts on synthetic load statistics for
# 64-1,024 ranks and 100-1,000 tables). Extra arguments go to the benchmark
# (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
exec "$PYBIN" benchmarks/rebalance_scale_benchmark.py "$@"

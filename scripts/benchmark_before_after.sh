#!/usr/bin/env bash
# The reshard benchmark of an earlier commit and of this checkout's HEAD, one
# after the other (one sitting): each commit's own fork tree and benchmark
# script, built in temporary worktrees. Usage:
#   bash scripts/benchmark_before_after.sh REV [benchmark args...]
# e.g. bash scripts/benchmark_before_after.sh 0244630 --sizes-mib 256,1024 --reps 5
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
before=${1:?usage: benchmark_before_after.sh REV [benchmark args...]}
shift
work=$(mktemp -d)
trap 'git worktree remove --force "$work/before" 2>/dev/null; git worktree remove --force "$work/after" 2>/dev/null; rm -rf "$work"' EXIT
for which in before after; do
    rev=$before
    [ "$which" = after ] && rev=HEAD
    git worktree add -q --detach "$work/$which" "$rev"
    (cd "$work/$which" && "$PYBIN" -c "
import sys
from pathlib import Path
sys.path.insert(0, 'tools')
import forklib
forklib.build_source_tree(Path(sys.argv[1]), repo=Path('.'))
" "$work/tree-$which")
done
for which in before after; do
    echo "=== $which ($(git -C "$work/$which" rev-parse --short HEAD))"
    (cd "$work/$which" && PYTHONPATH="$work/tree-$which" "$PYBIN" \
        benchmarks/reshard_benchmark.py --no-plot --out-dir "$work/out-$which" "$@")
done

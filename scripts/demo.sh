#!/usr/bin/env bash
# The fork's main job on a fresh machine: set up .venv (stack + fork) if needed,
# then run the end-to-end demo on 2 gloo ranks. Extra arguments go to the demo.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
DEMO="examples/live_reshard_demo.py"
if [ ! -f "$DEMO" ]; then
    DEMO="examples/sharded_training_demo.py"
fi
exec "$PYBIN" "$DEMO" "$@"

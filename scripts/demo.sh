#!/usr/bin/env bash
# The fork's main job on a fresh machine: set up .venv (stack + fork) if needed,
# then run the live-resharding demo on 2 gloo ranks. Extra arguments go to the demo.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
exec "$PYBIN" examples/live_reshard_demo.py "$@"

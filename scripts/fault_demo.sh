#!/usr/bin/env bash
# Surviving a lost rank on a fresh machine: set up .venv (stack + fork) if
# needed, then run four gloo ranks that train a DLRM, kill one in the middle
# of a step and watch the three others recover and train on
# (examples/fault_tolerance_demo.py). Extra arguments go to the demo (--help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
exec "$PYBIN" examples/fault_tolerance_demo.py "$@"

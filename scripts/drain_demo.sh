#!/usr/bin/env bash
# Draining a host of a running job on a fresh machine: set up .venv (stack +
# fork) if needed, then start two torchrun agents on 127.0.0.1 as two nodes of
# 2 gloo ranks, train on both, drain node 1 onto node 0 with move_model, and
# train on on node 0 (examples/drain_node_demo.py). Extra arguments go to the
# demo (--help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
exec "$PYBIN" examples/drain_node_demo.py "$@"

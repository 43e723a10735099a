#!/usr/bin/env bash
# Sourced by scripts/demo.sh and scripts/test.sh: make sure .venv exists, holds
# the pinned stack and the fork built from this checkout. Idempotent; when
# nothing changed it only hashes a few files.
#
# Environment knobs:
#   TORCHREC_FORK_BASE   the upstream base of base.json to build on (default: its
#                        default, 1.1.0; 1.8.0 builds the fork on torchrec 1.8.0)
#   TORCHREC_FORK_VENV   virtualenv to use (default: <repo>/.venv, and
#                        <repo>/.venv-<base> for a base other than the default)
#   TORCHREC_FORK_STACK  cpu (default) or cuda: requirements/<stack>.txt
#                        (requirements/<stack>-<base>.txt on another base)
#   PYTHON               interpreter that creates the venv (default: python3.11
#                        if present, else python3; must be 3.11)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_BASE="$(sed -n 's/^  "version": "\(.*\)",$/\1/p' "$REPO/base.json" | head -n 1)"
BASE="${TORCHREC_FORK_BASE:-$DEFAULT_BASE}"
STACK="${TORCHREC_FORK_STACK:-cpu}"
if [ "$BASE" = "$DEFAULT_BASE" ]; then
    VENV="${TORCHREC_FORK_VENV:-$REPO/.venv}"
    REQS="$REPO/requirements/$STACK.txt"
else
    VENV="${TORCHREC_FORK_VENV:-$REPO/.venv-$BASE}"
    REQS="$REPO/requirements/$STACK-$BASE.txt"
    # setup.py and tools/fork.py read it: build this base
    export TORCHREC_FORK_BASE="$BASE"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { echo "[torchrec-fork] $*" >&2; }

if [ ! -f "$REQS" ]; then
    log "unknown stack '$STACK' on base $BASE (no $REQS)"
    exit 2
fi

if [ ! -x "$VENV/bin/python" ]; then
    PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
    if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
        log "$PY is not Python 3.11; set PYTHON to a Python 3.11 interpreter"
        exit 2
    fi
    log "creating $VENV"
    "$PY" -m venv "$VENV"
fi
PYBIN="$VENV/bin/python"

# (a base's requirements include the default stack's: both go into the stamp)
stack_stamp="$(cat "$REQS" $([ "$REQS" = "$REPO/requirements/$STACK.txt" ] || echo "$REPO/requirements/$STACK.txt") | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$VENV/.fork-stack" 2>/dev/null || true)" != "$stack_stamp" ]; then
    log "installing the $STACK stack ($REQS)"
    "$PYBIN" -m pip install -q -r "$REQS"
    echo "$stack_stamp" > "$VENV/.fork-stack"
    rm -f "$VENV/.fork-build"
fi

# Rebuild the fork whenever anything it is built from changed.
src_stamp="$(
    cd "$REPO" &&
        find setup.py pyproject.toml base.json version.txt tools patches torchrec \
            -type f ! -path '*/__pycache__/*' ! -name '*.py[co]' -print0 |
        sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
)$([ "$BASE" = "$DEFAULT_BASE" ] || echo "-$BASE")"
if [ "$(cat "$VENV/.fork-build" 2>/dev/null || true)" != "$src_stamp" ]; then
    log "building and installing the fork on torchrec $BASE from $REPO"
    "$PYBIN" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$REPO"
    echo "$src_stamp" > "$VENV/.fork-build"
fi

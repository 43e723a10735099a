#!/usr/bin/env bash
# Sourced by scripts/demo.sh and scripts/test.sh: make sure .venv exists, holds
# the pinned stack and the fork built from this checkout. Idempotent; when
# nothing changed it only hashes a few files.
#
# Environment knobs:
#   TORCHREC_FORK_BASE   the upstream base of base.json to build on (default: its
#                        "default"; e.g. 1.1.0 builds the fork on torchrec 1.1.0)
#   TORCHREC_FORK_VENV   virtualenv to use (default: <repo>/.venv, and
#                        <repo>/.venv-<base> for a base other than the default;
#                        a stack other than cpu and cuda adds -<stack>, e.g.
#                        .venv-torch2.14)
#   TORCHREC_FORK_STACK  cpu (default), cuda or torch2.14 (the stack
#                        `pip install torchrec==1.9.2` resolves: torch 2.14.1,
#                        fbgemm 1.9.0): requirements/<stack>.txt, plus what
#                        the base's wheel needs (base.json's "requires")
#   PYTHON               interpreter that creates the venv (default: python3.11
#                        if present, else python3; must be 3.11)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# base.json: its default base, and what the selected base's wheel needs
# besides the stack every base shares ("requires").
read_base() {
    python3 - "$REPO/base.json" "${TORCHREC_FORK_BASE:-}" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
wanted = sys.argv[2] or data["default"]
bases = {b["version"]: b for b in data["bases"]}
if wanted not in bases:
    sys.exit(f"[torchrec-fork] no base {wanted} in base.json ({', '.join(bases)})")
if bases[wanted].get("on"):
    sys.exit(
        f"[torchrec-fork] {wanted} is upstream's git tree, a target of the export: "
        f"nothing installs it (tools/fork.py --base {wanted} check, export)"
    )
print(data["default"])
print(wanted)
print(" ".join(bases[wanted].get("requires", [])))
PY
}
BASE_INFO="$(read_base)"
DEFAULT_BASE="$(sed -n 1p <<<"$BASE_INFO")"
BASE="$(sed -n 2p <<<"$BASE_INFO")"
BASE_REQUIRES="$(sed -n 3p <<<"$BASE_INFO")"
STACK="${TORCHREC_FORK_STACK:-cpu}"
REQS="$REPO/requirements/$STACK.txt"
# cpu and cuda are one machine's stack each (.venv); another stack is a lane
# beside them on the same machine: a venv of its own
case "$STACK" in
    cpu | cuda) stack_suffix="" ;;
    *) stack_suffix="-$STACK" ;;
esac
if [ "$BASE" = "$DEFAULT_BASE" ]; then
    VENV="${TORCHREC_FORK_VENV:-$REPO/.venv$stack_suffix}"
else
    VENV="${TORCHREC_FORK_VENV:-$REPO/.venv-$BASE$stack_suffix}"
fi
# setup.py and tools/fork.py read it: build this base
export TORCHREC_FORK_BASE="$BASE"
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

# (the base's own requirements go into the stamp with the stack's)
stack_stamp="$( (cat "$REQS"; echo "$BASE_REQUIRES") | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$VENV/.fork-stack" 2>/dev/null || true)" != "$stack_stamp" ]; then
    log "installing the $STACK stack ($REQS${BASE_REQUIRES:+ + $BASE_REQUIRES})"
    # shellcheck disable=SC2086
    "$PYBIN" -m pip install -q -r "$REQS" $BASE_REQUIRES
    echo "$stack_stamp" > "$VENV/.fork-stack"
    rm -f "$VENV/.fork-build"
fi

# Rebuild the fork whenever anything it is built from changed.
src_stamp="$(
    cd "$REPO" &&
        find setup.py pyproject.toml base.json version.txt tools patches torchrec \
            -type f ! -path '*/__pycache__/*' ! -name '*.py[co]' -print0 |
        sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
)-$BASE"
if [ "$(cat "$VENV/.fork-build" 2>/dev/null || true)" != "$src_stamp" ]; then
    log "building and installing the fork on torchrec $BASE from $REPO"
    "$PYBIN" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$REPO"
    echo "$src_stamp" > "$VENV/.fork-build"
fi

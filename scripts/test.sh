#!/usr/bin/env bash
# All tests on a fresh machine: set up .venv (stack + fork) if needed, then run
# the fork-level tests in test/ (the series, tools, stacks and bisect checks of
# every base, packaging, the demo; on a base with upstream's own reshard API,
# test/upstream_api too) and the in-package tests of the INSTALLED fork
# (pytest --pyargs torchrec.distributed.tests ...). Extra arguments go to pytest.
#
# TORCHREC_FORK_BASE=VERSION runs them on another base of base.json (its own
# venv, .venv-VERSION), TORCHREC_FORK_STACK=torch2.14 on the stack users
# install (.venv-torch2.14); .ci/run says what CI runs on each. The tests
# .ci/bases.txt deselects on the base ('!NAME' lines of its section, or of
# the base's section on that stack, each with its reason) are deselected
# here too.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
# the section of the base, or of the base on this stack ("[1.9.2 torch2.14]")
section="$BASE"
if grep -q "^\[$BASE $STACK\]" .ci/bases.txt; then
    section="$BASE$STACK"
fi
deselect="$(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' .ci/bases.txt |
    awk -v want="[$section]" '/^\[/{on = ($0 == want); next} on && /^!/ {
        printf "%snot %s", (n++ ? " and " : ""), substr($0, 2) }')"
# pytest keeps the last -k it is given: a -k of the caller is combined with
# the base's deselects ("(theirs) and (deselects)"), not put in their place.
user_k=""
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        -k | --keyword)
            user_k="${2-}"
            shift 2 || shift
            ;;
        --keyword=*) user_k="${1#--keyword=}"; shift ;;
        -k?*) user_k="${1#-k}"; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
expr="$deselect"
if [ -n "$user_k" ] && [ -n "$deselect" ]; then
    expr="($user_k) and ($deselect)"
elif [ -n "$user_k" ]; then
    expr="$user_k"
fi
k=()
if [ -n "$expr" ]; then
    k=(-k "$expr")
fi
# test/ is given as a path: with --pyargs a bare "test" would be the stdlib package.
exec "$VENV/bin/pytest" -p no:cacheprovider ${k[@]+"${k[@]}"} "$REPO/test" --pyargs \
    torchrec.distributed.tests torchrec.distributed.resharding.tests \
    torchrec.distributed.resharding.rebalance.tests \
    torchrec.optim.tests ${args[@]+"${args[@]}"}

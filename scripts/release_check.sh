#!/usr/bin/env bash
# Before a release (or after a change to an early entry of the series): what
# CI leaves out to stay within its budget (.ci/bases.txt), in full.
#
#  - tools/fork.py check on every base, and stack on every base (sizes);
#  - bisect-check on every release, every entry's tests at its commit, and
#    on main when a clone of upstream is at hand ($TORCHREC_FORK_UPSTREAM_GIT:
#    its files at the commit tools/upstream-main-*-tree.txt lists); what
#    passes is recorded in .ci/bisect-verified.json, so that CI then tests at
#    their commit only the entries changed since (commit that file);
#  - with the clone, the export for main applied with git am to upstream's
#    main (test/test_export.py's test_main_export_applies_to_upstreams_main).
#
# Runs from the default base's venv (scripts/_env.sh). About 50 minutes on 2
# cores (each full bisect check runs every in-package test once more). Extra
# arguments go to each bisect check's pytest (after --).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
PY="$VENV/bin/python"
VERIFIED=.ci/bisect-verified.json

# the '!NAME' deselections of a base's section of .ci/bases.txt, as -k
deselected() {
    sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' .ci/bases.txt |
        awk -v want="[$1]" '/^\[/{on = ($0 == want); next} on && /^!/ {
            printf "%snot %s", (n++ ? " and " : ""), substr($0, 2) }'
}

mapfile -t BASES < <("$PY" -c 'import json; print("\n".join(b["version"] for b in json.load(open("base.json"))["bases"]))')
"$PY" tools/fork.py check
for base in "${BASES[@]}"; do
    if [ "$base" = main ] && [ -z "${TORCHREC_FORK_UPSTREAM_GIT:-}" ]; then
        echo "release_check: main: TORCHREC_FORK_UPSTREAM_GIT is unset (a clone of upstream); its stack is checked by blob id only"
        continue
    fi
    "$PY" tools/fork.py --base "$base" stack
    k="$(deselected "$base")"
    start=$(date +%s)
    "$PY" tools/fork.py --base "$base" bisect-check --record "$VERIFIED" \
        -- ${k:+-k "$k"} "$@"
    echo "release_check: bisect-check on torchrec $base took $(($(date +%s) - start)) s"
done
if [ -n "${TORCHREC_FORK_UPSTREAM_GIT:-}" ]; then
    "$VENV/bin/pytest" -p no:cacheprovider -q test/test_export.py \
        -k test_main_export_applies_to_upstreams_main
fi
echo "release_check: done; commit $VERIFIED"

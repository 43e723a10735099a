#!/usr/bin/env bash
# All tests on a fresh machine: set up .venv (stack + fork) if needed, then run
# the fork-level tests in test/ and the in-package tests of the INSTALLED fork
# (pytest --pyargs torchrec.distributed.tests). Extra arguments go to pytest.
#
# TORCHREC_FORK_BASE=1.8.0 runs them on the torchrec 1.8.0 base instead (its
# own venv, .venv-1.8.0): the in-package tests and test/base-1.8.0/ (the
# fork-level tests of test/ are about the repository and its tools, and run on
# the default base).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
FORK_TESTS="$REPO/test"
if [ "$BASE" != "$DEFAULT_BASE" ]; then
    FORK_TESTS="$REPO/test/base-$BASE"
fi
# test/ is given as a path: with --pyargs a bare "test" would be the stdlib package.
exec "$VENV/bin/pytest" -p no:cacheprovider "$FORK_TESTS" --pyargs \
    torchrec.distributed.tests torchrec.distributed.resharding.tests \
    torchrec.optim.tests "$@"

#!/usr/bin/env bash
# All tests on a fresh machine: set up .venv (stack + fork) if needed, then run
# the fork-level tests in test/ and the in-package tests of the INSTALLED fork
# (pytest --pyargs torchrec.distributed.tests). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO"
# test/ is given as a path: with --pyargs a bare "test" would be the stdlib package.
exec "$VENV/bin/pytest" -p no:cacheprovider "$REPO/test" --pyargs \
    torchrec.distributed.tests torchrec.distributed.resharding.tests \
    torchrec.optim.tests "$@"

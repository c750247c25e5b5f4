#!/usr/bin/env bash
# The test suite: creates or reuses .venv, then runs pytest. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
exec python -m pytest "$@"

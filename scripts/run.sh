#!/usr/bin/env bash
# Set everything up (.venv) and run the main job on the embedded default. Extra arguments go to it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
exec python -m r3lab "$@"

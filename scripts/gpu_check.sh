#!/usr/bin/env bash
# One command on a single-GPU node: CUDA vLLM samples with native route capture, megatron-bridge loads the same
# checkpoint into Megatron-core, r3lab slices and replays the engine's routes there, and the drift table
# (none vs R3) is printed and written as a run. Environment: scripts/gpu_env.sh. Options: scripts/gpu_check.py -h.
# Python: $PYTHON, else .venv-gpu/bin/python, else python3. Exit 2 with a message where CUDA or a package is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv-gpu/bin/python" ]; then PY="$ROOT/.venv-gpu/bin/python"; else PY=python3; fi
fi
exec "$PY" "$ROOT/scripts/gpu_check.py" "$@"

#!/usr/bin/env bash
# Create the GPU environment (CUDA vLLM + Megatron-core + Megatron-Bridge + r3lab) in VENV (default .venv-gpu).
# Run on the GPU node (CUDA 13 driver, nvcc for Transformer Engine's PyTorch extension), Python 3.11:
#   bash scripts/gpu_env.sh [VENV]
# The pins and why they are what they are: requirements-gpu.txt (tests/test_gpu_recipe.py resolves it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-gpu}"
REQ="$ROOT/requirements-gpu.txt"
PY="${PYTHON:-python3.11}"
TE="$(sed -n 's/^transformer-engine\[[^]]*\]==\([0-9][0-9.]*\).*/\1/p' "$REQ")"
NODEPS="$(sed -n 's/^# no-deps: *\([^ ]*\).*/\1/p' "$REQ")"
if [ -z "$TE" ] || [ -z "$NODEPS" ]; then
  echo "gpu_env: requirements-gpu.txt has no transformer-engine pin or no '# no-deps:' line" >&2
  exit 2
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install -r "$REQ"
# Transformer Engine's PyTorch extension compiles against the torch just installed (NVIDIA's own instruction)
"${PIP[@]}" install --no-build-isolation "transformer_engine_torch==$TE"
"${PIP[@]}" install --no-deps "$NODEPS"
"${PIP[@]}" install --no-deps -e "$ROOT"
echo "gpu_env: ready; run: bash scripts/gpu_check.sh   (uses $VENV)" >&2

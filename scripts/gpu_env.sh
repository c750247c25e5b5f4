#!/usr/bin/env bash
# Create the GPU environment (CUDA vLLM + Megatron-core + Megatron-Bridge + r3lab) in VENV (default .venv-gpu).
# Run on the GPU node (NVIDIA driver for CUDA 13, a C++17 compiler, Python 3.11, the package index):
#   bash scripts/gpu_env.sh [VENV]
# The pins and why they are what they are: requirements-gpu.txt (tests/test_gpu_recipe.py resolves it). The CUDA
# toolkit that Transformer Engine's PyTorch extension is built with comes from pip (torch's CUDA 13 packages and the
# pinned nvcc), so the node needs no toolkit; CUDA_HOME set by the caller is used instead if its nvcc has torch's
# CUDA major.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-gpu}"
REQ="$ROOT/requirements-gpu.txt"
PY="${PYTHON:-python3.11}"
TE="$(sed -n 's/^transformer-engine\[[^]]*\]==\([0-9][0-9.]*\).*/\1/p' "$REQ")"
NODEPS="$(sed -n 's/^# no-deps: *\([^ ]*\).*/\1/p' "$REQ")"
mapfile -t BUILD < <(sed -n 's/^\([^ #][^ ]*\) *# build:.*/\1/p' "$REQ")
if [ -z "$TE" ] || [ -z "$NODEPS" ] || [ "${#BUILD[@]}" -eq 0 ]; then
  echo "gpu_env: requirements-gpu.txt has no transformer-engine pin, no '# no-deps:' line or no '# build:' pins" >&2
  exit 2
fi
fail() { echo "gpu_env: $*" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
# the build prerequisites first (pip, setuptools, wheel, ninja): a fresh venv has an old setuptools and no wheel
"${PIP[@]}" install "${BUILD[@]}"
"${PIP[@]}" install -r "$REQ"

# Transformer Engine's PyTorch extension compiles against the torch just installed (NVIDIA's own instruction:
# --no-build-isolation). TE 2.11's build_tools read nvcc (its version) and the CUDA headers from CUDA_HOME; the
# extension includes cudnn.h and nccl.h, which torch's pip packages keep in their own folders.
CUDA_MAJOR="$("$VENV/bin/python" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')"
[ -n "$CUDA_MAJOR" ] || fail "the torch in $VENV is not a CUDA build (torch.version.cuda is None)"
NV="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/nvidia"
if [ -n "${CUDA_HOME:-}" ]; then
  [ -x "$CUDA_HOME/bin/nvcc" ] || fail "CUDA_HOME=$CUDA_HOME has no bin/nvcc; unset it to use the pip toolkit"
  HAVE="$("$CUDA_HOME/bin/nvcc" -V | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
  [ "$HAVE" = "$CUDA_MAJOR" ] || fail "CUDA_HOME=$CUDA_HOME is CUDA $HAVE, torch is built for CUDA $CUDA_MAJOR"
else
  CUDA_HOME="$NV/cu$CUDA_MAJOR"
fi
for f in "$CUDA_HOME/bin/nvcc" "$CUDA_HOME/include/cuda_runtime.h" "$CUDA_HOME/include/cublasLt.h" \
         "$NV/cudnn/include/cudnn.h" "$NV/nccl/include/nccl.h"; do
  [ -e "$f" ] || fail "$f is missing after installing requirements-gpu.txt (nvidia-cuda-nvcc and torch's nvidia-*)"
done
# NVTE_PYTORCH_FORCE_BUILD: compile here instead of downloading a binary by a guessed release URL
CUDA_HOME="$CUDA_HOME" \
CPLUS_INCLUDE_PATH="$NV/cudnn/include:$NV/nccl/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE \
  "${PIP[@]}" install --no-build-isolation --check-build-dependencies "transformer_engine_torch==$TE"

"${PIP[@]}" install --no-deps "$NODEPS"
"${PIP[@]}" install --no-deps -e "$ROOT"
echo "gpu_env: ready; run: bash scripts/gpu_check.sh   (uses $VENV)" >&2

#!/usr/bin/env bash
# Create r3lab's two GPU environments on a CUDA 13 node (NVIDIA driver for CUDA 13, Python 3.12 with venv, a C++17
# compiler, the package index):
#   bash scripts/gpu_env.sh [both|engine|trainer]     # default both
#     engine  -> .venv-gpu-engine  ($R3LAB_ENGINE_VENV):  requirements-gpu-engine.txt (CUDA vLLM), then r3lab
#     trainer -> .venv-gpu-trainer ($R3LAB_TRAINER_VENV): the '# build:' pins, requirements-gpu-trainer.txt,
#                Transformer Engine's PyTorch extension built against its torch, Megatron-Bridge, then r3lab
#   GPU_ENV_PRINT=1 bash scripts/gpu_env.sh           # print the commands instead of running them
# The pins and why they are what they are: the two files (tests/test_gpu_recipe.py resolves both). The CUDA toolkit that
# Transformer Engine's extension is built with comes from pip (torch's CUDA 13 packages and the pinned nvcc), so the node
# needs no toolkit; CUDA_HOME set by the caller is used instead if its nvcc has torch's CUDA major.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHICH="${1:-both}"
PY="${PYTHON:-python3.12}"
ENGINE_VENV="${R3LAB_ENGINE_VENV:-$ROOT/.venv-gpu-engine}"
TRAINER_VENV="${R3LAB_TRAINER_VENV:-$ROOT/.venv-gpu-trainer}"
ENGINE_REQ="$ROOT/requirements-gpu-engine.txt"
TRAINER_REQ="$ROOT/requirements-gpu-trainer.txt"
PRINT="${GPU_ENV_PRINT:-}"
fail() { echo "gpu_env: $*" >&2; exit 2; }
run() { if [ -n "$PRINT" ]; then printf '%q ' "$@"; echo; else "$@"; fi; }
case "$WHICH" in both|engine|trainer) ;; *) fail "usage: bash scripts/gpu_env.sh [both|engine|trainer]";; esac
if [ -z "$PRINT" ]; then
  "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
    || fail "needs Python 3.12 (megatron-core 0.19 and Megatron-Bridge 0.6): set PYTHON=/path/to/python3.12"
fi
venv() { if [ -n "$PRINT" ] || [ ! -x "$1/bin/python" ]; then run "$PY" -m venv "$1"; fi; }

engine() {
  venv "$ENGINE_VENV"
  run "$ENGINE_VENV/bin/python" -m pip install -r "$ENGINE_REQ"
  run "$ENGINE_VENV/bin/python" -m pip install --no-deps -e "$ROOT"
  [ -n "$PRINT" ] || echo "gpu_env: engine environment ready in $ENGINE_VENV" >&2
}

trainer() {
  local TE NODEPS BUILD CUDA_MAJOR NV HOME_CUDA HAVE f
  TE="$(sed -n 's/^transformer-engine\[[^]]*\]==\([0-9][0-9.]*\).*/\1/p' "$TRAINER_REQ")"
  NODEPS="$(sed -n 's/^# no-deps: *\([^ ]*\).*/\1/p' "$TRAINER_REQ")"
  mapfile -t BUILD < <(sed -n 's/^\([^ #][^ ]*\) *# build:.*/\1/p' "$TRAINER_REQ")
  if [ -z "$TE" ] || [ -z "$NODEPS" ] || [ "${#BUILD[@]}" -eq 0 ]; then
    fail "requirements-gpu-trainer.txt has no transformer-engine pin, no '# no-deps:' line or no '# build:' pins"
  fi
  venv "$TRAINER_VENV"
  local PIP=("$TRAINER_VENV/bin/python" -m pip)
  # the build prerequisites first (pip, setuptools, wheel, ninja): a fresh Python 3.12 venv has no setuptools or wheel
  run "${PIP[@]}" install "${BUILD[@]}"
  run "${PIP[@]}" install -r "$TRAINER_REQ"

  # Transformer Engine's PyTorch extension compiles against the torch just installed (NVIDIA's own instruction:
  # --no-build-isolation). TE's build_tools read nvcc (its version) and the CUDA headers from CUDA_HOME; the extension
  # includes cudnn.h and nccl.h, which torch's pip packages keep in their own folders.
  if [ -n "$PRINT" ]; then
    CUDA_MAJOR="TORCH_CUDA_MAJOR"  # placeholders: what the installed torch says
    NV="SITE_PACKAGES/nvidia"
  else
    CUDA_MAJOR="$("$TRAINER_VENV/bin/python" -c 'import torch; print((torch.version.cuda or "").split(".")[0])')"
    [ -n "$CUDA_MAJOR" ] || fail "the torch in $TRAINER_VENV is not a CUDA build (torch.version.cuda is None)"
    NV="$("$TRAINER_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/nvidia"
  fi
  if [ -n "${CUDA_HOME:-}" ]; then
    [ -x "$CUDA_HOME/bin/nvcc" ] || fail "CUDA_HOME=$CUDA_HOME has no bin/nvcc; unset it to use the pip toolkit"
    HAVE="$("$CUDA_HOME/bin/nvcc" -V | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
    [ -n "$PRINT" ] || [ "$HAVE" = "$CUDA_MAJOR" ] \
      || fail "CUDA_HOME=$CUDA_HOME is CUDA $HAVE, torch is built for CUDA $CUDA_MAJOR"
    HOME_CUDA="$CUDA_HOME"
  else
    HOME_CUDA="$NV/cu$CUDA_MAJOR"
  fi
  if [ -z "$PRINT" ]; then
    for f in "$HOME_CUDA/bin/nvcc" "$HOME_CUDA/include/cuda_runtime.h" "$HOME_CUDA/include/cublasLt.h" \
             "$NV/cudnn/include/cudnn.h" "$NV/nccl/include/nccl.h"; do
      [ -e "$f" ] || fail "$f is missing after installing requirements-gpu-trainer.txt (nvidia-cuda-nvcc, torch's nvidia-*)"
    done
  fi
  # NVTE_PYTORCH_FORCE_BUILD: compile here instead of downloading a binary by a guessed release URL
  run env CUDA_HOME="$HOME_CUDA" \
    CPLUS_INCLUDE_PATH="$NV/cudnn/include:$NV/nccl/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
    NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE \
    "${PIP[@]}" install --no-build-isolation --check-build-dependencies "transformer_engine_torch==$TE"

  run "${PIP[@]}" install --no-deps "$NODEPS"
  run "${PIP[@]}" install --no-deps -e "$ROOT"
  [ -n "$PRINT" ] || echo "gpu_env: trainer environment ready in $TRAINER_VENV" >&2
}

if [ "$WHICH" != trainer ]; then engine; fi
if [ "$WHICH" != engine ]; then trainer; fi
[ -n "$PRINT" ] || echo "gpu_env: ready; docs/gpu.md says what runs in which environment" >&2

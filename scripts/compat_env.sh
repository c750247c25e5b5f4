#!/usr/bin/env bash
# Build the compatibility tier's far-end environment in ENV_DIR: Python 3.11 with the releases at the other end of
# each range r3lab supports from the workbench's (requirements/compat-far-end.txt: megatron-core 0.16.1,
# transformers 5.25.0, mbridge 0.15.1, torch 2.11.0: the index's CUDA build, run on the CPU). tests/test_compat.py
# builds it and runs there the tests that touch those libraries.
#
# Usage: scripts/compat_env.sh ENV_DIR
#
# It holds r3lab (editable, without its requirements) and only what those tests import: no vLLM, Jupyter or Ray
# (about 5 GB, most of it torch's CUDA libraries). uv (the dev extra; $R3LAB_UV, else uv on PATH) installs it: from
# uv's cache (~/.cache/uv) a build takes 3 s here, a first one 13 s, where pip took 90-166 s of the suite's two cores
# (unpacking and compiling 5 GB). No bytecode is compiled at install: the tests' processes compile what they import
# (tests/test_compat.py lets the far end write bytecode). ENV_DIR is reused when its stamp matches this script and the
# constraints file, built again when it is an older build of this script, and refused when it is anything else (so a
# mistyped path is never deleted).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -eq 1 ] || { echo "usage: scripts/compat_env.sh ENV_DIR" >&2; exit 2; }
ENV_DIR="$1"
CONSTRAINTS="$ROOT/requirements/compat-far-end.txt"
WANT_PY="3.11"  # the newest megatron-core for Python 3.11 is 0.16.1, the oldest r3lab accepts
# what the touching tests import (the pins are in $CONSTRAINTS; the rest is the newest within pyproject's ranges)
PACKAGES=(
  numpy numba orjson zstandard pybase64 tqdm msgpack  # r3lab's core requirements
  transformers tokenizers safetensors                 # the transformers router replay
  megatron-core mbridge einops                        # Megatron-core ranks and the mbridge loader
  pytest hypothesis                                   # the tests themselves
)

# the interpreter: $R3LAB_COMPAT_PYTHON, else python3.11 on PATH, else pyenv's 3.11 (a pyenv shim may name one it
# will not run)
PY=""
for cand in ${R3LAB_COMPAT_PYTHON:-} python3.11 "$(pyenv root 2>/dev/null)"/versions/3.11*/bin/python3.11; do
  if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 11)' >/dev/null 2>&1; then
    PY="$cand"; break
  fi
done
[ -n "$PY" ] || { echo "[compat] needs Python $WANT_PY (set R3LAB_COMPAT_PYTHON=/path/to/python3.11)" >&2; exit 1; }
UV="${R3LAB_UV:-$(command -v uv || true)}"
[ -n "$UV" ] && [ -x "$UV" ] || { echo "[compat] needs uv (pip install uv, or set R3LAB_UV=/path/to/uv)" >&2; exit 1; }

STAMP_NAME=".r3lab-compat"
WANT="$(cat "${BASH_SOURCE[0]}" "$CONSTRAINTS" | sha256sum | cut -d' ' -f1)"
if [ -f "$ENV_DIR/$STAMP_NAME" ]; then
  if [ "$(cat "$ENV_DIR/$STAMP_NAME")" = "$WANT" ] && [ -x "$ENV_DIR/bin/python" ]; then
    echo "[compat] $ENV_DIR is up to date" >&2
    exit 0
  fi
  echo "[compat] $ENV_DIR was built from another script or constraints: building it again" >&2
  rm -rf "$ENV_DIR"
elif [ -f "$ENV_DIR/$STAMP_NAME.building" ]; then
  echo "[compat] $ENV_DIR is an interrupted build of this script: building it again" >&2
  rm -rf "$ENV_DIR"
elif [ -e "$ENV_DIR" ] && [ -n "$(ls -A "$ENV_DIR" 2>/dev/null)" ]; then
  echo "[compat] $ENV_DIR exists and is not a compat environment (no $STAMP_NAME): refusing to replace it" >&2
  exit 1
fi

echo "[compat] building $ENV_DIR with $PY" >&2
mkdir -p "$ENV_DIR"
touch "$ENV_DIR/$STAMP_NAME.building"  # an interrupted build is recognised as this script's, and built again
"$UV" venv -q --allow-existing --python "$PY" "$ENV_DIR"  # beside the .building marker
# uv reads no pip configuration: the index is PyPI (UV_INDEX_URL and friends where another is wanted)
INSTALL=("$UV" pip install -q --python "$ENV_DIR/bin/python" -c "$CONSTRAINTS")
"${INSTALL[@]}" torch "${PACKAGES[@]}"
"${INSTALL[@]}" --no-deps -e "$ROOT"
echo "$WANT" > "$ENV_DIR/$STAMP_NAME"
rm -f "$ENV_DIR/$STAMP_NAME.building"
echo "[compat] $ENV_DIR: $("$ENV_DIR/bin/python" -c 'import importlib.metadata as m; print(", ".join(
    f"{d} {m.version(d)}" for d in ("torch", "transformers", "megatron-core", "mbridge")))')" >&2

#!/usr/bin/env bash
# JupyterLab for r3lab: loopback only, a fresh token, the project's `r3lab` kernel, opened on notebooks/.
# Creates or reuses .venv (scripts/venv.sh). No browser is launched: open the printed URL.
# R3LAB_LAB_PORT picks the port (default: a free one); extra arguments go to `jupyter lab`
# (--ServerApp.root_dir=DIR, or --notebook-dir=DIR, opens another folder instead of notebooks/).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
if ! python -m jupyter kernelspec list 2>/dev/null | grep -q '^ *r3lab '; then
  python -m ipykernel install --sys-prefix --name r3lab --display-name "r3lab (Python 3.12)" >/dev/null
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the kernel imports this checkout's r3lab
PORT="${R3LAB_LAB_PORT:-$(python -c 'from r3lab._process import free_port; print(free_port())')}"
ROOT_FLAG=(); [ "$(id -u)" = "0" ] && ROOT_FLAG=(--allow-root)  # containers often run as root
TOKEN="$(python -c 'import secrets; print(secrets.token_urlsafe(32))')"
DIR_FLAG=(--ServerApp.root_dir="$ROOT/notebooks") WHERE="notebooks/"
for arg in "$@"; do  # a folder of the user's own wins over notebooks/ (jupyter takes one root_dir)
  case "$arg" in
    --ServerApp.root_dir=*|--ServerApp.root_dir|--notebook-dir=*|--notebook-dir|--ServerApp.notebook_dir=*)
      DIR_FLAG=() WHERE="the folder given" ;;
  esac
done
echo "[r3lab] JupyterLab on $WHERE: http://127.0.0.1:$PORT/lab?token=$TOKEN" >&2
exec python -m jupyter lab --no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port="$PORT" \
  --ServerApp.port_retries=0 --IdentityProvider.token="$TOKEN" "${DIR_FLAG[@]}" "${ROOT_FLAG[@]}" "$@"

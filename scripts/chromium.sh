#!/usr/bin/env bash
# Find the system Chromium, installing Debian's `chromium` when it is missing and we may (root + apt-get).
# Sourced by scripts/venv.sh; exports BROWSER_PATH (kaleido reads it) when a Chromium is found.
# Elsewhere install it yourself: `sudo apt-get install chromium` (Debian/Ubuntu) or set BROWSER_PATH.
_r3lab_find_chromium() {
  if [ -n "${BROWSER_PATH:-}" ] && [ -x "$BROWSER_PATH" ]; then echo "$BROWSER_PATH"; return; fi
  for c in chromium chromium-browser google-chrome; do
    if command -v "$c" >/dev/null 2>&1; then command -v "$c"; return; fi
  done
}
if [ -z "$(_r3lab_find_chromium)" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "[r3lab] installing Debian's chromium (figure export and the browser test need it)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null; } \
    || echo "[r3lab] could not install chromium with apt-get; figure export and the browser test will say so" >&2
fi
if [ -n "$(_r3lab_find_chromium)" ]; then
  export BROWSER_PATH="$(_r3lab_find_chromium)"
else
  echo "[r3lab] no Chromium found: install Debian's chromium (apt-get install chromium) or set BROWSER_PATH" >&2
fi
unset -f _r3lab_find_chromium

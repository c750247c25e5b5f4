#!/usr/bin/env bash
# Every test file alone, in its own pytest process without the cache plugin: the proof that no test depends on
# another file having run first (or on pytest's cache). Two files at a time (R3LAB_TEST_JOBS, default 2); extra
# arguments go to each pytest (e.g. -m "not slow"). Prints one line per file (exit status, pytest's summary,
# seconds) and exits non-zero when any file fails; each file's log is kept under $R3LAB_EACH_FILE_LOGS (default: a
# temporary folder, printed).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
logs="${R3LAB_EACH_FILE_LOGS:-$(mktemp -d -t r3lab-each-file-XXXXXX)}"
mkdir -p "$logs"
jobs="${R3LAB_TEST_JOBS:-2}"
export R3LAB_EACH_FILE_LOGS="$logs"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # as scripts/test.sh: two processes' default OpenMP threads oversubscribe
one() {
    local f="$1"; shift
    local name t0 rc
    name="$(basename "$f" .py)"
    t0=$(date +%s)
    set +e
    python -m pytest -p no:cacheprovider -q "$f" "$@" > "$R3LAB_EACH_FILE_LOGS/$name.log" 2>&1
    rc=$?
    set -e
    [[ $rc == 5 ]] && rc=0  # every test of the file deselected (e.g. -m "not slow" on a slow file)
    printf '%-40s rc=%-3s %6ss  %s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" \
        "$(grep -E '(passed|failed|error|deselected|no tests ran)' "$R3LAB_EACH_FILE_LOGS/$name.log" | tail -1 | tr -d '=')"
    return "$rc"
}
export -f one
t0=$(date +%s)
set +e
ls tests/test_*.py | xargs -P "$jobs" -I{} bash -c 'one "$@"' _ {} "$@" | tee "$logs/summary.txt"
status=${PIPESTATUS[1]}
set -e
failed=$(grep -vc ' rc=0 ' "$logs/summary.txt" || true)
echo "$(wc -l < "$logs/summary.txt") test files alone, $jobs at a time, $(( $(date +%s) - t0 )) s; failed: $failed; logs: $logs"
exit $(( status != 0 || failed != 0 ))

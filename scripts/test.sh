#!/usr/bin/env bash
# The test suite: creates or reuses .venv, then runs pytest. Extra arguments go to pytest.
# Two pytest workers (pytest-xdist), each running whole test files (--dist loadfile: a file's module fixtures and
# its order stay in one process): a single test waits on one core most of its time (an engine start, a kernel, a
# browser), so two files side by side keep the machine's two cores busy (the suite: 12.5 min here, against 36 min
# in one process). R3LAB_TEST_WORKERS=N runs N workers; R3LAB_TEST_WORKERS=0 runs everything in this one process
# (what -s, --pdb or a plain traceback of one test want).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/venv.sh"
cd "$ROOT"
workers="${R3LAB_TEST_WORKERS:-2}"
if [[ ! "$workers" =~ ^[0-9]+$ ]]; then
    echo "R3LAB_TEST_WORKERS=$workers: a number of pytest workers (0: no workers, one process)" >&2
    exit 2
fi
if [[ "$workers" == 0 ]]; then
    exec python -m pytest "$@"
fi
# One CPU thread per process for torch's and MKL's OpenMP kernels unless the caller chose (the tiny models gain nothing
# from more): with two workers, each process's default of one OpenMP thread per core put 4+ spinning threads on 2
# cores, and every small parallel region waited for a descheduled thread (test_trainer_megatron, test_async and
# test_rl side by side: 365 -> 230 file-seconds, user CPU 344 -> 236 s). Subprocesses (ranks, kernels, servers)
# inherit it.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# --no-loadscope-reorder: the files go out in collection order, which tests/conftest.py sets heaviest first
# (FILE_SECONDS); xdist's own order (most tests first) left the slowest, few-test files for last
exec python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"

"""The importers' memory measure, shared by tests/test_importers.py and tests/test_importers_skyrl_verl.py.

A fresh Python imports a small dump (the warm-up: modules, caches), reads its peak resident set, imports the big dump
and reads the peak again: the rise is the most the big import held at once beyond the warm-up. The peak is the
process's ``VmHWM`` (``/proc/self/status``), which starts afresh at ``exec``. ``getrusage``'s ``ru_maxrss``, which
these tests read before, keeps the high-water mark of the process that forked the child (pytest's, 600 MB), so the
child's peak never rose above it, every rise read 0 and the bound could not fail
(tests/test_importers.py::test_the_memory_measure_sees_a_rise_below_pytests_own_peak keeps that from coming back).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_PROBE = """\
import sys
def peak():
    with open('/proc/self/status') as f:
        return int(next(l for l in f if l.startswith('VmHWM:')).split()[1]) * 1024
{import_line}
imp(sys.argv[1], sys.argv[3] + '-warm', config=sys.argv[4])
before = peak()
imp(sys.argv[2], sys.argv[3], config=sys.argv[4])
print(before, peak())
"""


def import_rise(import_line: str, small: Path | str, big: Path | str, out: Path | str, config: Path | str) -> int:
    """Bytes the peak resident set rose while ``imp(src, out, config=...)`` (what ``import_line`` binds) imported
    ``big`` after a warm-up on ``small``, in a fresh Python."""
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(import_line=import_line), str(small), str(big),
                           str(out), str(config)], check=True, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    before, after = (int(x) for x in proc.stdout.split())
    return after - before

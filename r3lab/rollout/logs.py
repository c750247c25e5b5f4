"""Quiet engines: vLLM's known, benign start-up warnings hidden (one line per process says so), logs on stderr.

On a CPU machine every engine start logs a dozen WARNING lines that say nothing about a run: libtcmalloc and
libiomp are not in ``LD_PRELOAD`` (a speed hint), ``torch.set_num_threads`` is skipped after vLLM binds its
threads (once per call, several calls), Triton has no CPU backend, eager mode is on (r3lab asks for it), and
so on (:data:`KNOWN`, vLLM 0.30's texts as seen on an engine start here). In a notebook they fill the output;
in a terminal vLLM writes them to stdout, between the results. Not a log record, so not filtered: torch's C++
line "Warning: NUMA binding: Using MEMBIND policy ..." (``init_cpu_memory_env``), which goes to stderr.

:func:`quiet_vllm_logs` (entered by ``r3lab.rollout._common.vllm_env`` around every engine start) does two
things, in this process and in the engine processes vLLM spawns meanwhile (through ``VLLM_LOGGING_CONFIG_PATH``,
which vLLM reads at import in each process):

- vLLM's log goes to stderr, so stdout holds results only (``r3lab drift --quick > out.txt``);
- :class:`KnownNoise` drops the messages of :data:`KNOWN`; the first one dropped in a process is replaced by a
  single line naming what is hidden. Anything else, a new or unknown warning included, still shows.

``R3LAB_VLLM_WARNINGS=all`` shows every warning as vLLM prints it. A user's own ``VLLM_LOGGING_CONFIG_PATH``
(or ``VLLM_CONFIGURE_LOGGING=0``) is left alone.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["KNOWN", "SHOW_ENV", "KnownNoise", "quiet_vllm_logs", "logging_config"]

SHOW_ENV = "R3LAB_VLLM_WARNINGS"  # "all": every warning as vLLM prints it
KNOWN: tuple[tuple[str, re.Pattern[str]], ...] = (  # (what the one line calls it, the message it matches)
    ("libtcmalloc/libiomp not in LD_PRELOAD (a speed hint)",
     re.compile(r"^lib(tcmalloc|iomp)\S* is not found in LD_PRELOAD")),
    ("torch.set_num_threads skipped after vLLM's thread binding",
     re.compile(r"^CPU backend doesn't allow to use `torch\.set_num_threads` after the thread binding")),
    ("Triton without a CPU backend, so the V1 model runner",
     re.compile(r"^(Triton is installed, but (doesn't include CPU backend|`triton\.backends` could not be imported)"
                r"|Model Runner V2 requires Triton; using the V1 model runner instead)")),
    ("eager mode as r3lab asks (no torch.compile, no inductor)",
     re.compile(r"^(Enforce eager set, disabling torch\.compile|Inductor compilation was disabled by user settings)")),
    ("no Mamba layers (SSM cache type) and no DeepSelect extension",
     re.compile(r"^(Reset SSM cache type to float32|Failed to import the DeepSelect extension)")),
    ("the global seed in an in-process engine (r3lab seeds every step itself)",
     re.compile(r"^The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False")),
    ("NUMA memory node fallback",
     re.compile(r"^(Node \S+ is not in available memory nodes|CPU group key \S+ is not a valid memory node)")),
)
_LEVEL_ENV, _CONFIG_ENV, _CONFIGURE_ENV = "VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING"


class KnownNoise(logging.Filter):
    """Drops the messages of :data:`KNOWN`; the first dropped in this process becomes one line saying what is
    hidden and how to see it. Every other record passes unchanged."""

    said = False  # once per process, over every handler and logger

    def filter(self, record: logging.LogRecord) -> bool:
        if os.environ.get(SHOW_ENV, "").lower() == "all":
            return True
        msg = record.getMessage()
        if not any(p.search(msg) for _, p in KNOWN):
            return True
        if KnownNoise.said:
            return False
        KnownNoise.said = True
        record.msg = (f"r3lab: hiding vLLM's known, benign start-up warnings in this process "
                      f"({'; '.join(w for w, _ in KNOWN)}); {SHOW_ENV}=all shows them")
        record.args = ()
        return True


def logging_config(level: str) -> dict:
    """vLLM's own logging config (its format), to stderr, at ``level``, with :class:`KnownNoise` on its handler."""
    fmt = "%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": {"class": "vllm.logging_utils.NewLineFormatter", "datefmt": "%m-%d %H:%M:%S",
                                "format": fmt}},
        "filters": {"r3lab_known_noise": {"()": f"{__name__}.KnownNoise"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": level,
                              "stream": "ext://sys.stderr", "filters": ["r3lab_known_noise"]}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": level, "propagate": False}},
    }


def _config_file(level: str) -> Path:
    """The config as a JSON file for spawned processes (one per process and level; removed at exit)."""
    path = Path(tempfile.gettempdir()) / f"r3lab-vllm-logging-{os.getpid()}-{level.lower()}.json"
    if not path.is_file():
        path.write_text(json.dumps(logging_config(level)))
        atexit.register(path.unlink, missing_ok=True)
    return path


def _quiet_handlers() -> None:
    """This process's ``vllm`` handlers (a vLLM imported before): KnownNoise on each, stdout moved to stderr."""
    for h in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, KnownNoise) for f in h.filters):
            h.addFilter(KnownNoise())
        if isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.__stdout__):
            h.setStream(sys.stderr)


@contextmanager
def quiet_vllm_logs() -> Iterator[None]:
    """vLLM's log on stderr without the known start-up noise, here and in engine processes spawned in the block."""
    user_config = os.environ.get(_CONFIG_ENV) or os.environ.get(_CONFIGURE_ENV, "1") == "0"
    old = os.environ.get(_CONFIG_ENV)
    if user_config:
        yield
        return
    os.environ[_CONFIG_ENV] = str(_config_file(os.environ.get(_LEVEL_ENV, "INFO").upper()))
    _quiet_handlers()
    try:
        yield
    finally:
        _quiet_handlers()  # a vLLM first imported in the block: its handler too
        if old is None:
            os.environ.pop(_CONFIG_ENV, None)
        else:
            os.environ[_CONFIG_ENV] = old

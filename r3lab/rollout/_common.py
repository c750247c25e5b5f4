"""What the in-process engine and the server client share: model checks, CPU defaults, vLLM's environment.

Private to :mod:`r3lab.rollout`. It imports no vLLM at import time, and nothing from the trainer side.
The free port and the close-on-exit lifecycle come from the stage-neutral :mod:`r3lab._process`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from r3lab._process import Closing, free_port
from r3lab.moe_layout import ModelConfigError, MoELayout

__all__ = [
    "Closing",
    "free_port",
    "ENGINE_DEFAULTS",
    "CPU_DEFAULTS",
    "as_cli_args",
    "check_model_dir",
    "default_cpu_bind",
    "vllm_env",
    "quiet_log_level",
    "LOG_LEVEL_ENV",
]

# vLLM settings r3lab uses everywhere, and on CPU builds only (overridable by the caller).
ENGINE_DEFAULTS: dict[str, Any] = {"dtype": "bfloat16"}
CPU_DEFAULTS: dict[str, Any] = {"enforce_eager": True, "kv_cache_memory_bytes": 128 << 20, "max_num_seqs": 64}

LOG_LEVEL_ENV = "VLLM_LOGGING_LEVEL"  # read by vllm.logger when vLLM is first imported (vllm 0.30: envs.py)
_QUIET = "WARNING"


def as_cli_args(kwargs: dict[str, Any]) -> list[str]:
    """vLLM keyword arguments as command-line flags: True is a bare flag, False and None are left out.

    ``{"kv_cache_memory_bytes": 1, "enforce_eager": True}`` -> ``["--kv-cache-memory-bytes", "1", "--enforce-eager"]``
    """
    out: list[str] = []
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False and v is not None:
            out += [flag, str(v)]
    return out


def check_model_dir(model: str | os.PathLike, *, need_tokenizer: bool = False) -> tuple[Path, MoELayout]:
    """The model directory and its MoE layout; raises :class:`ModelConfigError` before any process starts.

    Checks: a readable config of a known MoE family (:meth:`MoELayout.from_model_dir`), ``.safetensors``
    weights, and with ``need_tokenizer`` a tokenizer (the server's completions endpoint cannot run without).
    """
    path = Path(model)
    layout = MoELayout.from_model_dir(path)
    if not list(path.glob("*.safetensors")):
        raise ModelConfigError(f"model path {str(path)!r} has no .safetensors weights")
    if need_tokenizer and not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelConfigError(f"{str(path)!r} ships no tokenizer; the completions endpoint needs one")
    return path, layout


def default_cpu_bind(requested: str | None = None) -> str:
    """The CPU cores for vLLM's OpenMP threads: ``requested``, else ``$VLLM_CPU_OMP_THREADS_BIND``, else one core."""
    if requested:
        return requested
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return str(cores[-1])


def quiet_log_level() -> str | None:
    """The level r3lab gives vLLM's log: WARNING, or None (leave it) when ``$VLLM_LOGGING_LEVEL`` is set."""
    return None if os.environ.get(LOG_LEVEL_ENV) else _QUIET


@contextmanager
def vllm_env(**values: str | None) -> Iterator[None]:
    """Environment for importing and starting vLLM in this process (and the processes it spawns meanwhile).

    Sets ``values`` (None: leave that variable as is) for the block and, unless the user chose a level in
    ``$VLLM_LOGGING_LEVEL``, vLLM's log level to WARNING: through the variable for a first import of vLLM
    and for spawned engine processes, and on the ``vllm`` logger for a vLLM imported before (the logger
    keeps WARNING after the block). Warnings and errors still show.
    """
    from r3lab.rollout.logs import quiet_vllm_logs  # known start-up noise hidden, vLLM's log on stderr

    level = quiet_log_level()
    with _env(**{LOG_LEVEL_ENV: level}, **values), _stdout_with_fd(), quiet_vllm_logs():
        if level is not None:
            logging.getLogger("vllm").setLevel(level)
        yield


@contextmanager
def _stdout_with_fd() -> Iterator[None]:
    """``sys.stdout`` with a real file descriptor for the block: vLLM silences C-level prints while it builds its
    process groups by dup2-ing ``sys.stdout.fileno()``, which a Jupyter kernel's stream (no descriptor) refuses
    (``UnsupportedOperation: fileno``). In a kernel the process's own stdout (or /dev/null) stands in."""
    try:
        sys.stdout.fileno()
        yield
        return
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        pass
    saved, devnull = sys.stdout, None
    try:
        try:
            sys.__stdout__.fileno()
            sys.stdout = sys.__stdout__
        except (AttributeError, OSError, ValueError):
            sys.stdout = devnull = open(os.devnull, "w")  # noqa: SIM115 - closed below
        yield
    finally:
        sys.stdout = saved
        if devnull is not None:
            devnull.close()


@contextmanager
def _env(**values: str | None) -> Iterator[None]:
    """Set environment variables for the duration of the block (None: leave as is)."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is not None:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

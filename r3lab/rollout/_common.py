"""What the in-process engine and the server client share: model checks, CPU defaults, vLLM's environment.

Private to :mod:`r3lab.rollout`. It imports no vLLM at import time, and nothing from the trainer side.
The free port and the close-on-exit lifecycle come from the stage-neutral :mod:`r3lab._process`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.moe_layout import ModelConfigError, MoELayout
from r3lab.rollout.types import RolloutError

__all__ = [
    "ENGINE_DEFAULTS",
    "CPU_DEFAULTS",
    "as_cli_args",
    "check_prompts",
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


def check_prompts(prompts: Any, *, max_tokens: int, max_model_len: int, vocab_size: int = 0,
                  tokenize: Callable[[str], Sequence[int]] | None = None) -> list[list[int]]:
    """Token ids of each prompt, checked: a non-empty list, each prompt non-empty plain ints in ``[0, vocab_size)``
    (0: unchecked) that fit the context with ``max_tokens`` more. Strings need ``tokenize`` (the embedded engine's
    tokenizer); without one (the server client) a string is an error that says to pass token ids."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise RolloutError(f"prompts must be a list of strings or token-id lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise RolloutError("prompts is empty: nothing to generate")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenize is None:
                raise RolloutError(f"prompt {i}: the server client takes token ids "
                                   "(the engine's tokenizer decides text)")
            ids = [int(t) for t in tokenize(p)]
        elif isinstance(p, (Sequence, np.ndarray)) and not isinstance(p, bytes):
            arr = np.asarray(p)
            if arr.size and (arr.ndim != 1 or arr.dtype.kind not in "iu"):
                raise RolloutError(f"prompt {i}: token ids must be a flat list of ints, got {arr.dtype} {arr.shape}")
            ids = [int(t) for t in arr.reshape(-1)]  # plain ints: numpy ints break vLLM's serializer
        else:
            raise RolloutError(f"prompt {i}: expected a string or a list of token ids, got {type(p).__name__}")
        if not ids:
            raise RolloutError(f"prompt {i} is empty (no tokens): the engine needs at least one prompt token")
        if vocab_size and (min(ids) < 0 or max(ids) >= vocab_size):
            raise RolloutError(f"prompt {i}: token id outside [0, {vocab_size})")
        if len(ids) + max_tokens > max_model_len:
            raise RolloutError(f"prompt {i} has {len(ids)} tokens; with max_tokens={max_tokens} it exceeds the context "
                               f"length {max_model_len}")
        out.append(ids)
    return out

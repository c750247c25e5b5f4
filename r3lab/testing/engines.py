"""One vLLM engine per (model, options) for a whole test session, handed out as if freshly started.

Starting vLLM is the suite's main cost (tens of seconds each on a CPU); most engine tests only read from the engine
(generate, score), and the ones that push weights (the RL loop, weight-sync checks) start from the checkpoint anyway.
:class:`EnginePool` starts each distinct engine once and, at every :meth:`~EnginePool.engine` hand-out after the
first, puts it back in the state a fresh start leaves:

* the checkpoint's weights and ``weight_version`` 0 (a full reload through ``update_weights``, as the RL loop's own
  start does, when anything was pushed since; ``engine_quant`` engines are quantized again on the way in);
* an empty prefix cache (no KV block, nor the routes stored with it, carried over from another test);
* a new start when another in-process engine was closed since (vLLM's shutdown tears down the process-wide
  parallel groups every in-process engine runs on), byte-checked like a reset;
* the process-wide RNGs seeded with the engine's seed, as vLLM's worker leaves them at the end of its start
  (``set_random_seed(seed)``: Python's, NumPy's and torch's), so unseeded sampling draws as it did on a fresh engine.

A byte check proves the reset: at the engine's start a fixed probe (two prompts, seeded sampling) records tokens,
routes and log-probs; every later hand-out and every :meth:`~EnginePool.restore` samples the probe again and raises
:class:`~r3lab.errors.R3LabError` unless all three are identical to the bytes seen at the start (a reload that did
not happen, or weights left behind by a test, fail loudly instead of shifting the next test's numbers).

Used by the suite's session fixture (``tests/conftest.py``: ``engine_pool``); a notebook that runs many experiments
can use it the same way. The engines run in this process (``in_process=True``, the default); :meth:`close` ends
them all.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import R3LabError
from r3lab.rollout import RolloutEngine, SamplingConfig

__all__ = ["EnginePool", "PROBE_PROMPTS"]

#: The probe every hand-out samples again (words of the tiny models' corpus; seeded, so the draw is the same).
PROBE_PROMPTS = ("kupi kobire reti ma lo", "reti ma")
_PROBE_SAMPLING = SamplingConfig(max_tokens=8, seed=11, ignore_eos=True)


@dataclass
class _Entry:
    engine: RolloutEngine
    seed: int
    probe: tuple[bytes, ...]
    handouts: int = 0
    pushes: int = 0  # update_weights calls since the last reload of the checkpoint
    reloads: int = 0
    restarts: int = 0  # new starts after another engine's close tore down vLLM's process-wide groups


class EnginePool:
    """Session-wide engines keyed by (model directory, options); see the module docstring for the reset contract."""

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}

    @staticmethod
    def _key(model: str | os.PathLike, options: dict[str, Any]) -> tuple:
        return (str(Path(model).resolve()), tuple(sorted((k, repr(v)) for k, v in options.items())))

    def engine(self, model: str | os.PathLike, *, seed: int = 0, **options: Any) -> RolloutEngine:
        """The pool's engine for ``model`` and these ``RolloutEngine`` options, started on first use, otherwise reset
        to a fresh start's state (weights, version, prefix cache, RNGs) and byte-checked. Never close it yourself."""
        key = self._key(model, {"seed": seed, **options})
        entry = self._entries.get(key)
        if entry is None:
            eng = RolloutEngine(model, seed=seed, **options)
            entry = self._entries[key] = _Entry(eng, seed, _probe(eng))
            _count_pushes(entry)
        elif not _parallel_state_alive():
            # another in-process engine was closed since: vLLM's shutdown destroys the process-wide parallel groups
            # every in-process engine runs on, so this one cannot run again; a new start replaces it (left unclosed:
            # closing it would tear down the new engine's groups), and its probe must be the first start's bytes
            eng = RolloutEngine(model, seed=seed, **options)
            entry.engine, entry.pushes, entry.restarts = eng, 0, entry.restarts + 1
            _count_pushes(entry)
            self._check_probe(entry, where="restart")
        else:
            self._reset(entry, where="hand-out")
        entry.handouts += 1
        entry.engine._llm.reset_prefix_cache()
        _seed_everything(entry.seed)
        return entry.engine

    def restore(self, engine: RolloutEngine) -> None:
        """Put ``engine`` (one of the pool's) back to its checkpoint weights and version 0, byte-checked; a test module
        that pushed weights calls this when done (the next :meth:`engine` hand-out would do it too). After another
        engine's close (vLLM's groups gone) there is nothing to run: the next hand-out starts it anew."""
        entry = self._entry_of(engine)
        if _parallel_state_alive():
            self._reset(entry, where="restore")

    @contextmanager
    def lease(self, model: str | os.PathLike, *, seed: int = 0, **options: Any) -> Iterator[RolloutEngine]:
        """``with pool.lease(model) as eng:``: :meth:`engine`, then :meth:`restore` on the way out."""
        eng = self.engine(model, seed=seed, **options)
        try:
            yield eng
        finally:
            self.restore(eng)

    def close(self) -> None:
        """End every engine of the pool."""
        entries, self._entries = self._entries, {}
        for entry in entries.values():
            entry.engine.close()

    def __len__(self) -> int:
        return len(self._entries)

    def _entry_of(self, engine: RolloutEngine) -> _Entry:
        for entry in self._entries.values():
            if entry.engine is engine:
                return entry
        raise R3LabError("EnginePool.restore: this engine is not one of the pool's")

    def _reset(self, entry: _Entry, *, where: str) -> None:
        eng = entry.engine
        if entry.pushes or eng.weight_version != 0:
            eng.update_weights(dict(_checkpoint_state_dict(eng.model_dir)), version=0)
            entry.pushes, entry.reloads = 0, entry.reloads + 1
        self._check_probe(entry, where=where)

    def _check_probe(self, entry: _Entry, *, where: str) -> None:
        eng = entry.engine
        got = _probe(eng)
        if got != entry.probe:
            which = [name for name, a, b in zip(("tokens", "routes", "logprobs"), got, entry.probe, strict=True)
                     if a != b]
            raise R3LabError(f"EnginePool {where}: the engine on {str(eng.model_dir)!r} does not sample its probe as "
                             f"it did when it started ({', '.join(which)} differ) after a reload of the checkpoint: a "
                             "test left other weights or state behind, or the reload did not reach the engine")
        if eng.weight_version != 0:
            raise R3LabError(f"EnginePool {where}: weight_version is {eng.weight_version} after the reset, not 0")


def _parallel_state_alive() -> bool:
    """Whether vLLM's process-wide model-parallel groups (what an in-process engine's forward reads) still exist."""
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    return bool(model_parallel_is_initialized())


def _count_pushes(entry: _Entry) -> None:
    """Count ``update_weights`` calls on the pool's engine (an instance attribute wraps the method), so a reset
    reloads the checkpoint exactly when something was pushed since the last one."""
    update = entry.engine.update_weights

    def counting_update(*args: Any, **kwargs: Any) -> int:
        entry.pushes += 1
        return update(*args, **kwargs)

    entry.engine.update_weights = counting_update  # type: ignore[method-assign]


def _checkpoint_state_dict(model_dir: Path) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                yield k, f.get_tensor(k)


def _probe(eng: RolloutEngine) -> tuple[bytes, bytes, bytes]:
    """Tokens, routes and log-probs of the fixed probe, as bytes (the prefix cache is emptied first and after, so
    the probe neither reads nor leaves a cached block)."""
    eng._llm.reset_prefix_cache()
    res = eng.generate(list(PROBE_PROMPTS), _PROBE_SAMPLING)
    eng._llm.reset_prefix_cache()
    tokens = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in res]).tobytes()
    routes = RolloutEngine.stack_routes(res).values.tobytes()
    logprobs = np.concatenate([np.asarray(r.logprobs, dtype=np.float32) for r in res]).tobytes()
    return tokens, routes, logprobs


def _seed_everything(seed: int) -> None:
    """What vLLM's worker does last in its start (``vllm.utils.torch_utils.set_random_seed``; on CPU the platform's
    ``manual_seed_all`` is torch's)."""
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

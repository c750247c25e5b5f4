"""An engine-only run: prompts sent through an engine, its tokens, log-probs and routes written (``r3lab capture``).

    # the server a user started on a GPU node (python -m vllm.entrypoints.openai.api_server --model CKPT
    # --enable-return-routed-experts), the prompts a file of theirs:
    r3lab capture --engine-url http://gpu-node:8000 --prompts prompts.txt --out data/runs/my-capture

No trainer runs. The run (kind ``capture``, :data:`~r3lab.runs.format.CAPTURE_KIND`) has one step, 0, holding every
sample in prompt order (``--samples`` completions of each prompt next to each other): the per-sample table (prompt
and response token ids, the engine's log-probs), the engine's routes (``P + R - 1`` rows per sample, the drift
experiment's convention) and a per-token table (``sample``, ``position``, ``logp_infer``). That is what notebooks
02 and 06 draw (expert load, imbalance, route view), what notebook 01 opens (``capture_run``), and what
``r3lab rescore`` needs to score it with a trainer afterwards.

Prompts (:func:`read_prompts`): a ``.jsonl`` file holds one JSON object per line whose ``"prompt"`` is a string or
a list of token ids (other keys are ignored); any other file is text, one prompt per line (blank lines skipped,
the line taken as written, without its line break). Text is encoded with the local checkpoint's tokenizer, as the
drift experiment encodes its prompts, so the same prompts and seed give the drift run's tokens and routes.

A failure (the server gone away, Ctrl-C) after the run folder is created leaves it marked stopped with the reason
(``stopped.json``), never a half-written run: steps are written only once every request has come back.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r3lab.cluster import place
from r3lab.config import CaptureConfig
from r3lab.errors import ConfigError, R3LabError, RolloutError, RunFormatError
from r3lab.paths import model_dir
from r3lab.rollout import Engine, RolloutResult, SamplingConfig, stack_routes
from r3lab.runs import RunWriter, Samples, load, mark_stopped
from r3lab.runs.format import CAPTURE_KIND
from r3lab.vocabulary import RLMetric

__all__ = ["Captured", "read_prompts", "run_capture", "capture_results",
           "sample_or_load"]

Prompt = str | list[int]


def read_prompts(path: str | os.PathLike[str]) -> list[Prompt]:
    """The prompts of a file: JSONL (``.jsonl``: ``{"prompt": "text" | [ids]}`` per line) or text (one per line)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompts file {str(p)!r} does not exist (a text file, one prompt per line, or a .jsonl "
                          'file of {"prompt": ...} objects)')
    out: list[Prompt] = []
    lines = p.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if p.suffix != ".jsonl":
            out.append(line)
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{p}:{i}: not JSON ({e}); a .jsonl prompts file holds one object per line") from e
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if isinstance(prompt, str) and prompt:
            out.append(prompt)
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):  # bool is no token id
            out.append([int(t) for t in prompt])
        else:
            raise ConfigError(f'{p}:{i}: needs a "prompt" that is a non-empty string or list of token ids, got '
                              f"{str(obj)[:120]}")
    if not out:
        raise ConfigError(f"prompts file {str(p)!r} holds no prompt")
    return out


@dataclass(frozen=True)
class Captured:
    """Samples and what reads them: the results (engine routes on each), the tokenizer, the run they came from."""

    results: list[RolloutResult]
    tokenizer: Any
    run: Path | None = None


def _sampling(config: CaptureConfig) -> SamplingConfig:
    return SamplingConfig(max_tokens=config.max_tokens, seed=config.seed, temperature=config.temperature,
                          n=config.samples)


def _model_path(config: CaptureConfig) -> Path:
    """The local checkpoint: ``config.model``, else the served model's name when that names one here."""
    if config.model is not None:
        return model_dir(config.model, config.data)
    from r3lab.rollout import served_model

    name = served_model(str(config.engine_url))
    try:
        return model_dir(name, config.data)
    except R3LabError as e:
        raise ConfigError(f"the server at {config.engine_url} serves {name!r}, which is not a local checkpoint here "
                          f"({e}); give {{model}} (the trainer's copy of the weights it serves)",
                          field="model") from e


def capture_results(engine: Any, prompts: Sequence[Prompt], sampling: SamplingConfig, *, batch: int = 64,
                    progress: bool = False) -> list[RolloutResult]:
    """``engine.generate`` over ``prompts``, ``batch`` prompts a request; results in prompt order, indices global."""
    from tqdm.auto import tqdm

    out: list[RolloutResult] = []
    starts = range(0, len(prompts), max(1, int(batch)))
    for a in tqdm(starts, desc=CAPTURE_KIND, unit="request", disable=not progress):
        for r in engine.generate(list(prompts[a:a + batch]), sampling):
            out.append(RolloutResult(a + r.prompt_index, r.sample_index, r.prompt_ids, r.response_ids, r.logprobs,
                                     r.routes, r.finish_reason, r.routes_start))
    return out


def run_capture(config: CaptureConfig, prompts: str | os.PathLike[str] | Sequence[Prompt], out: str | os.PathLike[str],
                *, progress: bool = True) -> Path:
    """Send ``prompts`` (a prompts file, :func:`read_prompts`, or a list) through the engine ``config`` names and
    write an engine-only run at ``out`` (must not exist). Returns the run folder.

    Checked before the folder is made: the config, the prompts, the model and (attached) the server's handshake. A
    failure after that leaves the run marked stopped with the reason (the server that went away is named)."""
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{str(out)!r} exists; runs are never overwritten (give another --out)")
    source: dict[str, Any] = {}
    if isinstance(prompts, (str, os.PathLike)):
        f = Path(prompts)
        items = read_prompts(f)
        source = {"prompts_file": str(f.resolve()), "prompts_sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    else:
        items = list(prompts)
        if not items:
            raise ConfigError("no prompts to capture")
    path = _model_path(config)
    sampling = _sampling(config)
    with place(config, path).start_engine(seed=0) as engine:  # the attached server at engine_url, or a local engine
        _check_known_words(engine, items)
        cfg = {**config.to_dict(), "model": str(path), **source, "prompts": len(items), "engine": engine.facts(),
               "trainer": None}
        writer = RunWriter(out.parent, out.name, CAPTURE_KIND, cfg)
        try:
            t0 = time.perf_counter()
            results = capture_results(engine, items, sampling, batch=config.batch, progress=progress)
            seconds = time.perf_counter() - t0
            write_capture(writer, results, model=str(path), seed=config.seed, seconds=seconds)
            writer.finish({"samples": len(results), "prompts": len(items),
                           "tokens": sum(len(r.response_ids) for r in results), RLMetric.TIME_GENERATE: seconds})
        except BaseException as e:  # the server gone, Ctrl-C: the folder says stopped and why, never half-done
            writer.close()
            if not writer.finished:
                mark_stopped(writer.path, f"{type(e).__name__}: {e}")
            raise
    return writer.path


def _check_known_words(engine: Engine, prompts: Sequence[Prompt]) -> None:
    """A text prompt the tokenizer reads as unknown tokens only would sample from nothing: an error naming it."""
    tok = engine.tokenizer
    unk = getattr(tok, "unk_token_id", None)  # a tokenizer's own attribute (None: it has no unknown token)
    if tok is None or unk is None:
        return
    for i, p in enumerate(prompts):
        if isinstance(p, str) and set(tok.encode(p, add_special_tokens=False)) <= {unk}:
            raise ConfigError(f"prompt {i} ({p[:60]!r}) is all unknown tokens to {engine.model_dir}'s "
                              "tokenizer: is it text of this model's vocabulary?")


def write_capture(writer: RunWriter, results: Sequence[RolloutResult], *, model: str, seed: int,
                  seconds: float | None = None) -> None:
    """Step 0 of a capture run: its step line, per-token table, per-sample table and the engine's routes."""
    import numpy as np

    if not results:
        raise RolloutError("no samples to write")
    n = [len(r.response_ids) for r in results]
    writer.log_step({"step": 0, "model": model, "seed": int(seed), "samples": len(results), "tokens": int(sum(n)),
                     RLMetric.TIME_GENERATE: seconds})
    writer.write_tokens(0, {"sample": np.repeat(np.arange(len(results)), n),
                            "position": np.concatenate([np.arange(k) for k in n]),
                            "logp_infer": np.concatenate([np.asarray(r.logprobs, np.float64) for r in results])})
    writer.write_samples(0, Samples.from_ids([r.prompt_ids for r in results], [r.response_ids for r in results],
                                             [r.logprobs for r in results]))
    writer.write_routes(0, "engine", stack_routes(results))


def sample_or_load(run: str | os.PathLike[str] | None, model: str | os.PathLike[str], prompts: Sequence[Prompt],
                   sampling: SamplingConfig, *, engine_url: str | None = None, seed: int = 0) -> Captured:
    """Notebook 01's samples: a capture run's (``run``: of ``model``), else ``prompts`` sampled now, by the server
    at ``engine_url`` (attached; ``model`` is its local checkpoint) or by a local engine seeded ``seed``."""
    path = model_dir(model)
    if run is not None:
        from transformers import AutoTokenizer

        from r3lab.experiments.rescore import stored_results

        r = load(run)
        if r.kind != CAPTURE_KIND:
            raise RunFormatError(f"run {r.name!r} is a {r.kind!r} run; give a capture run (r3lab capture)")
        if Path(r.config["model"]).resolve() != path.resolve():
            raise ConfigError(f"run {r.name!r} captured {r.config['model']}, not {path}: set model to its checkpoint",
                              field="model")
        return Captured(stored_results(r, 0)[0], AutoTokenizer.from_pretrained(str(path)), Path(run))
    config = CaptureConfig(model=str(path), engine_url=engine_url)  # where run_capture would sample them
    with place(config, path).start_engine(seed=seed) as engine:
        return Captured(engine.generate(list(prompts), sampling), engine.tokenizer)

"""Scoring a finished run's samples again with another trainer, layout or dtype (``r3lab rescore``).

A run of format version 3 keeps every sample's token ids and the engine's log-probs (``samples/``) and the engine's
routes of every step (``routes/step-*.engine.r3``). That is all the drift measurement needs: the trainer named here
scores the stored samples without replay ("none") and replaying the stored engine routes ("R3"), exactly as the
drift experiment does (:func:`r3lab.experiments.drift.replay_drift`), and the result is written as a new drift run
beside the original, with the drift run's metric names and, per cell, the original's values next to them
(``source/*``) and how far the new trainer's log-probs are from the original trainer's (``vs_source/*``). Nothing
is replayed through an engine: the engine's side is what the run stored.

Weights: a drift run scores the checkpoint it sampled with, so every cell can be scored again. An RL run's engine
and trainer hold the starting checkpoint only at step 0; later steps need the weights of that step, which a run
does not keep, so only step 0 is scored and asking for another step is an error that says so. A capture run
(``r3lab capture``: engine only) is scored like a drift cell at the checkpoint it names; it has no trainer's values
to compare, so its ``source/*`` columns are empty, and its trainer dtype defaults to float32.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.config import TRAINER_DTYPES, TRAINERS, DriftConfig
from r3lab.errors import ConfigError, RunFormatError
from r3lab.experiments.drift import (
    DriftRow,
    DriftSample,
    drift_spread,
    drift_summary,
    load_scorer,
    replay_drift,
    write_drift_cell,
)
from r3lab.paths import model_dir
from r3lab.rollout import RolloutResult
from r3lab.routes import Routes
from r3lab.runs import Run, RunWriter, load
from r3lab.runs.format import CAPTURE_KIND, check_run_name
from r3lab.trainer_registry import TRAINER_REGISTRY, trainer_spec
from r3lab.vocabulary import DriftMetric, RLMetric, RunKind

__all__ = ["stored_results", "RESCORE_KINDS"]

RESCORE_KINDS = (RunKind.DRIFT, RunKind.RL, CAPTURE_KIND)  # the runs whose samples can be scored again
CAPTURE_DTYPE = "float32"  # a capture run's trainer dtype when none is given (it has no trainer of its own)
_COMPARED = ("tokens", DriftMetric.FLIPPED_SHARE, DriftMetric.K3_NONE, DriftMetric.K3_R3,
             RLMetric.ENGINE_TRAINER_DISAGREEMENT)


@dataclass(frozen=True)
class _Cell:
    """One set of stored samples to score: a source step and the trainer dtype to score it in."""

    source_step: int
    model: str
    seed: int
    dtype: str
    source: dict[str, Any]  # the source's values of the compared metrics (None where it has none)


def stored_results(run: Run, step: int) -> tuple[list[RolloutResult], list[np.ndarray] | None]:
    """A step's samples as the engine returned them, from the run's files: token ids, the engine's log-probs and its
    routes (engine rows, ``P + R - 1`` per sample), and per sample the sampled mask (multi-turn runs; else None)."""
    samples = run.samples(step)
    routes = run.routes(step, "engine")
    if len(routes) != len(samples):
        raise RunFormatError(f"run {run.name!r} step {step}: {len(samples)} samples but engine routes of "
                             f"{len(routes)} sequences")
    out = []
    for i in range(len(samples)):
        p, r = samples.prompt_ids[i], samples.response_ids[i]
        seq, rows = routes.take([i]), int(routes.lengths[i])
        if rows == p.size + r.size:  # the RL loop stores the trainer's rows (one more, appended)
            seq = Routes(seq.values[:-1], [0, rows - 1], seq.num_experts, seq.layer_ids)
        elif rows != p.size + r.size - 1:
            raise RunFormatError(f"run {run.name!r} step {step} sample {i}: {rows} engine route rows for "
                                 f"{p.size} + {r.size} tokens (want {p.size + r.size - 1})")
        out.append(RolloutResult(i, 0, p.tolist(), r.tolist(), samples.logp_infer[i], seq))
    return out, None if samples.sampled is None else list(samples.sampled)


def _masked(s: DriftSample, keep: np.ndarray) -> DriftSample:
    """A sample's token arrays at the tokens the engine sampled (multi-turn: observations have no engine log-prob)."""
    def cut(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[keep]

    return DriftSample(s.logp_infer[keep], s.logp_none[keep], s.logp_r3[keep], s.flipped[keep],
                       cut(s.logp_none_batched), cut(s.logp_engine_again), s.trainer_routes)


def _disagreement(engine: Routes, trainer: Routes) -> float:
    """Share of (row, layer) pairs whose expert sets differ, over the engine's rows."""
    return float(metrics.set_differs(engine.values, trainer.select_layers(engine.layer_ids).values).mean())


def _trainer_label(cfg: dict[str, Any]) -> str:
    """The source run's trainer as the table names it (its layout too, for a layout trainer)."""
    if "trainer" in cfg and cfg["trainer"] is None:  # a capture run: the engine alone
        return "no trainer (engine-only capture)"
    t = str(cfg.get("trainer", "hf"))
    spec = TRAINER_REGISTRY.get(t)
    if spec is None:  # a run of a trainer this checkout does not know: its name as written
        return t
    return spec.layout_label(*(int(cfg.get(k, 1)) for k in ("tp", "pp", "ep")))


def _source_cells(run: Run, steps: Sequence[int] | None, trainer_dtype: str | None) -> list[_Cell]:
    records = {int(r["step"]): r for r in run.step_records}
    cfg = run.config
    if run.kind == RunKind.RL:
        want = [0] if steps is None else [int(s) for s in steps]
        later = [s for s in want if s != 0]
        if later:
            raise ConfigError(f"run {run.name!r} is an RL run: step {later[0]} was sampled and scored with the weights "
                              f"after {later[0]} update(s), which the run does not keep (only its starting "
                              "checkpoint is known); only step 0 can be scored again")
        rec = records.get(0)
        if rec is None:
            raise RunFormatError(f"run {run.name!r} has no step 0")
        if rec.get(RLMetric.ENGINE_WEIGHT_VERSION, 0) != 0:
            raise RunFormatError(f"run {run.name!r} step 0 was sampled with engine weight version "
                                 f"{rec[RLMetric.ENGINE_WEIGHT_VERSION]}, not the starting checkpoint")
        dtype = trainer_dtype or str(cfg.get("trainer_dtype", "float32"))
        return [_Cell(0, str(cfg["model"]), int(cfg.get("seed", 0)), dtype, _rl_source(run, 0, rec))]
    want = sorted(records) if steps is None else [int(s) for s in steps]
    chosen: dict[tuple[str, int, str], int] = {}  # (model, seed, dtype to score in) -> the source step
    for s in want:
        if s not in records:
            raise ConfigError(f"run {run.name!r} has no step {s} (steps {sorted(records)[:20]})")
        rec = records[s]
        dtype = trainer_dtype or str(rec.get("trainer_dtype") or CAPTURE_DTYPE)
        key = (str(rec["model"]), int(rec["seed"]), dtype)
        # the same samples in the same dtype are one cell; the source compared is the cell of that dtype if any
        if key not in chosen or (records[chosen[key]].get("trainer_dtype") != dtype
                                 and rec.get("trainer_dtype") == dtype):
            chosen[key] = s
    cells = []
    for (model, seed, dtype), s in sorted(chosen.items(), key=lambda kv: kv[1]):
        rec = records[s]
        src = {k: rec.get(k) for k in _COMPARED}
        if s in run.route_steps("trainer") and s in run.route_steps("engine"):
            src[RLMetric.ENGINE_TRAINER_DISAGREEMENT] = _disagreement(run.routes(s, "engine"), run.routes(s, "trainer"))
        src["trainer_dtype"] = rec.get("trainer_dtype")
        cells.append(_Cell(s, model, seed, dtype, src))
    return cells


def _rl_source(run: Run, step: int, rec: dict[str, Any]) -> dict[str, Any]:
    """An RL step's values of the drift metrics, from its per-token table: native routing is ``logp_native``; under
    R3 the old log-probs replayed the engine's routes."""
    src: dict[str, Any] = dict.fromkeys(_COMPARED)
    src["trainer_dtype"] = run.config.get("trainer_dtype")
    if step not in run.token_steps():
        return src
    t = run.tokens([step])
    keep = t["loss_mask"].to_numpy(bool) if "loss_mask" in t else np.ones(len(t), bool)
    infer = t["logp_infer"].to_numpy()[keep]
    src["tokens"] = int(keep.sum())
    src[DriftMetric.FLIPPED_SHARE] = float(t["flipped"].to_numpy()[keep].mean())
    src[DriftMetric.K3_NONE] = metrics.k3_kl(t["logp_native"].to_numpy()[keep], infer)
    if run.config.get("mode") == "R3":
        src[DriftMetric.K3_R3] = metrics.k3_kl(t["logp_old"].to_numpy()[keep], infer)
    return src


def _source_logps(run: Run, step: int) -> dict[str, np.ndarray]:
    """The original trainer's per-token log-probs of a step (none, and R3 where it has them), at sampled tokens."""
    if run.kind == CAPTURE_KIND or step not in run.token_steps():  # a capture run has no trainer
        return {}
    t = run.tokens([step])
    keep = t["loss_mask"].to_numpy(bool) if "loss_mask" in t else np.ones(len(t), bool)
    if run.kind == RunKind.DRIFT:
        return {"none": t["logp_none"].to_numpy()[keep], "r3": t["logp_r3"].to_numpy()[keep]}
    out = {"none": t["logp_native"].to_numpy()[keep]}
    if run.config.get("mode") == "R3":
        out["r3"] = t["logp_old"].to_numpy()[keep]
    return out


def _engine_again(run: Run, step: int, results: Sequence[RolloutResult]) -> list[np.ndarray] | None:
    """The engine's prefill scores of the samples (the engine floor), if the run stored them (drift runs)."""
    if run.kind != RunKind.DRIFT or step not in run.token_steps():
        return None
    t = run.tokens([step])
    if "logp_engine_again" not in t:
        return None
    return np.split(t["logp_engine_again"].to_numpy(), np.cumsum([len(r.response_ids) for r in results])[:-1])


def _default_name(source: str, trainer: str, tp: int, pp: int, ep: int, trainer_dtype: str | None) -> str:
    layout = trainer_spec(trainer).layout_suffix(tp, pp, ep)
    dtype = {"float32": "-fp32", "bfloat16": "-bf16", None: ""}[trainer_dtype]
    return f"{source}-rescore-{trainer}{layout}{dtype}"


def rescore_run(run_path: str | os.PathLike[str], *, trainer: str = "hf", tp: int = 1, pp: int = 1, ep: int = 1,
                trainer_dtype: str | None = None, out: str | None = None, steps: Sequence[int] | None = None,
                data: str | None = None, progress: bool = False, cluster: str | None = None,
                trainer_resources: str | None = None, cluster_timeout: float = 300.0) -> Path:
    """Score a finished drift or RL run's stored samples with ``trainer`` (layout ``tp``/``pp``/``ep``, dtype
    ``trainer_dtype``; default each cell's own), without replay and with R3 (the run's engine routes), and write the
    result as a new drift run ``out`` beside the original (default ``<run>-rescore-<trainer>[-<layout>][-<dtype>]``).

    ``steps``: the source steps to score (default: every drift cell; step 0 of an RL run, the only one whose
    weights, the starting checkpoint, are known). ``data``: the data folder holding the run's model (default: the
    run's own). ``cluster`` (with ``trainer_resources``, ``cluster_timeout``): score on a Ray cluster, as
    ``DriftConfig.cluster``. Returns the new run's folder; :func:`rescore_table` renders it next to the original.
    """
    import torch

    src_path = Path(run_path)
    source = load(src_path)
    if source.kind not in RESCORE_KINDS:
        raise RunFormatError(f"run {source.name!r} is a {source.kind!r} run; rescore scores drift, RL and capture runs "
                             "(their per-sample tables)")
    if not source.finished:
        raise RunFormatError(f"run {source.name!r} is not finished ({source.state}: no summary.json); rescore scores "
                             "finished runs only")
    if trainer not in TRAINERS:
        raise ConfigError(f"--trainer must be one of {sorted(TRAINERS)}, got {trainer!r}")
    if trainer_dtype is not None and trainer_dtype not in TRAINER_DTYPES:
        raise ConfigError(f"--trainer-dtype must be one of {sorted(TRAINER_DTYPES)}, got {trainer_dtype!r}")
    name = out or _default_name(source.name, trainer, tp, pp, ep, trainer_dtype)
    check_run_name(name)
    dest = src_path.parent / name
    if dest.exists():
        raise RunFormatError(f"{str(dest)!r} exists; runs are never overwritten (give another --out)")
    cfg = source.config
    data = data if data is not None else cfg.get("data")
    cells = _source_cells(source, steps, trainer_dtype)
    layout = DriftConfig(models=tuple(dict.fromkeys(c.model for c in cells)), trainer=trainer, tp=tp, pp=pp, ep=ep,
                         trainer_dtypes=tuple(dict.fromkeys(c.dtype for c in cells)), data=data, cluster=cluster,
                         trainer_resources=trainer_resources, cluster_timeout=cluster_timeout)  # validates them
    stored = {c.source_step: stored_results(source, c.source_step) for c in cells}  # every file read before scoring
    paths = {m: model_dir(m, data) for m in layout.models}
    if source.kind == RunKind.RL:
        weights = (f"the run's starting checkpoint {paths[cells[0].model]}: the run kept no weights, so only step 0 "
                   "(sampled and scored at those weights) is scored")
    else:
        weights = "the checkpoint the run sampled with: " + ", ".join(str(p) for p in paths.values())
    config = {"rescore_of": source.name, "source": str(src_path.resolve()), "source_kind": source.kind,
              "source_version": source.meta.get("version"), "source_trainer": _trainer_label(cfg),
              "source_steps": [c.source_step for c in cells], "models": list(layout.models), "trainer": trainer,
              "tp": tp, "pp": pp, "ep": ep, "dp": layout.dp, "trainer_dtype": trainer_dtype,
              "trainer_dtypes": list(layout.trainer_dtypes), "weights": weights,
              "replay": "none (the trainer's own routing) and R3 (the engine routes stored in the run)", "data": data}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the drift experiment scores: same threads, same sums
    rows: list[DriftRow] = []
    try:
        with RunWriter(src_path.parent, name, RunKind.DRIFT, config) as writer:
            for model in layout.models:
                for dtype in layout.trainer_dtypes:
                    todo = [c for c in cells if c.model == model and c.dtype == dtype]
                    if not todo:
                        continue
                    with load_scorer(layout, paths[model], dtype) as scorer:  # a multi-process one ends its ranks
                        for c in todo:
                            rows.append(_score_cell(scorer, source, c, stored[c.source_step], writer, len(rows),
                                                    progress))
            writer.finish({"cells": [dict(model=r.model, trainer_dtype=r.trainer_dtype, seed=r.seed, **r.summary)
                                     for r in rows], "spread": drift_spread(rows), "rescore": config})
    finally:
        torch.set_num_threads(threads)
    return dest


def _present(routes: Routes | None, what: str) -> Routes:
    """The routes, or an error naming which are missing (a scored sample always carries both)."""
    if routes is None:
        raise RunFormatError(f"rescore: a scored sample has no {what}")
    return routes


def _score_cell(scorer: Any, source: Run, cell: _Cell, stored: tuple[list[RolloutResult], list[np.ndarray] | None],
                writer: RunWriter, step: int, progress: bool) -> DriftRow:
    results, sampled = stored
    samples = replay_drift(scorer, results, progress=progress, engine_again=_engine_again(source, cell.source_step,
                                                                                           results))
    if sampled is not None:
        samples = [_masked(s, m) for s, m in zip(samples, sampled, strict=True)]
    summary = drift_summary(samples)
    engine = Routes.concat([_present(r.routes, "engine routes") for r in results])
    summary[RLMetric.ENGINE_TRAINER_DISAGREEMENT] = _disagreement(engine, Routes.concat(
        [_present(s.trainer_routes, "trainer routes") for s in samples]))
    extra: dict[str, Any] = {"source_step": cell.source_step}
    extra.update({f"source/{k}": v for k, v in cell.source.items()})
    for mode, logp in _source_logps(source, cell.source_step).items():
        mine = np.concatenate([s.logp_none if mode == "none" else s.logp_r3 for s in samples])
        if logp.shape == mine.shape:
            extra[f"vs_source/max_abs_dlogp_{mode}"] = float(np.abs(mine - logp).max())
    row = DriftRow(cell.model, cell.dtype, cell.seed, summary, writer.path)
    write_drift_cell(writer, step, row, samples, results, extra=extra, sampled=sampled)
    return row


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not np.isfinite(v)) else format(v, spec)


def rescore_table(run: Run | str | os.PathLike[str]) -> str:
    """Markdown: each rescored cell's metrics next to the original's (original -> rescored), and how far the new
    trainer's log-probs are from the original trainer's on the same tokens."""
    r = run if isinstance(run, Run) else load(run)
    c = r.config
    if "rescore_of" not in c:
        raise RunFormatError(f"run {r.name!r} is not a rescored run (its config has no 'rescore_of')")
    trainer = _trainer_label(c) + ", " + ("each cell's own dtype" if c.get("trainer_dtype") is None
                                          else TRAINER_DTYPES[c["trainer_dtype"]])
    lines = [f"rescore of {c['source_kind']} run {c['rescore_of']!r} ({c['source_trainer']}) -> {r.name!r} "
             f"({trainer})", f"weights: {c['weights']}", "",
             "| step | model | seed | trainer dtype (source) | tokens | route-flipped | routes differing "
             "| k3 none | k3 R3 | max \\|dlogp\\| vs source: none | R3 |",
             "|---:|---|---:|---|---:|---|---|---|---|---:|---:|"]
    def pair(s: dict[str, Any], key: str, spec: str) -> str:
        return f"{_fmt(s.get('source/' + key), spec)} -> {_fmt(s.get(key), spec)}"

    for s in r.step_records:
        lines.append(
            f"| {s['source_step']} | {s['model']} | {s['seed']} | {TRAINER_DTYPES.get(s['trainer_dtype'], '?')} "
            f"({TRAINER_DTYPES.get(str(s.get('source/trainer_dtype')), '?')}) | {s['tokens']} | "
            f"{pair(s, DriftMetric.FLIPPED_SHARE, '.2%')} | {pair(s, RLMetric.ENGINE_TRAINER_DISAGREEMENT, '.2%')} | "
            f"{pair(s, DriftMetric.K3_NONE, '.3e')} | {pair(s, DriftMetric.K3_R3, '.3e')} | "
            f"{_fmt(s.get('vs_source/max_abs_dlogp_none'), '.1e')} | "
            f"{_fmt(s.get('vs_source/max_abs_dlogp_r3'), '.1e')} |")
    lines += ["", "source -> rescored. route-flipped: sampled tokens whose input position the engine and the trainer "
              "routed differently in some layer; routes differing: (row, layer) pairs with different expert sets. "
              "R3 replays the run's engine routes, so its column compares the numerics alone."]
    return "\n".join(lines) + "\n"

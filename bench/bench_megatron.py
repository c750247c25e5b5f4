"""The Megatron-core trainer against the transformers trainer on one engine batch, per layout.

One run, one batch: the engine (vLLM, tiny-qwen3-moe, bf16) samples 8 prompts x 8 samples x 16 tokens and records
their routes. On that batch, side by side:

* **trainer steps**, for the transformers trainer (:class:`~r3lab.trainers.hf.HFTrainer`, one process) and the
  Megatron-core trainer (:class:`~r3lab.trainers.megatron.trainer.MegatronTrainer`, gloo CPU ranks) in each layout
  TP1, TP2+SP, PP2, EP2 (DP2) and TP2xPP2 (DP filling as the trainer derives it): the scoring step with native
  routing (no replay) and with the engine's routes replayed (R3), and the update step (one policy step, R3, the
  clipped objective + AdamW). Both trainers run fp32. Every trainer takes the same calls in the same order from the
  same weights, so its log-probs and its weights after the steps are checked against the transformers trainer's
  (columns *max |dlogp|* and *max |dw|*), which shows the timings are of the same computation.
* **weight sync to the engine**: gather/export (``export_weights``: for Megatron the TP/PP/EP shards gathered on
  rank 0 and mapped to the checkpoint's names) and the engine's ``update_weights``.
* **route staging** of this batch's routes over the three backends, local (a dict in this process; ranks called one
  after another), Ray (one actor per DP rank) and torch.distributed (gloo, this process the driver), with
  bench/bench_staging.py's own measurement (``run_per_rank``, ``run_dist``, ``_per_rank_row``): time, bytes and the
  per-rank peak (heap peak + chunk bytes).

Times are medians of ``--reps`` repeats after one untimed warm-up call of each kind. Run:
``python bench/bench_megatron.py`` (writes bench/results/megatron.md); ``--quick`` for a smoke run (not written).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_staging import _per_rank_row, run_dist, run_per_rank  # noqa: E402

from r3lab.corpus import corpus_prompts  # noqa: E402
from r3lab.paths import model_dir, results_dir  # noqa: E402
from r3lab.routes import Routes  # noqa: E402
from r3lab.slicing import ParallelLayout  # noqa: E402
from r3lab.staging import LocalBackend, RankCoords, RayBackend, StagingPlan, barrier, fetch, stage  # noqa: E402
from r3lab.trainers import PolicyUpdate, TokenBatch  # noqa: E402

MODEL = "tiny-qwen3-moe"
LAYOUTS: dict[str, dict[str, int]] = {"TP1": {}, "TP2+SP": dict(tp=2), "PP2": dict(pp=2), "EP2": dict(ep=2),
                                      "TP2xPP2": dict(tp=2, pp=2)}
LR = 1e-3
MiB = 2**20


def _median(f, reps: int) -> tuple[float, Any]:
    """One untimed warm-up call, then the median wall time of ``reps`` calls (and the last call's result)."""
    out = f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def sample_batch(engine, prompts: int, samples: int, tokens: int) -> dict:
    """The engine's samples: the batch (prompt + response ids), the engine's log-probs and routes (P + R rows)."""
    from r3lab.rollout import SamplingConfig, append_last_row

    texts = corpus_prompts(prompts, seed=0)
    results = engine.generate(texts, SamplingConfig(max_tokens=tokens, n=samples, seed=1, ignore_eos=True))
    batch = TokenBatch.from_results(results)
    routes = Routes.concat([append_last_row(r.routes) for r in results])
    infer = np.concatenate([r.logprobs for r in results]).astype(np.float64)
    return dict(batch=batch, routes=routes, infer=infer, engine_routes=engine.stack_routes(results))


def measure_trainer(trainer, engine, data: dict, update: PolicyUpdate, reps: int) -> dict:
    """Scoring (none, R3), the update step (R3) and the weight sync (export + update_weights), each a median."""
    batch, routes = data["batch"], data["routes"]
    row: dict[str, Any] = {}
    row["score_none"], none = _median(lambda: trainer.score(batch), reps)
    row["score_r3"], r3 = _median(lambda: trainer.score(batch, routes=routes), reps)
    row["logp_none"], row["logp_r3"] = none.logprobs, r3.logprobs
    row["step"], _ = _median(lambda: trainer.policy_step(batch, update, routes=routes), reps)
    row["export"], weights = _median(trainer.export_weights, reps)
    row["update_weights"], _ = _median(lambda: engine.update_weights(weights), reps)
    row["weights"] = weights
    return row


def run_trainers(args, engine, data: dict) -> dict[str, dict]:
    from r3lab.trainers.hf import HFTrainer
    from r3lab.trainers.megatron.trainer import MegatronTrainer

    path = model_dir(MODEL)
    rows: dict[str, dict] = {}
    t0 = time.perf_counter()
    hf = HFTrainer.load(path, lr=LR)
    start = time.perf_counter() - t0
    old = hf.score(data["batch"], routes=data["routes"]).logprobs  # the old policy: the checkpoint, R3
    rng = np.random.default_rng(0)
    adv = rng.standard_normal(len(data["batch"]))[data["batch"].token_sample]
    update = PolicyUpdate(old_logprobs=old, advantages=adv, infer_logprobs=data["infer"], tis_cap=2.0)
    rows["transformers"] = dict(measure_trainer(hf, engine, data, update, args.reps), start=start, world=1,
                                layout="1 process")
    print("transformers", {k: round(v, 3) for k, v in rows["transformers"].items() if isinstance(v, float)},
          flush=True)
    del hf
    for name in args.layouts:
        t0 = time.perf_counter()
        with MegatronTrainer(path, lr=LR, timeout_s=300, **LAYOUTS[name]) as t:
            start = time.perf_counter() - t0
            row = measure_trainer(t, engine, data, update, args.reps)
            L = t.layout
            stats = t.stage_stats[-1]
            row.update(start=start, world=L.world_size, layout=f"tp={L.tp} pp={L.pp} ep={L.ep} dp={L.dp}",
                       checked=t.replay_checked, mismatched=t.replay_mismatched, staged_bytes=stats.bytes_put,
                       staged_chunks=stats.chunks)
        rows[name] = row
        print(name, {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}, flush=True)
    hf_w = rows["transformers"]["weights"]
    for name, row in rows.items():
        row["dlogp_none"] = float(np.abs(row["logp_none"] - rows["transformers"]["logp_none"]).max())
        row["dlogp_r3"] = float(np.abs(row["logp_r3"] - rows["transformers"]["logp_r3"]).max())
        w = row["weights"]
        common = sorted(set(w) & set(hf_w))
        if not common:
            raise RuntimeError(f"{name}: no exported name in common with the transformers trainer's")
        row["names_differ"] = sorted(set(w) ^ set(hf_w))
        row["dw"] = max(float((w[n].float() - hf_w[n].float()).abs().max()) for n in common)
    return rows


# ---- staging ------------------------------------------------------------------------------------------------------
def run_local(routes: Routes, layout: ParallelLayout, codec: str) -> dict:
    """Per-rank staging on the local backend: every rank's fetch in this process, one after another (tracemalloc
    around each, as ``RankWorker.receive(measure=True)`` does on a worker), then every rank's barrier."""
    backend = LocalBackend()
    t0 = time.perf_counter()
    staged, st = stage(routes, StagingPlan.build(len(routes), layout), backend, codec=codec)
    t1 = time.perf_counter()
    res = []
    for d in range(layout.dp):
        tracemalloc.start()
        share, rs = fetch(staged, RankCoords(d), 0, timeout=60)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        res.append(dict(stats=dataclasses.asdict(rs), peak_heap=peak,
                        share_bytes=share.values.nbytes + share.cu_seqlens.nbytes))
    for d, r in enumerate(res):
        r["stats"]["barrier_s"] = barrier(staged, RankCoords(d), 0, timeout=60)
    t2 = time.perf_counter()
    staged.release()
    return _per_rank_row(st, res, t1 - t0, t2 - t0)


def run_staging(routes: Routes, dps: list[int], codecs: list[str], reps: int) -> list[tuple[int, str, str, dict]]:
    """Each (DP ranks, codec): local, Ray and torch.distributed, the median end to end of ``reps`` (+1 warm-up)."""
    import ray

    from r3lab.testing.staging import RankWorker

    def med(runs: list[dict]) -> dict:
        runs = runs[1:] if len(runs) > 1 else runs  # the first is the warm-up
        mid = sorted(runs, key=lambda r: r["total"])[len(runs) // 2]
        return mid

    out = []
    for dp in dps:
        layout = ParallelLayout(num_layers=routes.num_layers, dp=dp)
        for c in codecs:
            out.append((dp, c, "local", med([run_local(routes, layout, c) for _ in range(reps + 1)])))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=256 * MiB)
    try:
        actor = ray.remote(RankWorker).options(num_cpus=0)
        workers = [actor.remote() for _ in range(max(dps))]
        ray.get([w.warm_up.remote(c, routes.num_experts, routes.top_k) for w in workers for c in codecs], timeout=600)
        backend = RayBackend()
        for dp in dps:
            layout = ParallelLayout(num_layers=routes.num_layers, dp=dp)
            backend.open(f"warm-up-{dp}", StagingPlan.build(dp, layout), {}, [])
            for c in codecs:
                runs = [run_per_rank(ray, workers[:dp], backend, routes, layout, c) for _ in range(reps + 1)]
                out.append((dp, c, "Ray", med(runs)))
    finally:
        ray.shutdown()
    for dp in dps:  # one process group per DP count
        layout = ParallelLayout(num_layers=routes.num_layers, dp=dp)
        for c, r in run_dist(routes, layout, codecs, warmup=1, repeats=reps).items():
            out.append((dp, c, "torch.distributed (gloo)", r))
    return out


# ---- the table ----------------------------------------------------------------------------------------------------
def _ms(x: float) -> str:
    return f"{1e3 * x:,.0f}"


def render(args, data: dict, rows: dict[str, dict], staging: list, engine_info: str) -> str:
    import torch

    batch, routes = data["batch"], data["routes"]
    n_tok = int(batch.response_lengths.sum())
    hf = rows["transformers"]
    lines = [
        "| trainer | layout | ranks | start s | score, no replay ms | score, R3 ms | update step, R3 ms "
        "| export ms | engine update_weights ms | sync total ms | max abs dlogp vs transformers (none / R3) "
        "| max abs dw vs transformers |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, r in rows.items():
        ratio = "" if name == "transformers" else (
            f" ({r['score_r3'] / hf['score_r3']:.1f}x)")
        step_ratio = "" if name == "transformers" else f" ({r['step'] / hf['step']:.1f}x)"
        sync = r["export"] + r["update_weights"]
        sync_ratio = "" if name == "transformers" else f" ({sync / (hf['export'] + hf['update_weights']):.1f}x)"
        lines.append(
            f"| {'transformers' if name == 'transformers' else 'Megatron-core'} | "
            f"{'-' if name == 'transformers' else name} ({r['layout']}) | {r['world']} | {r['start']:.1f} | "
            f"{_ms(r['score_none'])} | {_ms(r['score_r3'])}{ratio} | {_ms(r['step'])}{step_ratio} | "
            f"{_ms(r['export'])} | {_ms(r['update_weights'])} | {_ms(sync)}{sync_ratio} | "
            f"{r['dlogp_none']:.1e} / {r['dlogp_r3']:.1e} | {r['dw']:.1e} |")
    meg = [(n, r) for n, r in rows.items() if n != "transformers"]
    replay = "; ".join(f"{n}: {r['checked']:,} checked, {r['mismatched']} differ" for n, r in meg)
    staged = "; ".join(f"{n}: {r['staged_chunks']} chunk(s), {r['staged_bytes'] / 1024:,.1f} KiB" for n, r in meg)
    differ = {n: r["names_differ"] for n, r in meg if r["names_differ"]}
    names = (f"every layout exports the transformers trainer's {len(hf['weights'])} checkpoint names" if not differ
             else f"differ from the transformers trainer's (max abs dw over the common ones): {differ}")
    st_lines = [
        "| DP ranks | codec | backend | driver slice+encode ms | put ms | slowest rank get ms | slowest rank decode ms "
        "| barrier ms | end to end ms | KiB put | KiB read by ranks | per-rank peak KiB (heap + chunk) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dp, c, backend, r in staging:
        bar = "-" if not np.isfinite(r["barrier"]) else f"{1e3 * r['barrier']:,.1f}"
        st_lines.append(
            f"| {dp} | {c} | {backend} | {1e3 * r['ser']:,.1f} | {1e3 * r['put']:,.1f} | {1e3 * r['get']:,.1f} | "
            f"{1e3 * r['dec']:,.1f} | {bar} | {1e3 * r['total']:,.1f} | {r['put_bytes'] / 1024:,.1f} | "
            f"{r['read_bytes'] / 1024:,.1f} | {(r['heap'] + r['mapped']) / 1024:,.1f} |")
    env = (f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, Python "
           f"{platform.python_version()}")
    from importlib import metadata  # megatron.core.__version__ appends the git hash of the current folder's repository

    import vllm

    mcore = metadata.version("megatron-core")
    load = os.getloadavg()[0]

    return f"""# Megatron-core trainer vs transformers trainer on one engine batch

Batch: {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens sampled by the engine from {MODEL}
({len(batch)} samples, {n_tok:,} scored tokens, {routes.total_tokens:,} route rows x {routes.num_layers} MoE layers x
top-{routes.top_k} of {routes.num_experts}); {engine_info}. Both trainers fp32, AdamW lr {LR}, one torch thread per
process (the transformers trainer in this process, each Megatron rank in its own). Times: **median of
{args.reps} repeats** after one untimed warm-up call of each kind (the warm-up and the repeats are policy steps too,
the same {args.reps + 1} for every trainer, so the weights compared are after {args.reps + 1} identical steps).
Machine: {env}, megatron-core {mcore}, vLLM {vllm.__version__}; load average at the end {load:.1f} (other jobs may
share the 2 cores: seconds are indicative, the ratios more than the absolute values; bytes and the max-abs columns
are not). Produced by `python bench/bench_megatron.py`.

## Trainer steps and weight sync, per layout

{chr(10).join(lines)}

- *score*: `trainer.score(batch)` (native routing) and `trainer.score(batch, routes=R3)` (the engine's routes
  replayed); *update step*: `policy_step` on the whole batch, replaying the engine's routes (forward, the clipped
  objective, backward, gradient all-reduce over DP / expert-DP and SP norms over TP, clipping, AdamW). (Nx): the
  Megatron time over the transformers trainer's. Megatron's times are the driver's: staging the routes (the
  driver's TCPStore, one chunk per DP rank), the ranks' forward/backward and the pipe round trip.
- *export*: `export_weights()` (Megatron: TP/PP/EP shards gathered on rank 0 by `export_hf_state_dict`, mapped to
  the checkpoint's names, sent over the pipe); *engine update_weights*: `RolloutEngine.update_weights` of that dict
  (vLLM's layer-wise reload, in process). The engine runs bf16, so the engine side is the same for every trainer.
- *start*: building the trainer (Megatron: spawning the ranks, gloo, loading the checkpoint through mbridge).
- *max abs dlogp*: the log-probs against the transformers trainer's on the same batch before any step
  (R3: no routing flip can enter, the loading proof's 1e-4 bound; none: native routing, where a near-tie can flip);
  *max abs dw*: the weights after the steps against the transformers trainer's.
- Replay held on every rank (record after replay against the routes given, all calls): {replay}.
- Routes the trainer staged per call: {staged}.
- Exported names: {names}.

## Route staging of this batch's routes, by backend

{chr(10).join(st_lines)}

- The same chunks, frames, checksums and all-or-none barrier on every backend (`r3lab.staging`); rows from
  bench/bench_staging.py's `run_per_rank` (Ray), `run_dist` (torch.distributed) and `_per_rank_row` (all three).
  Each row: the median run (by end to end) of {args.reps} after one untimed warm-up run.
- *local*: chunks in a dict of this process; every rank's `fetch` runs here one after another, then every rank's
  `barrier`, so its get is a dict lookup and its chunk is shared memory of the driver. *Ray*: one actor per DP rank,
  the chunk mapped from the object store. *torch.distributed*: one gloo process per DP rank, the driver rank 0
  sending each its chunk (`isend`).
- *per-rank peak*: the tracemalloc heap peak around the rank's receive + the chunk bytes it maps or receives, as in
  bench/results/staging.md. At this batch's size every byte count is KiB and the times are fixed costs (process
  hops, the barrier), not bandwidth; bench/results/staging.md measures the bandwidth at the seeds' scale.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="timed repeats of each call (after one warm-up)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--dp", nargs="+", type=int, default=[2, 4], help="DP ranks of the staging runs")
    ap.add_argument("--codecs", nargs="+", default=["raw", "bitpack"])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2x2x8 batch, 1 repeat, TP1 and TP2xPP2")
    ap.add_argument("--out", type=Path, default=results_dir() / "megatron.md")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.samples, args.tokens, args.reps = 2, 2, 8, 1
        args.layouts, args.dp, args.codecs = ["TP1", "TP2xPP2"], [2], ["raw"]
    import torch

    from r3lab.rollout import RolloutEngine

    torch.set_num_threads(1)  # the transformers trainer on one thread, as each Megatron rank (worker.rank_main)
    warnings.filterwarnings("ignore", message=".*top_k // topk_group.*")
    with RolloutEngine(model_dir(MODEL), seed=0, dtype="bfloat16") as engine:
        data = sample_batch(engine, args.prompts, args.samples, args.tokens)
        print(f"engine: {len(data['batch'])} samples, {data['routes'].total_tokens} route rows", flush=True)
        rows = run_trainers(args, engine, data)
    staging = run_staging(data["routes"], args.dp, args.codecs, args.reps)
    text = render(args, data, rows, staging, "the engine: vLLM in process, bfloat16 (the RL loop's default)")
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()

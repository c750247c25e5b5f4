"""The same quick RL step on this machine and on a two-node Ray cluster: seconds per phase, bytes per rank actor.

One quick GRPO setting (tiny-qwen3-moe, R3, Megatron on two CPU gloo ranks, 2 prompts x 2 samples x 8 tokens,
2 mini-batches), run twice in one process, the same seeds and inputs:

* **local**: the in-process vLLM engine and two spawned rank processes (``r3lab rl --trainer megatron``);
* **cluster**: two raylets on this machine (:func:`r3lab.testing.cluster.local_cluster`): node A holds the engine
  actor (custom resource ``engine``), node B the two rank actors in one placement group (``trainer``), as
  ``r3lab rl --cluster ray --engine-resources '{"engine": 1}' --trainer-resources '{"trainer": 1}'`` places them.

Per phase, seconds per step (the loop's own functions: ``sample_step``, ``train_step``, export + ``update_weights``):
generate (the engine's sampling), staging (driver: slice + encode + put of the routes; ranks: fetch + decode +
all-or-none barrier, the slowest rank), score (the old log-probs, staging included), update (the mini-batch policy
steps, staging included) and weight sync (the ranks' export and the engine's load; on the cluster the weights go
from rank 0's actor to the engine actor through the object store). Step 0 is shown apart (first calls, warm-up).

Bytes: what each rank read from the staged routes (its receives' ``bytes_read``) against its share (the chunks the
staging plan gives its DP rank, sized as the driver put them) and the whole batch (every chunk): a rank that read
the whole batch would show it. Layouts: ``tp2`` (one DP rank: each rank's share is the whole batch) and ``ep2``
(two DP ranks: each reads half).

    nice -n 10 python bench/bench_cluster.py                # writes bench/results/cluster.md
    python bench/bench_cluster.py --layouts tp2             # one layout (prints, writes nothing)
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np

from r3lab.config import RLConfig
from r3lab.paths import model_dir, results_dir

MODEL = "tiny-qwen3-moe"
LAYOUTS = {"tp2": dict(tp=2), "ep2": dict(ep=2)}
ENGINE, TRAINER = '{"engine": 1}', '{"trainer": 1}'
PHASES = ("generate", "staging, driver", "staging, slowest rank", "score", "update", "weight sync", "step")


def config(layout: str, steps: int, cluster: bool) -> RLConfig:
    extra = dict(cluster="ray", engine_resources=ENGINE, trainer_resources=TRAINER) if cluster else {}
    return RLConfig.quick(model=MODEL, trainer="megatron", steps=steps, prompts_per_step=2, samples_per_prompt=2,
                          max_tokens=8, mini_batches=2, mode="R3", noise_every=0, **LAYOUTS[layout], **extra)


def _record_puts(trainer: Any) -> dict[str, int]:
    """The size of every chunk the driver puts, by key (``stage_id/chunk``): the trainer's staging backend's
    ``put`` wrapped (bench instrumentation; the staged bytes are unchanged)."""
    sizes: dict[str, int] = {}
    backend = trainer.transport.backend
    put = backend.put

    def recording_put(key: str, buf: Any) -> Any:
        sizes[key] = len(buf)
        return put(key, buf)

    backend.put = recording_put
    return sizes


def run(cfg: RLConfig, engine: Any) -> dict[str, Any]:
    """``cfg.steps`` steps of the RL loop on ``engine`` (reset to the checkpoint first, as ``run_rl`` does with a
    shared engine) with every phase timed; the bytes each rank read; the step metrics."""
    import torch

    from r3lab.experiments.rl import start_trainer, train_step
    from r3lab.experiments.rl.batch import sample_step
    from r3lab.experiments.rl.loop import StaleWeights
    from r3lab.experiments.tasks import make_task

    path = model_dir(cfg.model, cfg.data)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    steps: list[dict[str, float]] = []
    metrics: list[dict[str, Any]] = []
    read: dict[int, int] = defaultdict(int)
    with start_trainer(cfg, path) as trainer:
        sizes = _record_puts(trainer)
        weights = StaleWeights(engine, trainer.export_weights(), cfg.staleness)
        task = make_task(engine.tokenizer, cfg)
        trainer.receive_stats()  # forget the start's (none)
        for step in range(cfg.steps):
            n_score, n_update, n_stage = len(trainer.timings["score"]), len(trainer.timings["policy_step"]), len(
                trainer.stage_stats)
            t0 = time.perf_counter()
            rollout = sample_step(engine, task, cfg, step)
            result = train_step(trainer, rollout.batch, cfg, rng)
            t1 = time.perf_counter()
            weights.push(trainer.export_weights(), step)
            t2 = time.perf_counter()
            received = trainer.receive_stats()  # per rank, this step's receives
            for r, stats in enumerate(received):
                read[r] += sum(s["bytes_read"] for s in stats)
            n = min(len(s) for s in received)
            slowest = sum(max(received[r][i]["wait_s"] + received[r][i]["decode_s"] + received[r][i]["barrier_s"]
                              for r in range(len(received))) for i in range(n))
            stages = trainer.stage_stats[n_stage:]
            steps.append({
                "generate": rollout.seconds,
                "staging, driver": sum(s.slice_s + s.encode_s + s.put_s for s in stages),
                "staging, slowest rank": slowest,
                "score": sum(trainer.timings["score"][n_score:]),
                "update": sum(trainer.timings["policy_step"][n_update:]),
                "weight sync": t2 - t1,
                "step": t2 - t0,
            })
            metrics.append({k: v for k, v in result.metrics.items() if not k.startswith("time_")})
        layout = trainer.layout
        nodes = list(getattr(trainer, "node_ids", [])) or ["this machine"] * layout.world_size
        coords = [trainer.ranks[r] for r in range(layout.world_size)]
    share = {}
    for r, c in enumerate(coords):
        share[r] = sum(v for k, v in sizes.items() if k.split("/", 1)[1].startswith(f"dp{c['dp']}/"))
    return dict(steps=steps, metrics=metrics, read=dict(read), share=share, whole=sum(sizes.values()),
                nodes=nodes, coords=coords, engine_node=getattr(engine, "node_id", "this machine"))


def _mean(rows: list[dict[str, float]], k: str) -> float:
    return float(np.mean([r[k] for r in rows])) if rows else float("nan")


def table(results: dict[str, dict[str, dict[str, Any]]], steps: int, seconds: float) -> str:
    out = ["# The quick RL step, local vs a two-node Ray cluster (bench/bench_cluster.py)", "",
           f"`nice -n 10 python bench/bench_cluster.py` on {platform.machine()}, {platform.python_version()}, "
           f"{steps} steps per run, {seconds:.0f} s in all. Two raylets on this one 2-core machine (loopback, CPU "
           "gloo ranks, vLLM on CPU), shared with other jobs: the times say what the cluster path costs on top of "
           "the local one here, not how a GPU cluster runs.", ""]
    for layout, res in results.items():
        loc, clu = res["local"], res["cluster"]
        same = loc["metrics"] == clu["metrics"]
        out += [f"## {MODEL}, R3, Megatron {layout} ({len(loc['coords'])} ranks)", "",
                f"Step metrics of the two runs bit-equal: **{'yes' if same else 'NO'}**. Engine actor on node "
                f"`{clu['engine_node'][:12]}`, ranks on `{', '.join(n[:12] for n in clu['nodes'])}`.", "",
                "| phase (s per step) | local, step 0 | cluster, step 0 | local, later steps | cluster, later steps "
                "| cluster / local, later |", "|---|---:|---:|---:|---:|---:|"]
        for p in PHASES:
            a0, b0 = loc["steps"][0][p], clu["steps"][0][p]
            a, b = _mean(loc["steps"][1:], p), _mean(clu["steps"][1:], p)
            ratio = f"{b / a:.2f}" if a > 0 else "-"
            out.append(f"| {p} | {a0:.3f} | {b0:.3f} | {a:.3f} | {b:.3f} | {ratio} |")
        out += ["", "| run | rank (dp, tp) | node | bytes read | its share | whole batch | read / share |",
                "|---|---|---|---:|---:|---:|---:|"]
        for where, res1 in (("local", loc), ("cluster", clu)):
            for r, c in enumerate(res1["coords"]):
                got, share = res1["read"].get(r, 0), res1["share"][r]
                out.append(f"| {where} | {r} ({c['dp']}, {c['tp']}) | {res1['nodes'][r][:12]} | {got:,} | {share:,} "
                           f"| {res1['whole']:,} | {got / share if share else float('nan'):.2f} |")
        out.append("")
    out += ["Phases: generate is the engine's sampling; staging, driver is slice + encode + put of the routes, and "
            "staging, slowest rank the fetch + decode + barrier of the slowest rank (both already inside score and "
            "update, which time the trainer's whole calls); weight sync is the ranks' export plus the engine's "
            "load; step is generate through weight sync. Bytes: over all steps, each rank's receives against the "
            "chunks the plan gives its DP rank and against every chunk staged.", ""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="RL steps per run (step 0 is shown apart)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--out", default=None, help="write the table here (default: bench/results/cluster.md with the "
                    "default settings; a shorter run only prints)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (step 0 is warm-up)")
    from r3lab.experiments.rl.loop import start_engine
    from r3lab.testing.cluster import local_cluster

    t0 = time.perf_counter()
    results: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in args.layouts}
    first = config(args.layouts[0], args.steps, cluster=False)
    with start_engine(first, model_dir(first.model, first.data)) as engine:  # one engine start per side
        for layout in args.layouts:
            results[layout]["local"] = run(config(layout, args.steps, cluster=False), engine)
            print(f"local {layout}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    nodes = [dict(num_cpus=1, resources={"engine": 1}), dict(num_cpus=2, resources={"trainer": 2})]
    with local_cluster(nodes):
        first = config(args.layouts[0], args.steps, cluster=True)
        with start_engine(first, model_dir(first.model, first.data)) as engine:
            for layout in args.layouts:
                results[layout]["cluster"] = run(config(layout, args.steps, cluster=True), engine)
                print(f"cluster {layout}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    text = table(results, args.steps, time.perf_counter() - t0)
    print(text)
    default = args.steps == ap.get_default("steps") and args.layouts == list(LAYOUTS)
    out = args.out or (str(results_dir() / "cluster.md") if default else None)
    if out:
        with open(out, "w") as f:
            f.write(text)
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Per-rank route staging (Ray, torch.distributed) vs whole-batch put, at a scaled-down version of the seeds' example.

Seeds' example (R3_BACKGROUND.md, SkyRL's R3 tracking issue): GLM-4.7-Flash, batch 128 prompts x 8 samples
= 1024 sequences, 47 layers, top-4, 20k context: "~16 GiB of expert indices", 2 DP ranks per node, so
32 GB per node when every DP rank materializes the whole batch. Here: 1/16 of the batch (64 sequences)
at the full 20k context, 47 layers, top-4 of 64 experts (uint8), 4 DP ranks as 4 Ray worker actors on
one node (a local Ray cluster, 2 CPUs).

Side by side in one run, per codec:

* **whole-batch put** (SkyRL before #1376): the driver puts the whole batch as one object; every worker
  gets it, decodes all of it, and keeps its DP share (``dp_share``).
* **per-rank staging** (``r3lab.staging``): the driver puts one object per DP rank; each worker gets
  and decodes only its own (``receive``: fetch, checks, all-or-none barrier).
* **per-rank staging over torch.distributed** (``TorchDistBackend``, gloo on loopback): this process is the
  driver, rank 0 of a process group with the DP ranks (one process each); it sends each rank its chunk.

Columns: driver serialization (slice + encode) and put, the slowest worker's get, decode (+ slice for
the whole batch) and barrier, end to end (driver start to the last worker done), bytes put into the
object store and read by workers, and per-worker peak memory measured inside the worker around the
receive: the tracemalloc peak (heap) plus the object-store bytes it maps. Every worker runs warm (codec
kernels compiled beforehand).

Run: ``python bench/bench_staging.py`` (writes bench/results/staging.md); ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import socket
import time
from pathlib import Path

import numpy as np
import orjson

from r3lab.compaction import decode, encode
from r3lab.paths import results_dir
from r3lab.routes import Routes
from r3lab.slicing import ParallelLayout
from r3lab.staging import RankCoords, RayBackend, StagingPlan, TorchDistBackend, stage
from r3lab.testing.staging import RankWorker
from r3lab.workloads import fixed_length_routes

NUM_LAYERS, TOP_K, NUM_EXPERTS, CONTEXT = 47, 4, 64, 20_000
SEEDS_SEQS, SEEDS_GIB = 1024, 16
MiB = 2**20
DIST = "per-rank staging, torch.distributed"
EXTRA_HEADER = (
    "| codec | GiB put (seeds) | GiB read by workers, whole-batch | GiB read by workers, per-rank "
    "| per-worker memory GiB, whole-batch | per-worker memory GiB, per-rank "
    "| driver slice+encode: rate -> seeds' batch | worker decode: rate -> one rank's share |\n"
    "|---|---:|---:|---:|---:|---:|---|---|"
)


def make_batch(num_seqs: int, length: int, seed: int = 0) -> Routes:
    """num_seqs sequences of ``length`` tokens; rows from 4096 distinct top-k sets (fast to build, valid)."""
    return fixed_length_routes(num_seqs, length, num_layers=NUM_LAYERS, top_k=TOP_K, num_experts=NUM_EXPERTS,
                               seed=seed)


def run_whole(ray, workers, backend: RayBackend, routes: Routes, layout: ParallelLayout, codec: str) -> dict:
    t0 = time.perf_counter()
    whole, st = stage(
        routes, StagingPlan.build(len(routes), ParallelLayout(num_layers=NUM_LAYERS)), backend, codec=codec
    )
    t1 = time.perf_counter()
    res = ray.get([w.receive_whole.remote(whole, layout, RankCoords(d), timeout=600) for d, w in enumerate(workers)])
    t2 = time.perf_counter()
    whole.release()
    return dict(
        ser=st.slice_s + st.encode_s,
        put=st.put_s,
        get=max(r["wait_s"] for r in res),
        dec=max(r["decode_s"] + r["slice_s"] for r in res),
        barrier=float("nan"),
        total=t2 - t0,
        driver=t1 - t0,
        put_bytes=st.bytes_put,
        read_bytes=sum(r["bytes_read"] for r in res),
        heap=max(r["peak_heap"] for r in res),
        mapped=max(r["bytes_read"] for r in res),
        share=max(r["share_bytes"] for r in res),
    )


def run_per_rank(ray, workers, backend: RayBackend, routes: Routes, layout: ParallelLayout, codec: str) -> dict:
    t0 = time.perf_counter()
    plan = StagingPlan.build(len(routes), layout)
    staged, st = stage(routes, plan, backend, codec=codec)
    t1 = time.perf_counter()
    res = ray.get(
        [
            w.receive.remote(staged, RankCoords(d), 0, timeout=600, measure=True, return_arrays=False)
            for d, w in enumerate(workers)
        ]
    )
    t2 = time.perf_counter()
    if not all(r["ok"] for r in res):
        raise RuntimeError(f"staging failed: {[r for r in res if not r['ok']]}")
    staged.release()
    return _per_rank_row(st, res, t1 - t0, t2 - t0)


def _per_rank_row(st, res: list[dict], driver_s: float, total_s: float) -> dict:
    s = [r["stats"] for r in res]
    return dict(
        ser=st.slice_s + st.encode_s,
        put=st.put_s,
        get=max(x["wait_s"] for x in s),
        dec=max(x["decode_s"] for x in s),
        barrier=max(x["barrier_s"] for x in s),
        total=total_s,
        driver=driver_s,
        put_bytes=st.bytes_put,
        read_bytes=sum(x["bytes_read"] for x in s),
        heap=max(r["peak_heap"] for r in res),
        mapped=max(x["bytes_read"] for x in s),
        share=max(r["share_bytes"] for r in res),
    )


def _dist_rank(child: int, world: int, port: int, codecs: list[str], runs: int = 1) -> None:
    """A trainer rank of the torch.distributed run: warm up, then receive each codec's batch ``runs`` times, post
    the results."""
    import torch.distributed as dist

    index = child + 1  # global rank: the driver is 0

    from r3lab.testing.staging import RankWorker

    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=900))
    dist.init_process_group("gloo", store=store, rank=index, world_size=world, timeout=datetime.timedelta(seconds=900))
    worker, backend = RankWorker(), TorchDistBackend(store)
    for c in codecs:
        worker.warm_up(c, NUM_EXPERTS, TOP_K)
    store.set(f"ready/{index}", "1")
    for c in codecs:
        for run in range(runs):
            staged = backend.attach(f"bench-{c}-{run}", timeout=900)
            res = worker.receive(staged, RankCoords(index - 1), 0, timeout=600, measure=True, return_arrays=False)
            store.set(f"result/{c}/{run}/{index}", orjson.dumps(res))
    store.wait(["done"], datetime.timedelta(seconds=900))
    dist.destroy_process_group()


def run_dist(routes: Routes, layout: ParallelLayout, codecs: list[str], warmup: int = 0, repeats: int = 1
             ) -> dict[str, dict]:
    """Per-rank staging over torch.distributed (gloo): this process is the driver (rank 0), one process per DP rank.

    Each codec is staged ``warmup`` times untimed, then ``repeats`` times; its row is the median run by end to end.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    world = layout.dp + 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore(  # the ranks are started below: do not wait for them here
        "127.0.0.1", port, world, True, timeout=datetime.timedelta(seconds=900), wait_for_workers=False
    )
    print(f"torch.distributed: starting {world - 1} rank processes", flush=True)
    ctx = mp.start_processes(
        _dist_rank, args=(world, port, codecs, warmup + repeats), nprocs=world - 1, join=False, start_method="spawn"
    )
    dist.init_process_group("gloo", store=store, rank=0, world_size=world, timeout=datetime.timedelta(seconds=900))
    rows = {}
    try:
        store.wait([f"ready/{i}" for i in range(1, world)], datetime.timedelta(seconds=900))
        backend = TorchDistBackend(store)
        plan = StagingPlan.build(len(routes), layout)
        for c in codecs:
            timed = []
            for run in range(warmup + repeats):
                t0 = time.perf_counter()
                staged, st = stage(routes, plan, backend, codec=c, stage_id=f"bench-{c}-{run}")
                t1 = time.perf_counter()
                keys = [f"result/{c}/{run}/{i}" for i in range(1, world)]
                store.wait(keys, datetime.timedelta(seconds=900))
                t2 = time.perf_counter()
                res = [orjson.loads(store.get(k)) for k in keys]
                if not all(r["ok"] for r in res):
                    raise RuntimeError(f"staging failed: {[r for r in res if not r['ok']]}")
                staged.release()
                if run >= warmup:
                    timed.append(_per_rank_row(st, res, t1 - t0, t2 - t0))
            rows[c] = sorted(timed, key=lambda r: r["total"])[len(timed) // 2]
            print(c, "torch.distributed", {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[c].items()})
        store.set("done", "1")
        ctx.join(600)
    finally:
        dist.destroy_process_group()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=64, help="sequences in the batch (seeds: 1024)")
    ap.add_argument("--length", type=int, default=CONTEXT, help="tokens per sequence (seeds: 20k context)")
    ap.add_argument("--dp", type=int, default=4, help="DP ranks = worker actors")
    ap.add_argument("--codecs", nargs="+", default=["raw", "bitpack", "topk-set"])
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 sequences of 2000 tokens")
    ap.add_argument("--out", type=Path, default=results_dir() / "staging.md")
    args = ap.parse_args()
    if args.quick:
        args.seqs, args.length = 8, 2_000
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    routes = make_batch(args.seqs, args.length)
    for codec in args.codecs:  # compile the codec kernels in the driver too
        decode(encode(routes.take([0]), codec))
    batch_bytes = routes.values.nbytes
    ray.init(
        address="local",  # a private instance, measured alone: never a cluster `ray start` left running
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        object_store_memory=max(4 * batch_bytes, 256 * MiB),
    )
    try:
        actor = ray.remote(RankWorker).options(num_cpus=0)
        workers = [actor.remote() for _ in range(args.dp)]
        ray.get([w.warm_up.remote(c, NUM_EXPERTS, TOP_K) for w in workers for c in args.codecs], timeout=600)
        backend = RayBackend()  # one for the run: its coordinator actor starts once, outside the measurements
        layout = ParallelLayout(num_layers=NUM_LAYERS, dp=args.dp)
        backend.open("warm-up", StagingPlan.build(args.dp, layout), {}, [])
        rows = []
        for codec in args.codecs:
            for name, fn in (("whole-batch put", run_whole), ("per-rank staging", run_per_rank)):
                r = fn(ray, workers, backend, routes, layout, codec)
                rows.append((codec, name, r))
                print(codec, name, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    finally:
        ray.shutdown()
    print("Ray is down", flush=True)
    for codec, r in run_dist(routes, layout, args.codecs).items():  # after Ray, so the two never share the cores
        rows.append((codec, DIST, r))
    write(args, routes, rows)


def _f(x: float) -> str:
    return "-" if isinstance(x, float) and math.isnan(x) else f"{x:.2f}"


def write(args, routes: Routes, rows) -> None:
    T, B, dp = routes.total_tokens, routes.values.nbytes, args.dp
    ids = T * NUM_LAYERS * TOP_K
    seeds_ids = SEEDS_SEQS * CONTEXT * NUM_LAYERS * TOP_K
    scale = seeds_ids / ids
    lines = [
        "| codec | backend | strategy | driver: slice+encode s | put s | worker get s | worker decode (+slice) s "
        "| barrier s | end to end s | MiB put | MiB read by workers | per-worker heap peak MiB "
        "| per-worker chunk MiB (mapped / received) | per-worker memory / share |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for codec, name, r in rows:
        backend, strategy = ("torch.distributed (gloo)", "per-rank staging") if name == DIST else ("Ray", name)
        lines.append(
            f"| {codec} | {backend} | {strategy} | {_f(r['ser'])} | {_f(r['put'])} | {_f(r['get'])} | {_f(r['dec'])} | "
            f"{_f(r['barrier'])} | {_f(r['total'])} | {r['put_bytes'] / MiB:,.1f} | {r['read_bytes'] / MiB:,.1f} | "
            f"{r['heap'] / MiB:,.1f} | {r['mapped'] / MiB:,.1f} | {(r['heap'] + r['mapped']) / r['share']:.2f}x |"
        )
    by = {(c, n): r for c, n, r in rows}
    per_rank = [
        "| codec | end to end s, Ray | end to end s, torch.distributed | worker get s, Ray | worker get s, "
        "torch.distributed | MiB read per rank (both) | per-rank memory MiB, Ray | per-rank memory MiB, "
        "torch.distributed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for codec in args.codecs:
        ray_r, d = by[(codec, "per-rank staging")], by[(codec, DIST)]
        per_rank.append(
            f"| {codec} | {_f(ray_r['total'])} | {_f(d['total'])} | {_f(ray_r['get'])} | {_f(d['get'])} | "
            f"{ray_r['mapped'] / MiB:,.1f} / {d['mapped'] / MiB:,.1f} | "
            f"{(ray_r['heap'] + ray_r['mapped']) / MiB:,.1f} | "
            f"{(d['heap'] + d['mapped']) / MiB:,.1f} |"
        )
    extra = []
    for codec in args.codecs:
        w, p = by[(codec, "whole-batch put")], by[(codec, "per-rank staging")]
        enc_rate = ids / p["ser"] / 1e6
        dec_rate = ids / dp / p["dec"] / 1e6 if p["dec"] else float("nan")
        put_gib = p["put_bytes"] * scale / 2**30
        extra.append(
            f"| {codec} | {put_gib:,.2f} | {w['read_bytes'] * scale / 2**30:,.1f} | "
            f"{p['read_bytes'] * scale / 2**30:,.2f} | {(w['heap'] + w['mapped']) * scale / 2**30:,.1f} | "
            f"{(p['heap'] + p['mapped']) * scale / 2**30:,.2f} | "
            f"{enc_rate:,.0f} M ids/s -> {seeds_ids / enc_rate / 1e6:,.0f} s | "
            f"{dec_rate:,.0f} M ids/s -> {seeds_ids / dp / dec_rate / 1e6:,.1f} s |"
        )
    env = f"{platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}, Python {platform.python_version()}"
    import ray
    import torch

    text = f"""# Per-rank route staging vs whole-batch put (Ray, torch.distributed)

Batch: {args.seqs} sequences x {args.length:,} tokens = {T:,} tokens, {NUM_LAYERS} layers, top-{TOP_K} of {NUM_EXPERTS}
experts (uint8): {ids:,} expert ids, {B / MiB:,.1f} MiB compact. Scale vs the seeds' example
({SEEDS_SEQS} x {CONTEXT:,} tokens): 1/{scale:.0f} of the ids. {dp} DP ranks = {dp} Ray worker actors on one node
(local Ray {ray.__version__} cluster, 2 CPUs, object store in /dev/shm), then {dp} gloo processes of a
torch {torch.__version__} process group on loopback with this process as the driver (rank 0). Machine: {env};
shared with other jobs, so seconds are indicative, bytes and memory are not. Produced by
`python bench/bench_staging.py`.

{chr(10).join(lines)}

Per-rank staging by backend (the same chunks, checks and barrier; memory per rank = heap peak + chunk bytes):

{chr(10).join(per_rank)}

- *whole-batch put*: one object with the whole batch; every worker gets it, decodes all of it, keeps its DP share
  (what SkyRL did before #1376). *per-rank staging*: `r3lab.staging.stage` puts one object per DP rank, each
  worker `receive`s only its own (fetch, identity and checksum checks, all-or-none barrier).
- Times: the driver column is serialization (slicing by the index plan + encoding); worker columns are the slowest
  of the {dp} workers, which run at once on 2 cores. *end to end*: driver start to the last worker done.
- Memory is measured inside each worker around its receive: *heap peak* is the tracemalloc peak (Python and numpy
  allocations; `raw` decodes zero-copy on Ray, so its per-rank heap is near 0: the routes are a view of the object
  store's shared memory); *object-store MiB mapped* is the object the worker gets (shared memory it maps and reads
  in full, checksum included). *per-worker memory* = heap peak + mapped, over the worker's compact DP share
  ({B / dp / MiB:,.1f} MiB here). The resident high-water mark (VmHWM) is not used: it misses shared pages a worker
  had mapped for an earlier object, so it under-counts object-store reads.
- torch.distributed: the driver sends each rank its chunk as a uint8 tensor (`isend`; gloo here, NCCL with
  device tensors on GPU nodes); a rank's *get* is its `irecv` into a tensor of the chunk's size (its *chunk MiB*:
  torch allocates it outside tracemalloc, so it is counted there, not in the heap peak; `raw` then decodes it
  zero-copy). The manifest and the all-or-none tally go through the group's TCPStore.
- On one node a worker's get maps shared memory; across nodes every worker's node first pulls the object over the
  network, so *MiB read by workers* is also the network volume of a multi-node job (whole batch: once per node).

## Extrapolation to the seeds' example, on paper

The seeds' batch: {SEEDS_SEQS} x {CONTEXT:,} tokens x {NUM_LAYERS} layers x top-{TOP_K} = {seeds_ids:,} expert ids.
At 4 bytes an id (int32, what the field shipped) that is {seeds_ids * 4 / 2**30:,.1f} GiB, the seeds' "~16 GiB";
in r3lab's compact uint8 it is {seeds_ids / 2**30:,.2f} GiB. This run holds {ids:,} ids, so every byte count
scales by {seeds_ids:,} / {ids:,} = {scale:.1f} (the per-id cost does not depend on the batch size; the codecs'
fixed costs are negligible at these sizes). With D DP ranks and a compact batch of C bytes:

- whole-batch put: every rank reads and decodes C; a node with 2 DP ranks holds 2C. For the seeds at int32,
  2 x {seeds_ids * 4 / 2**30:,.1f} GiB = {2 * seeds_ids * 4 / 2**30:,.1f} GiB = {2 * seeds_ids * 4 / 1e9:,.1f} GB
  per node (the seeds' "32 GB per node", rounded the same way as their "~16 GiB").
- per-rank staging: a rank reads C / D; the batch is read once in all. At uint8 and D = {dp}:
  {seeds_ids / 2**30:,.2f} / {dp} = {seeds_ids / dp / 2**30:,.2f} GiB per rank; with `split_stages=True` and
  PP stages, a rank reads only its stage's layers (C / (D x PP)).

Measured quantities scaled by {scale:.1f} (D = {dp}; times from the throughput measured here, one core each):

{EXTRA_HEADER}
{chr(10).join(extra)}
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.quick:
        args.out.write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()

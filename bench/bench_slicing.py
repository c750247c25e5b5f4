"""shard() throughput and per-rank peak memory at a scaled-down version of the seeds' example.

Seeds' example (R3_BACKGROUND.md): GLM-4.7-Flash, batch 128 prompts x 8 samples = 1024 sequences,
47 layers, top-4, 20k context, 2 DP ranks per node. Here: 47 layers (layer 0 dense, 46 routers, as
vLLM reports every layer), top-4 of 64 experts (uint8), long contexts kept (lengths uniform in
[min_len, max_len], default 1k..20k), batch scaled by 1/8 (16 prompts x 8 samples = 128 sequences).
The global batch is written once to an .npy file and memory-mapped, as a staging store would hold it.

Per layout, one rank does what a trainer rank does: stage its DP share of its pipeline stage's layers
(``dp_share(..., pp_rank=)``, reading only its rows of the memory map), then ``shard_local`` every
micro-batch in turn (one micro-batch's arrays alive at a time). Memory is traced with tracemalloc
(numpy allocations; page-cache pages of the map are not the rank's). "share" = the rank's compact
share (uint8) + the int64 arrays of its largest micro-batch, i.e. what it must hold at minimum.

Run: ``python bench/bench_slicing.py`` (writes bench/results/slicing.md); ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from r3lab.paths import results_dir
from r3lab.routes import Routes
from r3lab.slicing import ParallelLayout, dp_sequence_ids, dp_share, shard, shard_local

NUM_LAYERS, TOP_K, NUM_EXPERTS = 47, 4, 64
SEEDS_TOKENS = 1024 * 20_000  # the seeds' example: 1024 sequences of ~20k tokens

LAYOUTS = {
    "dp2 (2 DP ranks/node), packed, 8 seq/mb": dict(dp=2, micro_batch_size=8),
    "dp4 tp2-sp pp2 (layers 24/23) cp2-zigzag, packed, 4 seq/mb": dict(
        dp=4, tp=2, sequence_parallel=True, pp=2, last_stage_layers=23, cp=2, micro_batch_size=4
    ),
    "dp2 tp4-sp pp4 (layers 11/12/12/12), padded, 1 seq/mb": dict(
        dp=2,
        tp=4,
        sequence_parallel=True,
        pp=4,
        first_stage_layers=11,
        last_stage_layers=12,
        packed=False,
        micro_batch_size=1,
    ),
    "dp8 pp2 (layers 23/24) cp4-zigzag, align 16 (FP8), packed, 2 seq/mb": dict(
        dp=8, pp=2, cp=4, first_stage_layers=23, extra_alignment=16, micro_batch_size=2
    ),
}


def make_batch(path: Path, num_seqs: int, min_len: int, max_len: int, seed: int = 0) -> Routes:
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_len, max_len + 1, num_seqs)
    total = int(lens.sum())
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(total, NUM_LAYERS, TOP_K))
    base = np.stack([rng.permutation(NUM_EXPERTS)[:TOP_K] for _ in range(4096)]).astype(np.uint8)  # distinct rows
    for s in range(0, total, 1 << 16):
        n = min(1 << 16, total - s)
        mm[s : s + n] = base[rng.integers(0, 4096, (n, NUM_LAYERS))]
    mm.flush()
    del mm
    values = np.load(path, mmap_mode="r")
    return Routes(values, np.concatenate([[0], np.cumsum(lens)]), NUM_EXPERTS, validate=False)


def bench_rank(routes: Routes, layout: ParallelLayout, dp_rank: int, pp_rank: int, cp_rank: int, tp_rank: int) -> dict:
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    share = dp_share(routes, layout, dp_rank, pp_rank=pp_rank)
    t_stage = time.perf_counter() - t0
    n_mb = len(dp_sequence_ids(len(routes), layout, dp_rank))
    out_max, rows_out, t_shard, call_ratio = 0, 0, 0.0, 0.0
    for m in range(n_mb):
        _, before = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        base_now, _ = tracemalloc.get_traced_memory()
        t0 = time.perf_counter()
        out = shard_local(share, layout, pp_rank=pp_rank, cp_rank=cp_rank, tp_rank=tp_rank, micro_batch=m)
        t_shard += time.perf_counter() - t0
        nbytes = sum(o.nbytes for o in out)
        _, peak_call = tracemalloc.get_traced_memory()
        if nbytes:
            call_ratio = max(call_ratio, (peak_call - base_now) / nbytes)
        out_max = max(out_max, nbytes)
        rows_out += sum(o.shape[0] for o in out)
        del out
    tracemalloc.reset_peak()
    _, peak_total = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # peak over the whole rank run: staging peak vs share + largest micro-batch output
    share_bytes = share.values.nbytes + share.cu_seqlens.nbytes
    return dict(
        share_mib=share_bytes / 2**20,
        out_mib=out_max / 2**20,
        n_mb=n_mb,
        t_stage=t_stage,
        t_shard=t_shard,
        rows_out=rows_out,
        call_ratio=call_ratio,
        share_bytes=share_bytes,
        out_max=out_max,
    )


def rank_peak(routes: Routes, layout: ParallelLayout, dp_rank: int, pp_rank: int, cp_rank: int, tp_rank: int) -> int:
    """tracemalloc peak of a whole rank run (stage + every micro-batch, one alive at a time)."""
    gc.collect()
    tracemalloc.start()
    share = dp_share(routes, layout, dp_rank, pp_rank=pp_rank)
    for m in range(len(dp_sequence_ids(len(routes), layout, dp_rank))):
        out = shard_local(share, layout, pp_rank=pp_rank, cp_rank=cp_rank, tp_rank=tp_rank, micro_batch=m)
        del out
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del share
    return peak


def direct_peak(routes: Routes, layout: ParallelLayout, coords: dict) -> tuple[float, float]:
    """shard() straight from the global memory map for one micro-batch: (peak / output, seconds)."""
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    out = shard(routes, layout, micro_batch=0, **coords)
    dt = time.perf_counter() - t0
    nbytes = sum(o.nbytes for o in out)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return (peak / nbytes if nbytes else float("nan")), dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=128, help="sequences in the global batch (seeds: 1024)")
    ap.add_argument("--min-len", type=int, default=1_000)
    ap.add_argument("--max-len", type=int, default=20_000)
    ap.add_argument("--quick", action="store_true", help="smoke run: 32 sequences of 200..2000 tokens")
    ap.add_argument("--out", type=Path, default=results_dir() / "slicing.md")
    args = ap.parse_args()
    if args.quick:
        args.seqs, args.min_len, args.max_len = 32, 200, 2_000
    with tempfile.TemporaryDirectory(prefix="r3lab_bench_") as tmp:
        t0 = time.perf_counter()
        routes = make_batch(Path(tmp) / "routes.npy", args.seqs, args.min_len, args.max_len)
        t_make = time.perf_counter() - t0
        T = routes.total_tokens
        header = (
            f"Global batch: {args.seqs} sequences, {T:,} tokens (lengths {args.min_len}..{args.max_len}), "
            f"{NUM_LAYERS} layers (layer 0 dense, 46 routers), top-{TOP_K} of {NUM_EXPERTS} experts, uint8: "
            f"{routes.values.nbytes / 2**20:,.0f} MiB memory-mapped (written in {t_make:.1f} s). Scale vs the seeds' "
            f"example (1024 x ~20k tokens): batch 1/{1024 // args.seqs}, tokens 1/{SEEDS_TOKENS / T:.1f}."
        )
        lines = [
            "| layout | rank (dp,pp,cp,tp) | DP share (MiB, uint8) | largest micro-batch out (MiB, int64) "
            "| micro-batches | stage s | shard s | router rows/s | shard() peak / its output "
            "| rank peak / (share + out) | shard() from global map: peak/out, s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, kw in LAYOUTS.items():
            layout = ParallelLayout(num_layers=NUM_LAYERS, moe_layer_ids=tuple(range(1, NUM_LAYERS)), **kw)
            coords = dict(dp_rank=layout.dp - 1, pp_rank=layout.pp - 1, cp_rank=layout.cp - 1, tp_rank=layout.tp - 1)
            r = bench_rank(routes, layout, **coords)
            peak = rank_peak(routes, layout, **coords)
            ratio = peak / (r["share_bytes"] + r["out_max"])
            d_ratio, d_s = direct_peak(routes, layout, coords)
            rate = r["rows_out"] / r["t_shard"] if r["t_shard"] else float("nan")
            lines.append(
                f"| {name} | ({coords['dp_rank']},{coords['pp_rank']},{coords['cp_rank']},{coords['tp_rank']}) "
                f"| {r['share_mib']:,.1f} | "
                f"{r['out_mib']:,.1f} | {r['n_mb']} | {r['t_stage']:.2f} | {r['t_shard']:.2f} | {rate / 1e6:,.1f} M | "
                f"{r['call_ratio']:.3f}x | {ratio:.3f}x | {d_ratio:.3f}x, {d_s:.3f} |"
            )
            print(lines[-1], flush=True)
        del routes
    table = "\n".join(lines)
    env = f"{platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}, Python {platform.python_version()}"
    text = (
        "# shard() throughput and per-rank memory\n\n"
        f"{header}\n\nOne rank per layout (the last rank of each axis). Machine: {env}.\n\n{table}\n\n"
        "- *router rows/s*: int64 `[rows, top_k]` rows produced per second by `shard_local`, summed over the rank's "
        "routers.\n"
        "- *shard() peak / its output*: tracemalloc peak during one `shard_local` call over the arrays it returns "
        "(target <= 1.2x).\n"
        "- *rank peak / (share + out)*: peak over staging the rank's DP share of its stage's layers from the memory "
        "map plus sharding\n"
        "  every micro-batch (one alive at a time), over the compact share plus the largest micro-batch's arrays.\n"
        "- Last column: `shard()` from the global memory map (no staging) for micro-batch 0.\n"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.quick:
        args.out.write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()

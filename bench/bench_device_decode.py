"""Route decoding straight into device memory vs host decode plus host-to-device copy, in GB/s on the seeds' batch.

The seeds' batch (SkyRL's R3 tracking issue, "GPU based transfer for routed expert indices"): GLM-4.7-Flash, 128
prompts x 8 samples = 1024 sequences of 20,000 tokens, 47 MoE layers, top-4 of 64 routed experts: 3.85e9 expert
ids, 3.59 GiB as uint8. Per codec (``raw``, ``bitpack``), side by side:

* **host path**: :func:`r3lab.compaction.decode` on the host (frame and CRC-32, the codec, the row check), then one
  copy of the decoded ``[T, L, K]`` ids to the device;
* **device path**: :func:`r3lab.staging.device_decode.decode_to_device`: the frame and CRC-32 checked on the host,
  the payload copied to the device, decoded and row-checked there by torch operations.

GB/s is decoded route bytes (``T * L * K`` ids in the compact dtype) per second of the whole path, the best of
``--repeats`` runs after a warm-up; both results are compared bit for bit. Host copies are from pageable memory in
both paths. The numba host decode is single-threaded, as a trainer rank's decode is.

Run on a CUDA machine: ``python bench/bench_device_decode.py [--out FILE]`` (the full seeds' batch). Without CUDA it
runs on CPU tensors, on 1/64 of the batch unless ``--seqs`` says otherwise, and its header says so: such numbers are
not GPU numbers, and ``--out`` refuses to write them under ``bench/results/``. ``--dry-run`` (or ``--quick``): 8
sequences of 500 tokens, one repeat.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from r3lab.compaction import decode, encode, read_header  # noqa: E402
from r3lab.routes import Routes  # noqa: E402
from r3lab.workloads import fixed_length_routes  # noqa: E402

#: the seeds' batch
SEEDS_SEQS, CONTEXT, NUM_LAYERS, TOP_K, NUM_EXPERTS = 1024, 20_000, 47, 4, 64
CODECS = ("raw", "bitpack")
#: sequences measured on CPU tensors unless --seqs says otherwise (1/64 of the seeds' batch)
CPU_SEQS = SEEDS_SEQS // 64
DRY_RUN = dict(seqs=8, context=500, repeats=1)


def make_batch(num_seqs: int, context: int, seed: int = 0) -> Routes:
    """``num_seqs`` sequences of ``context`` tokens, 47 layers, top-4 of 64; rows drawn from 4096 distinct top-k
    sets (valid routes, fast to build at billions of ids)."""
    return fixed_length_routes(num_seqs, context, num_layers=NUM_LAYERS, top_k=TOP_K, num_experts=NUM_EXPERTS,
                               seed=seed)


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_path(torch, buf: bytes, device):
    t0 = time.perf_counter()
    routes = decode(buf)
    t1 = time.perf_counter()
    host = torch.from_numpy(np.ascontiguousarray(routes.values))
    out = host.to(device, copy=True)
    _sync(torch, device)
    t2 = time.perf_counter()
    return out, t1 - t0, t2 - t1


def _device_path(torch, buf: bytes, device):
    from r3lab.staging.device_decode import decode_to_device

    t0 = time.perf_counter()
    out = decode_to_device(buf, device)
    _sync(torch, device)
    return out.values, time.perf_counter() - t0


def measure(routes: Routes, codecs=CODECS, device=None, repeats: int = 3) -> list[dict]:
    """One row per codec: the host and device paths' seconds (best of ``repeats``), GB/s, and bit equality."""
    import warnings

    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    warm = make_batch(1, 64, seed=1)
    decoded = routes.values.nbytes
    rows = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for codec in codecs:
            wbuf = encode(warm, codec)
            _host_path(torch, wbuf, device)
            _device_path(torch, wbuf, device)  # warm-up: numba kernels, the CUDA context, torch's kernels
            t0 = time.perf_counter()
            buf = encode(routes, codec)
            encode_s = time.perf_counter() - t0
            best: dict[str, float] = {}
            equal = True
            for _ in range(max(1, repeats)):
                h0 = time.perf_counter()
                read_header(buf)
                frame = time.perf_counter() - h0
                ref, dec_s, copy_s = _host_path(torch, buf, device)
                got, dev_s = _device_path(torch, buf, device)
                equal &= bool(torch.equal(ref, got))
                del ref, got
                for key, value in (("frame", frame), ("host_decode", dec_s), ("host_copy", copy_s),
                                   ("host", dec_s + copy_s), ("device", dev_s)):
                    best[key] = min(best.get(key, float("inf")), value)
            rows.append(dict(codec=codec, payload=read_header(buf)["_payload_length"], decoded=decoded,
                             encode_s=encode_s, equal=equal, **best))
            del buf
    return rows


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def table(rows: list[dict], *, device_name: str, cuda: bool, seqs: int, context: int, command: str) -> str:
    ids = seqs * context * NUM_LAYERS * TOP_K
    scale = "the seeds' batch" if (seqs, context) == (SEEDS_SEQS, CONTEXT) else \
        f"{seqs} of the seeds' {SEEDS_SEQS} sequences" + (f", {context:,} tokens each" if context != CONTEXT else "")
    where = (f"on {device_name} (CUDA)" if cuda else
             f"on CPU tensors ({device_name}; no CUDA device): NOT a GPU measurement, the device path's work runs "
             "on the host's cores here")
    lines = [
        f"# Route decoding into device memory, {where}",
        "",
        f"`{command}`, {datetime.date.today().isoformat()}, Python {platform.python_version()}, "
        f"{os.cpu_count()} host cores. {scale}: {seqs} x {context:,} tokens x {NUM_LAYERS} layers x top-{TOP_K} of "
        f"{NUM_EXPERTS} experts = {ids:,} ids ({_size(ids)} as uint8). GB/s: decoded route bytes per "
        "second of the whole path (best of the repeats). Host path: r3lab.compaction.decode (frame, CRC-32, codec, "
        "row check) then a copy to the device; device path: the frame and CRC-32 on the host, the payload copied "
        "once, decoded and row-checked by torch on the device.",
        "",
        "| codec | payload MiB | frame + CRC-32 (host) s | host decode s | copy to device s | host path s "
        "| host path GB/s | device path s | device path GB/s | device / host | bit-equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        gb = r["decoded"] / 1e9
        lines.append(
            f"| {r['codec']} | {r['payload'] / 2**20:,.2f} | {r['frame']:.3f} | {r['host_decode']:.3f} | "
            f"{r['host_copy']:.3f} | {r['host']:.3f} | {gb / r['host']:.2f} | {r['device']:.3f} | "
            f"{gb / r['device']:.2f} | {r['host'] / r['device']:.2f}x | {'yes' if r['equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", "--quick", action="store_true", help="8 sequences of 500 tokens, one repeat")
    ap.add_argument("--seqs", type=int, help=f"sequences (default: {SEEDS_SEQS} on CUDA, {CPU_SEQS} without)")
    ap.add_argument("--context", type=int, default=CONTEXT, help="tokens per sequence")
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args(argv)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    seqs = args.seqs or (SEEDS_SEQS if cuda else CPU_SEQS)
    context, repeats = args.context, args.repeats
    if args.dry_run:
        seqs, context, repeats = DRY_RUN["seqs"], DRY_RUN["context"], DRY_RUN["repeats"]
    if args.out and not cuda and Path(args.out).resolve().is_relative_to(ROOT / "bench" / "results"):
        print("bench_device_decode: refusing to write a CPU measurement under bench/results/ (it is not a GPU "
              "number); write it elsewhere", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if cuda else (platform.processor() or platform.machine())
    rows = measure(make_batch(seqs, context), args.codecs, device, repeats)
    command = "python bench/bench_device_decode.py" + (" --dry-run" if args.dry_run else "")
    text = table(rows, device_name=name, cuda=cuda, seqs=seqs, context=context, command=command)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Transport benchmark: r3lab codecs side by side with what the field sends today, in one run.

For each workload (bench/workloads.py) with skewed and uniform expert popularity, every method
encodes the whole packed batch and decodes it back to an array; we report bytes per routed id,
encode and decode time (median of repeats) and encode+decode throughput in million ids per second.
Writes bench/results/transport.md. Run: ``python bench/bench_transport.py [--quick]``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson
import pybase64

sys.path.insert(0, str(Path(__file__).parent))
from workloads import WORKLOADS, sample_routes  # noqa: E402

from r3lab.compaction import decode, encode  # noqa: E402
from r3lab.paths import results_dir
from r3lab.routes import Routes  # noqa: E402

RESULTS = results_dir() / "transport.md"


# ---- baselines: what the field sends ------------------------------------------------------------
def nested_json(r: Routes) -> tuple[bytes, Callable[[bytes], np.ndarray]]:
    buf = json.dumps([r.sequence(i).tolist() for i in range(len(r))]).encode()
    return buf, lambda b: np.concatenate(
        [np.asarray(s, dtype=np.int64).reshape(-1, r.num_layers, r.top_k) for s in json.loads(b)]
    )


def nested_orjson(r: Routes):
    buf = orjson.dumps([r.sequence(i).tolist() for i in range(len(r))])
    return buf, lambda b: np.concatenate(
        [np.asarray(s, dtype=np.int64).reshape(-1, r.num_layers, r.top_k) for s in orjson.loads(b)]
    )


def _b64_json(arr: np.ndarray, r: Routes) -> bytes:
    return orjson.dumps(
        {
            "data": pybase64.b64encode(arr.tobytes()).decode(),
            "shape": list(arr.shape),
            "dtype": arr.dtype.name,
            "cu_seqlens": r.cu_seqlens.tolist(),
        }
    )


_DTYPES = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2"), "int32": np.dtype("<i4")}


def _from_b64_json(b: bytes) -> np.ndarray:
    d = orjson.loads(b)
    dt = _DTYPES[d["dtype"]]
    raw = pybase64.b64decode(d["data"], validate=True)
    if len(raw) != int(np.prod(d["shape"])) * dt.itemsize or min(d["shape"]) < 0:
        raise ValueError("byte count")
    return np.frombuffer(raw, dtype=dt).reshape(d["shape"])


def compact_b64_orjson(r: Routes):
    """The field's best today: compact dtype + base64 + orjson, packed without padding."""
    return _b64_json(r.values, r), _from_b64_json


def int32_b64_orjson(r: Routes):
    return _b64_json(r.values.astype("<i4"), r), _from_b64_json


def npy_b64_orjson(r: Routes):
    bio = io.BytesIO()
    np.save(bio, r.values, allow_pickle=False)
    buf = orjson.dumps({"routed_experts": base64.b64encode(bio.getvalue()).decode()})
    return buf, lambda b: np.load(io.BytesIO(base64.b64decode(orjson.loads(b)["routed_experts"])), allow_pickle=False)


def r3lab_codec(codec: str):
    def method(r: Routes):
        return encode(r, codec), lambda b: decode(b).values

    method.__name__ = f"r3lab {codec}"
    return method


BASELINES = [nested_json, nested_orjson, int32_b64_orjson, npy_b64_orjson, compact_b64_orjson]
CODECS = ["raw", "bitpack", "topk-set", "raw+zstd", "bitpack+zstd", "topk-set+zstd", "topk-gaps+zstd"]
LABELS = {
    "nested_json": "nested lists, json",
    "nested_orjson": "nested lists, orjson",
    "int32_b64_orjson": "int32 + base64 + orjson",
    "npy_b64_orjson": "base64 .npy (vLLM server)",
    "compact_b64_orjson": "compact + base64 + orjson (field's best)",
}


def measure(method, r: Routes, repeats: int) -> dict:
    enc_t, dec_t = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf, dec = method(r)
        t1 = time.perf_counter()
        out = dec(buf)
        t2 = time.perf_counter()
        enc_t.append(t1 - t0)
        dec_t.append(t2 - t1)
    want = r.values if not method.__name__.startswith("r3lab topk-") else np.sort(r.values, axis=2)
    if not np.array_equal(np.asarray(out).reshape(want.shape), want):
        raise AssertionError(f"{method.__name__} did not round-trip")
    enc, dec = statistics.median(enc_t), statistics.median(dec_t)
    return {
        "bytes_per_id": len(buf) / r.values.size,
        "enc_ms": enc * 1e3,
        "dec_ms": dec * 1e3,
        "mids": r.values.size / (enc + dec) / 1e6,
    }


def run(quick: bool = False) -> tuple[str, list[dict]]:
    lines = [
        "# Transport benchmark",
        "",
        f"`python bench/bench_transport.py{' --quick' if quick else ''}` on {platform.machine()}, "
        f"{platform.python_version()}, numpy {np.__version__}, 1 thread of a 2-core machine. Median of repeats; "
        "ids = tokens x MoE layers x top-k. r3lab buffers are binary (an HTTP body or object-store blob); inside JSON "
        "they would grow by 4/3. Decode includes r3lab's full validation (checksum, id range, distinct ids per row); "
        "the baselines check byte counts only.",
        "",
    ]
    summary, records = [], []
    for w in WORKLOADS:
        if quick:
            w = replace(w, tokens=w.tokens // 8)
        for skew in (1.0, 0.0):
            r = sample_routes(w, skew=skew)
            label = (
                f"{w.name}, {'skewed (Zipf s=1)' if skew else 'uniform'} popularity: {r.total_tokens} tokens x "
                f"{r.num_layers} MoE layers x top-{r.top_k} = {r.values.size / 1e6:.2f} M ids"
            )
            lines += [
                f"## {label}",
                "",
                "| method | bytes / id | vs field's best | encode ms | decode ms | enc+dec M ids/s |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            rows = {}
            for m in BASELINES + [r3lab_codec(c) for c in CODECS]:
                slow = m in (nested_json, nested_orjson)
                rows[m.__name__] = measure(m, r, 1 if slow else (3 if quick else 7))
            best = rows["compact_b64_orjson"]
            for name, x in rows.items():
                lines.append(
                    f"| {LABELS.get(name, name)} | {x['bytes_per_id']:.3f} | "
                    f"{best['bytes_per_id'] / x['bytes_per_id']:.2f}x smaller | "
                    f"{x['enc_ms']:.1f} | {x['dec_ms']:.1f} | {x['mids']:.0f} |"
                )
            lines.append("")
            smallest = min((k for k in rows if k.startswith("r3lab")), key=lambda k: rows[k]["bytes_per_id"])
            summary.append((w.name, skew, best, rows, smallest))
            records += [
                {"workload": w.name, "popularity": "skewed" if skew else "uniform", "method": LABELS.get(k, k), **x}
                for k, x in rows.items()
            ]
            print(f"done: {label}", file=sys.stderr, flush=True)
    lines += weights_section(quick)
    lines += [
        "## Targets",
        "",
        "| workload | popularity | smallest r3lab codec | size vs field's best | raw speed vs field's best "
        "| bitpack speed vs field's best |",
        "|---|---|---|---:|---:|---:|",
    ]
    for name, skew, best, rows, smallest in summary:
        lines.append(
            f"| {name} | {'skewed' if skew else 'uniform'} | {smallest.removeprefix('r3lab ')} | "
            f"{best['bytes_per_id'] / rows[smallest]['bytes_per_id']:.2f}x smaller | "
            f"{rows['r3lab raw']['mids'] / best['mids']:.2f}x | "
            f"{rows['r3lab bitpack']['mids'] / best['mids']:.2f}x |"
        )
    return "\n".join(lines) + "\n", records


def weights_section(quick: bool) -> list[str]:
    """Ids only beside ids + routing weights (R3W) on each workload's skewed batch: bytes per expert-layer-token.

    Weights are synthetic (normalized random top-k weights, float32); their block is uncompressed, so its size is
    exact and independent of the values. prime-rl #3523 packs ``int32 [ids, fp32 weight bits]``: 8 bytes per
    expert-layer-token."""
    out = [
        "## Ids only vs ids + routing weights (R3W), bytes per expert-layer-token",
        "",
        "The routing weights ride in format version 3's weights block (`r3lab.compaction.codecs.weights`) behind "
        "the id codec's bytes; vLLM's API returns ids only, so only the in-process engine has weights to send. "
        "prime-rl #3523 ships int32 ids + fp32 weight bits: 8.000 bytes.",
        "",
        "| workload | ids: raw | ids: topk-set+zstd | + fp32 weights | + bf16 weights | + fp16 weights "
        "| int32 ids + fp32 bits (#3523) | bytes / token, ids (topk-set+zstd) | bytes / token, + bf16 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in WORKLOADS:
        if quick:
            w = replace(w, tokens=w.tokens // 8)
        r = sample_routes(w, skew=1.0)
        wt = np.random.default_rng(0).random(r.values.shape).astype(np.float32) + 0.01
        rw = r.with_weights(wt / wt.sum(-1, keepdims=True))
        n = r.values.size
        size = {c: len(encode(r, c)) / n for c in ("raw", "topk-set+zstd")}
        for dt in ("float32", "bfloat16", "float16"):
            buf = encode(rw, "topk-set+zstd", weights=dt)
            back = decode(buf)
            if back.weights is None or back.weights.shape != r.values.shape:
                raise AssertionError("weights did not round-trip")
            size[dt] = len(buf) / n
        per_tok = r.num_layers * r.top_k
        out.append(
            f"| {w.name} | {size['raw']:.3f} | {size['topk-set+zstd']:.3f} | {size['float32']:.3f} | "
            f"{size['bfloat16']:.3f} | {size['float16']:.3f} | 8.000 | {size['topk-set+zstd'] * per_tok:,.0f} | "
            f"{size['bfloat16'] * per_tok:,.0f} |"
        )
    return out + [""]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1/8 of the tokens and fewer repeats (smoke run)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--weights-only", action="store_true",
                    help="only the ids vs ids + routing weights sizes, written to transport_weights.md")
    args = ap.parse_args(argv)
    if args.weights_only:
        out = RESULTS.with_name("transport_weights.md")
        text = "\n".join([f"# Routing weights in transport\n\n`python bench/bench_transport.py --weights-only"
                          f"{' --quick' if args.quick else ''}` (sizes only; the full run prints the same table).\n",
                          *weights_section(args.quick)])
        print(text)
        if not args.quick:
            out.write_text(text)
            print(f"wrote {out}", file=sys.stderr)
        return
    table, records = run(args.quick)
    print(table)
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
        args.out.with_suffix(".json").write_bytes(orjson.dumps(records, option=orjson.OPT_INDENT_2))
        print(f"wrote {args.out} and {args.out.with_suffix('.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Size and speed of every codec on one set of routes, beside the field's best JSON payload (for notebooks).

``bench/bench_transport.py`` is the committed benchmark (all baselines, fixed workloads); this measures the
routes a user holds, e.g. a notebook's own rollout, with the same rules: the whole batch encoded and decoded
back to an array (r3lab's full validation included), the median of ``repeats``, and a round-trip check.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from r3lab.compaction.codecs import PIPELINES, parse_pipeline
from r3lab.compaction.container import decode, encode
from r3lab.compaction.payload import from_payload, to_payload
from r3lab.errors import RouteFormatError
from r3lab.routes import Routes

BASELINE = "compact + base64 + orjson"  # the field's best today (r3lab's to_payload, serialized with orjson)


def _roundtrip(routes: Routes, codec: str) -> tuple[int, float, float, np.ndarray]:
    t0 = time.perf_counter()
    if codec == BASELINE:
        buf = orjson.dumps(to_payload(routes))
        t1 = time.perf_counter()
        out = from_payload(orjson.loads(buf)).values
    else:
        buf = encode(routes, codec)
        t1 = time.perf_counter()
        out = decode(buf).values
    return len(buf), t1 - t0, time.perf_counter() - t1, out


def measure_codecs(routes: Routes, codecs: Sequence[str] | None = None, *, repeats: int = 3,
                   label: str = "routes") -> list[dict[str, Any]]:
    """One record per codec (the baseline first): ``bytes``, ``bytes_per_id``, ``ratio_to_baseline``,
    ``encode_ms`` / ``decode_ms`` (medians) and ``mids_per_s`` (million ids per second, encode + decode).

    ``codecs`` default: every built-in pipeline (:data:`~r3lab.compaction.codecs.PIPELINES`). Raises
    :class:`RouteFormatError` if a codec does not give the routes back (set codecs: each row sorted).
    """
    names = [BASELINE, *(list(PIPELINES) if codecs is None else [c for c in codecs if c != BASELINE])]
    if repeats < 1:
        raise RouteFormatError(f"repeats must be >= 1, got {repeats}")
    if routes.values.size == 0:
        raise RouteFormatError("no routes to measure")
    ids = routes.values.size
    records: list[dict[str, Any]] = []
    for name in names:
        runs = [_roundtrip(routes, name) for _ in range(repeats)]
        size, out = runs[0][0], runs[-1][3]
        sorts = name != BASELINE and parse_pipeline(name)[0].sorts_rows  # set codecs give each row sorted
        want = np.sort(routes.values, axis=2) if sorts else routes.values
        if not np.array_equal(out, want):
            raise RouteFormatError(f"codec {name!r} did not give the routes back")
        enc = statistics.median(r[1] for r in runs)
        dec = statistics.median(r[2] for r in runs)
        records.append({"routes": label, "codec": name, "ids": ids, "bytes": size, "bytes_per_id": size / ids,
                        "encode_ms": enc * 1e3, "decode_ms": dec * 1e3, "mids_per_s": ids / (enc + dec) / 1e6})
    base = records[0]["bytes"]
    for r in records:
        r["ratio_to_baseline"] = base / r["bytes"]
    return records

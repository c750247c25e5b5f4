import base64
import io
import struct
import zlib
from pathlib import Path

import numpy as np
import orjson
import pytest
from conftest import random_routes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3lab.compaction import (
    ALIASES,
    MAGIC,
    BitPack,
    Raw,
    RouteFormatError,
    TopKSet,
    Zstd,
    compact_dtype,
    decode,
    encode,
    from_payload,
    get_codec,
    read_sglang_base64_int32,
    read_vllm_nested_list,
    read_vllm_npy_base64,
    to_payload,
)
from r3lab.compaction.codecs import id_bits
from r3lab.routes import Routes

FIXTURES = Path(__file__).parent / "fixtures"


@st.composite
def route_sets(draw):
    E = draw(st.integers(2, 512))
    K = draw(st.integers(1, min(22, E)))
    L = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 24), min_size=1, max_size=5))
    first = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    return random_routes(np.random.default_rng(seed), num_experts=E, top_k=K, num_layers=L, lengths=lengths,
                         layer_ids=list(range(first, first + L)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(route_sets(), st.sampled_from(sorted(ALIASES)))
def test_round_trip_every_codec(routes, codec):
    buf = encode(routes, codec)
    out = decode(buf)
    want = routes.sorted_rows() if codec.startswith("topk-") else routes
    assert out == want
    assert out.values.dtype == compact_dtype(routes.num_experts)
    assert decode(memoryview(buf)) == want and decode(bytearray(buf)) == want


@settings(max_examples=40, deadline=None)
@given(route_sets())
def test_round_trip_payload(routes):
    payload = orjson.loads(orjson.dumps(to_payload(routes)))
    assert from_payload(payload) == routes


def test_topk_set_returns_sorted_rows_and_is_compact():
    r = Routes(np.array([[[5, 1, 3]], [[0, 7, 2]]]), [0, 2], 8)
    out = decode(encode(r, "topk-set"))
    assert out.values.tolist() == [[[1, 3, 5]], [[0, 2, 7]]]
    # C(8, 3) = 56 sets -> 6 bits per row -> 12 bits -> 2 bytes of payload
    assert TopKSet().encoded_size((2, 1, 3), np.uint8, 8) == 2


@pytest.mark.parametrize(("E", "K"), [(64, 8), (512, 22), (384, 8), (65536, 2), (2, 2), (3, 3)])
def test_topk_set_extremes(E, K):
    """The first and last set of the combinatorial order, including ranks wider than 64 bits."""
    lo = np.arange(K)
    hi = np.arange(E - K, E)
    r = Routes(np.stack([lo, hi])[:, None, :], [0, 2], E)
    assert decode(encode(r, "topk-set")) == r


@pytest.mark.parametrize("E", [2, 3, 7, 8, 9, 64, 65, 256, 257, 300, 512, 1024, 65536])
def test_bitpack_uses_ceil_log2_bits(E):
    rng = np.random.default_rng(E)
    K = min(4, E)
    r = random_routes(rng, num_experts=E, top_k=K, num_layers=3, lengths=[13, 0, 6])
    n = r.values.size
    b = id_bits(E)
    assert b == max(1, int(np.ceil(np.log2(E))))
    assert BitPack().encoded_size(r.values.shape, r.values.dtype, E) == -(-n * b // 8)
    assert decode(encode(r, "bitpack")) == r


def test_codec_configs_round_trip_and_registry():
    for c in (Raw(), Raw(order="layer"), BitPack(), TopKSet(order="layer"), Zstd(level=9)):
        cfg = orjson.loads(orjson.dumps(c.get_config()))
        assert get_codec(cfg) == c
    with pytest.raises(RouteFormatError, match="unknown codec 'lz4'"):
        get_codec({"id": "lz4"})
    with pytest.raises(RouteFormatError, match="bad config"):
        get_codec({"id": "zstd", "speed": 1})
    with pytest.raises(RouteFormatError, match="order"):
        Raw(order="column")
    r = Routes(np.zeros((2, 1, 1), int), [0, 2], 4)
    assert decode(encode(r, [BitPack(order="layer"), Zstd(1)])) == r
    with pytest.raises(RouteFormatError, match="unknown codec"):
        encode(r, "gzip")
    with pytest.raises(RouteFormatError, match="starts with an id coder"):
        encode(r, [Zstd()])
    with pytest.raises(RouteFormatError, match="at most one byte stage"):
        encode(r, [Raw(), Zstd(), Zstd()])


# ---- golden fixtures: format version 1 must decode forever --------------------------------------

@pytest.mark.parametrize("name", ["e64k8", "e512k22"])
@pytest.mark.parametrize("codec", sorted(ALIASES))
def test_golden_fixtures_decode(name, codec):
    exp = np.load(FIXTURES / f"{name}.expected.npz", allow_pickle=False)
    want = Routes(exp["values"], exp["cu_seqlens"], int(exp["num_experts"]), exp["layer_ids"])
    if codec.startswith("topk-"):
        want = want.sorted_rows()
    assert decode((FIXTURES / f"{name}.{codec}.r3").read_bytes()) == want
    payload = orjson.loads((FIXTURES / f"{name}.payload.json").read_bytes())
    assert from_payload(payload) == Routes(exp["values"], exp["cu_seqlens"], int(exp["num_experts"]), exp["layer_ids"])


# ---- malformed input: every error class, every decoder ------------------------------------------

def _sample(codec="raw"):
    r = random_routes(np.random.default_rng(7), num_experts=16, top_k=2, num_layers=2, lengths=[3, 2])
    return r, encode(r, codec)


def _reframe(buf: bytes, *, header=None, cu=None, payload=None, version=1, magic=MAGIC) -> bytes:
    """Rebuild a buffer with one part replaced, with a correct checksum (so the named check must fire)."""
    _, _, hlen, plen = struct.unpack_from("<4sB3xIQ", buf, 0)
    h = orjson.loads(buf[20 : 20 + hlen])
    n = h["num_seqs"] + 1
    old_cu = buf[20 + hlen : 20 + hlen + 8 * n]
    old_pay = buf[20 + hlen + 8 * n : -4]
    h = header(h) if header else h
    hb = orjson.dumps(h)
    cu_b = old_cu if cu is None else np.asarray(cu, "<i8").tobytes()
    pay = old_pay if payload is None else payload
    body = struct.pack("<4sB3xIQ", magic, version, len(hb), len(pay)) + hb + cu_b + pay
    return body + struct.pack("<I", zlib.crc32(body))


def _raw_frame(header: bytes, rest: bytes) -> bytes:
    body = struct.pack("<4sB3xIQ", MAGIC, 1, len(header), len(rest)) + header + rest
    return body + struct.pack("<I", zlib.crc32(body))


def _set(key, value):
    def f(h):
        h[key] = value
        return h
    return f


MALFORMED = {
    "bad magic": (lambda b: _reframe(b, magic=b"NOPE"), "bad magic"),
    "bad version": (lambda b: _reframe(b, version=9), "unsupported format version 9"),
    "unknown codec": (lambda b: _reframe(b, header=_set("codec", [{"id": "lz4"}])), "unknown codec 'lz4'"),
    "unknown dtype": (lambda b: _reframe(b, header=_set("dtype", "float32")), "unknown dtype"),
    "non-compact dtype": (lambda b: _reframe(b, header=_set("dtype", "uint16")), "not the compact dtype"),
    "truncated": (lambda b: b[:-7], "truncated"),
    "too short": (lambda b: b[:10], "truncated"),
    "trailing": (lambda b: b + b"\0\0", "trailing bytes"),
    "checksum": (lambda b: b[:-5] + bytes([b[-5] ^ 1]) + b[-4:], "checksum mismatch"),
    "shape vs bytes": (lambda b: _reframe(b, header=_set("shape", [6, 2, 2]), cu=[0, 3, 6]), "needs"),
    "negative dim": (lambda b: _reframe(b, header=_set("shape", [5, -2, 2])), "negative dim"),
    "non-integer dim": (lambda b: _reframe(b, header=_set("shape", [5, 2.0, 2])), "non-integer dim"),
    "id out of range": (lambda b: _reframe(b, header=_set("num_experts", 9)), "out of range"),
    "cu not monotone": (lambda b: _reframe(b, cu=[0, 4, 2, 5], header=_set("num_seqs", 3)), "not monotone"),
    "cu end": (lambda b: _reframe(b, cu=[0, 3, 4]), "ends at"),
    "header not json": (lambda b: _raw_frame(b"{not json", b""), "header is not valid JSON"),
    "header not object": (lambda b: _raw_frame(b"[1, 2]", b""), "JSON object"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_decode_errors(case):
    _, buf = _sample()
    corrupt, message = MALFORMED[case]
    with pytest.raises(RouteFormatError, match=message):
        decode(corrupt(buf))


def test_decode_errors_are_value_errors():
    assert issubclass(RouteFormatError, ValueError)
    with pytest.raises(ValueError):
        decode(b"garbage-garbage-garbage-garbage")


def test_repeated_ids_inside_a_row_rejected_by_raw_and_bitpack():
    for codec in ("raw", "bitpack"):
        r, buf = _sample(codec)
        dup = np.array(r.values)
        dup[1, 0] = [5, 5]
        coder = Raw() if codec == "raw" else BitPack()
        with pytest.raises(RouteFormatError, match="repeated expert id"):
            decode(_reframe(buf, payload=coder.encode(dup, 16)))


def test_topk_set_rank_out_of_range_rejected():
    r, buf = _sample("topk-set")
    nbytes = TopKSet().encoded_size((5, 2, 2), np.uint8, 16)  # C(16, 2) = 120 -> 7 bits per row
    with pytest.raises(RouteFormatError, match="C\\(16, 2\\)"):
        decode(_reframe(buf, payload=b"\xff" * nbytes))


def test_size_cap_stops_bombs():
    r = Routes(np.zeros((100_000, 4, 1), int), [0, 100_000], 8)
    buf = encode(r, "raw+zstd")
    assert len(buf) < 2000  # a tiny buffer that would inflate to 400 kB
    with pytest.raises(RouteFormatError, match="over the cap"):
        decode(buf, max_bytes=100_000)
    assert decode(buf, max_bytes=400_000) == r


def test_zstd_frame_that_lies_about_its_size_is_refused():
    r, buf = _sample("raw+zstd")
    import zstandard

    liar = zstandard.ZstdCompressor().compress(b"\0" * 21)
    with pytest.raises(RouteFormatError, match="zstd frame declares 21"):
        decode(_reframe(buf, payload=liar))
    with pytest.raises(RouteFormatError, match="zstd"):
        decode(_reframe(buf, payload=b"not zstd at all"))


# ---- JSON payload and engine readers -----------------------------------------------------------

def test_payload_errors():
    r, _ = _sample()
    good = to_payload(r)
    bad = {
        "not a dict": ([1], "must be a dict"),
        "missing data": ({k: v for k, v in good.items() if k != "data"}, "lacks"),
        "bad base64": ({**good, "data": "@@@@"}, "bad base64"),
        "non-canonical dtype": ({**good, "dtype": "<u1"}, "non-canonical"),
        "unknown dtype": ({**good, "dtype": "float32"}, "unknown or non-canonical"),
        "wrong byte count": ({**good, "shape": [5, 2, 3]}, "do not match"),
        "negative dim": ({**good, "shape": [-5, 2, 2]}, "negative"),
        "non-integer dim": ({**good, "shape": [5, 2, "2"]}, "non-integer"),
        "ids out of range": ({**good, "num_experts": 3}, "out of range"),
        "bad cu": ({**good, "cu_seqlens": [0, 4, 3]}, "not monotone"),
        "no num_experts": ({k: v for k, v in good.items() if k != "num_experts"}, "num_experts"),
        "padded without lengths": ({**good, "shape": [1, 5, 2, 2]}, "lengths"),
    }
    for _name, (payload, message) in bad.items():
        with pytest.raises(RouteFormatError, match=message):
            from_payload(payload)
    with pytest.raises(RouteFormatError, match="over the cap"):
        from_payload(good, max_bytes=10)
    with pytest.raises(RouteFormatError, match="disagrees"):
        from_payload(good, num_experts=17)


def test_field_style_payloads():
    """The field's {data, shape, dtype}: int32 and int16 arrays, padded [B, S, L, K] with lengths."""
    arr = np.array([[[3, 1]], [[0, 2]]], dtype=np.int32)
    p = {"data": base64.b64encode(arr.tobytes()).decode(), "shape": [2, 1, 2], "dtype": "int32"}
    r = from_payload(p, num_experts=4)
    assert r.values.dtype == np.uint8 and r.values.tolist() == arr.tolist() and len(r) == 1
    padded = np.zeros((2, 3, 1, 2), dtype=np.int16) + np.arange(2, dtype=np.int16)
    padded[0, 0] = [[300, 7]]
    p = {"data": base64.b64encode(padded.tobytes()).decode(), "shape": [2, 3, 1, 2], "dtype": "int16", "lengths": [1, 2]}
    r = from_payload(p, num_experts=384)
    assert r.lengths.tolist() == [1, 2] and r.values[0].tolist() == [[300, 7]]


def _npy_b64(arr, **kw) -> str:
    bio = io.BytesIO()
    np.save(bio, arr, **kw)
    return base64.b64encode(bio.getvalue()).decode()


def test_read_vllm_npy_base64():
    arr = np.arange(24, dtype=np.uint8).reshape(4, 3, 2)
    assert np.array_equal(read_vllm_npy_base64(_npy_b64(arr)), arr)
    big = np.arange(24, dtype=np.uint16).reshape(4, 3, 2) + 300
    assert np.array_equal(read_vllm_npy_base64(_npy_b64(big)), big)
    cases = {
        "pickle": (_npy_b64(np.array([{"a": 1}], dtype=object), allow_pickle=True), "refusing .npy dtype"),
        "float": (_npy_b64(arr.astype(np.float32)), "refusing .npy dtype"),
        "big-endian": (_npy_b64(big.astype(">u2")), "refusing .npy dtype"),
        "fortran": (_npy_b64(np.asfortranarray(arr)), "Fortran"),
        "2-D": (_npy_b64(arr.reshape(4, 6)), "shape"),
        "not npy": (base64.b64encode(b"hello world").decode(), "not .npy"),
        "bad base64": ("!!!", "bad base64"),
    }
    for _name, (data, message) in cases.items():
        with pytest.raises(RouteFormatError, match=message):
            read_vllm_npy_base64(data)
    raw = base64.b64decode(_npy_b64(arr))
    with pytest.raises(RouteFormatError, match="do not match"):
        read_vllm_npy_base64(base64.b64encode(raw[:-1]))
    with pytest.raises(RouteFormatError, match="over the cap"):
        read_vllm_npy_base64(_npy_b64(arr), max_bytes=8)


def test_read_vllm_nested_list_and_sglang():
    nested = [[[1, 2], [0, 3]], [[2, 3], [1, 0]]]
    assert read_vllm_nested_list(nested).tolist() == nested
    with pytest.raises(RouteFormatError, match="ragged"):
        read_vllm_nested_list([[[1, 2]], [[1]]])
    with pytest.raises(RouteFormatError, match="integers"):
        read_vllm_nested_list([[[1.5, 2.0]]])
    with pytest.raises(RouteFormatError, match="nesting"):
        read_vllm_nested_list([1, 2])
    flat = np.array(nested, dtype="<i4").ravel()
    out = read_sglang_base64_int32(base64.b64encode(flat.tobytes()).decode(), num_layers=2, top_k=2)
    assert out.tolist() == nested
    with pytest.raises(RouteFormatError, match="whole number"):
        read_sglang_base64_int32(base64.b64encode(flat.tobytes()[:-4]).decode(), num_layers=2, top_k=2)
    with pytest.raises(RouteFormatError, match=">= 1"):
        read_sglang_base64_int32("", num_layers=0, top_k=2)


def test_topk_gaps_rejects_bad_relabelling_and_overflowing_gaps():
    r, buf = _sample("topk-gaps+zstd")
    import zstandard

    T, L, K, E = 5, 2, 2, 16
    perms = np.tile(np.arange(E, dtype=np.uint8), (L, 1))
    gaps = np.zeros((L, K, T), dtype=np.uint8)
    ok = perms.tobytes() + gaps.tobytes()
    assert decode(_reframe(buf, payload=zstandard.ZstdCompressor().compress(ok))).values[:, :, :].tolist() == [[[0, 1]] * 2] * 5
    perms_bad = perms.copy()
    perms_bad[1, 3] = 0
    with pytest.raises(RouteFormatError, match="not a permutation"):
        decode(_reframe(buf, payload=zstandard.ZstdCompressor().compress(perms_bad.tobytes() + gaps.tobytes())))
    gaps_bad = gaps.copy()
    gaps_bad[0, 1, 2] = 15
    with pytest.raises(RouteFormatError, match="out of range"):
        decode(_reframe(buf, payload=zstandard.ZstdCompressor().compress(perms.tobytes() + gaps_bad.tobytes())))


def test_topk_gaps_pays_on_skewed_popularity():
    """Zipf-skewed experts: topk-gaps+zstd beats the fixed-width topk-set; on uniform ones it does not need to."""
    rng = np.random.default_rng(3)
    E, K, T = 64, 4, 4000
    logw = -1.2 * np.log(np.arange(1, E + 1))
    vals = np.argpartition(-(logw + rng.gumbel(size=(T, E))), K - 1, axis=1)[:, :K].reshape(T, 1, K)
    r = Routes(vals, [0, T], E)
    assert len(encode(r, "topk-gaps+zstd")) < 0.9 * len(encode(r, "topk-set"))
    assert decode(encode(r, "topk-gaps+zstd")) == r.sorted_rows()


@pytest.mark.parametrize("E", [8, 9, 64, 100, 128, 129, 200, 256])
def test_row_checks_catch_every_duplicate_pair_and_every_out_of_range_id(E):
    """The word-at-a-time check of top-8 uint8 rows (and its fallbacks) against a plain oracle."""
    from r3lab.compaction.kernels import first_bad_row

    rng = np.random.default_rng(E)
    rows = np.argsort(rng.random((64, E)), axis=1)[:, :8].astype(np.uint8)
    assert first_bad_row(rows, E) == (-1, -1)
    for i in range(8):
        for j in range(i + 1, 8):
            bad = rows.copy()
            bad[37, j] = bad[37, i]
            assert first_bad_row(bad, E) == (37, 1), (i, j)
    for value in sorted({E, min(E + 27, 255), 255}):
        if E <= value <= 255:
            bad = rows.copy()
            bad[50] = [value, 0, 1, 2, 3, 4, 5, 6]  # distinct ids, one out of range
            assert first_bad_row(bad, E) == (50, 0), value

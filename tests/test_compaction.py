import base64
import inspect
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
    FORMAT_VERSION,
    MAGIC,
    decode,
    encode,
    from_payload,
    read_header,
    read_sglang_base64_int32,
    read_vllm_nested_list,
    read_vllm_npy_base64,
    to_payload,
)
from r3lab.compaction.codecs import PIPELINES, BitPack, Raw, TopKSet, Zstd, get_codec, id_bits
from r3lab.errors import RouteFormatError
from r3lab.routes import Routes, compact_dtype
from r3lab.testing import vllm_npy_base64


@st.composite
def route_sets(draw):
    E = draw(st.integers(2, 512))
    K = draw(st.integers(1, min(22, E)))
    L = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 24), min_size=1, max_size=5))
    first = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    return random_routes(
        np.random.default_rng(seed), num_experts=E, top_k=K, num_layers=L, lengths=lengths,
        layer_ids=list(range(first, first + L)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(route_sets(), st.sampled_from(sorted(PIPELINES)))
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
    with pytest.raises(RouteFormatError, match="starts with an id codec"):
        encode(r, [Zstd()])
    with pytest.raises(RouteFormatError, match="at most one byte stage"):
        encode(r, [Raw(), Zstd(), Zstd()])


# ---- malformed input: every error class, every decoder ------------------------------------------

def _sample(codec="raw"):
    r = random_routes(np.random.default_rng(7), num_experts=16, top_k=2, num_layers=2, lengths=[3, 2])
    return r, encode(r, codec)


def _reframe(buf: bytes, *, header=None, cu=None, payload=None, version=None, magic=MAGIC) -> bytes:
    """Rebuild a buffer with one part replaced, with a correct checksum (so the named check must fire)."""
    _, old_version, hlen, plen = struct.unpack_from("<4sB3xIQ", buf, 0)
    version = old_version if version is None else version
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
    body = struct.pack("<4sB3xIQ", MAGIC, FORMAT_VERSION, len(header), len(rest)) + header + rest
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


def _every_decoder():
    """Every codec that decodes: each registered built-in (its default config) and the read-only version 1 layout."""
    from r3lab.compaction import BitPackPlanesV1
    from r3lab.compaction.codecs import CODECS

    return [CODECS[cid]() for cid in ("raw", "bitpack", "topk-set", "topk-gaps", "zstd")] + [BitPackPlanesV1()]


@pytest.mark.parametrize("codec", _every_decoder(), ids=repr)
@pytest.mark.parametrize("E, K", [(16, 2), (300, 3), (512, 22)])
def test_every_decoder_refuses_malformed_bytes(codec, E, K):
    """numcodecs' test_decode_errors for each codec alone: a buffer of the wrong length is refused by name, and
    random bytes of the right length decode to valid rows or raise RouteFormatError (never another error)."""
    from r3lab.compaction.codecs import ByteCodec

    r = random_routes(np.random.default_rng(E), num_experts=E, top_k=K, num_layers=2, lengths=[3, 2])
    shape, dtype = r.values.shape, r.values.dtype
    rng = np.random.default_rng(1)
    if isinstance(codec, ByteCodec):
        inner = Raw(order="layer").encode(r.values, E)
        frame = codec.encode(inner)
        assert bytes(codec.decode(memoryview(frame), len(inner))) == inner
        for bad, size in ((frame, len(inner) + 1), (frame[:-3], len(inner)), (b"", len(inner)),
                          (rng.bytes(len(frame)), len(inner))):
            with pytest.raises(RouteFormatError, match="zstd"):
                codec.decode(memoryview(bad), size)
        return
    size = codec.encoded_size(shape, dtype, E)
    for n in {0, size - 1, size + 1} - {size}:
        with pytest.raises(RouteFormatError, match=r"payload holds \d+ bytes but shape"):
            codec.decode(memoryview(rng.bytes(n)), shape, dtype, E)
    for _ in range(20):
        try:
            out = codec.decode(memoryview(rng.bytes(size)), shape, dtype, E)
        except RouteFormatError:
            continue
        assert out.shape == shape and out.dtype == dtype
        if codec.checks_rows:  # the codec promises valid rows itself; the others are checked by the container
            Routes(out, [0, shape[0]], E)


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
    p = {
        "data": base64.b64encode(padded.tobytes()).decode(), "shape": [2, 3, 1, 2], "dtype": "int16", "lengths": [1, 2],
    }
    r = from_payload(p, num_experts=384)
    assert r.lengths.tolist() == [1, 2] and r.values[0].tolist() == [[300, 7]]


def test_read_vllm_npy_base64():
    arr = np.arange(24, dtype=np.uint8).reshape(4, 3, 2)
    assert np.array_equal(read_vllm_npy_base64(vllm_npy_base64(arr)), arr)
    big = np.arange(24, dtype=np.uint16).reshape(4, 3, 2) + 300
    assert np.array_equal(read_vllm_npy_base64(vllm_npy_base64(big)), big)
    cases = {
        "pickle": (vllm_npy_base64(np.array([{"a": 1}], dtype=object), allow_pickle=True), "refusing .npy dtype"),
        "float": (vllm_npy_base64(arr.astype(np.float32)), "refusing .npy dtype"),
        "big-endian": (vllm_npy_base64(big.astype(">u2")), "refusing .npy dtype"),
        "fortran": (vllm_npy_base64(np.asfortranarray(arr)), "Fortran"),
        "2-D": (vllm_npy_base64(arr.reshape(4, 6)), "shape"),
        "not npy": (base64.b64encode(b"hello world").decode(), "not .npy"),
        "bad base64": ("!!!", "bad base64"),
    }
    for _name, (data, message) in cases.items():
        with pytest.raises(RouteFormatError, match=message):
            read_vllm_npy_base64(data)
    raw = base64.b64decode(vllm_npy_base64(arr))
    with pytest.raises(RouteFormatError, match="do not match"):
        read_vllm_npy_base64(base64.b64encode(raw[:-1]))
    with pytest.raises(RouteFormatError, match="over the cap"):
        read_vllm_npy_base64(vllm_npy_base64(arr), max_bytes=8)


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
    out = decode(_reframe(buf, payload=zstandard.ZstdCompressor().compress(ok)))
    assert out.values.tolist() == [[[0, 1]] * 2] * 5
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


# ---- golden fixtures: every layout ever released decodes (or refuses) forever -------------------
#
# tests/fixtures/           format version 1 as the writers of 9956a86..d0a0f16 left it
#                           (e512k22 bitpack files: the one-stream layout, rewritten by 9956a86)
# tests/fixtures/v1-cf15985 format version 1 as the first writer (cf15985) made it (restored from git)
# tests/fixtures/v2         format version 2, written by make_golden.py

FIXTURES = Path(__file__).parent / "fixtures"
V2 = FIXTURES / "v2"
#: who wrote the version 1 bitpack buffers of each folder (the answer decode(legacy_bitpack=...) needs)
V1_BITPACK_WRITER = {FIXTURES: "stream", FIXTURES / "v1-cf15985": "planes"}
# ids-only layouts (versions 1 and 2); v3/ (routes with routing weights) is checked in tests/test_r3w.py
ALL_FIXTURES = sorted(p for p in FIXTURES.rglob("*.r3") if p.parent.name != "v3")


def _expected(folder: Path, name: str) -> Routes:
    e = np.load(folder / f"{name}.expected.npz", allow_pickle=False)
    return Routes(e["values"], e["cu_seqlens"], int(e["num_experts"]), e["layer_ids"])


def _name_codec(path: Path) -> tuple[str, str]:
    name, codec = path.name[: -len(".r3")].split(".", 1)
    return name, codec


def _version(buf: bytes) -> int:
    return struct.unpack_from("<4sB", buf, 0)[1]


def _parts(buf: bytes) -> tuple:
    """(version, header JSON, cu_seqlens bytes, the id codec's payload with any zstd stage inflated)."""
    h = read_header(buf)
    payload = buf[h["_payload_offset"] : h["_payload_offset"] + h["_payload_length"]]
    if len(h["codec"]) > 1:
        import zstandard

        payload = zstandard.ZstdDecompressor().decompress(payload)
    hlen = struct.unpack_from("<I", buf, 8)[0]
    return h["format_version"], buf[20 : 20 + hlen], buf[h["_cu_offset"] : h["_payload_offset"]], payload


def test_fixture_folders_are_the_ones_we_know():
    assert {p.parent for p in ALL_FIXTURES} == {V2, *V1_BITPACK_WRITER}
    assert len(ALL_FIXTURES) == 14 + 12 + 4 * 7


@pytest.mark.parametrize("path", ALL_FIXTURES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_every_fixture_decodes_exactly_or_refuses_clearly(path):
    buf = path.read_bytes()
    name, codec = _name_codec(path)
    want = _expected(path.parent, name)
    if codec.startswith("topk-"):
        want = want.sorted_rows()
    version = _version(buf)
    assert version in (1, 2) and (version == 2) == (path.parent == V2)
    if version == 1 and codec.startswith("bitpack") and id_bits(want.num_experts) > 8:
        with pytest.raises(RouteFormatError, match=r"format version 1 bitpack buffer with 9-bit ids .* ambiguous"):
            decode(buf)
        assert decode(buf, legacy_bitpack=V1_BITPACK_WRITER[path.parent]) == want
    else:
        assert decode(buf) == want
        for legacy in ("planes", "stream"):  # an answer to a question the buffer does not raise changes nothing
            assert decode(buf, legacy_bitpack=legacy) == want


@pytest.mark.parametrize("folder", [V2, *V1_BITPACK_WRITER], ids=lambda p: p.name)
def test_every_fixture_payload_json_decodes(folder):
    names = sorted(p.name.split(".")[0] for p in folder.glob("*.payload.json"))
    assert names == sorted(p.name.split(".")[0] for p in folder.glob("*.expected.npz"))
    for name in names:
        assert from_payload(orjson.loads((folder / f"{name}.payload.json").read_bytes())) == _expected(folder, name)


def _make_golden():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_golden", FIXTURES / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_expected_routes_agree_across_versions_and_with_make_golden():
    golden = _make_golden().golden_routes()
    assert sorted(p.name.split(".")[0] for p in V2.glob("*.expected.npz")) == sorted(golden)
    for name, routes in golden.items():
        assert _expected(V2, name) == routes
        for folder in V1_BITPACK_WRITER:
            if (folder / f"{name}.expected.npz").exists():
                assert _expected(folder, name) == routes


@pytest.mark.parametrize("codec", sorted(PIPELINES))
@pytest.mark.parametrize("name", ["e64k8", "e512k22", "e16k3", "e1000k6"])
def test_encode_writes_exactly_the_v2_fixture_bytes(name, codec):
    """Any change to what a codec writes fails here: the current version's goldens are byte-exact."""
    fixture = (V2 / f"{name}.{codec}.r3").read_bytes()
    buf = encode(_expected(V2, name), codec)
    assert _version(buf) == FORMAT_VERSION == 2
    assert _parts(buf) == _parts(fixture)  # frame, header, cu_seqlens and the id codec's bytes, exactly
    import zstandard

    written_with = orjson.loads((V2 / "written-with.json").read_bytes())
    if "zstd" not in codec or written_with["libzstd"] == ".".join(map(str, zstandard.ZSTD_VERSION)):
        assert buf == fixture  # and the whole buffer (zstd's bytes depend on the library that compressed them)


def test_v1_stream_fixtures_are_v2_bytes_under_another_version_byte():
    """The 9956a86..d0a0f16 writers already wrote today's layouts: only the version byte (and CRC) differ."""
    for path in sorted(FIXTURES.glob("*.r3")):
        old = bytearray(path.read_bytes())
        assert old[4] == 1
        old[4] = 2
        body = bytes(old[:-4])
        assert body + struct.pack("<I", zlib.crc32(body)) == (V2 / path.name).read_bytes(), path.name


def test_restored_cf15985_originals_never_decode_to_wrong_ids():
    """The first writer's e512k22 bitpack buffers: refused by default; right only when told 'planes'."""
    old = FIXTURES / "v1-cf15985"
    for codec in ("bitpack", "bitpack+zstd"):
        buf = (old / f"e512k22.{codec}.r3").read_bytes()
        assert buf != (FIXTURES / f"e512k22.{codec}.r3").read_bytes()  # the file 9956a86 rewrote in place
        with pytest.raises(RouteFormatError, match="ambiguous.*legacy_bitpack='planes'.*legacy_bitpack='stream'"):
            decode(buf)
        assert decode(buf, legacy_bitpack="planes") == _expected(old, "e512k22")
        with pytest.raises(RouteFormatError, match="repeated expert id"):  # read as one stream, as HEAD used to
            decode(buf, legacy_bitpack="stream")
        stream = (FIXTURES / f"e512k22.{codec}.r3").read_bytes()
        with pytest.raises(RouteFormatError, match="repeated expert id"):
            decode(stream, legacy_bitpack="planes")


def _v1_frame(routes: Routes, codec: str, payload: bytes) -> bytes:
    """A version 1 buffer for ``routes`` with the id codec's bytes replaced (zstd applied when the codec has it)."""
    import zstandard

    buf = encode(routes, codec)
    if "zstd" in codec:
        payload = zstandard.ZstdCompressor().compress(payload)
    return _reframe(buf, payload=payload, version=1)


def test_v1_planes_buffer_that_one_stream_reading_misreads_silently():
    """By hand: 512 experts (9 bits), one row [300, 5]. cf15985 wrote the low bytes 2C 05, then the high bits
    1, 0 as a bit stream: 01. Read as one 9-bit stream (what r3lab did from 9956a86 on) the same three bytes
    are the valid row [300, 130]: a silent misread. Now it is refused unless the writer is named."""
    r = Routes(np.array([[[300, 5]]]), [0, 1], 512)
    for codec in ("bitpack", "bitpack+zstd"):
        buf = _v1_frame(r, codec, bytes([0x2C, 0x05, 0x01]))
        with pytest.raises(RouteFormatError, match="version 1 bitpack buffer with 9-bit ids \\(num_experts=512\\)"):
            decode(buf)
        assert decode(buf, legacy_bitpack="planes") == r
        assert decode(buf, legacy_bitpack="stream").values.tolist() == [[[300, 130]]]
    # 16-bit ids: planes are all low bytes, then all high bytes
    r16 = Routes(np.array([[[0x1234, 0xABCD]]]), [0, 1], 65536)
    buf = _v1_frame(r16, "bitpack", bytes([0x34, 0xCD, 0x12, 0xAB]))
    with pytest.raises(RouteFormatError, match="16-bit ids"):
        decode(buf)
    assert decode(buf, legacy_bitpack="planes") == r16
    assert decode(encode(r16, "bitpack")) == r16


def test_v1_layouts_that_never_changed_still_decode_and_unknown_v1_codecs_refuse(custom_codecs):
    r = random_routes(np.random.default_rng(3), num_experts=256, top_k=4, num_layers=2, lengths=[5, 3])
    for codec in sorted(PIPELINES):  # 8-bit ids: every version 1 layout is today's
        buf = encode(r, codec)
        v1 = _reframe(buf, version=1)
        want = r.sorted_rows() if codec.startswith("topk-") else r
        assert decode(v1) == want and read_header(v1)["format_version"] == 1
    for spec, cid in (("test-u32", "test-u32"), ("raw+test-xor", "test-xor")):  # registered now, not in version 1
        buf = encode(r, spec)
        assert decode(buf) == r
        with pytest.raises(RouteFormatError, match=f"format version 1 .* codec '{cid}', which version 1 did not have"):
            decode(_reframe(buf, version=1))
    with pytest.raises(RouteFormatError, match="legacy_bitpack must be one of"):
        decode(encode(r, "raw"), legacy_bitpack="planez")


# ---- bit order, against bytes written out by hand from the BitPack docstring ---------------------

BIT_ORDER = {
    # 4 bits: two ids per byte, the first in the low nibble. 10 ids: a group of 8 plus a tail of 2.
    16: ([[1, 2], [3, 15], [0, 10], [7, 8], [4, 5]], "21 f3 a0 87 54"),
    # 9 bits: id i holds stream bits [9i, 9i+9). 1 -> bit 0; 256 -> bit 17; 511 -> bits 18..26;
    # 300 = 0b100101100 -> bits 38 39 41 44; 5 -> 45 47; 2 -> 55; 3 -> 63 64; 341 -> 72 74 76 78 80;
    # 170 -> 82 84 86 88. Bytes: 01 | 00 | bits 17..23 = fe | 24..26 = 07 | 38 39 = c0 | 41 44 45 47 = b2 | 55 = 80
    # | 63 = 80 | 64 = 01 | 72..78 = 55 | 80..86 = 55 | 88 = 01.
    512: ([[1, 256], [511, 0], [300, 5], [2, 3], [341, 170]], "01 00 fe 07 c0 b2 80 80 01 55 55 01"),
    # 16 bits: each id a little-endian uint16.
    65536: (
        [[0x1234, 0xABCD], [0, 65535], [1, 256], [0x0F0F, 0xF0F0], [7, 0x8000]],
        "34 12 cd ab 00 00 ff ff 01 00 00 01 0f 0f f0 f0 07 00 00 80",
    ),
}


@pytest.mark.parametrize("E", sorted(BIT_ORDER))
def test_bitpack_bit_order_by_hand(E):
    rows, hexbytes = BIT_ORDER[E]
    want = bytes.fromhex(hexbytes)
    r = Routes(np.array(rows)[:, None, :], [0, len(rows)], E)
    assert BitPack().encode(r.values, E) == want
    buf = encode(r, "bitpack")
    h = read_header(buf)
    assert buf[h["_payload_offset"] : h["_payload_offset"] + h["_payload_length"]] == want
    assert decode(buf) == r
    assert decode(_reframe(buf, payload=want)) == r


# ---- numcodecs-style registry and interfaces ----------------------------------------------------

#: the pipeline table r3lab 0.1 kept as a second registry (ALIASES), written out as it was: the oracle of what
#: each built-in pipeline name means (the golden files were written from it)
ALIASES_0_1 = {
    "raw": [{"id": "raw", "order": "token"}],
    "bitpack": [{"id": "bitpack", "order": "token"}],
    "topk-set": [{"id": "topk-set", "order": "token"}],
    "raw+zstd": [{"id": "raw", "order": "layer"}, {"id": "zstd", "level": 3}],
    "bitpack+zstd": [{"id": "bitpack", "order": "layer"}, {"id": "zstd", "level": 3}],
    "topk-set+zstd": [{"id": "topk-set", "order": "layer"}, {"id": "zstd", "level": 3}],
    "topk-gaps+zstd": [{"id": "topk-gaps", "order": "layer"}, {"id": "zstd", "level": 3}],
}


def test_pipeline_names_resolve_as_the_former_alias_table_did():
    from r3lab.compaction.codecs import pipeline_configs

    assert list(PIPELINES) == list(ALIASES_0_1)
    for name, configs in ALIASES_0_1.items():
        assert pipeline_configs(name) == configs, name
    assert pipeline_configs("topk-gaps") == [{"id": "topk-gaps", "order": "layer"}]
    r = random_routes(np.random.default_rng(5), num_experts=40, top_k=3, num_layers=2, lengths=[4, 3])
    for name, configs in ALIASES_0_1.items():  # a name and its configs write the same bytes
        assert encode(r, name) == encode(r, configs), name


def test_former_names_are_deprecated_but_still_work():
    import r3lab.compaction as compaction
    import r3lab.compaction.codecs as codecs
    from r3lab.compaction.codecs import IdCodec, TopKGaps

    for module in (compaction, codecs):
        with pytest.warns(DeprecationWarning, match=r"IdCoder is deprecated .* use IdCodec"):
            assert module.IdCoder is IdCodec
        with pytest.warns(DeprecationWarning, match=r"SetGaps is deprecated .* use TopKGaps"):
            assert module.SetGaps is TopKGaps
        with pytest.warns(DeprecationWarning, match=r"ALIASES is deprecated .* use PIPELINES"):
            assert module.ALIASES == ALIASES_0_1
        with pytest.raises(AttributeError, match="no attribute 'Nope'"):
            module.Nope  # noqa: B018
    with pytest.warns(DeprecationWarning):
        from r3lab.compaction import IdCoder  # noqa: F401 - the import statement of 0.1 still works


def test_codec_interfaces_names():
    from r3lab.compaction.codecs import ByteCodec, Codec, IdCodec, RowCodec, TopKGaps

    assert TopKGaps.codec_id == "topk-gaps"
    for cls in (Raw, BitPack, TopKSet):
        assert issubclass(cls, RowCodec) and issubclass(cls, IdCodec)
    assert issubclass(TopKGaps, IdCodec) and issubclass(Zstd, ByteCodec) and not issubclass(Zstd, IdCodec)
    for abstract in (IdCodec, ByteCodec, RowCodec):
        with pytest.raises(TypeError, match="abstract"):
            abstract()
    # encode/decode signatures belong to the kinds: the shared base fixes none (register_codec refuses it)
    assert not hasattr(Codec, "encode") and not hasattr(Codec, "decode")
    assert list(inspect.signature(IdCodec.decode).parameters) == ["self", "buf", "shape", "dtype", "num_experts"]
    assert list(inspect.signature(ByteCodec.decode).parameters) == ["self", "buf", "expected_size"]
    assert get_codec("zstd") == Zstd() and get_codec("topk-gaps") == TopKGaps() and get_codec(Raw()) == Raw()
    assert get_codec({"id": "bitpack", "order": "layer"}) == BitPack(order="layer")


@pytest.fixture
def custom_codecs():
    """Register a custom id codec and a custom byte codec for one test, then restore the registry."""
    from r3lab.compaction.codecs import CODECS, ByteCodec, RowCodec, register_codec

    before = dict(CODECS)

    @register_codec
    class U32(RowCodec):
        """Every id as a little-endian uint32, plus a constant offset (a parameter in the config)."""

        codec_id = "test-u32"

        def __init__(self, order="token", offset=0):
            super().__init__(order)
            self.offset = offset

        def _params(self):
            return {**super()._params(), "offset": self.offset}

        def _rows_size(self, n_rows, top_k, dtype, num_experts):
            return 4 * n_rows * top_k

        def _encode_rows(self, rows, num_experts):
            return (rows.astype("<u4") + self.offset).tobytes()

        def _decode_rows(self, buf, n_rows, top_k, dtype, num_experts):
            self._check_size(buf, n_rows, top_k, dtype, num_experts)
            return (np.frombuffer(buf, "<u4") - self.offset).astype(dtype).reshape(n_rows, top_k)

    @register_codec
    class Xor(ByteCodec):
        codec_id = "test-xor"

        def __init__(self, key=0x5A):
            self.key = key

        def _params(self):
            return {"key": self.key}

        def encode(self, data):
            return (np.frombuffer(data, np.uint8) ^ self.key).tobytes()

        def decode(self, buf, expected_size):
            if len(buf) != expected_size:
                raise RouteFormatError(f"test-xor holds {len(buf)} bytes, expected {expected_size}")
            return memoryview(self.encode(buf))

    yield U32, Xor
    CODECS.clear()
    CODECS.update(before)


def test_register_custom_codecs_and_round_trip_by_name(custom_codecs):
    U32, Xor = custom_codecs
    r = random_routes(np.random.default_rng(11), num_experts=300, top_k=3, num_layers=2, lengths=[4, 0, 2])
    specs = ["test-u32", "test-u32+zstd", "test-u32+test-xor", "raw+test-xor", [U32(order="layer", offset=7), Xor(3)]]
    for spec in specs:
        buf = encode(r, spec)
        assert decode(buf) == r, spec
    buf = encode(r, [{"id": "test-u32", "offset": 1000}, {"id": "test-xor", "key": 1}])
    want_config = [{"id": "test-u32", "order": "token", "offset": 1000}, {"id": "test-xor", "key": 1}]
    assert read_header(buf)["codec"] == want_config
    assert decode(buf) == r
    h = read_header(buf)
    assert len(buf) - h["_payload_offset"] - 4 == 4 * r.values.size  # really the custom layout
    assert get_codec("test-u32") == U32() and get_codec({"id": "test-xor", "key": 9}) == Xor(9)
    with pytest.raises(RouteFormatError, match="starts with an id codec"):
        encode(r, [Xor()])
    with pytest.raises(RouteFormatError, match="'raw' cannot follow an id codec"):
        encode(r, [U32(), Raw()])
    with pytest.raises(RouteFormatError, match="unknown codec 'test-u32\\+lz4'"):
        encode(r, "test-u32+lz4")


def test_register_codec_refuses_what_it_cannot_register(custom_codecs):
    from r3lab.compaction.codecs import CODECS, ByteCodec, Codec, register_codec
    from r3lab.errors import ConfigError

    U32, _ = custom_codecs
    with pytest.raises(ConfigError, match="subclass of IdCodec or ByteCodec"):
        register_codec(int)
    with pytest.raises(ConfigError, match="subclass of IdCodec or ByteCodec"):
        register_codec(type("Bare", (Codec,), {"codec_id": "bare"}))

    class NoId(ByteCodec):
        encode = decode = None

    with pytest.raises(ConfigError, match="must define its own codec_id"):
        register_codec(NoId)
    with pytest.raises(ConfigError, match="without '\\+'"):
        register_codec(type("Plus", (NoId,), {"codec_id": "a+b"}))
    with pytest.raises(ConfigError, match="'raw' is already registered to r3lab.compaction.codecs.raw.Raw"):
        register_codec(type("MyRaw", (U32,), {"codec_id": "raw"}))
    assert register_codec(U32) is U32  # registering the same class again is a no-op
    mine = type("MyU32", (U32,), {"codec_id": "test-u32"})
    assert register_codec(mine, replace=True) is mine and CODECS["test-u32"] is mine


# ---- make_golden.py only ever adds files ---------------------------------------------------------

def test_make_golden_never_overwrites(tmp_path):
    mg = _make_golden()
    folder = tmp_path / "v2"
    first = mg.write_golden(folder)
    assert first["differ"] == [] and first["kept"] == [] and len(first["written"]) == 4 * (len(PIPELINES) + 2)
    for fname in first["written"]:  # what it writes is what is committed
        if fname.endswith(".r3"):
            assert _parts((folder / fname).read_bytes()) == _parts((V2 / fname).read_bytes()), fname
        elif fname.endswith(".json"):
            assert (folder / fname).read_bytes() == (V2 / fname).read_bytes(), fname
    again = mg.write_golden(folder)
    assert again["written"] == [] and sorted(again["kept"]) == sorted(first["written"])
    victim = folder / "e64k8.bitpack.r3"
    victim.write_bytes(b"changed meaning")
    third = mg.write_golden(folder)
    assert third["differ"] == ["e64k8.bitpack.r3"] and victim.read_bytes() == b"changed meaning"


def test_make_golden_script_adds_nothing_to_a_complete_folder_and_refuses_a_changed_one(tmp_path):
    """Run as a script on a copy of the committed v2 folder: nothing written; a file whose bytes now differ
    makes it exit 1 and stay as it was."""
    import os
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "v2"
    shutil.copytree(V2, folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    cmd = [sys.executable, str(FIXTURES / "make_golden.py"), str(folder)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert "written" not in res.stdout and res.stdout.count("kept") == len(before) - 1  # all but written-with.json
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    (folder / "e16k3.raw.r3").write_bytes(b"other bytes")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode == 1 and "REFUSED" in res.stderr and "differ   v2/e16k3.raw.r3" in res.stdout
    assert (folder / "e16k3.raw.r3").read_bytes() == b"other bytes"


def test_measure_codecs_reports_the_real_sizes_beside_the_json_baseline():
    import orjson

    from r3lab.compaction import BASELINE, encode, measure_codecs, to_payload
    from r3lab.testing import random_routes

    r = random_routes(np.random.default_rng(7), num_experts=64, top_k=8, num_layers=3, lengths=[40, 25])
    recs = measure_codecs(r, ["bitpack", "topk-set+zstd"], repeats=2, label="mine")
    assert [x["codec"] for x in recs] == [BASELINE, "bitpack", "topk-set+zstd"]
    assert recs[0]["bytes"] == len(orjson.dumps(to_payload(r))) and recs[0]["ratio_to_baseline"] == 1.0
    assert recs[2]["bytes"] == len(encode(r, "topk-set+zstd")) and recs[2]["ids"] == r.values.size
    assert recs[1]["ratio_to_baseline"] == pytest.approx(recs[0]["bytes"] / recs[1]["bytes"])
    assert all(x["routes"] == "mine" and x["encode_ms"] > 0 and x["mids_per_s"] > 0 for x in recs)
    with pytest.raises(RouteFormatError, match="repeats"):
        measure_codecs(r, repeats=0)

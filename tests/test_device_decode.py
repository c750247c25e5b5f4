"""Routes decoded into device memory by torch operations (r3lab.staging.device_decode) equal the host decode.

The oracle is :func:`r3lab.compaction.decode` (numpy and numba loops on the host): for every codec with a device
kernel (raw and bitpack in token and layer order, topk-gaps) the device decode gives the same ids bit for bit, in the
same dtype and shape, over id widths that cross byte boundaries (1 to 16 bits), one token, no token, step sizes that
cut bit groups, the golden fixtures of every format version, and routing weights in all three dtypes; malformed
buffers fail with the host decode's own message; a codec without a kernel is refused unless the host may decode it.
The kernels run here on CPU tensors; on a machine with CUDA the same checks run on the GPU too (on a machine without,
those cases are reported as skipped).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3lab.compaction import decode, encode, read_header
from r3lab.compaction.codecs import id_bits
from r3lab.errors import ConfigError, RouteFormatError
from r3lab.routes import Routes
from r3lab.staging.device_decode import DEVICE_CODECS, decode_to_device
from r3lab.testing import random_routes

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="no CUDA device on this machine"))]
#: pipelines whose ids decode on the device, and what the host must do for each (a byte stage inflates there)
PIPES = {
    "raw": "frame", "bitpack": "frame", "topk-gaps": "frame",
    "raw+zstd": "byte-stages", "bitpack+zstd": "byte-stages", "topk-gaps+zstd": "byte-stages",
}
# ids of 1..16 bits: every width, and the neighbours of the byte boundaries (8 -> 9 bits switches uint8 -> uint16)
EXPERTS = [2, 3, 5, 9, 16, 17, 33, 64, 65, 128, 129, 255, 256, 257, 300, 513, 1025, 2049, 4097, 8193, 16385, 32769,
           65536]


def _routes(E: int, K: int, L: int, lengths, seed: int = 0, weights: bool = False) -> Routes:
    r = random_routes(np.random.default_rng(seed), num_experts=E, top_k=K, num_layers=L, lengths=lengths,
                      layer_ids=list(range(1, L + 1)))
    if weights:
        # signed, so bfloat16's sign bit is exercised (router weights are positive, the codec does not assume it)
        w = np.random.default_rng(seed + 1).standard_normal(r.values.shape).astype(np.float32)
        r = r.with_weights(w)
    return r


def _same(dev, host: Routes) -> None:
    """Bit equality of a device decode with the host decode (dtype, shape, ids, offsets, layers, weights)."""
    got = dev.values.cpu().numpy()
    assert got.dtype == host.values.dtype and got.shape == host.values.shape
    assert np.array_equal(got, host.values)
    assert np.array_equal(dev.cu_seqlens, host.cu_seqlens) and np.array_equal(dev.layer_ids, host.layer_ids)
    assert dev.num_experts == host.num_experts
    if host.weights is None:
        assert dev.weights is None
    else:
        w = dev.weights.cpu().numpy()
        assert w.dtype == np.float32 and np.array_equal(w.view(np.uint32), host.weights.view(np.uint32))


def _codec(name: str, order: str | None):
    """A pipeline spec: ``name`` with its id codec in ``order`` (None: the name's own)."""
    if order is None:
        return name
    first, *rest = name.split("+")
    return [{"id": first, "order": order}, *[{"id": r} for r in rest]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E", EXPERTS)
@pytest.mark.parametrize("pipe", sorted(PIPES))
def test_every_kernel_equals_the_host_decode_at_every_id_width(pipe, E, device):
    K = min(E, 3)
    r = _routes(E, K, 2, [5, 1, 0, 4])  # 10 tokens x 2 layers x 3 = 60 ids: not a multiple of 8
    for order in ((None, "token", "layer") if not pipe.startswith("topk-gaps") else (None,)):
        buf = encode(r, _codec(pipe, order))
        host = decode(buf)
        for chunk in (8, 16, 24, 1 << 20):  # steps of one bit group and more; the default bound
            dev = decode_to_device(buf, device, host=PIPES[pipe], chunk_ids=chunk)
            _same(dev, host)
            assert dev.values.device.type == device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pipe", sorted(PIPES))
@pytest.mark.parametrize(("E", "K", "L", "lengths"), [(64, 8, 3, [1]), (2, 2, 1, [1]), (65536, 4, 2, [1]),
                                                      (17, 5, 4, [0]), (300, 1, 1, [7]), (512, 22, 2, [3, 2])])
def test_edge_shapes(pipe, E, K, L, lengths, device):
    """One token, no token, top-1, top-k equal to E, the widest ids."""
    r = _routes(E, K, L, lengths, seed=3)
    buf = encode(r, pipe)
    _same(decode_to_device(buf, device, host=PIPES[pipe], chunk_ids=8), decode(buf))


@st.composite
def _route_sets(draw):
    E = draw(st.one_of(st.integers(2, 300), st.integers(257, 65536)))
    K = draw(st.integers(1, min(12, E)))
    L = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 17), min_size=1, max_size=4))
    return _routes(E, K, L, lengths, seed=draw(st.integers(0, 2**31)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_route_sets(), st.sampled_from(sorted(PIPES)), st.sampled_from([None, "token", "layer"]),
       st.sampled_from([8, 16, 40, 1 << 20]))
def test_property_device_decode_is_the_host_decode(routes, pipe, order, chunk):
    if pipe.startswith("topk-gaps"):
        order = None  # always layer-major
    buf = encode(routes, _codec(pipe, order))
    _same(decode_to_device(buf, "cpu", host=PIPES[pipe], chunk_ids=chunk), decode(buf))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("pipe", sorted(PIPES))
def test_routing_weights_equal_the_host_decode(pipe, dtype):
    """Format version 3: the weights block decodes on the device and follows each row's decoded id order (sorted
    rows for topk-gaps, the stored order otherwise), bit for bit in float32."""
    r = _routes(300, 6, 3, [4, 9], seed=5, weights=True)
    buf = encode(r, pipe, weights=dtype)
    host = decode(buf)
    assert host.weights is not None and (host.weights < 0).any()
    _same(decode_to_device(buf, "cpu", host=PIPES[pipe], chunk_ids=16), host)


def _fixtures():
    out = []
    for path in sorted(FIXTURES.rglob("*.r3")):
        name = path.name.split(".")[1]
        if name.split("+")[0] in DEVICE_CODECS:
            out.append(path)
    return out


@pytest.mark.parametrize("path", _fixtures(), ids=lambda p: str(p.relative_to(FIXTURES)))
def test_golden_fixtures_of_every_version_decode_the_same(path):
    buf = path.read_bytes()
    h = read_header(buf)
    host_work = "byte-stages" if len(h["codec"]) > 1 else "frame"
    wide_v1_bitpack = h["format_version"] == 1 and h["codec"][0]["id"] == "bitpack" and id_bits(h["num_experts"]) > 8
    if wide_v1_bitpack:  # ambiguous without the writer's name: refused on the device exactly as on the host
        with pytest.raises(RouteFormatError, match="ambiguous"):
            decode_to_device(buf, "cpu", host=host_work)
        if path.parent.name != "v1-cf15985":  # one bit stream, today's layout: the device kernel reads it
            _same(decode_to_device(buf, "cpu", host=host_work, legacy_bitpack="stream"),
                  decode(buf, legacy_bitpack="stream"))
            return
        with pytest.raises(ConfigError, match="BitPackPlanesV1.*no device kernel"):
            decode_to_device(buf, "cpu", host=host_work, legacy_bitpack="planes")
        planes = decode_to_device(buf, "cpu", host="all", legacy_bitpack="planes")
        _same(planes, decode(buf, legacy_bitpack="planes"))
        assert planes.stages[-1] == ("copy", "cpu")
        return
    _same(decode_to_device(buf, "cpu", host=host_work, chunk_ids=64), decode(buf))


def test_index_dtype_widens_and_refuses_a_dtype_too_narrow():
    r = _routes(300, 4, 2, [6])
    buf = encode(r, "bitpack")
    wide = decode_to_device(buf, "cpu", index_dtype=torch.int64)
    assert wide.values.dtype == torch.int64 and np.array_equal(wide.values.numpy(), r.values.astype(np.int64))
    with pytest.raises(ConfigError, match="cannot hold expert id 299"):
        decode_to_device(buf, "cpu", index_dtype=torch.int8)
    with pytest.raises(ConfigError, match="integer torch dtype"):
        decode_to_device(buf, "cpu", index_dtype=torch.float32)
    small = decode_to_device(encode(_routes(100, 4, 2, [6]), "raw"), "cpu", index_dtype=torch.int8)
    assert small.values.dtype == torch.int8


def test_codecs_without_a_kernel_are_refused_unless_the_host_may_decode_them():
    r = _routes(64, 8, 2, [5, 3])
    for pipe in ("topk-set", "topk-set+zstd"):
        buf = encode(r, pipe)
        with pytest.raises(ConfigError) as e:
            decode_to_device(buf, "cpu", host="byte-stages")
        assert "'topk-set'" in str(e.value) and "no device kernel" in str(e.value) and "host='all'" in str(e.value)
        dev = decode_to_device(buf, "cpu", host="all", index_dtype=torch.int64)
        assert np.array_equal(dev.values.numpy(), decode(buf).values)
        assert dev.stages[0] == ("frame", "host") and dev.stages[-2:] == (("topk-set", "host"), ("copy", "cpu"))
    buf = encode(r, "bitpack+zstd")
    with pytest.raises(ConfigError, match="byte stage 'zstd' has no device kernel.*host='byte-stages'"):
        decode_to_device(buf, "cpu")
    dev = decode_to_device(buf, "cpu", host="byte-stages")
    assert dev.stages == (("frame", "host"), ("zstd", "host"), ("bitpack", "cpu"))
    assert decode_to_device(encode(r, "raw"), "cpu").stages == (("frame", "host"), ("raw", "cpu"))
    with pytest.raises(ConfigError, match="host must be one of"):
        decode_to_device(buf, "cpu", host="gpu")
    with pytest.raises(ConfigError, match="chunk_ids"):
        decode_to_device(buf, "cpu", host="all", chunk_ids=4)
    with pytest.raises(RouteFormatError, match="legacy_bitpack must be one of"):
        decode_to_device(buf, "cpu", host="all", legacy_bitpack="guess")


def test_input_forms_and_a_device_tensor_refused():
    r = _routes(16, 2, 2, [3, 2])
    buf = encode(r, "bitpack")
    host = decode(buf)
    for form in (bytearray(buf), memoryview(buf), np.frombuffer(buf, np.uint8), torch.frombuffer(bytearray(buf),
                                                                                               dtype=torch.uint8)):
        _same(decode_to_device(form, "cpu"), host)
    with pytest.raises(ConfigError, match="frame on the host.*meta"):
        decode_to_device(torch.empty(len(buf), dtype=torch.uint8, device="meta"), "cpu")


def _frame_with_payload(buf: bytes, payload: bytes) -> bytes:
    """``buf`` with its payload replaced (same length) and the CRC-32 made right, so only the row check can fire."""
    import zlib

    h = read_header(buf)
    start = h["_payload_offset"]
    body = buf[:start] + payload + buf[start + len(payload) : -4]
    return body + zlib.crc32(body).to_bytes(4, "little")


def _host_error(buf: bytes) -> str:
    with pytest.raises(RouteFormatError) as e:
        decode(buf)
    return str(e.value)


@pytest.mark.parametrize("order", ["token", "layer"])
@pytest.mark.parametrize("E", [20, 300])
def test_bad_rows_fail_with_the_host_message(order, E):
    """An id out of range, or repeated inside a row, is found on the device and reported as the host reports it:
    the first bad row in token-major order (in a layer-major payload too), its token, layer and ids."""
    from r3lab.compaction.kernels import pack_ids

    r = _routes(E, 3, 3, [4, 4], seed=2)
    beyond = 2 ** id_bits(E) - 1  # out of range, yet it fits the id width of both codecs (20: 5 bits; 300: 9)
    assert beyond >= E
    cases = {"repeated": (5, 1, [7, 7, 1]), "out of range": (6, 0, [2, beyond, 1])}
    for what, (tok, layer, row) in cases.items():
        bad = r.values.copy()
        bad[tok, layer] = row
        bad[tok + 1, 0] = [3, 3, 3]  # a later bad row (in layer-major order it comes first when layer > 0)
        stored = np.ascontiguousarray(bad.transpose(1, 0, 2) if order == "layer" else bad)
        for codec in ("raw", "bitpack"):
            if codec == "raw":
                payload = stored.astype(r.values.dtype.newbyteorder("<")).tobytes()
            else:
                payload = pack_ids(stored.reshape(-1), id_bits(E))
            buf = _frame_with_payload(encode(r, _codec(codec, order)), payload)
            message = _host_error(buf)
            assert ("repeated" in message) == (what == "repeated") and f"token {tok}," in message, message
            with pytest.raises(RouteFormatError) as e:
                decode_to_device(buf, "cpu", chunk_ids=8)
            assert str(e.value) == message


def test_topk_gaps_refusals_are_the_host_ones():
    r = _routes(16, 3, 3, [5], seed=4)
    buf = encode(r, "topk-gaps")
    h = read_header(buf)
    payload = bytearray(buf[h["_payload_offset"] : h["_payload_offset"] + h["_payload_length"]])
    not_perm = bytearray(payload)
    not_perm[16 + 2] = not_perm[16 + 3]  # layer 1's relabelling repeats an expert
    too_far = bytearray(payload)
    too_far[3 * 16 + 2 * 5 * 3 + 0] = 200  # layer 2, slot 0, token 0: a gap past the last expert
    for bad in (not_perm, too_far):
        frame = _frame_with_payload(buf, bytes(bad))
        message = _host_error(frame)
        with pytest.raises(RouteFormatError) as e:
            decode_to_device(frame, "cpu", chunk_ids=8)
        assert str(e.value) == message, (str(e.value), message)


def test_corrupt_frames_fail_before_any_device_work():
    buf = bytearray(encode(_routes(16, 2, 2, [3]), "raw"))
    buf[-10] ^= 0xFF
    with pytest.raises(RouteFormatError, match="checksum mismatch"):
        decode_to_device(bytes(buf), "cpu")


def test_per_layer_views_replay_in_transformers_as_the_host_routes_do():
    """The device-decoded ids go to the transformers router replay as they are (``per_layer``): the same log-probs
    as replaying the host-decoded Routes."""
    from r3lab.paths import model_dir
    from r3lab.replay import hf_replay, load_hf_model

    model = load_hf_model(model_dir("tiny-qwen3-moe"))
    tokens = torch.randint(4, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), hf_replay(model, mode="record") as rec:
        model(input_ids=tokens)
    own = rec.to_routes()
    buf = encode(own, "bitpack")
    dev = decode_to_device(buf, "cpu", index_dtype=torch.int64)
    assert sorted(dev.per_layer()) == own.layer_ids.tolist()
    with torch.no_grad():
        with hf_replay(model, dev.per_layer()):
            a = model(input_ids=tokens).logits
        with hf_replay(model, decode(buf)):
            b = model(input_ids=tokens).logits
    assert torch.equal(a, b)


def test_module_imports_without_torch_and_asks_for_the_replay_extra():
    """The staging package stays torch-free: the module imports with torch refused, and decoding says which extra
    brings torch."""
    code = (
        "import sys, importlib.abc\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "from r3lab.staging import device_decode\n"
        "from r3lab.errors import MissingExtraError\n"
        "try:\n"
        "    device_decode.decode_to_device(b'', 'cpu')\n"
        "except MissingExtraError as e:\n"
        "    print('MISSING', e)\n"
        "assert 'torch' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "MISSING" in proc.stdout and "torch" in proc.stdout and "replay" in proc.stdout, proc.stdout


def test_benchmark_dry_run_says_where_it_ran_and_keeps_cpu_numbers_out_of_the_results(tmp_path):
    """bench/bench_device_decode.py without CUDA: its table says it measured CPU tensors, both paths bit-equal, and
    it refuses to write that table where the committed (GPU) results live."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    script = [sys.executable, str(ROOT / "bench" / "bench_device_decode.py"), "--dry-run"]
    committed = ROOT / "bench" / "results" / "device_decode.md"
    before = committed.read_bytes() if committed.exists() else None
    proc = subprocess.run([*script, "--out", str(committed)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and "refusing to write a CPU measurement" in proc.stderr, proc.stderr
    assert (committed.read_bytes() if committed.exists() else None) == before
    out = tmp_path / "table.md"
    proc = subprocess.run([*script, "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "on CPU tensors" in text and "NOT a GPU measurement" in text
    rows = [ln for ln in text.splitlines() if ln.startswith(("| raw ", "| bitpack "))]
    assert len(rows) == 2 and all(ln.rstrip().endswith("| yes |") for ln in rows), rows

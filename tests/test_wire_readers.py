"""The wire readers on responses shaped by the producers' source (issue 37, "And on the wire").

- vLLM: ``choices[i].routed_experts`` is base64 of ``np.save(..., allow_pickle=False)`` (vllm 0.30
  ``vllm/utils/serial_utils.py::numpy2base64``), ``|u1`` for at most 256 experts, ``<u2`` above; with
  ``--enable-omit-prefix-routed-experts`` (vLLM PR #57966, open) a turn's rows start at
  ``max(routed_experts_prompt_start, num_cached_tokens)`` and end at ``P + R - 1``.
- SGLang PR #31219 (open, revision a6463a10): ``encode_routed_experts_for_wire`` sends the configured uint8/uint16
  when every id fits and int32 otherwise (negative sentinels included), and names the dtype in
  ``meta_info["routed_experts_dtype"]``; ``routed_experts_start_len`` skips earlier rows (PR #24851).
- ``-1`` marks an uncaptured row (tunix #2046, NeMo-RL #3113).

Every expectation below is the numbers the generators put in, never what a reader returned.
"""

import base64
import io
from pathlib import Path

import numpy as np
import pytest

from r3lab.compaction import (
    read_sglang_base64_int32,
    read_sglang_meta_info,
    read_vllm_nested_list,
    read_vllm_npy_base64,
    stitch_turns,
    uncaptured_rows,
    vllm_turn_start,
)
from r3lab.errors import RolloutError, RouteFormatError
from r3lab.moe_layout import MoELayout
from r3lab.rollout import RolloutResult, assemble_turns, parse_completion
from r3lab.rollout.attach import CompletionsClient
from r3lab.routes import SENTINEL
from r3lab.testing import vllm_npy_base64

MODEL = Path(__file__).resolve().parents[1] / "data" / "models" / "tiny-qwen3-moe"
L, K, E = 8, 2, 16  # the shipped model's layout, checked in test_the_shipped_model_is_what_the_tests_assume


# ---- writers, restated from the producers' source ------------------------------------------------------------------

def sglang_wire(routes: np.ndarray, dtype_name: str) -> tuple[str, str]:
    """SGLang PR #31219's ``encode_routed_experts_for_wire``: flat row-major bytes in the configured dtype, or int32
    where an id (a negative sentinel too) does not fit it; returns (base64, the dtype actually sent)."""
    target = np.dtype(dtype_name)
    arr = np.asarray(routes, dtype=np.int32)
    if target.kind == "u" and arr.size and (arr.min() < 0 or arr.max() > np.iinfo(target).max):
        target = np.dtype(np.int32)
    return base64.b64encode(arr.astype(target).tobytes()).decode("utf-8"), target.name


def conversation(seed: int, lengths: list[tuple[int, int]]) -> np.ndarray:
    """Routes of a whole conversation (rows for every position the last turn feeds), distinct ids per row."""
    P, R = lengths[-1]
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((P + R - 1, L, E)), axis=2)[:, :, :K].astype(np.uint8)


def vllm_omit_prefix_turns(full: np.ndarray, lengths: list[tuple[int, int]], requested: list[int],
                           cached: list[int]) -> list[tuple[int, np.ndarray]]:
    """What a prefix-omitting vLLM returns per turn: rows [max(requested, cached), P + R - 1) of the conversation."""
    out = []
    for (P, R), req, c in zip(lengths, requested, cached, strict=True):
        start = max(req, c)
        out.append((start, full[start : P + R - 1]))
    return out


def test_the_shipped_model_is_what_the_tests_assume():
    lay = MoELayout.from_model_dir(MODEL)
    assert (lay.num_hidden_layers, lay.top_k, lay.num_experts) == (L, K, E)
    assert list(lay.moe_layer_ids) == list(range(L))


def test_sentinel_is_the_importers_sentinel():
    assert SENTINEL == -1


# ---- vLLM .npy: uint8 / uint16 kept as sent, -1 rows kept signed ----------------------------------------------------

def test_vllm_npy_keeps_the_wire_dtype():
    small = np.arange(24, dtype=np.uint8).reshape(4, 3, 2) + 230  # ids up to 253: uint8, no sign
    got = read_vllm_npy_base64(vllm_npy_base64(small))
    assert got.dtype == np.uint8 and got.tolist() == small.tolist()
    assert not uncaptured_rows(got).any()  # 255-ish ids in an unsigned wire are ids, never "uncaptured"
    wide = (np.arange(24, dtype=np.uint16) * 20 + 300).reshape(4, 3, 2)  # 300..760: a >256-expert model
    got = read_vllm_npy_base64(vllm_npy_base64(wide))
    assert got.dtype == np.dtype("<u2") and got.tolist() == wide.tolist()


def test_vllm_npy_keeps_uncaptured_rows_signed():
    arr = np.arange(24, dtype=np.int16).reshape(4, 3, 2)
    arr[2] = SENTINEL
    got = read_vllm_npy_base64(vllm_npy_base64(arr))
    assert got.dtype == np.int16 and got[2].tolist() == [[-1, -1]] * 3
    assert uncaptured_rows(got).tolist() == [False, False, True, False]


def test_vllm_npy_refuses_mixed_and_negative_rows_and_negative_shapes():
    arr = np.arange(24, dtype=np.int16).reshape(4, 3, 2)
    arr[1, 2, 0] = SENTINEL
    with pytest.raises(RouteFormatError, match=r"row 1 mixes the uncaptured mark -1 \(layer 2, slot 0\)"):
        read_vllm_npy_base64(vllm_npy_base64(arr))
    arr[1, 2, 0] = -2
    with pytest.raises(RouteFormatError, match="negative expert id -2 at row 1, layer 2, slot 0"):
        read_vllm_npy_base64(vllm_npy_base64(arr))
    buf = io.BytesIO()  # a header written by numpy's own writer, with a negative dim
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": (-1, 3, 2)})
    with pytest.raises(RouteFormatError, match="negative dim"):
        read_vllm_npy_base64(base64.b64encode(buf.getvalue()))
    with pytest.raises(RouteFormatError, match="bad base64"):
        read_vllm_npy_base64("k!!=")


def test_nested_list_and_sglang_int32_keep_and_refuse_sentinels():
    nested = [[[1, 2], [0, 3]], [[-1, -1], [-1, -1]], [[2, 3], [1, 0]]]
    got = read_vllm_nested_list(nested)
    assert got.tolist() == nested and uncaptured_rows(got).tolist() == [False, True, False]
    with pytest.raises(RouteFormatError, match="row 0 mixes"):
        read_vllm_nested_list([[[1, -1], [0, 3]]])
    flat = np.array(nested, dtype="<i4").ravel()
    got = read_sglang_base64_int32(base64.b64encode(flat.tobytes()).decode(), num_layers=2, top_k=2)
    assert got.tolist() == nested
    flat[1] = -1
    with pytest.raises(RouteFormatError, match="row 0 mixes"):
        read_sglang_base64_int32(base64.b64encode(flat.tobytes()).decode(), num_layers=2, top_k=2)


# ---- SGLang PR #31219: routed_experts_dtype in meta_info -----------------------------------------------------------

@pytest.mark.parametrize("name, top, itemsize", [("uint8", 255, 1), ("uint16", 65535, 2), ("int32", 70000, 4)])
def test_sglang_meta_info_reads_each_wire_dtype(name, top, itemsize):
    routes = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
    routes[1, 2, 1] = top
    data, sent = sglang_wire(routes, name)
    assert sent == name and len(base64.b64decode(data)) == routes.size * itemsize
    got = read_sglang_meta_info({"routed_experts": data, "routed_experts_dtype": sent}, num_layers=3, top_k=2)
    assert got.dtype == np.dtype(name) and got.tolist() == routes.tolist()


def test_sglang_meta_info_legacy_and_sentinel_fall_back_to_int32():
    routes = np.array([[[1, 255]], [[-1, -1]], [[3, 4]]], dtype=np.int32)
    data, sent = sglang_wire(routes, "uint8")  # -1 does not fit uint8: the sender falls back to int32
    assert sent == "int32"
    got = read_sglang_meta_info({"routed_experts": data, "routed_experts_dtype": sent}, num_layers=1, top_k=2)
    assert got.tolist() == routes.tolist() and uncaptured_rows(got).tolist() == [False, True, False]
    legacy = base64.b64encode(np.array([[[1, 2]], [[3, 4]]], dtype="<i4").tobytes()).decode()
    for meta in ({"routed_experts": legacy}, {"routed_experts": legacy, "routed_experts_dtype": None}):
        assert read_sglang_meta_info(meta, num_layers=1, top_k=2).tolist() == [[[1, 2]], [[3, 4]]]
    # SGLang's decoder matches the name after strip().lower(); so does the reader
    data, _ = sglang_wire(np.array([[[7, 9]]]), "uint8")
    assert read_sglang_meta_info({"routed_experts": data, "routed_experts_dtype": " UINT8 "}, num_layers=1,
                                 top_k=2).tolist() == [[[7, 9]]]


def test_sglang_meta_info_start_len_and_row_count():
    P, R, start = 6, 3, 4  # a later turn that asked for rows [4, 8)
    full = conversation(1, [(P, R)])
    data, sent = sglang_wire(full[start:], "uint8")
    meta = {"routed_experts": data, "routed_experts_dtype": sent}
    got = read_sglang_meta_info(meta, num_layers=L, top_k=K, start_len=start, prompt_len=P, response_len=R)
    assert got.tolist() == full[start:].tolist()
    with pytest.raises(RouteFormatError, match="4 rows; expected 5"):
        read_sglang_meta_info(meta, num_layers=L, top_k=K, start_len=start - 1, prompt_len=P, response_len=R)
    with pytest.raises(RouteFormatError, match="meta_info says routed_experts_start_len=4, the request sent 0"):
        read_sglang_meta_info(dict(meta, routed_experts_start_len=4), num_layers=L, top_k=K)
    with pytest.raises(RouteFormatError, match="outside \\[0, 6\\]"):
        read_sglang_meta_info(meta, num_layers=L, top_k=K, start_len=7, prompt_len=P, response_len=R + 5)


@pytest.mark.parametrize("meta, message", [
    ({"routed_experts": "AAAA", "routed_experts_dtype": "float32"}, "unknown routed_experts_dtype 'float32'"),
    ({"routed_experts": "AAAA", "routed_experts_dtype": ""}, "unknown routed_experts_dtype ''"),
    ({"routed_experts": "AAAA", "routed_experts_dtype": 8}, "unknown routed_experts_dtype 8"),
    ({"routed_experts": "AAAA", "routed_experts_dtype": "int64"}, "unknown routed_experts_dtype 'int64'"),
    ({"routed_experts": "A!!A", "routed_experts_dtype": "uint8"}, "bad base64"),
    ({"routed_experts": base64.b64encode(bytes(5)).decode(), "routed_experts_dtype": "uint16"},
     r"5 bytes is not a whole number of \[1, 2\] uint16 rows"),
    ({"routed_experts": base64.b64encode(bytes(6)).decode()}, r"6 bytes is not a whole number of \[1, 2\] int32"),
    ({"routed_experts_dtype": "uint8"}, "no routed_experts"),
    ("not a dict", "meta_info must be an object"),
])
def test_sglang_meta_info_refuses_malformed(meta, message):
    with pytest.raises(RouteFormatError, match=message):
        read_sglang_meta_info(meta, num_layers=1, top_k=2)


def test_sglang_meta_info_refuses_bad_dims_and_mixed_rows():
    data, sent = sglang_wire(np.array([[[1, 2]]]), "uint8")
    with pytest.raises(RouteFormatError, match="negative"):
        read_sglang_meta_info({"routed_experts": data}, num_layers=-1, top_k=2)
    with pytest.raises(RouteFormatError, match=">= 1"):
        read_sglang_meta_info({"routed_experts": data}, num_layers=0, top_k=2)
    with pytest.raises(RouteFormatError, match="start_len must be a non-negative integer"):
        read_sglang_meta_info({"routed_experts": data, "routed_experts_dtype": sent}, num_layers=1, top_k=2,
                              start_len=-1)
    data, sent = sglang_wire(np.array([[[1, -1]]]), "uint8")
    assert sent == "int32"
    with pytest.raises(RouteFormatError, match="row 0 mixes the uncaptured mark -1"):
        read_sglang_meta_info({"routed_experts": data, "routed_experts_dtype": sent}, num_layers=1, top_k=2)


# ---- stitching turns ------------------------------------------------------------------------------------------------

LENGTHS = [(5, 4), (12, 3), (20, 6)]  # (P_j, R_j): each turn's prompt is the previous tokens plus an observation


def test_stitch_prefix_omitted_turns_gives_the_whole_conversation():
    full = conversation(0, LENGTHS)
    held = [0, 5 + 4 - 1, 12 + 3 - 1]  # the client asks for the rows it does not hold
    cached = [0, 8, 13]  # vLLM's cached prefix (full blocks of 4 or so): at most the rows held
    turns = vllm_omit_prefix_turns(full, LENGTHS, held, cached)
    assert [s for s, _ in turns] == [0, 8, 14]
    got = stitch_turns(turns, total_rows=20 + 6 - 1)
    assert got.dtype == np.uint8 and got.tolist() == full.tolist()
    # the start each turn's row count implies is the one the server used
    for (P, R), (s, a) in zip(LENGTHS, turns, strict=True):
        assert vllm_turn_start(len(a), prompt_len=P, response_len=R) == s


def test_stitch_overlap_that_agrees_is_kept_and_one_that_disagrees_is_refused():
    full = conversation(2, LENGTHS)
    turns = vllm_omit_prefix_turns(full, LENGTHS, [0, 0, 0], [0, 4, 12])  # starts 0, 4, 12: overlaps held rows
    assert stitch_turns(turns).tolist() == full.tolist()
    s, a = turns[2]
    changed = a.copy()
    other = next(e for e in range(E) if e not in a[1, 5])  # row 13 = turn 2's second row: one expert swapped
    changed[1, 5, 0] = other
    bad = [turns[0], turns[1], (s, changed)]
    with pytest.raises(RouteFormatError, match=r"turn 2 overlaps the held rows \[12, 14\) and disagrees at row 13, "
                                               r"layer 5"):
        stitch_turns(bad)
    # the same order inside top-k is not required: a row is its expert set
    swapped = a.copy()
    swapped[0] = swapped[0, :, ::-1]
    assert stitch_turns([turns[0], turns[1], (s, swapped)]).tolist() == full.tolist()
    kept = stitch_turns(bad, overlap="keep")
    assert kept.tolist() == full.tolist()
    replaced = stitch_turns(bad, overlap="replace")
    assert replaced[13].tolist() == changed[1].tolist() and replaced[12].tolist() == full[12].tolist()


def test_stitch_refuses_a_gap_naming_turn_and_rows():
    full = conversation(3, LENGTHS)
    turns = vllm_omit_prefix_turns(full, LENGTHS, [0, 8, 14], [0, 8, 16])  # cache past the rows the client holds
    with pytest.raises(RouteFormatError, match=r"turn 2 starts at row 16, but 14 rows are held: rows \[14, 16\)"):
        stitch_turns(turns)
    with pytest.raises(RouteFormatError, match="turn 0 starts at row 3, but no rows are held"):
        stitch_turns([(3, full[3:8])])


def test_stitch_fills_uncaptured_rows_and_checks_shapes():
    full = conversation(4, LENGTHS).astype(np.int16)
    first = full[:8].copy()
    first[6] = SENTINEL  # turn 0 did not capture row 6; turn 1 re-reads it in its prefill
    got = stitch_turns([(0, first), (4, full[4:14])])
    assert got.tolist() == full[:14].tolist()
    assert uncaptured_rows(stitch_turns([(0, first)])).tolist() == [False] * 6 + [True, False]
    with pytest.raises(RouteFormatError, match=r"turn 1: routes of \[layers, top_k\] \[7, 2\]"):
        stitch_turns([(0, full[:8]), (8, full[8:14, :7])])
    with pytest.raises(RouteFormatError, match="the turns hold 14 rows, the conversation needs 25"):
        stitch_turns([(0, full[:8]), (8, full[8:14])], total_rows=25)
    with pytest.raises(RouteFormatError, match="turn 0: routes must be an integer"):
        stitch_turns([(0, full[:8].astype(np.float32))])
    with pytest.raises(RouteFormatError, match="turn 1: start row must be a non-negative integer"):
        stitch_turns([(0, full[:8]), (-1, full[:8])])
    mixed = full[:8].copy()
    mixed[2, 0, 0] = SENTINEL
    with pytest.raises(RouteFormatError, match="turn 0: row 2 mixes"):
        stitch_turns([(0, mixed)])
    with pytest.raises(RouteFormatError, match="no turns"):
        stitch_turns([])


def test_vllm_turn_start_checks_against_what_the_server_reports():
    assert vllm_turn_start(10, prompt_len=12, response_len=3, requested_start=0, cached_tokens=4) == 4
    with pytest.raises(RouteFormatError, match="reports 8 cached tokens"):
        vllm_turn_start(10, prompt_len=12, response_len=3, requested_start=0, cached_tokens=8)
    with pytest.raises(RouteFormatError, match=r"start at row 13, outside \[0, 12\]"):
        vllm_turn_start(1, prompt_len=12, response_len=3)
    with pytest.raises(RouteFormatError, match=r"start at row 2, outside \[8, 12\]"):
        vllm_turn_start(12, prompt_len=12, response_len=3, requested_start=8)


# ---- the client of a vLLM server: multi-turn requests, -1 rows -----------------------------------------------------

def completion(prompt: list[int], response: list[int], routes: np.ndarray, cached: int | None = None) -> dict:
    """A ``/v1/completions`` response as vLLM's ``request_output_to_completion_response`` builds it."""
    out = {"choices": [{"index": 0, "text": "", "prompt_token_ids": prompt, "token_ids": response,
                        "logprobs": {"token_logprobs": [-0.5] * len(response)},
                        "routed_experts": vllm_npy_base64(routes), "finish_reason": "length"}]}
    if cached is not None:
        out["usage"] = {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": cached}}
    return out


def test_client_stitches_prefix_omitted_turns():
    layout = MoELayout.from_model_dir(MODEL)
    full = conversation(5, LENGTHS)
    tokens = list(range(100, 100 + 20 + 6))
    requested, cached = [0, 8, 14], [0, 8, 14]
    results = []
    for (P, R), req, c in zip(LENGTHS, requested, cached, strict=True):
        start = max(req, c)
        resp = completion(tokens[:P], tokens[P : P + R], full[start : P + R - 1], cached=c)
        (res,) = parse_completion(resp, layout, [tokens[:P]], routes_prompt_start=req, omit_prefix=True)
        assert res.routes_start == start and res.routes.values.dtype == np.uint8
        results.append(res)
    assert assemble_turns(results).values.tolist() == full.tolist()
    # a cache that reaches past the rows held leaves a gap: assemble_turns refuses it
    P, R = LENGTHS[2]
    resp = completion(tokens[:P], tokens[P : P + R], full[16 : P + R - 1], cached=16)
    (late,) = parse_completion(resp, layout, [tokens[:P]], routes_prompt_start=14, omit_prefix=True)
    with pytest.raises(RolloutError, match="turn 2 starts its routes at row 16, but 14 rows are held"):
        assemble_turns([*results[:2], late])
    # a server that says its cache held 8 tokens, but starts the rows at 16, is refused
    resp = completion(tokens[:P], tokens[P : P + R], full[16 : P + R - 1], cached=8)
    with pytest.raises(RolloutError, match="reports 8 cached tokens"):
        parse_completion(resp, layout, [tokens[:P]], routes_prompt_start=14, omit_prefix=True)
    # without omit_prefix, rows that start past the requested row are a wrong shape, as before
    with pytest.raises(RolloutError, match="shape"):
        parse_completion(resp, layout, [tokens[:P]], routes_prompt_start=14)


def test_client_refuses_uncaptured_rows_and_never_reads_255_as_an_id():
    layout = MoELayout.from_model_dir(MODEL)
    P, R = 4, 3
    full = conversation(6, [(P, R)])
    signed = full.astype(np.int16)
    signed[2] = SENTINEL
    resp = completion(list(range(P)), list(range(P, P + R)), signed)
    with pytest.raises(RolloutError, match=r"choice 0: 1 of 6 route rows are marked uncaptured \(-1 in every slot; "
                                           r"first at row 2\)"):
        parse_completion(resp, layout, [list(range(P))])
    wrapped = signed.astype(np.uint8)  # what a cast to uint8 makes of -1: expert 255
    assert int(wrapped[2, 0, 0]) == 255
    resp = completion(list(range(P)), list(range(P, P + R)), wrapped)
    with pytest.raises(RolloutError, match=r"expert id 255 outside \[0, 16\)"):
        parse_completion(resp, layout, [list(range(P))])
    signed[2, 0, 0] = 3
    resp = completion(list(range(P)), list(range(P, P + R)), signed)
    with pytest.raises(RolloutError, match="row 2 mixes the uncaptured mark"):
        parse_completion(resp, layout, [list(range(P))])


class _Recorder(CompletionsClient):
    """The client with its HTTP replaced by a prefix-omitting server's answer; records what it was sent."""

    def __init__(self, answer: dict):
        self.url, self.served_name, self.max_model_len, self.model_dir = "http://test", "m", 512, MODEL
        self.layout = MoELayout.from_model_dir(MODEL)
        self.answer, self.sent = answer, []

    def request(self, body, timeout=None, headers=None):
        self.sent.append((body, headers))
        return self.answer


def test_generate_sends_the_session_and_the_start():
    full = conversation(7, [(5, 4)])
    tokens = list(range(100, 109))
    client = _Recorder(completion(tokens[:5], tokens[5:], full[4:], cached=4))
    from r3lab.rollout import SamplingConfig

    (res,) = client.generate([tokens[:5]], SamplingConfig(max_tokens=4), routes_prompt_start=0, omit_prefix=True,
                             session_id="conv-1")
    body, headers = client.sent[0]
    assert headers == {"x-session-id": "conv-1"} and body["routed_experts_prompt_start"] == 0
    assert isinstance(res, RolloutResult) and res.routes_start == 4
    assert res.routes.values.tolist() == full[4:].tolist()
    with pytest.raises(RolloutError, match="omit_prefix needs a session_id"):
        client.generate([tokens[:5]], SamplingConfig(max_tokens=4), omit_prefix=True)

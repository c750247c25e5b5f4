"""JSON interop: the field's ``{"data": base64, "shape", "dtype"}`` payload, and readers for what engines send.

- :func:`to_payload` / :func:`from_payload`: Routes as a JSON-safe dict (compact buffer in base64).
- :func:`read_vllm_npy_base64`: vLLM >= 0.22 OpenAI server, ``choices[i].routed_experts`` (base64 of ``.npy``).
- :func:`read_vllm_nested_list`: vLLM 0.21, nested JSON lists.
- :func:`read_sglang_base64_int32`: SGLang, base64 of a flat int32 buffer (layers and top-k given).
- :func:`read_sglang_meta_info`: SGLang with the narrow wire of sgl-project/sglang PR #31219 (open; read at its
  revision a6463a1003429d415506fe0d97b4c548b85444e1, ``python/sglang/srt/state_capturer/routed_experts_wire.py``,
  ``encode_routed_experts_for_wire`` and ``extract_routed_experts_from_meta_info``): ``meta_info["routed_experts"]``
  is base64 of a flat row-major buffer in the dtype that ``meta_info["routed_experts_dtype"]`` names (``"int32"``,
  ``"uint16"`` or ``"uint8"``; absent or None: the int32 of older servers). The sender falls back to int32 whenever
  an id does not fit the narrow dtype, negative sentinels included, so a ``-1`` never arrives as an unsigned 255.
  The rows cover ``[routed_experts_start_len, P + R - 1)`` (``GenerateReqInput.routed_experts_start_len``,
  ``python/sglang/srt/managers/io_struct.py``, PR #24851, merged).
- :func:`stitch_turns` and :func:`vllm_turn_start`: one ``[P + R - 1, L, K]`` array from the per-turn route arrays of
  a multi-turn conversation, for servers that return only the rows a turn adds (SGLang's
  ``routed_experts_start_len``; vLLM's ``routed_experts_prompt_start`` and the open vLLM PR #57966,
  ``--enable-omit-prefix-routed-experts``, read in its description of 2026-09-21: rows start at
  ``max(routed_experts_prompt_start, num_cached_tokens)``; the choice carries no start field, as
  ``CompletionResponseChoice.routed_experts`` in vllm 0.30 ``vllm/entrypoints/openai/completion/serving.py`` carries
  none, so the start follows from the row count: the rows always end at ``P + R - 1``).

Uncaptured rows: several producers write a route row they did not capture as ``-1`` in every slot (tunix #2046,
NeMo-RL #3113: ``ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL`` in ``nemo_rl/models/generation/interfaces.py``, which
rejects partly negative rows). Every reader keeps such a row as it is, signed (:data:`SENTINEL`, never cast to an
unsigned id: a cast to uint8 makes it expert 255), and refuses a row that mixes ``-1`` with ids and any other
negative value. vLLM's ``.npy`` routes are ``|u1`` when the model has at most 256 experts and ``<u2`` above
(``routed_experts_capturer.py``): they are returned in that dtype, never widened or narrowed.

Every reader validates strictly and raises :class:`RouteFormatError`; none unpickles.
"""

from __future__ import annotations

import ast
import binascii
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pybase64

from r3lab.compaction.container import DEFAULT_MAX_BYTES
from r3lab.errors import RouteFormatError
from r3lab.routes import SENTINEL, Routes

#: SGLang PR #31219's wire dtypes (``_WIRE_DTYPES`` in ``routed_experts_wire.py``), little-endian as its hosts write
SGLANG_WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    "int32": np.dtype("<i4"), "uint16": np.dtype("<u2"), "uint8": np.dtype("u1"),
}

#: dtypes a payload may name, by their canonical numpy names; others ("<u1", "i4", "object") are refused
PAYLOAD_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in ("uint8", "uint16", "int16", "int32", "int64")}


def _b64decode(data: Any, what: str, max_bytes: int) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
    elif isinstance(data, str):
        data = data.encode("ascii", errors="strict") if data.isascii() else None
    else:
        data = None
    if data is None:
        raise RouteFormatError(f"{what}: data must be a base64 string")
    if len(data) // 4 * 3 > max_bytes:
        raise RouteFormatError(f"{what}: about {len(data) // 4 * 3} decoded bytes, over the cap of {max_bytes}")
    try:
        return pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RouteFormatError(f"{what}: bad base64 ({e})") from e


def _shape(shape: Any, ndims: tuple[int, ...], what: str) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or len(shape) not in ndims:
        raise RouteFormatError(
            f"{what}: shape must be a list of {' or '.join(map(str, ndims))} integers, got {shape!r}"
        )
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise RouteFormatError(f"{what}: shape has a non-integer dim: {list(shape)!r}")
        if d < 0:
            raise RouteFormatError(f"{what}: shape has a negative dim: {list(shape)!r}")
    return tuple(int(d) for d in shape)


def to_payload(routes: Routes) -> dict[str, Any]:
    """Routes as a JSON-safe dict: the compact buffer in base64 plus everything needed to rebuild them."""
    return {
        "data": pybase64.b64encode(routes.values.tobytes()).decode("ascii"),
        "shape": list(routes.values.shape),
        "dtype": routes.values.dtype.name,
        "num_experts": routes.num_experts,
        "layer_ids": routes.layer_ids.tolist(),
        "cu_seqlens": routes.cu_seqlens.tolist(),
    }


def from_payload(
    payload: dict[str, Any],
    *,
    num_experts: int | None = None,
    layer_ids: Any = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Routes:
    """Rebuild Routes from :func:`to_payload`'s dict, or from a field payload with only data/shape/dtype.

    ``shape`` is ``[T, L, K]`` (with optional ``cu_seqlens``; one sequence if absent) or padded
    ``[B, S, L, K]`` with ``lengths``. ``num_experts`` and ``layer_ids`` fill in what the payload lacks
    and must agree with what it has. Ids are range-checked and downcast to the compact dtype.
    """
    what = "routes payload"
    if not isinstance(payload, dict):
        raise RouteFormatError(f"{what} must be a dict, got {type(payload).__name__}")
    missing = [k for k in ("data", "shape", "dtype") if k not in payload]
    if missing:
        raise RouteFormatError(f"{what} lacks {missing}")
    dtype = PAYLOAD_DTYPES.get(payload["dtype"]) if isinstance(payload["dtype"], str) else None
    if dtype is None:
        raise RouteFormatError(
            f"{what}: unknown or non-canonical dtype {payload['dtype']!r}; use one of {sorted(PAYLOAD_DTYPES)}"
        )
    shape = _shape(payload["shape"], (3, 4), what)
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if need > max_bytes:
        raise RouteFormatError(f"{what}: shape {list(shape)} needs {need} bytes, over the cap of {max_bytes}")
    raw = _b64decode(payload["data"], what, max_bytes)
    if len(raw) != need:
        raise RouteFormatError(
            f"{what}: {len(raw)} bytes do not match shape {list(shape)} of {dtype.name} ({need} bytes)"
        )
    E = _agree(payload.get("num_experts"), num_experts, "num_experts")
    if E is None:
        raise RouteFormatError(f"{what}: num_experts is neither in the payload nor given")
    lids = _agree(payload.get("layer_ids"), layer_ids, "layer_ids")
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if len(shape) == 4:
        if "lengths" not in payload:
            raise RouteFormatError(f"{what}: a padded [B, S, L, K] payload needs 'lengths'")
        left = bool(payload.get("left_padded", False))
        return Routes.from_padded(arr, payload["lengths"], num_experts=E, layer_ids=lids, left_padded=left)
    cu = payload.get("cu_seqlens", [0, shape[0]])
    return Routes(arr, cu, E, lids)


def _agree(in_payload: Any, given: Any, name: str) -> Any:
    if in_payload is None:
        return given
    if given is not None and np.asarray(in_payload).tolist() != np.asarray(given).tolist():
        raise RouteFormatError(f"payload {name}={in_payload!r} disagrees with the given {name}={given!r}")
    return in_payload


def read_vllm_npy_base64(data: str | bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """Decode vLLM's OpenAI-server ``routed_experts``: base64 of ``.npy`` bytes, ``[tokens, layers, top_k]``.

    Only a plain little-endian integer array is accepted: object, structured or Fortran-ordered
    arrays, pickles, bad headers and byte counts that disagree with the header are refused.
    """
    what = "vLLM routed_experts (.npy base64)"
    raw = _b64decode(data, what, max_bytes)
    if raw[:6] != b"\x93NUMPY" or len(raw) < 10:
        raise RouteFormatError(f"{what}: not .npy bytes (bad magic {raw[:6]!r})")
    major = raw[6]
    if major == 1:
        hlen, start = int.from_bytes(raw[8:10], "little"), 10
    elif major in (2, 3):
        hlen, start = int.from_bytes(raw[8:12], "little"), 12
    else:
        raise RouteFormatError(f"{what}: unsupported .npy version {major}.{raw[7]}")
    if start + hlen > len(raw):
        raise RouteFormatError(f"{what}: truncated .npy header")
    try:
        header = ast.literal_eval(raw[start : start + hlen].decode("latin1"))
    except (ValueError, SyntaxError) as e:
        raise RouteFormatError(f"{what}: unreadable .npy header ({e})") from e
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise RouteFormatError(f"{what}: malformed .npy header {header!r}")
    descr = header["descr"]
    if not isinstance(descr, str) or descr not in ("|u1", "<u2", "<i2", "<i4", "<i8", "<u4", "|i1"):
        raise RouteFormatError(f"{what}: refusing .npy dtype {descr!r}; routes are plain little-endian integers")
    if header["fortran_order"] is not False:
        raise RouteFormatError(f"{what}: refusing a Fortran-ordered .npy array")
    shape = _shape(header["shape"], (3,), what)
    dtype = np.dtype(descr)
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    body = raw[start + hlen :]
    if need > max_bytes:
        raise RouteFormatError(f"{what}: shape {list(shape)} needs {need} bytes, over the cap of {max_bytes}")
    if len(body) != need:
        raise RouteFormatError(
            f"{what}: {len(body)} data bytes do not match shape {list(shape)} of {dtype} ({need} bytes)"
        )
    return _check_sentinel(np.frombuffer(body, dtype=dtype).reshape(shape), what)


def read_vllm_nested_list(data: Any) -> np.ndarray:
    """Decode vLLM 0.21's nested-list ``routed_experts`` into an int64 ``[tokens, layers, top_k]`` array."""
    what = "vLLM routed_experts (nested lists)"
    try:
        arr = np.asarray(data)
    except ValueError as e:
        raise RouteFormatError(f"{what}: ragged nesting ({e})") from e
    if arr.ndim != 3:
        raise RouteFormatError(f"{what}: expected [tokens, layers, top_k] nesting, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise RouteFormatError(f"{what}: expected integers, got {arr.dtype}")
    return _check_sentinel(arr.astype(np.int64, copy=False), what)


def read_sglang_base64_int32(
    data: str | bytes, *, num_layers: int, top_k: int, max_bytes: int = DEFAULT_MAX_BYTES
) -> np.ndarray:
    """Decode SGLang's base64 flat int32 routes into ``[tokens, num_layers, top_k]``."""
    what = "SGLang routed experts (base64 int32)"
    num_layers, top_k = _shape([num_layers, top_k], (2,), what)
    if num_layers < 1 or top_k < 1:
        raise RouteFormatError(f"{what}: num_layers and top_k must be >= 1, got {num_layers}, {top_k}")
    raw = _b64decode(data, what, max_bytes)
    row = 4 * num_layers * top_k
    if len(raw) % row:
        raise RouteFormatError(f"{what}: {len(raw)} bytes is not a whole number of [{num_layers}, {top_k}] int32 rows")
    return _check_sentinel(np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k), what)


def uncaptured_rows(arr: np.ndarray) -> np.ndarray:
    """bool per row of a ``[rows, layers, top_k]`` array: True where every slot is :data:`SENTINEL` (not captured).

    Unsigned arrays have no such rows (their 255 or 65535 is an id, range-checked where the model is known)."""
    a = np.asarray(arr)
    if a.dtype.kind != "i" or a.ndim != 3 or not a.size:
        return np.zeros(a.shape[0] if a.ndim else 0, dtype=bool)
    return np.asarray((a == SENTINEL).all(axis=(1, 2)))


def _check_sentinel(arr: np.ndarray, what: str) -> np.ndarray:
    """``arr`` unchanged if its negatives are whole :data:`SENTINEL` rows, else RouteFormatError naming the row."""
    if arr.dtype.kind != "i" or not arr.size or int(arr.min()) >= 0:
        return arr
    whole = uncaptured_rows(arr)
    bad = (arr < 0) & ~whole[:, None, None]
    if bad.any():
        t, j, k = (int(x) for x in np.argwhere(bad)[0])
        v = int(arr[t, j, k])
        if v == SENTINEL:
            raise RouteFormatError(f"{what}: row {t} mixes the uncaptured mark -1 (layer {j}, slot {k}) with expert "
                                   "ids; an uncaptured row is -1 in every slot")
        raise RouteFormatError(f"{what}: negative expert id {v} at row {t}, layer {j}, slot {k}")
    return arr


def read_sglang_meta_info(
    meta_info: Any, *, num_layers: int, top_k: int, start_len: int = 0, prompt_len: int | None = None,
    response_len: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
) -> np.ndarray:
    """Decode SGLang's ``meta_info`` routes into ``[rows, num_layers, top_k]`` in the wire's own dtype.

    The dtype comes from ``meta_info["routed_experts_dtype"]`` (absent or None: int32, as SGLang's own decoder
    does; names are matched after ``strip().lower()``, as there); any other value is refused. ``start_len`` is the
    ``routed_experts_start_len`` the request sent; where ``meta_info`` states one too, the two must agree. With
    ``prompt_len`` and ``response_len`` the row count must be ``prompt_len + response_len - 1 - start_len``.
    int32 rows that are -1 throughout stay -1 (uncaptured); uint8/uint16 ids are returned unwidened.
    """
    what = "SGLang routed experts (meta_info)"
    if not isinstance(meta_info, dict):
        raise RouteFormatError(f"{what}: meta_info must be an object, got {type(meta_info).__name__}")
    if meta_info.get("routed_experts") is None:
        raise RouteFormatError(f"{what}: no routed_experts (server started without --enable-return-routed-experts, "
                               "or the request lacked return_routed_experts)")
    name = meta_info.get("routed_experts_dtype")
    dtype = SGLANG_WIRE_DTYPES["int32"] if name is None else (
        SGLANG_WIRE_DTYPES.get(name.strip().lower()) if isinstance(name, str) else None)
    if dtype is None:
        raise RouteFormatError(f"{what}: unknown routed_experts_dtype {name!r}; SGLang sends one of "
                               f"{sorted(SGLANG_WIRE_DTYPES)}")
    num_layers, top_k = _shape([num_layers, top_k], (2,), what)
    if isinstance(start_len, bool) or not isinstance(start_len, (int, np.integer)) or start_len < 0:
        raise RouteFormatError(f"{what}: routed_experts_start_len must be a non-negative integer, got {start_len!r}")
    start = int(start_len)
    if num_layers < 1 or top_k < 1:
        raise RouteFormatError(f"{what}: num_layers and top_k must be >= 1, got {num_layers}, {top_k}")
    said = meta_info.get("routed_experts_start_len")
    if said is not None and (isinstance(said, bool) or not isinstance(said, int) or said != start):
        raise RouteFormatError(f"{what}: meta_info says routed_experts_start_len={said!r}, the request sent {start}")
    raw = _b64decode(meta_info["routed_experts"], what, max_bytes)
    row = dtype.itemsize * num_layers * top_k
    if len(raw) % row:
        raise RouteFormatError(f"{what}: {len(raw)} bytes is not a whole number of [{num_layers}, {top_k}] "
                               f"{dtype.name} rows ({row} bytes each)")
    arr = np.frombuffer(raw, dtype=dtype).reshape(-1, num_layers, top_k)
    if prompt_len is not None and response_len is not None:
        want = int(prompt_len) + int(response_len) - 1 - start
        if not 0 <= start <= int(prompt_len):
            raise RouteFormatError(f"{what}: routed_experts_start_len={start} outside [0, {prompt_len}] (the prompt)")
        if arr.shape[0] != want:
            raise RouteFormatError(f"{what}: {arr.shape[0]} rows; expected {want} (prompt {prompt_len} + response "
                                   f"{response_len} - 1 - routed_experts_start_len {start})")
    return _check_sentinel(arr, what)


def vllm_turn_start(rows: int, *, prompt_len: int, response_len: int, requested_start: int = 0,
                    cached_tokens: int | None = None, where: str = "turn") -> int:
    """The first row a vLLM choice's routes cover: ``prompt_len + response_len - 1 - rows``.

    vLLM's rows end at ``P + R - 1`` and start at ``routed_experts_prompt_start``; with
    ``--enable-omit-prefix-routed-experts`` (vLLM PR #57966, open) at ``max(routed_experts_prompt_start,
    num_cached_tokens)``. The start must lie in ``[requested_start, prompt_len]``; where the response reports its
    cached tokens (``usage.prompt_tokens_details.cached_tokens``), the start must equal the larger of the two.
    """
    end = int(prompt_len) + int(response_len) - 1
    start = end - int(rows)
    if not int(requested_start) <= start <= int(prompt_len):
        raise RouteFormatError(
            f"{where}: {rows} route rows end at row {end} (prompt {prompt_len} + response {response_len} - 1), so they "
            f"start at row {start}, outside [{requested_start}, {prompt_len}] (routed_experts_prompt_start "
            f"{requested_start} .. the prompt's end)")
    if cached_tokens is not None and start != max(int(requested_start), int(cached_tokens)):
        raise RouteFormatError(
            f"{where}: routes start at row {start}, but the server reports {cached_tokens} cached tokens and "
            f"routed_experts_prompt_start={requested_start}: a prefix-omitting server starts at "
            f"{max(int(requested_start), int(cached_tokens))}")
    return start


def stitch_turns(
    turns: Sequence[tuple[int, np.ndarray]], *, total_rows: int | None = None,
    overlap: Literal["check", "keep", "replace"] = "check",
) -> np.ndarray:
    """One ``[rows, L, K]`` array from a conversation's per-turn ``(start_row, routes)`` pairs, in turn order.

    Turn j's routes cover rows ``[start_j, start_j + len)``. Turn 0 must start at row 0, and no turn may start past
    the rows already held (a gap: the rows in between were never returned). A turn that starts before the rows held
    overlaps them: ``overlap="check"`` (default) refuses an overlapping row whose expert set differs from the one
    held (naming turn, row and layer), ``"keep"`` keeps the held rows, ``"replace"`` takes the later turn's (as
    Miles' ``reconstruct_routed_experts`` does). Held rows marked uncaptured (:data:`SENTINEL`) are filled by a
    later turn that has them. ``total_rows`` (``P + R - 1`` of the last turn), if given, must be the rows held at
    the end. The result has the turns' common integer dtype (uint8 turns stay uint8).
    """
    if overlap not in ("check", "keep", "replace"):
        raise RouteFormatError(f"stitch_turns: overlap must be 'check', 'keep' or 'replace', got {overlap!r}")
    if not turns:
        raise RouteFormatError("stitch_turns: no turns")
    parts: list[tuple[int, np.ndarray]] = []
    for j, item in enumerate(turns):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise RouteFormatError(f"turn {j}: expected a (start_row, routes) pair, got {type(item).__name__}")
        start, arr = item
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise RouteFormatError(f"turn {j}: start row must be a non-negative integer, got {start!r}")
        a = np.asarray(arr)
        if a.ndim != 3 or (a.size and a.dtype.kind not in "iu"):
            raise RouteFormatError(f"turn {j}: routes must be an integer [rows, layers, top_k] array, "
                                   f"got {a.dtype} {a.shape}")
        if parts and a.shape[1:] != parts[0][1].shape[1:]:
            raise RouteFormatError(f"turn {j}: routes of [layers, top_k] {list(a.shape[1:])}, turn 0 has "
                                   f"{list(parts[0][1].shape[1:])}")
        parts.append((int(start), _check_sentinel(a, f"turn {j}")))
    dtype = np.result_type(*[a.dtype for _, a in parts])
    held = 0
    end = max(s + len(a) for s, a in parts)
    out = np.full((end, *parts[0][1].shape[1:]), SENTINEL if dtype.kind == "i" else 0, dtype=dtype)
    for j, (start, a) in enumerate(parts):
        if start > held:
            what = "no rows" if j == 0 else f"{held} rows"
            raise RouteFormatError(f"turn {j} starts at row {start}, but {what} are held: rows [{held}, {start}) were "
                                   "never returned (a cached prefix the client did not keep?)")
        n = min(held, start + len(a)) - start  # rows of this turn that overlap the held ones
        if n > 0:
            old, new = out[start : start + n], a[:n]
            gap = uncaptured_rows(old) & ~uncaptured_rows(new)
            if overlap == "check":
                both = ~uncaptured_rows(old) & ~uncaptured_rows(new)
                differs = (np.sort(old, axis=2) != np.sort(new, axis=2)).any(axis=2) & both[:, None]
                if differs.any():
                    t, layer = (int(x) for x in np.argwhere(differs)[0])
                    raise RouteFormatError(
                        f"turn {j} overlaps the held rows [{start}, {start + n}) and disagrees at row {start + t}, "
                        f"layer {layer}: held {sorted(old[t, layer].tolist())}, turn {j} "
                        f"{sorted(new[t, layer].tolist())} ({int(differs.any(axis=1).sum())} of {n} rows differ)")
            take = np.ones(n, dtype=bool) if overlap == "replace" else gap
            out[start : start + n][take] = new[take]
        out[start + max(n, 0) : start + len(a)] = a[max(n, 0) :]
        held = max(held, start + len(a))
    if total_rows is not None and held != int(total_rows):
        raise RouteFormatError(f"stitch_turns: the turns hold {held} rows, the conversation needs {total_rows} "
                               "(P + R - 1 of its last turn)")
    return out

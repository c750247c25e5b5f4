"""JSON interop: the field's ``{"data": base64, "shape", "dtype"}`` payload, and readers for what engines send.

- :func:`to_payload` / :func:`from_payload`: Routes as a JSON-safe dict (compact buffer in base64).
- :func:`read_vllm_npy_base64`: vLLM >= 0.22 OpenAI server, ``choices[i].routed_experts`` (base64 of ``.npy``).
- :func:`read_vllm_nested_list`: vLLM 0.21, nested JSON lists.
- :func:`read_sglang_base64_int32`: SGLang, base64 of a flat int32 buffer (layers and top-k given).

Every reader validates strictly and raises :class:`RouteFormatError`; none unpickles.
"""

from __future__ import annotations

import ast
import binascii
from typing import Any

import numpy as np
import pybase64

from r3lab.compaction.container import DEFAULT_MAX_BYTES
from r3lab.errors import RouteFormatError
from r3lab.routes import Routes

__all__ = ["to_payload", "from_payload", "read_vllm_npy_base64", "read_vllm_nested_list", "read_sglang_base64_int32"]

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
    return np.frombuffer(body, dtype=dtype).reshape(shape)


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
    return arr.astype(np.int64, copy=False)


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
    return np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k)

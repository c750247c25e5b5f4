"""Routes decoded straight into a torch device's memory: the encoded bytes cross to the device once, torch decodes.

A trainer rank that replays routes needs them as a tensor on its GPU. Decoding on the host and copying the result
moves the decoded bytes across PCIe (for ``bitpack``, 8/6 of the payload at 64 experts; for ``topk-gaps+zstd`` many
times it) and runs a single-threaded host loop; :func:`decode_to_device` instead checks the container's frame on the
host (magic, version, header, cu_seqlens, the CRC-32: cheap, and a corrupt buffer never reaches the device), copies
the codec's payload to ``device`` as one uint8 tensor, and decodes it there with torch operations only (shifts,
masks, gathers, a sort along top-k), a bounded number of ids at a time. Nothing loops over tokens in Python.

The result equals :func:`r3lab.compaction.decode` bit for bit: the same ``[T, L, K]`` ids in the compact dtype
(uint8 up to 256 experts, uint16 beyond), rows sorted exactly where the host decode sorts them, the same routing
weights for a format version 3 buffer, and the same :class:`~r3lab.errors.RouteFormatError` (same message) for an
id out of range or repeated in a row, found on the device. ``index_dtype`` hands back another integer dtype instead
(``torch.int64``, what routers index with), refused when it cannot hold every id.

Device kernels (:data:`DEVICE_CODECS`): ``raw`` and ``bitpack`` (either row order) and ``topk-gaps``. A byte stage
(``zstd``) and the other id codecs (``topk-set``: combinatorial unranking; version 1 ``bitpack`` planes) have none:
``host="frame"`` (the default) refuses such a buffer with a :class:`~r3lab.errors.ConfigError` naming the stage;
``host="byte-stages"`` inflates the byte stage on the host and decodes the ids on the device; ``host="all"``
also decodes an id codec without a kernel on the host and copies the result. ``DeviceRoutes.stages`` says where
each stage ran. There are no sentinel rows here: a container holds valid ids only (uncaptured rows marked
:data:`r3lab.routes.SENTINEL` are dropped by the wire readers before encoding).

torch is imported when a function runs, never when this module is imported.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from r3lab._extras import importing
from r3lab.compaction import DEFAULT_MAX_BYTES, decode, read_header
from r3lab.compaction.codecs import BitPack, IdCodec, Raw, TopKGaps, id_bits, parse_pipeline
from r3lab.compaction.codecs.weights import WeightCodec
from r3lab.compaction.framing import byte_view
from r3lab.compaction.kernels import first_bad_row
from r3lab.compaction.legacy import LEGACY_BITPACK, v1_coder
from r3lab.errors import ConfigError, RouteFormatError
from r3lab.routes import Routes, check_cu_seqlens, compact_dtype

__all__ = ["decode_to_device", "DeviceRoutes", "DEVICE_CODECS", "HOST_WORK", "DEFAULT_CHUNK_IDS"]

#: what ``host=`` may leave to the host, from least to most: the frame only; also byte stages; also an id codec
HOST_WORK = ("frame", "byte-stages", "all")
#: ids decoded per step on the device (bounds the int32/int64 temporaries to a few hundred MB at any batch size)
DEFAULT_CHUNK_IDS = 1 << 24


@dataclasses.dataclass(frozen=True)
class DeviceRoutes:
    """Routes whose ids (and routing weights) live in a torch device's memory; the rest is small and on the host.

    :ivar values: ``[T, L, K]`` ids on the device, the compact dtype unless ``index_dtype`` said otherwise.
    :ivar cu_seqlens: int64 ``[num_seqs + 1]`` sequence offsets (host).
    :ivar num_experts: experts per MoE layer.
    :ivar layer_ids: the global layer id of each entry of the layer axis (host).
    :ivar weights: float32 ``[T, L, K]`` routing weights on the device, or None.
    :ivar stages: ``(stage, where it ran)`` in order, e.g. ``(("frame", "host"), ("zstd", "host"),
        ("topk-gaps", "cuda:0"))``; a host-decoded id codec is followed by ``("copy", device)``.
    """

    values: Any
    cu_seqlens: np.ndarray
    num_experts: int
    layer_ids: np.ndarray
    weights: Any
    stages: tuple[tuple[str, str], ...]

    def per_layer(self) -> dict[int, Any]:
        """``{global_layer_id: [T, K] ids}``, views of :attr:`values` (what :func:`r3lab.replay.hf_replay` takes)."""
        return {int(g): self.values[:, j, :] for j, g in enumerate(self.layer_ids)}

    def to_routes(self) -> Routes:
        """A host copy as :class:`~r3lab.routes.Routes` (compact dtype; checks and tests)."""
        vals = self.values.cpu().numpy().astype(compact_dtype(self.num_experts), copy=False)
        w = None if self.weights is None else self.weights.cpu().numpy()
        return Routes(vals, self.cu_seqlens, self.num_experts, self.layer_ids, validate=False, weights=w)


def _torch() -> Any:
    with importing("torch", for_="decoding routes into device memory"):
        import torch
    return torch


def _host_bytes(buf: Any) -> memoryview:
    """A flat byte view of a host buffer (bytes-like, numpy array, CPU torch tensor); a device tensor is refused."""
    if type(buf).__module__.startswith("torch"):
        if buf.device.type != "cpu":
            raise ConfigError(f"decode_to_device reads the container's frame on the host; got a tensor on "
                              f"{buf.device}: pass the encoded bytes in host memory")
        buf = buf.detach().contiguous().numpy()
    return byte_view(buf)


def _to_device(torch: Any, mv: memoryview, device: Any) -> Any:
    """One host-to-device copy of ``mv`` as a uint8 tensor (the host view is read-only; it is never written)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        host = torch.frombuffer(mv, dtype=torch.uint8) if len(mv) else torch.empty(0, dtype=torch.uint8)
    return host.to(device)


def _copy_to(torch: Any, array: np.ndarray, device: Any, dtype: Any) -> Any:
    """A copy of a host array on ``device`` (the array may be a read-only view of the caller's buffer)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(array).to(device=device, dtype=dtype, copy=True)


def _u16(torch: Any, pairs: Any) -> Any:
    """int32 of little-endian uint16 values from a ``[n, 2]`` uint8 tensor (any alignment, any host byte order)."""
    p = pairs.to(torch.int32)
    return p[:, 0] | (p[:, 1] << 8)


def _raw_ids(torch: Any, payload: Any, i0: int, i1: int, itemsize: int) -> Any:
    """int32 ids ``[i0, i1)`` of a ``raw`` payload (one little-endian uint8/uint16 per id)."""
    part = payload[i0 * itemsize : i1 * itemsize]
    return part.to(torch.int32) if itemsize == 1 else _u16(torch, part.view(-1, 2))


def _bitpack_ids(torch: Any, payload: Any, i0: int, i1: int, bits: int) -> Any:
    """int32 ids ``[i0, i1)`` of a ``bitpack`` stream (``i0`` a multiple of 8: it starts on a byte boundary).

    Every 8 ids fill ``bits`` bytes, and id ``j`` of such a group starts at bit ``j * bits`` of it, so within a group
    the byte and shift of each id are constants: gather the (at most three) bytes an id touches, join them, shift and
    mask. A column past the group's end is clamped to its last byte; what it adds lies above the mask."""
    if bits in (8, 16):
        return _raw_ids(torch, payload, i0, i1, bits // 8)
    dev = payload.device
    start = torch.arange(8, device=dev) * bits
    cols = (start // 8)[:, None] + torch.arange(3, device=dev)[None, :]
    cols = cols.clamp(max=bits - 1).reshape(-1)
    shift = (start % 8).to(torch.int32)
    mask = (1 << bits) - 1
    n = i1 - i0
    groups, rem = divmod(n, 8)
    b0 = i0 // 8 * bits
    body = payload[b0 : b0 + groups * bits].view(groups, bits)
    if rem:  # the last, partial group: its ceil(rem * bits / 8) bytes, zero-padded to a whole group
        tail = torch.zeros(1, bits, dtype=torch.uint8, device=dev)
        have = payload[b0 + groups * bits :]
        tail[0, : have.numel()] = have
        body = torch.cat([body, tail])
    x = body.index_select(1, cols).view(-1, 8, 3).to(torch.int32)
    word = x[..., 0] | (x[..., 1] << 8) | (x[..., 2] << 16)
    return ((word >> shift) & mask).reshape(-1)[:n]


def _row_codec(torch: Any, payload: Any, coder: Any, shape: tuple[int, int, int], num_experts: int, out: Any,
               chunk_ids: int) -> None:
    """Decode a ``raw``/``bitpack`` payload into ``out`` ``[T, L, K]``, ``chunk_ids`` ids (a multiple of 8) a step."""
    T, L, K = shape
    n = T * L * K
    want = coder.encoded_size(shape, compact_dtype(num_experts), num_experts)
    if payload.numel() != want:  # the container checked the length against the header: this is a second guard
        raise RouteFormatError(f"{coder.codec_id} payload holds {payload.numel()} bytes but shape {list(shape)} "
                               f"needs {want}")
    if isinstance(coder, BitPack):
        bits = id_bits(num_experts)

        def ids(i0: int, i1: int) -> Any:
            return _bitpack_ids(torch, payload, i0, i1, bits)
    else:
        itemsize = compact_dtype(num_experts).itemsize

        def ids(i0: int, i1: int) -> Any:
            return _raw_ids(torch, payload, i0, i1, itemsize)

    stored = out.view(-1) if coder.order == "token" else torch.empty((L, T, K), dtype=out.dtype, device=out.device)
    flat = stored.view(-1)
    for i0 in range(0, n, chunk_ids):
        i1 = min(n, i0 + chunk_ids)
        flat[i0:i1] = ids(i0, i1)
    if coder.order == "layer":
        out.copy_(stored.permute(1, 0, 2))


def _topk_gaps(torch: Any, payload: Any, coder: Any, shape: tuple[int, int, int], num_experts: int, out: Any,
               chunk_ids: int) -> None:
    """Decode a ``topk-gaps`` payload (``perm[L, E]`` then ``gaps[L, K, T]``) into ``out``, rows sorted, with the
    host decoder's refusals: a relabelling that is not a permutation, an id out of range (first layer first)."""
    T, L, K = shape
    E = num_experts
    itemsize = compact_dtype(E).itemsize
    want = coder.encoded_size(shape, compact_dtype(E), E)
    if payload.numel() != want:
        raise RouteFormatError(f"topk-gaps payload holds {payload.numel()} bytes but shape {list(shape)} needs {want}")
    dev = payload.device
    perms = _raw_ids(torch, payload, 0, L * E, itemsize).view(L, E).to(torch.int64)
    gaps_at = L * E  # in ids
    perm_bad = (perms >= E).any(dim=1) | (perms.sort(dim=1).values != torch.arange(E, device=dev)).any(dim=1)
    range_bad = torch.zeros(L, dtype=torch.bool, device=dev)
    step = max(1, chunk_ids // max(L * K, 1))
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        # gaps[:, :, t0:t1] of the [L, K, T] block, read as L*K runs of t1 - t0 ids
        rows = torch.arange(L * K, device=dev)[:, None] * T + torch.arange(t0, t1, device=dev)[None, :]
        flat = payload.view(-1, itemsize)[gaps_at + rows.reshape(-1)]
        g = (flat[:, 0].to(torch.int64) if itemsize == 1 else _u16(torch, flat).to(torch.int64)).view(L, K, t1 - t0)
        ids = torch.cumsum(g + 1, dim=1) - 1  # strictly increasing along K
        range_bad |= (ids[:, -1, :] >= E).any(dim=1)
        ids.clamp_(max=E - 1)  # a gather index must be valid even where the buffer is refused below
        expert = perms.gather(1, ids.view(L, -1)).view(L, K, t1 - t0)
        out[t0:t1] = expert.permute(2, 0, 1).sort(dim=2).values
    bad = perm_bad | range_bad
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        if bool(perm_bad[j]):
            raise RouteFormatError(f"topk-gaps: the relabelling of layer {j} is not a permutation of {E} experts")
        raise RouteFormatError(f"topk-gaps: expert id out of range [0, {E}) in layer {j}")


#: id codec class -> its device kernel (exact classes: a subclass with another layout has none)
_KERNELS: dict[type[IdCodec], Callable[..., None]] = {Raw: _row_codec, BitPack: _row_codec, TopKGaps: _topk_gaps}
#: the codec ids whose payload decodes on the device
DEVICE_CODECS: tuple[str, ...] = tuple(c.codec_id for c in _KERNELS)


def _bad_rows(torch: Any, ids: Any, num_experts: int) -> Any:
    """bool per ``[rows, K]`` row: an id out of range or repeated."""
    x = ids.to(torch.int32)
    bad = (x >= num_experts).any(dim=1)
    if x.shape[1] > 1:
        s = x.sort(dim=1).values
        bad |= (s[:, 1:] == s[:, :-1]).any(dim=1)
    return bad


def _check_rows(torch: Any, values: Any, num_experts: int, layer_ids: list[int], chunk_ids: int) -> None:
    """The container's row check on the device: the first bad row in token-major order, the host's message."""
    T, L, K = values.shape
    rows = values.view(-1, K)
    step = max(1, chunk_ids // max(K, 1))
    flags = [_bad_rows(torch, rows[r0 : r0 + step], num_experts).any() for r0 in range(0, T * L, step)]
    if not flags or not bool(torch.stack(flags).any()):
        return
    for r0 in range(0, T * L, step):
        bad = _bad_rows(torch, rows[r0 : r0 + step], num_experts)
        if bool(bad.any()):
            row = r0 + int(bad.nonzero()[0, 0])
            ids = rows[row].cpu().numpy().astype(np.int64)
            _, problem = first_bad_row(ids.reshape(1, K), num_experts)
            what = f"expert id out of range [0, {num_experts})" if problem == 0 else "repeated expert id inside a " \
                "top-k row"
            where = f"row {row} (token {row // max(L, 1)}, layer {layer_ids[row % L]})"
            raise RouteFormatError(f"{what}: {where} is {ids.tolist()}")


def _weights(torch: Any, block: Any, codec: WeightCodec, values: Any) -> Any:
    """The routing weights from their block on the device: float32, in each row's decoded id order (the block holds
    them in ascending id order); a non-finite weight is refused as on the host."""
    shape = tuple(values.shape)
    want = codec.encoded_size(shape)
    if block.numel() != want:
        raise RouteFormatError(f"weights block has {block.numel()} bytes; {codec.dtype} {list(shape)} needs {want}")
    if codec.dtype == "float32":
        w = block.view(torch.float32) if block.numel() else torch.empty(0, dtype=torch.float32, device=block.device)
    elif codec.dtype == "float16":
        w = block.view(torch.float16).to(torch.float32)
    else:
        w = (_u16(torch, block.view(-1, 2)) << 16).view(torch.float32)
    w = w.reshape(shape)
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise RouteFormatError("weights block holds a non-finite weight")
    order = torch.argsort(values.to(torch.int32), dim=2, stable=True)
    return torch.empty_like(w).scatter_(2, order, w)


def _out_dtype(torch: Any, index_dtype: Any, num_experts: int) -> Any:
    compact = {1: torch.uint8, 2: torch.uint16}[compact_dtype(num_experts).itemsize]
    if index_dtype is None:
        return compact
    if not isinstance(index_dtype, torch.dtype) or index_dtype.is_floating_point or index_dtype.is_complex \
            or index_dtype == torch.bool:
        raise ConfigError(f"index_dtype must be an integer torch dtype, got {index_dtype!r}")
    if torch.iinfo(index_dtype).max < num_experts - 1:
        raise ConfigError(f"index_dtype {index_dtype} cannot hold expert id {num_experts - 1} "
                          f"(num_experts={num_experts})")
    return index_dtype


def decode_to_device(buf: Any, device: Any, *, host: str = "frame", index_dtype: Any = None,
                     max_bytes: int = DEFAULT_MAX_BYTES, legacy_bitpack: str | None = None,
                     chunk_ids: int = DEFAULT_CHUNK_IDS) -> DeviceRoutes:
    """Decode an encoded routes buffer (:func:`r3lab.compaction.encode`'s bytes, in host memory) into ``device``.

    ``host``: what may run on the host besides the frame check (:data:`HOST_WORK`; module docstring); a buffer
    that needs more is refused with a :class:`~r3lab.errors.ConfigError` naming the stage, never decoded on the host
    silently. ``index_dtype``: an integer torch dtype for the ids (default: the compact dtype, as the host decode).
    ``max_bytes`` and ``legacy_bitpack``: as :func:`r3lab.compaction.decode`. ``chunk_ids``: ids decoded per
    device step (memory bound, not a result change). Malformed buffers raise :class:`RouteFormatError` as the host
    decode does.
    """
    torch = _torch()
    if host not in HOST_WORK:
        raise ConfigError(f"host must be one of {HOST_WORK}, got {host!r}")
    if isinstance(chunk_ids, bool) or not isinstance(chunk_ids, int) or chunk_ids < 8:
        raise ConfigError(f"chunk_ids must be an integer >= 8, got {chunk_ids!r}")
    chunk_ids -= chunk_ids % 8  # bitpack steps start on a byte boundary
    if legacy_bitpack is not None and legacy_bitpack not in LEGACY_BITPACK:
        raise RouteFormatError(f"legacy_bitpack must be one of {sorted(LEGACY_BITPACK)} or None, "
                               f"got {legacy_bitpack!r}")
    device = torch.device(device)
    mv = _host_bytes(buf)
    h = read_header(mv, max_bytes=max_bytes)
    coder, byte_stages = parse_pipeline(h["codec"])
    T, L, K = h["shape"]
    E = h["num_experts"]
    if h["format_version"] == 1:
        coder = v1_coder(coder, [s.codec_id for s in byte_stages], E, legacy_bitpack)
    out_dtype = _out_dtype(torch, index_dtype, E)
    cu = check_cu_seqlens(np.frombuffer(mv[h["_cu_offset"] : h["_payload_offset"]], dtype="<i8"), T)
    layer_ids = np.asarray(h["layer_ids"], dtype=np.int64)
    where = str(device)
    kernel = _KERNELS.get(type(coder))
    if byte_stages and host == "frame":
        names = "+".join(s.codec_id for s in byte_stages)
        raise ConfigError(f"this buffer's byte stage {names!r} has no device kernel (device kernels: "
                          f"{', '.join(DEVICE_CODECS)}); pass host='byte-stages' to inflate it on the host and decode "
                          f"the {coder.codec_id} ids on {where}, or host='all'")
    if kernel is None:
        if host != "all":
            raise ConfigError(f"codec {coder.codec_id!r} ({type(coder).__name__}) has no device kernel (device "
                              f"kernels: {', '.join(DEVICE_CODECS)}); pass host='all' to decode it on the host and "
                              f"copy the result to {where}")
        routes = decode(mv, max_bytes=max_bytes, legacy_bitpack=legacy_bitpack)
        values = _copy_to(torch, routes.values, device, out_dtype)
        weights = None if routes.weights is None else _copy_to(torch, routes.weights, device, torch.float32)
        stages = (("frame", "host"), *((s.codec_id, "host") for s in byte_stages), (coder.codec_id, "host"),
                  ("copy", where))
        return DeviceRoutes(values, cu, E, layer_ids, weights, stages)
    payload: Any = mv[h["_payload_offset"] : h["_payload_offset"] + h["_payload_length"]]
    for stage in byte_stages:  # host="byte-stages" or "all": inflate on the host, exactly what the id codec reads
        payload = byte_view(stage.decode(payload, coder.encoded_size((T, L, K), compact_dtype(E), E)))
    values = torch.empty((T, L, K), dtype=out_dtype, device=device)
    kernel(torch, _to_device(torch, payload, device), coder, (T, L, K), E, values, chunk_ids)
    if not coder.checks_rows:
        _check_rows(torch, values, E, h["layer_ids"], chunk_ids)
    weights = None
    if "weights" in h:
        w_off = h["_payload_offset"] + h["_payload_length"]
        block = _to_device(torch, mv[w_off : w_off + h["_weights_length"]], device)
        weights = _weights(torch, block, WeightCodec.from_config(h["weights"]), values)
    stages = (("frame", "host"), *((s.codec_id, "host") for s in byte_stages), (coder.codec_id, where))
    return DeviceRoutes(values, cu, E, layer_ids, weights, stages)

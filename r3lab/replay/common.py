"""What both replay backends share: the exception and the validation of one router's replay ids."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from r3lab.errors import ReplayError

__all__ = ["release_tuple", "in_release_range"]


def release_tuple(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: ``"0.19.2rc1+cu130"`` -> ``(0, 19, 2)`` (a part's trailing letters
    and every part after the first without a leading digit are dropped)."""
    out = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for c in part:
            if not c.isdigit():
                break
            digits += c
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def in_release_range(version: str, lo: tuple[int, ...], hi: tuple[int, ...]) -> bool:
    """Whether ``version`` is at least ``lo`` and, compared on ``hi``'s length, at most ``hi`` (``hi=(5, 25)``
    admits every 5.25.x)."""
    rel = release_tuple(version)
    return lo <= rel and rel[: len(hi)] <= hi


def check_route_tensor(
    ids: Any, *, top_k: int | None, num_experts: int, what: str = "ids", allow_3d: bool = True
) -> torch.Tensor:
    """Validate one router's replay ids and return them as an int64 tensor ``[tokens, top_k]``.

    Accepts a torch tensor or a numpy array of any integer dtype (uint8/uint16 from the wire included),
    ``[tokens, top_k]`` or, with ``allow_3d``, ``[B, S, top_k]`` (flattened row-major); ``top_k=None``
    takes it from the array. Raises :class:`ReplayError` naming
    ``what`` for a wrong rank or top_k, a non-integer dtype, ids outside ``[0, num_experts)`` and rows
    that repeat an id (duplicates break Megatron's dispatcher split sizes).
    """
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise ReplayError(f"{what}: ids must have an integer dtype, got {ids.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(ids).astype(np.int64, copy=False))
    elif isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ReplayError(f"{what}: ids must have an integer dtype, got {ids.dtype}")
        t = ids.detach().to(torch.int64)
    else:
        raise ReplayError(f"{what}: ids must be a torch.Tensor or numpy array, got {type(ids).__name__}")
    if t.ndim == 3 and allow_3d:
        t = t.reshape(-1, t.shape[-1])
    if top_k is None and t.ndim == 2:
        top_k = int(t.shape[1])
    if t.ndim != 2 or top_k is None or t.shape[1] != top_k or top_k < 1:
        raise ReplayError(f"{what}: ids must be [tokens, top_k={top_k}], got shape {tuple(ids.shape)}")
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            raise ReplayError(f"{what}: expert id {bad} out of range [0, {num_experts})")
        if top_k > 1:
            s = t.sort(dim=1).values
            dup = (s[:, 1:] == s[:, :-1]).any(dim=1)
            if bool(dup.any()):
                row = int(dup.nonzero()[0, 0])
                raise ReplayError(f"{what}: repeated expert id in row {row}: {t[row].tolist()}")
    return t.contiguous()

"""A transformers trainer model: the checkpoint with fp32 routers, and its one log-prob forward.

:func:`score_batch` is the trainer's one forward that scores tokens: a right-padded batch, optionally
replaying routes (:func:`~r3lab.replay.hf.hf_replay`) or recording what the routers chose, with or without
gradients. :func:`hf_token_logprobs` (one sequence, no grad) and :func:`recompute_routes` (the engine's row
convention) are built on it. transformers itself is imported only by :func:`load_hf_model`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch

from r3lab.moe_layout import MoELayout
from r3lab.replay.common import ReplayError
from r3lab.replay.hf import find_hf_routers, hf_replay
from r3lab.routes import Routes

# ---- fp32 routers in a lower-precision model ----------------------------------------------------
_CASTS: weakref.WeakKeyDictionary[torch.nn.Module, RouterCasts] = weakref.WeakKeyDictionary()


def _cast_inputs_fp32(module: torch.nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) else a for a in args)


_cast_inputs_fp32._r3lab_router_cast = True  # type: ignore[attr-defined]


def count_router_cast_hooks(model: torch.nn.Module) -> int:
    """Number of fp32 input-cast hooks r3lab has put on ``model``'s routers (:func:`keep_routers_fp32`)."""
    return sum(
        1 for m in model.modules() for h in m._forward_pre_hooks.values() if getattr(h, "_r3lab_router_cast", False)
    )


class RouterCasts:
    """Routers of a lower-precision model held in fp32, their inputs cast to fp32 by a forward pre-hook.

    :meth:`remove` (or leaving the ``with`` block) takes the hooks off and gives every router parameter and
    buffer back the dtype it had (transformers may already keep some in fp32). Made by :func:`keep_routers_fp32`.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.routers = find_hf_routers(model)
        self._dtypes = {g: _tensor_dtypes(r) for g, r in self.routers.items()}
        self._handles: list[Any] = []
        try:
            for r in self.routers.values():
                r.float()
                self._handles.append(r.register_forward_pre_hook(_cast_inputs_fp32))
        except BaseException:
            self.remove()
            raise

    def __len__(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        """Take the hooks off and restore each router's dtype (idempotent)."""
        while self._handles:
            self._handles.pop().remove()
        with torch.no_grad():
            for g, r in self.routers.items():
                for name, p in r.named_parameters():
                    p.data = p.data.to(self._dtypes[g][name])
                for name, b in r.named_buffers():
                    owner, _, attr = name.rpartition(".")
                    setattr(r.get_submodule(owner), attr, b.to(self._dtypes[g][name]))
        if _CASTS.get(self.model) is self:
            del _CASTS[self.model]

    def __enter__(self) -> RouterCasts:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _tensor_dtypes(module: torch.nn.Module) -> dict[str, torch.dtype]:
    return {n: t.dtype for n, t in [*module.named_parameters(), *module.named_buffers()]}


def keep_routers_fp32(model: torch.nn.Module) -> RouterCasts:
    """Run ``model``'s MoE routers (and their inputs) in fp32, as Megatron and most RL stacks do.

    Returns the :class:`RouterCasts` handle; :func:`remove_router_casts` finds it again from the model.
    Raises :class:`ReplayError` if the routers already carry r3lab's cast hooks.
    """
    if count_router_cast_hooks(model):
        raise ReplayError("the routers already run in fp32 (r3lab cast hooks present); call remove_router_casts first")
    casts = RouterCasts(model)
    _CASTS[model] = casts
    return casts


def remove_router_casts(model: torch.nn.Module) -> int:
    """Undo :func:`keep_routers_fp32` (or :func:`load_hf_model`'s fp32 routers); returns the hooks removed."""
    casts = _CASTS.get(model)
    if casts is None:
        return 0
    n = len(casts)
    casts.remove()
    return n


# ---- checkpoint, log-prob forward, recomputation ------------------------------------------------
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_hf_model(model_dir: str | Path, dtype: str = "float32") -> torch.nn.Module:
    """The checkpoint in transformers, eval mode. ``"bfloat16"`` keeps routers (and their inputs) in fp32.

    The fp32 routers are a :class:`RouterCasts` (:func:`count_router_cast_hooks` counts its hooks,
    :func:`remove_router_casts` takes them off).
    """
    if dtype not in _DTYPES:
        raise ReplayError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    from transformers import AutoModelForCausalLM

    td = _DTYPES[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=td)
    model.eval()
    if td != torch.float32:
        keep_routers_fp32(model)
    return model


def _token_tensor(token_ids: Any) -> torch.Tensor:
    arr = np.asarray(token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids))
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise ReplayError(
            f"token_ids must be a non-empty 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}"
        )
    return torch.tensor([arr.tolist()])


@dataclass
class Scores:
    """What :func:`score_batch` returns. Token values are flat over the scored positions, row-major (sample by
    sample, positions in order), as tensors on the model's device (with a graph when ``grad=True``)."""

    logprobs: torch.Tensor  # float32 log p(token t | tokens < t) at every scored position t
    entropy: torch.Tensor | None  # float32 entropy of the next-token distribution that scored t (entropy=True)
    routes: Routes | None  # record=True: the ids the routers used, one sequence per row, padding dropped


def score_batch(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scored: torch.Tensor,
    *,
    routes: Routes | None = None,
    record: bool = False,
    grad: bool = False,
    entropy: bool = False,
    weights: str | None = None,
    record_weights: bool = False,
) -> Scores:
    """One forward over a right-padded batch ``ids [B, S]``; scores the positions where ``scored [B, S]`` is True.

    Position t is scored from the logits at t - 1 (so ``scored[:, 0]`` must be False). ``routes`` (one
    sequence per row, as many rows as the row's real tokens) is replayed in every MoE router; ``record``
    returns the ids the routers used (their own, or under replay the replayed ones). ``attention_mask``
    None (or all ones) runs the plain causal forward. ``weights`` (``"stop"``, ``"straight"``; needs ``routes``
    that carry routing weights) also replays the engine's routing weights (:func:`~r3lab.replay.hf.hf_replay`).
    ``record_weights`` (with ``record``, no ``routes``): the recorded routes carry the routers' own top-k weights.
    """
    if record_weights and (not record or routes is not None):
        raise ReplayError("record_weights records the routers' own weights: it needs record=True and no routes")
    if ids.ndim != 2 or scored.shape != ids.shape:
        raise ReplayError(f"ids and scored must both be [B, S], got {tuple(ids.shape)} and {tuple(scored.shape)}")
    scored = scored.bool()
    if scored[:, 0].any():
        raise ReplayError("position 0 cannot be scored: no token precedes it")
    mask = attention_mask
    if mask is not None:
        if mask.shape != ids.shape:
            raise ReplayError(f"attention_mask {tuple(mask.shape)} differs from ids {tuple(ids.shape)}")
        if (scored & ~mask.bool()).any():
            raise ReplayError("a scored position is padding")
        if bool(mask.bool().all()):
            mask = None  # the plain causal forward: the same numerics as an unpadded call
    if routes is not None:
        if not isinstance(routes, Routes):
            raise ReplayError(f"routes must be r3lab.routes.Routes, got {type(routes).__name__}")
        ctx: Any = hf_replay(model, routes, record_replayed=record, attention_mask=mask, weights=weights)
    elif weights is not None:
        raise ReplayError(f"weights={weights!r} needs routes (the engine's ids and weights)")
    elif record:
        ctx = hf_replay(model, mode="record")
    else:
        ctx = contextlib.nullcontext()
    device = next(model.parameters()).device
    with torch.set_grad_enabled(grad), ctx as rep:
        kw = {} if mask is None else {"attention_mask": mask.to(device)}
        logits = model(input_ids=ids.to(device), **kw).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1)
    sel = scored[:, 1:].to(device)
    out = lp.gather(2, ids[:, 1:].to(device)[..., None])[..., 0][sel]
    ent = -(lp.exp() * lp).sum(-1)[sel] if entropy else None
    used = None
    if record:
        used = rep.to_routes(attention_mask=mask, weights=record_weights) if mask is not None else rep.to_routes(
            cu_seqlens=np.arange(ids.shape[0] + 1) * ids.shape[1], weights=record_weights)
    return Scores(out, ent, used)


@overload
def hf_token_logprobs(
    model: torch.nn.Module, token_ids: Sequence[int], *, prompt_len: int = 1, routes: Routes | None = None,
    record: Literal[True],
) -> tuple[np.ndarray, Routes]: ...


@overload
def hf_token_logprobs(
    model: torch.nn.Module, token_ids: Sequence[int], *, prompt_len: int = 1, routes: Routes | None = None,
    record: bool = False,
) -> tuple[np.ndarray, Routes | None]: ...


def hf_token_logprobs(
    model: torch.nn.Module,
    token_ids: Sequence[int],
    *,
    prompt_len: int = 1,
    routes: Routes | None = None,
    record: bool = False,
) -> tuple[np.ndarray, Routes | None]:
    """One no-grad forward over ``token_ids``: float64 ``log p(token t | tokens < t)`` for t in ``[prompt_len, len)``.

    ``routes`` (a :class:`~r3lab.routes.Routes` with ``len(token_ids)`` rows; extra layers such as dense
    ones are ignored) is replayed in every MoE router. With ``record=True`` the second value is the
    Routes the routers used in this forward (``len(token_ids)`` rows, one sequence, ``layer_ids`` = the
    MoE layers): their own choice, or under replay the replayed ids; otherwise it is ``None``.
    Inputs go to the device of the model's first parameter; the result is on the CPU.
    """
    ids = _token_tensor(token_ids)
    n = ids.shape[1]
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)) or not 1 <= prompt_len <= n:
        raise ReplayError(f"prompt_len must be an int in [1, {n}] (len(token_ids)), got {prompt_len!r}")
    if routes is not None:
        if not isinstance(routes, Routes):
            raise ReplayError(f"routes must be r3lab.routes.Routes, got {type(routes).__name__}")
        if routes.total_tokens != n:
            raise ReplayError(f"routes have {routes.total_tokens} token rows for {n} tokens; pass one row per token")
    scored = torch.zeros_like(ids, dtype=torch.bool)
    scored[0, prompt_len:] = True
    s = score_batch(model, ids, None, scored, routes=routes, record=record)
    return s.logprobs.cpu().numpy().astype(np.float64), s.routes


def recompute_routes(
    model_dir: str | Path,
    sequences: Sequence[Sequence[int]],
    *,
    dtype: str = "float32",
    model: torch.nn.Module | None = None,
    return_logprobs: bool = False,
) -> Routes | tuple[Routes, list[np.ndarray]]:
    """Routes of each token sequence under transformers, in the engine's convention (``len - 1`` rows).

    ``model`` (already loaded, e.g. on a GPU) is used as is, else :func:`load_hf_model` loads
    ``model_dir`` in ``dtype``. ``layer_ids`` are the checkpoint's MoE layers (global ids). With
    ``return_logprobs`` also returns, per sequence, float64 ``log p(token t | tokens < t)`` for t >= 1.
    """
    layout = MoELayout.from_model_dir(model_dir)
    model = model if model is not None else load_hf_model(model_dir, dtype)
    want = list(layout.moe_layer_ids)
    per_seq, lps = [], []
    for i, seq in enumerate(sequences):
        lp, used = hf_token_logprobs(model, seq, prompt_len=1, record=True)
        if used.layer_ids.tolist() != want:
            got = used.layer_ids.tolist()
            raise ReplayError(f"sequence {i}: the model's routers are layers {got}, {model_dir} says MoE layers {want}")
        per_seq.append(used.values[: used.total_tokens - 1])
        lps.append(lp)
    routes = Routes.from_list(per_seq, num_experts=layout.num_experts, layer_ids=want)
    return (routes, lps) if return_logprobs else routes

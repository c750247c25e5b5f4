"""An independent reference for captured routes: the same checkpoint in transformers, hooks on each router.

Used by tests, the model build script and the GPU check to measure how often the inference engine and
a trainer-style forward pick different expert sets. Nothing here touches vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import R3LabError
from r3lab.moe_layout import MoELayout
from r3lab.routes import Routes

__all__ = ["load_reference_model", "record_router_topk", "recompute_routes", "route_agreement", "permuted_experts"]


def _routers(model: Any) -> dict[int, Any]:
    """Global layer number -> router module (``...layers.<i>.mlp.gate``)."""
    out = {}
    for name, mod in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 4 and parts[-1] == "gate" and parts[-2] == "mlp" and parts[-4] == "layers":
            out[int(parts[-3])] = mod
    return out


@contextmanager
def record_router_topk(model: Any) -> Iterator[dict[int, list[Any]]]:
    """Record each router's top-k ids per forward: ``{layer: [LongTensor [tokens, k], ...]}``.

    The hooks always come off, also when the forward raises.
    """
    rec: dict[int, list[Any]] = {}
    handles = []

    def hook(layer: int):
        def fn(mod, inp, out):
            idx = out[-1] if isinstance(out, tuple) else None
            if idx is None or idx.dtype.is_floating_point:
                raise R3LabError(f"router of layer {layer} ({type(mod).__name__}) returns no top-k ids")
            rec.setdefault(layer, []).append(idx.detach().reshape(-1, idx.shape[-1]).cpu())
        return fn

    try:
        for layer, mod in sorted(_routers(model).items()):
            handles.append(mod.register_forward_hook(hook(layer)))
        yield rec
    finally:
        for h in handles:
            h.remove()


def load_reference_model(model_dir: str | Path, dtype: str = "float32") -> Any:
    """The checkpoint in transformers, eval mode. ``bfloat16`` keeps routers (and their inputs) in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    td = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=td)
    model.eval()
    if td != torch.float32:
        for r in _routers(model).values():
            r.float()
            r.register_forward_pre_hook(lambda m, args: tuple(a.float() if torch.is_tensor(a) else a for a in args))
    return model


def recompute_routes(model_dir: str | Path, sequences: Sequence[Sequence[int]], *, dtype: str = "float32",
                     model: Any = None, return_logprobs: bool = False):
    """Routes of each token sequence under transformers, in the engine's convention (``len - 1`` rows).

    With ``return_logprobs`` also returns, per sequence, ``log p(token t | tokens < t)`` for t >= 1.
    """
    import torch

    layout = MoELayout.from_model_dir(model_dir)
    model = model if model is not None else load_reference_model(model_dir, dtype)
    per_seq, lps = [], []
    with torch.no_grad(), record_router_topk(model) as rec:
        for seq in sequences:
            rec.clear()
            ids = torch.tensor([list(seq)], dtype=torch.long)
            logits = model(input_ids=ids).logits.float()
            missing = [g for g in layout.moe_layer_ids if g not in rec]
            if missing:
                raise R3LabError(f"no router output recorded for MoE layers {missing}")
            arr = np.stack([rec[g][0].numpy() for g in layout.moe_layer_ids], axis=1)[: len(seq) - 1]
            per_seq.append(arr)
            if return_logprobs:
                lp = torch.log_softmax(logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
                lps.append(lp.numpy())
    routes = Routes.from_list(per_seq, num_experts=layout.num_experts, layer_ids=list(layout.moe_layer_ids))
    return (routes, lps) if return_logprobs else routes


def route_agreement(a: Routes, b: Routes) -> dict[str, Any]:
    """Set-based agreement of two route sets over the same tokens (order inside top-k ignored).

    Returns ``per_layer_agreement`` (global layer -> fraction of tokens with the same expert set),
    ``per_layer_overlap`` (mean shared ids / k), ``router_disagreement`` (1 - mean set agreement),
    ``token_disagreement`` (tokens where any layer differs), and ``chance`` = k / E, the overlap of
    unrelated routes.
    """
    if a.values.shape != b.values.shape or not np.array_equal(a.layer_ids, b.layer_ids) or a.num_experts != b.num_experts:
        raise R3LabError(f"cannot compare {a!r} with {b!r}")
    E, K = a.num_experts, a.top_k
    ha = np.zeros(a.values.shape[:2] + (E,), dtype=bool)
    hb = np.zeros_like(ha)
    np.put_along_axis(ha, a.values.astype(np.int64), True, axis=2)
    np.put_along_axis(hb, b.values.astype(np.int64), True, axis=2)
    shared = (ha & hb).sum(-1)  # [T, L]
    same = shared == K
    lids = [int(g) for g in a.layer_ids]
    return {
        "per_layer_agreement": {g: float(same[:, j].mean()) for j, g in enumerate(lids)},
        "per_layer_overlap": {g: float(shared[:, j].mean() / K) for j, g in enumerate(lids)},
        "router_disagreement": float(1.0 - same.mean()),
        "token_disagreement": float((~same).any(axis=1).mean()),
        "chance": K / E,
        "tokens": int(same.shape[0]),
    }


def permuted_experts(model_dir: str | Path, layers: Sequence[int]) -> tuple[dict[str, Any], dict[str, Any], np.ndarray]:
    """A weight update that relabels the experts of ``layers`` and leaves the function unchanged.

    New expert e holds old expert ``perm[e]`` (router row, expert-score bias, expert MLP). For
    group-limited routers (``n_group > 1``) whole groups move, so group membership is preserved.
    Returns ``(update, original, perm)``: ``original`` holds the same keys with the checkpoint's
    values, to undo the update. Routes after the update are ``argsort(perm)[routes before]``.
    """
    import json

    import torch
    from safetensors.torch import load_file

    layout = MoELayout.from_model_dir(model_dir)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    E = layout.num_experts
    groups = int(cfg.get("n_group", 1) or 1)
    perm = np.roll(np.arange(E), E // groups if groups > 1 else 3)
    sd: dict[str, Any] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    p = torch.as_tensor(perm)
    new: dict[str, Any] = {}
    for g in layers:
        if g not in layout.moe_layer_ids:
            raise R3LabError(f"layer {g} is not an MoE layer ({list(layout.moe_layer_ids)})")
        pre = f"model.layers.{g}.mlp."
        new[pre + "gate.weight"] = sd[pre + "gate.weight"][p]
        if pre + "gate.e_score_correction_bias" in sd:
            new[pre + "gate.e_score_correction_bias"] = sd[pre + "gate.e_score_correction_bias"][p]
        for e in range(E):
            for w in ("gate_proj", "up_proj", "down_proj"):
                new[f"{pre}experts.{e}.{w}.weight"] = sd[f"{pre}experts.{int(perm[e])}.{w}.weight"]
    return new, {k: sd[k] for k in new}, perm

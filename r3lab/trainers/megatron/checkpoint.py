"""A Megatron-core GPTModel from a Hugging Face checkpoint, and its weights back: mbridge's mappings, on CPU.

The name and format mapping (Hugging Face <-> Megatron names, q/k/v and gate/up fusion, TP split and
merge rules) is mbridge 0.15.1's (the bridge verl uses; ``pip install --no-deps mbridge==0.15.1``), family
by family (``qwen3_moe``, ``glm4_moe``, ...), or r3lab's own for a family mbridge does not map (the family's
``mbridge_bridge`` in :mod:`r3lab.families`, e.g. OLMoE: :mod:`r3lab.trainers.megatron.mbridge_bridges.olmoe`). What
this module adds, because mbridge assumes Transformer Engine and CUDA:

* the model is built with Megatron's local spec (:func:`~r3lab.trainers.megatron.cpu.local_block_spec`);
  its parameter names differ from TE's in two places, translated before mbridge's mapping:
  ``input_layernorm.weight`` -> ``self_attention.linear_qkv.layer_norm_weight`` and
  ``mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`` -> ``mlp.experts.linear_fc{1,2}.weight{e}``
  (``e`` the global expert id, ``ep_rank * experts_per_rank + j``);
* every rank reads the tensors it needs from the safetensors file and keeps its own TP/EP shard (no
  scatter), and :func:`export_hf_state_dict` gathers the shards over TP/ETP with mbridge's merge rules and
  collects the pieces on one rank with ``gather_object`` (fine for small models; a large one should
  stream tensor by tensor, as mbridge's ``export_weights`` does on GPU nodes);
* mbridge's private mapping methods are reached through :mod:`~r3lab.trainers.megatron.mbridge_api` only;
* the TransformerConfig gets the CPU settings (:data:`~r3lab.trainers.megatron.cpu.CPU_CONFIG`),
  routing replay on, load balancing off, and the family's corrections of mbridge's config
  (:func:`r3lab.families.megatron_overrides`; for ``glm4_moe``:
  ``add_qkv_bias`` from the checkpoint's ``attention_bias`` (mbridge hard-codes True), the partial rotary
  factor and rope theta from ``rope_parameters`` (transformers 5 moved them there; mbridge reads the old
  attributes), the shared expert's width times ``n_shared_experts``, and the router's group settings
  (``n_group``/``topk_group``) which mbridge leaves unset).

Group-limited routing differs by construction between Megatron-core and transformers/vLLM for some
configs (:func:`r3lab.families.group_routing_mismatch`): Megatron scores a group by the sum of its best
``top_k // topk_group`` experts, DeepSeek-V3-style models (GLM-4-MoE included) by the sum of their best 2.
:func:`build_model` warns (:class:`GroupRoutingMismatchWarning`) or raises, as asked; replayed routes
are unaffected (replay bypasses selection).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from r3lab.errors import MegatronLoadError
from r3lab.families import FAMILIES, family_of, group_routing_mismatch, megatron_overrides
from r3lab.moe_layout import MoELayout
from r3lab.slicing import ParallelLayout
from r3lab.trainers.megatron.cpu import CPU_CONFIG, gpt_chunks, init_parallel, patch_megatron_for_cpu
from r3lab.trainers.megatron.mbridge_api import (
    bridge_class,
    check_mbridge_api,
    hf_names,
    mbridge_registry,
    merge_across_tp,
    split_across_tp,
    to_hf_format,
    to_megatron_format,
)
from r3lab.trainers.megatron.model import MegatronModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


class GroupRoutingMismatchWarning(UserWarning):
    """Megatron-core and transformers/vLLM select experts differently for this config (group scoring)."""


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise MegatronLoadError(f"{model_dir} has no config.json")
    return json.loads(path.read_text())


def layout_for(model_dir: str | Path, **parallel: Any) -> ParallelLayout:
    """A :class:`ParallelLayout` with the checkpoint's layers (``num_layers``, ``moe_layer_ids``) and ``parallel``."""
    moe = MoELayout.from_model_dir(model_dir)
    return ParallelLayout(num_layers=moe.num_hidden_layers, moe_layer_ids=tuple(moe.moe_layer_ids), **parallel)


def _bridge(hf_config: Any, dtype: torch.dtype):
    """The family's own mapping (``mbridge_bridge`` in :mod:`r3lab.families`), else mbridge's."""
    fam = family_of(str(hf_config.model_type))
    if fam is not None and fam.mbridge_bridge is not None:
        import importlib

        module, _, name = fam.mbridge_bridge.partition(":")
        cls = getattr(importlib.import_module(module), name)
        check_mbridge_api(cls)
    else:
        cls = bridge_class(hf_config.model_type)
    if cls is None:
        known = sorted({*mbridge_registry(), *(f.model_type for f in FAMILIES.values() if f.mbridge_bridge)})
        raise MegatronLoadError(f"neither mbridge nor r3lab.families maps model_type {hf_config.model_type!r} to "
                                f"Megatron; known: {known} (docs/adding-a-model-family.md)")
    return cls(hf_config, dtype=dtype)


def _config_overrides(cfg: dict[str, Any], layout: ParallelLayout) -> dict[str, Any]:
    """The TransformerConfig settings: the CPU ones, replay on, load balancing off, this layout's, then what the
    checkpoint's config and its family say (:func:`r3lab.families.megatron_overrides`)."""
    o: dict[str, Any] = dict(CPU_CONFIG)
    o.update(
        moe_enable_routing_replay=True,
        variable_seq_lengths=False,  # the allgather dispatcher refuses it; micro-batches have a fixed shape
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        sequence_parallel=layout.sequence_parallel and layout.tp > 1,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
    )
    o.update(megatron_overrides(cfg))
    return o


def build_model(
    model_dir: str | Path,
    layout: ParallelLayout,
    *,
    dtype: str = "float32",
    etp: int | None = None,
    group_routing: str = "warn",
    init: bool = True,
    load: bool = True,
    loader: str | None = None,
) -> MegatronModel:
    """Build this rank's Megatron-core GPTModel chunks for ``layout`` and load ``model_dir``'s weights (eval mode).

    Call in every rank of a torch.distributed world of ``layout.world_size`` processes (gloo on CPU), e.g.
    under :func:`~r3lab.trainers.megatron.launch.launch`. ``init`` (re)initialises Megatron's parallel groups
    from ``layout``; ``etp`` is the expert tensor-parallel size (None: tp). ``group_routing``: what to do when
    :func:`group_routing_mismatch` finds the config routes differently in Megatron: ``"warn"``, ``"raise"`` or
    ``"ignore"``. Routers get a ``RouterReplay`` each (``moe_enable_routing_replay``). ``loader``: whose mappings
    build and load it, ``"mbridge"`` or ``"megatron-bridge"`` (:mod:`~r3lab.trainers.megatron.megatron_bridge_loader`;
    None: :func:`r3lab.trainer_registry.default_megatron_loader`).
    """
    from r3lab.trainer_registry import megatron_loader

    loader = megatron_loader(loader)
    if dtype not in _DTYPES:
        raise MegatronLoadError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if group_routing not in ("warn", "raise", "ignore"):
        raise MegatronLoadError(f"group_routing must be 'warn', 'raise' or 'ignore', got {group_routing!r}")
    if layout.cp > 1:
        raise MegatronLoadError(
            "context parallelism needs Transformer Engine attention: Megatron's local DotProductAttention asserts "
            "'Context parallelism is only supported by TEDotProductAttention!' (GPU nodes only)"
        )
    model_dir = Path(model_dir)
    cfg = _read_config(model_dir)
    moe = MoELayout.from_config(cfg)
    if layout.num_layers != moe.num_hidden_layers or tuple(layout.router_layers) != tuple(moe.moe_layer_ids):
        raise MegatronLoadError(
            f"layout has {layout.num_layers} layers, MoE layers {list(layout.router_layers)}; {model_dir.name} has "
            f"{moe.num_hidden_layers}, MoE layers {list(moe.moe_layer_ids)} (use layout_for)"
        )
    why = group_routing_mismatch(cfg)
    if why and group_routing == "raise":
        raise MegatronLoadError(f"{model_dir.name}: {why}")
    if why and group_routing == "warn":
        warnings.warn(f"{model_dir.name}: {why}", GroupRoutingMismatchWarning, stacklevel=2)
    patch_megatron_for_cpu()
    if init:
        init_parallel(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, cp=layout.cp, ep=layout.ep, etp=etp)
    import torch.distributed as dist
    from transformers import AutoConfig

    want = layout.world_size
    if dist.get_world_size() != want:
        raise MegatronLoadError(
            f"the layout needs {want} ranks (tp*pp*cp*dp), torch.distributed has {dist.get_world_size()}"
        )
    if loader == "megatron-bridge":
        from r3lab.trainers.megatron import megatron_bridge_loader

        return megatron_bridge_loader.build(model_dir, layout, cfg, dtype=_DTYPES[dtype], etp=etp,
                                            overrides=_config_overrides(cfg, layout), load=load)
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    td = _DTYPES[dtype]
    bridge = _bridge(hf_config, td)
    over = _config_overrides(cfg, layout)
    rotary_percent, rotary_base = over.pop("_rotary_percent"), over.pop("_rotary_base")
    bridge.set_extra_args(**over)
    config = bridge.config
    chunks = gpt_chunks(
        config,
        layout.vpp,
        lambda model: model.eval(),
        vocab_size=int(cfg["vocab_size"]),
        max_sequence_length=int(cfg["max_position_embeddings"]),
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=rotary_percent,
        rotary_base=int(rotary_base) if float(rotary_base).is_integer() else rotary_base,
        spec_hook=getattr(bridge, "local_spec_hook", None),
    )
    out = MegatronModel(chunks, layout, model_dir, bridge, hf_config)
    if load:
        load_checkpoint(out)
    return out


# ---- names ------------------------------------------------------------------------------------
def _local_tensors(chunk: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters, then the routers' ``expert_bias`` buffers (a state_dict entry, not a parameter)."""
    params = list(chunk.named_parameters())
    seen = {n for n, _ in params}
    extra = [(n, t) for n, t in chunk.named_buffers() if n.endswith("expert_bias") and n not in seen]
    return params + extra


def _te_global_name(chunk: torch.nn.Module, name: str, experts_per_rank: int, ep_rank: int) -> str:
    """A local-spec parameter name -> the TE-spec, global name mbridge's mappings expect."""
    m = _LAYER.match(name)
    if m:
        layer = chunk.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{int(layer.layer_number) - 1}." + name[m.end() :]
    if name.endswith(".input_layernorm.weight"):
        return name[: -len("input_layernorm.weight")] + "self_attention.linear_qkv.layer_norm_weight"
    e = _LOCAL_EXPERT.search(name)
    if e:
        return f"{name[: e.start()]}.mlp.experts.{e.group(2)}.weight{ep_rank * experts_per_rank + int(e.group(1))}"
    return name


def _is_expert(te_name: str) -> bool:
    return ".mlp.experts.linear_fc" in te_name


def _tp_of(te_name: str) -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    if _is_expert(te_name):
        return (
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_group(),
        )
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
    )


def _mapped(model: MegatronModel):
    """(chunk, local name, tensor, TE global name, HF names) for every tensor of this rank, in a fixed order."""
    from megatron.core import parallel_state as ps

    n_exp = int(model.config.num_moe_experts or 0)
    per_rank = n_exp // ps.get_expert_model_parallel_world_size() if n_exp else 0
    ep_rank = ps.get_expert_model_parallel_rank()
    for chunk in model.chunks:
        for name, t in _local_tensors(chunk):
            te = _te_global_name(chunk, name, per_rank, ep_rank)
            try:
                hf = hf_names(model.bridge, te)
            except (NotImplementedError, AssertionError, IndexError) as e:
                raise MegatronLoadError(f"mbridge maps no checkpoint name to Megatron parameter {name!r} ({te})") from e
            yield chunk, name, t, te, hf


def load_checkpoint(model: MegatronModel, files: Sequence[str | Path] | None = None) -> None:
    """Copy the checkpoint's tensors into this rank's shards (every tensor checked by name and shape).

    ``files``: safetensors files holding the checkpoint's names (default: ``model.model_dir``'s), e.g. exported
    weights saved by :meth:`~r3lab.trainers.megatron.trainer.MegatronTrainer.load_weights`; each rank reads only
    the tensors its shards need and converts them to the model's dtype.
    """
    from safetensors import safe_open

    if model.loader == "megatron-bridge":
        from r3lab.trainers.megatron import megatron_bridge_loader

        return megatron_bridge_loader.load_weights(model, files)
    files = sorted(model.model_dir.glob("*.safetensors")) if files is None else [Path(f) for f in files]
    if not files:
        raise MegatronLoadError(f"{model.model_dir} has no .safetensors file")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            where.update({k: f for k in h.keys()})
    used: set[str] = set()
    handles: dict[Path, Any] = {}
    try:
        with torch.no_grad():
            for _, name, t, te, hf_names in _mapped(model):
                missing = [h for h in hf_names if h not in where]
                if missing:
                    raise MegatronLoadError(f"{model.model_dir.name} lacks {missing} (for Megatron {name!r})")
                hf = []
                for h in hf_names:
                    if where[h] not in handles:
                        handles[where[h]] = safe_open(str(where[h]), "pt")
                    hf.append(handles[where[h]].get_tensor(h))
                used.update(hf_names)
                full = to_megatron_format(model.bridge, te, hf)
                size, rank, _ = _tp_of(te)
                piece = full
                if getattr(t, "tensor_model_parallel", False) and size > 1:
                    piece = split_across_tp(model.bridge, te, full, t, size)[rank]
                if tuple(piece.shape) != tuple(t.shape):
                    raise MegatronLoadError(
                        f"Megatron {name!r} has shape {tuple(t.shape)}, the checkpoint gives {tuple(piece.shape)} "
                        f"(from {hf_names})"
                    )
                t.copy_(piece.to(t.dtype))
    finally:
        handles.clear()
    model.loaded_names = used


def export_hf_state_dict(model: MegatronModel, *, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Gather the TP/ETP/EP/PP shards into the checkpoint's names and layout; the full dict on rank ``dst``.

    Collective: every rank of the world must call it. Tensors keep the model's dtype (cast to the checkpoint's
    to save it). Other ranks get None.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if model.loader == "megatron-bridge":
        from r3lab.trainers.megatron import megatron_bridge_loader

        return megatron_bridge_loader.export_weights(model, dst=dst)
    mine: dict[str, torch.Tensor] = {}
    owner_dense = (
        ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    owner_expert = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    with torch.no_grad():
        for _, _, t, te, _ in _mapped(model):
            size, _, group = _tp_of(te)
            full = t.detach()
            if getattr(t, "tensor_model_parallel", False) and size > 1:
                parts = [torch.empty_like(full) for _ in range(size)]
                dist.all_gather(parts, full.contiguous(), group=group)
                full = merge_across_tp(model.bridge, te, parts, t)
            if not (owner_expert if _is_expert(te) else owner_dense):
                continue
            names, tensors = to_hf_format(model.bridge, te, full)
            for n, x in zip(names, tensors, strict=True):
                mine[n] = x.detach().clone().contiguous()
    got: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == dst else None  # type: ignore[assignment]
    dist.gather_object(mine, got, dst=dst)
    if dist.get_rank() != dst:
        return None
    out: dict[str, torch.Tensor] = {}
    for r, part in enumerate(got):
        for n, x in part.items():
            if n in out:
                raise MegatronLoadError(f"two ranks exported {n!r} (rank {r} and an earlier one): ownership is wrong")
            out[n] = x
    return dict(sorted(out.items()))

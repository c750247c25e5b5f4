"""The Megatron trainer's model through NVIDIA Megatron-Bridge on CPU ranks: build and load, load again, export.

The ``megatron-bridge`` loader (:data:`r3lab.trainer_registry.MEGATRON_LOADERS`;
:func:`~r3lab.trainers.megatron.checkpoint.build_model` hands over to :func:`build` after its checks and the parallel
setup). Megatron-Bridge's ``AutoBridge.from_hf_pretrained(model_dir)`` gives the family's provider (its
TransformerConfig from the checkpoint's config) and its mappings (names, q/k/v and gate/up fusion, TP split and
merge, expert numbering under EP, pipeline stages); ``to_megatron_provider(load_weights=True)`` registers the load of
the checkpoint's tensors as a pre-wrap hook; :func:`~r3lab.trainers.megatron.megatron_bridge_api.provide_on_cpu`
builds this rank's chunks on CPU. Megatron-Bridge's mapping replaces r3lab's for every family it maps, OLMoE
included (``OlMoEBridge``). What r3lab sets on the provider, and why:

* the settings the mbridge loader sets too (:func:`~r3lab.trainers.megatron.checkpoint.build_model`'s
  ``overrides``): the CPU ones, routing replay on, load balancing off, fp32 routers, the layout's sequence
  parallelism and uneven pipeline stages, and the checkpoint's own values where a bridge's differ
  (:func:`r3lab.families.megatron_overrides`: ``add_qkv_bias`` from ``attention_bias``, the rotary fraction and base
  from ``rope_parameters``, the GLM-4-MoE shared expert's width times ``n_shared_experts``, OLMoE's router rule), and
  the parallel sizes;
* the dtype everywhere (``params_dtype``, ``pipeline_dtype``, ``autocast_dtype``; the bridges read bf16 from the
  checkpoint's ``dtype``), so fp32 runs are fp32 end to end;
* the layer spec: Megatron's local spec with CPU norms (:func:`~r3lab.trainers.megatron.cpu.local_block_spec`,
  which also builds dense and MoE layers by ``moe_layer_freq``), edited by the family's ``megatron_spec_hook``
  (:mod:`r3lab.families`). OLMoE's puts its full-width q/k norms there
  (:mod:`~r3lab.trainers.megatron.olmoe_qk_norm`): Megatron-Bridge's ``OLMoESelfAttention`` builds them
  ``num_attention_heads * head_dim`` wide on every rank, right at TP 1 only; r3lab's norms are TP-sharded and
  registered column-parallel for Megatron-Bridge's ``q_layernorm``/``k_layernorm`` mappings. OLMoE's family
  corrections also set its router rule ``moe_router_pre_softmax = not norm_topk_prob`` (``OlMoEBridge`` sets True
  whatever the checkpoint says; the shipped OLMoE has ``norm_topk_prob=False``, where both agree).

Multi-token prediction is refused: Megatron-Bridge's MTP block spec is Transformer Engine's
(``gpt_provider.mtp_block_spec``). Weights come back with ``AutoBridge.export_hf_weights`` (every rank takes part
in the gathers; one rank keeps the dict) and go in again with ``AutoBridge.load_hf_weights``. Both loads read the
tensors from memory (:func:`~r3lab.trainers.megatron.megatron_bridge_api.use_state`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from r3lab.errors import MegatronLoadError
from r3lab.families import family_of
from r3lab.slicing import ParallelLayout
from r3lab.trainers.megatron import megatron_bridge_api as mb
from r3lab.trainers.megatron.cpu import local_block_spec
from r3lab.trainers.megatron.model import MegatronModel, checkpoint_state_dict

__all__ = ["build", "load_weights", "export_weights", "spec_for", "provider_overrides"]


def _split_weight_modules(spec: Any) -> set[type]:
    """The module classes of a block spec whose weight is split over TP ranks along dim 0 (``weight_split_over_tp``)."""
    found: set[type] = set()

    def walk(x: Any) -> None:
        if isinstance(x, type):
            if getattr(x, "weight_split_over_tp", False):
                found.add(x)
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(spec)
    return found


def spec_for(model_type: str):
    """The layer spec callable for ``model_type``: ``spec(config, vp_stage=None)`` -> the local CPU block spec, edited
    by the family's ``megatron_spec_hook`` (:mod:`r3lab.families`), as ``GPTModelProvider.provide`` calls it. Modules
    whose weight is split over TP ranks are registered column-parallel for Megatron-Bridge's mappings."""
    fam = family_of(model_type)
    hook = None
    if fam is not None and fam.megatron_spec_hook is not None:
        module, _, name = fam.megatron_spec_hook.partition(":")
        hook = getattr(importlib.import_module(module), name)

    def spec(config: Any, vp_stage: int | None = None) -> Any:
        block = local_block_spec(config, vp_stage, hook)
        mb.register_column_parallel(*sorted(_split_weight_modules(block), key=lambda c: c.__qualname__))
        return block

    return spec


def provider_overrides(layout: ParallelLayout, overrides: dict[str, Any], *, dtype: torch.dtype,
                       etp: int | None) -> dict[str, Any]:
    """The provider fields r3lab sets on ``layout`` (module docstring), from the mbridge loader's TransformerConfig
    ``overrides`` (its private ``_rotary_*`` keys become provider fields)."""
    o = dict(overrides)
    o["rotary_percent"] = float(o.pop("_rotary_percent"))
    base = float(o.pop("_rotary_base"))
    o["rotary_base"] = int(base) if base.is_integer() else base
    o.update(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=etp if etp is not None else layout.tp,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
    )
    return o


def build(model_dir: Path, layout: ParallelLayout, cfg: dict[str, Any], *, dtype: torch.dtype, etp: int | None,
          overrides: dict[str, Any], load: bool) -> Any:
    """This rank's :class:`~r3lab.trainers.megatron.model.MegatronModel` through Megatron-Bridge (eval mode),
    the checkpoint loaded unless ``load`` is False. The parallel groups must be set up (gloo)."""

    bridge = mb.auto_bridge(model_dir)
    mb.add_local_expert_aliases(bridge)
    mb.use_state(bridge, checkpoint_state_dict(model_dir))
    provider = bridge.to_megatron_provider(load_weights=load)
    if getattr(provider, "mtp_num_layers", None):
        raise MegatronLoadError(f"{model_dir.name} has multi-token prediction layers: Megatron-Bridge's MTP block spec "
                                "needs Transformer Engine; load it with the mbridge loader")
    chunks = mb.provide_on_cpu(provider, spec=spec_for(str(cfg.get("model_type", ""))), dtype=dtype,
                               overrides=provider_overrides(layout, overrides, dtype=dtype, etp=etp))
    for c in chunks:
        c.eval()
    return MegatronModel(chunks, layout, model_dir, bridge, bridge.hf_pretrained.config, loader="megatron-bridge")


def load_weights(model: Any, files: Sequence[str | Path] | None = None) -> None:
    """Copy checkpoint-named tensors into this rank's shards with Megatron-Bridge's mappings: ``files`` (safetensors;
    default: the checkpoint's own), every name of the checkpoint."""
    from safetensors.torch import load_file


    if files is None:
        tensors = checkpoint_state_dict(model.model_dir)
    else:
        missing = [str(f) for f in files if not Path(f).is_file()]
        if missing:
            raise MegatronLoadError(f"no such safetensors file: {missing}")
        tensors = {}
        for f in files:
            tensors.update(load_file(str(f)))
    mb.use_state(model.bridge, tensors)
    model.bridge.load_hf_weights(model.chunks)


def export_weights(model: Any, *, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Every weight in the checkpoint's names and shapes (the model's dtype), gathered by Megatron-Bridge; the dict on
    rank ``dst``, None on the others. Collective: every rank of the world must call it."""
    import torch.distributed as dist

    keep = dist.get_rank() == dst
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.bridge.export_hf_weights(model.chunks, cpu=True, show_progress=False):
        if not keep:
            continue
        if name in out:
            raise MegatronLoadError(f"Megatron-Bridge exported {name!r} twice")
        out[name] = tensor.detach().clone().contiguous()
    return dict(sorted(out.items())) if keep else None

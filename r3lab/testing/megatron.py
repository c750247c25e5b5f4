"""Run megatron-core (0.16.1 or 0.19.2) on CPU ranks (gloo, loopback): tiny MoE GPT models for tests and benches.

A test harness on randomly initialised models. The CPU support itself is product code in
:mod:`r3lab.trainers.megatron` (the process-wide patches, the local spec with a plain RMSNorm, the forward
passes and the launcher of gloo ranks) and is re-exported here under the names the tests use.
The model uses the local (non-TE) layer spec with a plain RMSNorm module (the local spec's
``WrappedTorchNorm`` refuses sequence parallelism), learned-absolute positions, an explicit attention
mask and the ``allgather`` token dispatcher. Context parallelism needs Transformer Engine attention and
does not run here.

The parallel layout of a model is an :class:`r3lab.slicing.ParallelLayout` (the one set of layout
fields: the same object tells :func:`r3lab.slicing.shard` what each rank's routers see); a
:class:`TinyGPTSpec` adds the model's sizes to it.

Typical single-process use (world size 1)::

    from r3lab.slicing import ParallelLayout
    from r3lab.testing import megatron as mc
    mc.init_cpu_parallel()                      # gloo on a free loopback port if needed
    (model,) = mc.build_tiny_gpt(mc.TinyGPTSpec(ParallelLayout(num_layers=2)))
    logits = mc.forward_tokens(model, tokens)   # tokens: int64 [B, S]
    mc.destroy_cpu_parallel()

Multi-process: ``mc.launch(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in spawned
processes with ``torch.distributed`` initialized (gloo) and returns every rank's return value.
Weights are set by :func:`init_weights_deterministic` from each parameter's *global* name and unsharded
shape, so a model split by TP/PP/VPP/EP computes the same function as the unsplit one.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from r3lab.errors import R3LabError
from r3lab.routes import Routes
from r3lab.slicing import ParallelLayout
from r3lab.trainers.megatron.cpu import destroy_parallel, gpt_chunks, init_parallel, patch_megatron_for_cpu
from r3lab.trainers.megatron.forward import pipeline_forward

__all__ = [
    "TinyGPTSpec",
    "init_cpu_parallel",
    "destroy_cpu_parallel",
    "build_tiny_gpt",
    "init_weights_deterministic",
    "router_layer_numbers",
    "route_parts",
    "same_bits",
    "RankPass",
    "replay_then_record",
    "export_check",
    "shard_state",
    "shard_state_check",
    "router_agreement",
]

def init_cpu_parallel(layout: ParallelLayout | None = None, *, etp: int | None = None, seed: int = 1234) -> None:
    """Initialize Megatron's model-parallel groups for ``layout`` on CPU (a 1-rank gloo group if none exists).

    ``layout`` (default: one rank) gives tp, pp, vpp, cp and ep; ``etp`` is the expert tensor-parallel
    size (Megatron's default when None). The world size must equal ``layout.world_size``. Re-initializing
    destroys the previous groups first, so one process can run several layouts in turn
    (:func:`r3lab.trainers.megatron.cpu.init_parallel` does the work).
    """
    import torch.distributed as dist

    layout = layout if layout is not None else ParallelLayout(num_layers=1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != layout.world_size:
        raise R3LabError(
            f"the layout needs {layout.world_size} ranks (tp*pp*cp*dp = {layout.tp}*{layout.pp}*{layout.cp}*"
            f"{layout.dp}), torch.distributed has {world}: set the layout's dp to world_size // (tp*pp*cp)"
        )
    init_parallel(tp=layout.tp, pp=layout.pp, vpp=layout.vpp, cp=layout.cp, ep=layout.ep, etp=etp, seed=seed)


destroy_cpu_parallel = destroy_parallel  # the testing name of the product's teardown


@dataclasses.dataclass
class TinyGPTSpec:
    """A tiny MoE GPT: its parallel ``layout`` plus model sizes.

    The layout gives the layers (``num_layers``; ``moe_layer_ids`` have a router, the others are dense,
    e.g. DeepSeek-style leading dense layers) and tp/pp/vpp/cp/ep, sequence parallelism and uneven
    first/last pipeline stages. ``etp``: expert tensor-parallel size (None: tp), a Megatron knob that
    slicing does not need. ``mtp_num_layers``: multi-token-prediction layers after the decoder (on the last
    stage; each wraps the last decoder layer's spec, so it has a router when that layer is MoE); a model with
    them needs ``labels`` in its forward. ``extra_config`` goes to ``TransformerConfig`` last.
    """

    layout: ParallelLayout
    hidden_size: int = 32
    num_attention_heads: int = 4
    ffn_hidden_size: int = 64
    num_experts: int = 8
    topk: int = 2
    moe_ffn_hidden_size: int = 32
    vocab_size: int = 128
    max_sequence_length: int = 256
    etp: int | None = None
    mtp_num_layers: int = 0
    params_dtype: torch.dtype = torch.float32
    extra_config: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, ParallelLayout):
            raise R3LabError(
                f"TinyGPTSpec.layout must be an r3lab.slicing.ParallelLayout, got {type(self.layout).__name__}"
            )

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    def layer_pattern(self) -> list[int]:
        """0/1 per global layer (1 = MoE): Megatron's ``moe_layer_freq`` as a list."""
        moe = set(self.layout.router_layers)
        return [1 if i in moe else 0 for i in range(self.layout.num_layers)]

    def moe_layer_ids(self) -> list[int]:
        """0-based global ids of the MoE layers (Megatron's layer_number - 1)."""
        return list(self.layout.router_layers)

    def transformer_config(self):
        from megatron.core.transformer import TransformerConfig

        lay = self.layout
        kw = dict(
            num_layers=lay.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            ffn_hidden_size=self.ffn_hidden_size,
            num_moe_experts=self.num_experts,
            moe_router_topk=self.topk,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_layer_freq=self.layer_pattern(),
            moe_token_dispatcher_type="allgather",
            moe_enable_routing_replay=True,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            tensor_model_parallel_size=lay.tp,
            pipeline_model_parallel_size=lay.pp,
            virtual_pipeline_model_parallel_size=lay.vpp if lay.vpp > 1 else None,
            context_parallel_size=lay.cp,
            expert_model_parallel_size=lay.ep,
            expert_tensor_parallel_size=self.etp if self.etp is not None else lay.tp,
            sequence_parallel=lay.sequence_parallel and lay.tp > 1,
            num_layers_in_first_pipeline_stage=lay.first_stage_layers,
            num_layers_in_last_pipeline_stage=lay.last_stage_layers,
            normalization="RMSNorm",
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            params_dtype=self.params_dtype,
            pipeline_dtype=self.params_dtype,
            gradient_accumulation_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
        )
        if self.mtp_num_layers:
            kw["mtp_num_layers"] = self.mtp_num_layers
        kw.update(self.extra_config)
        return TransformerConfig(**kw)


def build_tiny_gpt(spec: TinyGPTSpec, *, seed: int = 0, init_parallel: bool = True) -> list[torch.nn.Module]:
    """Build this rank's model chunks (one per virtual pipeline stage) in eval mode with deterministic weights.

    With ``init_parallel`` (default) the model-parallel groups are (re)initialized from ``spec.layout`` first.
    Routers register their ``RouterReplay`` in construction order: chunk 0's layers, then chunk 1's, ...
    """
    patch_megatron_for_cpu()
    if init_parallel:
        init_cpu_parallel(spec.layout, etp=spec.etp)
    config = spec.transformer_config()

    def prepare(model: torch.nn.Module) -> None:
        init_weights_deterministic(model, seed=seed)
        model.eval()

    return gpt_chunks(config, spec.layout.vpp, prepare, vocab_size=spec.vocab_size,
                      max_sequence_length=spec.max_sequence_length, position_embedding_type="learned_absolute")


_LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def init_weights_deterministic(model: torch.nn.Module, seed: int = 0) -> None:
    """Set every parameter from a generator seeded by its global name, then take this rank's TP/EP shard.

    Global name: the decoder layer's index becomes its global layer number (an MTP layer's inner layer
    ``num_layers + k``, whatever the release numbers it), a local expert index its global expert index. Norm
    weights are ones, other 1-D parameters zeros, matrices N(0, 1/fan_in), embeddings N(0, 1). Tensor-parallel
    parameters are generated unsharded and chunked along ``partition_dim`` (stride 1), so every TP/PP/VPP/EP split
    computes the same function.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from r3lab.replay import mcore_api

    layer_prefix, mtp_prefix = {}, {}
    names = {id(m): n for n, m in model.named_modules()}
    for name, mod in model.named_modules():
        if isinstance(mod, TransformerLayer):
            layer_prefix[name + "."] = f"layer{mod.layer_number}."
        elif isinstance(mod, MultiTokenPredictionLayer):  # keyed num_layers + k in every release (0.16.1's number)
            inner = mcore_api.mtp_inner_layer(mod)
            mtp_prefix[names[id(inner)] + "."] = f"layer{int(mod.config.num_layers) + int(mod.layer_number)}."
    layer_prefix.update(mtp_prefix)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = name
            for pre, glob in layer_prefix.items():
                if name.startswith(pre):
                    key = glob + name[len(pre) :]
                    break
            is_expert = ".experts." in name
            if is_expert:
                m = _LOCAL_EXPERT.search(key)
                n_local = _count_local_experts(model, name)
                if m:
                    key = key[: m.start(1)] + str(ep_rank * n_local + int(m.group(1))) + key[m.end(1) :]
            size, rank = (etp, etp_rank) if is_expert else (tp, tp_rank)
            shape = list(p.shape)
            dim = getattr(p, "partition_dim", 0)
            sharded = bool(getattr(p, "tensor_model_parallel", False)) and size > 1
            if sharded:
                shape[dim] *= size
            gen = torch.Generator().manual_seed((zlib.crc32(key.encode()) + 7919 * seed) % (2**63))
            if p.dim() == 1:
                full = torch.ones(shape) if "norm" in key else torch.zeros(shape)
            elif "embedding" in key:
                full = torch.randn(shape, generator=gen, dtype=torch.float64)
            else:
                full = torch.randn(shape, generator=gen, dtype=torch.float64) / (shape[-1] ** 0.5)
            if sharded:
                full = full.chunk(size, dim=dim)[rank]
            p.copy_(full.to(p.dtype))


def _count_local_experts(model: torch.nn.Module, param_name: str) -> int:
    prefix = param_name.split("local_experts.")[0] + "local_experts"
    return len(model.get_submodule(prefix))


def router_layer_numbers(chunks: Sequence[torch.nn.Module]) -> list[int]:
    """Megatron ``layer_number`` (1-based, global) of each router, in RouterReplay registration order."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for m in chunks:
        for mod in m.modules():
            if isinstance(mod, TopKRouter) and getattr(mod, "router_replay", None) is not None:
                out.append(int(mod.layer_number))
    return out


def route_parts(routes: Routes) -> tuple:
    """``routes`` as picklable parts for a spawned rank (``Routes`` refuses pickling: it is immutable);
    ``Routes(*parts)`` rebuilds it there."""
    return (np.asarray(routes.values), np.asarray(routes.cu_seqlens), routes.num_experts, np.asarray(routes.layer_ids))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of dtype, shape and every element (``torch.equal`` would call -0.0 and 0.0 equal)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(ints[a.element_size()]), b.contiguous().view(ints[b.element_size()]))


@dataclasses.dataclass
class RankPass:
    """One rank's two forward passes over its share of a batch: engine routes replayed, then its own routing recorded.

    ``replay_logits`` and ``native_logits`` are the pipeline's output (None off the last stage), ``native`` the routes
    the rank's routers chose, by Megatron layer, ``rows`` the token rows of this rank's routers (slicing's view),
    ``seqs`` the batch's sequences this data-parallel rank holds and ``tokens`` their token ids.
    """

    dp: int
    pp: int
    tp: int
    seqs: np.ndarray
    tokens: torch.Tensor | None
    replay_logits: torch.Tensor | None
    native_logits: torch.Tensor | None
    native: dict
    rows: np.ndarray


def replay_then_record(model, layout: ParallelLayout, tokens: torch.Tensor, routes: Routes) -> RankPass:
    """Run ``model`` (an :class:`r3lab.trainers.megatron.MegatronModel` on this rank) twice over this rank's share of
    ``tokens`` [B, S]: once replaying ``routes`` (sliced for the rank by :func:`r3lab.slicing.shard`), once recording
    its own routing. The rank-side half of the tests that compare Megatron with transformers on the same weights."""
    from megatron.core import parallel_state as ps

    from r3lab.replay import megatron_replay
    from r3lab.slicing import dp_sequence_ids, shard, token_rows

    dp, pp = ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    tp = ps.get_tensor_model_parallel_rank()
    seqs = dp_sequence_ids(len(routes), layout, dp)[0]
    mine = tokens[torch.from_numpy(seqs)]
    ids = shard(routes, layout, dp_rank=dp, pp_rank=pp, cp_rank=0, tp_rank=tp)
    last = pp == layout.pp - 1
    with megatron_replay(model.chunks, [ids]) as rep:
        rep.begin_microbatch(forward_only=True)
        replay_logits = pipeline_forward(model.chunks, mine)
        rep.after_forward()
    with megatron_replay(model.chunks, mode="record") as rec:
        rec.begin_microbatch()
        native_logits = pipeline_forward(model.chunks, mine)
        native = rec.after_forward()
    assert native is not None  # record mode returns what the routers chose
    rows = token_rows(np.full(len(seqs), tokens.shape[1]), layout, tp_rank=tp)
    return RankPass(dp=dp, pp=pp, tp=tp, seqs=seqs, tokens=mine, replay_logits=replay_logits if last else None,
                    native_logits=native_logits if last else None, native={g: t.numpy() for g, t in native.items()},
                    rows=rows)


def export_check(model, checkpoint: str | Path) -> dict | None:
    """What :func:`r3lab.trainers.megatron.export_hf_state_dict` gives back against the checkpoint it was loaded from:
    names missing and extra, and those whose values differ in any bit (in the checkpoint's dtype, and the export
    against the checkpoint widened to fp32). None on ranks that export nothing (all but the gathering rank)."""
    from r3lab.trainers.megatron import checkpoint_state_dict, export_hf_state_dict

    exported = export_hf_state_dict(model)
    if exported is None:
        return None
    ckpt = checkpoint_state_dict(checkpoint)
    differ = sorted(n for n in set(ckpt) & set(exported)
                    if not same_bits(exported[n].to(ckpt[n].dtype), ckpt[n])
                    or not same_bits(exported[n], ckpt[n].float()))
    return dict(missing=sorted(set(ckpt) - set(exported)), extra=sorted(set(exported) - set(ckpt)), differ=differ,
                n=len(ckpt))


def shard_state(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer of this rank's shard (``model.chunks``), by chunk index and name."""
    out = {}
    for i, chunk in enumerate(model.chunks):
        for name, t in [*chunk.named_parameters(), *chunk.named_buffers()]:
            out[f"{i}.{name}"] = t.detach().clone()
    return out


def shard_state_check(model, before: dict[str, torch.Tensor]) -> dict:
    """This rank's shard against a :func:`shard_state` taken earlier: names missing and extra, and those whose values
    differ in any bit. A shard that exported bit for bit (:func:`export_check`) when ``before`` was taken, and holds
    those bits again, exports the same again: the check of a reload without a second export (a gather of every
    tensor over the ranks, the slow part of an export)."""
    after = shard_state(model)
    differ = sorted(n for n in set(before) & set(after) if not same_bits(after[n], before[n]))
    return dict(missing=sorted(set(before) - set(after)), extra=sorted(set(after) - set(before)), differ=differ,
                n=len(before))


def router_agreement(routes: Routes, passes: Sequence[RankPass], *, sequence_parallel: bool) -> tuple[int, int]:
    """How many (token, MoE layer) router rows of the ranks' own routing (``RankPass.native``) chose the same expert
    set as ``routes`` (set-based: order within the top-k is free), and how many rows there were. Each row is counted
    once: tensor-parallel rank 0's rows, or every rank's under sequence parallelism (each holds a slice)."""
    agree = total = 0
    layers = routes.layer_ids.tolist()
    for p in passes:
        if not (sequence_parallel or p.tp == 0):
            continue
        share = np.concatenate([routes.values[routes.cu_seqlens[s]: routes.cu_seqlens[s + 1]] for s in p.seqs])
        real = p.rows >= 0
        for layer, ids in p.native.items():
            want = np.sort(share[p.rows[real], layers.index(layer)], axis=1)
            agree += int((np.sort(ids[real], axis=1) == want).all(axis=1).sum())
            total += int(real.sum())
    return agree, total

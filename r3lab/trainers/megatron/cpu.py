"""Megatron-core on CPU ranks (0.16.1 and 0.19.2): the few CUDA / Transformer Engine assumptions, bypassed explicitly.

Megatron assumes CUDA and Transformer Engine in four places that a CPU forward and backward reach:
``torch.cuda.current_device`` (called while building layers), the CUDA RNG tracker's ``add``/``fork``
(tensor-parallel initialisation and dropout regions), the CUDA RNG state saved by activation
recomputation, and ``moe_utils.te_general_gemm`` (a NameError without TE). :func:`patch_megatron_for_cpu`
replaces exactly those, once per process; :func:`cpu_patches_applied` says whether it ran. The patches are
process-wide because Megatron reads them as module globals: call it in each trainer rank before building.
On a machine with CUDA only the TE and RNG-tracker patches apply. The names it replaces are checked against the
installed release first (:func:`r3lab.replay.mcore_api.check_mcore_api`, ``CPU_PATCH_NAMES``); 0.19.2 reaches the
same four places (its quantile-balancing router also builds its buffers on ``torch.cuda.current_device()``).

The layer spec is Megatron's local (non-TE) spec with every norm a plain :class:`CPURMSNorm`
(the local spec's ``WrappedTorchNorm`` refuses sequence parallelism); :func:`local_block_spec` builds it.
Attention is Megatron's local ``DotProductAttention``: it needs an explicit attention mask and refuses
context parallelism (only TE's attention implements CP).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch

from r3lab.errors import ConfigError, MegatronCoreAPIError
from r3lab.replay import mcore_api

__all__ = ["local_mtp_block_spec", "gpt_chunks", "live_process_groups", "TORCH_GROUP_REGISTRY_CHECKED"]

_PATCHED = False

#: TransformerConfig settings a CPU rank needs (no fused kernels, no grouped GEMM, the allgather dispatcher).
CPU_CONFIG: dict[str, Any] = dict(
    moe_token_dispatcher_type="allgather",
    moe_grouped_gemm=False,
    moe_shared_expert_overlap=False,  # CUDA streams
    moe_router_fusion=False,  # the fused top-k ignores RouterReplay
    gradient_accumulation_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    use_cpu_initialization=True,
)


def cpu_patches_applied() -> bool:
    """Whether :func:`patch_megatron_for_cpu` has run in this process."""
    return _PATCHED


def patch_megatron_for_cpu() -> None:
    """Bypass the CUDA / Transformer Engine assumptions of megatron-core in this process (idempotent); a release
    outside the checked ones raises :class:`~r3lab.errors.MegatronCoreAPIError` first."""
    global _PATCHED
    if _PATCHED:
        return
    mcore_api.check_mcore_api()
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    warnings.filterwarnings("ignore", message=".*Apex.*")
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # referenced unconditionally; a NameError without TE

    def add(self, name, seed):  # CPU twin of CudaRNGStatesTracker.add
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name=tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):  # CPU twin of .fork
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

    if not torch.cuda.is_available():
        tp_random.CudaRNGStatesTracker.add = add
        tp_random.CudaRNGStatesTracker.fork = fork
        # activation recomputation saves and restores the CUDA RNG state
        tp_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
        tp_random._set_cuda_rng_state = lambda *a, **k: None
    _PATCHED = True


class CPURMSNorm(torch.nn.RMSNorm):
    """Plain RMSNorm with Megatron's norm constructor signature; unlike WrappedTorchNorm it allows SP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # grads all-reduced over TP


def local_block_spec(config, vp_stage: int | None = None, spec_hook: Callable[[Any], Any] | None = None):
    """Megatron's local GPT block spec for ``config`` (this rank's stage) with every norm a :class:`CPURMSNorm`,
    then edited by ``spec_hook`` (a family's own modules, e.g. OLMoE's full-width q/k norms)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage)
    layer_specs = []
    for ls in spec.layer_specs:
        sub = ls.submodules
        attn = sub.self_attention
        asub = attn.submodules
        norms = {
            f: CPURMSNorm
            for f in ("q_layernorm", "k_layernorm")
            if getattr(asub, f, IdentityOp) not in (IdentityOp, None)
        }
        if norms:
            attn = dataclasses.replace(attn, submodules=dataclasses.replace(asub, **norms))
        sub = dataclasses.replace(sub, input_layernorm=CPURMSNorm, pre_mlp_layernorm=CPURMSNorm, self_attention=attn)
        layer_specs.append(dataclasses.replace(ls, submodules=sub))
    spec = dataclasses.replace(spec, layer_specs=layer_specs, layer_norm=CPURMSNorm)
    return spec if spec_hook is None else spec_hook(spec)


def local_mtp_block_spec(config, vp_stage: int | None = None, spec_hook: Callable[[Any], Any] | None = None):
    """The multi-token-prediction block spec for this rank's stage on the local spec, or None (no MTP here).

    Megatron's own :func:`get_gpt_mtp_block_spec` (the MTP layer wraps the *last* decoder layer's spec and is built
    on the last pipeline stage only, at 0.16.1 and 0.19.2) with its norms made :class:`CPURMSNorm` like the
    decoder's. ``None`` unless ``config.mtp_num_layers`` is set.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    if not getattr(config, "mtp_num_layers", None):
        return None
    spec = get_gpt_mtp_block_spec(config, local_block_spec(config, vp_stage, spec_hook), use_transformer_engine=False,
                                  vp_stage=vp_stage)
    if spec is None:
        return None
    norms = dict(enorm=CPURMSNorm, hnorm=CPURMSNorm, layer_norm=CPURMSNorm)
    layers = [dataclasses.replace(ls, submodules=dataclasses.replace(ls.submodules, **norms))
              for ls in spec.layer_specs]
    return dataclasses.replace(spec, layer_specs=layers)


def gpt_chunks(config: Any, vpp: int, prepare: Callable[[torch.nn.Module], Any] | None = None, *,
               spec_hook: Callable[[Any], Any] | None = None, **model_kwargs: Any) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks on the local spec, one per virtual pipeline stage (``vpp``; 1: one chunk).

    The first chunk of the first stage embeds (``pre_process``), the last chunk of the last stage has the output
    layer (``post_process``). ``spec_hook`` edits the local spec (:func:`local_block_spec`). ``prepare(chunk)``
    runs on each chunk right after it is built, before the next one (weights set in construction order);
    ``model_kwargs`` go to ``GPTModel``. The one chunk loop of the checkpoint loader and the test models
    (:mod:`r3lab.testing.megatron`). With ``config.mtp_num_layers`` the chunk of the last stage also gets
    Megatron's MTP block (:func:`local_mtp_block_spec`).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    virtual = vpp if vpp > 1 else None
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    chunks = []
    for vp in range(virtual or 1):
        vp_stage = vp if virtual else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=local_block_spec(config, vp_stage, spec_hook),
            pre_process=pp_rank == 0 and vp == 0,
            post_process=pp_rank == pp - 1 and vp == (virtual or 1) - 1,
            vp_stage=vp_stage,
            mtp_block_spec=local_mtp_block_spec(config, vp_stage, spec_hook),
            **model_kwargs,
        )
        if prepare is not None:
            prepare(model)
        chunks.append(model)
    return chunks


def init_parallel(
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
) -> None:
    """Initialise Megatron's model-parallel groups on this process's torch.distributed group (gloo on CPU).

    Without a process group a one-rank gloo group is created, its rendezvous an in-memory store (a world of one meets
    no peer, so it takes no port). Re-initialising destroys the previous groups first, so one process can build
    several layouts in turn.
    """
    patch_megatron_for_cpu()
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ConfigError(f"world size {world} is not a multiple of tp*pp*cp = {tp}*{pp}*{cp}")
    if parallel_state.model_parallel_is_initialized():
        destroy_parallel(keep_process_group=True)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _vllm_holds_the_process_group() -> bool:
    """Whether an in-process vLLM engine has set up its world group on this process's torch.distributed group
    (``vllm.distributed.parallel_state._WORLD``, vLLM 0.30): destroying that group breaks the engine, and every
    in-process engine started after it fails with "Process group ... is not initialized in the world group map"."""
    import sys

    ps = sys.modules.get("vllm.distributed.parallel_state")
    return ps is not None and getattr(ps, "_WORLD", None) is not None


def _megatron_process_groups() -> list:
    """The process groups Megatron's ``parallel_state`` holds now (its module globals, lists of groups included),
    each once, without the default group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    found: dict[int, Any] = {}
    for value in vars(parallel_state).values():
        for group in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(group, dist.ProcessGroup) and group is not dist.GroupMember.WORLD:
                found[id(group)] = group
    return list(found.values())


#: the torch releases whose private registry of live process groups (``torch.distributed.distributed_c10d._world
#: .pg_map``: group -> backend and store) :func:`destroy_parallel` was read against: it asks that registry which of
#: Megatron's groups ``destroy_model_parallel`` left alive (the far end of the compatibility tier runs 2.11.0)
TORCH_GROUP_REGISTRY_CHECKED = ("2.11.0", "2.13.0")


def live_process_groups() -> dict:
    """torch.distributed's registry of the process groups alive in this process (private; see
    :data:`TORCH_GROUP_REGISTRY_CHECKED`). A torch without it raises :class:`~r3lab.errors.MegatronCoreAPIError`
    naming the release, before any group is destroyed: guessing which groups are left would destroy one twice, or
    leave its threads behind without a word."""
    import torch.distributed as dist

    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if not isinstance(registry, dict):
        raise MegatronCoreAPIError(
            f"torch {torch.__version__}: torch.distributed.distributed_c10d._world.pg_map (the registry of live "
            f"process groups, read in torch {' and '.join(TORCH_GROUP_REGISTRY_CHECKED)}) is gone or no longer a "
            "dict; r3lab.trainers.megatron.cpu.destroy_parallel cannot tell which of Megatron's groups are left to "
            "destroy. Read this torch's distributed_c10d and update live_process_groups")
    return registry


def destroy_parallel(*, keep_process_group: bool = True) -> None:
    """Tear down the model-parallel groups and Megatron's router-replay registry (and the gloo group if asked; refused
    while an in-process vLLM engine holds it, as the error says).

    Megatron's ``destroy_model_parallel`` only forgets its groups (it destroys the extra ``*_GLOO`` ones a GPU run
    makes beside NCCL); on CPU every group is a gloo group, and a gloo group keeps a socket loop thread (measured
    waking about 50 times a second) and two worker threads until torch destroys it. Each layout built in one process
    added its groups' threads to the last ones': four ranks building the four shipped models in three layouts each
    held 600 threads and spent a quarter of their CPU waking them (13 s of system time a rank). With
    ``keep_process_group`` (a world that goes on, to build another layout: every rank calls this, as it called
    ``init_parallel``) the groups Megatron held are destroyed too, after a barrier on the default group, so that no
    rank leaves a group a peer still uses; without it every group goes with the default one, and a rank tearing down
    after a peer failed waits on no barrier."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    groups = _megatron_process_groups()
    destroy_ours = keep_process_group and bool(groups) and dist.is_initialized()
    if destroy_ours:
        live_process_groups()  # a torch without the registry is refused before anything is destroyed
    parallel_state.destroy_model_parallel()
    if destroy_ours:
        dist.barrier()
        registered = live_process_groups()  # destroy_model_parallel destroyed some already
        for group in groups:
            if registered.get(group) is not None:
                dist.destroy_process_group(group)
    if not keep_process_group and dist.is_initialized():
        if _vllm_holds_the_process_group():
            raise ConfigError("destroy_parallel(keep_process_group=False): an in-process vLLM engine holds this "
                              "process's torch.distributed group; destroying it would break that engine and every "
                              "in-process engine started after it. Keep the group (keep_process_group=True)")
        dist.destroy_process_group()

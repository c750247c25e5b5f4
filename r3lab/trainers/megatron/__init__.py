"""The Megatron-core trainer's building blocks on CPU ranks (and, unchanged, on GPU nodes).

* :mod:`~r3lab.trainers.megatron.cpu`: the CPU patches of megatron-core 0.16.1, the local layer spec, the
  parallel-group setup.
* :mod:`~r3lab.trainers.megatron.checkpoint`: :func:`build_model` loads a Hugging Face checkpoint
  (mbridge's mappings) into this rank's GPTModel chunks; :func:`export_hf_state_dict` gathers them back
  (:func:`load_checkpoint` also takes exported weights saved as safetensors).
* :mod:`~r3lab.trainers.megatron.forward`: masks, the forward-only pipeline pass, token log-probs.
* :mod:`~r3lab.trainers.megatron.launch`: :func:`launch` runs a function on gloo ranks, forked as
  :func:`rank_processes` starts them.
* :mod:`~r3lab.trainers.megatron.trainer`: :class:`~r3lab.trainers.megatron.trainer.MegatronTrainer`, long-lived ranks
  (:mod:`~r3lab.trainers.megatron.worker`) behind the trainer interface, routes staged to them through
  :mod:`~r3lab.trainers.megatron.store_backend`. Import it from its module (it is not re-exported here).
* :mod:`~r3lab.trainers.megatron.transport`: how the trainer starts and reaches its ranks (:class:`RankTransport
  <r3lab.trainers.megatron.transport.RankTransport>`; spawned gloo processes by default, Ray actors with
  :class:`r3lab.cluster.megatron.RayRanks`).

megatron-core, mbridge and transformers are imported when used, not when this package is imported.
"""

from r3lab.trainers.megatron.checkpoint import (
    GroupRoutingMismatchWarning,
    build_model,
    export_hf_state_dict,
    layout_for,
    load_checkpoint,
)
from r3lab.trainers.megatron.cpu import (
    CPU_CONFIG,
    CPURMSNorm,
    cpu_patches_applied,
    destroy_parallel,
    init_parallel,
    local_block_spec,
    patch_megatron_for_cpu,
)
from r3lab.trainers.megatron.forward import causal_mask, forward_tokens, gather_vocab, logits_logprobs, pipeline_forward
from r3lab.trainers.megatron.launch import RANK_PRELOAD, adopt_environment, launch, rank_processes
from r3lab.trainers.megatron.model import MegatronModel, checkpoint_shapes, checkpoint_state_dict

__all__ = [
    "CPURMSNorm",
    "CPU_CONFIG",
    "GroupRoutingMismatchWarning",
    "MegatronModel",
    "RANK_PRELOAD",
    "adopt_environment",
    "build_model",
    "causal_mask",
    "checkpoint_shapes",
    "checkpoint_state_dict",
    "cpu_patches_applied",
    "destroy_parallel",
    "export_hf_state_dict",
    "forward_tokens",
    "gather_vocab",
    "init_parallel",
    "launch",
    "layout_for",
    "load_checkpoint",
    "local_block_spec",
    "logits_logprobs",
    "patch_megatron_for_cpu",
    "pipeline_forward",
    "rank_processes",
]

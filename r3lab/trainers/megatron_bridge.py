"""A Megatron-core ``GPTModel`` on one rank as a scorer: none, R3 (shard + ``RouterReplay``) and recording.

:func:`megatron_token_logprobs` scores one sequence with any GPTModel built with ``moe_enable_routing_replay=True``,
on CPU too (the tests use ``r3lab.testing.megatron``'s tiny model): given routes are sliced for the rank by
:func:`r3lab.slicing.shard` and set into every router by :func:`r3lab.replay.megatron_replay`.
:class:`MegatronBridgeTrainer` wraps it as a :class:`~r3lab.trainers.base.Scorer` for the drift experiment
(``trainer="megatron-bridge"``). :func:`load_bridge_model` needs CUDA, Transformer Engine and megatron-bridge
(the GPU trainer environment, ``requirements-gpu-trainer.txt``); only ``scripts/gpu_check.py`` runs it. Scoring
only: the RL loop's Megatron trainer (policy steps, weight export, many ranks) is ``r3lab.trainers.megatron``'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.config import TRAINER_DTYPES
from r3lab.errors import ConfigError
from r3lab.replay import megatron_replay, megatron_routers
from r3lab.routes import Routes
from r3lab.slicing import ParallelLayout, shard
from r3lab.trainer_registry import TrainerOptions
from r3lab.trainers.base import Scorer, TokenBatch, TrainerScores

__all__ = ["Forward", "default_forward", "megatron_token_logprobs", "MegatronBridgeTrainer", "load_bridge_model"]

Forward = Callable[[Any, Any], Any]  # (model, input ids [1, S]) -> logits [1, S, V_padded]


def default_forward(model: Any, ids: Any) -> Any:
    """A GPTModel forward of one unpadded sequence: positions ``0..S-1``, Megatron's causal mask (TE attention)."""
    import torch

    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    return model(input_ids=ids, position_ids=pos, attention_mask=None)


def _model_layout(model: Any) -> ParallelLayout:
    """The one-rank layout of a model: its decoder layer count and which layers have a router."""
    routers, _ = megatron_routers(model)
    cfg = next(iter(routers.values())).config
    return ParallelLayout(num_layers=int(cfg.num_layers), moe_layer_ids=tuple(routers))


def megatron_token_logprobs(
    model: Any,
    token_ids: Sequence[int],
    prompt_len: int,
    *,
    routes: Routes | None = None,
    record: bool = False,
    vocab_size: int | None = None,
    forward: Forward = default_forward,
) -> tuple[np.ndarray, Routes | None]:
    """Log-probabilities (float64) of ``token_ids[prompt_len:]`` under a Megatron GPTModel on one rank (no TP/PP).

    ``routes``: replay these (one sequence, a row per token, global layer ids; e.g. the engine's routes with
    :func:`r3lab.rollout.append_last_row`): sliced by :func:`r3lab.slicing.shard` for this rank and set into
    every router by :func:`r3lab.replay.megatron_replay`. ``record``: also return the routes the routers used,
    as :class:`Routes` on the model's MoE layer ids. ``vocab_size``: the tokenizer's vocabulary (Megatron pads
    the output layer; padded columns are cut off before the softmax). Forward only, no gradients.
    """
    import torch

    if not 1 <= prompt_len < len(token_ids):
        raise ConfigError(f"prompt_len must be in [1, {len(token_ids)}), got {prompt_len}")
    if routes is not None and record:
        raise ConfigError("pass routes (replay) or record=True, not both: replayed routes are the routes used")
    if vocab_size is not None and max(token_ids) >= vocab_size:
        raise ConfigError(f"token id {max(token_ids)} is outside the vocabulary of {vocab_size}")
    layout = _model_layout(model)
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    used = None
    with torch.no_grad():
        if routes is not None:
            if len(routes) != 1 or routes.total_tokens != len(token_ids):
                raise ConfigError(f"routes must hold one sequence of {len(token_ids)} rows (one per token), got "
                                  f"{len(routes)} sequence(s) of {routes.total_tokens} rows in all")
            missing = sorted(set(layout.router_layers) - set(routes.layer_ids.tolist()))
            if missing:
                raise ConfigError(f"routes have no rows for the model's MoE layers {missing} "
                                  f"(routes: layers {routes.layer_ids.tolist()})")
            per_router = shard(routes, layout, dp_rank=0, pp_rank=0, cp_rank=0, tp_rank=0)
            with megatron_replay(model, [per_router], num_experts=routes.num_experts) as rep:
                rep.begin_microbatch(forward_only=True)
                logits = forward(model, ids)
        elif record:
            with megatron_replay(model, mode="record") as rep:
                rep.begin_microbatch()
                logits = forward(model, ids)
                got = rep.after_forward()
            cfg = next(iter(megatron_routers(model)[0].values())).config
            values = np.stack([got[g].cpu().numpy() for g in layout.router_layers], axis=1)
            used = Routes.from_list([values], num_experts=int(cfg.num_moe_experts), layer_ids=layout.moe_layer_ids)
        else:
            logits = forward(model, ids)
        logits = logits[0].float()
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        logp = torch.log_softmax(logits[prompt_len - 1 : -1], dim=-1)
        picked = logp.gather(1, ids[0, prompt_len:, None])[:, 0]
    return picked.double().cpu().numpy(), used


class MegatronBridgeTrainer(Scorer):
    """A one-rank Megatron GPTModel as a :class:`~r3lab.trainers.base.Scorer`: every sample is its own forward."""

    name = "megatron-bridge"
    batch_forward = False  # samples are scored one at a time (no padded batch forward)

    def __init__(self, model: Any, *, vocab_size: int | None = None, forward: Forward = default_forward):
        self.model, self.vocab_size, self.forward = model, vocab_size, forward

    @classmethod
    def load(cls, path: str | os.PathLike, dtype: str = "bfloat16") -> MegatronBridgeTrainer:
        """GPU only: :func:`load_bridge_model`, cutting Megatron's padded vocabulary to the checkpoint's."""
        vocab = int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
        return cls(load_bridge_model(path, dtype), vocab_size=vocab)

    def score(self, batch: TokenBatch, *, routes: Routes | None = None, record: bool = False,
              entropy: bool = False, weights: str | None = None) -> TrainerScores:
        if weights is not None:
            raise ConfigError(f"weights={weights!r} (R3W, the engine's routing weights) is replayed by the "
                              "transformers trainer only (--trainer hf); this trainer replays expert ids")
        if entropy:
            raise ConfigError("the megatron-bridge scorer computes no entropy")
        if routes is not None and len(routes) != len(batch):
            raise ConfigError(f"routes hold {len(routes)} sequences for {len(batch)} samples")
        logps, used = [], []
        for i, (q, p) in enumerate(zip(batch.sequences, batch.prompt_lens, strict=True)):
            lp, own = megatron_token_logprobs(self.model, q, p, routes=None if routes is None else routes.take([i]),
                                              record=record, vocab_size=self.vocab_size, forward=self.forward)
            logps.append(lp)
            used.append(own)
        return TrainerScores(np.concatenate(logps), Routes.concat(used) if record else None)


def load_bridge_model(path: str | os.PathLike, dtype: str = "bfloat16") -> Any:
    """A Megatron-core GPTModel (one GPU, no parallelism) with the weights of a Hugging Face checkpoint.

    GPU only: megatron-bridge imports Transformer Engine and builds TE layers, and Megatron initialises NCCL.
    The routers get ``moe_enable_routing_replay`` (RouterReplay) and run in fp32, as the CPU trainer's do.
    """
    import torch

    if dtype not in TRAINER_DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(TRAINER_DTYPES)}, got {dtype!r}")
    if not torch.cuda.is_available():
        raise ConfigError("the megatron-bridge trainer needs a CUDA GPU (megatron-bridge builds Transformer Engine "
                          "layers): run it on a GPU node (`bash scripts/gpu_check.sh`); on CPU use --trainer hf")
    from megatron.bridge import AutoBridge
    from megatron.core.transformer.moe.router_replay import RouterReplay

    bridge = AutoBridge.from_hf_pretrained(str(path))
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.tensor_model_parallel_size = provider.pipeline_model_parallel_size = 1
    provider.expert_model_parallel_size = provider.context_parallel_size = 1
    provider.sequence_parallel = False
    provider.moe_enable_routing_replay = True
    provider.moe_router_fusion = False  # the fused top-k ignores RouterReplay
    provider.moe_router_dtype = "fp32"
    bf16 = dtype == "bfloat16"
    provider.bf16, provider.fp16 = bf16, False
    provider.params_dtype = torch.bfloat16 if bf16 else torch.float32
    provider.pipeline_dtype = provider.params_dtype
    provider.finalize()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        if "MASTER_PORT" not in os.environ:  # no launcher (torchrun) named a world: this process is a world of one
            # its rendezvous an in-memory store (no peer to meet: no port to choose and lose); the provider's
            # initialize_model_parallel finds the group formed, as it finds a launcher's
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            torch.distributed.init_process_group("nccl", store=torch.distributed.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        provider.initialize_model_parallel(seed=0)
    RouterReplay.clear_global_router_replay_instances()  # this process builds one trainer model at a time
    chunks = provider.provide_distributed_model(wrap_with_ddp=False, bf16=bf16, fp16=False)
    if len(chunks) != 1:
        raise ConfigError(f"expected one model chunk without pipeline parallelism, got {len(chunks)}")
    return chunks[0].eval()


def load(path: str | os.PathLike, options: TrainerOptions) -> MegatronBridgeTrainer:
    """The registry's loader (``trainer="megatron-bridge"``, :mod:`r3lab.trainer_registry`), GPU only."""
    return MegatronBridgeTrainer.load(path, options.dtype)

"""The drift experiment with a Megatron-core trainer: none vs R3 on the engine's samples, the GPU-node path.

The engine (CUDA vLLM on a GPU node) samples; a Megatron-core ``GPTModel`` built from the same Hugging Face
checkpoint by megatron-bridge scores the same tokens twice: with its own routing ("none") and replaying the
engine's routes ("R3"), sliced for its rank by :func:`r3lab.slicing.shard` and injected into Megatron's
``RouterReplay`` by :func:`r3lab.replay.megatron_replay`. Results are :class:`~r3lab.experiments.drift.DriftSample`
and are summarised and written exactly as the CPU drift experiment's (``r3lab.runs``, kind ``drift``).

What runs where: :func:`megatron_token_logprobs` and :func:`megatron_replay_drift` take any Megatron GPTModel
built with ``moe_enable_routing_replay=True``, on CPU too (the tests use ``r3lab.testing.megatron``'s tiny
model). :func:`load_bridge_model` and :func:`run_megatron_drift` need CUDA, Transformer Engine and
megatron-bridge (the GPU environment, ``requirements-gpu.txt``); only ``scripts/gpu_check.py`` runs them.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab._process import free_port
from r3lab.errors import ConfigError, R3LabError
from r3lab.experiments.drift import (
    TRAINER_DTYPES,
    DriftRow,
    DriftSample,
    _run_summary,
    _seed_inputs,
    _write_cell,
    drift_summary,
)
from r3lab.paths import MODELS, model_dir
from r3lab.replay import megatron_replay, megatron_routers
from r3lab.rollout import RolloutEngine, RolloutResult, append_last_row
from r3lab.routes import Routes
from r3lab.runs import RunWriter
from r3lab.slicing import ParallelLayout, shard

__all__ = [
    "MegatronDriftConfig",
    "megatron_token_logprobs",
    "megatron_replay_drift",
    "load_bridge_model",
    "run_megatron_drift",
    "megatron_drift_table",
]

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
            missing = sorted(set(layout.moe_layer_ids) - set(routes.layer_ids.tolist()))
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
            values = np.stack([got[g].cpu().numpy() for g in layout.moe_layer_ids], axis=1)
            used = Routes.from_list([values], num_experts=int(cfg.num_moe_experts), layer_ids=layout.moe_layer_ids)
        else:
            logits = forward(model, ids)
        logits = logits[0].float()
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        logp = torch.log_softmax(logits[prompt_len - 1 : -1], dim=-1)
        picked = logp.gather(1, ids[0, prompt_len:, None])[:, 0]
    return picked.double().cpu().numpy(), used


def megatron_replay_drift(
    model: Any,
    results: Sequence[RolloutResult],
    *,
    vocab_size: int | None = None,
    forward: Forward = default_forward,
    engine_again: Sequence[np.ndarray] | None = None,
) -> list[DriftSample]:
    """Score every engine sample with the Megatron model without replay and with R3 (the engine's routes).

    Flips are set-based, on the token's input position, against the routes the model recorded on its own.
    """
    samples = []
    for i, r in enumerate(results):
        if r.routes is None or r.routes_start != 0:
            raise ConfigError(f"sample {i}: needs the engine's routes for every row (captured from position 0)")
        ids, P = r.token_ids, len(r.prompt_ids)
        engine_routes = append_last_row(r.routes)  # the last sampled token has no engine row
        logp_none, own = megatron_token_logprobs(model, ids, P, record=True, vocab_size=vocab_size, forward=forward)
        logp_r3, _ = megatron_token_logprobs(model, ids, P, routes=engine_routes, vocab_size=vocab_size,
                                             forward=forward)
        theirs = engine_routes.select_layers(own.layer_ids).values
        flips = metrics.token_route_flips(theirs, own.values)
        again = None if engine_again is None else np.asarray(engine_again[i], dtype=np.float64)
        samples.append(DriftSample(np.asarray(r.logprobs, dtype=np.float64), logp_none, logp_r3,
                                   flips[P - 1 : len(ids) - 1], None, again))
    return samples


# ---- GPU only ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MegatronDriftConfig:
    """The GPU drift experiment: engine (CUDA vLLM) samples, a megatron-bridge trainer scores (none vs R3)."""

    models: tuple[str, ...] = MODELS
    prompts: int = 32
    max_tokens: int = 48
    prompt_words: int = 12
    seeds: tuple[int, ...] = (0, 1, 2)  # seed s: prompts drawn with s, sampled with seed s + 1
    temperature: float = 1.0
    trainer_dtype: str = "bfloat16"  # bf16 weights with fp32 routers (as the CPU trainer), or float32
    gpu_memory_utilization: float = 0.3  # the engine's share; the trainer shares the GPU after it
    data: str | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("MegatronDriftConfig.models is empty")
        for name in ("prompts", "max_tokens", "prompt_words"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"MegatronDriftConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"MegatronDriftConfig.seeds must be distinct and non-empty, got {self.seeds!r}")
        if self.trainer_dtype not in TRAINER_DTYPES:
            raise ConfigError(f"trainer_dtype must be one of {sorted(TRAINER_DTYPES)}, got {self.trainer_dtype!r}")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization!r}")

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def load_bridge_model(path: str | os.PathLike, dtype: str = "bfloat16") -> Any:
    """A Megatron-core GPTModel (one GPU, no parallelism) with the weights of a Hugging Face checkpoint.

    GPU only: megatron-bridge imports Transformer Engine and builds TE layers, and Megatron initialises NCCL.
    The routers get ``moe_enable_routing_replay`` (RouterReplay) and run in fp32, as the CPU trainer's do.
    """
    import torch
    from megatron.bridge import AutoBridge
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if dtype not in TRAINER_DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(TRAINER_DTYPES)}, got {dtype!r}")
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
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        provider.initialize_model_parallel(seed=0)
    RouterReplay.clear_global_router_replay_instances()  # this process builds one trainer model at a time
    chunks = provider.provide_distributed_model(wrap_with_ddp=False, bf16=bf16, fp16=False)
    if len(chunks) != 1:
        raise R3LabError(f"expected one model chunk without pipeline parallelism, got {len(chunks)}")
    model = chunks[0].eval()
    return model


def run_megatron_drift(
    config: MegatronDriftConfig | None = None,
    *,
    runs_root: Any = None,
    run_name: str | None = None,
    on_row: Callable[[DriftRow], None] | None = None,
    on_model: Callable[[str, Any, list[RolloutResult]], None] | None = None,
) -> list[DriftRow]:
    """GPU only. Per model: CUDA vLLM samples every seed (routes captured natively), scores them again by prefill
    (its noise floor) and is shut down; then the megatron-bridge model scores them without replay and with R3.
    With ``runs_root`` the rows are written as a ``drift`` run, in the CPU experiment's format. ``on_model(name,
    model, samples of the first seed)`` runs once per loaded trainer model (extra checks of a GPU script)."""
    import torch

    config = config or MegatronDriftConfig()
    rows: list[DriftRow] = []
    writer = None
    if runs_root is not None:
        writer = RunWriter(runs_root, run_name or f"gpu-drift-{time.strftime('%Y%m%d-%H%M%S')}", "drift",
                           {**config.to_dict(), "trainer": "megatron-bridge"})
    try:
        for name in config.models:
            path = model_dir(name, config.data)
            # the engine core in its own process: its GPU memory and its torch.distributed state leave with it,
            # before Megatron initialises NCCL in this one
            with RolloutEngine(path, seed=0, in_process=False,
                               gpu_memory_utilization=config.gpu_memory_utilization) as engine:
                results, again = {}, {}
                for s in config.seeds:
                    results[s] = engine.generate(*_seed_inputs(config, s))  # the CPU experiment's prompts
                    again[s] = engine.score([r.token_ids for r in results[s]],
                                            start=[len(r.prompt_ids) for r in results[s]])
            torch.cuda.empty_cache()
            model = load_bridge_model(path, config.trainer_dtype)
            vocab = _tokenizer_vocab(Path(path))
            label = os.path.basename(str(name).rstrip("/"))
            if on_model is not None:
                on_model(label, model, results[config.seeds[0]])
            for s in config.seeds:
                samples = megatron_replay_drift(model, results[s], vocab_size=vocab, engine_again=again[s])
                row = DriftRow(label, config.trainer_dtype, s, drift_summary(samples), writer.path if writer else None)
                rows.append(row)
                if writer is not None:
                    _write_cell(writer, len(rows) - 1, row, samples, results[s])
                if on_row is not None:
                    on_row(row)
            del model
            torch.cuda.empty_cache()
        if writer is not None:
            writer.finish(_run_summary(rows))
    finally:
        if writer is not None:
            writer.close()
    return rows


def _tokenizer_vocab(path: Path) -> int:
    import json

    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def megatron_drift_table(rows: Sequence[DriftRow], config: MegatronDriftConfig, *, device: str,
                         command: str = "bash scripts/gpu_check.sh") -> str:
    """The GPU drift experiment as markdown: per (model, seed), k3 KL against the engine without replay and with R3."""
    import torch

    nan = float("nan")
    lines = [
        "# What replay changes with a Megatron trainer on a GPU",
        "",
        f"`{command}` on {device}, torch {torch.__version__}, {platform.python_version()}: CUDA vLLM samples "
        f"{config.prompts} corpus prompts x {config.max_tokens} tokens per seed (routes captured by the engine); "
        f"megatron-bridge loads the same checkpoint into a Megatron-core GPTModel "
        f"({TRAINER_DTYPES[config.trainer_dtype]}), which scores the samples with its own routing (none) and with "
        "the engine's routes sliced by r3lab.slicing.shard and replayed through RouterReplay (R3).",
        "",
        "| model | trainer | seed | tokens | route-flipped | k3 none | k3 R3 | cut | flipped: none | flipped: R3 "
        "| agreeing: none | agreeing: R3 | floor: engine |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r.summary
        cut = s["k3_none"] / s["k3_r3"] if s["k3_r3"] else nan
        lines.append(
            f"| {r.model} | {TRAINER_DTYPES[r.trainer_dtype]} | {r.seed} | {s['tokens']} | {s['flipped_share']:.1%} "
            f"| {s['k3_none']:.2e} | {s['k3_r3']:.2e} | {cut:.1f}x | {s.get('k3_flipped_none', nan):.2e} "
            f"| {s.get('k3_flipped_r3', nan):.2e} | {s.get('k3_agreeing_none', nan):.2e} "
            f"| {s.get('k3_agreeing_r3', nan):.2e} | {s.get('k3_engine_floor', nan):.1e} |"
        )
    return "\n".join(lines) + "\n"

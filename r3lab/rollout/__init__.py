"""Capture (inference side): generate with vLLM and return tokens, engine log-probabilities and routes.

    from r3lab.rollout import RolloutEngine, SamplingConfig

    with RolloutEngine("data/models/tiny-qwen3-moe", seed=0) as eng:
        results = eng.generate(["ka lo mi"], SamplingConfig(max_tokens=32, seed=0))

Modules: :mod:`~r3lab.rollout.base` (:class:`Engine`, the protocol every engine class meets, wherever it runs),
:mod:`~r3lab.rollout.engine` (vLLM in this process), :mod:`~r3lab.rollout.server` (vLLM's OpenAI-compatible server
on loopback), :mod:`~r3lab.rollout.attach` (a server the user started, and the client that decodes its routes),
:mod:`~r3lab.rollout.types` (sampling settings, one sample's result, the checks on engine routes; shared by all).
Importing this package does not import vLLM (the engine and the server import it when they start),
and nothing here imports the trainer side (slicing, replay).
"""


from r3lab.rollout.attach import API_KEY_ENV, AttachedServer, connect, parse_completion, served_model
from r3lab.rollout.base import Engine
from r3lab.rollout.engine import RolloutEngine
from r3lab.rollout.server import RolloutServer
from r3lab.rollout.types import (
    RolloutResult,
    SamplingConfig,
    append_last_row,
    assemble_turns,
    split_turn_routes,
    stack_routes,
    validate_engine_routes,
)

__all__ = [
    "Engine",
    "RolloutEngine",
    "RolloutServer",
    "RolloutResult",
    "SamplingConfig",
    "validate_engine_routes",
    "append_last_row",
    "stack_routes",
    "assemble_turns",
    "split_turn_routes",
    "parse_completion",
    "connect",
    "served_model",
    "AttachedServer",
    "API_KEY_ENV",
]

"""The ``attached`` engine placement (:mod:`r3lab.cluster.placement`): a vLLM server the user started, at the
config's ``engine_url``, reached with :func:`r3lab.rollout.connect` (its handshake checks the served model against the
local checkpoint first). The server is the user's: closing the engine leaves it running.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from r3lab.errors import ConfigError

__all__: list[str] = []  # the placement registry reaches the builders by path


def build_engine(config: Any, path: Path, options: dict[str, Any]) -> Any:
    """The server at ``config.engine_url``, checked against the checkpoint at ``path``.

    ``options`` describe an engine r3lab starts; the server was started with its own (seed, dtype, memory), so those
    are not r3lab's to set. Two would change what a run measures and are refused rather than dropped: the routers'
    weights (vLLM's HTTP API returns expert ids only) and a simulated quantization (quantise the server yourself).
    """
    from r3lab.rollout import connect

    if options.get("capture_weights"):
        raise ConfigError("capture_weights needs the in-process engine: vLLM's HTTP API at {engine_url} returns "
                          "expert ids only, never routing weights", field="engine_url")
    if options.get("engine_quant", "none") != "none":
        raise ConfigError(f"engine_quant={options['engine_quant']!r} applies to an engine r3lab starts; quantise the "
                          "server at {engine_url} yourself", field="engine_url")
    return connect(config.engine_url, model=path)

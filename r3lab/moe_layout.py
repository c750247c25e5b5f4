"""Which decoder layers of a Hugging Face config are MoE layers, and with how many experts and top-k.

Engines report routes for every decoder layer (dense layers come back as rows of zeros); this module
names the MoE ones by their global layer number, from the model's own config rules (its family's entry in
:mod:`r3lab.families`), so dense layers are dropped by id and never shift the MoE layers behind them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from r3lab.errors import ModelConfigError
from r3lab.families import family_of

__all__ = ["MoELayout"]


_DENSE_HINTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class MoELayout:
    """The routing layout of a decoder: ``moe_layer_ids`` are global layer numbers (0-based)."""

    model_type: str
    architecture: str
    num_hidden_layers: int
    moe_layer_ids: tuple[int, ...]
    num_experts: int
    top_k: int
    max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.moe_layer_ids:
            raise ModelConfigError(
                f"{self.architecture}: no MoE layer among {self.num_hidden_layers} layers (a dense model)"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelConfigError(
                f"{self.architecture}: top_k={self.top_k} outside [1, num_experts={self.num_experts}]"
            )
        if min(self.moe_layer_ids) < 0 or max(self.moe_layer_ids) >= self.num_hidden_layers:
            raise ModelConfigError(
                f"{self.architecture}: MoE layer ids {self.moe_layer_ids} outside [0, {self.num_hidden_layers})"
            )

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        moe = set(self.moe_layer_ids)
        return tuple(i for i in range(self.num_hidden_layers) if i not in moe)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> MoELayout:
        p = Path(path)
        cfg_path = p / "config.json"
        if not p.is_dir():
            raise ModelConfigError(
                f"model path {str(p)!r} is not a directory (r3lab builds models locally; no hub downloads)"
            )
        if not cfg_path.is_file():
            raise ModelConfigError(f"model path {str(p)!r} has no config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as e:
            raise ModelConfigError(f"unreadable {cfg_path}: {e}") from e
        return cls.from_config(cfg)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> MoELayout:
        if not isinstance(cfg, dict):
            raise ModelConfigError(f"config must be a dict, got {type(cfg).__name__}")
        mt = str(cfg.get("model_type", ""))
        arch = (cfg.get("architectures") or [mt])[0]
        L = _int(cfg, "num_hidden_layers", arch)
        max_pos = int(cfg.get("max_position_embeddings", 0) or 0)
        family = family_of(mt)
        if family is not None:
            E = family.num_experts(cfg, arch)
            ids = family.moe_layers(cfg, L)
        elif any(cfg.get(k) for k in _DENSE_HINTS):
            raise ModelConfigError(
                f"{arch} (model_type {mt!r}) looks like an MoE model but r3lab has no layer rule for it; "
                "add its family to r3lab.families (docs/adding-a-model-family.md) so dense layers are not mistaken "
                "for MoE layers"
            )
        else:
            raise ModelConfigError(f"{arch} (model_type {mt!r}) is a dense model: it has no routed experts to capture")
        k = _int(cfg, family.top_k_key, arch)
        return cls(mt, arch, L, ids, E, k, max_pos)


def _int(cfg: dict[str, Any], key: str, arch: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelConfigError(f"{arch}: config field {key!r} must be an integer, got {v!r}")
    return v

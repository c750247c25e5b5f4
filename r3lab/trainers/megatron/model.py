"""One rank's Megatron model as r3lab's loaders hand it over, and the Hugging Face checkpoint it is built from.

Both Megatron loaders (:mod:`~r3lab.trainers.megatron.checkpoint`, mbridge's mappings, and
:mod:`~r3lab.trainers.megatron.megatron_bridge_loader`, NVIDIA Megatron-Bridge's) return a :class:`MegatronModel` and
read the checkpoint through :func:`checkpoint_state_dict`; this module holds what they share, so the imports run one
way: ``checkpoint`` dispatches to the Megatron-Bridge loader by name, and that loader needs nothing of ``checkpoint``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from r3lab.slicing import ParallelLayout


@dataclasses.dataclass
class MegatronModel:
    """This rank's model chunks (one per virtual pipeline stage) and what built them."""

    chunks: list[torch.nn.Module]
    layout: ParallelLayout
    model_dir: Path
    bridge: Any  # the mbridge Bridge (or Megatron-Bridge's AutoBridge) whose mappings load and export
    hf_config: Any
    loaded_names: set[str] = dataclasses.field(default_factory=set)  # checkpoint tensors this rank read (mbridge)
    loader: str = "mbridge"  # which loader built it (r3lab.trainer_registry.MEGATRON_LOADERS)

    @property
    def config(self):
        return self.chunks[0].config


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes, read from the safetensors headers (no tensor is loaded)."""
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    return dict(sorted(out.items()))


def checkpoint_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name, as stored (the oracle :func:`export_hf_state_dict` must reproduce)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return dict(sorted(out.items()))

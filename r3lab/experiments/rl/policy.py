"""Save an RL run's policy at chosen steps, and start a run from a saved one (``--save-every``, ``--init-from``).

What a save holds is what the next step depends on: the trainer model's weights, AdamW's state (moments and step
counts), the loop's numpy RNG (it shuffles the mini-batches) and torch's RNG, and the reward history the collapse
detector looks back over. The engine needs nothing saved: each step's prompts and sampling seeds come from
(seed, step) (:func:`r3lab.experiments.rl.batch.step_seed`) and its weights are pushed from the trainer. So a run
of N steps and a run of k steps saved, then resumed for N - k with the same config, write the same step records
(timings aside) when the thread count is the same. The format is :mod:`r3lab.runs.policy`'s.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.config import RLConfig
from r3lab.errors import ConfigError
from r3lab.runs.policy import (
    POLICY_FORMAT,
    POLICY_VERSION,
    STATE_FILE,
    file_digest,
    policy_path,
    read_policy_meta,
    resolve_init_from,
)

__all__ = ["SavedPolicy", "save_policy", "load_policy", "restore_policy"]


@dataclass(frozen=True)
class SavedPolicy:
    """A saved policy read back: the step it resumes at, its metadata and its state (torch objects)."""

    path: Path
    step: int
    meta: dict[str, Any]
    state: dict[str, Any]

    @property
    def rewards(self) -> list[float]:
        return [float(r) for r in self.meta["rewards"]]


def _held(trainer: Any) -> tuple[Any, Any]:
    model, optimizer = getattr(trainer, "model", None), getattr(trainer, "optimizer", None)
    if model is None or not hasattr(model, "state_dict"):
        raise ConfigError(f"the {getattr(trainer, 'name', type(trainer).__name__)!r} trainer holds no model whose "
                          "state can be saved (--save-every / --init-from need --trainer hf)", field="trainer")
    return model, optimizer


def save_policy(run_path: str | Path, step: int, trainer: Any, rng: np.random.Generator, config: RLConfig,
                rewards: Sequence[float]) -> Path:
    """Save the policy after ``step`` updates into ``run_path``'s ``policy/`` folder (state first, metadata with its
    digest last, so a folder with a ``policy.json`` is complete)."""
    import torch

    model, optimizer = _held(trainer)
    if len(rewards) != step:
        raise ConfigError(f"save_policy: {len(rewards)} rewards of history for step {step}")
    folder = policy_path(run_path, step)
    folder.mkdir(parents=True, exist_ok=False)
    state = {"model": model.state_dict(), "optimizer": None if optimizer is None else optimizer.state_dict(),
             "torch_rng": torch.get_rng_state()}
    torch.save(state, folder / STATE_FILE)
    meta = {"format": POLICY_FORMAT, "version": POLICY_VERSION, "step": int(step), "run": Path(run_path).name,
            "model": config.model, "trainer": config.trainer, "trainer_dtype": config.trainer_dtype,
            "router_dtype": config.router_dtype, "lr": config.lr, "seed": config.seed,
            "optimizer": optimizer is not None, "numpy_rng": rng.bit_generator.state,
            "rewards": [float(r) for r in rewards],
            "state": {"file": STATE_FILE, "sha256": file_digest(folder / STATE_FILE),
                      "bytes": (folder / STATE_FILE).stat().st_size}}
    (folder / "policy.json").write_text(json.dumps(meta, indent=1) + "\n")
    return folder


def load_policy(config: RLConfig, runs_root: Any = None) -> SavedPolicy:
    """The saved policy ``config.init_from`` names, checked against ``config`` (model, trainer and its dtypes) and
    its own digest; the resumed run goes on to ``config.steps``, so the save must be before it."""
    import torch

    if not config.init_from:
        raise ConfigError("load_policy: the config has no init_from", field="init_from")
    folder = resolve_init_from(config.init_from, runs_root)
    meta = read_policy_meta(folder)
    for key in ("model", "trainer", "trainer_dtype", "router_dtype"):
        if meta[key] != getattr(config, key):
            raise ConfigError(f"init_from {config.init_from!r}: saved with {key} {meta[key]!r}, this run has "
                              f"{getattr(config, key)!r}", field="init_from", fields=(key,))
    if meta["step"] >= config.steps:
        raise ConfigError(f"init_from {config.init_from!r} resumes at step {meta['step']}, at or past this run's "
                          f"{{steps}} {config.steps}", field="init_from", fields=("steps",))
    state_file = folder / meta["state"]["file"]
    if file_digest(state_file) != meta["state"]["sha256"]:
        raise ConfigError(f"init_from {config.init_from!r}: {state_file} is not the file its policy.json names "
                          "(sha256 differs)", field="init_from")
    state = torch.load(state_file, weights_only=True)
    return SavedPolicy(folder, int(meta["step"]), meta, state)


def restore_policy(saved: SavedPolicy, trainer: Any, rng: np.random.Generator) -> None:
    """Load ``saved`` into the trainer (weights, optimizer state when saved) and the loop's RNGs."""
    import torch

    model, optimizer = _held(trainer)
    model.load_state_dict(saved.state["model"], strict=True)
    if saved.state.get("optimizer") is not None:
        if optimizer is None:
            raise ConfigError("init_from: the policy saved optimizer state and this trainer has no optimizer")
        optimizer.load_state_dict(saved.state["optimizer"])
    torch.set_rng_state(saved.state["torch_rng"])
    rng.bit_generator.state = saved.meta["numpy_rng"]

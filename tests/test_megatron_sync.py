"""Weights go back from the Megatron-core trainer to the engine: ``update_weights`` equals loading them from disk.

The Megatron trainer at TP2xPP2 (gloo CPU ranks) takes one policy step, so its weights differ from the shipped
checkpoint, and exports them (TP and PP shards gathered, mapped to the checkpoint's names). Oracle: those weights
saved as a checkpoint folder (the shipped config and tokenizer, one safetensors file) and loaded by a fresh engine.
Under test: an engine started from the shipped checkpoint that takes the exported weights with ``update_weights``.
Both engines score the same fixed token sequences (prefill log-probs).

Bit-equal, because the inputs are identical: the same fp32 tensors (the file holds exactly the exported tensors and
both engines run fp32, so no cast happens on either path), the same sequences in the same batch, the same process,
kernels and thread count; vLLM's reload repacks each module as its first load did (``RolloutEngine.update_weights``).

Two engine starts, one after the other, not one: an engine that first loaded the exported weights from disk, took
other weights and then the exported ones again would hide a module that ``update_weights`` never reaches (it would
still hold the disk copy). Starting from the shipped checkpoint, every module the update misses keeps the old
weights and the scores differ. Holds the heavy lock (``flock /tmp/r3lab-heavy.lock``): Megatron ranks and vLLM.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from r3lab.paths import model_dir
from r3lab.rollout import RolloutEngine
from r3lab.trainers import PolicyUpdate, TokenBatch
from r3lab.trainers.megatron.trainer import MegatronTrainer

MODEL = "tiny-qwen3-moe"
LR = 1e-3


def _sequences() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(4, 388, size=n).tolist() for n in (14, 19, 11, 17)]


def _scores(engine: RolloutEngine) -> np.ndarray:
    return np.concatenate(engine.score(_sequences()))


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    """The Megatron trainer's weights after one policy step at TP2xPP2, saved as a checkpoint folder."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = model_dir(MODEL)
    batch = TokenBatch.from_ids(_sequences(), [4, 6, 3, 5])
    with MegatronTrainer(src, tp=2, pp=2, lr=LR, timeout_s=120) as t:
        old = t.score(batch).logprobs
        adv = np.random.default_rng(1).standard_normal(len(batch))[batch.token_sample]
        t.policy_step(batch, PolicyUpdate(old_logprobs=old - 0.05, advantages=adv, infer_logprobs=old, tis_cap=2.0))
        weights = dict(t.export_weights())
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        shipped = {k: f.get_tensor(k) for k in f.keys()}
    folder = tmp_path_factory.mktemp("megatron-stepped")
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors":
            shutil.copy(p, folder / p.name)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return dict(weights=weights, shipped=shipped, folder=folder)


def test_exported_weights_are_the_whole_checkpoint_and_moved(stepped):
    w, shipped = stepped["weights"], stepped["shipped"]
    assert sorted(w) == sorted(shipped)  # every checkpoint name, nothing else: a complete checkpoint on disk
    for n, t in w.items():
        assert t.shape == shipped[n].shape and t.dtype == torch.float32, n
    moved = [n for n in w if not torch.equal(w[n], shipped[n].float())]
    assert len(moved) > len(w) // 2  # the step changed most tensors (AdamW's first step moves every live weight)


def test_update_weights_scores_as_the_same_weights_loaded_from_disk(stepped):
    with RolloutEngine(model_dir(MODEL), seed=0, dtype="float32") as eng:
        before = _scores(eng)
        eng.update_weights(stepped["weights"])
        pushed = _scores(eng)
    with RolloutEngine(stepped["folder"], seed=0, dtype="float32") as eng:
        from_disk = _scores(eng)
    print(f"\nmax |logp(pushed) - logp(disk)| = {np.abs(pushed - from_disk).max():.2e}; "
          f"the step moved the engine's log-probs by up to {np.abs(pushed - before).max():.2e}")
    assert np.abs(pushed - before).max() > 1e-4  # the update reached the engine (the weights differ from disk)
    np.testing.assert_array_equal(pushed, from_disk)

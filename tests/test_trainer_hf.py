"""The transformers trainer behind the Trainer interface (r3lab.trainers.hf), on the shipped tiny model (no engine):
scoring equals the one-sequence forward, replay and record keep their promises, a policy step moves the weights,
and the exported weights carry the checkpoint's names and shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3lab.errors import ConfigError
from r3lab.paths import model_dir
from r3lab.replay import hf_token_logprobs
from r3lab.routes import Routes
from r3lab.trainers import PolicyUpdate, TokenBatch, Trainer
from r3lab.trainers.hf import HFTrainer

SEQS = [[2, 10, 11, 12, 13, 14, 15], [2, 20, 21, 22, 23]]
PROMPTS = [3, 2]


@pytest.fixture(scope="module")
def trainer():
    return HFTrainer.load(model_dir("tiny-qwen3-moe"), "float32", lr=1e-3)


def test_it_is_a_trainer_and_scores_a_lone_sample_as_the_one_sequence_forward(trainer):
    assert isinstance(trainer, Trainer)
    for q, p in zip(SEQS, PROMPTS, strict=True):
        got = trainer.score(TokenBatch.from_ids([q], [p]), record=True)
        want, routes = hf_token_logprobs(trainer.model, q, prompt_len=p, record=True)
        assert np.array_equal(got.logprobs, want)  # identical inputs and shapes: bit-equal
        assert got.routes == routes and got.routes.total_tokens == len(q)  # P + R rows: the trainer convention


def test_a_padded_batch_scores_each_sample_within_fp32_rounding(trainer):
    """Padding changes the matmul shapes and the expert batches, so the batch agrees with one-by-one scoring
    within fp32 rounding (1e-4 on log-probs of a few nats), not to the bit."""
    both = trainer.score(TokenBatch.from_ids(SEQS, PROMPTS), record=True, entropy=True)
    alone = np.concatenate([hf_token_logprobs(trainer.model, q, prompt_len=p)[0]
                            for q, p in zip(SEQS, PROMPTS, strict=True)])
    np.testing.assert_allclose(both.logprobs, alone, rtol=0, atol=1e-4)
    assert both.entropy.shape == both.logprobs.shape and (both.entropy > 0).all()
    assert [len(both.routes.sequence(i)) for i in range(2)] == [len(q) for q in SEQS]  # padding dropped


def test_replayed_routes_are_the_routes_used(trainer):
    batch = TokenBatch.from_ids(SEQS, PROMPTS)
    own = trainer.score(batch, record=True).routes
    rng = np.random.default_rng(0)
    other = Routes(np.stack([np.stack([rng.choice(own.num_experts, own.top_k, replace=False)
                                       for _ in range(own.num_layers)]) for _ in range(own.total_tokens)]),
                   own.cu_seqlens, own.num_experts, own.layer_ids)
    out = trainer.score(batch, routes=other, record=True)
    assert out.routes == other
    assert not np.allclose(out.logprobs, trainer.score(batch).logprobs)


def test_a_policy_step_moves_the_weights_and_the_export_keeps_the_checkpoint_names(trainer):
    from safetensors import safe_open

    batch = TokenBatch.from_ids(SEQS, PROMPTS)
    n = int(batch.response_lengths.sum())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    old = trainer.score(batch).logprobs
    update = PolicyUpdate(old_logprobs=old, advantages=np.where(batch.token_sample == 0, 1.0, -1.0),
                          infer_logprobs=old, clip_eps=0.2)
    stats = trainer.policy_step(batch, update)
    assert stats.loss == pytest.approx(-float(np.mean(np.where(batch.token_sample == 0, 1.0, -1.0))), abs=1e-5)
    assert stats.clip_frac == 0.0 and stats.grad_norm > 0 and stats.tis_weight_mean is None
    np.testing.assert_allclose(stats.logprobs, old, rtol=0, atol=1e-5)  # the forward before the step: the old policy
    assert stats.logprobs.shape == (n,)
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    exported = trainer.export_weights()
    with safe_open(str(model_dir("tiny-qwen3-moe") / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert set(exported) == names
        for k in names:
            assert tuple(exported[k].shape) == tuple(f.get_slice(k).get_shape()), k


def test_no_optimizer_no_policy_step():
    scorer = HFTrainer.load(model_dir("tiny-qwen3-moe"), "float32")
    batch = TokenBatch.from_ids(SEQS[:1], PROMPTS[:1])
    zeros = np.zeros(int(batch.response_lengths.sum()))
    with pytest.raises(ConfigError, match="lr="):
        scorer.policy_step(batch, PolicyUpdate(zeros, zeros, zeros))

"""The clipped objectives of r3lab.trainers.loss against hand-computed cases: GSPO's sequence ratio, its clipping
and gradient; GRPO's token-level form as it was."""

import math

import numpy as np
import pytest
import torch

from r3lab.errors import BatchError, ConfigError
from r3lab.trainers import PolicyUpdate
from r3lab.trainers.loss import clipped_policy_loss, sequence_ratios

# two samples: 3 tokens with log-ratios 0.1, 0.2, -0.3 (mean 0), 2 tokens with 0.001, 0.003 (mean 0.002)
LOGP = np.array([-1.0, -2.0, -0.5, -1.5, -0.7])
OLD = LOGP - np.array([0.1, 0.2, -0.3, 0.001, 0.003])
SAMPLE = np.array([0, 0, 0, 1, 1])
ADV = np.array([1.0, 1.0, 1.0, 2.0, 2.0])


def _update(**kw):
    base = dict(old_logprobs=OLD, advantages=ADV, infer_logprobs=OLD, clip_eps=3e-4, clip_eps_high=4e-4,
                loss="gspo", token_sample=SAMPLE)
    return PolicyUpdate(**{**base, **kw})


def _logp():
    return torch.tensor(LOGP, dtype=torch.float32, requires_grad=True)


def test_sequence_ratio_is_the_geometric_mean_of_token_ratios():
    s = sequence_ratios(_logp(), torch.tensor(OLD, dtype=torch.float32), torch.tensor(SAMPLE), 2)
    assert s.detach().numpy() == pytest.approx([1.0, math.exp(0.002)], rel=1e-6)


def test_gspo_loss_value_clipping_and_gradient_by_hand():
    logp = _logp()
    out = clipped_policy_loss(logp, _update())
    # sample 0: s = 1 inside [1 - 3e-4, 1 + 4e-4] -> term -A s = -1; sample 1: s = e^0.002 > 1 + 4e-4 with A > 0 ->
    # min picks the clipped value -(1 + 4e-4) * 2; the loss is the mean over samples
    assert float(out.loss.detach()) == pytest.approx((-1.0 - 2 * (1 + 4e-4)) / 2, rel=1e-6)
    out.loss.backward()
    # d/d logp_t of -A s / 2 for the unclipped sample: -A s / (2 n_i) = -1 / 6 on each of its 3 tokens; 0 for the
    # clipped sample (the clamp is flat there)
    assert logp.grad.numpy() == pytest.approx([-1 / 6, -1 / 6, -1 / 6, 0.0, 0.0], abs=1e-7)
    st = out.stats()
    assert st["clip_frac"] == 0.5  # one of two samples clipped (a share of samples, not of tokens)
    assert out.seq_ratio.detach().numpy() == pytest.approx([1.0, math.exp(0.002)], rel=1e-6)


def test_gspo_negative_advantage_and_token_weights():
    logp = _logp()
    adv = np.array([-1.0, -1.0, -1.0, -2.0, -2.0])
    infer = OLD - np.log([1.0, 2.0, 1.0, 1.0, 1.0])  # token 1: pi_old / pi_engine = 2, capped at 1.5
    out = clipped_policy_loss(logp, _update(advantages=adv, infer_logprobs=infer, tis_cap=1.5))
    # sample 1 with A < 0 and s above the range: the unclipped -A s = 2 e^0.002 is the max; min(s A, clip(s) A)
    # = s A; sample 0: tokens weighted 1, 1.5, 1 -> its term (1 * 3.5) / 3
    s1 = math.exp(0.002)
    assert float(out.loss.detach()) == pytest.approx((3.5 / 3 + 2 * s1) / 2, rel=1e-6)
    out.loss.backward()
    g = logp.grad.numpy()
    assert g[:3] == pytest.approx([1 / 6, 1.5 / 6, 1 / 6], rel=1e-5)
    assert g[3:] == pytest.approx([2 * s1 / 4, 2 * s1 / 4], rel=1e-5)  # A s / (2 n_i), unclipped
    assert out.tis_weight.numpy() == pytest.approx([1.0, 1.5, 1.0, 1.0, 1.0])


def test_grpo_is_the_token_level_objective():
    logp = _logp()
    out = clipped_policy_loss(logp, PolicyUpdate(old_logprobs=OLD, advantages=ADV, infer_logprobs=OLD))
    r = np.exp(LOGP - OLD)
    want = -np.minimum(r * ADV, np.clip(r, 0.8, 1.2) * ADV).mean()
    assert float(out.loss.detach()) == pytest.approx(want, rel=1e-6)
    assert out.stats()["clip_frac"] == pytest.approx(np.mean(np.abs(r - 1) > 0.2))
    assert out.stats(0.05)["clip_frac"] == pytest.approx(np.mean(np.abs(r - 1) > 0.05))


def test_gspo_refuses_what_it_cannot_compute():
    with pytest.raises(BatchError, match="token_sample"):
        clipped_policy_loss(_logp(), _update(token_sample=None))
    with pytest.raises(BatchError, match="one advantage per sample"):
        clipped_policy_loss(_logp(), _update(advantages=np.array([1.0, 0.0, 1.0, 2.0, 2.0])))
    with pytest.raises(BatchError, match="skips a sample"):
        clipped_policy_loss(_logp(), _update(token_sample=np.array([0, 0, 0, 2, 2])))
    with pytest.raises(ConfigError, match="loss must be one of"):
        clipped_policy_loss(_logp(), _update(loss="ppo2"))

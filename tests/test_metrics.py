import numpy as np
import pytest

from r3lab.errors import R3LabError
from r3lab.metrics import (
    expert_load,
    extreme_token_fraction,
    k3_kl,
    max_violation,
    mismatch_metrics,
    route_agreement,
    route_change_rate,
    set_differs,
    set_overlap,
    token_route_flips,
)


def test_k3_matches_its_definition_and_is_zero_on_identical():
    rng = np.random.default_rng(0)
    infer = -rng.random(100) * 3
    train = infer + rng.normal(0, 0.1, 100)
    d = train - infer
    assert k3_kl(train, infer) == pytest.approx(np.mean(np.exp(d) - 1 - d), rel=1e-12)
    assert k3_kl(infer, infer) == 0.0
    assert k3_kl(train, infer) > 0


def test_extreme_token_fraction():
    infer = np.log([0.5, 0.5, 0.5, 0.5])
    train = np.log([0.5, 0.2, 0.9, 0.05])  # ratios 1, 0.4, 1.8, 0.1
    assert extreme_token_fraction(train, infer, tau=2.0) == 0.5
    assert extreme_token_fraction(train, infer, tau=1.5) == 0.75


def test_route_flips_are_set_based():
    a = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])
    b = np.array([[[1, 0], [3, 2]], [[4, 5], [6, 1]]])  # token 0: same sets, other order; token 1: layer 1 differs
    assert set_differs(a, b).tolist() == [[False, False], [False, True]]
    assert token_route_flips(a, b).tolist() == [False, True]


def test_bad_shapes_raise():
    with pytest.raises(R3LabError, match="shape"):
        k3_kl(np.zeros(3), np.zeros(4))
    with pytest.raises(R3LabError, match="no tokens"):
        k3_kl(np.zeros(0), np.zeros(0))
    with pytest.raises(R3LabError, match=r"\[T, L, K\]"):
        set_differs(np.zeros((2, 2)), np.zeros((2, 2)))


def test_route_agreement_by_hand():
    a = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]])
    b = np.array([[[1, 0], [3, 2]], [[4, 5], [6, 1]], [[2, 4], [5, 6]]])
    assert set_overlap(a, b, 8).tolist() == [[2, 2], [2, 1], [1, 0]]
    agg = route_agreement(a, b, 8, layer_ids=[1, 3])
    assert agg["per_layer_agreement"] == {1: pytest.approx(2 / 3), 3: pytest.approx(1 / 3)}
    assert agg["per_layer_overlap"] == {1: pytest.approx(5 / 6), 3: pytest.approx(3 / 6)}
    assert agg["router_disagreement"] == pytest.approx(3 / 6)
    assert agg["token_disagreement"] == pytest.approx(2 / 3)
    assert agg["chance"] == 2 / 8 and agg["tokens"] == 3
    with pytest.raises(R3LabError, match="outside"):
        set_overlap(a, b, 7)
    with pytest.raises(R3LabError, match="layer ids"):
        route_agreement(a, b, 8, layer_ids=[1])


def test_mismatch_metrics_by_hand():
    infer = np.log([0.5, 0.5, 0.25, 0.8])
    train = np.log([0.5, 0.25, 0.75, 0.8])  # rho = 1, 0.5, 3, 1
    m = mismatch_metrics(train, infer, cu_seqlens=[0, 2, 4], tis_cap=2.0)
    rho = np.array([1, 0.5, 3, 1])
    d = np.log(rho)
    assert m["k3_kl"] == pytest.approx(np.mean(rho - 1 - d))
    assert m["extreme_frac_tau2"] == pytest.approx(0.25)  # only 3 > 2 (0.5 is exactly 1/2, not beyond)
    assert m["extreme_frac_tau1.5"] == pytest.approx(0.5)
    assert m["logprob_abs_diff_mean"] == pytest.approx(np.mean(np.abs(d)))
    assert m["logprob_abs_diff_max"] == pytest.approx(np.log(3))
    seq = np.array([-(0 + np.log(0.5)) / 2, -(np.log(3) + 0) / 2])  # log-ppl train minus infer per sequence
    assert m["log_ppl_diff"] == pytest.approx(seq.mean())
    assert m["ppl_ratio"] == pytest.approx(np.exp(seq).mean())
    assert m["chi2_token"] == pytest.approx(np.mean(rho**2) - 1)
    assert m["is_ratio_mean"] == pytest.approx(1.375) and m["is_ratio_max"] == pytest.approx(3)
    assert m["is_eff_sample_size"] == pytest.approx(5.5**2 / (4 * 11.25))
    assert m["tis_clipfrac"] == pytest.approx(0.25)
    assert m["probs_pearson_corr"] == pytest.approx(np.corrcoef(np.exp(train), np.exp(infer))[0, 1])
    same = mismatch_metrics(infer, infer)
    assert same["k3_kl"] == 0 and same["is_eff_sample_size"] == pytest.approx(1) and same["tis_clipfrac"] == 0
    assert same["probs_pearson_corr"] == pytest.approx(1)


def test_mismatch_metrics_refuse_bad_input():
    with pytest.raises(R3LabError, match="cu_seqlens"):
        mismatch_metrics(np.zeros(3), np.zeros(3), cu_seqlens=[0, 2])
    with pytest.raises(R3LabError, match="non-finite"):
        mismatch_metrics(np.array([0.0, -np.inf]), np.zeros(2))
    with pytest.raises(R3LabError, match="tis_cap"):
        mismatch_metrics(np.zeros(2), np.zeros(2), tis_cap=1.0)


def test_expert_load_max_violation_and_route_change_by_hand():
    v = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 1]]])  # T=2, L=2, K=2, E=4
    load = expert_load(v, 4)
    assert load.tolist() == [[0.5, 0.25, 0.25, 0.0], [0.0, 0.25, 0.5, 0.25]]
    assert max_violation(load).tolist() == pytest.approx([1.0, 1.0])  # max 0.5 vs mean 0.25
    assert max_violation(np.full((1, 4), 0.25)).tolist() == [0.0]
    after = np.array([[[1, 0], [2, 0]], [[0, 2], [1, 2]]])
    assert route_change_rate(v, after).tolist() == [0.0, 0.5]
    with pytest.raises(R3LabError, match="outside"):
        expert_load(v, 3)

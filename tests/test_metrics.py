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
    routing_weight_l1,
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


def test_routing_weight_l1_by_hand():
    ids_a = np.array([[[0, 1]], [[0, 1]], [[2, 3]]])
    w_a = np.array([[[0.75, 0.25]], [[0.75, 0.25]], [[0.5, 0.5]]])
    ids_b = np.array([[[1, 0]], [[0, 1]], [[0, 1]]])  # token 0: same set in another order; token 2: disjoint
    w_b = np.array([[[0.25, 0.75]], [[0.5, 0.5]], [[0.5, 0.5]]])
    # token 0: identical routing; token 1: |0.75 - 0.5| + |0.25 - 0.5|; token 2: all weight moved, 1 + 1
    assert routing_weight_l1(ids_a, w_a, ids_b, w_b, 4)[:, 0].tolist() == pytest.approx([0.0, 0.5, 2.0])
    with pytest.raises(R3LabError, match="weights"):
        routing_weight_l1(ids_a, w_a[:, :, :1], ids_b, w_b, 4)
    with pytest.raises(R3LabError, match="outside"):
        routing_weight_l1(ids_a, w_a, ids_b + 3, w_b, 4)


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


def test_extreme_fraction_curve_matches_the_pointwise_definition():
    from r3lab.metrics import extreme_fraction_curve, extreme_token_fraction

    rng = np.random.default_rng(3)
    inf = rng.normal(-2, 1, 500)
    train = inf + rng.normal(0, 0.4, 500)
    taus = np.array([1.01, 1.2, 1.5, 2.0, 3.0])
    want = [extreme_token_fraction(train, inf, t) for t in taus]
    np.testing.assert_allclose(extreme_fraction_curve(train, inf, taus), want)
    # by hand: deltas 0, log 1.5 (not beyond 1.5: strictly greater), log 3
    np.testing.assert_allclose(extreme_fraction_curve(np.log([1, 1.5, 3]), np.zeros(3), [1.5, 2.0]), [1 / 3, 1 / 3])
    with pytest.raises(R3LabError, match="> 1"):
        extreme_fraction_curve(train, inf, [0.5])


def test_load_shift_response_rows_and_per_layer_flip_drift_by_hand():
    from r3lab.metrics import load_shift, per_layer_flip_drift, response_rows

    a = np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    b = np.array([[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]])
    np.testing.assert_allclose(load_shift(a, b), [0.5, 0.0])
    with pytest.raises(R3LabError, match="one shape"):
        load_shift(a, b[:1])
    # two samples: P=3, R=2 -> 4 rows (input rows 2, 3); P=2, R=3 -> 4 rows (input rows 1, 2, 3), offset 4
    np.testing.assert_array_equal(response_rows([0, 4, 8], [2, 3]), [2, 3, 5, 6, 7])
    with pytest.raises(R3LabError, match="response tokens"):
        response_rows([0, 4, 8], [2, 5])
    differs = np.array([[True, False], [False, False], [True, True]])
    d = np.array([0.1, 0.0, -0.2])
    out = per_layer_flip_drift(differs, d, np.zeros(3))
    k3 = np.expm1(d) - d
    np.testing.assert_allclose(out["disagreement"], [2 / 3, 1 / 3])
    np.testing.assert_allclose(out["k3_flipped"], [(k3[0] + k3[2]) / 2, k3[2]])
    np.testing.assert_allclose(out["k3_agreeing"], [k3[1], (k3[0] + k3[1]) / 2])
    np.testing.assert_allclose(out["abs_diff_flipped"], [0.15, 0.2])
    assert np.isnan(per_layer_flip_drift(np.zeros((3, 1), bool), d, np.zeros(3))["k3_flipped"][0])


def test_both_row_conventions_name_the_same_input_positions():
    """A sampled token is scored at input position t - 1, whichever convention the routes follow: the engine's
    P + R - 1 rows (no row for the last sampled token) or the trainer's P + R rows."""
    from r3lab.metrics import ENGINE_ROWS, TRAINER_ROWS, response_rows

    P, R = (3, 2), (2, 3)  # two samples
    engine_cu = np.concatenate([[0], np.cumsum([p + r - 1 for p, r in zip(P, R, strict=True)])])
    trainer_cu = np.concatenate([[0], np.cumsum([p + r for p, r in zip(P, R, strict=True)])])
    # by hand: the input position of token t = P + r is P + r - 1, offset by the sample's first row
    want_engine = [int(engine_cu[i]) + P[i] - 1 + r for i in range(2) for r in range(R[i])]
    want_trainer = [int(trainer_cu[i]) + P[i] - 1 + r for i in range(2) for r in range(R[i])]
    np.testing.assert_array_equal(response_rows(engine_cu, R, ENGINE_ROWS), want_engine)
    np.testing.assert_array_equal(response_rows(trainer_cu, R, TRAINER_ROWS), want_trainer)
    assert want_trainer == [2, 3, 6, 7, 8]
    with pytest.raises(R3LabError, match="P \\+ R route rows"):
        response_rows([0, 4], [4], TRAINER_ROWS)  # 4 rows cannot hold P >= 1 and R = 4 with a row per token
    with pytest.raises(R3LabError, match="row convention"):
        response_rows(trainer_cu, R, "vllm")


def test_k3_by_flip_splits_by_hand():
    from r3lab.metrics import k3_by_flip

    d = np.array([0.1, -0.3, 0.0, 0.2])
    flipped = np.array([True, False, False, True])
    k3 = np.expm1(d) - d
    got = k3_by_flip(d, np.zeros(4), flipped)
    assert got["flipped"] == pytest.approx((k3[0] + k3[3]) / 2) and got["agreeing"] == pytest.approx(k3[1] / 2)
    assert k3_by_flip(d, np.zeros(4), np.zeros(4, bool))["flipped"] is None  # no flipped token: no number
    with pytest.raises(R3LabError, match="one shape"):
        k3_by_flip(d, np.zeros(4), flipped[:3])

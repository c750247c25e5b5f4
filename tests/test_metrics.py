import numpy as np
import pytest

from r3lab.errors import R3LabError
from r3lab.metrics import extreme_token_fraction, k3_kl, route_agreement, set_differs, set_overlap, token_route_flips


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

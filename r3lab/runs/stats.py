"""Seed statistics for runs read back: Student's t, equivalence (TOST), power, Fisher's exact test, Kaplan-Meier
survival and the log-rank test, and a least-squares fit with several regressors.

Why here and in numpy: the environment has no scipy, and these are the few tests the long-horizon re-analysis and
the pre-registered collapse experiment (bench/bench_collapse.py) name. Each is the textbook form, written so a
reader can check it against its definition: the t distribution through the regularized incomplete beta function
(continued fraction, modified Lentz), Fisher's two-sided p as the sum of the hypergeometric tables no more likely
than the observed one (as R's ``fisher.test`` and scipy's ``fisher_exact``), the log-rank statistic with the
hypergeometric variance at each event time (one degree of freedom).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from r3lab.errors import MetricError

__all__ = ["t_cdf", "t_ppf", "normal_cdf", "least_squares", "Tost", "tost", "detectable_difference", "seeds_needed",
           "fisher_exact", "KaplanMeier", "kaplan_meier", "LogRank", "logrank"]


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            return h
    raise MetricError(f"incomplete beta: the continued fraction did not converge (a={a}, b={b}, x={x})")


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (``df`` > 0, not necessarily whole: Welch's)."""
    if not df > 0:
        raise MetricError(f"t_cdf needs df > 0, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise MetricError(f"t_ppf needs p in (0, 1), got {p}")
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, abs(mid)):
            break
    return 0.5 * (lo + hi)


def normal_cdf(z: float) -> float:
    """P(Z <= z) for the standard normal."""
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def least_squares(y: np.ndarray, *columns: np.ndarray) -> np.ndarray:
    """The coefficients of ``y ~ 1 + columns...`` by least squares (intercept first); rows with a non-finite value
    are left out. Fewer rows than coefficients is an error."""
    yy = np.asarray(y, dtype=np.float64).ravel()
    x = np.column_stack([np.ones(yy.size)] + [np.asarray(c, dtype=np.float64).ravel() for c in columns])
    if x.shape[0] != yy.size:
        raise MetricError(f"least_squares: {yy.size} values against {x.shape[0]} rows of regressors")
    ok = np.isfinite(yy) & np.isfinite(x).all(axis=1)
    if ok.sum() < x.shape[1]:
        raise MetricError(f"least_squares: {int(ok.sum())} usable rows for {x.shape[1]} coefficients")
    coef: np.ndarray = np.linalg.lstsq(x[ok], yy[ok], rcond=None)[0]
    return coef


@dataclass(frozen=True)
class Tost:
    """Two one-sided tests (Schuirmann) of ``|mean(a) - mean(b)| < margin``, Welch's t: equivalence is shown at
    level alpha when ``p`` < alpha, i.e. when the (1 - 2 alpha) interval lies inside (-margin, +margin)."""

    diff: float  # mean(a) - mean(b)
    se: float
    df: float  # Welch-Satterthwaite
    p_lower: float  # H0: diff <= -margin
    p_upper: float  # H0: diff >= +margin
    p: float  # max of the two
    lo: float  # the (1 - 2 alpha) confidence interval of diff
    hi: float
    margin: float
    alpha: float

    @property
    def equivalent(self) -> bool:
        return self.p < self.alpha


def tost(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, margin: float, *,
         alpha: float = 0.05) -> Tost:
    """:class:`Tost` of two samples (at least 2 values each, not all equal on both sides)."""
    x, y = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if x.size < 2 or y.size < 2 or not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise MetricError(f"tost needs at least 2 finite values a side, got {x.size} and {y.size}")
    if margin <= 0 or not 0 < alpha < 0.5:
        raise MetricError(f"tost needs margin > 0 and alpha in (0, 0.5), got {margin}, {alpha}")
    va, vb = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    se = math.sqrt(va + vb)
    if se == 0:
        raise MetricError("tost: no spread on either side (every value equal)")
    df = (va + vb) ** 2 / (va**2 / (x.size - 1) + vb**2 / (y.size - 1))
    diff = float(x.mean() - y.mean())
    p_lower = 1.0 - t_cdf((diff + margin) / se, df)
    p_upper = t_cdf((diff - margin) / se, df)
    q = t_ppf(1.0 - alpha, df)
    return Tost(diff, se, df, p_lower, p_upper, max(p_lower, p_upper), diff - q * se, diff + q * se, margin, alpha)


def detectable_difference(sd: float, n: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest difference of means a two-sided two-sample t test with ``n`` seeds an arm detects with
    ``power``, for a seed SD ``sd``: ``(t_{1-alpha/2, 2n-2} + t_{power, 2n-2}) * sd * sqrt(2 / n)`` (the usual
    t-corrected normal approximation; exact power needs the noncentral t, within a few percent of this here)."""
    if n < 2 or sd < 0:
        raise MetricError(f"detectable_difference needs n >= 2 and sd >= 0, got {n}, {sd}")
    df = 2 * n - 2
    return (t_ppf(1 - alpha / 2, df) + t_ppf(power, df)) * sd * math.sqrt(2.0 / n)


def seeds_needed(sd: float, difference: float, *, alpha: float = 0.05, power: float = 0.8,
                 limit: int = 10000) -> int:
    """The fewest seeds an arm for which :func:`detectable_difference` is at most ``difference``."""
    if difference <= 0:
        raise MetricError(f"seeds_needed needs a difference > 0, got {difference}")
    for n in range(2, limit + 1):
        if detectable_difference(sd, n, alpha=alpha, power=power) <= difference:
            return n
    raise MetricError(f"seeds_needed: more than {limit} seeds an arm for {difference} at sd {sd}")


def _hypergeom_pmf(k: int, n_a: int, n_b: int, events: int) -> float:
    return math.comb(n_a, k) * math.comb(n_b, events - k) / math.comb(n_a + n_b, events)


def fisher_exact(events_a: int, n_a: int, events_b: int, n_b: int) -> float:
    """Fisher's exact test of the 2x2 table (``events_a`` of ``n_a`` against ``events_b`` of ``n_b``), two-sided: the
    summed probability of every table with the same margins no more likely than the observed one."""
    if not (0 <= events_a <= n_a and 0 <= events_b <= n_b) or n_a < 1 or n_b < 1:
        raise MetricError(f"fisher_exact: {events_a} of {n_a} and {events_b} of {n_b} is no 2x2 table")
    m = events_a + events_b
    ks = range(max(0, m - n_b), min(n_a, m) + 1)
    p_obs = _hypergeom_pmf(events_a, n_a, n_b, m)
    return min(1.0, sum(p for k in ks if (p := _hypergeom_pmf(k, n_a, n_b, m)) <= p_obs * (1 + 1e-7)))


@dataclass(frozen=True)
class KaplanMeier:
    """The Kaplan-Meier survival curve: ``survival[i]`` is S(t) just after ``times[i]`` (the event times)."""

    times: np.ndarray
    survival: np.ndarray
    at_risk: np.ndarray
    events: np.ndarray


def _survival_data(times: Sequence[float] | np.ndarray, events: Sequence[bool] | np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    t, e = np.asarray(times, dtype=np.float64).ravel(), np.asarray(events, dtype=bool).ravel()
    if t.size != e.size or t.size == 0 or not np.isfinite(t).all():
        raise MetricError(f"survival data needs one finite time per event flag, got {t.size} times, {e.size} flags")
    return t, e


def kaplan_meier(times: Sequence[float] | np.ndarray, events: Sequence[bool] | np.ndarray) -> KaplanMeier:
    """Kaplan-Meier of ``times`` (the event step, or the last step observed) with ``events`` (True: the event
    happened at that time; False: censored there)."""
    t, e = _survival_data(times, events)
    ut = np.unique(t[e])
    at_risk = np.array([(t >= u).sum() for u in ut], dtype=np.int64)
    d = np.array([(e & (t == u)).sum() for u in ut], dtype=np.int64)
    return KaplanMeier(ut, np.cumprod(1.0 - d / at_risk), at_risk, d)


@dataclass(frozen=True)
class LogRank:
    """The log-rank test of two survival samples: observed and expected events of the first, the chi-square (one
    degree of freedom) and its p."""

    observed_a: int
    expected_a: float
    chi2: float
    p: float


def logrank(times_a: Sequence[float] | np.ndarray, events_a: Sequence[bool] | np.ndarray,
            times_b: Sequence[float] | np.ndarray, events_b: Sequence[bool] | np.ndarray) -> LogRank:
    """The (Mantel-Cox) log-rank test: at each event time the first sample's events against their hypergeometric
    expectation given who is at risk; ``chi2 = (O - E)^2 / V``, p from the chi-square with one degree of freedom.
    No event in either sample: chi2 0, p 1."""
    ta, ea = _survival_data(times_a, events_a)
    tb, eb = _survival_data(times_b, events_b)
    o = e_sum = v = 0.0
    for u in np.unique(np.concatenate([ta[ea], tb[eb]])):
        na, nb = float((ta >= u).sum()), float((tb >= u).sum())
        da, db = float((ea & (ta == u)).sum()), float((eb & (tb == u)).sum())
        n, d = na + nb, da + db
        o += da
        e_sum += d * na / n
        if n > 1:
            v += d * (na / n) * (nb / n) * (n - d) / (n - 1)
    chi2 = (o - e_sum) ** 2 / v if v > 0 else 0.0
    return LogRank(int(o), e_sum, chi2, math.erfc(math.sqrt(chi2 / 2.0)))

"""Tick values and labels chosen from the data's range, so that no axis shows two identical labels.

plotly.js picks ticks by itself, but a fixed ``tickformat`` (".0%" on values below 1%) or its SI labels on a
log axis spanning less than a decade ("902.8071μ") can print the same text twice or unreadable text. Here the
ticks are chosen in Python (1/2/5 steps on a linear axis; decades, then 1-3 or 1-2-5 mantissas on a log axis)
and each is labelled with the shortest text that reads back as its value, so distinct ticks get distinct
labels. :func:`axis_ticks` returns the axis properties (``tickmode="array"``) for ``update_xaxes``/``update_yaxes``
or a colour bar; :func:`tick_labels` the labels alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from r3lab.errors import FigureError

__all__ = ["tick_values", "tick_labels", "axis_ticks"]

_SCI_BELOW, _SCI_FROM = 1e-3, 1e5  # outside this magnitude labels read "2e-5" / "1e6"


def _finite(values: Iterable[Any], log: bool) -> np.ndarray:
    a = np.asarray([v for v in np.ravel(np.asarray(list(values), dtype=object)) if v is not None], dtype=np.float64)
    a = a[np.isfinite(a)]
    return a[a > 0] if log else a


def tick_values(lo: float, hi: float, *, log: bool = False, target: int = 5, integer: bool = False) -> np.ndarray:
    """About ``target`` round tick values covering ``[lo, hi]`` (a log axis needs ``lo > 0``).

    Linear: multiples of 1, 2 or 5 x 10^k. Log: decades (every n-th when there are many), else 1-3 or 1-2-5
    mantissas per decade, else (a range inside one decade) linear ticks. ``integer``: steps of 1 or more.
    """
    lo, hi = float(min(lo, hi)), float(max(lo, hi))
    if log:
        if lo <= 0:
            raise FigureError(f"a log axis needs positive values, got the range [{lo}, {hi}]")
        k0, k1 = math.floor(math.log10(lo) + 1e-9), math.ceil(math.log10(hi) - 1e-9)
        decades = [k for k in range(k0, k1 + 1) if lo * (1 - 1e-9) <= 10.0**k <= hi * (1 + 1e-9)]
        if len(decades) >= 3:
            every = math.ceil(len(decades) / (target + 1))
            return np.array([10.0**k for k in decades if k % every == 0] or [10.0 ** decades[0]])
        for mantissas in ((1, 3), (1, 2, 5)):
            ticks = [m * 10.0**k for k in range(k0 - 1, k1 + 1) for m in mantissas
                     if lo * (1 - 1e-9) <= m * 10.0**k <= hi * (1 + 1e-9)]
            if len(ticks) >= 3:
                return np.array(ticks)
        lin = tick_values(lo, hi, target=4, integer=integer)
        return lin[lin > 0] if (lin > 0).sum() >= 2 else np.array([lo, hi])
    if hi == lo:
        half = abs(lo) / 2 or 0.5
        lo, hi = lo - half, hi + half
    raw = (hi - lo) / target
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if (hi - lo) / (m * mag) <= target + 1e-9)
    step = max(step, 1.0) if integer else step
    k0, k1 = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return np.array([k * step for k in range(k0, k1 + 1)])


def _text(v: float, digits: int, sci: bool) -> str:
    if v == 0:
        return "0"
    if sci:
        m, e = f"{v:.{digits}e}".split("e")
        m = m.rstrip("0").rstrip(".") if "." in m else m
        return f"{m}e{int(e)}"
    s = f"{v:.{digits}f}"
    s = s.rstrip("0").rstrip(".") if "." in s else s
    return "0" if s in ("-0", "") else s


def tick_labels(values: Any, *, percent: bool = False, log: bool = False) -> list[str]:
    """The shortest label of each tick that reads back as its value (to 1e-6 of the tick spacing, or of the
    value on a log axis); shares (``percent``) in percent; scientific ("2e-5") when the ticks are below 1e-3 or
    from 1e5 in size. Distinct ticks get distinct labels."""
    v = np.asarray(values, dtype=np.float64) * (100.0 if percent else 1.0)
    if v.size == 0:
        return []
    nonzero = np.abs(v[v != 0])
    sci = bool(nonzero.size) and (nonzero.max() < _SCI_BELOW or nonzero.max() >= _SCI_FROM or
                                  (log and nonzero.min() < _SCI_BELOW))
    spacing = np.diff(np.sort(np.unique(v))).min() if np.unique(v).size > 1 else (abs(v[0]) or 1.0)
    out = []
    for x in v:
        tol = 1e-6 * (abs(x) if log and x else spacing)
        for digits in range(0, 17):
            s = _text(float(x), digits, sci)
            if abs(float(s) - x) <= tol:
                break
        out.append(s + ("%" if percent else ""))
    return out


def axis_ticks(values: Iterable[Any], *, log: bool = False, percent: bool = False, include_zero: bool = False,
               pad: float = 0.05, target: int = 6, integer: bool = False, set_range: bool = True) -> dict[str, Any]:
    """Axis properties (``tickmode="array"``, ``tickvals``, ``ticktext``) for data ``values`` (None, NaN and,
    on a log axis, values <= 0 are ignored), padded by ``pad`` of the range as plotly's autorange pads; an
    empty dict when no value is left (plotly's own ticks then). ``integer``: whole-number ticks (RL steps).

    The axis ``range`` is set to that padded range (in log10 units on a log axis), so the ticks shown are the
    ones chosen; ``set_range=False`` for a colour bar (which has no range of its own: pass zmin/zmax)."""
    a = _finite(values, log)
    if a.size == 0:
        return {}
    if log:
        llo, lhi = math.log10(a.min()), math.log10(a.max())
        span = (lhi - llo) or 0.5
        lo, hi = 10 ** (llo - pad * span), 10 ** (lhi + pad * span)
    else:
        lo, hi = float(a.min()), float(a.max())
        if include_zero:
            lo, hi = min(lo, 0.0), max(hi, 0.0)
        span = hi - lo
        lo, hi = (lo - pad * span, hi + pad * span) if span else (lo, hi)
        if include_zero:
            lo, hi = (0.0 if a.min() >= 0 else lo), (0.0 if a.max() <= 0 else hi)
    ticks = tick_values(lo, hi, log=log, target=target, integer=integer and not log)
    out: dict[str, Any] = {"tickmode": "array", "tickvals": [float(t) for t in ticks],
                           "ticktext": tick_labels(ticks, percent=percent, log=log)}
    if set_range:
        if hi == lo:  # one value: the ticks' span around it
            lo, hi = min(lo, float(ticks.min())), max(hi, float(ticks.max()))
        out["range"] = [math.log10(lo), math.log10(hi)] if log else [lo, hi]
    return out

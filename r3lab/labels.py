"""Labels, units and value formats of record keys, for figures, widgets and tables alike (no torch, no plotly).

A record key such as ``routing/engine_max_vio`` maps to a :class:`~r3lab.vocabulary.Metric` in the one table of
keys, :data:`r3lab.vocabulary.METRICS`: a human label, a unit, how its values read (``kind``: a share shown in
percent, a plain number, a count, seconds) and the axis it is best drawn on (``scale``). The run summary's
``mean/<key>`` and ``last_quarter/<key>`` take their key's metric. A key outside the table still displays (its label
is the key itself); :func:`is_known` tells the two apart.

    >>> label("routing/engine_max_vio"), unit("routing/engine_max_vio")
    ('engine load imbalance (max_vio)', '')
    >>> axis_title("mismatch/extreme_frac_tau2")
    'F(2): tokens with ratio beyond 2x (%)'
"""

from __future__ import annotations

import math
from typing import Literal

from r3lab.vocabulary import METRICS, Kind, Metric

__all__ = ["metric", "label", "unit", "axis_title", "kind", "scale", "is_known", "format_value"]

_PREFIXES = {"mean/": "{} (run mean)", "last_quarter/": "{} (last-quarter mean)"}


def metric(key: str) -> Metric:
    """The :class:`~r3lab.vocabulary.Metric` of a record key (a summary's ``mean/``/``last_quarter/`` key takes its
    metric's unit); a key outside the table gets its own name as label, no unit, plain numbers."""
    if key in METRICS:
        return METRICS[key]
    for prefix, words in _PREFIXES.items():
        if key.startswith(prefix):
            m = metric(key[len(prefix):])
            return Metric(words.format(m.label), m.unit, m.kind, m.scale)
    return Metric(key)


def is_known(key: str) -> bool:
    """Whether ``key`` (or the key under its summary prefix) is in :data:`r3lab.vocabulary.METRICS`."""
    for prefix in _PREFIXES:
        key = key.removeprefix(prefix)
    return key in METRICS


def label(key: str) -> str:
    """The human label of a record key (the key itself when it is not in the table)."""
    return metric(key).label


def unit(key: str) -> str:
    """The unit of a record key's values ("" when dimensionless; "%" for shares stored as fractions)."""
    return metric(key).unit


def kind(key: str) -> Kind:
    """How a record key's values format: "percent", "number", "count" or "seconds"."""
    return metric(key).kind


def scale(key: str) -> Literal["linear", "log"]:
    """The axis type a record key is drawn on by default."""
    return metric(key).scale


def axis_title(key: str) -> str:
    """``label (unit)``, or the label alone for a dimensionless metric."""
    m = metric(key)
    return f"{m.label} ({m.unit})" if m.unit else m.label


def format_value(key: str, value: float | None, digits: int = 3) -> str:
    """One value of ``key`` for a table: shares in percent, counts whole, others to ``digits`` significant
    digits (scientific below 1e-3 or from 1e5); ``None``/NaN as "n/a"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    k = kind(key)
    if k == "count":
        return f"{int(round(value)):d}"
    if k == "percent":
        return _number(100 * value, digits) + "%"
    text = _number(value, digits)
    return text + " s" if k == "seconds" else text


def _number(v: float, digits: int) -> str:
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    if abs(v) < 1e-3 or abs(v) >= 1e5:
        m, e = f"{v:.{digits - 1}e}".split("e")
        return f"{m.rstrip('0').rstrip('.')}e{int(e)}"
    return f"{v:.{digits}g}" if abs(v) >= 10 ** (digits - 1) else f"{float(f'{v:.{digits}g}'):g}"

"""Figures from results (never from engines): each function returns a ``plotly.graph_objects.Figure``.

Figures are for notebooks and papers; nothing here calls ``.show()``. Export with
``fig.write_image(path)`` (kaleido; set ``BROWSER_PATH`` to a Chromium binary on a machine without one of its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import plotly.graph_objects as go

__all__ = ["transport_figure"]


def transport_figure(records: Iterable[Mapping[str, Any]], *, popularity: str = "uniform") -> go.Figure:
    """Bytes per routed id of every transport method, one bar group per workload (bench/results/transport.json)."""
    rows = [r for r in records if r["popularity"] == popularity]
    if not rows:
        raise ValueError(f"no transport records with popularity={popularity!r}")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig = go.Figure()
    for m in methods:
        by_w = {r["workload"]: r["bytes_per_id"] for r in rows if r["method"] == m}
        fig.add_bar(name=m, x=workloads, y=[by_w.get(w) for w in workloads], hovertemplate="%{x}<br>%{y:.3f} bytes/id")
    fig.update_layout(
        title=f"Routed-expert transport: bytes per routed id ({popularity} expert popularity)",
        yaxis_title="bytes per routed id (log)",
        yaxis_type="log",
        barmode="group",
        template="plotly_white",
        legend={"orientation": "h", "y": -0.2},
        width=1100,
        height=520,
    )
    return fig

"""One figure style for every figure: the ``"r3lab"`` plotly template, the paper sizes, one colour per replay mode
(and a pair of their own for engine and trainer), and :func:`finish`, which every figure builder ends with.

A finished figure is a :class:`LabFigure`: a ``go.Figure`` whose layout keeps its paper size (exports use it)
but which, displayed in a notebook, drops the fixed width and fills its output area (autosize, responsive).
:func:`finish` also applies the honest-marks rules: a legend entry whose trace has nothing to draw says so in
its own text, titles wrap to the paper width instead of running off it, and a bar is never drawn on a log axis.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping
from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.colors import hex_to_rgb

from r3lab.errors import FigureError

__all__ = ["MODE_COLORS", "mode_color", "SOURCE_COLORS", "ONE_COLUMN", "TWO_COLUMN", "TEMPLATE", "FLIP_COLOR",
           "NOTEBOOK_CONFIG", "NOT_DRAWN", "LabFigure", "finish", "plural", "wrap", "translucent", "lighter"]

# one colour per replay mode, everywhere
MODE_COLORS = {"none": "#7f7f7f", "R2": "#1f77b4", "R3": "#d62728", "R3W": "#9467bd"}
SOURCE_COLORS = {"engine": "#1b9e77", "trainer": "#7570b3"}  # engine vs trainer: never a mode's colour
ONE_COLUMN = {"width": 520, "height": 380}  # px at scale 1; a paper's single column
TWO_COLUMN = {"width": 1100, "height": 460}
FLIP_COLOR = "#ffb000"  # a (token, layer) cell where engine and trainer chose different expert sets
NOTEBOOK_CONFIG = {"responsive": True, "displaylogo": False}  # plotly.js config of a figure shown in a notebook
NOT_DRAWN = "not drawn"  # the words a legend entry carries when its trace has no point to draw
_TITLE_SIZE = 15
_template = go.layout.Template(pio.templates["plotly_white"])  # the paper template: plotly_white, our fonts
_template.layout.update(font={"family": "Helvetica, Arial, sans-serif", "size": 13},
                        title={"font": {"size": _TITLE_SIZE}, "x": 0.02, "xanchor": "left"},
                        margin={"l": 70, "r": 30, "t": 60, "b": 50}, legend={"orientation": "h", "y": -0.25})
pio.templates["r3lab"] = _template
TEMPLATE = "r3lab"


def mode_color(mode: str) -> str:
    """The replay mode's colour in every figure (:data:`MODE_COLORS`; green for a mode outside none/R2/R3)."""
    return MODE_COLORS.get(mode, "#2ca02c")


def _rgb(color: str) -> tuple[int, int, int]:
    if not re.fullmatch(r"#[0-9a-fA-F]{6}", color):
        raise FigureError(f"colour {color!r} is not of the form #rrggbb (the figure colours r3lab blends are)")
    return hex_to_rgb(color)


def translucent(color: str, alpha: float) -> str:
    """``#rrggbb`` as ``rgba(r,g,b,alpha)``: a band's fill in its line's colour."""
    r, g, b = _rgb(color)
    return f"rgba({r},{g},{b},{alpha})"


def lighter(color: str, share: float = 0.5) -> str:
    """``#rrggbb`` blended ``share`` of the way to white, as ``#rrggbb``."""
    return "#{:02x}{:02x}{:02x}".format(*(round(v + (255 - v) * share) for v in _rgb(color)))


def plural(n: int, word: str, words: str | None = None) -> str:
    """``"1 seed"``, ``"3 seeds"`` (``words``: an irregular plural)."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def wrap(text: str, width: int) -> str:
    """``text`` broken with ``<br>`` into lines of at most ``width`` characters (existing breaks kept)."""
    return "<br>".join(line for part in re.split(r"<br\s*/?>", text)
                       for line in (textwrap.wrap(part, width) or [""]))


class LabFigure(go.Figure):
    """A ``go.Figure`` that fills the notebook's width when displayed (the layout's width dropped, autosize,
    ``responsive``); its layout keeps the paper size, which :func:`r3lab.viz.export` and ``write_image`` use."""

    def notebook_dict(self) -> dict[str, Any]:
        """The figure as displayed in a notebook: no fixed width, autosized."""
        d = self.to_dict()
        d["layout"].pop("width", None)
        d["layout"]["autosize"] = True
        return d

    def _ipython_display_(self) -> None:
        if pio.renderers.render_on_display and pio.renderers.default:
            pio.show(self.notebook_dict(), validate=False, config=NOTEBOOK_CONFIG)
        else:
            print(repr(self))

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, validate: bool = True,
                          **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("config", NOTEBOOK_CONFIG)
        return pio.renderers._build_mime_bundle(self.notebook_dict(), pio.renderers.default, **kwargs)


def _axis_types(fig: go.Figure) -> dict[str, str]:
    """``{"x": type, "x2": type, "y": ..., }`` of every cartesian axis the layout names."""
    out = {}
    for name in fig.layout:
        m = re.fullmatch(r"([xy])axis(\d*)", name)
        if m:
            out[m[1] + m[2]] = fig.layout[name].type or "-"
    return out


def _drawable(trace: Any, types: Mapping[str, str]) -> bool:
    """Whether a cartesian trace has at least one point plotly can draw on its axes (finite; > 0 on a log axis)."""
    if trace.type not in ("scatter", "bar", "scattergl"):
        return True
    ok = None
    for axis in ("x", "y"):
        vals = getattr(trace, axis)
        if vals is None:
            continue
        ref = getattr(trace, f"{axis}axis") or axis
        arr = np.asarray([v for v in vals], dtype=object)
        num = np.array([isinstance(v, int | float | np.number) and not isinstance(v, bool) for v in arr])
        if not num.any():  # categories: every non-None one draws
            good = np.array([v is not None for v in arr])
        else:
            f = np.array([float(v) if n else np.nan for v, n in zip(arr, num, strict=True)])
            good = np.isfinite(f) & ((f > 0) if types.get(ref) == "log" else True)
        ok = good if ok is None else ok & good
    return ok is None or bool(ok.any())


def _note_undrawn(fig: go.Figure) -> None:
    types = _axis_types(fig)
    for t in fig.data:
        if t.showlegend is False or not t.name or NOT_DRAWN in t.name or _drawable(t, types):
            continue
        ys = [v for v in (t.y if t.y is not None else []) if v is not None and np.isfinite(float(v))]
        yref = t.yaxis or "y"
        why = ("0 everywhere" if ys and all(v == 0 for v in ys) else "no positive value") if ys else "no value"
        on = " on the log axis" if ys and types.get(yref) == "log" else ""
        t.name = f"{t.name} ({why}: {NOT_DRAWN}{on})"


def _bars_on_log(fig: go.Figure) -> list[str]:
    types = _axis_types(fig)
    return [t.name or "bar" for t in fig.data if t.type == "bar"
            and types.get((t.yaxis or "y") if (t.orientation or "v") == "v" else (t.xaxis or "x")) == "log"]


def _wrap_axis_titles(fig: go.Figure, height: int) -> None:
    """A y axis title longer than the plot is tall runs into the title: break it into lines (and widen the margin)."""
    font = (fig.layout.font.size or 13) + 1
    chars = max(16, int((height - (fig.layout.margin.t or 60) - (fig.layout.margin.b or 50) - 40) / (0.62 * font)))
    extra = 0
    for name in fig.layout:
        if re.fullmatch(r"yaxis\d*", name) and fig.layout[name].title.text:
            text = wrap(fig.layout[name].title.text, chars)
            fig.layout[name].title.text = text
            extra = max(extra, text.count("<br>"))
    if extra:
        left = fig.layout.margin.l or 70
        right = fig.layout.margin.r or 30
        secondary = "yaxis2" in fig.layout and fig.layout["yaxis2"].overlaying  # a right axis: its title wraps too
        fig.update_layout(margin_l=left + 18 * extra, margin_r=right + 18 * extra if secondary else right)


def finish(fig: go.Figure, size: Mapping[str, int], *, title: str | None = None, subtitle: str | None = None,
           **layout: Any) -> LabFigure:
    """The figure in the r3lab template at ``size`` (:data:`ONE_COLUMN` / :data:`TWO_COLUMN`), its title (and a
    smaller ``subtitle``: what the counts count) wrapped to that width, undrawn legend entries noted in place;
    raises :class:`~r3lab.errors.FigureError` on a bar drawn on a log axis (its length would mean nothing)."""
    fig.update_layout(template=TEMPLATE, **size, **layout)
    width = int(size["width"])
    chars = max(30, int((width - 40) / (0.56 * _TITLE_SIZE)))
    lines = 0
    if title is not None:
        text = wrap(title, chars)
        lines = text.count("<br>") + 1
        fig.update_layout(title_text=text)
    if subtitle:
        sub = wrap(subtitle, int(chars * _TITLE_SIZE / 12))
        lines += sub.count("<br>") + 1
        fig.update_layout(title_subtitle_text=sub, title_subtitle_font_size=12)
    if lines > 1:
        fig.update_layout(margin_t=40 + 20 * lines)
    _wrap_axis_titles(fig, int(size["height"]))
    bad = _bars_on_log(fig)
    if bad:
        raise FigureError(f"bars on a log axis do not compare fairly ({bad}): use a linear axis or points")
    _note_undrawn(fig)
    return fig if isinstance(fig, LabFigure) else LabFigure(fig)

"""One figure style for every figure: the ``"r3lab"`` plotly template, the paper sizes, one colour per replay mode."""

from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio

__all__ = ["MODE_COLORS", "mode_color", "ONE_COLUMN", "TWO_COLUMN", "TEMPLATE", "FLIP_COLOR"]

MODE_COLORS = {"none": "#7f7f7f", "R2": "#1f77b4", "R3": "#d62728"}  # one colour per replay mode, everywhere
ONE_COLUMN = {"width": 520, "height": 380}  # px at scale 1; a paper's single column
TWO_COLUMN = {"width": 1100, "height": 460}
FLIP_COLOR = "#ffb000"  # a (token, layer) cell where engine and trainer chose different expert sets
_template = go.layout.Template(pio.templates["plotly_white"])  # the paper template: plotly_white, our fonts
_template.layout.update(font={"family": "Helvetica, Arial, sans-serif", "size": 13},
                        margin={"l": 60, "r": 20, "t": 50, "b": 50}, legend={"orientation": "h", "y": -0.25})
pio.templates["r3lab"] = _template
TEMPLATE = "r3lab"


def mode_color(mode: str) -> str:
    """The replay mode's colour in every figure (:data:`MODE_COLORS`; green for a mode outside none/R2/R3)."""
    return MODE_COLORS.get(mode, "#2ca02c")

"""What the dashboard's and the dial's controls share: one width for labels and controls (three columns fit the
968 px output area JupyterLab gives with its file browser open), tooltips from the config's own help texts, and
errors shown in the status line instead of lost in a callback."""

from __future__ import annotations

import html
from collections.abc import Callable, Mapping
from typing import Any

import ipywidgets as widgets

from r3lab.config import RLConfig
from r3lab.errors import ConfigError, R3LabError

__all__ = ["LABEL_WIDTH", "CONTROL", "field_help", "show_errors"]

LABEL_WIDTH = "125px"  # every control: a label column this wide, the control 310 px in all
CONTROL = {"width": "310px"}


def field_help(name: str) -> str:
    """The RLConfig field's help text (the same words as ``r3lab rl --help``), for a control's tooltip."""
    return str(RLConfig.__dataclass_fields__[name].metadata.get("help", ""))


def show_errors(status: widgets.HTML, action: Callable[[], Any], labels: Mapping[str, str] | None = None) -> None:
    """Run a button's action; an r3lab error (bad config, a run in progress) goes to the status line in red.

    A config error names its fields by ``labels`` (field -> the control's label: what the user sees); a field
    without a control keeps its keyword (``mini_batches``)."""
    try:
        action()
    except R3LabError as e:
        said = e.phrase(lambda name: (labels or {}).get(name, name)) if isinstance(e, ConfigError) else str(e)
        status.value = f"<div class='r3lab-status'><b style='color:#d62728'>{html.escape(said)}</b></div>"

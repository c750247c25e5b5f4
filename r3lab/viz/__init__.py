"""Figures from results (never from engines): each function returns a ``plotly.graph_objects.Figure``.

Figures are for notebooks and papers; nothing here calls ``.show()``. They share one template
(``"r3lab"``: fonts, white background) and one fixed colour per replay mode (:data:`MODE_COLORS`), so
none / R2 / R3 look the same in every figure (engine and trainer have their own pair, :data:`SOURCE_COLORS`).
Every figure is a :class:`LabFigure`: displayed in a notebook it fills the output area's width; exported it
keeps its paper size. Labels and units of record keys come from :mod:`r3lab.labels`. :func:`export` writes a
figure as PNG, SVG and PDF through kaleido with the system's Chromium (:func:`find_chromium`; no browser is
downloaded).

Modules: ``style`` (template, sizes, colours, :func:`finish`), ``ticks`` (tick values and labels from the data's
range), ``exporting`` (files), and the figure builders ``results`` (tables and runs), ``routing`` (routes and
expert load), ``logprobs`` (log-prob drift per token), ``phase`` (the phase diagram and its staleness figure, from
``r3lab.runs.phase`` records), ``horizon`` (the long-horizon sweep), ``collapse`` (the collapse experiment's
survival curves and k3 at each collapse), ``paper`` (the paper figures from committed results) and ``available``
(every figure a run's fields allow, own or imported: :func:`run_figures`; :func:`in_place` and the ``*_or_note``
helpers hand a :class:`NotAvailable` note to the notebooks' cells where an imported run lacks a field).

Figures need plotly (the ``lab`` extra). Without it ``import r3lab.viz`` still works and lists the same names, and
using any of them raises :class:`~r3lab.errors.MissingExtraError` saying to install ``r3lab[lab]``.
"""

from typing import Any

from r3lab._extras import installed, require

__all__ = ["MODE_COLORS", "mode_color", "ONE_COLUMN", "TWO_COLUMN", "TEMPLATE", "FLIP_COLOR", "EXPORT_FORMATS",
           "find_chromium", "export", "transport_figure", "rl_curves_figure", "expert_load_figure", "drift_figure",
           "route_view_figure", "codec_figure", "expert_load_comparison_figure", "layer_disagreement_figure",
           "load_imbalance_figure", "load_shift_figure", "prob_density_figure", "extreme_fraction_figure",
           "delta_histogram_figure", "flip_split_figure", "layer_drift_figure", "response_differs",
           "most_flipped_sample", "export_figures", "paper_figures", "paper_figure_set",
           "SOURCE_COLORS", "NOT_DRAWN", "NOTEBOOK_CONFIG", "LabFigure", "finish", "axis_ticks", "tick_labels",
           "tick_values", "phase_figure", "staleness_figure", "OBJECTIVE_STYLES", "horizon_figure",
           "horizon_search_figure", "collapse_survival_figure", "collapse_k3_figure", "NotAvailable", "health_figure",
           "run_figures", "drawn", "expert_load", "in_place", "routes_or_note", "of_kind", "mismatch_logprobs",
           "noise_floors", "column_or_note", "rl_logprobs_or_note"]

if installed("plotly"):
    from r3lab.viz.available import (
        NotAvailable,
        column_or_note,
        drawn,
        expert_load,
        health_figure,
        in_place,
        mismatch_logprobs,
        noise_floors,
        of_kind,
        rl_logprobs_or_note,
        routes_or_note,
        run_figures,
    )
    from r3lab.viz.collapse import collapse_k3_figure, collapse_survival_figure
    from r3lab.viz.exporting import EXPORT_FORMATS, export, export_figures, find_chromium
    from r3lab.viz.horizon import horizon_figure, horizon_search_figure
    from r3lab.viz.logprobs import (
        delta_histogram_figure,
        extreme_fraction_figure,
        flip_split_figure,
        layer_drift_figure,
        prob_density_figure,
    )
    from r3lab.viz.paper import paper_figure_set, paper_figures
    from r3lab.viz.phase import OBJECTIVE_STYLES, phase_figure, staleness_figure
    from r3lab.viz.results import codec_figure, drift_figure, load_shift_figure, rl_curves_figure, transport_figure
    from r3lab.viz.routing import (
        expert_load_comparison_figure,
        expert_load_figure,
        layer_disagreement_figure,
        load_imbalance_figure,
        most_flipped_sample,
        response_differs,
        route_view_figure,
    )
    from r3lab.viz.style import (
        FLIP_COLOR,
        MODE_COLORS,
        NOT_DRAWN,
        NOTEBOOK_CONFIG,
        ONE_COLUMN,
        SOURCE_COLORS,
        TEMPLATE,
        TWO_COLUMN,
        LabFigure,
        finish,
        mode_color,
    )
    from r3lab.viz.ticks import axis_ticks, tick_labels, tick_values
else:  # no plotly (the lab extra): the names are listed, and each says what to install when it is used

    def __getattr__(name: str) -> Any:
        if name in __all__:
            require("plotly", for_=f"r3lab.viz.{name}")
        raise AttributeError(f"module 'r3lab.viz' has no attribute {name!r}")

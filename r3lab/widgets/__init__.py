"""Notebook widgets that read runs on disk: a live monitor and the RL ablation dashboard.

Both follow run folders (``r3lab.runs``) that another process writes, never an engine: the dashboard's Run
button starts ``python -m r3lab rl ...`` as a child process (:func:`start_rl`, a :class:`RLJob` handle) and
both widgets read its ``steps.jsonl`` files from a background thread (:class:`r3lab.runs.RunFollower`),
reading only the bytes appended since the last poll. The kernel stays free while a job runs; figures are
plain ``go.Figure`` objects, each shown whole in an ``Output`` widget as it changes (:class:`LiveFigure`;
``live``'s docstring says why not plotly's ``FigureWidget``), one colour per replay mode
(``r3lab.viz.MODE_COLORS``).

Modules: ``jobs`` (child-process RL jobs), ``live`` (the live figures the widgets draw), ``monitoring``
(:class:`RunMonitor`, :func:`monitor`), ``dashboard`` (:class:`AblationDashboard`) and ``dial``
(:class:`DialWidget`: one point of the phase diagram run and placed on it). The knobs and their
defaults are :class:`r3lab.config.RLConfig`'s (:meth:`~r3lab.config.RLConfig.quick` unless told otherwise).
"""



from r3lab._extras import importing

with importing("ipywidgets", for_="r3lab.widgets"), importing("plotly", for_="r3lab.widgets"):
    import ipywidgets  # noqa: F401  (the widgets' toolkit: the lab extra)
    import plotly  # noqa: F401

from r3lab.widgets.dashboard import AblationDashboard  # noqa: E402
from r3lab.widgets.dial import DialWidget, objective_config  # noqa: E402
from r3lab.widgets.jobs import RLJob, rl_config, start_rl  # noqa: E402
from r3lab.widgets.live import DEFAULT_METRICS, LAYER_METRIC, PLOTLY_MIME, LiveFigure  # noqa: E402
from r3lab.widgets.monitoring import RunMonitor, monitor  # noqa: E402

__all__ = ["DEFAULT_METRICS", "LAYER_METRIC", "PLOTLY_MIME", "LiveFigure", "RLJob", "start_rl",
           "rl_config", "RunMonitor", "monitor", "AblationDashboard", "DialWidget", "objective_config"]

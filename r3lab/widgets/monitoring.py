"""The live monitor: curves of runs that another process writes (a job, a terminal, another notebook)."""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from typing import Any

import ipywidgets as widgets

from r3lab.errors import ConfigError
from r3lab.labels import label
from r3lab.runs import RunFollower
from r3lab.widgets.jobs import RLJob
from r3lab.widgets.live import (
    DASHES,
    DEFAULT_METRICS,
    LAYER_METRIC,
    LiveFigure,
    set_steps,
    set_traces,
    status_html,
    value,
)


class RunMonitor(widgets.VBox):
    """Live curves of runs written by another process; see :class:`RunFollower` for ``source``/``prefix``/ends.

    One figure per metric (:attr:`figures`: ``go.Figure`` objects, shown by
    :class:`~r3lab.widgets.live.LiveFigure`), one trace per run coloured by its replay mode, redrawn as steps
    land. A folder that does not exist yet (a job just started in a terminal) is waited for up to
    ``folder_wait_s`` seconds. ``close()`` (or :meth:`stop`) ends the follower thread.
    """

    def __init__(self, source: str | os.PathLike, prefix: str = "", *, metrics: Sequence[str] = DEFAULT_METRICS,
                 layer: int | None = None, expect: int | None = None, job: RLJob | None = None,
                 interval: float = 0.5, stall_s: float = 300.0, settle_s: float = 60.0,
                 folder_wait_s: float = 120.0, start: bool = True):
        if not metrics:
            raise ConfigError("give at least one metric to monitor")
        self.follower = RunFollower(source, prefix, expect=expect, job=job, interval=interval, stall_s=stall_s,
                                    settle_s=settle_s, folder_wait_s=folder_wait_s, on_update=self._refresh)
        self.metrics, self.layer, self.job = list(metrics), layer, job
        self.views = {m: LiveFigure(f"{label(m)} (layer {layer})" if layer is not None and m == LAYER_METRIC
                                    else label(m), m) for m in self.metrics}
        self.figures = {m: v.figure for m, v in self.views.items()}
        self.status = widgets.HTML(status_html(self.follower))
        grid = widgets.GridBox([v.widget for v in self.views.values()],
                               layout=widgets.Layout(grid_template_columns="repeat(2, minmax(0, 1fr))"))
        super().__init__([self.status, grid])
        if start:
            self.follower.start()

    def _refresh(self, follower: RunFollower) -> None:
        snap = follower.snapshot()  # one snapshot: the figures and the status say the same
        total = max((r.total_steps for r in snap if r.total_steps is not None), default=None)
        for m, fig in self.figures.items():
            set_steps(fig, total)
            set_traces(fig, [(r.name, f"{r.mode} s{r.seed}", r.mode, DASHES[r.seed % len(DASHES)],
                              [s["step"] for s in r.records], [value(s, m, self.layer) for s in r.records])
                             for r in snap])
            self.views[m].draw()
        extra = ""
        if follower.state == "failed" and self.job is not None:
            extra = f"<pre class='r3lab-log'>{html.escape(self.job.tail())}</pre>"
        self.status.value = status_html(follower, extra, snap)

    @property
    def state(self) -> str:
        return self.follower.state

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the runs are done (True) or ``timeout`` passes (False); for scripts and CI."""
        return self.follower.wait(timeout)

    def stop(self) -> None:
        self.follower.stop()

    def close(self) -> None:
        follower = getattr(self, "follower", None)
        if follower is not None:
            follower.stop()
        super().close()


def monitor(source: str | os.PathLike | RLJob, prefix: str = "", **kwargs: Any) -> RunMonitor:
    """A :class:`RunMonitor` on a run folder, a folder of runs (with a name ``prefix``), or an :class:`RLJob`."""
    if isinstance(source, RLJob):
        return RunMonitor(source.runs_root, source.prefix, job=source, **kwargs)
    return RunMonitor(source, prefix, **kwargs)

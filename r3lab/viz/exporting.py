"""Figures to files: PNG, SVG and PDF through kaleido, driving the system's Chromium (no browser is downloaded)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

from r3lab.errors import R3LabError

__all__ = ["EXPORT_FORMATS", "find_chromium", "export", "export_figures"]

EXPORT_FORMATS = ("png", "svg", "pdf")
_CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_NO_CHROMIUM = ("figure export needs a Chromium binary and none was found: install Debian's package "
                "(`sudo apt-get install chromium`, which `bash scripts/test.sh` does by itself when run as root) "
                "or point BROWSER_PATH at a Chromium or Chrome executable")


def find_chromium() -> str:
    """The system Chromium kaleido should drive: ``$BROWSER_PATH`` if set, else the first on ``PATH``.

    Raises :class:`R3LabError` saying how to install one; r3lab never downloads a browser.
    """
    env = os.environ.get("BROWSER_PATH")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise R3LabError(f"BROWSER_PATH={env!r} is not an executable file; {_NO_CHROMIUM}")
        return env
    for name in _CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise R3LabError(_NO_CHROMIUM)


# kaleido 1.5 runs its renderer in a fresh Chromium page per call; on a loaded machine the call can reach the page
# before the page's script has defined ``kaleido_scopes`` (seen once in CI while two RL sweeps shared the 2 cores).
# That race, and only that one, is tried again in a fresh browser; every other error is raised at once.
_PAGE_RACE = "kaleido_scopes is not defined"
_PAGE_RACE_TRIES = 3


def _render(fig: go.Figure, fmt: str, scale: float, browser: str) -> bytes:
    """One image of ``fig`` from kaleido, its browser given as an argument (the process environment is untouched).

    The size falls back as ``plotly.io.write_image``'s does: the layout's, the template's, plotly's default. The
    page-load race above is tried again, up to ``_PAGE_RACE_TRIES`` browsers in all.
    """
    import kaleido
    from kaleido.errors import ChromeNotFoundError

    layout = fig.layout
    width = layout.width or layout.template.layout.width or pio.defaults.default_width
    height = layout.height or layout.template.layout.height or pio.defaults.default_height
    kopts: dict[str, Any] = {"path": browser}
    for key in ("plotlyjs", "mathjax", "headers"):  # what plotly passes on when set
        if getattr(pio.defaults, key, None):
            kopts[key] = getattr(pio.defaults, key)
    spec = fig.to_dict()
    for attempt in range(1, _PAGE_RACE_TRIES + 1):
        try:
            return kaleido.calc_fig_sync(spec, opts={"format": fmt, "width": width, "height": height, "scale": scale},
                                         topojson=pio.defaults.topojson, kopts=kopts)
        except ChromeNotFoundError as e:
            raise R3LabError(f"kaleido could not start the browser {browser!r}: {_NO_CHROMIUM}") from e
        except Exception as e:  # noqa: BLE001 (kaleido's JavascriptError is private: matched by its text)
            if _PAGE_RACE not in str(e):
                raise
            if attempt == _PAGE_RACE_TRIES:
                raise R3LabError(f"kaleido's page in {browser!r} never defined its renderer ({_PAGE_RACE!r}) in "
                                 f"{_PAGE_RACE_TRIES} fresh browsers: the machine may be too loaded") from e
    raise AssertionError("unreachable")


def export(fig: go.Figure, path: str | os.PathLike[str], *, formats: Sequence[str] = EXPORT_FORMATS,
           scale: float = 2.0) -> list[Path]:
    """Write ``fig`` as ``path`` with each suffix of ``formats`` (PNG, SVG and PDF by default); returns the files.

    ``path``'s own suffix, if any, is replaced. The figure's layout size is kept (the paper sizes
    :data:`ONE_COLUMN` / :data:`TWO_COLUMN`); ``scale`` only sharpens the PNG. The browser
    (:func:`find_chromium`) is handed to kaleido; the process environment is left as it was.
    """
    bad = [f for f in formats if f not in EXPORT_FORMATS]
    if bad or not formats:
        raise R3LabError(f"export formats must be among {EXPORT_FORMATS}, got {list(formats)}")
    browser = find_chromium()
    base = Path(path)
    base = base.with_suffix("") if base.suffix.lower().lstrip(".") in EXPORT_FORMATS else base
    base.parent.mkdir(parents=True, exist_ok=True)
    out = []
    for fmt in formats:
        target = base.with_name(f"{base.name}.{fmt}")
        target.write_bytes(_render(fig, fmt, scale if fmt == "png" else 1, browser))
        if not target.is_file() or target.stat().st_size == 0:
            raise R3LabError(f"kaleido wrote nothing to {target}")
        out.append(target)
    return out


def export_figures(figures: Mapping[str, go.Figure], out_dir: str | os.PathLike[str], **kwargs: Any) -> list[Path]:
    """:func:`export` each named figure as ``out_dir/<name>.{png,svg,pdf}``; returns every file written."""
    if not figures:
        raise R3LabError("no figures to export")
    return [p for name, fig in figures.items() for p in export(fig, Path(out_dir) / name, **kwargs)]

"""Figures to files: PNG, SVG and PDF through kaleido, driving the system's Chromium (no browser is downloaded)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

from r3lab._extras import importing
from r3lab.errors import FigureError

__all__ = ["EXPORT_FORMATS", "find_chromium", "export", "export_figures"]

EXPORT_FORMATS = ("png", "svg", "pdf")
_CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_NO_CHROMIUM = ("figure export needs a Chromium binary and none was found: install Debian's package "
                "(`sudo apt-get install chromium`, which `bash scripts/test.sh` does by itself when run as root) "
                "or point BROWSER_PATH at a Chromium or Chrome executable")


def find_chromium() -> str:
    """The system Chromium kaleido should drive: ``$BROWSER_PATH`` if set, else the first on ``PATH``.

    Raises :class:`~r3lab.errors.FigureError` saying how to install one; r3lab never downloads a browser.
    """
    env = os.environ.get("BROWSER_PATH")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise FigureError(f"BROWSER_PATH={env!r} is not an executable file; {_NO_CHROMIUM}")
        return env
    for name in _CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise FigureError(_NO_CHROMIUM)


# kaleido 1.5 starts a Chromium per ``calc_fig_sync`` call (~2 s here, most of an export's time), so every image of
# one :func:`export` or :func:`export_figures` call is rendered in one browser, one page per image, in a thread of
# its own (a notebook's running event loop is left alone). On a loaded machine a page can be reached before its
# script has defined ``kaleido_scopes`` (seen once in CI while two RL sweeps shared the 2 cores): that race, and
# only that one, is tried again in a fresh browser, from the image it hit; every other error is raised at once.
_PAGE_RACE = "kaleido_scopes is not defined"
_PAGE_RACE_TRIES = 3


def _image_opts(fig: go.Figure, fmt: str, scale: float) -> dict[str, Any]:
    """kaleido's options for one image; the size falls back as ``plotly.io.write_image``'s does: the layout's, the
    template's, plotly's default."""
    layout = fig.layout
    width = layout.width or layout.template.layout.width or pio.defaults.default_width
    height = layout.height or layout.template.layout.height or pio.defaults.default_height
    return {"format": fmt, "width": width, "height": height, "scale": scale}


def _in_one_browser(images: Sequence[tuple[dict[str, Any], dict[str, Any]]], browser: str) -> list[bytes]:
    """Each ``(figure dict, options)`` rendered by kaleido in one Chromium ``browser``, in order; what was rendered
    before an error is kept in the error (``rendered``) so a retry starts after it."""
    import asyncio
    import threading

    with importing("kaleido", for_="exporting figures as PNG, SVG and PDF"):
        import kaleido

    kopts: dict[str, Any] = {"path": browser}
    for key in ("plotlyjs", "mathjax", "headers"):  # what plotly passes on when set
        if getattr(pio.defaults, key, None):
            kopts[key] = getattr(pio.defaults, key)
    done: list[bytes] = []
    failure: list[BaseException] = []

    async def render() -> None:
        async with kaleido.Kaleido(**kopts) as k:
            for spec, opts in images:
                done.append(await k.calc_fig(spec, opts=opts, topojson=pio.defaults.topojson))

    def run() -> None:
        try:
            asyncio.run(render())
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            failure.append(e)

    thread = threading.Thread(target=run, name="r3lab-kaleido")
    thread.start()
    thread.join()
    if failure:
        failure[0].rendered = done  # type: ignore[attr-defined]
        raise failure[0]
    return done


def _render(images: Sequence[tuple[go.Figure, str, float]], browser: str) -> list[bytes]:
    """The bytes of each ``(figure, format, scale)``, from kaleido driving ``browser`` (the process environment is
    untouched); the page-load race above is tried again from where it hit, up to ``_PAGE_RACE_TRIES`` browsers."""
    from kaleido.errors import ChromeNotFoundError

    todo = [(fig.to_dict(), _image_opts(fig, fmt, scale)) for fig, fmt, scale in images]
    out: list[bytes] = []
    for attempt in range(1, _PAGE_RACE_TRIES + 1):
        try:
            return out + _in_one_browser(todo, browser)
        except ChromeNotFoundError as e:
            raise FigureError(f"kaleido could not start the browser {browser!r}: {_NO_CHROMIUM}") from e
        except Exception as e:  # noqa: BLE001 (kaleido's JavascriptError is private: matched by its text)
            if _PAGE_RACE not in str(e):
                raise
            if attempt == _PAGE_RACE_TRIES:
                raise FigureError(f"kaleido's page in {browser!r} never defined its renderer ({_PAGE_RACE!r}) in "
                                  f"{_PAGE_RACE_TRIES} fresh browsers: the machine may be too loaded") from e
            rendered = getattr(e, "rendered", [])
            out += rendered
            todo = todo[len(rendered):]
    raise AssertionError("unreachable")


def _targets(path: str | os.PathLike[str], formats: Sequence[str]) -> list[Path]:
    """``path`` with each suffix of ``formats`` (its own export suffix, if any, replaced); its folder is made."""
    bad = [f for f in formats if f not in EXPORT_FORMATS]
    if bad or not formats:
        raise FigureError(f"export formats must be among {EXPORT_FORMATS}, got {list(formats)}")
    base = Path(path)
    base = base.with_suffix("") if base.suffix.lower().lstrip(".") in EXPORT_FORMATS else base
    base.parent.mkdir(parents=True, exist_ok=True)
    return [base.with_name(f"{base.name}.{fmt}") for fmt in formats]


def _write(figures: Sequence[tuple[go.Figure, Path]], scale: float) -> list[Path]:
    """Render every ``(figure, target)`` in one browser and write each target (its suffix is its format)."""
    browser = find_chromium()
    fmts = [t.suffix.lstrip(".") for _, t in figures]
    images = _render([(fig, fmt, scale if fmt == "png" else 1) for (fig, _), fmt in zip(figures, fmts, strict=True)],
                     browser)
    for (_, target), data in zip(figures, images, strict=True):
        target.write_bytes(data)
        if not target.is_file() or target.stat().st_size == 0:
            raise FigureError(f"kaleido wrote nothing to {target}")
    return [t for _, t in figures]


def export(fig: go.Figure, path: str | os.PathLike[str], *, formats: Sequence[str] = EXPORT_FORMATS,
           scale: float = 2.0) -> list[Path]:
    """Write ``fig`` as ``path`` with each suffix of ``formats`` (PNG, SVG and PDF by default); returns the files.

    ``path``'s own suffix, if any, is replaced. The figure's layout size is kept (the paper sizes
    :data:`ONE_COLUMN` / :data:`TWO_COLUMN`); ``scale`` only sharpens the PNG. The browser
    (:func:`find_chromium`) is handed to kaleido; the process environment is left as it was.
    """
    return _write([(fig, t) for t in _targets(path, formats)], scale)


def export_figures(figures: Mapping[str, go.Figure], out_dir: str | os.PathLike[str], *,
                   formats: Sequence[str] = EXPORT_FORMATS, scale: float = 2.0) -> list[Path]:
    """:func:`export` each named figure as ``out_dir/<name>.{png,svg,pdf}``, all in one browser; returns every file
    written."""
    if not figures:
        raise FigureError("no figures to export")
    return _write([(fig, t) for name, fig in figures.items() for t in _targets(Path(out_dir) / name, formats)], scale)

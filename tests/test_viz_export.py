"""Exported figures (r3lab.viz.export, `r3lab figures`): valid PNG/SVG/PDF files of non-trivial size."""

import os
import shutil
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import plotly.graph_objects as go
import pytest

from r3lab.errors import R3LabError
from r3lab.viz import EXPORT_FORMATS, export, find_chromium, paper_figures

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# what the committed results hold: the transport table, the drift run (of three models), RL runs of three models and
# the phase diagram's runs (bench/results/phase/: the diagram and its staleness figure), the long-horizon runs and the
# collapse experiment's runs (bench/results/collapse/: its survival curves and k3 at each collapse)
PAPER_FIGURES = ("transport", "drift", "expert_load_qwen3", "expert_load_glm4", "expert_load_olmoe", "rl_k3_glm4",
                 "rl_k3_olmoe", "rl_k3_qwen3", "phase", "phase_staleness", "horizon", "horizon_search",
                 "collapse_survival", "collapse_k3")


def check_figure_file(path: Path, min_bytes: int = 4000) -> None:
    """The file is what its suffix says (parsed, not just named) and more than an empty canvas."""
    data = path.read_bytes()
    assert len(data) >= min_bytes, f"{path} is only {len(data)} bytes"
    kind = path.suffix.lstrip(".")
    if kind == "png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 400 and height >= 300, (path, width, height)
    elif kind == "svg":
        root = ET.fromstring(data)
        assert root.tag.endswith("svg"), (path, root.tag)
        assert len(list(root.iter())) > 20, f"{path} has almost no elements"
    elif kind == "pdf":
        assert data.startswith(b"%PDF-") and b"%%EOF" in data[-64:], path
    else:
        raise AssertionError(f"unexpected file {path}")


def test_chromium_is_there_or_the_error_says_how_to_install_it(monkeypatch):
    assert Path(find_chromium()).is_file(), "the setup (scripts/chromium.sh) installs Debian's chromium"
    monkeypatch.setenv("BROWSER_PATH", "/nonexistent/chromium")
    with pytest.raises(R3LabError, match="apt-get install chromium"):
        find_chromium()


def test_export_writes_the_three_formats_and_leaves_the_environment_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("BROWSER_PATH", raising=False)
    before = dict(os.environ)
    fig = go.Figure(go.Scatter(x=[0, 1, 2, 3], y=[1, 3, 2, 4], name="k3"), layout={"title": "a figure"})
    files = export(fig, tmp_path / "sub" / "curve.png")  # the suffix is replaced, folders are made
    assert [f.name for f in files] == [f"curve.{fmt}" for fmt in EXPORT_FORMATS]
    for f in files:
        check_figure_file(f, min_bytes=2000)
    assert dict(os.environ) == before  # the browser went to kaleido as an argument
    width, height = struct.unpack(">II", files[0].read_bytes()[16:24])
    assert (width, height) == (2 * 700, 2 * 500)  # no layout size: plotly's default, at the PNG's scale 2
    with pytest.raises(R3LabError, match="formats must be among"):
        export(fig, tmp_path / "x", formats=["jpeg"])


def test_kaleidos_page_race_is_tried_again_and_nothing_else_is(tmp_path, monkeypatch):
    """kaleido's page can be reached before its script defined ``kaleido_scopes`` on a loaded machine: that error
    is tried again in a fresh browser from the image it hit (the images before it are kept, none is rendered twice),
    and named after the last try; any other error is raised at once."""
    import kaleido

    from r3lab.viz import exporting

    real = kaleido.Kaleido.calc_fig
    calls: list[str] = []
    browsers: list[int] = []
    real_enter = kaleido.Kaleido.__aenter__

    async def counting_enter(self):
        browsers.append(1)
        return await real_enter(self)

    async def flaky(self, spec, opts=None, **kwargs):
        calls.append(opts["format"])
        if len(calls) == 2:  # the second image of the first browser
            raise RuntimeError("{'description': 'ReferenceError: kaleido_scopes is not defined'}")
        return await real(self, spec, opts=opts, **kwargs)

    fig = go.Figure(go.Scatter(x=[0, 1], y=[1, 2]))
    monkeypatch.setattr(kaleido.Kaleido, "__aenter__", counting_enter)
    monkeypatch.setattr(kaleido.Kaleido, "calc_fig", flaky)
    files = export(fig, tmp_path / "a")
    for f in files:
        check_figure_file(f, min_bytes=2000)
    assert calls == ["png", "svg", "svg", "pdf"] and len(browsers) == 2  # svg again, in a second browser

    async def always(self, *args, **kwargs):
        calls.append("x")
        raise RuntimeError("ReferenceError: kaleido_scopes is not defined")

    async def no_browser(self):  # the failing cases below render nothing: the tries are counted, no Chromium starts
        browsers.append(1)
        return self

    async def no_close(self, *exc):
        return None

    calls.clear()
    browsers.clear()
    monkeypatch.setattr(kaleido.Kaleido, "__aenter__", no_browser)
    monkeypatch.setattr(kaleido.Kaleido, "__aexit__", no_close)
    monkeypatch.setattr(kaleido.Kaleido, "calc_fig", always)
    with pytest.raises(R3LabError, match=r"never defined its renderer .* in 3 fresh browsers"):
        export(fig, tmp_path / "b", formats=["png"])
    assert len(calls) == len(browsers) == exporting._PAGE_RACE_TRIES  # one try in each fresh browser

    async def broken(self, *args, **kwargs):
        calls.append("x")
        raise RuntimeError("TypeError: fig.data is not iterable")

    calls.clear()
    browsers.clear()
    monkeypatch.setattr(kaleido.Kaleido, "calc_fig", broken)
    with pytest.raises(RuntimeError, match="not iterable"):
        export(fig, tmp_path / "c", formats=["png"])
    assert len(calls) == len(browsers) == 1


def test_export_figures_renders_every_figure_in_one_browser(tmp_path, monkeypatch):
    """One Chromium for all the images of an export_figures call (a browser start is most of an image's time)."""
    import kaleido

    from r3lab.viz import export_figures

    browsers: list[int] = []
    real_enter = kaleido.Kaleido.__aenter__

    async def counting_enter(self):
        browsers.append(1)
        return await real_enter(self)

    monkeypatch.setattr(kaleido.Kaleido, "__aenter__", counting_enter)
    figs = {f"f{i}": go.Figure(go.Bar(x=[0, 1, 2], y=[i, 2, 1])) for i in range(3)}
    files = export_figures(figs, tmp_path, formats=["svg", "png"])
    assert [f.name for f in files] == [f"f{i}.{fmt}" for i in range(3) for fmt in ("svg", "png")]
    for f in files:
        check_figure_file(f, min_bytes=2000)
    assert len(browsers) == 1


def test_r3lab_figures_regenerates_every_committed_figure(tmp_path, capsys):
    from r3lab.cli import main

    main(["figures", "--out", str(tmp_path)])
    written = sorted(p.name for p in tmp_path.iterdir())
    printed = capsys.readouterr().out
    names = set(PAPER_FIGURES)
    assert written == sorted(f"{n}.{fmt}" for n in names for fmt in EXPORT_FORMATS)  # every figure, nothing else
    assert sorted(printed.splitlines()) == sorted(f"wrote {tmp_path / name}" for name in written)
    for name in written:
        check_figure_file(tmp_path / name)
    committed = {p.name for p in (ROOT / "docs" / "figures").iterdir()}
    assert set(written) <= committed, f"docs/figures lacks {set(written) - committed}: run `r3lab figures`"


def test_r3lab_figures_names_a_missing_input(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results, ignore=shutil.ignore_patterns("drift-run"))
    with pytest.raises(R3LabError, match=r"drift-run is missing: `python bench/bench_drift.py`"):
        paper_figures(results, tmp_path / "out", formats=["svg"])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_paper_figures_are_read_from_the_results_not_named_in_the_code(tmp_path):
    import json

    from r3lab.viz import paper_figure_set

    assert list(paper_figure_set(RESULTS)) == list(PAPER_FIGURES)
    results = tmp_path / "results"
    left_out = shutil.ignore_patterns("tiny-qwen3-moe-*", "tiny-olmoe-*", "routes", "tokens")
    shutil.copytree(RESULTS, results, ignore=left_out)
    shutil.copytree(RESULTS / "drift-run" / "routes", results / "drift-run" / "routes")
    cfg = results / "drift-run" / "config.json"
    meta = json.loads(cfg.read_text())
    meta["config"]["models"] = ["tiny-glm4-moe"]
    cfg.write_text(json.dumps(meta))
    figures = paper_figure_set(results)
    assert list(figures) == ["transport", "drift", "expert_load_glm4", "rl_k3_glm4", "phase", "phase_staleness",
                             "horizon", "horizon_search", "collapse_survival", "collapse_k3"]  # one RL model left
    assert "bf16 trainer (5 seeds)" in figures["expert_load_glm4"].layout.title.text  # the run's first setting
    for run in (results / "rl").glob("tiny-glm4-moe-default-*"):  # only runs with changed knobs are left
        shutil.rmtree(run)
    with pytest.raises(R3LabError, match="no reference RL runs of tiny-glm4-moe with the default knobs"):
        paper_figure_set(results)


def test_the_phase_figures_come_from_the_phase_runs_and_a_broken_set_is_named(tmp_path):
    """Committed phase runs add the phase diagram and its staleness figure (built from those runs' records);
    a missing folder, a folder without staleness runs or with an unreadable run is an error naming the command that
    regenerates it."""
    import warnings

    from test_viz_phase import grid_runs

    from r3lab.runs import load_runs
    from r3lab.runs.phase import phase_records
    from r3lab.viz import paper_figure_set, phase_figure

    results = tmp_path / "results"
    shutil.copytree(RESULTS, results, ignore=shutil.ignore_patterns("phase", "tokens"))
    with pytest.raises(R3LabError, match=r"phase is missing: `python bench/bench_phase.py` regenerates it"):
        paper_figure_set(results)
    grid_runs(results / "phase")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figures = paper_figure_set(results)
    assert list(figures)[-6:] == ["phase", "phase_staleness", "horizon", "horizon_search", "collapse_survival",
                                  "collapse_k3"]
    want = phase_figure(phase_records(load_runs(results / "phase")))
    assert [(t.name, list(t.x), list(t.y)) for t in figures["phase"].data] == [
        (t.name, list(t.x), list(t.y)) for t in want.data]
    for run in (results / "phase").glob("q-stale*"):
        shutil.rmtree(run)
    with pytest.raises(R3LabError, match=r"no staleness runs .* `python bench/bench_phase.py`"):
        paper_figure_set(results)
    (results / "phase" / "broken").mkdir()
    (results / "phase" / "broken" / "config.json").write_text("{")
    with pytest.raises(R3LabError, match=r"unreadable phase-diagram runs \(`python bench/bench_phase.py`"):
        paper_figure_set(results)

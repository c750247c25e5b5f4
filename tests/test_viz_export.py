"""Exported figures (r3lab.viz.export, `r3lab figures`): valid PNG/SVG/PDF files of non-trivial size."""

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


def test_export_writes_the_three_formats(tmp_path):
    fig = go.Figure(go.Scatter(x=[0, 1, 2, 3], y=[1, 3, 2, 4], name="k3"), layout={"title": "a figure"})
    files = export(fig, tmp_path / "sub" / "curve.png")  # the suffix is replaced, folders are made
    assert [f.name for f in files] == [f"curve.{fmt}" for fmt in EXPORT_FORMATS]
    for f in files:
        check_figure_file(f, min_bytes=2000)
    with pytest.raises(R3LabError, match="formats must be among"):
        export(fig, tmp_path / "x", formats=["jpeg"])


def test_r3lab_figures_regenerates_every_committed_figure(tmp_path, capsys):
    from r3lab.cli import main

    main(["figures", "--out", str(tmp_path)])
    written = sorted(p.name for p in tmp_path.iterdir())
    printed = capsys.readouterr().out
    assert all(f"wrote {tmp_path / name}" in printed for name in written)
    names = {Path(n).stem for n in written}
    assert {"drift", "expert_load_glm4", "rl_k3_glm4", "rl_k3_qwen3", "transport"} <= names
    assert written == sorted(f"{n}.{fmt}" for n in names for fmt in EXPORT_FORMATS)
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

"""What the figures look like in a real browser: every notebook run in JupyterLab at its default layout.

Each notebook under notebooks/ (notebooks added later included) is parameterized with its CI parameters
(``metadata["r3lab"]["ci_parameters"]``, cells tagged ``live`` left out) and run with Run All in JupyterLab
served by ``tests/test_browser.py``'s fixture, in Chromium at 1400x1000 with the file browser open (output
area about 968 px wide). Then the DOM is checked, figure by figure:

* the figure fits its output area: no horizontal scroll, and no drawn text (titles, tick labels, colour-bar
  labels, legend) outside the figure's box, so nothing is clipped or hidden behind a scroll;
* no axis (colour bars included) shows two identical tick labels;
* no title (of the figure, an axis or a colour bar) overlaps another or the legend;
* every legend entry has a drawn trace, or says in its own text that it is not drawn.

A screenshot of every figure is saved under the test's temporary folder (``figures/<notebook>-<n>.png``).
"""

from __future__ import annotations

import json
from pathlib import Path

import make_dumps
import nbformat
import pytest
from test_browser import CHROMIUM_ARGS, _chromium, lab_server

from r3lab.viz import NOT_DRAWN

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
VIEWPORT = {"width": 1400, "height": 1000}


def _ci_notebook(path: Path, root: Path, tmp: Path) -> Path:
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(str(path))
    params = dict(nb.metadata["r3lab"]["ci_parameters"])
    params.update({"out_dir": str(tmp / "out"), "export": False})
    if path.stem == "06_your_run":  # the notebook opens an imported run: import a generated slime dump
        params["run"] = str(make_dumps.imported_run(tmp))
    source = next(c.source for c in nb.cells if c.cell_type == "code")
    if "\nruns_dir =" in "\n" + source:
        params["runs_dir"] = str(tmp / "runs")
    params = {k: v for k, v in params.items() if f"\n{k} =" in "\n" + source}
    nb.cells = [c for c in nb.cells if "live" not in c.metadata.get("tags", [])]
    nb = parameterize_notebook(nb, params)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    out = root / path.name
    nbformat.write(nb, out)
    return out


# Per figure: does it fit its output area, which tick labels repeat on an axis, which legend entries draw nothing
_CHECK = r"""(gd) => {
  const out = gd.closest('.jp-OutputArea-child') || gd.parentElement;  // the output row (prompt and output)
  const box = gd.getBoundingClientRect(), area = out.getBoundingClientRect();
  const res = {scroll: [gd.scrollWidth - gd.clientWidth, out.scrollWidth - out.clientWidth],
               box: [box.left, box.right], area: [area.left, area.right],
               outside: [], duplicates: [], undrawn: [], overlaps: []};
  for (const t of gd.querySelectorAll('.main-svg text, .infolayer text')) {
    if (!t.textContent.trim() || t.closest('.hoverlayer')) continue;
    const r = t.getBoundingClientRect();
    if (r.width === 0) continue;
    if (r.left < box.left - 1 || r.right > box.right + 1 || r.top < box.top - 1 || r.bottom > box.bottom + 1)
      res.outside.push(t.textContent);
  }
  const groups = {};  // the labels plotly.js drew on each axis (its computed ticks), then on each colour bar
  for (const k of Object.keys(gd._fullLayout).filter(k => /^[xy]axis\d*$/.test(k))) {
    const ax = gd._fullLayout[k];
    if (ax.visible !== false && ax.showticklabels !== false) groups[k] = (ax._vals || []).map(d => d.text);
  }
  gd.querySelectorAll('.colorbar').forEach((cb, i) => {
    groups['colorbar ' + i] = Array.from(cb.querySelectorAll('[class*="tick"] text')).map(t => t.textContent); });
  for (const [k, labels] of Object.entries(groups)) {
    const seen = new Set();
    for (const l of labels) {
      if (l !== undefined && l !== '' && seen.has(l)) res.duplicates.push([k, l]);
      seen.add(l);
    }
  }
  // titles (figure, subtitle, axes, colour bars) and the legend: no two may overlap
  const boxes = Array.from(gd.querySelectorAll('.infolayer text[class*="title"], .legend .bg'))
    .filter(e => e.tagName !== 'text' || e.textContent.trim())
    .map(e => [e.tagName === 'text' ? e.textContent : 'legend', e.getBoundingClientRect()]);
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
    const [a, ra] = boxes[i], [b, rb] = boxes[j];
    if (ra.left < rb.right - 1 && rb.left < ra.right - 1 && ra.top < rb.bottom - 1 && rb.top < ra.bottom - 1)
      res.overlaps.push([a, b]);
  }
  const axisType = (ref) => (gd._fullLayout[ref.charAt(0) + 'axis' + ref.slice(1)] || {}).type;
  for (const item of gd.querySelectorAll('.legend .traces')) {
    const name = (item.querySelector('.legendtext') || item).textContent;
    if (name.includes(NOT_DRAWN)) continue;
    // the traces of this entry (by name, as the legend lists them) and whether plotly.js has a point of theirs
    // it can place: finite, and positive on a log axis
    const traces = gd._fullData.filter(t => t.showlegend !== false && t.name === name);
    const drawn = traces.some(t => {
      const cd = gd.calcdata[t.index] || [], xlog = axisType(t.xaxis || 'x') === 'log',
            ylog = axisType(t.yaxis || 'y') === 'log';
      return t.visible === true && cd.some(p => {
        const x = t.type === 'bar' ? p.p : p.x, y = t.type === 'bar' ? p.s : p.y;
        return Number.isFinite(x) && Number.isFinite(y) && (!xlog || x > 0) && (!ylog || y > 0); }); });
    if (!drawn) res.undrawn.push(name + (traces.length ? '' : ' (no trace of that name)'));
  }
  return res;
}""".replace("NOT_DRAWN", json.dumps(NOT_DRAWN))


@pytest.fixture(params=NOTEBOOKS, ids=lambda p: p.stem)
def lab(request, tmp_path):
    root = tmp_path / "lab"
    root.mkdir()
    nb = _ci_notebook(request.param, root, tmp_path)
    with lab_server(tmp_path, root) as (base, token):
        yield base, token, nb.name, tmp_path


def test_every_figure_fits_reads_and_draws_what_its_legend_lists(lab):
    from playwright.sync_api import sync_playwright

    base, token, name, out = lab
    shots = out / "figures"
    shots.mkdir()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            try:
                problems = _run_and_check(page, base, token, name, shots)
            except Exception:
                page.screenshot(path=str(out / "failure.png"), full_page=True)
                print(f"failure screenshot: {out / 'failure.png'}")
                raise
        finally:
            browser.close()
    print(f"screenshots: {shots}")
    assert not problems, "\n".join(problems)


_BAD_FIGURES = [  # each cell draws one problem the checks must report (plain plotly figures, not r3lab's)
    ("import plotly.graph_objects as go", None),
    ('go.Figure(go.Scatter(x=[0, 1], y=[0, 1]), layout={"width": 1100})', "does not fit"),
    ('go.Figure(go.Scatter(x=[0, 1], y=[0.001, 0.009]), layout={"yaxis_tickformat": ".0%"})', "repeats tick labels"),
    ('go.Figure([go.Scatter(x=[1, 2], y=[0, 0], name="floor"), go.Scatter(x=[1, 2], y=[1, 2], name="seen")], '
     'layout={"yaxis_type": "log", "showlegend": True})', "nothing drawn"),
    ('go.Figure(go.Scatter(x=[0, 1], y=[0, 1]), layout={"title": "a title far too long for its figure " * 6})',
     "outside its box"),
    ('go.Figure(go.Scatter(x=[0, 1], y=[0, 1]), layout={"height": 220, "title": {"text": "a title", "x": 0}, '
     '"margin_t": 30, "yaxis_title": "a y axis title much taller than its short plot"})', "drawn over each other"),
]


def test_the_checks_catch_each_problem_they_look_for(tmp_path):
    """The checks can fail: a notebook of plain plotly figures, each with one of the problems, reports each."""
    from playwright.sync_api import sync_playwright

    root = tmp_path / "lab"
    root.mkdir()
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "r3lab", "display_name": "r3lab (Python 3.11)",
                                                            "language": "python"},
                                            "r3lab": {"ci_expect_figures": len(_BAD_FIGURES) - 1}})
    nb.cells = [nbformat.v4.new_code_cell(src) for src, _ in _BAD_FIGURES]
    nbformat.write(nb, root / "bad.ipynb")
    shots = tmp_path / "figures"
    shots.mkdir()
    with lab_server(tmp_path, root) as (base, token), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            problems = _run_and_check(browser.new_page(viewport=VIEWPORT), base, token, "bad.ipynb", shots)
        finally:
            browser.close()
    for i, (_, want) in enumerate(_BAD_FIGURES[1:]):
        found = [m for m in problems if m.startswith(f"bad.ipynb figure {i} ")]
        assert any(want in m for m in found), (i, want, found)


def _run_and_check(page, base: str, token: str, name: str, shots: Path) -> list[str]:
    page.goto(f"{base}/lab/tree/{name}?token={token}", timeout=60_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    page.wait_for_function("() => document.body.innerText.includes('r3lab (Python 3.11) | Idle')", timeout=90_000)
    assert page.locator(".jp-FileBrowser").first.is_visible(), "the default layout has the file browser open"
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    # done: the kernel is idle and every code cell has run, or a cell raised (Run All stops there)
    page.wait_for_function(r"""() => {
        const prompts = Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')).map(e => e.textContent);
        const failed = Array.from(document.querySelectorAll('.jp-OutputArea-output'))
            .some(o => o.textContent.includes('Traceback (most recent call last)'));
        return document.body.innerText.includes('| Idle') && (failed || prompts.every(t => /\[\d+\]/.test(t)));
    }""", timeout=900_000, polling=1000)
    failed = page.locator(".jp-OutputArea-output", has_text="Traceback (most recent call last)")
    assert failed.count() == 0, failed.first.inner_text()[-3000:]
    page.wait_for_timeout(1500)  # plotly's resize to the output width
    figures = page.locator(".jp-OutputArea-output.js-plotly-plot")  # JupyterLab's plotly output is the plot
    want = int(json.loads((shots.parent / "lab" / name).read_text())["metadata"]["r3lab"]["ci_expect_figures"])
    assert figures.count() >= want, f"{figures.count()} figures drawn, {want} expected"
    problems = []
    for i in range(figures.count()):
        fig = figures.nth(i)
        fig.scroll_into_view_if_needed()
        title = fig.locator(".gtitle").first.text_content() if fig.locator(".gtitle").count() else f"figure {i}"
        fig.screenshot(path=str(shots / f"{Path(name).stem}-{i:02d}.png"))
        r = fig.evaluate(_CHECK)
        where = f"{name} figure {i} ({title!r})"
        if max(r["scroll"]) > 1 or r["box"][1] > r["area"][1] + 1 or r["box"][0] < r["area"][0] - 1:
            problems.append(f"{where} does not fit its output area: {r}")
        if r["outside"]:
            problems.append(f"{where} draws text outside its box (clipped): {r['outside']}")
        if r["duplicates"]:
            problems.append(f"{where} repeats tick labels on an axis: {r['duplicates']}")
        if r["overlaps"]:
            problems.append(f"{where} has titles or legend drawn over each other: {r['overlaps']}")
        if r["undrawn"]:
            problems.append(f"{where} lists legend entries with nothing drawn and no note: {r['undrawn']}")
    return problems

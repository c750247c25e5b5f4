"""What the figures look like in a real browser: every executed notebook opened in JupyterLab at its default layout.

The notebooks run once, in ``tests/test_notebooks.py`` (papermill on the ``r3lab`` kernel with their CI parameters,
the ``live`` cells included, and the imported-run and attached-server variants). Each executed notebook is then
opened here (:class:`FigureLab`): JupyterLab served by ``tests/test_browser.py``'s fixture, in Chromium at 1400x1000
with the file browser open (output area about 968 px wide). JupyterLab draws a saved plotly output with the renderer
that draws it in a live run (jupyterlab-plotly's mime renderer, ``safe``, so an untrusted notebook draws it too), so
the figures are those a user sees after Run All. Running a notebook in JupyterLab itself (Run All in a fresh kernel,
the widgets, the dashboard's job) is what ``tests/test_browser.py`` tests.

Every plotly output the notebook holds must be drawn; then the DOM is checked, figure by figure:

* the figure fits its output area: no horizontal scroll, and no drawn text (titles, tick labels, colour-bar
  labels, legend) outside the figure's box, so nothing is clipped or hidden behind a scroll;
* no axis (colour bars included) shows two identical tick labels;
* no title (of the figure, an axis or a colour bar) overlaps another or the legend;
* every legend entry has a drawn trace, or says in its own text that it is not drawn.

A screenshot of every figure is saved under the lab's temporary folder (``figures/<notebook>-<n>.png``).
This file holds the checks and proves they can fail: a notebook of plain plotly figures, one problem each.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import nbformat
from test_browser import CHROMIUM_ARGS, _chromium, _shutdown_kernels, lab_server

from r3lab.viz import NOT_DRAWN

VIEWPORT = {"width": 1400, "height": 1000}
PLOTLY = "application/vnd.plotly.v1+json"


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


# how long a cell's outputs may trail its execute reply (nbclient's iopub_timeout) in every notebook the tests run:
# its 4 s default failed a cell in a fresh-clone run, the two cores busy with the other worker's file
IOPUB_TIMEOUT_S = 120


class FigureLab:
    """One JupyterLab server and one Chromium page, for any number of executed notebooks.

    ``check(executed)`` copies the notebook into the lab's root, opens it in a workspace of its own (no tab of an
    earlier notebook restored beside it), waits until every saved plotly output is drawn, and returns the problems
    its figures show (an empty list: none). Use it as a context manager: the browser and the server (with the
    kernels JupyterLab started for the notebooks it opened) end on the way out."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = Path(tmp)
        self.root = self.tmp / "lab"
        self.shots = self.tmp / "figures"
        self._opened = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> FigureLab:
        from playwright.sync_api import sync_playwright

        self.root.mkdir(parents=True, exist_ok=True)
        self.shots.mkdir(parents=True, exist_ok=True)
        try:
            self.base, self.token = self._stack.enter_context(lab_server(self.tmp, self.root))
            p = self._stack.enter_context(sync_playwright())
            browser = p.chromium.launch(executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS,
                                        timeout=60_000)
            self._stack.callback(browser.close)
            self.page = browser.new_page(viewport=VIEWPORT)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def check(self, executed: Path) -> list[str]:
        """The problems the figures of ``executed`` (a notebook with its outputs) show in the browser."""
        _shutdown_kernels(self.base, self.token)  # the kernels JupyterLab started for the notebooks opened before
        self._opened += 1
        name = f"{self._opened:02d}-{Path(executed).name}"
        shutil.copyfile(executed, self.root / name)
        want = sum(PLOTLY in o.get("data", {}) for c in nbformat.read(executed, as_version=4).cells
                   if c.cell_type == "code" for o in c.outputs)
        try:
            return _draw_and_check(self.page, self.base, self.token, name, f"nb{self._opened}", want, self.shots)
        except Exception:
            failure = self.shots / f"{Path(name).stem}-failure.png"
            self.page.screenshot(path=str(failure), full_page=True)
            print(f"failure screenshot: {failure}")
            raise
        finally:
            # a blank page until the next check: an open JupyterLab polls its server and redraws, 15% of a core
            # through the minute the next notebook takes to execute
            self.page.goto("about:blank")


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
    """The checks can fail: a notebook of plain plotly figures, each with one of the problems, executed the way
    tests/test_notebooks.py executes the notebooks, then opened in the browser, reports each."""
    import papermill

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "r3lab", "display_name": "r3lab (Python 3.12)",
                                                            "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(src) for src, _ in _BAD_FIGURES]
    nbformat.write(nb, tmp_path / "bad.in.ipynb")
    papermill.execute_notebook(str(tmp_path / "bad.in.ipynb"), str(tmp_path / "bad.ipynb"), kernel_name="r3lab",
                               cwd=str(tmp_path), execution_timeout=300, progress_bar=False,
                               iopub_timeout=IOPUB_TIMEOUT_S)
    with FigureLab(tmp_path / "browser") as lab:
        problems = lab.check(tmp_path / "bad.ipynb")
    for i, (_, want) in enumerate(_BAD_FIGURES[1:]):
        found = [m for m in problems if m.startswith(f"01-bad.ipynb figure {i} ")]
        assert any(want in m for m in found), (i, want, found)


def _draw_and_check(page, base: str, token: str, name: str, workspace: str, want: int, shots: Path) -> list[str]:
    page.goto(f"{base}/lab/workspaces/{workspace}/tree/{name}?token={token}", timeout=60_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    assert page.locator(".jp-FileBrowser").first.is_visible(), "the default layout has the file browser open"
    figures = page.locator(".jp-OutputArea-output.js-plotly-plot")  # JupyterLab's plotly output is the plot
    try:
        page.wait_for_function(f"() => document.querySelectorAll('.jp-OutputArea-output.js-plotly-plot').length "
                               f">= {want}", timeout=90_000, polling=500)
    except Exception as e:
        raise AssertionError(f"{name}: {figures.count()} of its {want} plotly outputs drawn") from e
    assert figures.count() == want, f"{name}: {figures.count()} figures drawn, the notebook holds {want}"
    page.wait_for_timeout(1500)  # plotly's resize to the output width
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

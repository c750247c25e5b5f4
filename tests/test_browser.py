"""The real-browser test: JupyterLab on loopback, the system Chromium driven by Playwright, notebook 04 run all.

A small copy of notebooks/04_rl_ablation.ipynb (its cells up to the dashboard; the live-job cells, tagged
``live``, are left out) is parameterized with papermill into a temporary root. The test runs every cell in
the browser and checks the DOM: a plotly figure rendered, the dashboard's widgets rendered, and clicking the
dashboard's Run makes its figure's data grow as the child job's steps land. A screenshot is saved under the
test's temporary folder. No browser is downloaded: a missing Chromium is a failure that says how to install it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

from r3lab._process import free_port

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "04_rl_ablation.ipynb"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
STEPS = 2  # of the dashboard's run: one mode, 2 steps of 2 prompts x 2 samples


def _chromium() -> str:
    for c in (os.environ.get("BROWSER_PATH"), "/usr/bin/chromium", shutil.which("chromium"),
              shutil.which("chromium-browser")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    pytest.fail("the browser test needs the system Chromium and none was found: install Debian's package "
                "(`apt-get install chromium`; `bash scripts/test.sh` does it through scripts/chromium.sh when run as "
                "root) or set BROWSER_PATH to a Chromium executable")


def _small_notebook(root: Path, runs: Path) -> Path:
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(str(NOTEBOOK))  # with the metadata papermill adds
    nb.cells = [c for c in nb.cells if "live" not in c.metadata.tags]
    nb = parameterize_notebook(nb, {"modes": ["R3"], "live_steps": STEPS, "live_prompts_per_step": 2,
                                    "live_samples_per_prompt": 2, "live_max_tokens": 8, "out_dir": str(runs)})
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    out = root / "04_small.ipynb"
    nbformat.write(nb, out)
    return out


@contextlib.contextmanager
def lab_server(tmp_path: Path, root: Path) -> Iterator[tuple[str, str]]:
    """JupyterLab on a free loopback port with a token, serving ``root``; yields (base URL, token), then stops
    the server with its kernels. Every cell is in the DOM (no windowing) and there is no news pop-up."""
    port, token = free_port(), secrets.token_urlsafe(24)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    log = open(tmp_path / "jupyter.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    settings = tmp_path / "settings"  # every cell in the DOM (no windowing), no news pop-up
    for ext, name, value in (("notebook-extension", "tracker", {"windowingMode": "none"}),
                             ("apputils-extension", "notification", {"fetchNews": "false"})):
        (settings / f"@jupyterlab/{ext}").mkdir(parents=True, exist_ok=True)
        (settings / f"@jupyterlab/{ext}" / f"{name}.jupyterlab-settings").write_text(json.dumps(value))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not start: {(tmp_path / 'jupyter.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield base, token
    finally:
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):  # the server, its kernels and their jobs
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a temporary root that holds the small notebook 04."""
    root = tmp_path / "lab"
    root.mkdir()
    nb = _small_notebook(root, tmp_path / "runs")
    with lab_server(tmp_path, root) as (base, token):
        yield base, token, nb.name, tmp_path


_POINTS = """() => Array.from(document.querySelectorAll('.r3lab-dashboard .js-plotly-plot'))
                  .map(gd => (gd.data || []).reduce((n, t) => n + (t.y || []).filter(v => v !== null).length, 0))"""


def test_notebook_04_runs_in_jupyterlab_and_its_dashboard_runs(lab):
    from playwright.sync_api import sync_playwright

    base, token, name, out = lab
    chromium = _chromium()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})  # the default layout a user sees
            try:
                _run_and_check(page, base, token, name, out)
            except Exception:
                page.screenshot(path=str(out / "failure.png"), full_page=True)
                print(f"failure screenshot: {out / 'failure.png'}")
                print(page.locator(".jp-Notebook").inner_text()[-4000:])
                raise
        finally:
            browser.close()
    runs = sorted((out / "runs").glob("dash-*-R3-s0"))
    assert len(runs) == 1 and (runs[0] / "summary.json").is_file()


_RANGES = """() => Array.from(document.querySelectorAll('.r3lab-dashboard .js-plotly-plot')).map(gd => [
    gd._fullLayout.xaxis.range, gd._fullLayout.yaxis.range, gd.data.flatMap(t => t.y.filter(v => v !== null)),
    gd._fullLayout.yaxis.type == 'log'])"""


def _run_and_check(page, base: str, token: str, name: str, out: Path) -> None:
    page.goto(f"{base}/lab/tree/{name}?token={token}", timeout=60_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    page.wait_for_function("() => document.body.innerText.includes('r3lab (Python 3.11) | Idle')", timeout=90_000)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    # a plotly figure of the committed runs, drawn by plotly.js: its SVG has the traces
    page.wait_for_selector(".jp-OutputArea .js-plotly-plot .scatterlayer .trace", timeout=120_000)
    # the dashboard's widgets
    dash = page.locator(".r3lab-dashboard")
    dash.wait_for(timeout=120_000)
    dash.scroll_into_view_if_needed()
    for sel in (".widget-dropdown", ".widget-select-multiple", ".widget-hslider", ".widget-button",
                ".widget-hprogress", ".widget-html"):
        assert dash.locator(sel).count() >= 1, f"the dashboard has no {sel}"
    page.wait_for_function(f"() => ({_POINTS})().length == 2", timeout=60_000)
    assert page.evaluate(_POINTS) == [0, 0]  # empty before Run
    dash.locator("button", has_text="Run").first.click()
    # the child job starts vLLM and the trainer; each landed step adds a point (a y value) to both figures
    page.wait_for_function(f"() => ({_POINTS})().every(n => n >= {STEPS})", timeout=300_000)
    page.wait_for_function("() => document.querySelector('.r3lab-dashboard .r3lab-status')"
                           ".textContent.includes('finished')", timeout=120_000)
    assert page.evaluate(_POINTS) == [STEPS, STEPS]
    # what the page shows holds every point: x spans the steps, y (autoranged by plotly.js) every value
    for xr, yr, ys, log in page.evaluate(_RANGES):
        ys = [math.log10(v) for v in ys] if log else ys
        assert xr[0] < 0 and xr[1] > STEPS - 1 and yr[0] <= min(ys) <= max(ys) <= yr[1], (xr, yr, ys)
    shot = out / "dashboard.png"
    dash.scroll_into_view_if_needed()
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000

"""Every notebook under notebooks/ is committed clean and runs top to bottom with its CI parameters.

Clean: no outputs or execution counts, the r3lab kernelspec, exactly one cell tagged ``parameters`` and it is
the first code cell, CI parameters in ``metadata["r3lab"]``. Run: papermill on the ``r3lab`` kernel with those
parameters (plus ``out_dir`` / ``runs_dir`` in a temporary folder; 03 opens the runs 02 made where their experiments
are equal: ``RUNS_FROM``); the executed notebook must hold no error
and at least ``ci_expect_figures`` plotly figures, and any figure it exported must be a real PNG/SVG/PDF. Every
executed notebook (the variants on an imported run and on an attached server too) is then opened in JupyterLab in
Chromium, and its figures must pass tests/test_browser_figures.py's checks: one execution serves both, where the
browser test used to run every notebook a second time.
"""

from __future__ import annotations

import os
from pathlib import Path

import make_dumps
import nbformat
import pytest
from test_browser_figures import IOPUB_TIMEOUT_S

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PLOTLY = "application/vnd.plotly.v1+json"
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-", "svg": b"<svg"}


def _ids(p: Path) -> str:
    return p.stem


def _generator() -> dict:
    import runpy

    return runpy.run_path(str(ROOT / "scripts" / "make_notebooks.py"))


def test_every_notebook_comes_from_the_generator():
    """One way of authoring: each committed notebook is one of scripts/make_notebooks.py's, and each of those is
    committed (a notebook added by hand, or one the generator lost, fails here)."""
    generated = sorted(_generator()["NOTEBOOKS"])
    assert [p.stem for p in NOTEBOOKS] == generated
    assert generated, "the generator defines no notebooks"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_is_committed_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "r3lab", nb.metadata.get("kernelspec")
    assert nb.metadata["kernelspec"].get("display_name") and nb.metadata["kernelspec"].get("language") == "python"
    code = [c for c in nb.cells if c.cell_type == "code"]
    dirty = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None]
    assert not dirty, f"code cells {dirty} hold outputs or execution counts: clear them before committing"
    tagged = [i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", [])]
    assert tagged == [0], f"exactly one 'parameters' cell, the first code cell; tagged: {tagged}"
    assert "def " not in "".join(c.source for c in code), "notebooks hold no logic: define functions in r3lab"
    meta = nb.metadata.get("r3lab", {})
    assert isinstance(meta.get("ci_parameters"), dict) and int(meta.get("ci_expect_figures", 0)) >= 1, meta
    params = code[0].source
    for name in [*meta["ci_parameters"], "out_dir"]:
        assert f"\n{name} =" in "\n" + params, f"CI parameter {name!r} is not set in the parameters cell"


def _check_exported(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.rglob("*") if p.suffix.lstrip(".") in MAGIC)
    for p in files:
        head = p.read_bytes()[:4096]
        want = MAGIC[p.suffix.lstrip(".")]
        assert (want in head) if p.suffix == ".svg" else head.startswith(want), f"{p.name} is not a {p.suffix} file"
        assert p.stat().st_size > 2000, f"{p.name} is only {p.stat().st_size} bytes"
    return files


@pytest.fixture(scope="module")
def figure_lab(tmp_path_factory):
    """One JupyterLab and one Chromium for the module: each executed notebook's figures are checked in it."""
    from test_browser_figures import FigureLab

    with FigureLab(tmp_path_factory.mktemp("figure-lab")) as lab:
        yield lab


def _executed(source: Path | str, tmp_path: Path, params: dict, lab) -> list:
    """Run notebook ``source`` (a path, or the stem of one under notebooks/) with ``params`` (and an ``out_dir``
    under ``tmp_path`` unless given) in the ``r3lab`` kernel; assert it holds no error and that its figures pass the
    browser's checks in ``lab``; return its outputs."""
    import papermill  # the lab extra; a missing one fails here, loudly

    source = Path(source) if Path(source).suffix else ROOT / "notebooks" / f"{source}.ipynb"
    executed = tmp_path / f"{source.stem.removesuffix('.in')}.{len(list(tmp_path.glob('*.ipynb')))}.ipynb"
    papermill.execute_notebook(str(source), str(executed), parameters={"out_dir": str(tmp_path / "out"), **params},
                               kernel_name="r3lab", cwd=str(tmp_path), execution_timeout=600, progress_bar=False,
                               iopub_timeout=IOPUB_TIMEOUT_S)
    outputs = [o for c in nbformat.read(executed, as_version=4).cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, (source.stem, errors[0].get("evalue"))
    problems = lab.check(executed)
    assert not problems, "\n".join(problems)
    return outputs


def _figures(outputs: list) -> list:
    figures = [o for o in outputs if PLOTLY in o.get("data", {})]
    assert all(f["data"][PLOTLY]["data"] for f in figures), "a figure without traces"
    return figures


@pytest.fixture(autouse=True)
def _kernel_imports_this_checkout(monkeypatch):
    """The kernel inherits this environment: make it import the r3lab of this checkout."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


# Notebooks 02 and 03 run the same experiments with their CI parameters (one drift run, RL runs in each mode): 03 then
# opens the runs 02 made, given as drift_run and rl_runs, as a user opens earlier runs, instead of computing them a
# second time. Only when _experiments() finds the two equal: the cells that start them, and the value of every name
# those cells read.
RUNS_FROM = {"03_logprob_drift": "02_expert_distribution"}
GIVEN = {"drift_run", "rl_runs", "runs_dir"}  # the folders a test passes; not part of what an experiment is
_RUNS_MADE: dict[str, Path] = {}  # notebook stem -> the runs folder its test run made


def _experiments(path: Path) -> tuple[list[str], dict]:
    """The cells of notebook ``path`` that run experiments (``load_or_run``), and the CI value of every name they
    read (its parameters cell, then the CI parameters)."""
    import ast

    nb = nbformat.read(path, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    values = {t.id: ast.literal_eval(n.value) for n in ast.parse(code[0]).body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)}
    values.update(nb.metadata["r3lab"]["ci_parameters"])
    cells = [src for src in code[1:] if "load_or_run(" in src]
    names = {n.id for src in cells for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}
    return cells, {k: values[k] for k in sorted(names & set(values) - GIVEN)}


def test_notebook_03_opens_the_runs_02_made_only_where_they_are_its_own():
    """What lets 03 open 02's runs: the same experiment cells, reading the same values (see RUNS_FROM)."""
    for nb, source in RUNS_FROM.items():
        cells, values = _experiments(ROOT / "notebooks" / f"{nb}.ipynb")
        assert len(cells) == 2 and {"model", "prompts", "max_tokens", "seed", "rl_steps", "modes"} <= set(values)
        assert (cells, values) == _experiments(ROOT / "notebooks" / f"{source}.ipynb"), (nb, source)


@pytest.mark.engine  # executes the notebook in a kernel (the dial notebook runs RL on an engine)
@pytest.mark.browser  # and checks its figures in JupyterLab
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_runs_top_to_bottom_and_draws_its_figures(path, tmp_path, figure_lab):
    """As shipped (06: its default run, the committed reference drift run), with the CI parameters; 03 on the runs
    02 made, where RUNS_FROM allows (02 ran first in this module and their experiments are equal)."""
    from r3lab.runs import list_runs
    from r3lab.vocabulary import RunKind

    nb = nbformat.read(path, as_version=4)
    meta = nb.metadata["r3lab"]
    out_dir = tmp_path / "out"
    params = {**meta["ci_parameters"], "out_dir": str(out_dir)}
    runs_dir = tmp_path / "runs"
    if "\nruns_dir =" in "\n" + nb.cells[[c.cell_type for c in nb.cells].index("code")].source:
        params["runs_dir"] = str(runs_dir)
    source = RUNS_FROM.get(path.stem)
    opened = source in _RUNS_MADE and _experiments(path) == _experiments(ROOT / "notebooks" / f"{source}.ipynb")
    if opened:
        made = list_runs(_RUNS_MADE[source])
        (params["drift_run"],) = [str(folder) for folder, run in made if run.kind == RunKind.DRIFT]
        modes = _experiments(path)[1]["modes"]  # in the order 02's comparison ran them: seeds, then modes
        rl = sorted((run for _, run in made if run.kind == RunKind.RL),
                    key=lambda r: (r.config["seed"], modes.index(r.config["mode"])))
        params["rl_runs"] = [str(r.path) for r in rl]
    figures = _figures(_executed(path, tmp_path, params, figure_lab))
    assert len(figures) >= int(meta["ci_expect_figures"]), f"{len(figures)} plotly figures"
    if params.get("export"):
        assert _check_exported(out_dir), f"export=True wrote no figure files under {out_dir}"
    if opened:
        assert not runs_dir.exists() or not list(runs_dir.iterdir()), f"{path.stem} ran an experiment of its own"
    elif "runs_dir" in params and runs_dir.is_dir():
        _RUNS_MADE[path.stem] = runs_dir


@pytest.mark.browser  # checks its figures in JupyterLab
def test_notebook_06_opens_an_imported_run(tmp_path, figure_lab):
    """Notebook 06 pointed at an imported run (a generated slime dump): no error, and its figures."""
    params = {"run": str(make_dumps.imported_run(tmp_path))}
    outputs = _executed("06_your_run", tmp_path, params, figure_lab)
    assert len(_figures(outputs)) >= 7, len(_figures(outputs))
    assert any(params["run"] in str(o.get("data", {}).get("text/plain", "")) for o in outputs), "not the given run"


# Notebooks 02-04 on an imported run (the generated slime dump: engine routes and log-probs, no trainer routes, no
# replay mode): (plotly figures, in-place notes) each must show. The figures are those the fields allow (the
# engine's expert load and imbalance; the drift densities, F(tau), delta histogram); the notes stand for the ones
# needing trainer routes, a drift run's cells or a replay mode.
IMPORTED_EXPECT = {"02_expert_distribution": (2, 4), "03_logprob_drift": (3, 8), "04_rl_ablation": (0, 5)}


@pytest.mark.engine  # executes the notebook in a kernel (the dial notebook runs RL on an engine)
@pytest.mark.browser  # and checks its figures in JupyterLab
@pytest.mark.parametrize("name", sorted(IMPORTED_EXPECT))
def test_notebook_takes_an_imported_run(name, tmp_path, figure_lab):
    """Where notebooks 02-04 take a run folder they take an imported run: no error, and in place of each figure
    whose fields the run lacks a note saying which (04: its finished-runs part; the live job cells are dropped)."""
    run = make_dumps.imported_run(tmp_path / "fixture")
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    if name == "04_rl_ablation":
        nb.cells = [c for c in nb.cells if "live" not in c.metadata.get("tags", [])]
        params = {"reference_runs": str(run.parent), "reference_prefix": run.name}
    else:
        params = {"drift_run": str(run), "rl_runs": [str(run)], "runs_dir": str(tmp_path / "runs")}
    source = tmp_path / f"{name}.in.ipynb"
    nbformat.write(nb, source)
    outputs = _executed(source, tmp_path, params, figure_lab)
    figures = _figures(outputs)
    notes = [o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert all(n.startswith("*") and "need" in n for n in notes), notes
    assert (len(figures), len(notes)) == IMPORTED_EXPECT[name], (len(figures), notes)
    assert not list(tmp_path.joinpath("runs").glob("*")), "the notebook ran an experiment instead of the given run"


@pytest.mark.engine  # a vLLM server started the way a user starts it, and notebooks executed in a kernel
@pytest.mark.browser  # their figures checked in JupyterLab
def test_notebooks_on_an_attached_server_and_a_capture_run(tmp_path, figure_lab):
    """Notebook 01 with ``engine_url`` samples through a server the user started (tests/user_vllm.py; its access log
    shows the requests); ``r3lab capture`` through that server writes a run that notebooks 01 (``capture_run``), 02
    (``drift_run``) and 06 (``run``) open: expert load, imbalance and the route view drawn, the rest noted."""
    from user_vllm import QWEN, UserServers

    from r3lab.cli import main
    from r3lab.corpus import corpus_prompts

    servers = UserServers(tmp_path)
    run = tmp_path / "runs" / "cap"
    # notebook 01's CI sizes (its synthetic transport workload among them), without the export the main test checks
    ci01 = nbformat.read(ROOT / "notebooks" / "01_capture_and_transport.ipynb", as_version=4).metadata["r3lab"]
    small = {k: v for k, v in ci01["ci_parameters"].items() if k != "export"}
    try:
        url = servers.get(QWEN)
        out01 = _executed("01_capture_and_transport", tmp_path, {**small, "engine_url": url}, figure_lab)
        assert len(_figures(out01)) == 2
        log = next(tmp_path.glob("tiny-qwen3-moe-*.log")).read_text(errors="replace")
        assert log.count("POST /v1/completions") >= 2, "notebook 01 did not sample through the attached server"
        (tmp_path / "prompts.txt").write_text("\n".join(corpus_prompts(4, seed=0)) + "\n")
        main(["capture", "--engine-url", url, "--prompts", str(tmp_path / "prompts.txt"), "--out", str(run),
              "--tokens", "12", "--samples", "2", "--no-progress"])
    finally:
        servers.stop()
    out01 = _executed("01_capture_and_transport", tmp_path, {**small, "capture_run": str(run)}, figure_lab)
    assert len(_figures(out01)) == 2
    out02 = _executed("02_expert_distribution", tmp_path, {"drift_run": str(run), "rl_runs": [str(run)],
                                                           "runs_dir": str(tmp_path / "made")}, figure_lab)
    notes = [o.data["text/markdown"] for o in out02 if "text/markdown" in o.get("data", {})]
    assert (len(_figures(out02)), len(notes)) == (2, 4), notes  # expert load and imbalance of the engine
    assert not (tmp_path / "made").exists() or not list((tmp_path / "made").iterdir()), "02 ran an experiment"
    out06 = _executed("06_your_run", tmp_path, {"run": str(run)}, figure_lab)
    titles = [f["data"][PLOTLY]["layout"].get("title", {}).get("text", "") for f in _figures(out06)]
    assert len(titles) >= 3 and any("expert load" in t for t in titles), titles


def test_imported_run_helpers_note_what_is_missing_and_pass_r3lab_runs_through(tmp_path):
    """The notebooks' helpers: a missing field of an imported run becomes a note that in_place passes on (also as
    a mapping's value); r3lab's own runs pass through of_kind unchanged; the token log-probs are the table's own."""
    import numpy as np

    from r3lab import viz
    from r3lab.runs import load, load_runs, reference_runs_dir

    run = load(make_dumps.imported_run(tmp_path))
    trainer = viz.routes_or_note(run, 0, "trainer")
    assert isinstance(trainer, viz.NotAvailable) and "trainer routes" in trainer.message
    engine = viz.routes_or_note(run, 0, "engine")
    assert engine.total_tokens == run.routes(0, "engine").total_tokens
    assert viz.in_place(dict, a=1, b={"t": trainer}) is trainer
    assert viz.in_place(dict, a=1) == {"a": 1}
    assert list(viz.drawn({"engine": engine, "trainer": trainer})) == ["engine"]
    tok = run.tokens([0])
    infer, modes = viz.mismatch_logprobs(tok)
    assert list(modes) == ["trainer"] and np.array_equal(modes["trainer"], tok["logp_train"].to_numpy())
    assert np.array_equal(infer, tok["logp_infer"].to_numpy()) and viz.noise_floors(tok) == {}
    assert isinstance(viz.of_kind([run], "rl"), viz.NotAvailable)
    own = load_runs(reference_runs_dir(), "tiny-qwen3-moe-default-")
    assert viz.of_kind(own, "rl") is own


def test_generated_notebooks_match_their_generator():
    """Every notebook is scripts/make_notebooks.py's output: edit the generator, then rerun it."""
    gen = _generator()
    for name, (cells, ci, n) in gen["NOTEBOOKS"].items():
        want = nbformat.writes(gen["build"](cells, ci, n))
        have = (ROOT / "notebooks" / f"{name}.ipynb").read_text()
        assert have.strip() == want.strip(), f"notebooks/{name}.ipynb differs from scripts/make_notebooks.py"


# the calls that start an engine or trainer ranks from a notebook: each must receive the cluster parameters
CLUSTER_CALLS = {"RLConfig.quick", "DriftConfig", "widgets.AblationDashboard", "widgets.start_rl"}
CLUSTER_KNOBS = {"cluster", "engine_resources", "trainer_resources"}


def test_notebooks_that_run_experiments_pass_the_cluster_on():
    """Notebooks 02, 03 and 04 run drift and RL themselves: their parameters name the Ray cluster (and the actors'
    resources), and every call that starts an engine or trainer ranks gets all three, so a notebook pointed at a
    cluster never runs part of its work on this machine instead."""
    import ast

    seen = {}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c.source for c in nb.cells if c.cell_type == "code"]
        params = {t.id for n in ast.walk(ast.parse(code[0])) if isinstance(n, ast.Assign) for t in n.targets
                  if isinstance(t, ast.Name)}
        calls = [n for src in code[1:] for n in ast.walk(ast.parse(src))
                 if isinstance(n, ast.Call) and ast.unparse(n.func) in CLUSTER_CALLS]
        if not calls:
            continue
        seen[path.stem] = len(calls)
        assert CLUSTER_KNOBS <= params, f"{path.stem}: parameters lack {sorted(CLUSTER_KNOBS - params)}"
        for call in calls:
            given = {k.arg: ast.unparse(k.value) for k in call.keywords}
            assert all(given.get(k) == k for k in CLUSTER_KNOBS), f"{path.stem}: {ast.unparse(call)[:80]}"
    assert set(seen) == {"02_expert_distribution", "03_logprob_drift", "04_rl_ablation"}, seen

"""Shared test fixtures and the suite's tiers; the random-routes generator lives in r3lab.testing (re-exported here
for the tests).

Tiers (markers registered in pyproject.toml, ``--strict-markers``): ``engine`` (starts a vLLM engine), ``megatron``
(spawns Megatron-core / gloo ranks), ``browser`` (Chromium and JupyterLab), ``network`` (pip and the package index),
``compat`` (builds the far end of each supported range and tests there), and ``slow``, the union of the five. They
are applied here by file (:data:`TIERS`), so a new test in one of those files is tiered without anyone remembering;
a test elsewhere that needs one marks itself (``@pytest.mark.engine``) and gets ``slow`` too. ``bash scripts/test.sh``
runs everything; ``bash scripts/test.sh -m "not slow"`` is the fast tier.

Engines: a test that needs vLLM on a shipped model takes the session's ``engine_pool`` fixture (one engine per model
and options for the whole run, handed out in a fresh start's state and byte-checked; :mod:`r3lab.testing.engines`)
instead of starting its own; the count printed at the end says which files still start engines.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

from r3lab.testing import random_routes

__all__ = ["random_routes", "rng"]

SLOW_TIERS = ("engine", "megatron", "browser", "network", "compat")

# file -> the slow tiers its tests belong to (every test of the file; the fast tier is what is left)
TIERS: dict[str, tuple[str, ...]] = {
    "test_async.py": ("engine",),
    "test_experiments.py": ("engine",),
    "test_multiturn.py": ("engine",),
    "test_quant.py": ("engine",),
    "test_rl.py": ("engine",),
    "test_rollout.py": ("engine",),
    "test_r3w_engine.py": ("engine",),
    "test_collapse_bench.py": ("engine",),  # the collapse benchmark's --quick run
    "test_init_from.py": ("engine",),  # RL runs saved and resumed
    "test_attach.py": ("engine",),  # starts vLLM servers the way a user would
    "test_packaging.py": ("engine",),  # builds a wheel, installs it in a venv, runs the quick drift from it
    "test_rescore.py": ("engine", "megatron"),
    "test_cluster.py": ("engine", "megatron"),  # a two-node Ray cluster: the engine actor and Megatron rank actors
    "test_megatron_sync.py": ("engine", "megatron"),
    "test_trainer_megatron.py": ("engine", "megatron"),
    "test_megatron_load.py": ("megatron",),
    "test_megatron_bridge_loader.py": ("megatron",),  # Megatron-Bridge's ranks (Python 3.12; skipped elsewhere)
    "test_mtp.py": ("megatron",),
    "test_olmoe.py": ("engine", "megatron"),
    "test_slicing.py": ("megatron",),
    "test_staging_dist.py": ("megatron",),
    "test_trainer_megatron_bridge.py": ("megatron",),
    "test_browser.py": ("browser",),
    "test_browser_figures.py": ("browser",),
    "test_gpu_recipe.py": ("network",),
    "test_install.py": ("network",),  # the built wheel installed from the index into fresh venvs (with, without torch)
    "test_compat.py": ("compat",),  # builds the far end of each supported range (Python 3.11) and tests there
}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _no_stdlib_distutils_left_behind():
    """A test that imports pip's internals (tests/test_gpu_recipe.py, in a test or a module fixture) can leave the
    standard library's ``distutils`` in ``sys.modules``; setuptools' ``_distutils_hack`` then asserts on the next
    import of setuptools (every Megatron import after it failed). After each test, drop the standard library's
    ``distutils`` (setuptools' own copy, ``setuptools/_distutils``, stays), so the next import is as in a fresh
    process."""
    import sys

    yield
    core = sys.modules.get("distutils")
    if core is not None and "_distutils" not in (getattr(core, "__file__", None) or ""):
        for name in [n for n in sys.modules if n == "distutils" or n.startswith("distutils.")]:
            del sys.modules[name]


# Seconds each file took (the "seconds per test file" line a full run prints; two workers, this 2-core machine). Only
# the order in which the two xdist workers take the files follows from them (:func:`_heaviest_files_first`); a wrong
# or missing number costs minutes, never a result. A file not listed counts as UNLISTED_FILE_SECONDS.
FILE_SECONDS: dict[str, float] = {  # measured 2026-12-06 (Python 3.12, two workers, the whole suite on an AMX Xeon);
    # the files that run's slowest-25 line did not list keep earlier numbers
    "test_notebooks.py": 381, "test_cluster.py": 133, "test_install.py": 98, "test_compat.py": 94,
    "test_docs.py": 90, "test_attach.py": 89, "test_megatron_bridge_loader.py": 73, "test_importers_skyrl_verl.py": 54,
    "test_browser.py": 54, "test_megatron_load.py": 49, "test_viz_export.py": 45, "test_staging.py": 45,
    "test_rollout.py": 42, "test_rl.py": 36, "test_trainer_megatron.py": 36, "test_gpu_recipe.py": 29,
    "test_widgets.py": 28, "test_staging_dist.py": 28, "test_packaging.py": 22, "test_gpu_check_today.py": 19,
    "test_server_ports.py": 18, "test_slicing.py": 18, "test_typing.py": 16, "test_olmoe.py": 16, "test_async.py": 15,
    # earlier measurements (not in that run's slowest 25)
    "test_device_decode.py": 24, "test_rescore.py": 17, "test_viz_collapse.py": 40, "test_docstrings.py": 19,
    "test_cluster_timeouts.py": 12, "test_megatron_sync.py": 18, "test_cpu_amx.py": 12,
}
UNLISTED_FILE_SECONDS = 10.0


def _heaviest_files_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker (scripts/test.sh: ``--dist loadfile --no-loadscope-reorder``), order the files by
    :data:`FILE_SECONDS`, heaviest first: xdist hands out files in collection order to whichever worker is free,
    so the long files start early and the short ones fill the gaps at the end (longest-processing-time first). Its
    own default orders files by their number of tests, which put the slowest, few-test files (the browser, the
    cluster, the wheel build) last, one worker idle while the other finished them. The sort is stable: each file's
    tests keep their order. A shuffled run (``-p randomly``) and a run in one process keep the order they have."""
    if not hasattr(config, "workerinput") or config.pluginmanager.get_plugin("randomly") is not None:
        return
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, UNLISTED_FILE_SECONDS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its file's tiers (:data:`TIERS`), and every test of a slow tier with ``slow``; in an xdist
    worker, the heaviest files first (:func:`_heaviest_files_first`)."""
    for item in items:
        for tier in TIERS.get(item.path.name, ()):
            item.add_marker(getattr(pytest.mark, tier))
        if any(item.get_closest_marker(t) for t in SLOW_TIERS):
            item.add_marker(pytest.mark.slow)
    _heaviest_files_first(config, items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the GPU recipe's pip dry runs (both environments) in the background once the tests are known
    (tests/gpu_dry_run.py): they wait on the network, so they overlap the CPU-bound tests instead of adding minutes."""
    if any(item.path.name == "test_gpu_recipe.py" for item in session.items):
        import gpu_dry_run

        gpu_dry_run.start_all()


# ---- how many vLLM engines the run started, per test file (printed at the end: the suite's main cost) --------------

_ENGINE_STARTS: collections.Counter[str] = collections.Counter()


@pytest.fixture(autouse=True, scope="session")
def _count_engine_starts():
    """Count ``RolloutEngine`` starts per test file (wrapping its ``__init__``; vLLM is not imported for this)."""
    import os

    from r3lab.rollout import engine as engine_module

    init = engine_module.RolloutEngine.__init__

    def counting_init(self, *args, **kwargs):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[0]
        _ENGINE_STARTS[Path(test).name] += 1
        return init(self, *args, **kwargs)

    engine_module.RolloutEngine.__init__ = counting_init
    yield
    engine_module.RolloutEngine.__init__ = init


# ---- where the suite's time goes, per test file (setup + call + teardown; printed at the end) -----------------------

_FILE_SECONDS: collections.Counter[str] = collections.Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _FILE_SECONDS[Path(report.nodeid.split("::")[0]).name] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker (scripts/test.sh runs two): hand its engine count to the controller, which prints."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["engine_starts"] = dict(_ENGINE_STARTS)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent (and never called) without workers
def pytest_testnodedown(node, error) -> None:
    _ENGINE_STARTS.update(getattr(node, "workeroutput", {}).get("engine_starts", {}))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _FILE_SECONDS:
        total = sum(_FILE_SECONDS.values())
        top = ", ".join(f"{f} {s:.0f}" for f, s in _FILE_SECONDS.most_common(25))
        terminalreporter.write_line(f"seconds per test file ({total:.0f} s in all; the slowest 25): {top}")
    if _ENGINE_STARTS:
        per_file = ", ".join(f"{f} {n}" for f, n in sorted(_ENGINE_STARTS.items()))
        terminalreporter.write_line(f"vLLM engines started: {sum(_ENGINE_STARTS.values())} ({per_file})")


# ---- session-wide vLLM engines (r3lab.testing.engines): one per (model, options), reset at every hand-out ------------


@pytest.fixture(scope="session")
def engine_pool():
    """The session's :class:`~r3lab.testing.engines.EnginePool`: ``engine_pool.engine(model, seed=0)`` is a vLLM engine
    in a fresh start's state (checkpoint weights, version 0, empty prefix cache, RNGs seeded), byte-checked against
    its first start; a module that pushes weights takes ``engine_pool.lease(...)`` (restored on the way out). Every
    engine ends with the session."""
    from r3lab.testing.engines import EnginePool

    pool = EnginePool()
    yield pool
    pool.close()

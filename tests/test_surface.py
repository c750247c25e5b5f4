"""The public surface: each public name is exported (listed in an ``__all__``) by exactly one module, its face: the
package facade nearest above the module that defines it (``r3lab.viz`` for ``r3lab.viz.routing``) when that facade
lists it, otherwise the defining module itself; never also by the defining module beside its facade, by an outer
facade beside an inner one, or by a sibling that imports it (``r3lab.widgets`` re-exporting ``r3lab.config.MODES``
would be one: two homes for one name).

The home of a name is found by reading each module's source: a name a module binds with ``from X import name`` is X's
(followed to the module that binds it otherwise), so constants and exceptions are traced as classes are.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import r3lab

ROOT = Path(r3lab.__file__).parent


def _module_names() -> list[str]:
    return ["r3lab"] + [m.name for m in pkgutil.walk_packages([str(ROOT)], "r3lab.")]


def _source(name: str) -> tuple[Path, ast.Module] | None:
    rel = name.split(".")[1:]
    for path in (ROOT.joinpath(*rel, "__init__.py"), ROOT.joinpath(*rel).with_suffix(".py") if rel else None):
        if path is not None and path.is_file():
            return path, ast.parse(path.read_text())
    return None


@cache
def home(module: str, name: str) -> str:
    """The r3lab module that binds ``name`` itself (not by importing it from another r3lab module)."""
    src = _source(module)
    if src is None:
        return module
    path, tree = src
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            base = node.module or ""
            if node.level:
                pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{node.module}" if node.module else pkg
            if not base.startswith("r3lab"):
                return module  # a third-party name exported under r3lab's own (none today)
            if _source(f"{base}.{alias.name}") is not None and alias.name == name:
                return f"{base}.{alias.name}"  # a submodule imported by name
            return home(base, alias.name)
    return module


def _exports() -> dict[str, list[str]]:
    """Each module's ``__all__`` as Python computes it (some are built from their submodules' lists)."""
    return {name: list(getattr(importlib.import_module(name), "__all__", [])) for name in _module_names()}


def test_each_public_name_is_exported_by_its_home_and_its_facades_only():
    stray = []
    for module, names in _exports().items():
        for name in names:
            where = home(module, name)
            if where != module and not where.startswith(module + "."):
                stray.append(f"{module} exports {name}, whose home is {where}")
    assert not stray, "\n".join(stray)


def test_each_public_name_is_exported_by_one_module_only():
    """One face per name: the same object (its home module and name) in two ``__all__`` lists fails."""
    exporters: dict[tuple[str, str], list[str]] = {}
    for module, names in _exports().items():
        for name in names:
            exporters.setdefault((home(module, name), name), []).append(module)
    twice = [f"{where}.{name} is exported by {', '.join(mods)}" for (where, name), mods in sorted(exporters.items())
             if len(mods) > 1]
    assert not twice, f"{len(twice)} names exported twice:\n" + "\n".join(twice)


def test_every_exported_name_exists():
    missing = []
    for module, names in _exports().items():
        mod = importlib.import_module(module)
        missing += [f"{module}.{n}" for n in names if not hasattr(mod, n)]
    assert not missing, missing


def test_the_rule_catches_a_sibling_re_export(tmp_path, monkeypatch):
    """The check can fail: a module that imports another module's name and lists it in its __all__ is found."""
    home.cache_clear()
    fake = "r3lab.widgets"
    real = _source

    def patched(name: str):
        if name == fake:
            return Path("x/__init__.py"), ast.parse("from r3lab.config import MODES\n__all__ = ['MODES']\n")
        return real(name)

    monkeypatch.setitem(globals(), "_source", patched)
    try:
        assert home(fake, "MODES") == "r3lab.config"
    finally:
        home.cache_clear()


def test_every_module_is_reachable_from_the_package_without_importing_it_first():
    """``import r3lab; r3lab.NAME`` works for every public module and package beside ``r3lab/__init__.py`` (the list
    is read from the package: a module added later is reachable without editing it), and ``import r3lab`` stays
    light (no torch)."""
    code = ("import sys, pathlib, r3lab\n"
            "assert 'torch' not in sys.modules, 'import r3lab pulled in torch'\n"
            "root = pathlib.Path(r3lab.__file__).parent\n"
            "want = sorted(p.stem if p.is_file() else p.name for p in root.iterdir()\n"
            "              if not p.name.startswith('_') and (p.suffix == '.py' or (p / '__init__.py').is_file()))\n"
            "assert list(r3lab.STAGES) == want, (r3lab.STAGES, want)\n"
            "for name in ('importers', 'doctor', 'families', 'labels', 'trainer_registry', 'routes'):\n"
            "    assert getattr(r3lab, name).__name__ == 'r3lab.' + name\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent, timeout=120)


def test_importing_the_cluster_package_leaves_torch_and_the_megatron_trainer_alone():
    """``import r3lab.cluster`` as its docstring promises: the Megatron rank actors' module (torch, the trainer) comes
    in only when one of its names is first used."""
    code = ("import sys, r3lab.cluster as c\n"
            "assert 'torch' not in sys.modules and 'r3lab.trainers.megatron' not in sys.modules, sorted(sys.modules)\n"
            "assert c.RemoteWeights.__module__ == 'r3lab.cluster.megatron'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent, timeout=120)

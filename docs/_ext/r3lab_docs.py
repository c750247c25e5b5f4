"""The site's own Sphinx machinery: results pages from ``bench/results/``, the module map of the API pages, and the
check that every role in a docstring names something that exists.

* **Results.** Each ``bench/results/NAME.md`` a benchmark printed becomes the page ``results/bench/NAME`` when the
  build starts (``builder-inited``), so the site shows the committed tables and never a copy edited by hand. The
  folder is the generator's own (ignored by git): a page whose table is gone is removed with it.
* **Module map.** ``.. r3lab-submodules:: r3lab.compaction`` lists every public module under a package with its
  docstring, read from the source without importing it (the trainer and engine modules import torch, vLLM or
  Megatron). Each becomes a ``py:module`` target, so ``:mod:`r3lab.compaction.container``` links.
* **Every role names something.** The API reference documents the facades (``r3lab.compaction``, ...), while the
  docstrings name objects where they are defined (``:func:`r3lab.compaction.container.encode```), relative to the
  module that defines them, or in torch, numpy and the standard library, which this offline build has no inventory
  of. A reference Sphinx cannot resolve is looked up by importing it, relative to the module that defines the
  documented object: found and documented under another name (a facade's re-export), it links there; found and
  not documented, it stays plain code; found nowhere, Sphinx's own warning stands and the strict build fails.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import make_refnode, nested_parse_with_titles

DOCS = Path(__file__).resolve().parent.parent
CHECKOUT = DOCS.parent
BENCH_RESULTS = CHECKOUT / "bench" / "results"
RESULTS_OUT = DOCS / "results" / "bench"
GENERATED_MARK = "<!-- generated from bench/results/ by docs/_ext/r3lab_docs.py: edit the benchmark, not this -->"


# ---- results pages ------------------------------------------------------------------------------------------------
def result_pages(source: Path = BENCH_RESULTS) -> dict[str, str]:
    """``{page name: page text}`` for every benchmark table in ``source`` (``NAME.md`` -> ``NAME``).

    The page is the table as its benchmark wrote it, with a line under its title naming the file it comes from.
    """
    pages = {}
    for path in sorted(source.glob("*.md")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        if not lines or not lines[0].startswith("# "):
            raise ValueError(f"{path} must start with a '# ' title line (the page's title), starts with {lines[:1]!r}")
        note = f"*The committed table `bench/results/{path.name}`, as its benchmark printed it.*"
        pages[path.stem] = "\n".join([GENERATED_MARK, lines[0], "", note, *lines[1:]]) + "\n"
    return pages


def write_result_pages(app: Sphinx) -> None:
    """Write the results pages into ``docs/results/bench/`` (only files that change; stale pages removed)."""
    pages = result_pages()
    RESULTS_OUT.mkdir(parents=True, exist_ok=True)
    for old in RESULTS_OUT.glob("*.md"):
        if old.stem not in pages and old.read_text(encoding="utf-8").startswith(GENERATED_MARK):
            old.unlink()
    for name, text in pages.items():
        target = RESULTS_OUT / f"{name}.md"
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            tmp = target.with_suffix(".md.tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(target)


# ---- module map -----------------------------------------------------------------------------------------------------
def public_submodules(package: str) -> list[tuple[str, Path]]:
    """Every module under ``package`` whose dotted name has no part starting with ``_``, in name order."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for info in pkgutil.walk_packages(list(spec.submodule_search_locations), prefix=package + "."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        sub = importlib.util.find_spec(info.name)
        if sub is not None and sub.origin:
            found.append((info.name, Path(sub.origin)))
    return sorted(found)


def reexported_data(package: str) -> list[tuple[str, str, str]]:
    """``(name, value repr or "", docstring)`` of each name in ``package.__all__`` that is data (not a class, function
    or module) autodoc leaves out: imported from another module, or assigned without a docstring. The docstring is
    the one under the assignment where the name is defined, if any."""
    from sphinx.pycode import ModuleAnalyzer

    module = importlib.import_module(package)
    own_docs = ModuleAnalyzer.for_module(package).find_attr_docs()
    found = []
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name, None)
        if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj) or ("", name) in own_docs:
            continue  # autodoc's own: classes, functions, and data with a docstring where the facade assigns it
        where, _, attr = module_aliases(package).get(name, f"{package}.{name}").rpartition(".")
        try:
            docs = ModuleAnalyzer.for_module(where).find_attr_docs()
        except Exception:  # a module without source: the value alone
            docs = {}
        doc = "\n".join(docs.get(("", attr), [])).strip()
        value = repr(obj)
        found.append((name, value if len(value) <= 100 and "\n" not in value else "", doc))
    return found


class SubmodulesDirective(SphinxDirective):
    """``.. r3lab-submodules:: PACKAGE``: a section per public module under PACKAGE, with its docstring."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        package = self.arguments[0]
        modules = public_submodules(package)
        if not modules and not reexported_data(package):
            return []
        facade = importlib.import_module(package)
        here = f"<modules of {package}>"
        content = StringList()
        data = reexported_data(package)
        if data:
            for line in [".. rubric:: Constants", ""]:
                content.append(line, here)
        for name, value, doc in data:
            for line in [f".. py:data:: {name}", *([f"   :value: {value}"] if value else []), "",
                         *(f"   {d}" for d in doc.splitlines()), ""]:
                content.append(line, here)
        for line in ["Modules", "-------", ""] if modules else []:
            content.append(line, here)
        for name, path in modules:
            self.env.note_dependency(str(path))
            tree = ast.parse(path.read_text(encoding="utf-8"))
            doc = ast.get_docstring(tree) or "(no docstring)"
            first = tree.body[0].lineno if ast.get_docstring(tree) else 0  # warnings name the module's own lines
            # a module named like an object of its facade (r3lab.cluster.connect the module and the function): the
            # object keeps the name in the index, references to the module read as code
            parent, _, last = name.rpartition(".")
            shadowed = last in getattr(facade, "__all__", ()) or last in getattr(importlib.import_module(parent),
                                                                                   "__all__", ())
            if path.name == "__init__.py" and not shadowed:
                # a package below this one is a facade of its own (one face per public name): its members here
                for line in [f"``{name}``", "~" * (len(name) + 4), "", f".. automodule:: {name}", "   :members:",
                             "   :undoc-members:", ""]:
                    content.append(line, here)
                continue
            directive = [f".. py:module:: {name}", "   :no-index:"] if shadowed else [f".. py:module:: {name}"]
            for line in [f"``{name}``", "~" * (len(name) + 4), "", *directive, ""]:
                content.append(line, here)
            for i, line in enumerate([*doc.splitlines(), ""]):
                content.append(line, str(path), first - 1 + i)
        content.append(f".. py:currentmodule:: {package}", here)
        section = nodes.section()
        nested_parse_with_titles(self.state, content, section)
        return section.children


# ---- every role names something -----------------------------------------------------------------------------------
_MISSING = object()


@functools.cache
def resolve_name(dotted: str) -> Any:
    """The object ``dotted`` names (a module, or attributes of the longest importable module prefix; a builtin; a
    dataclass field or annotated attribute of a class), else :data:`_MISSING`."""
    if not dotted or not re.fullmatch(r"[A-Za-z_][\w.]*", dotted):
        return _MISSING
    parts = dotted.split(".")
    if len(parts) == 1 and hasattr(builtins, dotted):
        return getattr(builtins, dotted)
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # a module that fails on import here names something all the same
            return _MISSING
        for i, attr in enumerate(parts[cut:], start=cut):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and i == len(parts) - 1 and _declares(obj, attr):
                return ("attribute of", obj, attr)
            else:
                return _MISSING
        return obj
    return _MISSING


def _declares(cls: type, attr: str) -> bool:
    """Whether ``cls`` (or a base) declares ``attr``: a dataclass field, an annotation, a slot, or ``self.attr = ...``
    in one of its methods (read from the source)."""
    for klass in cls.__mro__:
        if attr in getattr(klass, "__dataclass_fields__", {}) or attr in getattr(klass, "__annotations__", {}):
            return True
        if attr in (getattr(klass, "__slots__", ()) or ()):
            return True
        if klass.__module__ != "builtins" and attr in _self_attributes(klass):
            return True
    return False


def _self_attributes(klass: type) -> frozenset[str]:
    try:
        tree = ast.parse(inspect.getsource(klass).lstrip())
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                     and isinstance(node.value, ast.Name) and node.value.id == "self"
                     and isinstance(node.ctx, ast.Store))


@functools.cache
def module_aliases(module: str) -> dict[str, str]:
    """``{local name: dotted name}`` of every import in ``module``'s source, those under ``TYPE_CHECKING`` included
    (``import pandas as pd`` gives ``{"pd": "pandas"}``), so a string annotation names what it meant."""
    spec = importlib.util.find_spec(module) if module else None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return {}
    aliases = {}
    for node in ast.walk(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _enclosing_object(node: nodes.Node) -> tuple[str | None, str | None]:
    """The module and full name of the documented object whose description holds ``node``."""
    parent = node.parent
    while parent is not None:
        if isinstance(parent, addnodes.desc):
            for sig in parent.children:
                if isinstance(sig, addnodes.desc_signature):
                    return sig.get("module"), sig.get("fullname")
        parent = parent.parent
    return None, None


def _candidates(target: str, module: str | None, klass: str | None, node: nodes.Node) -> list[str]:
    # Sphinx's type fields split ``dict[str, int]`` at the comma: the head ``dict[str`` names ``dict``
    target = target.lstrip(".~").split("[", 1)[0]
    names = [target]
    for mod in filter(None, [module]):
        names += [f"{mod}.{klass}.{target}" if klass else "", f"{mod}.{target}"]
    obj_module, fullname = _enclosing_object(node)
    real_module = None
    if obj_module and fullname:
        documented = resolve_name(f"{obj_module}.{fullname}")
        owner = documented if isinstance(documented, type) else None
        if owner is None and "." in fullname:  # a method or attribute: its class
            owner_obj = resolve_name(f"{obj_module}.{fullname.rsplit('.', 1)[0]}")
            owner = owner_obj if isinstance(owner_obj, type) else None
        real_module = getattr(owner or documented, "__module__", None)
        if isinstance(real_module, str):  # where the object is defined: its docstring's names are relative to that
            if owner is not None:
                names.append(f"{real_module}.{owner.__qualname__}.{target}")
            names.append(f"{real_module}.{target}")
    head, _, rest = target.partition(".")
    for mod in filter(None, [module, obj_module, real_module if isinstance(real_module, str) else None]):
        alias = module_aliases(mod).get(head)
        if alias:
            names.append(f"{alias}.{rest}" if rest else alias)
    return [n for n in names if n]


def _documented(env: BuildEnvironment) -> dict[tuple[str, int], str]:
    """``{(last name, id(object)): documented full name}`` over the py domain's objects (built once per read)."""
    objects = env.get_domain("py").objects
    key = (id(env), len(objects))
    if key not in _DOCUMENTED:
        table = {}
        for fullname in objects:
            obj = resolve_name(fullname)
            if obj is not _MISSING and not isinstance(obj, tuple):
                table.setdefault((fullname.rsplit(".", 1)[-1], id(obj)), fullname)
        _DOCUMENTED.clear()
        _DOCUMENTED[key] = table
    return _DOCUMENTED[key]


_DOCUMENTED: dict[tuple[int, int], dict[tuple[str, int], str]] = {}


def resolve_missing(app: Sphinx, env: BuildEnvironment, node: addnodes.pending_xref,
                    contnode: nodes.Element) -> nodes.Element | None:
    """A py reference Sphinx could not resolve: a link to where the object is documented, plain code where it
    exists undocumented, ``None`` (Sphinx warns) where it names nothing."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    for name in _candidates(target, node.get("py:module"), node.get("py:class"), node):
        obj = resolve_name(name)
        if obj is _MISSING:
            continue
        if isinstance(obj, tuple):  # a declared attribute: documented under its class where it is
            return contnode
        hit = _documented(env).get((name.rsplit(".", 1)[-1], id(obj)))
        if hit is not None:
            entry = env.get_domain("py").objects[hit]
            return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, hit)
        return contnode
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", write_result_pages)
    app.connect("missing-reference", resolve_missing)
    app.add_directive("r3lab-submodules", SubmodulesDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}

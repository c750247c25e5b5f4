"""Sphinx configuration of r3lab's documentation site (built strict by tests/test_docs.py).

Build it with ``python -m sphinx -W --keep-going -b html docs docs/_build/html``. Prose pages are Markdown (MyST);
the API reference is autodoc over the packages' facades, whose docstrings are reStructuredText with Sphinx roles.
The site's own machinery lives in ``docs/_ext/r3lab_docs.py``: the results pages generated from ``bench/results/``,
the submodule listing of the API pages, and the check that every role in a docstring names something that exists.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # the checkout's r3lab, not an installed copy

import r3lab  # noqa: E402

project = "r3lab"
author = "the r3lab authors"
copyright = "the r3lab authors, Apache-2.0"  # noqa: A001  (Sphinx's name)
release = version = r3lab.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "r3lab_docs",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "figures", "gallery/*.png", "README.md"]
templates_path: list[str] = []

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links, checked like any other

# every reference must resolve: roles in docstrings included (r3lab_docs resolves what autodoc leaves over, and
# warns about what names nothing)
nitpicky = True
# members are listed per page (``:members:``); napoleon is left out on purpose: the docstrings are reST prose, and it
# reads an attribute docstring's first clause before a colon as the attribute's type
autodoc_default_options = {"show-inheritance": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False
autodoc_class_signature = "separated"

html_theme = "furo"
html_title = f"r3lab {release}"
html_static_path: list[str] = []
html_show_sourcelink = False

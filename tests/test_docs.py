"""The documentation site (``docs/``): it builds with no warning, its internal links land, it documents the public
surface and every benchmark table, and every code example on it runs.

The site is built once per module, in a subprocess, with ``-W`` (and ``nitpicky`` from ``docs/conf.py``: every
reference, roles in docstrings included, must name something). The links are checked on the built HTML by this file,
independently of Sphinx: every relative ``href``/``src`` must be a file of the build and every ``#fragment`` an id
in its page. Python examples run as scripts, one process per page (its blocks in order, like a notebook), in a
scratch folder that sees the checkout's ``data/`` and ``bench/``; a block after a ``% example: engine`` line needs a
vLLM engine and runs in the engine tier. Shell examples are checked, not run (they start engines, clusters or
servers for minutes): every ``r3lab`` line parses with the command's own parser, every ``bash scripts/...`` names a
script that exists. No network: the build reads no inventory and checks no external link.
"""

from __future__ import annotations

import ast
import html.parser
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
import r3lab_docs  # noqa: E402

FACADES = ("routes", "compaction", "slicing", "staging", "replay", "rollout", "importers", "doctor", "runs", "viz",
           "widgets", "trainers", "experiments", "metrics", "config", "errors")
ENGINE_MARK = "% example: engine"


def sphinx_build(src: Path, out: Path, *extra: str, timeout: float = 600) -> tuple[int, str, float]:
    """Build ``src`` to HTML in ``out`` strictly; (return code, warnings, seconds)."""
    warnings = out / "warnings.txt"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(out / "doctrees"), "-w", str(warnings), *extra, str(src), str(out / "html")],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    seconds = time.monotonic() - start
    text = warnings.read_text() if warnings.exists() else ""
    if proc.returncode and not text.strip():  # Sphinx itself failed: its stderr says why
        text = proc.stderr
    return proc.returncode, text, seconds


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    rc, warnings, seconds = sphinx_build(DOCS, out)
    print(f"docs build: {seconds:.1f} s")
    assert rc == 0 and not warnings.strip(), f"the site build warned (exit {rc}):\n{warnings}"
    return out / "html"


# ---- the build and its links ----------------------------------------------------------------------------------------
class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if value and ((name == "href" and tag in ("a", "link")) or (name == "src" and tag in ("img", "script"))):
                self.links.append(value)


def _parse(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def broken_links(root: Path) -> list[str]:
    """Every relative link or fragment in the HTML under ``root`` that lands on no file or no id."""
    pages = {p: _parse(p) for p in root.rglob("*.html")}
    bad = []
    for page, parsed in pages.items():
        for link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith("mailto:"):
                continue  # external: not checked (no network)
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                bad.append(f"{page.relative_to(root)}: {link} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = (pages.get(target) or _parse(target)).ids
                if unquote(parts.fragment) not in ids:
                    bad.append(f"{page.relative_to(root)}: {link} (no id {parts.fragment!r} there)")
    return bad


def test_site_builds_without_warnings_and_its_links_land(site: Path) -> None:
    assert (site / "index.html").is_file()
    bad = broken_links(site)
    assert not bad, "broken internal links:\n" + "\n".join(bad)


def test_link_check_catches_a_missing_page_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.html").write_text('<p id="here"><a href="b.html#nowhere">x</a><a href="c.html">y</a>'
                                     '<a href="#here">z</a><a href="https://example.org/x">w</a></p>')
    (tmp_path / "b.html").write_text('<p id="there">b</p>')
    assert sorted(broken_links(tmp_path)) == ["a.html: b.html#nowhere (no id 'nowhere' there)",
                                              "a.html: c.html (no such file)"]


def test_a_role_that_names_nothing_fails_the_strict_build(tmp_path: Path) -> None:
    """A small site with the same configuration, built once: a role naming nothing (a stale name, as the docstrings
    had) fails the build with Sphinx's warning, and that is its only warning: the roles beside it, naming a real but
    undocumented object, pass."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text((DOCS / "conf.py").read_text().replace("DOCS = Path(__file__).resolve().parent",
                                                                          f"DOCS = Path({str(DOCS)!r})"))
    ok = "# ok\n\n{py:func}`r3lab.compaction.container.encode` and {py:class}`numpy.ndarray`\n"
    bad = "r3lab.cluster.waits.ActorJob.fail"
    (src / "index.md").write_text(ok + f"\n{{py:meth}}`{bad}`\n")
    rc, warnings, _ = sphinx_build(src, tmp_path / "site")
    assert rc != 0 and bad in warnings, warnings
    lines = [line for line in warnings.splitlines() if "WARNING" in line or "ERROR" in line]
    assert lines and all(bad in line for line in lines), warnings


def test_resolve_name_finds_what_exists_and_nothing_else() -> None:
    import numpy as np

    from r3lab.compaction import encode
    from r3lab.runs import RunWriter
    from r3lab.slicing import ParallelLayout

    assert r3lab_docs.resolve_name("r3lab.compaction.container.encode") is encode
    assert r3lab_docs.resolve_name("numpy.ndarray") is np.ndarray
    assert r3lab_docs.resolve_name("ValueError") is ValueError
    assert r3lab_docs.resolve_name("r3lab.slicing.ParallelLayout.num_layers") == (  # a dataclass field
        "attribute of", ParallelLayout, "num_layers")
    assert r3lab_docs.resolve_name("r3lab.runs.writer.RunWriter.path") == (  # set in __init__
        "attribute of", RunWriter, "path")
    for missing in ("r3lab.compaction.container.no_such", "r3lab.no_such_module", "ParallelLayout.num_layers",
                    "r3lab.slicing.ParallelLayout.no_such_field", "not a name"):
        assert r3lab_docs.resolve_name(missing) is r3lab_docs._MISSING, missing


# ---- what the site documents --------------------------------------------------------------------------------------
def test_api_reference_documents_every_facade_name(site: Path) -> None:
    import importlib

    for facade in FACADES:
        page = site / "api" / f"{facade}.html"
        assert page.is_file(), f"no API page for r3lab.{facade}"
        ids = _parse(page).ids
        module = importlib.import_module(f"r3lab.{facade}")
        missing = [name for name in module.__all__ if f"r3lab.{facade}.{name}" not in ids]
        assert not missing, f"r3lab.{facade}: {missing} in __all__ but not in the API reference"


def test_results_pages_are_the_benchmark_tables(site: Path) -> None:
    tables = sorted((ROOT / "bench" / "results").glob("*.md"))
    assert len(tables) >= 10
    for table in tables:
        page = site / "results" / "bench" / f"{table.stem}.html"
        assert page.is_file(), f"no results page for {table}"
        text = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page.read_text(encoding="utf-8"))))
        text = text.replace("\u2019", "'").replace("\u2018", "'").replace("\u201c", '"').replace("\u201d", '"')
        title = table.read_text(encoding="utf-8").splitlines()[0].removeprefix("# ").replace("`", "")
        cells = [c.strip() for line in table.read_text(encoding="utf-8").splitlines() if line.startswith("| ")
                 for c in line.strip("|").split("|")][:40]
        for piece in [title, *(c for c in cells if c and "`" not in c and "*" not in c and "\\" not in c)]:
            assert html.unescape(piece) in text or re.sub(r"\s+", " ", piece) in text, (table.name, piece)


def test_result_pages_follow_the_tables(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A table\n\n| x |\n|---|\n| 1 |\n")
    (tmp_path / "b.md").write_text("no title\n")
    with pytest.raises(ValueError, match="b.md must start with a '# ' title"):
        r3lab_docs.result_pages(tmp_path)
    (tmp_path / "b.md").unlink()
    pages = r3lab_docs.result_pages(tmp_path)
    assert list(pages) == ["a"]
    assert pages["a"].splitlines()[1] == "# A table" and "| 1 |" in pages["a"]


# ---- every example runs -------------------------------------------------------------------------------------------
def doc_sources() -> list[Path]:
    """The site's hand-written pages (the results pages are generated from bench/results/)."""
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts and "bench" not in p.parts)


def examples(lang: str) -> list[tuple[Path, int, str, bool]]:
    """``(page, line, code, needs an engine)`` of every fenced ``lang`` block of the site's pages."""
    found = []
    for page in doc_sources():
        lines = page.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            m = re.match(r"^(`{3,})" + lang + r"\s*$", lines[i])
            if m:
                end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(m.group(1)))
                engine = i > 0 and lines[i - 1].strip() == ENGINE_MARK
                found.append((page, i + 1, "\n".join(lines[i + 1:end]), engine))
                i = end
            i += 1
    return found


def run_page(page: Path, blocks: list[tuple[int, str]], cwd: Path, *, substitute: dict[str, str] | None = None,
             timeout: float = 300) -> None:
    """Run a page's blocks in order as one script in ``cwd`` (which sees the checkout's data/ and bench/)."""
    for name in ("data", "bench"):
        if not (cwd / name).exists():
            (cwd / name).symlink_to(ROOT / name)
    script = ""
    for line, code in blocks:
        script += f"# {page.relative_to(ROOT)} line {line}\n{code}\n"
    for old, new in (substitute or {}).items():
        script = script.replace(old, new)
    path = cwd / f"{page.stem}_examples.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, str(path)], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, f"{page.relative_to(ROOT)}'s examples failed:\n{proc.stdout}\n{proc.stderr}"


def test_examples_are_found() -> None:
    fast = [e for e in examples("python") if not e[3]]
    engine = [e for e in examples("python") if e[3]]
    assert len(fast) >= 6 and len(engine) >= 2, (len(fast), len(engine))
    assert len(examples("bash")) >= 8


@pytest.mark.parametrize("page", sorted({str(p.relative_to(DOCS)) for p, _, _, e in examples("python") if not e}))
def test_python_examples_run(page: str, tmp_path: Path) -> None:
    path = DOCS / page
    blocks = [(line, code) for p, line, code, engine in examples("python") if p == path and not engine]
    if path.name == "adding-a-model-family.md":
        _check_family_entry(blocks)
        return
    run_page(path, blocks, tmp_path)


def _check_family_entry(blocks: list[tuple[int, str]]) -> None:
    """The family guide's entry is a template for r3lab/families.py: run there, it must build the entry r3lab
    ships for that family, field for field."""
    import r3lab.families as families

    built = []
    namespace = {**vars(families), "register_family": built.append}
    for line, code in blocks:
        exec(compile(code, f"docs/adding-a-model-family.md line {line}", "exec"), namespace)
    assert built, "the family guide's example registers no family"
    for family in built:
        assert family == families.FAMILIES[family.model_type], family.model_type


@pytest.mark.engine
def test_engine_examples_run(tmp_path: Path) -> None:
    """The capture example starts its own engine; the attach example talks to a loopback vLLM server started here
    in the place of the GPU node's."""
    from r3lab.rollout import RolloutServer

    by_page: dict[Path, list[tuple[int, str]]] = {}
    for page, line, code, engine in examples("python"):
        if engine:
            by_page.setdefault(page, []).append((line, code))
    attach = DOCS / "guides" / "attach.md"
    for page, blocks in by_page.items():
        if page != attach:
            (tmp_path / page.stem).mkdir()
            run_page(page, blocks, tmp_path / page.stem)
    with RolloutServer(ROOT / "data" / "models" / "tiny-qwen3-moe", seed=0, max_model_len=512) as server:
        (tmp_path / "attach").mkdir()
        run_page(attach, by_page[attach], tmp_path / "attach", substitute={"http://gpu-node:8000": server.url})


def test_shell_examples_name_real_commands_and_flags() -> None:
    from r3lab.cli import _parser

    checked = 0
    for page, line, code, _ in examples("bash"):
        for text in code.splitlines():
            words = shlex.split(text, comments=True)
            if not words:
                continue
            where = f"{page.relative_to(ROOT)} line {line}: {text.strip()}"
            if words[0] == "r3lab":
                try:
                    _parser().parse_args(words[1:])
                except SystemExit as e:
                    if e.code != 0:  # --help exits 0
                        raise AssertionError(f"`r3lab` does not take {where}") from None
                checked += 1
            elif words[0] == "bash":
                assert (ROOT / words[1]).is_file(), f"no script {words[1]}: {where}"
                checked += 1
    assert checked >= 20, checked


def test_docs_examples_parse() -> None:
    for page, line, code, _ in examples("python"):
        ast.parse(code, filename=f"{page} line {line}")

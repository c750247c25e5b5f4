"""The README is the project's landing page: short, everything it names exists, and its example runs.

It holds at most :data:`MAX_LINES` lines. Every command it names exists: ``bash scripts/X.sh`` and
``python bench/X.py`` / ``python scripts/X.py`` as files of the checkout, ``r3lab SUB`` as a subcommand of the
command's own parser, and each whole ``r3lab`` line of its shell blocks parses with that parser. Every relative link
and every path it names in inline code is a file or folder of the checkout, and a link's ``#fragment`` is a heading of
the Markdown page it points to (GitHub's heading slugs, which the site's MyST anchors share). Each headline result
links to a page, and every number in it is on that page (the numbers are copied, never rounded anew). The versions
table the documentation includes sits between its markers. Its Python example runs, as a script in a scratch folder
that sees the checkout's ``data/``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 200
VERSIONS_BEGIN, VERSIONS_END = "<!-- versions -->", "<!-- end versions -->"

_FENCE = re.compile(r"^(`{3,})(\w*)\s*$")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_SPAN = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^\.?[\w.-]+/[\w./-]*$")  # a relative path in inline code: has a slash, no spaces
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e-?\d+)?")


def split_blocks(text: str) -> tuple[list[tuple[int, str]], list[tuple[str, int, str]]]:
    """The prose lines as ``(line number, text)`` (fenced blocks left out) and every fenced block as ``(language,
    its first code line's number, code)``."""
    prose: list[tuple[int, str]] = []
    blocks: list[tuple[str, int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(m.group(1))), len(lines))
            blocks.append((m.group(2), i + 2, "\n".join(lines[i + 1:end])))
            i = end + 1
            continue
        prose.append((i + 1, lines[i]))
        i += 1
    return prose, blocks


def heading_slugs(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings (the site's MyST anchors are the same slugs)."""
    prose, _ = split_blocks(page.read_text(encoding="utf-8"))
    slugs = set()
    for _, line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            title = re.sub(r"[`*_]", "", m.group(1)).strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return slugs


def subcommands() -> set[str]:
    """The subcommands the ``r3lab`` command's parser takes."""
    from r3lab.cli import _parser

    found: set[str] = set()
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _command_problems(words: list[str], root: Path, where: str, *, whole_line: bool) -> list[str]:
    """What is wrong with one command: a script that is not there, an ``r3lab`` subcommand (or, for a whole line of a
    shell block, a command line) the parser does not take."""
    if not words:
        return []
    if words[0] == "bash" and len(words) > 1:
        return [] if (root / words[1]).is_file() else [f"{where}: no script {words[1]}"]
    if words[0] == "python" and len(words) > 1 and words[1].endswith(".py"):
        return [] if (root / words[1]).is_file() else [f"{where}: no script {words[1]}"]
    if words[0] == "python" and words[1:3] == ["-m", "r3lab"]:
        words = ["r3lab", *words[3:]]
    if words[0] != "r3lab":
        return []
    if whole_line:
        from r3lab.cli import _parser

        try:
            _parser().parse_args(words[1:])
        except SystemExit as e:
            if e.code != 0:  # --help exits 0
                return [f"{where}: `r3lab` does not take {' '.join(words[1:])!r}"]
        return []
    if len(words) > 1 and not words[1].startswith("-") and words[1] not in subcommands():
        return [f"{where}: `r3lab {words[1]}` is no subcommand of r3lab"]
    return []


def _link_problems(target: str, root: Path, where: str) -> list[str]:
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or target.startswith("mailto:"):
        return []  # external: not checked (no network)
    path = root / unquote(parts.path) if parts.path else root / "README.md"
    if not path.exists():
        return [f"{where}: link {target} lands on no file or folder"]
    if parts.fragment and path.suffix == ".md" and parts.fragment not in heading_slugs(path):
        return [f"{where}: link {target}: no heading #{parts.fragment} in {parts.path}"]
    return []


def _section(prose: list[tuple[int, str]], title: str) -> list[str]:
    """The prose lines under the level-2 heading ``title``, up to the next one."""
    texts = [line for _, line in prose]
    if f"## {title}" not in texts:
        return []
    start = texts.index(f"## {title}") + 1
    end = next((i for i in range(start, len(texts)) if texts[i].startswith("## ")), len(texts))
    return texts[start:end]


def readme_problems(text: str, root: Path = ROOT) -> list[str]:
    """Everything the landing page names that does not hold (empty: it all does)."""
    problems = []
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        problems.append(f"{len(lines)} lines, more than {MAX_LINES}: the detail belongs on the documentation site")
    prose, blocks = split_blocks(text)
    for lang, first, code in blocks:
        if lang not in ("bash", "sh", "console", "shell"):
            continue
        for k, line in enumerate(code.splitlines()):
            words = shlex.split(line, comments=True)
            problems += _command_problems(words, root, f"line {first + k}", whole_line=True)
    for n, line in enumerate(lines, 1):
        if _FENCE.match(line):
            continue
        for target in _LINK.findall(line):
            problems += _link_problems(target, root, f"line {n}")
    for n, line in prose:
        for span in _SPAN.findall(line):
            try:
                problems += _command_problems(shlex.split(span), root, f"line {n}", whole_line=False)
            except ValueError:  # not shell words: not a command
                pass
            if _PATH.match(span) and not (root / span).exists():
                problems.append(f"line {n}: `{span}` is no file or folder of the checkout")
    for bullet in (line for line in _section(prose, "Results") if line.startswith("- ")):
        links = [t for t in _LINK.findall(bullet) if not urlsplit(t).scheme]
        label = m.group(1) if (m := re.search(r"\*\*(.+?)\*\*", bullet)) else bullet[2:42]
        if not links:
            problems.append(f"headline result {label!r} links to no page")
            continue
        page = root / unquote(urlsplit(links[0]).path)
        if not page.is_file():
            continue  # reported as a broken link above
        words = " ".join(page.read_text(encoding="utf-8").split())
        claim = _LINK.sub("", bullet)
        missing = [x for x in _NUMBER.findall(claim) if not re.search(rf"(?<![\d.]){re.escape(x)}(?![\d]|\.\d)", words)]
        if missing:
            problems.append(f"headline result {label!r}: {missing} not on {links[0]}")
    if VERSIONS_BEGIN not in text or VERSIONS_END not in text:
        problems.append(f"the versions table the docs include needs its markers {VERSIONS_BEGIN} ... {VERSIONS_END}")
    elif "| library |" not in text.split(VERSIONS_BEGIN, 1)[1].split(VERSIONS_END, 1)[0]:
        problems.append("no versions table between the versions markers")
    return problems


def python_examples(text: str) -> list[str]:
    return [code for lang, _, code in split_blocks(text)[1] if lang == "python"]


# ---- the README itself ----------------------------------------------------------------------------------------------
def test_the_readme_is_short_and_everything_it_names_exists() -> None:
    assert readme_problems(README.read_text(encoding="utf-8")) == []


def test_its_example_runs(tmp_path: Path) -> None:
    examples = python_examples(README.read_text(encoding="utf-8"))
    assert len(examples) == 1, f"the README has {len(examples)} Python examples; the landing page keeps one"
    (tmp_path / "data").symlink_to(ROOT / "data")
    script = tmp_path / "readme_example.py"
    script.write_text(examples[0])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, f"the README's example failed:\n{proc.stdout}\n{proc.stderr}"


# ---- the checks can fail --------------------------------------------------------------------------------------------
def test_the_checks_find_what_does_not_exist() -> None:
    bad = "\n".join([
        "# r3lab",
        "```bash",
        "bash scripts/no_such.sh",
        "r3lab drift --no-such-flag",
        "python bench/bench_no_such.py",
        "```",
        "Run `r3lab frobnicate`, see `bench/no_such_folder/` and [the guide](docs/no-such-page.md),",
        "[testing](docs/testing.md#no-such-heading), [tiers](docs/testing.md#the-suite-and-its-tiers).",
        "## Results",
        "- **Drift**: R3 cuts k3 3.14159x ([drift](docs/results/summary.md#drift)).",
        "- **Transport**: no link.",
    ])
    problems = readme_problems(bad)
    expected = [
        "line 3: no script scripts/no_such.sh",
        "line 4: `r3lab` does not take 'drift --no-such-flag'",
        "line 5: no script bench/bench_no_such.py",
        "line 7: link docs/no-such-page.md lands on no file or folder",
        "line 8: link docs/testing.md#no-such-heading: no heading #no-such-heading in docs/testing.md",
        "line 7: `r3lab frobnicate` is no subcommand of r3lab",
        "line 7: `bench/no_such_folder/` is no file or folder of the checkout",
        "headline result 'Drift': ['3.14159'] not on docs/results/summary.md#drift",
        "headline result 'Transport' links to no page",
        f"the versions table the docs include needs its markers {VERSIONS_BEGIN} ... {VERSIONS_END}",
    ]
    assert problems == expected
    versions = [VERSIONS_BEGIN, "| library |", VERSIONS_END]
    assert readme_problems("\n".join(["text"] * (MAX_LINES - 3) + versions)) == []
    assert readme_problems("\n".join(["text"] * (MAX_LINES - 2) + versions)) == [
        f"{MAX_LINES + 1} lines, more than {MAX_LINES}: the detail belongs on the documentation site"]


def test_heading_slugs_are_githubs(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Results\n## RL: none, R2 and R3\n```bash\n# not a heading\n```\n"
                    "### Routing-weight replay (R3W)\n## `r3lab` on GPU nodes\n")
    assert heading_slugs(page) == {"results", "rl-none-r2-and-r3", "routing-weight-replay-r3w", "r3lab-on-gpu-nodes"}

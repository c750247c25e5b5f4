"""Docstrings and comments say what the code does and why; history lives in CHANGELOG.md.

Every docstring (of a module, class or function, and the string statements that document an attribute) and every
comment of ``r3lab/``, ``bench/`` and ``scripts/`` is cut into sentences, and three things are refused in them:

* **An upstream source line number**: ``path.py:123`` (or ``path.py:12-34``, ``path.py:5,9``) and ``l.123`` (or
  ``~l.123``). Lines move with every upstream commit; cite ``module.function`` or ``Class.method`` at the commit or
  release it was read at instead.
* **An issue or pull-request number of r3lab's own tracker**: ``issue 12`` anywhere (r3lab's own spelling), and
  ``#12`` in a sentence that names no upstream project. Upstream trackers are cited as ``#N`` with their project
  (``vLLM #33013``, ``verl #5344, #6054``, ``SkyRL's pull requests #2235 and #2236``): those numbers name someone
  else's bug, which a reader can open.
* **A bare commit hash of r3lab's own history**: a word of 7 to 40 lowercase hexadecimal digits, at least one of them
  a decimal digit and one a letter (so neither a plain number nor a word such as ``defaced``), in a sentence that
  names no upstream project. ``read at NVIDIA/Megatron-LM commit d98e8a64`` passes (a fixed point in another
  project's history); ``(r3lab cf15985)`` fails (what r3lab once did belongs in CHANGELOG.md).

An upstream project is one of :data:`UPSTREAM_PROJECTS`, matched as a whole word with its own spelling. A sentence
ends at a full stop, question mark or exclamation mark followed by white space, at a blank line, and where a bullet
(``*`` or ``-``) or a numbered item starts a line; comments alone on consecutive lines are read as one text, a
comment after code as a text of its own. So a hash or a ``#N`` passes only when the project it belongs to is named in
the same sentence. Strings the program uses (messages, data) are not read: only docstrings and comments.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import r3lab

ROOT = Path(r3lab.__file__).parent.parent
CHECKED_FOLDERS = ("r3lab", "bench", "scripts")

#: the projects whose commits, issues and pull requests r3lab's docstrings may cite, as they are spelled there (a
#: GitHub slug such as ``THUDM/slime`` or ``NVIDIA/Megatron-LM`` holds the project's name)
UPSTREAM_PROJECTS = (
    "vLLM", "vllm", "SGLang", "sglang", "verl", "slime", "Miles", "miles", "SkyRL", "NeMo-RL", "NVIDIA-NeMo",
    "prime-rl", "prime_rl", "verifiers", "tunix", "Megatron-LM", "Megatron", "megatron-core", "Megatron-Bridge",
    "mbridge", "transformers", "torch", "PyTorch", "Ray", "TransferQueue", "tensordict",
)
_UPSTREAM = re.compile(r"(?<![\w-])(?:" + "|".join(re.escape(name) for name in UPSTREAM_PROJECTS) + r")(?![\w-])")

_LINE_NUMBER = re.compile(r"\.py:\d+(?:[-,]\d+)*|(?<![\w.])~?l\.\s?\d+")
_OWN_ISSUE = re.compile(r"(?i)\bissues?\s+\d+")
_TRACKER_NUMBER = re.compile(r"(?<![\w&#])#\d+\b")
_HEX_WORD = re.compile(r"(?<![\w.-])[0-9a-f]{7,40}(?![\w-])")
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+|\n\s*\n|\n(?=\s*(?:[*-]|\d+[.)])\s)")


def documentation_texts(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every docstring and every comment block of ``source``.

    Docstrings are the first statement of a module, class or function when it is a string, and any other string
    statement in a body (what documents the attribute above it). Comments are read with :mod:`tokenize`: comments
    that stand alone on consecutive lines are one block, a comment after code on its line is a block of its own."""
    tree = ast.parse(source)
    texts = []
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else ():
            if (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
                    and isinstance(statement.value.value, str)):
                texts.append((statement.lineno, statement.value.value))
    block_start, block_end, block = 0, 0, []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line, text = token.start[0], token.string.lstrip("#:!").strip()
        alone = token.line.lstrip().startswith("#")
        if block and (line != block_end + 1 or not alone):
            texts.append((block_start, "\n".join(block)))
            block = []
        if not alone:
            texts.append((line, text))
            continue
        if not block:
            block_start = line
        block.append(text)
        block_end = line
    if block:
        texts.append((block_start, "\n".join(block)))
    return sorted(texts)


def sentences(text: str) -> list[str]:
    """``text`` cut where :data:`_SENTENCE_END` matches, each sentence on one line."""
    return [" ".join(part.split()) for part in _SENTENCE_END.split(text) if part.strip()]


def history_citations(text: str) -> list[str]:
    """What ``text`` cites that the module docstring's rules refuse: each finding with the sentence it is in."""
    found = []
    for sentence in sentences(text):
        here = [f"upstream line number {m.group()!r}" for m in _LINE_NUMBER.finditer(sentence)]
        here += [f"r3lab issue number {m.group()!r}" for m in _OWN_ISSUE.finditer(sentence)]
        if _UPSTREAM.search(sentence) is None:
            here += [f"r3lab issue number {m.group()!r}" for m in _TRACKER_NUMBER.finditer(sentence)]
            here += [f"r3lab commit hash {m.group()!r}" for m in _HEX_WORD.finditer(sentence)
                     if re.search(r"\d", m.group()) and re.search(r"[a-f]", m.group())]
        found += [f"{finding} in: {sentence}" for finding in here]
    return found


def checked_files() -> list[Path]:
    return sorted(path for folder in CHECKED_FOLDERS for path in (ROOT / folder).rglob("*.py"))


def test_the_checked_folders_hold_python_files():
    for folder in CHECKED_FOLDERS:
        assert any((ROOT / folder).rglob("*.py")), folder


def test_no_docstring_or_comment_carries_history_or_upstream_line_numbers():
    found = []
    for path in checked_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, text in documentation_texts(path.read_text(encoding="utf-8")):
            found += [f"{rel}:{line}: {finding}" for finding in history_citations(text)]
    assert not found, ("cite upstream code by module.function at the commit read, name the upstream project beside its "
                       "issue numbers and hashes, and move r3lab's own history to CHANGELOG.md:\n" + "\n".join(found))


@pytest.mark.parametrize("text", [
    "Read at Megatron-LM commit ``d98e8a64``.",
    "All-zero routes (vLLM #33013, #49184) are a capture failure.",
    "Dense rows shifted by one (verl #5037/#5452, slime #819).",
    "SkyRL's pull requests #2235 and #2236 reopen #2080 and #2081; read at their heads c1e71a0b and 0caad2f2.",
    "``fused_moe/layer.py`` ``FusedMoEFactory`` (vllm 0.30.0) passes the factor to the runner.",
    "A seed of 20261204 and 1,008 tests; the word defaced and the colour #1f77b4.",
    "``partition`` popped (``slime/utils/data.py:process_rollout_data``), a file and its function.",
])
def test_allowed_citations_pass(text):
    assert history_citations(text) == []


@pytest.mark.parametrize(("text", "kind"), [
    ("Megatron's ``router.py`` l.205-207 sets the flag.", "upstream line number"),
    ("``slime/ray/rollout.py:500,522`` saves eval rollouts.", "upstream line number"),
    ("NeMo-RL's ``grpo.py`` (~l.3630) logs the batch.", "upstream line number"),
    ("The benchmark of issue 17.", "r3lab issue number"),
    ("The Megatron-core trainer against the transformers trainer (issue 17's benchmark).", "r3lab issue number"),
    ("Fixed in #12.", "r3lab issue number"),
    ("The layout the first writer (r3lab cf15985) used.", "r3lab commit hash"),
    ("Supported by vLLM.\n\n* since 9956a86 one bit stream.", "r3lab commit hash"),
    ("Recorded as SkyRL does. Changed in 83591f8 to a fixed layout.", "r3lab commit hash"),
])
def test_refused_citations_are_found(text, kind):
    found = history_citations(text)
    assert len(found) == 1 and found[0].startswith(kind), found


def test_documentation_texts_reads_docstrings_and_comments_only():
    source = (
        '"""Module."""\n'
        "LIMIT = 3  # after code\n"
        '"""Documents LIMIT."""\n'
        "# one block,\n"
        "# two lines\n"
        "\n"
        "# another block\n"
        "def f():\n"
        '    """Function."""\n'
        '    return "a message naming #12 and cf15985"\n'
    )
    assert documentation_texts(source) == [
        (1, "Module."), (2, "after code"), (3, "Documents LIMIT."), (4, "one block,\ntwo lines"), (7, "another block"),
        (9, "Function."),
    ]


def test_a_finding_names_the_sentence_it_is_in():
    text = "The frame is fixed. Its layout changed in cf15985 (see the container)."
    assert history_citations(text) == [
        "r3lab commit hash 'cf15985' in: Its layout changed in cf15985 (see the container)."]

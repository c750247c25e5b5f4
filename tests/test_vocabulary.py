"""One vocabulary (r3lab.vocabulary): the names that cross layers are written there and nowhere else in the package,
and the collapse rule's words are generated from the numbers the detector runs with."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

import r3lab
from r3lab import metrics, vocabulary
from r3lab.errors import ConfigError
from r3lab.vocabulary import (
    COLLAPSE_RULE,
    LATE_COLLAPSE_RULE,
    METRICS,
    PLAIN_WORD_KEYS,
    RUN_KINDS,
    TASKS,
    DriftMetric,
    RLMetric,
    collapse_prose,
)

PACKAGE = Path(r3lab.__file__).parent
ROOT = PACKAGE.parent
VOCABULARY_FILE = Path(vocabulary.__file__)


# the same word as a field of a file r3lab writes, meaning something else (renaming it would change that file): slime's
# logs of files an import leaves out say {"imported": False}, whether r3lab imported them (not the run kind)
HOMONYM_KEYS = {"r3lab/importers/slime.py": frozenset({"imported"})}


def guarded_strings() -> frozenset[str]:
    """The strings only the vocabulary may write: record keys (but the plain words), run kinds, task names."""
    return frozenset((set(METRICS) - PLAIN_WORD_KEYS) | set(RUN_KINDS) | set(TASKS))


def _docstring_nodes(tree: ast.Module) -> set[int]:
    """The ids of the docstring constants: the first statement of a module, class or function, when a string."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                    str):
                out.add(id(first.value))
    return out


def vocabulary_literals(source: str, guarded: frozenset[str], homonym_keys: frozenset[str] = frozenset()
                        ) -> list[tuple[int, str]]:
    """(line, string) of every string constant in ``source`` that is one of ``guarded``: in expressions, dict keys,
    default arguments, f-string parts, anywhere but a docstring (comments are not in the syntax tree), and but a key
    of a dict display that is one of ``homonym_keys``."""
    tree = ast.parse(source)
    skip = _docstring_nodes(tree)
    skip |= {id(k) for node in ast.walk(tree) if isinstance(node, ast.Dict) for k in node.keys
             if isinstance(k, ast.Constant) and k.value in homonym_keys}
    return sorted((node.lineno, node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in guarded
                  and id(node) not in skip)


def test_no_module_but_the_vocabulary_writes_a_vocabulary_string():
    guarded = guarded_strings()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == VOCABULARY_FILE:
            continue
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{line}: {text!r}" for line, text in
                  vocabulary_literals(path.read_text(encoding="utf-8"), guarded, HOMONYM_KEYS.get(rel, frozenset()))]
    assert not found, "use the r3lab.vocabulary name instead of the string:\n" + "\n".join(found)


def test_each_homonym_exemption_is_still_needed():
    """An exemption names a dict key its file still writes (else it would hide a future use of the name)."""
    for rel, keys in HOMONYM_KEYS.items():
        assert vocabulary_literals((ROOT / rel).read_text(encoding="utf-8"), keys), rel


def test_the_finder_sees_every_use_in_code_and_none_in_docstrings_or_comments():
    """The check can fail: each way code can write a key is found, and documentation is left alone."""
    source = '''"""The module's docstring may say mismatch/k3_kl; so may a comment."""
KEY = "mismatch/k3_kl"  # mismatch/k3_kl
def f(run, key="rl"):
    """A function's docstring: "rl"."""
    run.require_kind("drift")
    return {"letter": 1}, f"{run['k3_none']:.2e}", run.get("tokens"), "mismatch/k3_kl_x"
class C:
    """A class's docstring: chain."""
    kind = "capture"
'''
    found = vocabulary_literals(source, guarded_strings())
    assert found == [(2, "mismatch/k3_kl"), (3, "rl"), (5, "drift"), (6, "k3_none"), (6, "letter"), (9, "capture")]
    # a homonym exemption skips that word as a dict display's key only, never elsewhere
    exempt = vocabulary_literals(source, guarded_strings(), frozenset({"letter", "drift"}))
    assert exempt == [(2, "mismatch/k3_kl"), (3, "rl"), (5, "drift"), (6, "k3_none"), (9, "capture")]


def test_the_guarded_strings_are_the_vocabulary():
    guarded = guarded_strings()
    assert {RLMetric.K3_KL, DriftMetric.K3_R3, "rl", "drift", "capture", "imported", "letter", "chain"} <= guarded
    assert PLAIN_WORD_KEYS <= set(METRICS) and not PLAIN_WORD_KEYS & guarded  # the exemption names table keys only
    assert len(guarded) == len(METRICS) - len(PLAIN_WORD_KEYS) + len(RUN_KINDS) + len(TASKS)  # no name is two things


def test_every_named_record_key_has_its_label_and_unit_in_the_one_table():
    for names in (RLMetric, DriftMetric):
        keys = {v for k, v in vars(names).items() if k.isupper()}
        assert keys and keys <= set(METRICS), sorted(keys - set(METRICS))
    assert len({v for k, v in vars(RLMetric).items() if k.isupper()}) == sum(k.isupper() for k in vars(RLMetric))


def test_the_public_names_read_the_vocabulary():
    from r3lab import config, labels
    from r3lab.experiments import tasks

    assert config.RLMetric is RLMetric and config.TASKS is TASKS and labels.METRICS is METRICS
    assert list(tasks.TASKS) == list(TASKS)  # the registry builds exactly the named tasks, in their order
    task_field = next(f for f in dataclasses.fields(config.RLConfig) if f.name == "task")
    assert task_field.metadata["choices"] == tuple(TASKS) and task_field.default in TASKS
    for name, reward in TASKS.items():  # the --task help tells each task's reward
        assert f"{name} ({reward})" in task_field.metadata["help"]


# ---- the collapse rule: its words from its numbers, the detector on the same numbers -------------------------------
def test_the_collapse_prose_is_generated_from_the_rule_numbers():
    assert collapse_prose() == "reward below half its running peak for 5 steps after a 10-step warm-up"
    other = dataclasses.replace(COLLAPSE_RULE, warmup=3, patience=7, fraction=0.25)
    assert collapse_prose(other) == "reward below 25% of its running peak for 7 steps after a 3-step warm-up"
    assert collapse_prose(dataclasses.replace(COLLAPSE_RULE, patience=1, warmup=0)) == (
        "reward below half its running peak for 1 step with no warm-up")
    assert collapse_prose(LATE_COLLAPSE_RULE, subject="", threshold=False) == "for 10 steps after a 50-step warm-up"
    # every sentence built on it moves with the numbers (the labels table is built at import, from the rule)
    assert METRICS[RLMetric.COLLAPSED].label == f"collapsed ({collapse_prose(peak='its peak', warm_up=False)})"
    assert "for 7 steps" in collapse_prose(other, peak="its peak", warm_up=False)


def test_the_committed_tables_say_what_the_prose_generates():
    """The committed results (bench/results/) were written with these words: the generated prose is unchanged."""
    phase = (ROOT / "bench" / "results" / "phase.md").read_text(encoding="utf-8")
    horizon = (ROOT / "bench" / "results" / "horizon.md").read_text(encoding="utf-8")
    assert f"Collapse: {collapse_prose(subject='seeds whose reward fell')} (r3lab.metrics.reward_collapse)" in phase
    assert (f"Collapse: {collapse_prose()} (r3lab.metrics.reward_collapse); late collapse: "
            f"{collapse_prose(LATE_COLLAPSE_RULE, subject='', threshold=False)} (r3lab.metrics.late_collapse)"
            in " ".join(horizon.split()))


def _rewards(rule, below: int, *, start: int | None = None, length: int = 120) -> np.ndarray:
    """A reward series at 1.0 with ``below`` steps just under ``rule.fraction`` of it from ``start`` (default: the
    first step after the warm-up), then back at 1.0."""
    start = rule.warmup if start is None else start
    r = np.ones(length)
    r[start:start + below] = rule.fraction * 0.99
    return r


@pytest.mark.parametrize("detector, rule", [(metrics.reward_collapse, COLLAPSE_RULE),
                                            (metrics.late_collapse, LATE_COLLAPSE_RULE)])
def test_the_detectors_run_on_the_rule_numbers(detector, rule):
    hit = detector(_rewards(rule, rule.patience))
    assert (hit.step, hit.detected) == (rule.warmup, rule.warmup + rule.patience - 1)  # patience steps: collapse
    assert detector(_rewards(rule, rule.patience - 1)).step is None  # one step short: none
    assert detector(_rewards(rule, rule.patience, start=rule.warmup - 1)).step is None  # during the warm-up: none
    r = _rewards(rule, rule.patience)
    r[r == 1.0] = rule.min_peak * 0.99  # a peak below min_peak never collapses
    r[rule.warmup:rule.warmup + rule.patience] = 0.0
    assert detector(r).step is None


def test_the_summary_states_the_rule_it_ran():
    from r3lab.experiments.rl import report

    rule = COLLAPSE_RULE
    history = [{RLMetric.REWARD: float(x)} for x in _rewards(rule, rule.patience, length=30)]
    out = report.collapse_summary(history)
    assert out["collapse/parameters"] == rule.parameters() == {"warmup": 10, "patience": 5, "fraction": 0.5,
                                                               "min_peak": 0.05}
    assert out[RLMetric.COLLAPSE_STEP] == rule.warmup
    assert "below half its running peak" in out["collapse/definition"] == metrics.COLLAPSE_DEFINITION
    assert metrics.LATE_COLLAPSE == {"warmup": LATE_COLLAPSE_RULE.warmup, "patience": LATE_COLLAPSE_RULE.patience}


@pytest.mark.parametrize("bad", [{"warmup": -1}, {"patience": 0}, {"fraction": 1.0}, {"fraction": 0.0},
                                 {"min_peak": -0.1}])
def test_a_collapse_rule_with_bad_numbers_is_refused(bad):
    with pytest.raises(ConfigError, match="collapse rule needs"):
        dataclasses.replace(COLLAPSE_RULE, **bad)

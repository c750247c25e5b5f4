"""r3lab.errors is the list of every exception r3lab raises on purpose: each subclass of R3LabError anywhere in the
package is defined there and listed in its __all__; bad input is a ValueError, a failed process a RuntimeError, a
package of an extra that is not installed an ImportError; ConfigError carries the fields it names."""

from __future__ import annotations

import builtins
import importlib
import pickle
import pkgutil

import pytest

import r3lab
import r3lab.errors as errors
from r3lab.config import RLConfig
from r3lab.errors import ConfigError, R3LabError


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


def _outside_errors(classes: set[type]) -> list[str]:
    """The r3lab exception classes not defined in r3lab.errors or not listed in its __all__."""
    return sorted(f"{c.__module__}.{c.__qualname__}" for c in classes if c.__module__.startswith("r3lab")
                  and (c.__module__ != "r3lab.errors" or c.__name__ not in errors.__all__))


def _every_r3lab_exception() -> set[type]:
    for mod in pkgutil.walk_packages(r3lab.__path__, "r3lab."):
        if mod.name != "r3lab.__main__":
            importlib.import_module(mod.name)  # an import that fails is a failure here, never a skip
    return _subclasses(R3LabError)


def test_every_r3lab_exception_is_defined_and_listed_in_errors():
    found = _every_r3lab_exception()
    assert not _outside_errors(found), _outside_errors(found)
    listed = {getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert listed - {R3LabError} == {c for c in found if c.__module__ == "r3lab.errors"}  # and nothing listed twice
    assert {"BatchError", "ImportFormatError", "UnsafeFileError", "MegatronLoadError", "MegatronTrainerError",
            "LaunchTimeout", "MissingExtraError"} <= set(errors.__all__)


def test_the_check_catches_an_exception_defined_elsewhere():
    stray = type("StrayError", (R3LabError, ValueError), {"__module__": "r3lab.somewhere"})
    assert _outside_errors({stray}) == ["r3lab.somewhere.StrayError"]


#: what something r3lab ran raises when it fails (a process, an actor, a cluster, a deadline), whatever the input
FAILURES = {"R3LabFailure", "MegatronTrainerError", "LaunchTimeout", "StagingTimeoutError", "ClusterError",
            "ServerPortError"}
#: what r3lab raises when the environment lacks a package one of its extras installs: neither input nor a failure
MISSING = {"MissingExtraError"}


def test_bad_input_is_a_value_error_a_failure_a_runtime_error_a_missing_extra_an_import_error_never_two():
    every = _every_r3lab_exception()
    failures = {c.__name__ for c in every if issubclass(c, errors.R3LabFailure)}
    assert failures == FAILURES, failures
    assert {c.__name__ for c in every if issubclass(c, ImportError)} == MISSING
    for c in every:
        kinds = [issubclass(c, k) for k in (ValueError, RuntimeError, ImportError)]
        if c.__name__ in FAILURES:
            assert kinds == [False, True, False], c
        elif c.__name__ in MISSING:
            assert kinds == [False, False, True], c
        else:
            assert kinds == [True, False, False], c
    assert issubclass(errors.LaunchTimeout, TimeoutError)  # what a caller of launch() catches
    assert issubclass(errors.StagingTimeoutError, TimeoutError)  # what a staging backend's caller catches


def test_a_missing_extra_is_caught_as_an_import_error_never_as_bad_input():
    """``try: import ... except ImportError`` (the usual optional-dependency guard) catches it; a handler for bad
    input does not swallow it."""
    try:
        raise errors.MissingExtraError("r3lab figures", "plotly", "lab")
    except ValueError:  # pragma: no cover - the point: an input handler does not swallow a missing package
        pytest.fail("a missing extra was caught as bad input")
    except ImportError as e:
        assert isinstance(e, R3LabError) and e.name == "plotly"
        assert str(e) == "r3lab figures needs plotly, which is not installed: pip install 'r3lab[lab]'"


def test_a_caller_catches_bad_input_apart_from_a_failed_process():
    from r3lab.trainers.megatron import launch

    with pytest.raises(ValueError, match="world_size must be a positive int"):
        launch(print, 0)
    try:
        raise errors.MegatronTrainerError("rank 1 died")
    except ValueError:  # pragma: no cover - the point: input handlers do not swallow failures
        pytest.fail("a failed rank was caught as bad input")
    except RuntimeError as e:
        assert isinstance(e, errors.R3LabError)


def test_the_stage_modules_raise_the_types_of_r3lab_errors():
    """The modules that raise them hold r3lab.errors' own classes (exported from r3lab.errors alone: test_surface)."""
    from r3lab.importers.common import ImportFormatError, UnsafeFileError
    from r3lab.trainers.megatron.checkpoint import MegatronLoadError
    from r3lab.trainers.megatron.launch import LaunchTimeout
    from r3lab.trainers.megatron.trainer import MegatronTrainerError

    assert (ImportFormatError, UnsafeFileError, MegatronLoadError, LaunchTimeout, MegatronTrainerError) == (
        errors.ImportFormatError, errors.UnsafeFileError, errors.MegatronLoadError, errors.LaunchTimeout,
        errors.MegatronTrainerError)


def test_data_shape_errors_are_batch_errors_not_config_errors():
    from r3lab.trainers import PolicyUpdate, TokenBatch

    with pytest.raises(errors.BatchError, match="prompt length") as e:
        TokenBatch.from_ids([[1, 2]], [2])
    assert not isinstance(e.value, ConfigError)
    with pytest.raises(errors.BatchError, match="every token"):
        PolicyUpdate([0.0, 0.0], [1.0, 1.0], [0.0, 0.0], loss_mask=[False, False])


def test_a_config_error_carries_its_fields_and_each_caller_spells_them():
    with pytest.raises(ConfigError) as e:
        RLConfig(samples_per_prompt=1)
    err = e.value
    assert err.field == "samples_per_prompt" and err.fields == ("samples_per_prompt",)
    assert str(err).startswith("--samples-per-prompt must be >= 2")  # the CLI's words
    assert err.phrase(str).startswith("samples_per_prompt must be >= 2")  # a notebook's keywords
    assert err.phrase({"samples_per_prompt": "samples / prompt"}.get).startswith("samples / prompt must be >= 2")
    respelled = err.spelled(str)
    assert str(respelled).startswith("samples_per_prompt") and respelled.field == err.field
    assert str(pickle.loads(pickle.dumps(err))) == str(err)  # a child process's error keeps its message
    assert str(ConfigError("a {literal} brace, no fields")) == "a {literal} brace, no fields"


def test_errors_that_name_several_fields_spell_each():
    with pytest.raises(ConfigError) as e:
        RLConfig(trainer_dtype="float32", router_dtype="bfloat16")
    assert set(e.value.fields) == {"router_dtype", "trainer_dtype"}
    assert "--router-dtype bfloat16 needs --trainer-dtype bfloat16" in str(e.value)
    assert "router_dtype bfloat16 needs trainer_dtype bfloat16" in e.value.phrase(str)


#: the built-in exceptions r3lab still raises on purpose, by (module, function, type): each is the one a Python
#: protocol or a caller's own code expects, never a refusal of a user's input or a failure of what r3lab ran
KEPT_BUILTIN_RAISES = {
    # attribute protocols: a module's (or a stand-in module's) __getattr__ for a name it lacks, a frozen object's
    # __setattr__; hasattr(), getattr(x, name, default) and copy/pickle rely on AttributeError
    ("r3lab/__init__.py", "__getattr__", "AttributeError"),
    ("r3lab/cluster/__init__.py", "__getattr__", "AttributeError"),
    ("r3lab/viz/__init__.py", "__getattr__", "AttributeError"),
    ("r3lab/compaction/codecs/__init__.py", "deprecated_name", "AttributeError"),  # the codecs' module __getattr__
    ("r3lab/trainers/megatron/megatron_bridge_api.py", "_StandIn.__getattr__", "AttributeError"),
    ("r3lab/routes.py", "Routes.__setattr__", "AttributeError"),
    # lookups by key or index that miss, as a dict or a sequence misses (callers test with `in` or catch these)
    ("r3lab/doctor.py", "Report.check", "KeyError"),
    ("r3lab/importers/layouts.py", "LayoutsSeen.add", "KeyError"),
    ("r3lab/routes.py", "Routes.sequence", "IndexError"),
    ("r3lab/routes.py", "Routes.take", "IndexError"),
    # programming errors of r3lab's own code (a field type, a mutable default, an extra's table, an abstract method,
    # a loop's unreachable end), never of a user's input
    ("r3lab/config.py", "knob", "TypeError"),
    ("r3lab/config.py", "_scalar_type", "TypeError"),
    ("r3lab/_extras.py", "_top", "ValueError"),
    ("r3lab/_process.py", "Closing.close", "NotImplementedError"),
    ("r3lab/viz/exporting.py", "_render", "AssertionError"),
    # the CPU twin of megatron-core's CudaRNGStatesTracker raises what the original raises (Megatron's callers)
    ("r3lab/trainers/megatron/cpu.py", "patch_megatron_for_cpu.add", "Exception"),
    ("r3lab/trainers/megatron/cpu.py", "patch_megatron_for_cpu.fork", "Exception"),
}

_BUILTIN_EXCEPTIONS = {name for name, v in vars(builtins).items()
                       if isinstance(v, type) and issubclass(v, BaseException)}


def _builtin_raises(source: str, path: str) -> set[tuple[str, str, str]]:
    """(path, enclosing qualified name, type) of each ``raise`` of a built-in exception class in ``source``."""
    import ast

    found = set()

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, (*scope, child.name))
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                target = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(target, ast.Name) and target.id in _BUILTIN_EXCEPTIONS:
                    found.add((path, ".".join(scope), target.id))
            visit(child, scope)

    visit(ast.parse(source), ())
    return found


def test_r3lab_raises_its_own_types_outside_the_kept_builtins():
    """Every deliberate error is an R3LabError; r3lab.testing (helpers of tests and benchmarks) is exempt."""
    from pathlib import Path

    root = Path(r3lab.__file__).parent
    found = set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if not rel.startswith("r3lab/testing/"):
            found |= _builtin_raises(path.read_text(), rel)
    assert not found - KEPT_BUILTIN_RAISES, sorted(found - KEPT_BUILTIN_RAISES)
    assert not KEPT_BUILTIN_RAISES - found, f"kept but gone: drop from the list {sorted(KEPT_BUILTIN_RAISES - found)}"


def test_the_builtin_raise_check_catches_one():
    src = ("class A:\n    def f(self):\n        raise ValueError('x')\n"
           "def g():\n    raise errors.ConfigError('y')\n"
           "def h():\n    raise TimeoutError\n"
           "def k():\n    try:\n        pass\n    except OSError:\n        raise\n")
    assert _builtin_raises(src, "m.py") == {("m.py", "A.f", "ValueError"), ("m.py", "h", "TimeoutError")}


def test_the_deadlines_are_failures_a_timeout_handler_still_catches():
    from r3lab.staging import LocalBackend

    with pytest.raises(TimeoutError, match="not put within 0.0 s") as e:  # what a TimeoutError handler catches
        LocalBackend().get("absent", 0.0)
    assert isinstance(e.value, errors.StagingTimeoutError) and isinstance(e.value, errors.R3LabFailure)
    assert issubclass(errors.StagingTimeoutError, TimeoutError) and not issubclass(errors.StagingTimeoutError,
                                                                                     ValueError)


def test_a_figures_and_a_workloads_bad_input_are_r3lab_value_errors():
    from r3lab.viz.ticks import tick_values
    from r3lab.workloads import fixed_length_routes

    with pytest.raises(errors.FigureError, match=r"a log axis needs positive values, got the range \[0.0, 10.0\]"):
        tick_values(0, 10, log=True)
    with pytest.raises(errors.RouteFormatError, match="at most 256 experts, got 300"):
        fixed_length_routes(1, 4, num_layers=1, top_k=2, num_experts=300)
    assert issubclass(errors.FigureError, ValueError) and issubclass(errors.RouteFormatError, ValueError)


def _bare_base_raises(source: str) -> int:
    """How many ``raise R3LabError(...)`` (the root class itself, neither bad input nor a failure) ``source`` has."""
    import ast

    return sum(1 for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Raise)
               and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name | ast.Attribute)
               and (getattr(node.exc.func, "id", None) or getattr(node.exc.func, "attr", None)) == "R3LabError")


def test_no_error_is_raised_as_the_bare_root_class():
    """A caller catches ``ValueError`` for bad input and ``R3LabFailure`` for a failed process: an error raised as
    ``R3LabError`` itself is neither, so none is (r3lab.testing, the tests' helpers, exempt); the check counts one."""
    from pathlib import Path

    assert _bare_base_raises("def f():\n    raise R3LabError('x')\ndef g():\n    raise errors.R3LabError('y')\n") == 2
    root = Path(r3lab.__file__).parent
    bare = {path.relative_to(root.parent).as_posix(): n for path in sorted(root.rglob("*.py"))
            if not path.relative_to(root).as_posix().startswith("testing/")
            and (n := _bare_base_raises(path.read_text()))}
    assert not bare, bare

"""r3lab.errors is the list of every exception r3lab raises on purpose: each subclass of R3LabError anywhere in the
package is defined there and listed in its __all__; bad input is a ValueError, a failed process a RuntimeError, a
package of an extra that is not installed an ImportError; ConfigError carries the fields it names."""

from __future__ import annotations

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
FAILURES = {"R3LabFailure", "MegatronTrainerError", "LaunchTimeout", "ClusterError"}
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

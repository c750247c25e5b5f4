"""mbridge's private API, the one place r3lab reaches into it: its model registry and five weight-mapping methods.

mbridge 0.15.1 (``pip install --no-deps mbridge==0.15.1``; ``mbridge/core/bridge.py``) maps Megatron-core parameter
names and formats to Hugging Face ones in private methods of its ``Bridge`` (its public ``load_weights`` /
``export_weights`` assume CUDA and Transformer Engine), and keeps the families in the private ``_MODEL_REGISTRY``.
Each reach is one named function here; :func:`check_mbridge_api` compares the library's names and signatures with
:data:`EXPECTED` and raises :class:`MbridgeAPIError` naming what changed, so an mbridge upgrade fails loudly at load
time (and in ``tests/test_megatron_load.py``), never as a wrong tensor.
"""

from __future__ import annotations

import inspect
from typing import Any

from r3lab.errors import MbridgeAPIError

__all__ = ["EXPECTED", "check_mbridge_api", "mbridge_registry", "bridge_class", "hf_names",
           "to_megatron_format", "split_across_tp", "merge_across_tp", "to_hf_format"]

PINNED = "mbridge==0.15.1"

#: Bridge method -> its parameters after ``self``, as mbridge 0.15.1 defines them.
EXPECTED: dict[str, tuple[str, ...]] = {
    "_weight_name_mapping_mcore_to_hf": ("mcore_weights_name",),
    "_weight_to_mcore_format": ("mcore_weights_name", "hf_weights"),
    "_weight_split_across_tp": ("mcore_weights_name", "mcore_weights", "param", "tp_split_size"),
    "_weight_merge_across_tp": ("mcore_weights_name", "mcore_weights", "param"),
    "_weight_to_hf_format": ("mcore_weights_name", "mcore_weights"),
}


def mbridge_registry() -> dict[str, Any]:
    """mbridge's ``model_type`` -> Bridge class table (``mbridge.core.bridge._MODEL_REGISTRY``), families registered."""
    try:
        import mbridge.models  # noqa: F401  (registers the families)
        from mbridge.core import bridge as mb
    except ImportError as e:
        raise MbridgeAPIError(f"loading a checkpoint into Megatron needs mbridge: pip install --no-deps "
                              f"{PINNED}") from e
    registry = getattr(mb, "_MODEL_REGISTRY", None)
    if not isinstance(registry, dict):
        raise MbridgeAPIError(f"mbridge.core.bridge._MODEL_REGISTRY is gone or not a dict ({type(registry).__name__}): "
                              f"r3lab needs {PINNED}")
    return registry


def check_mbridge_api(cls: Any) -> None:
    """Raise :class:`MbridgeAPIError` unless Bridge class ``cls`` has every method of :data:`EXPECTED` with its
    parameters (names in order)."""
    problems = []
    for name, params in EXPECTED.items():
        fn = getattr(cls, name, None)
        if not callable(fn):
            problems.append(f"{name} is missing")
            continue
        got = tuple(p for p in inspect.signature(fn).parameters if p != "self")
        if got != params:
            problems.append(f"{name}{got} (expected {params})")
    if problems:
        raise MbridgeAPIError(f"mbridge's Bridge ({cls.__module__}.{cls.__qualname__}) changed: "
                              f"{'; '.join(problems)}; r3lab needs {PINNED}")


def bridge_class(model_type: str) -> Any | None:
    """The Bridge class mbridge registers for ``model_type`` (None if it has none), its private API checked."""
    cls = mbridge_registry().get(model_type)
    if cls is not None:
        check_mbridge_api(cls)
    return cls


def hf_names(bridge: Any, te_name: str) -> list[str]:
    """The checkpoint names of Megatron (TE-spec, global) parameter ``te_name``."""
    return bridge._weight_name_mapping_mcore_to_hf(te_name)


def to_megatron_format(bridge: Any, te_name: str, hf_tensors: list[Any]) -> Any:
    """The checkpoint tensors of ``te_name`` as one full (unsharded) Megatron tensor (q/k/v, gate/up fused)."""
    return bridge._weight_to_mcore_format(te_name, hf_tensors)


def split_across_tp(bridge: Any, te_name: str, full: Any, param: Any, size: int) -> list[Any]:
    """The ``size`` tensor-parallel shards of ``full`` for parameter ``param``, by mbridge's split rule."""
    return list(bridge._weight_split_across_tp(te_name, full, param, size))


def merge_across_tp(bridge: Any, te_name: str, parts: list[Any], param: Any) -> Any:
    """The tensor-parallel shards ``parts`` merged back into the full tensor, by mbridge's merge rule."""
    return bridge._weight_merge_across_tp(te_name, parts, param)


def to_hf_format(bridge: Any, te_name: str, full: Any) -> tuple[list[str], list[Any]]:
    """The full Megatron tensor of ``te_name`` as checkpoint names and tensors (fusions undone)."""
    return bridge._weight_to_hf_format(te_name, full)

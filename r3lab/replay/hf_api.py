"""transformers' router internals that changed between releases: the one place :mod:`r3lab.replay.hf` reads them.

r3lab's router replay hooks each MoE router of a transformers model. Two layouts exist among the releases it was
checked against (:data:`CHECKED`):

* **fused** (every family at 5.25.0; all but two at 5.12.1): the router module computes logits, top-k ids and gate
  weights and returns ``(router_logits, topk_weights, topk_indices)``; a forward hook on it replays.
* **split** (``Glm4MoeTopkRouter`` and ``DeepseekV3TopkRouter`` at 5.12.1, ``modeling_glm4_moe.py`` /
  ``modeling_deepseek_v3.py``): the router returns the fp32 logits only and its MoE block selects, in the method
  ``route_tokens_to_experts(router_logits) -> (topk_indices, topk_weights)``; the replay wraps that method on the
  block instance (:class:`MethodHook`, removed like a hook handle). These routers also lack attributes the fused
  ones carry (``DeepseekV3TopkRouter`` has no ``top_k``, ``norm_topk_prob`` or ``routed_scaling_factor``, neither
  has ``num_experts``): :func:`router_setting` reads them from the router, else from its ``config``.

:func:`check_transformers_version` refuses a transformers outside :data:`SUPPORTED` (``ReplayError`` naming the
installed version and the checked ones); :func:`router_layout` tells the layout of one router from its module
structure and, at a checked release, compares it with :data:`CHECKED`, so a release that moves a router's selection
fails loudly here (and in ``tests/test_replay.py``), never as a replay that silently does nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib import metadata
from typing import Any

from r3lab.families import FAMILIES
from r3lab.replay.common import ReplayError, in_release_range

__all__ = ["CHECKED", "CHECKED_RELEASES", "SUPPORTED", "SPLIT_METHOD", "check_transformers_version",
           "transformers_version", "router_layout", "router_setting", "MethodHook"]

#: the transformers releases whose modeling files were read
CHECKED_RELEASES = ("5.12.1", "5.25.0")

#: the releases read: router class -> "fused" or "split", for every router class r3lab.families names (each family
#: says at which releases its routers are split: ``router_split_releases``; see the docstring)
CHECKED: dict[str, dict[str, str]] = {
    release: {cls: "split" if release in fam.router_split_releases else "fused"
              for fam in FAMILIES.values() for cls in fam.router_classes}
    for release in CHECKED_RELEASES
}

#: the transformers releases replay accepts: from the oldest checked one to the newest checked minor (inclusive)
SUPPORTED = ((5, 12, 1), (5, 25))

#: the MoE block's selection method in the split layout
SPLIT_METHOD = "route_tokens_to_experts"

#: a router setting -> the config keys that hold it when the router module does not (first present wins)
_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "top_k": ("num_experts_per_tok",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "norm_topk_prob": ("norm_topk_prob",),
    "routed_scaling_factor": ("routed_scaling_factor",),
}
_ROUTER_ATTRS: dict[str, tuple[str, ...]] = {"num_experts": ("num_experts", "n_routed_experts")}


def transformers_version() -> str:
    """The installed transformers' version (from its distribution metadata; transformers is not imported)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError as e:
        raise ReplayError("transformers router replay needs transformers (the cpu extra)") from e


@functools.cache
def check_transformers_version(version: str | None = None) -> str:
    """Return the installed (or given) transformers version; raise :class:`ReplayError` outside :data:`SUPPORTED`."""
    v = transformers_version() if version is None else version
    lo, hi = SUPPORTED
    if not in_release_range(v, lo, hi):
        raise ReplayError(
            f"transformers {v}: r3lab's router replay was checked against {', '.join(CHECKED)} and accepts "
            f"{'.'.join(map(str, lo))} to {'.'.join(map(str, hi))}.x; its routers' outputs and attributes change "
            "between releases (r3lab.replay.hf_api), so install a release in that range"
        )
    return v


def router_layout(router: Any, block: Any, *, version: str | None = None) -> str:
    """``"fused"`` or ``"split"`` for ``router`` inside MoE ``block`` (its parent module), told from the modules.

    Split: ``block`` has the selection method :data:`SPLIT_METHOD` and holds ``router`` as its ``gate``. At a
    release in :data:`CHECKED` the answer must be the table's, else :class:`ReplayError` names the difference.
    """
    v = check_transformers_version(version)
    split = callable(getattr(type(block), SPLIT_METHOD, None)) and getattr(block, "gate", None) is router
    got = "split" if split else "fused"
    want = CHECKED.get(v, {}).get(type(router).__name__)
    if want is not None and want != got:
        raise ReplayError(f"transformers {v}: {type(router).__name__} is {got} here (its MoE block "
                          f"{type(block).__name__}), r3lab read it as {want} in that release")
    return got


def router_setting(router: Any, name: str) -> Any:
    """One routing setting of ``router`` (``top_k``, ``num_experts``, ``norm_topk_prob``, ``routed_scaling_factor``):
    the router's attribute where it has one, else its ``config``'s (split routers at 5.12.1 keep only a config)."""
    for attr in _ROUTER_ATTRS.get(name, (name,)):
        if hasattr(router, attr):
            return getattr(router, attr)
    cfg = getattr(router, "config", None)
    for key in _CONFIG_KEYS[name]:
        if cfg is not None and getattr(cfg, key, None) is not None:
            return getattr(cfg, key)
    raise ReplayError(f"{type(router).__name__} has no {name!r} and no config key {list(_CONFIG_KEYS[name])} "
                      f"(transformers {transformers_version()}): r3lab.replay.hf_api needs updating for it")


_MISSING = object()


class MethodHook:
    """A wrapper of ``block.route_tokens_to_experts`` on the instance, removed like a hook handle.

    ``hook(router, (router_logits,), (router_logits, topk_weights, topk_indices))`` sees what a forward hook on a
    fused router sees and may return a replacement triple (None: keep). :meth:`remove` restores what the instance
    had before (nested wrappers come off in reverse order).
    """

    def __init__(self, block: Any, router: Any, hook: Callable[..., Any]):
        self.block = block
        self._prev = block.__dict__.get(SPLIT_METHOD, _MISSING)
        original = getattr(block, SPLIT_METHOD)

        def route_tokens_to_experts(router_logits: Any, *args: Any, **kwargs: Any) -> Any:
            indices, weights = original(router_logits, *args, **kwargs)
            out = hook(router, (router_logits,), (router_logits, weights, indices))
            if out is None:
                return indices, weights
            _, weights, indices = out
            return indices, weights

        route_tokens_to_experts._r3lab_replay = True  # type: ignore[attr-defined]
        # wrappers nest (a context inside a context): each counts itself and those it wraps (count_replay_hooks)
        depth = getattr(self._prev, "_r3lab_depth", 0)
        route_tokens_to_experts._r3lab_depth = depth + 1  # type: ignore[attr-defined]
        setattr(block, SPLIT_METHOD, route_tokens_to_experts)
        self._installed = route_tokens_to_experts

    def remove(self) -> None:
        """Take the wrapper off (idempotent)."""
        if self.block.__dict__.get(SPLIT_METHOD) is not self._installed:
            return
        if self._prev is _MISSING:
            delattr(self.block, SPLIT_METHOD)
        else:
            setattr(self.block, SPLIT_METHOD, self._prev)

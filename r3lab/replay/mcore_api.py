"""megatron-core's internals that r3lab reaches and that change between releases: one place, checked per release.

r3lab drives ``RouterReplay`` router by router, finds routers by where they sit, slices context-parallel batches as
Megatron does and patches a few CUDA assumptions for CPU ranks. The names and behaviours it relies on were read in
the releases of :data:`CHECKED`; between 0.16.1 and 0.19.2 these changed:

* the MTP layer's inner transformer layer: ``MultiTokenPredictionLayer.transformer_layer`` at 0.16.1,
  ``.mtp_model_layer`` at 0.19.2 (``multi_token_prediction.py``, ``MultiTokenPredictionLayer.__init__``):
  :func:`mtp_inner_layer`;
* the MTP router's ``layer_number``: ``num_layers + k`` for MTP depth ``k`` (1-based) at 0.16.1 (the inner layer
  adds the decoder's layer count), ``k`` at 0.19.2 (the inner layer keeps the MTP layer's own number, so an MTP
  router shares its number with decoder layer ``k - 1``): :data:`MTP_ROUTER_NUMBERING`. r3lab never feeds a router
  by its number (:func:`r3lab.replay.megatron.megatron_router_map` finds MTP routers inside the MTP block);
* ``megatron.core.utils.get_batch_on_this_cp_rank`` gained a required ``is_hybrid_cp`` (0.19.2), and without a
  ``cp_group`` it now splits over the default group instead of the context-parallel one: :func:`cp_rank_batch`;
* a routing type that never consults ``RouterReplay`` joined sinkhorn: ``quantile_balancing`` (0.19.2,
  ``TopKRouter.routing`` selects with ``qb_dual_update`` and hands the ids on as ``precomputed_indices``). Both are
  in :data:`REPLAY_BYPASSING_ROUTING`, the one list replay refuses (:func:`replay_bypass`).

:func:`check_mcore_api` refuses a megatron-core outside :data:`SUPPORTED` and checks every name and parameter list
below against the installed release, raising :class:`~r3lab.errors.MegatronCoreAPIError` that names what changed;
``tests/test_replay.py`` runs it and also reads ``TopKRouter.routing`` for routing types that bypass replay, so a
release that adds one fails there, never as a replay that silently does nothing.
"""

from __future__ import annotations

import functools
import inspect
from importlib import metadata
from typing import Any

from r3lab.errors import MegatronCoreAPIError
from r3lab.replay.common import in_release_range

__all__ = ["CHECKED", "SUPPORTED", "REPLAY_BYPASSING_ROUTING", "MTP_INNER_LAYER", "MTP_ROUTER_NUMBERING",
           "mcore_version", "check_mcore_version", "check_mcore_api", "mtp_inner_layer", "replay_bypass",
           "cp_rank_batch"]

#: the megatron-core releases r3lab was read against
CHECKED = ("0.16.1", "0.19.2")

#: the megatron-core releases r3lab accepts: the oldest checked one to the newest checked minor (inclusive)
SUPPORTED = ((0, 16, 1), (0, 19))

#: ``TopKRouter.routing_type`` values whose routing never calls ``RouterReplay`` (replay would be ignored)
REPLAY_BYPASSING_ROUTING = ("sinkhorn", "quantile_balancing")

#: release -> the attribute of ``MultiTokenPredictionLayer`` holding its inner ``TransformerLayer``
MTP_INNER_LAYER = {"0.16.1": "transformer_layer", "0.19.2": "mtp_model_layer"}

#: release -> how the router of MTP depth ``k`` (1-based) is numbered: "after_decoder" (``num_layers + k``) or
#: "from_one" (``k``)
MTP_ROUTER_NUMBERING = {"0.16.1": "after_decoder", "0.19.2": "from_one"}

#: ``RouterReplay`` methods r3lab calls per instance -> their parameters after ``self`` (the same in both releases)
ROUTER_REPLAY_METHODS: dict[str, tuple[str, ...]] = {
    "set_target_indices": ("topk_indices",),
    "get_recorded_indices": (),
    "clear_indices": (),
    "set_router_replay_action": ("router_replay_action",),
    "clear_router_replay_action": (),
}

#: ``RouterReplay`` instance attributes r3lab reads (the REPLAY_BACKWARD queue included, which it pops)
ROUTER_REPLAY_ATTRS = ("target_topk_idx", "replay_backward_list", "router_replay_action", "recorded_topk_idx")

#: release -> ``get_batch_on_this_cp_rank``'s parameters
CP_BATCH_PARAMS = {"0.16.1": ("batch", "cp_group"),
                   "0.19.2": ("batch", "is_hybrid_cp", "cp_group", "hybrid_cp_group_func",
                              "use_per_sequence_balancing")}

#: what :mod:`r3lab.trainers.megatron.cpu` replaces in ``megatron.core.tensor_parallel.random`` on a CPU rank
CPU_PATCH_NAMES = ("CudaRNGStatesTracker", "_get_cuda_rng_state", "_set_cuda_rng_state",
                   "_MODEL_PARALLEL_RNG_TRACKER_NAME")


def mcore_version() -> str:
    """The installed megatron-core's version (distribution metadata; megatron-core is not imported)."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError as e:
        raise MegatronCoreAPIError("the Megatron backend needs megatron-core (RouterReplay): pip install "
                                   f"megatron-core=={CHECKED[-1]}") from e


def check_mcore_version(version: str | None = None) -> str:
    """The installed (or given) megatron-core version; :class:`MegatronCoreAPIError` outside :data:`SUPPORTED`."""
    v = mcore_version() if version is None else version
    lo, hi = SUPPORTED
    if not in_release_range(v, lo, hi):
        raise MegatronCoreAPIError(
            f"megatron-core {v}: r3lab was checked against {', '.join(CHECKED)} and accepts "
            f"{'.'.join(map(str, lo))} to {'.'.join(map(str, hi))}.x (r3lab.replay.mcore_api lists what changed "
            "between releases); install one of those"
        )
    return v


def _params(fn: Any) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


@functools.cache
def check_mcore_api() -> str:
    """Check the installed megatron-core against what r3lab reaches (once per process); return its version.

    Raises :class:`MegatronCoreAPIError` outside :data:`SUPPORTED`, or naming each method, attribute or parameter
    list that differs from what r3lab reads (:data:`ROUTER_REPLAY_METHODS`, :data:`ROUTER_REPLAY_ATTRS`,
    :data:`CP_BATCH_PARAMS` at a checked release, :data:`CPU_PATCH_NAMES`).
    """
    v = check_mcore_version()
    from megatron.core import utils as mutils
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe.router_replay import RouterReplay

    problems = []
    for name, params in ROUTER_REPLAY_METHODS.items():
        fn = getattr(RouterReplay, name, None)
        if not callable(fn):
            problems.append(f"RouterReplay.{name} is missing")
        elif _params(fn) != params:
            problems.append(f"RouterReplay.{name}{_params(fn)} (r3lab calls it with {params})")
    probe = RouterReplay.__new__(RouterReplay)  # read the attributes __init__ sets, without registering an instance
    try:
        type(probe).__init__(probe)
    finally:
        regs = RouterReplay.global_router_replay_instances
        regs[:] = [rr for rr in regs if rr is not probe]
    problems += [f"RouterReplay instances have no {a!r}" for a in ROUTER_REPLAY_ATTRS if not hasattr(probe, a)]
    want_cp = CP_BATCH_PARAMS.get(v)
    got_cp = _params(mutils.get_batch_on_this_cp_rank)
    if want_cp is not None and got_cp != want_cp:
        problems.append(f"get_batch_on_this_cp_rank{got_cp} (expected {want_cp})")
    problems += [f"megatron.core.tensor_parallel.random.{n} is missing" for n in CPU_PATCH_NAMES
                 if not hasattr(tp_random, n)]
    if problems:
        raise MegatronCoreAPIError(f"megatron-core {v} changed what r3lab relies on: {'; '.join(problems)}")
    return v


def mtp_inner_layer(mtp_layer: Any) -> Any:
    """The ``TransformerLayer`` inside a ``MultiTokenPredictionLayer`` (the one whose ``mlp`` holds the MTP router).

    At a checked release the attribute named in :data:`MTP_INNER_LAYER`; at another supported one whichever of those
    names the layer has. :class:`MegatronCoreAPIError` when it has none of them.
    """
    v = mcore_version()
    names = [MTP_INNER_LAYER[v]] if v in MTP_INNER_LAYER else list(dict.fromkeys(MTP_INNER_LAYER.values()))
    for name in names:
        inner = getattr(mtp_layer, name, None)
        if inner is not None:
            return inner
    raise MegatronCoreAPIError(f"megatron-core {v}: {type(mtp_layer).__name__} has no inner layer under "
                               f"{' or '.join(names)} (r3lab.replay.mcore_api.MTP_INNER_LAYER)")


def replay_bypass(router: Any) -> str | None:
    """Why ``router`` (a ``TopKRouter``) would ignore ``RouterReplay``, or None: the fused top-k
    (``moe_router_fusion``) or a routing type of :data:`REPLAY_BYPASSING_ROUTING`."""
    if router.config.moe_router_fusion:
        return "moe_router_fusion=True uses the fused top-k, which ignores RouterReplay"
    kind = router.routing_type
    if isinstance(kind, str) and kind in REPLAY_BYPASSING_ROUTING:
        return (f"{kind} routing (moe_router_load_balancing_type) selects experts without RouterReplay; replay "
                "would be silently ignored")
    return None


def cp_rank_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """Megatron's own context-parallel split of ``batch`` (``{name: [B, S, ...]}``) for this rank's CP group.

    ``megatron.core.utils.get_batch_on_this_cp_rank`` (per-sequence zigzag), called the way the installed release
    wants it: at 0.19.2 with ``is_hybrid_cp=False``, no ``cu_seqlens`` and the CP group named (its default is the
    whole world), at 0.16.1 with the batch alone.
    """
    check_mcore_api()
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    params = _params(get_batch_on_this_cp_rank)
    if "is_hybrid_cp" in params:
        out = get_batch_on_this_cp_rank({**batch, "cu_seqlens": None}, is_hybrid_cp=False,
                                        cp_group=ps.get_context_parallel_group())
        out.pop("cu_seqlens", None)
        return out
    return get_batch_on_this_cp_rank(dict(batch), cp_group=ps.get_context_parallel_group())

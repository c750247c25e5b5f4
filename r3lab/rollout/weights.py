"""Capture the engine's top-k routing weights beside its expert ids (in-process vLLM only).

vLLM returns the routed expert ids and nothing else: neither its offline ``LLM`` outputs nor its OpenAI server
carry the routing weights (vllm 0.30: ``RoutedExpertsCapturer.capture(layer_id, topk_ids)`` receives only the ids;
``CompletionOutput.routed_experts`` and the server's ``routed_experts`` field hold only them). So the HTTP path
(:mod:`r3lab.rollout.server`) cannot give weights, and this module reads them inside the process that runs the
model, at the one call site where vLLM has them.

Where the weights are (vllm 0.30.0, ``model_executor/layers/fused_moe/router/base_router.py``,
``BaseRouter._select_experts``)::

    topk_weights, topk_ids = self._compute_routing(hidden_states, router_logits, ...)
    if self.capture_fn is not None:
        self.capture_fn(topk_ids)          # -> RoutedExpertsCapturer.capture(layer_id, topk_ids)

r3lab wraps, on each router instance of the running model (no vLLM file is edited): ``_compute_routing`` (keep
the weights of the call) and ``capture_fn`` (write them, at the rows ``capture`` writes the ids, into a step
buffer). A guard checks at install time that ``_select_experts`` still calls ``_compute_routing`` and then
``capture_fn(topk_ids)``, and at every call that ``capture_fn`` is handed the very tensor ``_compute_routing``
returned; anything else raises :class:`WeightCaptureError`. A monolithic MoE kernel (routing inside the kernel)
is refused.

The ids travel from the step buffer to a request by vLLM's slot-indexed buffer (``RoutedExpertsManager``, so
chunked prefill and prefix-cached blocks work); r3lab wraps ``Scheduler.update_from_output`` to mirror both ids
and weights into its own slot buffer, then, for every per-request ids chunk vLLM emits, reads the weights of the
same slots and checks that its own mirrored ids equal vLLM's chunk exactly (a misaligned weight is an error,
never a guess). Supported: one worker (no TP/PP/DP), in-process engine core, synchronous scheduling, no
speculative decoding; every other case raises.

The weights are float32 as the router computed them (vLLM's CPU router returns fp32 ``topk_weights``), the
factor each chosen expert's output is multiplied by, with ``routed_scaling_factor`` included: the trainer's
convention (transformers' GLM-4-MoE / DeepSeek gates return ``topk_weights * routed_scaling_factor``). vLLM either
scales inside the router or, where the layer was built with ``apply_routed_scale_to_output`` (GLM-4-MoE on CPU,
``models/glm4_moe.py``; the router then gets 1.0 and ``MoERunner.routed_scaling_factor`` scales the summed
expert output, ``fused_moe/layer.py`` ``FusedMoEFactory``), after the experts; in that case r3lab multiplies
the captured weights by the runner's factor (tests/test_r3w_engine.py checks both models against the transformers
gate on the same tokens).
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any

import numpy as np

from r3lab.errors import WeightCaptureError

__all__ = ["WeightCapture", "install_weight_capture", "check_vllm_call_site", "engine_request_id"]


def check_vllm_call_site() -> None:
    """Raise unless vLLM's ``BaseRouter._select_experts`` computes the routing and then hands ``capture_fn`` the ids.

    The one place r3lab depends on vLLM's router internals; a vLLM that moved it fails here, loudly.
    """
    try:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    except ImportError as e:
        raise WeightCaptureError(f"vLLM has no fused_moe.router.base_router.BaseRouter ({e}): "
                                 "r3lab's weight capture must follow its new place") from e
    src = inspect.getsource(BaseRouter._select_experts)
    a = src.find("topk_weights, topk_ids = self._compute_routing(")
    b = src.find("self.capture_fn(topk_ids)")
    if a < 0 or b < 0 or b < a:
        raise WeightCaptureError(
            "vLLM's BaseRouter._select_experts no longer computes `topk_weights, topk_ids = "
            "self._compute_routing(...)` "
            "and then calls `self.capture_fn(topk_ids)`: r3lab's routing-weight capture (r3lab.rollout.weights) "
            "must be re-checked against this vLLM")


class WeightCapture:
    """Worker- and scheduler-side state of one engine's weight capture (all in one process).

    ``pop(request_id)`` returns the ``[rows, num_hidden_layers, top_k]`` float32 weights of a finished request
    (dense layers zero, as vLLM's ids are), in vLLM's row order.
    """

    def __init__(self, max_tokens: int, num_layers: int, top_k: int, num_slots: int):
        import torch

        self.step_w = torch.zeros((max_tokens, num_layers, top_k), dtype=torch.float32)
        self.step_ids = torch.zeros((max_tokens, num_layers, top_k), dtype=torch.int32)  # dense layers: 0, as vLLM
        self.slot_w = np.zeros((num_slots, num_layers, top_k), dtype=np.float32)
        self.slot_ids = np.zeros((num_slots, num_layers, top_k), dtype=np.int32)
        self.layers: list[int] = []  # the MoE layers whose routers are wrapped
        self.chunks: dict[str, list[np.ndarray]] = defaultdict(list)
        self.id_chunks: dict[str, list[np.ndarray]] = defaultdict(list)
        self.num_layers = num_layers
        self.calls = 0

    # ---- worker side: inside the forward ----------------------------------------------------------
    def write(self, layer_id: int, ids: Any, weights: Any) -> None:
        from vllm.forward_context import get_forward_context

        if get_forward_context().dp_metadata is not None:
            raise WeightCaptureError("routing-weight capture supports one data-parallel rank only")
        n = int(ids.shape[0])
        if tuple(weights.shape) != tuple(ids.shape):
            raise WeightCaptureError(f"layer {layer_id}: topk_weights {tuple(weights.shape)} vs topk_ids "
                                     f"{tuple(ids.shape)}")
        if n > self.step_w.shape[0]:
            raise WeightCaptureError(f"layer {layer_id}: {n} tokens in one step exceed the buffer's "
                                     f"{self.step_w.shape[0]}")
        self.step_w[:n, layer_id] = weights.detach().to("cpu", dtype=self.step_w.dtype)
        self.step_ids[:n, layer_id] = ids.detach().to("cpu", dtype=self.step_ids.dtype)
        self.calls += 1

    # ---- scheduler side ---------------------------------------------------------------------------
    def store_step(self, routing_data: np.ndarray, slot_mapping: np.ndarray) -> None:
        n = len(slot_mapping)
        ids = self.step_ids[:n].numpy()
        moe = self.layers
        if not np.array_equal(ids[:, moe].astype(np.int64), np.asarray(routing_data)[:, moe].astype(np.int64)):
            raise WeightCaptureError("this step's ids seen by r3lab's router hook differ from vLLM's captured ids: "
                                     "the weights would be misaligned (a router path r3lab does not wrap?)")
        self.slot_w[slot_mapping] = self.step_w[:n].numpy()
        self.slot_ids[slot_mapping] = ids

    def add_chunk(self, request_id: str, slots: np.ndarray, ids_chunk: np.ndarray) -> None:
        moe = self.layers
        if not np.array_equal(self.slot_ids[slots][:, moe].astype(np.int64),
                              np.asarray(ids_chunk)[:, moe].astype(np.int64)):
            raise WeightCaptureError(f"request {request_id}: the ids r3lab mirrored for its slots differ from the "
                                     "chunk vLLM emitted; refusing to attach weights")
        self.chunks[request_id].append(self.slot_w[slots].copy())
        self.id_chunks[request_id].append(self.slot_ids[slots].copy())

    def pop(self, request_id: str, ids: Any) -> np.ndarray:
        """The weights of engine request ``request_id``, checked against the ids vLLM returned for it (``ids``)."""
        parts = self.chunks.pop(request_id, None)
        id_parts = self.id_chunks.pop(request_id, None)
        if not parts or not id_parts:
            raise WeightCaptureError(f"no routing weights were captured for engine request {request_id!r}")
        mine = np.concatenate(id_parts, axis=0).astype(np.int64)[:, self.layers]
        theirs = np.asarray(ids).astype(np.int64)
        if theirs.ndim != 3 or mine.shape != theirs[:, self.layers].shape or not np.array_equal(
                mine, theirs[:, self.layers]):
            raise WeightCaptureError(f"engine request {request_id!r}: the ids beside the captured weights differ from "
                                     "the routed experts vLLM returned")
        return np.concatenate(parts, axis=0)

    def request_ids(self) -> list[str]:
        return list(self.chunks)

    def clear(self) -> None:
        self.chunks.clear()
        self.id_chunks.clear()


def _wrap_routers(model: Any, cap: WeightCapture) -> int:
    """Wrap ``_compute_routing`` and ``capture_fn`` on every MoE router of the worker's model."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    n = 0
    for module in model.modules():
        if not isinstance(module, MoERunner):
            continue
        if getattr(module._quant_method, "is_monolithic", False):
            raise WeightCaptureError(f"layer {module.layer_id}: a monolithic MoE kernel routes inside the kernel; "
                                     "its routing weights never reach Python")
        router = module.router
        if not isinstance(router, BaseRouter):
            raise WeightCaptureError(f"layer {module.layer_id}: router {type(router).__name__} is not a BaseRouter")
        if router.capture_fn is None:
            raise WeightCaptureError(f"layer {module.layer_id}: vLLM bound no ids capture to this router "
                                     "(enable_return_routed_experts off?)")
        if getattr(router, "_r3lab_weights", False):
            raise WeightCaptureError(f"layer {module.layer_id}: weight capture is already installed")
        layer_id = int(module.layer_id)
        if not hasattr(module, "routed_scaling_factor"):
            raise WeightCaptureError(f"layer {layer_id}: vLLM's MoERunner has no routed_scaling_factor: whether the "
                                     "routing weights are scaled after the experts cannot be told (vLLM changed)")
        out_scale = float(module.routed_scaling_factor)  # 1.0 unless the runner scales the output (module doc)
        last: dict[str, Any] = {}
        compute, ids_fn = router._compute_routing, router.capture_fn

        def compute_routing(*args: Any, _c: Any = compute, _last: dict = last, **kwargs: Any) -> Any:
            w, ids = _c(*args, **kwargs)
            _last["w"], _last["ids"] = w, ids
            return w, ids

        def capture_fn(topk_ids: Any, _f: Any = ids_fn, _last: dict = last, _g: int = layer_id,
                       _scale: float = out_scale) -> None:
            _f(topk_ids)
            w, ids = _last.pop("w", None), _last.pop("ids", None)
            if ids is not topk_ids:
                raise WeightCaptureError(f"layer {_g}: capture_fn was not handed the ids _compute_routing returned "
                                         "(vLLM's BaseRouter._select_experts changed): weights cannot be matched")
            cap.write(_g, topk_ids, w if _scale == 1.0 or w is None else w * _scale)

        router._compute_routing = compute_routing
        router.capture_fn = capture_fn
        router._r3lab_weights = True
        cap.layers.append(layer_id)
        n += 1
    if n == 0:
        raise WeightCaptureError("no vLLM MoE router found to capture weights from")
    cap.layers.sort()
    return n


def _on_worker(worker: Any, cap_args: tuple[int, int, int, int]) -> WeightCapture:
    cap = WeightCapture(*cap_args)
    _wrap_routers(worker.model_runner.get_model(), cap)
    return cap


def install_weight_capture(llm: Any) -> WeightCapture:
    """Install routing-weight capture on a running in-process ``vllm.LLM`` (see the module docstring)."""
    check_vllm_call_site()
    try:
        core = llm.llm_engine.engine_core.engine_core
        sched = core.scheduler
        mgr = sched.routed_experts_mgr
        vcfg = llm.llm_engine.vllm_config
    except AttributeError as e:
        raise WeightCaptureError(f"routing-weight capture needs the in-process engine core (in_process=True) and "
                                 f"vLLM's routed-experts manager ({e})") from e
    par = vcfg.parallel_config
    if (par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size) != (1, 1, 1):
        raise WeightCaptureError("routing-weight capture supports one worker (TP = PP = DP = 1)")
    if getattr(vcfg.scheduler_config, "async_scheduling", False):
        raise WeightCaptureError("routing-weight capture needs synchronous scheduling (async_scheduling=False)")
    if vcfg.speculative_config is not None:
        raise WeightCaptureError("routing-weight capture does not support speculative decoding")
    slots, L, K = mgr.routed_experts_by_slot.shape
    max_tokens = int(vcfg.scheduler_config.max_num_batched_tokens)
    cap = llm.collective_rpc(_on_worker, args=((max_tokens, L, K, slots),))[0]
    if not isinstance(cap, WeightCapture):
        raise WeightCaptureError("the worker's weight capture did not come back in-process")
    _wrap_scheduler(sched, mgr, cap)
    return cap


def _wrap_scheduler(sched: Any, mgr: Any, cap: WeightCapture) -> None:
    update = sched.update_from_output
    bs = int(mgr.block_size)

    def update_from_output(scheduler_output: Any, model_runner_output: Any) -> Any:
        re = model_runner_output.routed_experts
        before: dict[str, tuple[int, list[int]]] = {}
        if re is not None:
            cap.store_step(re.routing_data, np.asarray(re.slot_mapping))
            for rid in model_runner_output.req_ids:
                req = sched.requests.get(rid)
                if req is None:
                    continue
                blocks = sched.kv_cache_manager.get_block_ids(rid)[mgr.attn_gid]
                before[rid] = (int(req.num_tokens), list(blocks))
        out = update(scheduler_output, model_runner_output)
        if re is None:
            return out
        for eco in out.values():
            for o in eco.outputs:
                if o.routed_experts is None:
                    continue
                rid = o.request_id
                if rid not in before:
                    raise WeightCaptureError(f"request {rid}: vLLM emitted routes for a request r3lab did not see "
                                             "scheduled")
                n_tok, blocks = before[rid]
                end = n_tok + len(o.new_token_ids) - 1  # rows forwarded: every token but the last sampled one
                pos = np.arange(end - len(o.routed_experts), end)
                blk = np.asarray(blocks, dtype=np.int64)
                if pos.size and pos.max() // bs >= blk.size:
                    raise WeightCaptureError(f"request {rid}: rows up to {int(pos.max())} lie beyond its "
                                             f"{blk.size} KV blocks")
                slots = blk[pos // bs] * bs + pos % bs
                cap.add_chunk(rid, slots, np.asarray(o.routed_experts))
        return out

    sched.update_from_output = update_from_output


def engine_request_id(output_request_id: str, index: int, n: int, known: list[str]) -> str:
    """The engine-core id of sample ``index`` of ``LLM.generate``'s output ``output_request_id``.

    vllm 0.30 sends ``"<id>-<random>"`` for one sample and ``"<index>_<id>-<random>"`` per sample for ``n > 1``
    (``v1/engine/parallel_sampling.py``); exactly one captured id must match.
    """
    base = f"{index}_{output_request_id}" if n > 1 else str(output_request_id)
    hits = [r for r in known if r.rsplit("-", 1)[0] == base]
    if len(hits) != 1:
        raise WeightCaptureError(f"sample {index} of request {output_request_id!r}: {len(hits)} captured engine "
                                 f"requests match {base!r}-* (have {known[:6]}...)")
    return hits[0]

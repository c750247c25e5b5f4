"""Attach to a vLLM OpenAI-compatible server that the user started: a handshake, then the same ``generate``.

For example::

    # on the GPU node: python -m vllm.entrypoints.openai.api_server --model PATH --enable-return-routed-experts
    from r3lab.rollout import connect
    with connect("http://gpu-node:8000", model="data/models/tiny-qwen3-moe") as eng:
        results = eng.generate([[5, 6, 7]], SamplingConfig(max_tokens=16, seed=0))

``model`` is the trainer's local copy of the weights (its ``config.json`` gives the MoE layout the routes
must match). The handshake before any work: ``/v1/models`` (the served name and max length), then one probe
completion that must return routes of the local layout (layers, top-k, id range) that are not constant (the
all-zero class of vLLM #33013 / #54730). The API key comes from ``$R3LAB_ENGINE_API_KEY`` (or ``api_key=``),
never from a command-line value that would land in a run's config. Requests have a timeout, connection
failures a bounded number of retries, and at most ``max_in_flight`` requests are open at once.
:class:`~r3lab.rollout.RolloutServer` is "launch, then this client".
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from r3lab._process import Closing
from r3lab.compaction import DEFAULT_MAX_BYTES, read_vllm_npy_base64, uncaptured_rows, vllm_turn_start
from r3lab.config import ATTACHED_RL_REASON
from r3lab.errors import AttachError, R3LabError
from r3lab.moe_layout import MoELayout
from r3lab.rollout._common import check_model_dir, check_prompts
from r3lab.rollout.types import RolloutError, RolloutResult, SamplingConfig, validate_engine_routes

__all__ = ["CompletionsClient"]

API_KEY_ENV = "R3LAB_ENGINE_API_KEY"
START_HINT = ("start it as: python -m vllm.entrypoints.openai.api_server --model {model} "
              "--enable-return-routed-experts")


class CompletionsClient(Closing):
    """``/v1/completions`` with routes, for any vLLM server at ``self.url`` serving ``self.served_name``."""

    url: str
    served_name: str
    model_dir: Path
    layout: MoELayout
    max_model_len: int
    max_routes_bytes: int = DEFAULT_MAX_BYTES
    api_key: str | None = None
    timeout_s: float = 600.0
    retries: int = 0
    _slots: threading.BoundedSemaphore | None = None
    # what the Engine protocol asks (r3lab.rollout.base): a server samples with the weights it started with, exact
    # (r3lab simulates no quantization on it), and its HTTP API returns expert ids only, never routing weights
    engine_quant: str = "none"
    captures_weights: bool = False
    weight_version: int = 0

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        h.update(extra or {})
        return h

    def _http(self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None,
              headers: dict[str, str] | None = None) -> dict[str, Any]:
        """GET (body None) or POST JSON; connection failures retried ``retries`` times, then an error naming it."""
        data = None if body is None else json.dumps(body).encode()
        timeout = self.timeout_s if timeout is None else timeout
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url + path, data=data, headers=self._headers(headers))
            try:
                if self._slots is not None:
                    self._slots.acquire()
                try:
                    with urllib.request.urlopen(req, timeout=timeout) as r:
                        raw = r.read(4 * self.max_routes_bytes + (1 << 20))
                finally:
                    if self._slots is not None:
                        self._slots.release()
            except urllib.error.HTTPError as e:
                detail = e.read(4000).decode(errors="replace")
                if e.code in (401, 403):
                    raise AttachError(f"{self.url}{path}: HTTP {e.code} (set ${API_KEY_ENV} to the server's "
                                      f"--api-key): {detail}") from e
                raise RolloutError(f"server {self.url} answered HTTP {e.code} on {path}: {detail}") from e
            except (urllib.error.URLError, OSError) as e:
                last = e
                if attempt < self.retries:
                    time.sleep(min(2.0 ** attempt, 10.0))
                    continue
                raise AttachError(f"server {self.url} is unreachable or went away ({path}, "
                                  f"{self.retries + 1} attempts, timeout {timeout:.0f} s): {e}") from e
            try:
                out = json.loads(raw)
            except ValueError as e:
                raise RolloutError(f"server {self.url}: {path} response is not JSON ({len(raw)} bytes): {e}") from e
            if not isinstance(out, dict):
                raise RolloutError(f"server {self.url}: {path} response is {type(out).__name__}, not an object")
            return out
        raise AttachError(f"server {self.url} unreachable: {last}")  # pragma: no cover - loop always returns/raises

    def request(self, body: dict[str, Any], timeout: float | None = None,
                headers: dict[str, str] | None = None) -> dict[str, Any]:
        """POST ``body`` to ``/v1/completions`` and return the parsed JSON (HTTP errors raise RolloutError)."""
        if headers is None:
            return self._http("/v1/completions", body, timeout)
        return self._http("/v1/completions", body, timeout, headers=headers)

    def encode_prompts(self, prompts: Sequence[str | Sequence[int]], max_tokens: int = 1) -> list[list[int]]:
        """Token ids of each prompt, checked (strings only where a local tokenizer is known)."""
        return check_prompts(prompts, max_tokens=max_tokens, max_model_len=self.max_model_len,
                             tokenize=self._tokenize())

    @property
    def tokenizer(self) -> Any:
        """The local checkpoint's tokenizer (the trainer's copy; None if it ships none), loaded on first use."""
        tok = self.__dict__.get("_tokenizer")
        if tok is None:
            if not (self.model_dir / "tokenizer.json").is_file() and not (self.model_dir / "tokenizer_config.json"
                                                                          ).is_file():
                return None
            from transformers import AutoTokenizer

            tok = self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        return tok

    def _tokenize(self) -> Any:
        """Text prompts are encoded with the local checkpoint's tokenizer (no special tokens, as the engines do)."""
        tok = self.tokenizer
        return None if tok is None else (lambda text: tok.encode(text, add_special_tokens=False))

    def generate(self, prompts: Sequence[str | Sequence[int]], sampling: SamplingConfig | None = None, *,
                 routes_prompt_start: int = 0, omit_prefix: bool = False,
                 session_id: str | None = None) -> list[RolloutResult]:
        """Prompts in one completions request; results in prompt order, then sample order.

        ``omit_prefix``: the server runs with ``--enable-omit-prefix-routed-experts`` (vLLM PR #57966), so a
        choice's routes may start past ``routes_prompt_start`` (at the cached prefix); each result's
        ``routes_start`` says where they start, and :func:`~r3lab.rollout.assemble_turns` refuses a turn whose
        start leaves a gap. That server requires a stable ``session_id`` (sent as ``x-session-id``) per conversation.
        """
        if omit_prefix and not session_id:
            raise RolloutError("omit_prefix needs a session_id: a prefix-omitting vLLM server requires a stable "
                               "x-session-id per conversation (vLLM PR #57966)")
        sampling = sampling or SamplingConfig()
        ids = self.encode_prompts(prompts, sampling.max_tokens)
        for i, p in enumerate(ids):
            if not 0 <= routes_prompt_start <= len(p):
                raise RolloutError(f"prompt {i}: routes_prompt_start={routes_prompt_start} outside [0, {len(p)}]")
        body = dict(sampling.to_openai(), model=self.served_name, prompt=ids, return_token_ids=True,
                    routed_experts_prompt_start=int(routes_prompt_start))
        resp = self.request(body, headers={"x-session-id": session_id} if session_id else None)
        return parse_completion(resp, self.layout, ids, n=sampling.n, routes_prompt_start=routes_prompt_start,
                                max_routes_bytes=self.max_routes_bytes, omit_prefix=omit_prefix)

    def score(self, sequences: Sequence[Sequence[int]], *, start: int | Sequence[int] = 1) -> list[np.ndarray]:
        """The server's log-probability of each token given the tokens before it (``prompt_logprobs``, prefill)."""
        ids = self.encode_prompts(list(sequences), 1)
        starts = [int(start)] * len(ids) if isinstance(start, int) else [int(s) for s in start]
        if len(starts) != len(ids):
            raise RolloutError(f"{len(starts)} starts for {len(ids)} sequences")
        for i, (s, p) in enumerate(zip(starts, ids, strict=True)):
            if not 1 <= s <= len(p):
                raise RolloutError(f"sequence {i}: start={s} outside [1, {len(p)}] (token 0 has no log-prob)")
        body = dict(SamplingConfig(max_tokens=1, temperature=0.0).to_openai(), model=self.served_name, prompt=ids,
                    prompt_logprobs=0)
        resp = self.request(body)
        choices = sorted(resp.get("choices") or [], key=lambda c: int(c.get("index", 0)))
        if len(choices) != len(ids):
            raise RolloutError(f"server {self.url}: {len(choices)} choices for {len(ids)} scored sequences")
        out = []
        for i, (c, s) in enumerate(zip(choices, starts, strict=True)):
            plp = c.get("prompt_logprobs")
            if not isinstance(plp, list) or len(plp) != len(ids[i]):
                raise RolloutError(f"server {self.url}: sequence {i}: no prompt_logprobs for its {len(ids[i])} tokens")
            row = np.empty(len(ids[i]) - s, dtype=np.float32)
            for t, tok in enumerate(ids[i][s:]):
                d = plp[s + t] or {}
                e = d.get(str(tok), d.get(tok))
                if not isinstance(e, dict) or "logprob" not in e:
                    raise RolloutError(f"server {self.url}: sequence {i}: no logprob for token {tok} at {s + t}")
                row[t] = float(e["logprob"])
            out.append(row)
        return out

    @property
    def weights_refusal(self) -> str:
        """Why ``update_weights`` refuses: r3lab drives no weight update over vLLM's HTTP API."""
        return (f"the vLLM server at {self.url}: r3lab has no weight-update path over its HTTP API (vLLM 0.30's "
                "dev-mode /update_weights moves weights over NCCL or CUDA IPC only, GPU to GPU); run RL with a local "
                "engine")

    def update_weights(self, *_: Any, **__: Any) -> NoReturn:
        """A server has no weight-update path r3lab drives: refuse with the reason (:attr:`weights_refusal`)."""
        raise AttachError(f"r3lab cannot push the trainer's weights into {self.weights_refusal}")

    def prefix_cache(self) -> dict[str, Any]:
        """A server's prefix cache is its own: unknown here (None for both)."""
        return {"enabled": None, "block_size": None}

    def facts(self) -> dict[str, Any]:
        """What a run records about the server (never its API key): its URL, served name and max length."""
        return {"url": self.url, "served_model": self.served_name, "max_model_len": self.max_model_len}


class AttachedServer(CompletionsClient):
    """A client of a server r3lab did not start; :func:`connect` builds it and runs the handshake."""

    def __init__(self, url: str, *, model: str | os.PathLike, api_key: str | None = None, timeout_s: float = 600.0,
                 retries: int = 2, max_in_flight: int = 4, max_routes_bytes: int = DEFAULT_MAX_BYTES,
                 handshake: bool = True):
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise AttachError(f"engine url {url!r} must start with http:// or https://")
        self.model_dir, self.layout = check_model_dir(model, need_tokenizer=False)
        self.api_key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
        self.timeout_s, self.retries = float(timeout_s), int(retries)
        if max_in_flight < 1:
            raise AttachError(f"max_in_flight={max_in_flight}; need at least 1")
        self._slots = threading.BoundedSemaphore(int(max_in_flight))
        self.max_routes_bytes = int(max_routes_bytes)
        self.served_name, self.max_model_len = "", int(self.layout.max_position_embeddings or 2048)
        if handshake:
            self.handshake()

    def close(self) -> None:  # nothing to end: the server belongs to the user
        pass

    @property
    def weights_refusal(self) -> str:
        """Why ``update_weights`` refuses: r3lab did not start this server and cannot push weights into it."""
        return f"the attached server at {self.url}: {ATTACHED_RL_REASON}"

    def handshake(self) -> None:
        """Served model and max length from ``/v1/models``; one probe completion whose routes fit ``model``."""
        hint = START_HINT.format(model=self.model_dir)
        models = self._http("/v1/models", timeout=min(self.timeout_s, 30.0))
        data = models.get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise AttachError(f"{self.url}/v1/models lists no model ({str(models)[:200]}); is this a vLLM server?")
        entry = data[0]
        self.served_name = str(entry["id"])
        if entry.get("max_model_len"):
            self.max_model_len = int(entry["max_model_len"])
        probe = [1, 2, 3, 4]
        body = dict(SamplingConfig(max_tokens=4, seed=0, temperature=1.0).to_openai(), model=self.served_name,
                    prompt=[probe], return_token_ids=True, routed_experts_prompt_start=0)
        resp = self.request(body, timeout=min(self.timeout_s, 120.0))
        choices = resp.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise AttachError(f"{self.url}: the probe completion returned no choices: {str(resp)[:300]}")
        b64 = choices[0].get("routed_experts")
        if not isinstance(b64, str):
            raise AttachError(f"{self.url} returned no routed_experts on the probe completion: the server was started "
                              f"without --enable-return-routed-experts; {hint}")
        try:
            raw = np.asarray(read_vllm_npy_base64(b64, max_bytes=self.max_routes_bytes))
        except R3LabError as e:
            raise AttachError(f"{self.url}: the probe's routed_experts do not decode: {e}") from e
        L, K, E = self.layout.num_hidden_layers, self.layout.top_k, self.layout.num_experts
        served = f"the server serves {self.served_name!r}, the local checkpoint is {self.model_dir}"
        if raw.ndim != 3:
            raise AttachError(f"{self.url}: probe routes have shape {raw.shape}; expected [rows, {L}, {K}]")
        if raw.shape[1] != L:
            raise AttachError(f"{self.url}: probe routes have {raw.shape[1]} layers, the local config.json has {L} "
                              f"({served}); serve the trainer's checkpoint: {hint}")
        if raw.shape[2] != K:
            raise AttachError(f"{self.url}: probe routes have top-k {raw.shape[2]}, the local config.json has {K} "
                              f"({served}); {hint}")
        moe = raw[:, list(self.layout.moe_layer_ids), :]
        if moe.size and (int(moe.min()) < 0 or int(moe.max()) >= E):
            raise AttachError(f"{self.url}: probe expert ids span [{int(moe.min())}, {int(moe.max())}], the local "
                              f"config.json has {E} experts ({served}); {hint}")
        zero = [g for g in self.layout.moe_layer_ids if raw.shape[0] >= 2 and not raw[:, g, :].any()]
        if zero and len(zero) < len(self.layout.moe_layer_ids):
            raise AttachError(f"{self.url}: probe routes leave layers {zero} empty (dense on the server), the local "
                              f"config.json has MoE layers {list(self.layout.moe_layer_ids)} ({served}); "
                              f"serve the trainer's checkpoint: {hint}")
        if moe.shape[0] >= 2 and bool((moe == moe[:1]).all()):
            raise AttachError(f"{self.url}: probe routes are constant (every row {moe[0].tolist()} over "
                              f"{moe.shape[0]} rows): the server's capture hook did not run (vLLM #33013 / #54730: "
                              "a fused MoE kernel that skips it); update vLLM "
                              f"or start it with --enforce-eager; {hint}")
        token_ids = choices[0].get("token_ids")
        if not isinstance(token_ids, list):
            raise AttachError(f"{self.url}: the probe returned no token_ids (vLLM too old for return_token_ids?)")
        try:
            validate_engine_routes(raw, self.layout, prompt_len=len(probe), response_len=len(token_ids),
                                   where=f"{self.url} probe")
        except RolloutError as e:
            raise AttachError(f"{e} ({served}); {hint}") from e


def connect(url: str, *, model: str | os.PathLike, api_key: str | None = None, timeout_s: float = 600.0,
            retries: int = 2, max_in_flight: int = 4) -> AttachedServer:
    """Attach to a running vLLM server at ``url``; ``model`` is the local checkpoint the routes must match."""
    return AttachedServer(url, model=model, api_key=api_key, timeout_s=timeout_s, retries=retries,
                          max_in_flight=max_in_flight)


def served_model(url: str, *, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The name the server at ``url`` serves its model under (``/v1/models``; vLLM: the ``--model`` it was given)."""
    client = CompletionsClient()
    client.url = url.rstrip("/")
    if not client.url.startswith(("http://", "https://")):
        raise AttachError(f"engine url {url!r} must start with http:// or https://")
    client.api_key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    data = client._http("/v1/models", timeout=timeout_s).get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise AttachError(f"{client.url}/v1/models lists no model; is this a vLLM server?")
    return str(data[0]["id"])


def parse_completion(resp: dict[str, Any], layout: MoELayout, prompts: Sequence[Sequence[int]], *, n: int = 1,
                     routes_prompt_start: int = 0, max_routes_bytes: int = DEFAULT_MAX_BYTES,
                     omit_prefix: bool = False) -> list[RolloutResult]:
    """Turn a ``/v1/completions`` response into validated :class:`RolloutResult` objects.

    Routes are the ``.npy`` of vLLM's choice, ``|u1`` (at most 256 experts) or ``<u2``, kept in that dtype. Without
    ``omit_prefix`` they must start at ``routes_prompt_start``; with it (vLLM PR #57966) they start at the row their
    count implies (:func:`r3lab.compaction.vllm_turn_start`, checked against ``usage.prompt_tokens_details.
    cached_tokens`` for a one-prompt request that reports it), and ``routes_start`` records it. A choice with rows
    marked uncaptured (-1 in every slot of a signed array: tunix #2046, NeMo-RL #3113) is refused with an error
    that says so: r3lab replays every row, and never reads -1 as an expert id.
    """
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list) or len(choices) != len(prompts) * n:
        got = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise RolloutError(f"expected {len(prompts) * n} choices, got {got}")
    out: list[RolloutResult] = []
    cached = _cached_tokens(resp, prompts) if omit_prefix else None
    for c in sorted(choices, key=lambda c: int(c.get("index", 0))):
        k = int(c.get("index", 0))
        i, j = divmod(k, n)
        where = f"choice {k}"
        if c.get("prompt_token_ids") is not None and list(c["prompt_token_ids"]) != list(prompts[i]):
            raise RolloutError(f"{where}: prompt_token_ids differ from the request's prompt {i}")
        resp_ids = c.get("token_ids")
        if not isinstance(resp_ids, list):
            raise RolloutError(f"{where}: no token_ids (return_token_ids unsupported by this server?)")
        resp_ids = [int(t) for t in resp_ids]
        lp = (c.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(lp, list) or len(lp) != len(resp_ids) or any(v is None for v in lp):
            raise RolloutError(f"{where}: token_logprobs missing or not one per sampled token")
        b64 = c.get("routed_experts")
        if not isinstance(b64, str):
            raise RolloutError(f"{where}: no routed_experts (server started without --enable-return-routed-experts?)")
        start = routes_prompt_start
        try:
            raw = read_vllm_npy_base64(b64, max_bytes=max_routes_bytes)
            if omit_prefix:
                start = vllm_turn_start(raw.shape[0], prompt_len=len(prompts[i]), response_len=len(resp_ids),
                                        requested_start=routes_prompt_start, cached_tokens=cached,
                                        where="routed_experts")
        except R3LabError as e:
            raise RolloutError(f"{where}: {e}") from e
        marked = np.flatnonzero(uncaptured_rows(raw))
        if marked.size:
            raise RolloutError(
                f"{where}: {marked.size} of {raw.shape[0]} route rows are marked uncaptured (-1 in every slot; first "
                f"at row {start + int(marked[0])}): the server captured no routes there, and replay needs every row; "
                "this sample's routes are refused")
        routes = validate_engine_routes(raw, layout, prompt_len=len(prompts[i]), response_len=len(resp_ids),
                                        start=start, where=where)
        out.append(RolloutResult(i, j, list(prompts[i]), resp_ids, np.asarray(lp, dtype=np.float32), routes,
                                 c.get("finish_reason"), start))
    return out


def _cached_tokens(resp: dict[str, Any], prompts: Sequence[Sequence[int]]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a one-prompt response (a batch's sum says nothing per prompt;
    vLLM reports it with ``--enable-prompt-tokens-details``), else None."""
    if len(prompts) != 1:
        return None
    details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    v = details.get("cached_tokens") if isinstance(details, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

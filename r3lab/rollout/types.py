"""Values of the capture stage: sampling settings, one sample's result, and the checks on engine routes.

Shared by the in-process engine (:mod:`r3lab.rollout.engine`) and the server client
(:mod:`r3lab.rollout.server`); import them from :mod:`r3lab.rollout`, which re-exports them.
Row convention: a sample of P prompt and R response tokens has ``P + R - 1`` route rows (row t routes
token t); the last sampled token is never fed through the model and has no row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3lab.errors import RolloutError, RouteFormatError
from r3lab.moe_layout import MoELayout
from r3lab.routes import Routes, check_distinct_rows


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings of one ``generate`` call; ``extra`` passes any other ``vllm.SamplingParams`` field."""

    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    n: int = 1  # samples per prompt
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RolloutError(f"SamplingConfig.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise RolloutError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.n, int) or self.n < 1:
            raise RolloutError(f"SamplingConfig.n must be an int >= 1, got {self.n!r}")

    def to_vllm(self, routes_prompt_start: int = 0):
        from vllm import SamplingParams

        kw: dict[str, Any] = dict(
            n=self.n,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop_token_ids=list(self.stop_token_ids),
            logprobs=0,  # the sampled token's log-probability only
            routed_experts_prompt_start=int(routes_prompt_start),
        )
        if self.top_k > 0:
            kw["top_k"] = self.top_k
        kw.update(self.extra)
        return SamplingParams(**kw)

    def to_openai(self) -> dict[str, Any]:
        """The same settings as OpenAI ``/v1/completions`` fields (vLLM extensions included)."""
        body = dict(n=self.n, max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    ignore_eos=self.ignore_eos, stop_token_ids=list(self.stop_token_ids), logprobs=0)
        if self.top_k > 0:
            body["top_k"] = self.top_k
        if self.seed is not None:
            body["seed"] = self.seed
        body.update(self.extra)
        return body


@dataclass(frozen=True)
class RolloutResult:
    """One sample. ``routes`` holds rows ``[routes_start, P + R - 1)`` of this sample (one sequence).

    ``routes`` is None only from an engine built with capture off (the benchmark's baseline).
    """

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: np.ndarray  # float32 [R]: the engine's log-probability of each sampled token
    routes: Routes | None
    finish_reason: str | None = None
    routes_start: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def validate_engine_routes(raw: Any, layout: MoELayout, *, prompt_len: int, response_len: int, start: int = 0,
                           where: str = "sample") -> Routes:
    """Check an engine's ``[rows, num_hidden_layers, top_k]`` array and keep the MoE layers as Routes.

    Raises :class:`RolloutError` when: it is missing or not an integer array; the row count is not
    ``prompt_len + response_len - 1 - start``; the layer axis is not the config's layer count; top_k
    differs from the config; an id is outside ``[0, num_experts)``; a row repeats an id; an MoE layer is
    all zeros (the capture hook never ran); a dense layer holds non-zero ids (layer mapping wrong).
    """
    if raw is None:
        raise RolloutError(f"{where}: the engine returned no routed experts (was enable_return_routed_experts set?)")
    arr = np.asarray(raw)
    if arr.dtype.kind not in "iu":
        raise RolloutError(f"{where}: routed experts must be integers, got dtype {arr.dtype}")
    want_rows = prompt_len + response_len - 1 - start
    L, K = layout.num_hidden_layers, layout.top_k
    if arr.ndim != 3 or arr.shape != (want_rows, L, K):
        raise RolloutError(
            f"{where}: routed experts have shape {arr.shape}; expected [{want_rows}, {L}, {K}] "
            f"(prompt {prompt_len} + response {response_len} - 1 (the last token has no row) - start {start})"
        )
    moe = list(layout.moe_layer_ids)
    sub = arr[:, moe, :]
    if sub.size and (int(sub.min()) < 0 or int(sub.max()) >= layout.num_experts):
        bad = int(sub.min()) if int(sub.min()) < 0 else int(sub.max())
        raise RolloutError(f"{where}: expert id {bad} outside [0, {layout.num_experts})")
    if want_rows >= 2:
        zero = [g for j, g in enumerate(moe) if not sub[:, j, :].any()]
        if zero:
            raise RolloutError(
                f"{where}: MoE layers {zero} are all zeros over {want_rows} rows: the engine's capture never ran there "
                "(a fused kernel that skips the hook, or a capturer bound too late)"
            )
    dense = list(layout.dense_layer_ids)
    if dense and arr[:, dense, :].any():
        nz = [g for g in dense if arr[:, g, :].any()]
        raise RolloutError(f"{where}: dense layers {nz} (from the config) hold expert ids; the layer mapping is wrong")
    try:
        check_distinct_rows(sub)
    except RouteFormatError as e:  # the same check as the wire decoders; the error says which response
        raise RolloutError(f"{where}: {e}") from e
    return Routes(sub, [0, want_rows], layout.num_experts, moe, validate=False)  # range and distinct ids checked above


def append_last_row(routes: Routes) -> Routes:
    """Add one ``arange(top_k)`` row at the end of every sequence (rows for all P + R tokens).

    Routing weights, if the routes carry them, get ``1 / top_k`` on that row (it scores no sampled token)."""
    parts = []
    pad = np.broadcast_to(np.arange(routes.top_k, dtype=routes.values.dtype), (1, routes.num_layers, routes.top_k))
    for i in range(len(routes)):
        parts.append(np.concatenate([routes.sequence(i), pad]))
    out = Routes.from_list(parts, num_experts=routes.num_experts, layer_ids=routes.layer_ids)
    if routes.weights is None:
        return out
    wpad = np.full((1, routes.num_layers, routes.top_k), 1.0 / routes.top_k, dtype=np.float32)
    w = [np.concatenate([routes.weights[routes.cu_seqlens[i]:routes.cu_seqlens[i + 1]], wpad])
         for i in range(len(routes))]
    return out.with_weights(np.concatenate(w))


def stack_routes(results: Sequence[RolloutResult]) -> Routes:
    """The routes of many results packed into one Routes (one sequence per result, in order); every result must
    carry routes (an engine started without route capture returns none)."""
    if not results:
        raise RolloutError("stack_routes needs at least one result")
    missing = [i for i, r in enumerate(results) if r.routes is None]
    if missing:
        raise RolloutError(f"stack_routes: results {missing[:5]} carry no routes (engine started without capture)")
    return Routes.concat([r.routes for r in results if r.routes is not None])


def assemble_turns(turns: Sequence[RolloutResult]) -> Routes:
    """Join the incremental captures of one multi-turn trajectory into the routes of its last turn.

    Turn j must have been generated with ``routes_prompt_start`` equal to the rows already held
    (the previous turn's ``routes_start + routes.total_tokens``), and its prompt must extend the
    previous turn's prompt + response.
    """
    if not turns:
        raise RolloutError("assemble_turns needs at least one turn")
    held = 0
    prev_tokens: list[int] = []
    for j, t in enumerate(turns):
        if t.routes is None:
            raise RolloutError(f"turn {j} has no routes (its engine was built with capture off)")
        if t.routes_start != held:
            raise RolloutError(f"turn {j} starts its routes at row {t.routes_start}, but {held} rows are held")
        if t.prompt_ids[: len(prev_tokens)] != prev_tokens:
            raise RolloutError(f"turn {j}'s prompt does not extend the previous turn's prompt + response")
        held += t.routes.total_tokens
        prev_tokens = t.token_ids
    parts = [t.routes for t in turns if t.routes is not None]  # all of them, checked above
    out = Routes.from_list([r.values for r in parts], num_experts=parts[0].num_experts, layer_ids=parts[0].layer_ids)
    return Routes(out.values, [0, out.total_tokens], out.num_experts, out.layer_ids, validate=False)


def split_turn_routes(turn: RolloutResult, held: int) -> tuple[Routes, RolloutResult]:
    """A later turn captured from an earlier row than needed, split at ``held`` (the rows earlier turns hold).

    Returns the turn's own routes of rows ``[turn.routes_start, held)`` (its prefill's view of tokens an earlier turn
    already routed, to compare with theirs) and the turn with routes from row ``held`` on, as if generated with
    ``routes_prompt_start=held`` (what :func:`assemble_turns` joins).
    """
    if turn.routes is None:
        raise RolloutError("split_turn_routes: the turn has no routes (its engine was built with capture off)")
    start, total = turn.routes_start, turn.routes.total_tokens
    top = min(start + total, len(turn.prompt_ids))
    if not start <= held <= top:
        raise RolloutError(f"split_turn_routes: held={held} outside [{start}, {top}] (the rows its prompt covers)")
    vals = turn.routes.values
    r = turn.routes

    def part(a: int, b: int) -> Routes:
        return Routes(vals[a - start : b - start], [0, b - a], r.num_experts, r.layer_ids, validate=False)

    return part(start, held), dataclasses.replace(turn, routes=part(held, start + total), routes_start=held)

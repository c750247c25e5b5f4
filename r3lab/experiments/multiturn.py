"""Step-wise multi-turn trajectories: the engine samples a turn, the environment appends an observation, the engine
continues on the whole prefix (a new ``generate`` call), ``turns`` times.

The observation is a few corpus words the policy did not sample (tokens the loss must never train on). The routes
replayed for a trajectory are stitched per turn (:func:`r3lab.rollout.assemble_turns`): every row an earlier turn
produced keeps its routing from that turn, so each sampled token's input position keeps the routes of its decode
step, and each prompt or observation position the routes of the prefill that first read it. Only the rows a turn
adds are taken from that turn.

Each later turn is captured from row 0 (``routes_prompt_start=0``) and split at the rows already held
(:func:`r3lab.rollout.split_turn_routes`): its prefill's routes of the earlier tokens are what a stack that
recomputes them would replay, and :func:`prefill_vs_decode` measures how often they differ from the stitched ones
(verl #6054, vLLM RFC #56402): for positions of sampled tokens (decode then, prefill now) and for positions of
prompt and observation tokens (prefill then, a longer prefill now). Where the engine's prefix cache serves a full
KV block of the earlier tokens, vLLM returns the routes stored with that block instead of recomputing them, so the
later view equals the stitched one there; ``prefix_cache_blocks`` in :func:`engine_prefix_cache` says whether that
can happen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.corpus import corpus_prompts
from r3lab.errors import ConfigError
from r3lab.rollout import RolloutResult, SamplingConfig, assemble_turns, split_turn_routes
from r3lab.routes import Routes

__all__ = ["Trajectory", "observation_ids", "rollout_turns", "prefill_vs_decode", "engine_prefix_cache"]


@dataclass(frozen=True)
class Trajectory:
    """One multi-turn sample: each turn's engine result and, per later turn, its prefill's view of earlier rows.

    ``turns[j].routes`` start at row ``turns[j].routes_start`` (the rows turns ``< j`` hold); ``prefill_views[j - 1]``
    holds turn j's own routing of rows ``[0, turns[j].routes_start)``.
    """

    turns: tuple[RolloutResult, ...]
    prefill_views: tuple[Routes, ...]

    def __post_init__(self) -> None:
        if not self.turns or len(self.prefill_views) != len(self.turns) - 1:
            raise ConfigError(f"a trajectory of {len(self.turns)} turns needs {len(self.turns) - 1} prefill views, "
                              f"got {len(self.prefill_views)}")

    @property
    def prompt_ids(self) -> list[int]:
        return self.turns[0].prompt_ids

    @property
    def token_ids(self) -> list[int]:
        return self.turns[-1].token_ids

    @property
    def sampled(self) -> np.ndarray:
        """Per token after the first prompt: True where the policy sampled it, False for observation tokens."""
        out = np.zeros(len(self.token_ids) - len(self.prompt_ids), dtype=bool)
        p0 = len(self.prompt_ids)
        for t in self.turns:
            p = len(t.prompt_ids) - p0
            out[p : p + len(t.response_ids)] = True
        return out

    @property
    def response_ids(self) -> list[int]:
        """The sampled tokens of every turn, in order (what the reward reads)."""
        return [tok for t in self.turns for tok in t.response_ids]

    @property
    def logprobs(self) -> np.ndarray:
        """float64 per token after the first prompt: the engine's log-prob where sampled, NaN at observations."""
        out = np.full(len(self.token_ids) - len(self.prompt_ids), np.nan)
        out[self.sampled] = np.concatenate([np.asarray(t.logprobs, dtype=np.float64) for t in self.turns])
        return out

    @property
    def routes(self) -> Routes:
        """The stitched routes of the whole trajectory (engine rows: ``len(token_ids) - 1``)."""
        return assemble_turns(self.turns)

    def decode_rows(self) -> np.ndarray:
        """bool per route row: True where the row was computed by a decode step (the input position of a sampled
        token that was fed back), False where a prefill computed it (prompt, observation, a turn's last token)."""
        out = np.zeros(len(self.token_ids) - 1, dtype=bool)
        for t in self.turns:
            p = len(t.prompt_ids)
            out[p : p + len(t.response_ids) - 1] = True
        return out


def observation_ids(tokenizer: Any, n: int, *, words: int, seed: int, data: Any = None) -> list[list[int]]:
    """``n`` observations of ``words`` corpus words each (token ids; a leading space joins them to the text)."""
    texts = corpus_prompts(n, words=words, seed=seed, data=data)
    return [list(tokenizer.encode(" " + t, add_special_tokens=False)) for t in texts]


def rollout_turns(engine: Any, prompts: Sequence[str], sampling: SamplingConfig, *, turns: int, observation_words: int,
                  seed: int, data: Any = None) -> list[Trajectory]:
    """``sampling.n`` trajectories per prompt of ``turns`` turns each (prompt-major, as ``engine.generate``).

    ``seed`` picks the observations (distinct corpus lines per trajectory and turn). Turn 0 samples ``sampling.n``
    completions per prompt; every later turn appends an observation to each trajectory and samples one continuation
    of it (``n=1``, seed ``sampling.seed + turn``), ``sampling.max_tokens`` tokens long.
    """
    if turns < 1:
        raise ConfigError(f"turns must be >= 1, got {turns}")
    first = engine.generate(list(prompts), sampling)
    history: list[list[RolloutResult]] = [[r] for r in first]
    views: list[list[Routes]] = [[] for _ in first]
    for j in range(1, turns):
        obs = observation_ids(engine.tokenizer, len(history), words=observation_words, seed=seed * 7919 + j,
                              data=data)
        prefixes = [h[-1].token_ids + o for h, o in zip(history, obs, strict=True)]
        step = dataclasses.replace(sampling, n=1, seed=None if sampling.seed is None else sampling.seed + j)
        outs = engine.generate(prefixes, step, routes_prompt_start=0)
        for i, (h, out) in enumerate(zip(history, outs, strict=True)):
            prev = h[-1]
            held = len(prev.token_ids) - 1  # the rows the previous turns hold: P + R - 1 of the previous turn
            view, own = split_turn_routes(out, held)
            h.append(own)
            views[i].append(view)
    return [Trajectory(tuple(h), tuple(v)) for h, v in zip(history, views, strict=True)]


def prefill_vs_decode(trajectories: Sequence[Trajectory]) -> dict[str, float | None]:
    """How often a later turn's prefill routes earlier tokens differently from the routes held for them.

    Shares of (token, layer) routers whose expert set differs, over every later turn's view of the rows before it:
    ``decode_rows``: rows a decode step computed (sampled tokens); ``prefill_rows``: rows an earlier prefill computed
    (prompt and observation tokens, a turn's last sampled token); ``token_any_decode``: share of decode rows with a
    difference in any layer. None where a trajectory has one turn (nothing to compare).
    """
    dec, pre = [], []
    for tr in trajectories:
        held = tr.routes.values
        kind = tr.decode_rows()
        for view in tr.prefill_views:
            n = view.total_tokens
            differs = metrics.set_differs(held[:n], view.values)
            dec.append(differs[kind[:n]])
            pre.append(differs[~kind[:n]])
    if not dec:
        return {"decode_rows": None, "prefill_rows": None, "token_any_decode": None, "rows_compared": 0}
    d, p = np.concatenate(dec), np.concatenate(pre)
    return {"decode_rows": float(d.mean()) if d.size else None, "prefill_rows": float(p.mean()) if p.size else None,
            "token_any_decode": float(d.any(axis=1).mean()) if d.size else None, "rows_compared": int(len(d) + len(p))}


def engine_prefix_cache(engine: Any) -> dict[str, Any]:
    """Whether the engine's prefix cache is on and its block size (a cached full block returns stored routes)."""
    try:
        cfg = engine._llm.llm_engine.vllm_config.cache_config
    except AttributeError:
        return {"enabled": None, "block_size": None}
    return {"enabled": bool(cfg.enable_prefix_caching), "block_size": int(cfg.block_size)}

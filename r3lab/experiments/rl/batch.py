"""One step's rollout batch: what the engine samples (one turn, or turn by turn), its rewards, its group-normalised
advantages (GRPO), the engine's noise floor on it, and the run's per-sample table of it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.config import RLConfig
from r3lab.corpus import corpus_prompts
from r3lab.experiments.multiturn import engine_prefix_cache, prefill_vs_decode, rollout_turns
from r3lab.rollout import Engine, RolloutResult, SamplingConfig, append_last_row
from r3lab.routes import Routes
from r3lab.runs import Samples
from r3lab.trainers import TokenBatch
from r3lab.vocabulary import RLMetric

__all__ = ["StepRollout", "step_seed", "group_advantages", "sample_step", "engine_noise_floor"]


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step`` in a run seeded ``seed``: its prompts, its sampling and its observations."""
    return seed * 1_000_003 + step


def group_advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """GRPO's advantages: each reward less its group's mean, over the group's standard deviation (prompt-major
    groups of ``group`` completions)."""
    g = np.asarray(rewards, dtype=np.float64).reshape(-1, group)
    adv: np.ndarray = ((g - g.mean(axis=1, keepdims=True)) / (g.std(axis=1, keepdims=True) + 1e-6)).reshape(-1)
    return adv


@dataclass(frozen=True)
class RolloutBatch:
    """A rollout batch as the trainer sees it: the samples, the engine's view of them, rewards and advantages."""

    tokens: TokenBatch
    logp_infer: np.ndarray  # [N] the engine's log-probs of the sampled tokens, sample-major
    engine_routes: Routes  # one sequence per sample, P + R rows (the trainer's row convention)
    advantages: np.ndarray  # [B] group-normalised rewards (GRPO)
    rewards: np.ndarray  # [B]
    loss_mask: np.ndarray | None = None  # [N] multi-turn: True at sampled tokens (logp_infer is NaN elsewhere)

    @classmethod
    def from_results(cls, results: Sequence[RolloutResult], rewards: np.ndarray, group: int) -> RolloutBatch:
        """The engine's samples in prompt-major groups of ``group`` completions, with their rewards."""
        routes = Routes.concat([append_last_row(r.routes) for r in results])
        logp = np.concatenate([np.asarray(r.logprobs, dtype=np.float64) for r in results])
        return cls(TokenBatch.from_results(results), logp, routes, group_advantages(rewards, group),
                   np.asarray(rewards))

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Any], rewards: np.ndarray, group: int) -> RolloutBatch:
        """Multi-turn trajectories (:class:`r3lab.experiments.multiturn.Trajectory`) as a batch: every token after the
        first prompt is scored, the loss mask keeps the sampled ones, the routes are the stitched per-turn ones."""
        tokens = TokenBatch.from_ids([t.token_ids for t in trajectories], [len(t.prompt_ids) for t in trajectories])
        routes = Routes.concat([append_last_row(t.routes) for t in trajectories])
        logp = np.concatenate([t.logprobs for t in trajectories])
        mask = np.concatenate([t.sampled for t in trajectories])
        return cls(tokens, logp, routes, group_advantages(rewards, group), np.asarray(rewards), mask)

    def sampled(self, values: np.ndarray) -> np.ndarray:
        """``values`` (one per scored token) at the sampled tokens: all of them, or the loss mask's."""
        return values if self.loss_mask is None else values[self.loss_mask]

    @property
    def cu_sampled(self) -> np.ndarray:
        """Offsets of each sample's sampled tokens in ``sampled(...)`` arrays."""
        if self.loss_mask is None:
            return self.cu_tokens
        per = np.add.reduceat(self.loss_mask.astype(np.int64), self.cu_tokens[:-1])
        return np.concatenate([[0], np.cumsum(per)])

    @property
    def cu_tokens(self) -> np.ndarray:
        """Offsets of each sample's sampled tokens in the flat token arrays."""
        return np.concatenate([[0], np.cumsum(self.tokens.response_lengths)])


@dataclass(frozen=True)
class StepRollout:
    """What one step sampled: the engine's results (multi-turn: trajectories), their rewards, the batch the trainer
    sees, the step's ``multiturn/*`` metrics and the seconds sampling took."""

    results: Sequence[Any]
    rewards: np.ndarray
    batch: RolloutBatch
    metrics: dict[str, Any]
    seconds: float


def sample_step(engine: Engine, task: Any, config: RLConfig, step: int) -> StepRollout:
    """Step ``step``'s rollouts: ``prompts_per_step`` corpus prompts, ``samples_per_prompt`` completions each (turn by
    turn when ``turns > 1``), scored by ``task``'s reward."""
    t0 = time.perf_counter()
    seed = step_seed(config.seed, step)
    prompts = corpus_prompts(config.prompts_per_step, words=config.prompt_words, seed=seed, data=config.data)
    sampling = SamplingConfig(max_tokens=config.max_tokens, temperature=config.temperature,
                              n=config.samples_per_prompt, seed=seed, ignore_eos=True)
    turn_rec: dict[str, Any] = {}
    if config.turns == 1:
        results: Sequence[Any] = engine.generate(prompts, sampling)
    else:
        results = rollout_turns(engine, prompts, sampling, turns=config.turns,
                                observation_words=config.observation_words, seed=seed, data=config.data)
        turn_rec = {f"multiturn/prefill_vs_held_{k}": v for k, v in prefill_vs_decode(results).items()}
        cache = engine_prefix_cache(engine)  # a cached full block returns stored routes, not a new prefill
        turn_rec.update({RLMetric.PREFIX_CACHE_BLOCK_SIZE: cache["block_size"] if cache["enabled"] else 0,
                         RLMetric.LONGEST_TRAJECTORY: max(len(t.token_ids) for t in results)})
    seconds = time.perf_counter() - t0
    rewards = np.array([task.reward(r.response_ids) for r in results])
    to_batch = RolloutBatch.from_results if config.turns == 1 else RolloutBatch.from_trajectories
    return StepRollout(results, rewards, to_batch(results, rewards, config.samples_per_prompt), turn_rec, seconds)


def engine_noise_floor(engine: Engine, rollout: StepRollout) -> float:
    """The engine against itself: k3 KL of the sampled tokens scored again by prefill, in another batch."""
    results, batch = rollout.results, rollout.batch
    again = engine.score([r.token_ids for r in results], start=[len(r.prompt_ids) for r in results])
    return metrics.k3_kl(batch.sampled(np.concatenate(again).astype(np.float64)), batch.sampled(batch.logp_infer))


def step_samples(results: Sequence[Any], *, multiturn: bool = False) -> Samples:
    """A step's samples (engine results, or multi-turn trajectories) as the run's per-sample table: token ids, the
    engine's log-probs and, multi-turn, which response tokens the engine sampled."""
    return Samples.from_ids([r.prompt_ids for r in results], [r.token_ids[len(r.prompt_ids):] for r in results],
                            [r.logprobs for r in results], [r.sampled for r in results] if multiturn else None)

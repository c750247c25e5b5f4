"""A small GRPO loop on CPU that compares routing replay modes: none, R2 and R3.

Each step: the embedded engine (vLLM) samples ``samples_per_prompt`` completions of corpus prompts with
the policy it holds (``staleness`` updates behind the trainer); a verifiable reward scores them; the
transformers trainer recomputes the old log-probabilities, then takes ``mini_batches`` clipped-objective
steps (AdamW) over the batch, and the new weights are pushed into the engine (``update_weights``).

Replay modes (one switch, as verl's ``router_replay.mode``):

* ``none``: the trainer routes natively everywhere.
* ``R2`` (GSPO's Routing Replay): the routes the trainer chose at the old-log-prob recompute are replayed
  in every mini-batch forward and backward of that batch (on the first mini-batch this is a no-op).
* ``R3``: the engine's routes are replayed in the old-log-prob recompute and in every mini-batch forward
  and backward.

Orthogonal: truncated importance sampling (``tis_cap``) weights each token's loss by
``min(pi_old_trainer / pi_engine, cap)``, as verl/slime apply it.

The task (``LetterTask``): the tiny models speak the made-up words of the shipped Markov corpus; the reward
of a completion is the number of distinct words in it that start with a target letter, per word (about
0.06 for "m" before training). Repeating one target word earns it once, and the chain's sparse
transitions cap how many different target words a completion can reach, so the reward climbs for many
steps instead of saturating (counting every hit, the policy found a loop of "m" words and reached 1.0
within 25 steps).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.config import MODES, RLConfig, RLMetric, run_name
from r3lab.corpus import corpus_prompts
from r3lab.doctor import diagnose
from r3lab.errors import ConfigError, R3LabError
from r3lab.paths import model_dir
from r3lab.rollout import RolloutEngine, RolloutResult, SamplingConfig, append_last_row
from r3lab.routes import Routes
from r3lab.runs import RunWriter
from r3lab.trainers import PolicyUpdate, TokenBatch, Trainer

__all__ = [
    "MODES",
    "RLConfig",
    "LetterTask",
    "RolloutBatch",
    "OldPolicy",
    "StepResult",
    "RLRun",
    "load_trainer",
    "old_policy",
    "policy_updates",
    "train_step",
    "run_rl",
    "run_comparison",
    "comparison_rows",
    "comparison_table",
    "COMPARISON_METRICS",
]


class LetterTask:
    """Reward: distinct response words that start with ``letter``, per response word (special tokens miss).

    Counting each word once keeps the task from collapsing into one word repeated: the policy must find many
    different target words, which the corpus's sparse transitions make hard, so the reward keeps climbing.
    """

    def __init__(self, tokenizer: Any, letter: str):
        vocab = tokenizer.get_vocab()
        self.letter = letter
        self.hits = np.zeros(max(vocab.values()) + 1, dtype=bool)
        for word, i in vocab.items():
            self.hits[i] = word.startswith(letter) and not word.startswith("<")
        if not self.hits.any():
            raise R3LabError(f"no word of the vocabulary starts with {letter!r}")

    def reward(self, response_ids: Sequence[int]) -> float:
        ids = np.asarray(response_ids, dtype=np.int64)
        return float(np.unique(ids[self.hits[ids]]).size / ids.size) if ids.size else 0.0


@dataclass(frozen=True)
class RolloutBatch:
    """A rollout batch as the trainer sees it: the samples, the engine's view of them, rewards and advantages."""

    tokens: TokenBatch
    logp_infer: np.ndarray  # [N] the engine's log-probs of the sampled tokens, sample-major
    engine_routes: Routes  # one sequence per sample, P + R rows (the trainer's row convention)
    advantages: np.ndarray  # [B] group-normalised rewards (GRPO)
    rewards: np.ndarray  # [B]

    @classmethod
    def from_results(cls, results: Sequence[RolloutResult], rewards: np.ndarray, group: int) -> RolloutBatch:
        """The engine's samples in prompt-major groups of ``group`` completions, with their rewards."""
        g = np.asarray(rewards, dtype=np.float64).reshape(-1, group)
        adv = ((g - g.mean(axis=1, keepdims=True)) / (g.std(axis=1, keepdims=True) + 1e-6)).reshape(-1)
        routes = Routes.concat([append_last_row(r.routes) for r in results])
        logp = np.concatenate([np.asarray(r.logprobs, dtype=np.float64) for r in results])
        return cls(TokenBatch.from_results(results), logp, routes, adv, np.asarray(rewards))

    @property
    def cu_tokens(self) -> np.ndarray:
        """Offsets of each sample's sampled tokens in the flat token arrays."""
        return np.concatenate([[0], np.cumsum(self.tokens.response_lengths)])


@dataclass(frozen=True)
class OldPolicy:
    """The old policy on a rollout batch: the log-probs the loss divides by, its own routes, and their diagnostics."""

    logp_old: np.ndarray  # [N] the loss's old log-probs (R3: replaying the engine's routes; else native)
    logp_native: np.ndarray  # [N] the trainer's own routing
    native_routes: Routes  # what the trainer routed natively: R2's replay data
    metrics: dict[str, Any]  # mismatch/* and routing/* of the step
    tokens: dict[str, np.ndarray]  # per sampled token: flipped, flipped_layers


@dataclass(frozen=True)
class StepResult:
    """One RL step's trainer side: its metrics (one step line of the run) and its per-token table."""

    metrics: dict[str, Any]
    tokens: dict[str, np.ndarray]


def load_trainer(config: RLConfig, path: str | os.PathLike) -> Trainer:
    """The RL trainer of ``config``: transformers (``trainer_dtype`` with ``router_dtype`` routers) or Megatron-core
    on ``tp * pp * dp`` CPU ranks (``config.trainer == "megatron"``, fp32 routers), each with AdamW at ``lr``."""
    if config.trainer == "megatron":
        from r3lab.trainers.megatron.trainer import MegatronTrainer

        return MegatronTrainer(path, tp=config.tp, pp=config.pp, ep=config.ep, dp=config.dp,
                               dtype=config.trainer_dtype, lr=config.lr)
    from r3lab.trainers.hf import HFTrainer

    return HFTrainer.load(path, config.trainer_dtype, router_dtype=config.router_dtype, lr=config.lr)


def old_policy(trainer: Trainer, batch: RolloutBatch, config: RLConfig) -> OldPolicy:
    """The old log-probs, and routing diagnostics: engine vs the trainer's own choice, per (token, layer)."""
    native = trainer.score(batch.tokens, record=True)
    if config.mode == "R3":
        logp_old = trainer.score(batch.tokens, routes=batch.engine_routes).logprobs
    else:
        logp_old = native.logprobs
    mismatch = metrics.mismatch_metrics(logp_old, batch.logp_infer, cu_seqlens=batch.cu_tokens,
                                        tis_cap=config.tis_cap or 2.0)
    rec: dict[str, Any] = {f"mismatch/{k}": v for k, v in mismatch.items()}
    own = native.routes
    differs = metrics.set_differs(batch.engine_routes.select_layers(own.layer_ids).values, own.values)
    rec[RLMetric.ENGINE_TRAINER_DISAGREEMENT] = float(differs.mean())
    rec["routing/engine_trainer_disagreement_per_layer"] = {
        int(g): float(v) for g, v in zip(own.layer_ids, differs.mean(axis=0), strict=True)}
    rec["routing/engine_trainer_token_any"] = float(differs.any(axis=1).mean())
    rows = metrics.response_rows(batch.engine_routes.cu_seqlens, batch.tokens.response_lengths, metrics.TRAINER_ROWS)
    flipped = differs.any(axis=1)[rows]
    for name, k3 in metrics.k3_by_flip(logp_old, batch.logp_infer, flipped).items():
        rec[f"mismatch/k3_kl_{name}"] = k3
    rec["routing/flipped_token_share"] = float(flipped.mean())
    load = metrics.expert_load(batch.engine_routes.values, batch.engine_routes.num_experts)
    rec[RLMetric.ENGINE_MAX_VIO] = float(metrics.max_violation(load).max())
    return OldPolicy(logp_old, native.logprobs, own, rec,
                     {"flipped": flipped, "flipped_layers": differs.sum(axis=1)[rows]})


_UPDATE_STATS = ("loss", "clip_frac", "approx_kl", "grad_norm", "entropy", "route_change", "used_route_change",
                 "tis_weight_mean")


def policy_updates(trainer: Trainer, batch: RolloutBatch, old: OldPolicy, config: RLConfig,
                   rng: np.random.Generator) -> tuple[dict[str, Any], np.ndarray]:
    """``mini_batches`` clipped policy steps over a shuffled split of the batch; replays per ``config.mode``.

    Returns the update's metrics (train/*, the route change of the policy, the noise floor of the trainer) and the
    samples of the first mini-batch.
    """
    chunks = np.array_split(rng.permutation(len(batch.tokens)), config.mini_batches)
    tok_sample = batch.tokens.token_sample
    stats: dict[str, list[float]] = {k: [] for k in _UPDATE_STATS}
    first_mb_gap = trainer_floor = 0.0
    for mb, idx in enumerate(np.sort(c) for c in chunks):
        sub = batch.tokens.take(idx)
        sel = np.isin(tok_sample, idx)
        # what the current policy would route natively, against the old policy's routes (what R2 freezes)
        now = trainer.score(sub, record=True)
        old_sub = old.native_routes.take(idx)
        stats["route_change"].append(float(metrics.set_differs(old_sub.values, now.routes.values).mean()))
        replay = {"R2": old_sub, "R3": batch.engine_routes.take(idx)}.get(config.mode)
        update = PolicyUpdate(old_logprobs=old.logp_old[sel], advantages=batch.advantages[tok_sample[sel]],
                              infer_logprobs=batch.logp_infer[sel], clip_eps=config.clip_eps,
                              tis_cap=config.tis_cap, max_grad_norm=config.max_grad_norm)
        step = trainer.policy_step(sub, update, routes=replay)
        # the routes this forward actually used, against the old policy's: 0 for R2 by construction
        used = now.routes if replay is None else replay.select_layers(now.routes.layer_ids)
        stats["used_route_change"].append(float(metrics.set_differs(old_sub.values, used.values).mean()))
        if mb == 0:  # the policy is still the old one: R2 must equal no replay here (its definition)
            gap = step.logprobs.astype(np.float32) - now.logprobs.astype(np.float32)  # the trainer's fp32
            first_mb_gap = float(np.abs(gap).max())
            trainer_floor = metrics.k3_kl(now.logprobs, old.logp_native[sel])
        for k in ("loss", "clip_frac", "approx_kl", "grad_norm", "entropy"):
            stats[k].append(getattr(step, k))
        if step.tis_weight_mean is not None:
            stats["tis_weight_mean"].append(step.tis_weight_mean)
    rec: dict[str, Any] = {f"train/{k}": float(np.mean(v)) if v else None for k, v in stats.items()}
    rec["routing/route_change_first_mb"] = stats["route_change"][0]
    rec[RLMetric.ROUTE_CHANGE_LAST_MB] = stats["route_change"][-1]
    rec[RLMetric.USED_ROUTE_CHANGE_LAST_MB] = stats["used_route_change"][-1]
    rec["train/first_mb_logp_gap_to_native"] = first_mb_gap
    # the trainer against itself: the same tokens under the same weights, scored in another batch composition
    rec["noise/k3_kl_trainer_vs_trainer"] = trainer_floor
    return rec, np.sort(chunks[0])


def train_step(trainer: Trainer, batch: RolloutBatch, config: RLConfig, rng: np.random.Generator) -> StepResult:
    """Old log-probs and routing diagnostics, then ``mini_batches`` clipped policy updates."""
    old = old_policy(trainer, batch, config)
    update, first_mb = policy_updates(trainer, batch, old, config, rng)
    sample = batch.tokens.token_sample
    tokens = {"sample": sample, "position": np.concatenate([np.arange(int(n)) for n in batch.tokens.response_lengths]),
              "logp_infer": batch.logp_infer, "logp_old": old.logp_old, "logp_native": old.logp_native,
              "flipped": old.tokens["flipped"], "flipped_layers": old.tokens["flipped_layers"],
              "reward": batch.rewards[sample], "first_mb_sample": np.isin(sample, first_mb)}
    return StepResult({**old.metrics, **update}, tokens)


@dataclass
class RLRun:
    """What ``run_rl`` returns: the per-step records (also in the run folder) and the folder, if written."""

    config: RLConfig
    steps: list[dict[str, Any]]
    path: Any = None


def run_rl(config: RLConfig, *, engine: RolloutEngine | None = None, runs_root: Any = None, run_name: str | None = None,
           progress: bool = True, on_step: Callable[[dict[str, Any]], None] | None = None) -> RLRun:
    """Run one GRPO job in ``config.mode``; write it to ``runs_root/run_name`` when ``runs_root`` is given.

    ``engine`` may be an engine already holding ``config.model``; its weights are reset to the checkpoint
    first, so several runs can share one engine start.
    """
    import torch
    from tqdm.auto import tqdm

    path = model_dir(config.model, config.data)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    own_engine = engine is None
    if not own_engine and getattr(engine, "engine_quant", "none") != config.engine_quant:
        raise ConfigError(f"the engine given runs engine_quant={engine.engine_quant!r}, the config asks for "
                          f"{config.engine_quant!r}: start it with RolloutEngine(..., engine_quant=...)")
    if engine is None:
        engine = RolloutEngine(path, seed=config.seed, dtype=config.engine_dtype, engine_quant=config.engine_quant)
    writer = None
    trainer = None
    try:
        trainer = load_trainer(config, path)
        checkpoint = trainer.export_weights()
        engine.update_weights(checkpoint, version=0)  # a shared engine starts from the checkpoint too
        task = LetterTask(engine.tokenizer, config.target_letter)
        if runs_root is not None:
            name = run_name or f"rl-{config.model}-{config.mode}-s{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
            writer = RunWriter(runs_root, name, "rl", config.to_dict())
        history: list[dict[str, Any]] = []
        snapshots: list[Any] = [checkpoint]  # weights after update u, for stale rollouts
        G = config.samples_per_prompt
        for step in tqdm(range(config.steps), desc=f"rl {config.mode}", unit="step", disable=not progress):
            t0 = time.perf_counter()
            prompts = corpus_prompts(config.prompts_per_step, words=config.prompt_words,
                                     seed=config.seed * 1_000_003 + step, data=config.data)
            sampling = SamplingConfig(max_tokens=config.max_tokens, temperature=config.temperature, n=G,
                                      seed=config.seed * 1_000_003 + step, ignore_eos=True)
            results = engine.generate(prompts, sampling)
            t_gen = time.perf_counter() - t0
            rewards = np.array([task.reward(r.response_ids) for r in results])
            batch = RolloutBatch.from_results(results, rewards, G)
            if config.noise_every and step % config.noise_every == 0:
                # the engine against itself: the sampled tokens scored again by prefill, in another batch
                again = engine.score([r.token_ids for r in results], start=[len(r.prompt_ids) for r in results])
                noise = metrics.k3_kl(np.concatenate(again).astype(np.float64), batch.logp_infer)
            else:
                noise = None
            result = train_step(trainer, batch, config, rng)
            rec = result.metrics
            rec["noise/k3_kl_engine_vs_engine"] = noise
            rec.update(step=step, **{RLMetric.REWARD: float(rewards.mean())}, reward_std=float(rewards.std()),
                       engine_weight_version=engine.weight_version, time_generate_s=t_gen)
            snapshots.append(trainer.export_weights())  # weights after update step + 1
            behind = min(config.staleness, len(snapshots) - 1)
            t1 = time.perf_counter()
            engine.update_weights(snapshots[-1 - behind], version=step + 1 - behind)
            snapshots = snapshots[-(config.staleness + 1) :]
            rec["time_weight_sync_s"] = time.perf_counter() - t1
            rec["time_step_s"] = time.perf_counter() - t0
            history.append(rec)
            if writer is not None:
                if step in (0, config.steps - 1) or (config.token_steps and step % config.token_steps == 0):
                    writer.write_tokens(step, result.tokens)
                    writer.write_routes(step, "engine", batch.engine_routes)
                writer.log_step(rec)
            if on_step is not None:
                on_step(rec)
        summary = _summary(history)
        if writer is not None:
            report = diagnose(writer.path)  # the field's silent failures, checked on what this run wrote
            summary.update(report.summary())
            if not report.ok:
                print(report.text(), file=sys.stderr)
            writer.finish(summary)
        return RLRun(config, history, writer.path if writer is not None else None)
    finally:
        if writer is not None:
            writer.close()
        close = getattr(trainer, "close", None)  # a multi-process trainer (Megatron's ranks) ends them
        if close is not None:
            close()
        if own_engine:
            engine.close()


def _summary(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means over the run and over its last quarter, and the reward's first and last quarter."""
    keys = sorted({k for h in history for k, v in h.items() if isinstance(v, int | float) and k != "step"})
    q = max(1, len(history) // 4)
    out: dict[str, Any] = {"steps": len(history)}
    for k in keys:
        vals = np.array([h[k] for h in history if h.get(k) is not None], dtype=np.float64)
        if vals.size:
            out[f"mean/{k}"] = float(vals.mean())
            out[f"last_quarter/{k}"] = float(vals[-q:].mean())
    r = np.array([h["reward_mean"] for h in history])
    out["reward_first_quarter"] = float(r[:q].mean())
    out["reward_last_quarter"] = float(r[-q:].mean())
    return out


def run_comparison(base: RLConfig, *, modes: Sequence[str] = MODES, seeds: Sequence[int] = (0, 1, 2),
                   runs_root: Any = None, prefix: str | None = None, progress: bool = True) -> list[RLRun]:
    """Every (mode, seed) of ``base`` on one engine start, written to ``runs_root`` as ``<prefix>-<mode>-s<seed>``."""
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"modes must be among {MODES}, got {list(modes)}")
    path = model_dir(base.model, base.data)
    prefix = prefix or f"rl-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = []
    with RolloutEngine(path, seed=base.seed, dtype=base.engine_dtype, engine_quant=base.engine_quant) as engine:
        for seed in seeds:
            for mode in modes:
                cfg = dataclasses.replace(base, mode=mode, seed=int(seed))
                out.append(run_rl(cfg, engine=engine, runs_root=runs_root, run_name=run_name(prefix, mode, seed),
                                  progress=progress))
    return out


COMPARISON_METRICS = (
    (RLMetric.REWARD, "reward", ".3f"),
    (RLMetric.K3_KL, "k3 KL", ".2e"),
    (RLMetric.F_1_5, "F(1.5)", ".4f"),
    (RLMetric.ABS_DIFF, "mean abs dlogp", ".4f"),
    (RLMetric.ENGINE_TRAINER_DISAGREEMENT, "engine-trainer routing differs", ".3f"),
    (RLMetric.ROUTE_CHANGE_LAST_MB, "policy route change (last mini-batch)", ".3f"),
    (RLMetric.USED_ROUTE_CHANGE_LAST_MB, "used routes vs old policy (last mini-batch)", ".3f"),
    (RLMetric.CLIP_FRAC, "clip frac", ".3f"),
)


def comparison_rows(steps_by_run: Sequence[tuple[RLConfig | dict, Sequence[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Per (model, mode): each metric's run mean, as min / median / max over seeds, plus the reward's rise."""
    groups: dict[tuple[str, str], list[Sequence[dict[str, Any]]]] = {}
    for cfg, steps in steps_by_run:
        c = cfg if isinstance(cfg, dict) else cfg.to_dict()
        groups.setdefault((c["model"], c["mode"]), []).append(steps)
    rows = []
    for (model, mode), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], MODES.index(kv[0][1]))):
        row: dict[str, Any] = {"model": model, "mode": mode, "seeds": len(runs), "steps": len(runs[0])}
        for key, _, _ in COMPARISON_METRICS:
            means = [float(np.mean([s[key] for s in steps if s.get(key) is not None])) for steps in runs]
            row[key] = (min(means), float(np.median(means)), max(means))
        q = max(1, len(runs[0]) // 4)
        rise = [float(np.mean([s["reward_mean"] for s in st[-q:]]) - np.mean([s["reward_mean"] for s in st[:q]]))
                for st in runs]
        row["reward_rise"] = (min(rise), float(np.median(rise)), max(rise))
        rows.append(row)
    return rows


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per (model, mode), every cell min / median / max over seeds of the run's mean."""
    head = ["model", "mode", "seeds x steps", *[label for _, label, _ in COMPARISON_METRICS],
            "reward rise (last - first quarter)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["mode"], f"{r['seeds']} x {r['steps']}"]
        for key, _, fmt in COMPARISON_METRICS:
            lo, mid, hi = r[key]
            cells.append(f"{mid:{fmt}} ({lo:{fmt}} - {hi:{fmt}})")
        lo, mid, hi = r["reward_rise"]
        cells.append(f"{mid:+.3f} ({lo:+.3f} - {hi:+.3f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

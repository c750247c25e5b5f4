"""The RL loop: per step, sample a batch, score the engine against itself, take the policy update, push the weights
the engine samples with next (``staleness`` updates behind), write the step; then the summary and the doctor.
:func:`run_comparison` runs every (mode, seed) on one engine start."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from r3lab.cluster import place
from r3lab.config import DEFAULT_MODES, MODES, RL_SEEDS, RLConfig, RLMetric, run_name
from r3lab.errors import AttachError, ConfigError
from r3lab.experiments.rl.batch import StepRollout, engine_noise_floor, sample_step
from r3lab.experiments.rl.policy import load_policy, restore_policy, save_policy
from r3lab.experiments.rl.report import collapse_state, finish_run, write_step
from r3lab.experiments.rl.trainer import scorer_at, start_trainer
from r3lab.experiments.rl.update import StepResult, train_step
from r3lab.experiments.tasks import make_task
from r3lab.paths import model_dir
from r3lab.rollout import Engine
from r3lab.runs import RunWriter, mark_stopped
from r3lab.vocabulary import RunKind

__all__ = ["LOW_PROB", "ZERO_ADVANTAGE_GROUPS", "StaleWeights", "default_prefix", "start_engine"]


@dataclass
class RLRun:
    """What ``run_rl`` returns: the per-step records (also in the run folder) and the folder, if written."""

    config: RLConfig
    steps: list[dict[str, Any]]
    path: Any = None


class StaleWeights:
    """The weights the engine samples with: the trainer's, ``staleness`` updates behind (the checkpoint until there
    are that many updates). Holds the last ``staleness + 1`` snapshots (``export_weights``)."""

    def __init__(self, engine: Engine, checkpoint: Any, staleness: int, *, version: int = 0):
        self.engine, self.staleness = engine, staleness
        self.snapshots: list[Any] = [checkpoint]  # weights after update u, for stale rollouts
        self.behaviour = checkpoint  # what the engine holds: the weights its rollouts are sampled with
        # a shared engine starts from the checkpoint too (a resumed run: the saved policy, at its step's version)
        engine.update_weights(checkpoint, version=version)

    def push(self, weights: Any, step: int) -> float:
        """``weights`` (after update ``step + 1``) in; the engine gets those ``staleness`` behind. Returns the sync's
        seconds."""
        self.snapshots.append(weights)
        behind = min(self.staleness, len(self.snapshots) - 1)
        t0 = time.perf_counter()
        self.behaviour = self.snapshots[-1 - behind]
        self.engine.update_weights(self.behaviour, version=step + 1 - behind)
        self.snapshots = self.snapshots[-(self.staleness + 1) :]
        return time.perf_counter() - t0


def _timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def default_prefix(model: str) -> str:
    """The folder-name prefix of a comparison no one named: ``rl-<model>-<time>``."""
    return f"rl-{model}-{_timestamp()}"


def engine_options(config: RLConfig, modes: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``RolloutEngine`` options the runs of ``config`` in ``modes`` (default: its own mode) need: its dtype and
    precision, and ``capture_weights`` when one of them is R3W (the engine records its routers' top-k weights; the
    ids, log-probs and samples are the same with and without)."""
    modes = [config.mode] if modes is None else list(modes)
    return {"dtype": config.engine_dtype, "engine_quant": config.engine_quant, "capture_weights": "R3W" in modes}


def start_engine(config: RLConfig, path: Any, modes: Sequence[str] | None = None) -> Engine:
    """The engine ``config`` asks for (with :func:`engine_options` for ``modes``), where the config places it
    (:func:`r3lab.cluster.place`: this process, or a Ray actor); the caller closes it."""
    return place(config, path).start_engine(seed=config.seed, **engine_options(config, modes))


def _check_engine(engine: Engine | None, config: RLConfig) -> None:
    if engine is None:
        return
    refusal = engine.weights_refusal
    if refusal is not None:  # before the trainer loads: its update_weights would refuse after it
        raise AttachError(f"RL cannot run on {refusal}")
    if engine.engine_quant != config.engine_quant:
        raise ConfigError(f"the engine given runs engine_quant={engine.engine_quant!r}, the config asks for "
                          f"{config.engine_quant!r}: start it with RolloutEngine(..., engine_quant=...)")
    if config.mode == "R3W" and not engine.captures_weights:
        raise ConfigError("mode R3W replays the engine's routing weights: the engine given does not capture them "
                          "(start it with RolloutEngine(..., capture_weights=True), or engine_options(config))")


LOW_PROB = RLMetric.LOW_PROB  # share of engine-sampled tokens the trainer gives p < 1e-4
ZERO_ADVANTAGE_GROUPS = RLMetric.ZERO_ADVANTAGE_GROUPS  # share of prompt groups whose rewards are all equal


def _record(result: StepResult, rollout: StepRollout, noise: float | None, step: int, version: int,
            group: int) -> dict[str, Any]:
    """The step line: the trainer's metrics, the multi-turn ones, the noise floor, the reward and the timing so far,
    and two collapse precursors: engine-sampled tokens the trainer (old policy) gives probability below 1e-4 (extreme
    tokens corrupt the importance ratios) and prompt groups with no reward spread (no advantage, no gradient)."""
    rec = result.metrics
    rec.update(rollout.metrics)
    logp = rollout.batch.sampled(np.asarray(result.tokens["logp_old"], dtype=np.float64))
    rec[LOW_PROB] = float(np.mean(logp < np.log(1e-4))) if logp.size else None
    rec[ZERO_ADVANTAGE_GROUPS] = float(np.mean(np.ptp(rollout.rewards.reshape(-1, group), axis=1) == 0))
    rec[RLMetric.ENGINE_NOISE_FLOOR] = noise
    rec.update(step=step, **{RLMetric.REWARD: float(rollout.rewards.mean())}, reward_std=float(rollout.rewards.std()),
               engine_weight_version=version, time_generate_s=rollout.seconds)
    return rec


def run_rl(config: RLConfig, *, engine: Engine | None = None, runs_root: Any = None, run_name: str | None = None,
           progress: bool = True, on_step: Callable[[dict[str, Any]], None] | None = None) -> RLRun:
    """Run one GRPO job in ``config.mode``; write it to ``runs_root/run_name`` when ``runs_root`` is given.

    ``engine`` may be an engine already holding ``config.model``; its weights are reset to the checkpoint
    first, so several runs can share one engine start. ``config.init_from``: the run starts from a saved policy
    (weights, optimizer and RNG state; the engine synced to them) at the step it was saved and goes on to
    ``config.steps``; ``config.save_every``: the policy is saved into the run folder every that many steps.
    """
    import torch
    from tqdm.auto import tqdm

    path = model_dir(config.model, config.data)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    _check_engine(engine, config)
    if config.save_every and runs_root is None:
        raise ConfigError("save_every saves the policy into the run folder: give runs_root", field="save_every")
    saved = load_policy(config, runs_root) if config.init_from else None  # before an engine starts
    start = saved.step if saved is not None else 0
    prior = [{RLMetric.REWARD: r} for r in saved.rewards] if saved is not None else []  # the detector's history
    own_engine = engine is None
    if engine is None:
        engine = start_engine(config, path)
    writer = trainer = behaviour = None
    try:
        trainer = start_trainer(config, path)
        if saved is not None:
            restore_policy(saved, trainer, rng)
        weights = StaleWeights(engine, trainer.export_weights(), config.staleness, version=start)
        task = make_task(engine.tokenizer, config)
        if runs_root is not None:
            writer = RunWriter(runs_root, run_name or _run_name(config), RunKind.RL, config.to_dict())
        history: list[dict[str, Any]] = []
        for step in tqdm(range(start, config.steps), desc=f"rl {config.mode}", unit="step", disable=not progress):
            t0 = time.perf_counter()
            rollout = sample_step(engine, task, config, step)
            noisy = config.noise_every and step % config.noise_every == 0
            noise = engine_noise_floor(engine, rollout) if noisy else None
            if config.old_logprobs == "behaviour":
                behaviour = scorer_at(config, path, weights.behaviour, scorer=behaviour)
            result = train_step(trainer, rollout.batch, config, rng, behaviour=behaviour)
            rec = _record(result, rollout, noise, step, engine.weight_version, config.samples_per_prompt)
            rec[RLMetric.TIME_WEIGHT_SYNC] = weights.push(trainer.export_weights(), step)
            rec[RLMetric.TIME_STEP] = time.perf_counter() - t0
            history.append(rec)
            rec.update(collapse_state(prior + history))
            if writer is not None:
                write_step(writer, config, step, rollout, result.tokens, rec)
                if config.save_every and (step + 1) % config.save_every == 0:
                    save_policy(writer.path, step + 1, trainer, rng, config,
                                [h[RLMetric.REWARD] for h in prior + history])
            if on_step is not None:
                on_step(rec)
        finish_run(writer, config, history, prior=prior)
        return RLRun(config, history, writer.path if writer is not None else None)
    except BaseException as e:  # a dead rank or engine, Ctrl-C: the run folder says stopped and why
        if writer is not None and not writer.finished:
            writer.close()
            mark_stopped(writer.path, f"{type(e).__name__}: {e}")
        raise
    finally:
        if writer is not None:
            writer.close()
        for held in (trainer, behaviour):  # a multi-process trainer (Megatron's ranks) ends them
            if held is not None:
                held.close()
        if own_engine:
            engine.close()


def _run_name(config: RLConfig) -> str:
    """The folder name of a run no one named: ``rl-<model>-<mode>-s<seed>-<time>``."""
    return f"{run_name(f'rl-{config.model}', config.mode, config.seed)}-{_timestamp()}"


def run_comparison(base: RLConfig, *, modes: Sequence[str] = DEFAULT_MODES, seeds: Sequence[int] = RL_SEEDS,
                   runs_root: Any = None, prefix: str | None = None, progress: bool = True) -> list[RLRun]:
    """Every (mode, seed) of ``base`` on one engine start, written to ``runs_root`` as ``<prefix>-<mode>-s<seed>``."""
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"modes must be among {MODES}, got {list(modes)}")
    path = model_dir(base.model, base.data)
    prefix = prefix or default_prefix(path.name)
    out = []
    with start_engine(base, path, modes) as engine:
        for seed in seeds:
            for mode in modes:
                cfg = dataclasses.replace(base, mode=mode, seed=int(seed))
                out.append(run_rl(cfg, engine=engine, runs_root=runs_root, run_name=run_name(prefix, mode, seed),
                                  progress=progress))
    return out

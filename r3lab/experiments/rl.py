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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from r3lab import metrics
from r3lab.config import MODES, RLConfig, run_name
from r3lab.errors import ConfigError, R3LabError
from r3lab.experiments.drift import padded_batch
from r3lab.paths import model_dir
from r3lab.replay import load_hf_model, remove_router_casts, score_batch
from r3lab.rollout import RolloutEngine, RolloutResult, SamplingConfig, append_last_row
from r3lab.routes import Routes
from r3lab.runs import RunWriter
from r3lab.testing.corpus import corpus_prompts

__all__ = [
    "MODES",
    "RLConfig",
    "LetterTask",
    "RLRun",
    "run_rl",
    "run_comparison",
    "comparison_rows",
    "comparison_table",
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


@dataclass
class _Batch:
    """A rollout batch laid out for the trainer: right-padded ids, masks and the engine's view of it."""

    ids: Any  # LongTensor [B, S]
    mask: Any  # LongTensor [B, S], 1 on real tokens
    response: Any  # BoolTensor [B, S]: position t holds a sampled token (scored from logits at t - 1)
    logp_infer: np.ndarray  # [N] the engine's log-probs of the sampled tokens, sample-major
    engine_routes: Routes  # one sequence per sample, P + R rows (the last row appended)
    advantages: np.ndarray  # [B]
    rewards: np.ndarray  # [B]


def _make_batch(results: Sequence[RolloutResult], rewards: np.ndarray, group: int) -> _Batch:
    ids, mask, response = padded_batch(results)
    g = rewards.reshape(-1, group)
    adv = ((g - g.mean(axis=1, keepdims=True)) / (g.std(axis=1, keepdims=True) + 1e-6)).reshape(-1)
    routes = Routes.concat([append_last_row(r.routes) for r in results])
    logp = np.concatenate([np.asarray(r.logprobs, dtype=np.float64) for r in results])
    return _Batch(ids, mask, response, logp, routes, adv, rewards)


def _state_for_engine(model: Any) -> dict[str, Any]:
    """The trainer's weights in the checkpoint's layout and names (what the engine loads), detached CPU copies.

    transformers 5 fuses each MoE block's experts into one tensor on load; ``revert_weight_conversion`` undoes
    that exactly (per-expert ``gate_proj``/``up_proj``/``down_proj``), as ``save_pretrained`` does.
    """
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()})


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
    if engine is None:
        engine = RolloutEngine(path, seed=config.seed, dtype=config.engine_dtype)
    writer = None
    try:
        model = load_hf_model(path, config.trainer_dtype)
        if config.router_dtype == "bfloat16":
            remove_router_casts(model)  # routers back in the checkpoint's own dtype (GLM keeps its fp32 bias)
        model.train()
        checkpoint = _state_for_engine(model)
        engine.update_weights(checkpoint, version=0)  # a shared engine starts from the checkpoint too
        task = LetterTask(engine.tokenizer, config.target_letter)
        opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.99), weight_decay=0.0)
        if runs_root is not None:
            name = run_name or f"rl-{config.model}-{config.mode}-s{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
            writer = RunWriter(runs_root, name, "rl", config.to_dict())
        history: list[dict[str, Any]] = []
        snapshots: list[dict[str, Any]] = [checkpoint]  # weights after update u, for stale rollouts
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
            batch = _make_batch(results, rewards, G)
            if config.noise_every and step % config.noise_every == 0:
                # the engine against itself: the sampled tokens scored again by prefill, in another batch
                again = engine.score([r.token_ids for r in results], start=[len(r.prompt_ids) for r in results])
                noise = metrics.k3_kl(np.concatenate(again).astype(np.float64), batch.logp_infer)
            else:
                noise = None
            rec = _train_step(model, opt, batch, config, rng, step)
            rec["noise/k3_kl_engine_vs_engine"] = noise
            rec.update(step=step, reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                       engine_weight_version=engine.weight_version, time_generate_s=t_gen)
            snapshots.append(_state_for_engine(model))  # weights after update step + 1
            behind = min(config.staleness, len(snapshots) - 1)
            t1 = time.perf_counter()
            engine.update_weights(snapshots[-1 - behind], version=step + 1 - behind)
            snapshots = snapshots[-(config.staleness + 1) :]
            rec["time_weight_sync_s"] = time.perf_counter() - t1
            rec["time_step_s"] = time.perf_counter() - t0
            history.append(rec)
            if writer is not None:
                tokens = rec.pop("_tokens")
                if step in (0, config.steps - 1) or (config.token_steps and step % config.token_steps == 0):
                    writer.write_tokens(step, tokens)
                    writer.write_routes(step, "engine", batch.engine_routes)
                writer.log_step(rec)
            else:
                rec.pop("_tokens")
            if on_step is not None:
                on_step(rec)
        summary = _summary(history)
        if writer is not None:
            writer.finish(summary)
        return RLRun(config, history, writer.path if writer is not None else None)
    finally:
        if writer is not None:
            writer.close()
        if own_engine:
            engine.close()


def _train_step(model: Any, opt: Any, batch: _Batch, config: RLConfig, rng: np.random.Generator,
                step: int) -> dict[str, Any]:
    """Old log-probs, then ``mini_batches`` clipped policy updates; returns the step's metrics."""
    import torch

    B = batch.ids.shape[0]
    n_resp = batch.response.sum(1).numpy()  # sampled tokens per sample
    sample = np.repeat(np.arange(B), n_resp)  # the sample of every sampled token
    # the old policy, routing natively: its routes are R2's replay data and the engine-vs-trainer comparison
    native = score_batch(model, batch.ids, batch.mask, batch.response, record=True)
    native_routes = native.routes
    logp_native = native.logprobs.double().cpu().numpy()
    if config.mode == "R3":
        logp_old = score_batch(model, batch.ids, batch.mask, batch.response, routes=batch.engine_routes).logprobs
        logp_old = logp_old.double().cpu().numpy()
    else:
        logp_old = logp_native
    mismatch = metrics.mismatch_metrics(logp_old, batch.logp_infer, cu_seqlens=np.concatenate([[0], np.cumsum(n_resp)]),
                                        tis_cap=config.tis_cap or 2.0)
    rec: dict[str, Any] = {f"mismatch/{k}": v for k, v in mismatch.items()}
    # routing: engine vs the trainer's own choice, per (token, layer), on every input position
    eng = batch.engine_routes.select_layers(native_routes.layer_ids).values
    differs = metrics.set_differs(eng, native_routes.values)
    rec["routing/engine_trainer_disagreement"] = float(differs.mean())
    rec["routing/engine_trainer_disagreement_per_layer"] = {
        int(g): float(v) for g, v in zip(native_routes.layer_ids, differs.mean(axis=0), strict=True)}
    rec["routing/engine_trainer_token_any"] = float(differs.any(axis=1).mean())
    flipped = _response_rows(batch, differs.any(axis=1))
    for name, m in (("flipped", flipped), ("agreeing", ~flipped)):
        rec[f"mismatch/k3_kl_{name}"] = metrics.k3_kl(logp_old[m], batch.logp_infer[m]) if m.any() else None
    rec["routing/flipped_token_share"] = float(flipped.mean())
    load = metrics.expert_load(batch.engine_routes.values, batch.engine_routes.num_experts)
    rec["routing/engine_max_vio"] = float(metrics.max_violation(load).max())

    # policy updates
    order = rng.permutation(B)
    chunks = np.array_split(order, config.mini_batches)
    adv = torch.as_tensor(batch.advantages, dtype=torch.float32)
    old_t = torch.as_tensor(logp_old, dtype=torch.float32)
    infer_t = torch.as_tensor(batch.logp_infer, dtype=torch.float32)
    tok_sample = torch.as_tensor(sample)
    stats: dict[str, list[float]] = {k: [] for k in ("loss", "clip_frac", "approx_kl", "grad_norm", "entropy",
                                                      "route_change", "used_route_change", "tis_weight_mean")}
    first_mb_gap = trainer_floor = 0.0
    for mb, idx in enumerate(np.sort(c) for c in chunks):
        idx_t = torch.as_tensor(idx)
        ids, mask, resp = batch.ids[idx_t], batch.mask[idx_t], batch.response[idx_t]
        sel = torch.isin(tok_sample, idx_t)
        # what the current policy would route natively, against the old policy's routes (what R2 freezes)
        now = score_batch(model, ids, mask, resp, record=True)
        now_routes = now.routes
        old_sub = native_routes.take(idx)
        stats["route_change"].append(float(metrics.set_differs(old_sub.values, now_routes.values).mean()))
        replay = None
        if config.mode == "R2":
            replay = old_sub
        elif config.mode == "R3":
            replay = batch.engine_routes.take(idx)
        cur = score_batch(model, ids, mask, resp, routes=replay, grad=True, entropy=True)
        logp, ent = cur.logprobs, cur.entropy
        # the routes this forward actually used, against the old policy's: 0 for R2 by construction
        used = now_routes if replay is None else replay.select_layers(now_routes.layer_ids)
        stats["used_route_change"].append(float(metrics.set_differs(old_sub.values, used.values).mean()))
        if mb == 0:  # the policy is still the old one: R2 must equal no replay here (its definition)
            first_mb_gap = float((logp.detach() - now.logprobs).abs().max())
            trainer_floor = metrics.k3_kl(now.logprobs.double().cpu().numpy(), logp_native[sel.numpy()])
        ratio = torch.exp(logp - old_t[sel])
        a = adv[tok_sample[sel]]
        unclipped = ratio * a
        clipped = torch.clamp(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * a
        per_token = -torch.minimum(unclipped, clipped)
        if config.tis_cap is not None:
            w = torch.clamp(torch.exp(old_t[sel] - infer_t[sel]), max=config.tis_cap)
            per_token = per_token * w
            stats["tis_weight_mean"].append(float(w.mean()))
        loss = per_token.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        opt.step()
        with torch.no_grad():
            lr = torch.log(ratio)
            stats["loss"].append(float(loss))
            stats["clip_frac"].append(float(((ratio - 1).abs() > config.clip_eps).float().mean()))
            stats["approx_kl"].append(float(((ratio - 1) - lr).mean()))
            stats["grad_norm"].append(float(gn))
            stats["entropy"].append(float(ent.mean()))
    for k, v in stats.items():
        rec[f"train/{k}"] = float(np.mean(v)) if v else None
    rec["routing/route_change_first_mb"] = stats["route_change"][0]
    rec["routing/route_change_last_mb"] = stats["route_change"][-1]
    rec["routing/used_route_change_last_mb"] = stats["used_route_change"][-1]
    pos = np.concatenate([np.arange(int(n)) for n in n_resp])
    rec["_tokens"] = {"sample": sample, "position": pos, "logp_infer": batch.logp_infer, "logp_old": logp_old,
                      "logp_native": logp_native, "flipped": flipped,
                      "flipped_layers": _response_rows(batch, differs.sum(axis=1)), "reward": batch.rewards[sample],
                      "first_mb_sample": np.isin(sample, np.sort(chunks[0]))}
    rec["train/first_mb_logp_gap_to_native"] = first_mb_gap
    # the trainer against itself: the same tokens under the same weights, scored in another batch composition
    rec["noise/k3_kl_trainer_vs_trainer"] = trainer_floor
    return rec


def _response_rows(batch: _Batch, per_row: np.ndarray) -> np.ndarray:
    """Select, for each sampled token, the value of its input position (t - 1) from per-route-row values."""
    out = []
    cu = batch.engine_routes.cu_seqlens
    for b in range(batch.ids.shape[0]):
        resp = np.flatnonzero(batch.response[b].numpy())
        out.append(per_row[cu[b] + resp - 1])
    return np.concatenate(out)


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
    with RolloutEngine(path, seed=base.seed, dtype=base.engine_dtype) as engine:
        for seed in seeds:
            for mode in modes:
                cfg = dataclasses.replace(base, mode=mode, seed=int(seed))
                out.append(run_rl(cfg, engine=engine, runs_root=runs_root, run_name=run_name(prefix, mode, seed),
                                  progress=progress))
    return out


COMPARISON_METRICS = (
    ("reward_mean", "reward", ".3f"),
    ("mismatch/k3_kl", "k3 KL", ".2e"),
    ("mismatch/extreme_frac_tau1.5", "F(1.5)", ".4f"),
    ("mismatch/logprob_abs_diff_mean", "mean abs dlogp", ".4f"),
    ("routing/engine_trainer_disagreement", "engine-trainer routing differs", ".3f"),
    ("routing/route_change_last_mb", "policy route change (last mini-batch)", ".3f"),
    ("routing/used_route_change_last_mb", "used routes vs old policy (last mini-batch)", ".3f"),
    ("train/clip_frac", "clip frac", ".3f"),
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
    """Markdown: one line per (model, mode), every cell min / median / max over seeds of the run's mean (one
    seed: its value alone, no range)."""
    head = ["model", "mode", "seeds x steps", *[label for _, label, _ in COMPARISON_METRICS],
            "reward rise (last - first quarter)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["mode"], f"{r['seeds']} x {r['steps']}"]
        one = r["seeds"] == 1
        for key, _, fmt in COMPARISON_METRICS:
            lo, mid, hi = r[key]
            cells.append(f"{mid:{fmt}}" if one else f"{mid:{fmt}} ({lo:{fmt}} - {hi:{fmt}})")
        lo, mid, hi = r["reward_rise"]
        cells.append(f"{mid:+.3f}" if one else f"{mid:+.3f} ({lo:+.3f} - {hi:+.3f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"

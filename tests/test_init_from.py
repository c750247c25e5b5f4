"""Saved policies (--save-every) and runs started from them (--init-from): a run of N steps and a run of k steps
saved, then resumed for N - k with the same seed, write the same step records (timings aside); the doctor checks
the saved format; the config refuses what a save cannot resume."""

import dataclasses
import json

import pytest

from r3lab.config import RLConfig
from r3lab.doctor import FAIL, OK, diagnose
from r3lab.errors import ConfigError, RunFormatError
from r3lab.experiments.rl import run_rl
from r3lab.paths import model_dir
from r3lab.runs import load
from r3lab.runs.policy import parse_init_from, policy_path, read_policy_meta, saved_steps

QUICK = RLConfig.quick(steps=4, mode="none")
TIMING = ("time_generate_s", "time_weight_sync_s", "time_step_s")


@pytest.fixture(scope="module")
def engine(engine_pool):
    with engine_pool.lease(model_dir(QUICK.model), seed=0) as eng:
        yield eng


def _strip(rec):
    return {k: v for k, v in rec.items() if k not in TIMING}


def test_a_resumed_run_writes_the_steps_the_straight_run_wrote(engine, tmp_path):
    full = run_rl(QUICK, engine=engine, runs_root=tmp_path, run_name="full", progress=False)
    part = run_rl(dataclasses.replace(QUICK, steps=2, save_every=2), engine=engine, runs_root=tmp_path,
                  run_name="part", progress=False)
    assert saved_steps(part.path) == [2]
    meta = read_policy_meta(policy_path(part.path, 2))
    assert meta["step"] == 2 and meta["optimizer"] and len(meta["rewards"]) == 2
    resumed = run_rl(dataclasses.replace(QUICK, init_from="part:2"), engine=engine, runs_root=tmp_path,
                     run_name="resumed", progress=False)
    assert [r["step"] for r in resumed.steps] == [2, 3]
    assert [_strip(r) for r in part.steps] == [_strip(r) for r in full.steps[:2]]
    assert [_strip(r) for r in resumed.steps] == [_strip(r) for r in full.steps[2:]]
    assert resumed.steps[0]["engine_weight_version"] == 2  # the engine synced to the saved policy's weights
    # a branch in another mode from the same save starts at the same step with other numbers
    branch = run_rl(dataclasses.replace(QUICK, init_from=str(part.path), mode="R3"), engine=engine,
                    runs_root=tmp_path, run_name="branch", progress=False)
    assert branch.steps[0]["step"] == 2 and branch.steps[0]["reward_mean"] == resumed.steps[0]["reward_mean"]
    assert branch.steps[0]["mismatch/k3_kl"] != resumed.steps[0]["mismatch/k3_kl"]
    # the doctor: the save checks out; a state file changed after the save fails, naming it
    assert load(part.path).summary["doctor/checks"]["saved policy"] == "ok"
    assert diagnose(part.path).check("saved policy").status == OK
    state = policy_path(part.path, 2) / "state.pt"
    b = state.read_bytes()
    state.write_bytes(b[:200] + bytes([b[200] ^ 1]) + b[201:])  # one bit flipped
    c = diagnose(part.path).check("saved policy")
    assert c.status == FAIL and "sha256" in c.worst
    with pytest.raises(ConfigError, match="sha256"):
        run_rl(dataclasses.replace(QUICK, init_from="part:2"), engine=engine, runs_root=tmp_path, run_name="bad",
               progress=False)


def test_a_saved_policy_of_an_unknown_version_is_refused(tmp_path):
    folder = policy_path(tmp_path / "run", 4)
    folder.mkdir(parents=True)
    (folder / "policy.json").write_text(json.dumps({"format": "r3lab-policy", "version": 99}))
    with pytest.raises(RunFormatError, match="version 99"):
        read_policy_meta(folder)
    (folder / "policy.json").write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(RunFormatError, match="format"):
        read_policy_meta(folder)


def test_the_config_and_the_command_line_carry_the_knobs_and_refuse_what_cannot_resume(tmp_path):
    assert parse_init_from("runs/a:12") == ("runs/a", 12) and parse_init_from("runs/a") == ("runs/a", None)
    args = dataclasses.replace(QUICK, save_every=5, init_from="x:5").to_cli_args()
    assert args[args.index("--save-every") + 1] == "5" and args[args.index("--init-from") + 1] == "x:5"
    assert "--save-every" not in QUICK.to_cli_args() and "--save-format" not in QUICK.to_cli_args()
    with pytest.raises(ConfigError, match="staleness"):
        RLConfig.quick(init_from="x:2", staleness=1)
    with pytest.raises(ConfigError, match="megatron"):
        RLConfig.quick(save_every=2, trainer="megatron")
    with pytest.raises(ConfigError, match="save-every"):
        RLConfig.quick(save_every=-1)
    with pytest.raises(ConfigError, match="no run folder"):
        run_rl(dataclasses.replace(QUICK, init_from=str(tmp_path / "nothing:2")), runs_root=tmp_path,
               progress=False)

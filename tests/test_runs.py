import json

import numpy as np
import pytest
from conftest import random_routes

from r3lab.errors import RunFormatError
from r3lab.runs import RUN_FORMAT_VERSION, RunWriter, list_runs, load, writer


def _write(tmp_path, name="r1", finish=True):
    w = RunWriter(tmp_path, name, "rl", {"lr": 1e-3, "modes": ("none", "R3"), "nan": float("nan")})
    for step in range(3):
        w.log_step({"step": step, "k3_kl": 1e-4 * (step + 1), "reward": np.float32(0.5)})
        w.write_tokens(step, {"sample": np.arange(4), "logp_infer": -np.arange(4.0), "flipped": np.array([0, 1, 0, 0])})
    routes = random_routes(np.random.default_rng(0), num_experts=16, top_k=2, num_layers=3, lengths=[3, 5])
    w.write_routes(1, "engine", routes)
    if finish:
        w.finish({"k3_kl": 3e-4})
    else:
        w.close()
    return w.path, routes


def test_round_trip(tmp_path):
    path, routes = _write(tmp_path)
    run = load(path)
    assert run.finished and run.kind == "rl" and run.name == "r1" and not run.truncated_last_line
    assert run.config == {"lr": 1e-3, "modes": ["none", "R3"], "nan": None}
    assert run.meta["version"] == RUN_FORMAT_VERSION and "numpy" in run.meta["versions"]
    assert run.steps["step"].tolist() == [0, 1, 2] and run.steps["k3_kl"].iloc[2] == pytest.approx(3e-4)
    tok = run.tokens()
    assert len(tok) == 12 and tok["step"].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert run.tokens([1])["flipped"].tolist() == [0, 1, 0, 0]
    assert run.routes(1, "engine") == routes
    assert run.summary == {"k3_kl": 3e-4}


def test_runs_are_never_overwritten(tmp_path):
    _write(tmp_path)
    with pytest.raises(RunFormatError, match="never overwritten"):
        RunWriter(tmp_path, "r1", "rl", {})
    with pytest.raises(RunFormatError, match="run name"):
        RunWriter(tmp_path, "../x", "rl", {})


def test_a_killed_run_reads_up_to_its_last_complete_step(tmp_path):
    path, _ = _write(tmp_path, finish=False)
    with open(path / "steps.jsonl", "a") as f:
        f.write('{"step": 3, "k3_')  # killed mid-write
    run = load(path)
    assert not run.finished and run.truncated_last_line and run.steps["step"].tolist() == [0, 1, 2]


def test_corrupt_and_unknown_files_are_named(tmp_path):
    path, _ = _write(tmp_path)
    lines = (path / "steps.jsonl").read_text().splitlines()
    (path / "steps.jsonl").write_text(lines[0] + "\nnot json\n" + lines[2] + "\n")
    with pytest.raises(RunFormatError, match="line 2 is not JSON"):
        load(path)
    meta = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(RunFormatError, match="version 99"):
        load(path)
    with pytest.raises(RunFormatError, match="no config.json"):
        load(tmp_path / "nothing")
    (tmp_path / "r2").mkdir()
    (tmp_path / "r2" / "config.json").write_text("{}")
    listed = dict(list_runs(tmp_path))
    assert all(isinstance(v, RunFormatError) for v in listed.values()) and len(listed) == 2
    good, _ = _write(tmp_path, "r3")
    (good / "tokens" / "step-000001.parquet").write_bytes(b"garbage")
    with pytest.raises(RunFormatError, match="parquet"):
        load(good).tokens([1])
    with pytest.raises(RunFormatError, match="no routes"):
        load(good).routes(2, "engine")
    (good / "routes" / "step-000001.engine.r3").write_bytes(b"R3RT garbage")
    with pytest.raises(ValueError):
        load(good).routes(1, "engine")


def test_bad_step_records_and_columns(tmp_path):
    w = RunWriter(tmp_path, "r", "rl", {})
    with pytest.raises(RunFormatError, match="integer 'step'"):
        w.log_step({"k3": 1.0})
    with pytest.raises(RunFormatError, match="one length"):
        w.write_tokens(0, {"a": np.zeros(3), "b": np.zeros(4)})
    w.close()


def test_load_runs_by_prefix_names_a_bad_run_and_kinds_are_checked(tmp_path):
    from r3lab.errors import R3LabError
    from r3lab.runs import load_runs

    for name in ("cmp-none-s0", "cmp-R3-s0", "other-R3-s0"):
        _write(tmp_path, name)
    assert [r.name for r in load_runs(tmp_path, "cmp-")] == ["cmp-R3-s0", "cmp-none-s0"]  # by name
    assert len(load_runs(tmp_path)) == 3
    with pytest.raises(R3LabError, match="no runs named 'x'"):
        load_runs(tmp_path, "x")
    with pytest.raises(R3LabError, match="does not exist"):
        load_runs(tmp_path / "nowhere")
    (tmp_path / "cmp-R2-s0").mkdir()
    (tmp_path / "cmp-R2-s0" / "config.json").write_text("{")
    with pytest.raises(RunFormatError, match="cmp-R2-s0.*not JSON"):
        load_runs(tmp_path, "cmp-")
    run = load(tmp_path / "other-R3-s0")
    assert run.require_kind("rl") is run
    with pytest.raises(R3LabError, match="'other-R3-s0' is a 'rl' run, not a drift run"):
        run.require_kind("drift")


def test_a_stopped_run_says_stopped_and_version_1_runs_still_read(tmp_path):
    from r3lab.runs import mark_stopped

    path, _ = _write(tmp_path, "stopped", finish=False)
    assert load(path).state == "running or killed"
    assert mark_stopped(path, "stopped from the dashboard") and not mark_stopped(path, "again")  # written once
    run = load(path)
    assert run.state == "stopped" and not run.finished
    assert run.stopped["steps"] == 3 and run.stopped["reason"] == "stopped from the dashboard"
    done, _ = _write(tmp_path, "done")
    assert not mark_stopped(done, "too late") and load(done).state == "finished"  # a finished run keeps its end
    with pytest.raises(RunFormatError, match="no config.json"):
        mark_stopped(tmp_path / "nothing", "x")
    # a run written by r3lab's format 1 (no stop mark, no r3lab-source) still reads
    old, _ = _write(tmp_path, "v1", finish=False)
    meta = json.loads((old / "config.json").read_text())
    meta["version"] = 1
    del meta["versions"]["r3lab-source"]
    (old / "config.json").write_text(json.dumps(meta))
    assert load(old).meta["version"] == 1 and load(old).state == "running or killed"
    (path / "stopped.json").write_text("{")
    with pytest.raises(RunFormatError, match="stopped.json.*not JSON"):
        load(path)


def test_a_writer_left_by_an_exception_marks_its_run_stopped(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with RunWriter(tmp_path, "ctrl-c", "rl", {}) as w:
            w.log_step({"step": 0})
            raise KeyboardInterrupt
    run = load(tmp_path / "ctrl-c")
    assert run.state == "stopped" and run.stopped["reason"] == "KeyboardInterrupt" and run.stopped["steps"] == 1


def test_the_run_records_which_r3lab_wrote_it(tmp_path):
    from pathlib import Path

    import r3lab

    path, _ = _write(tmp_path)
    assert load(path).meta["versions"]["r3lab-source"] == str(Path(r3lab.__file__).resolve().parent)


def test_r3lab_runs_names_its_folder_and_a_missing_folder_fails(tmp_path, capsys):
    from r3lab.cli import main
    from r3lab.runs import mark_stopped

    _write(tmp_path, "a-done")
    stopped, _ = _write(tmp_path, "b-stopped", finish=False)
    mark_stopped(stopped, "test")
    main(["runs", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"runs in {tmp_path}:"
    assert out[2].split() == ["a-done", "rl", "3", "finished"] and out[3].split() == ["b-stopped", "rl", "3", "stopped"]
    with pytest.raises(SystemExit) as e:
        main(["runs", str(tmp_path / "does-not-exist")])
    assert e.value.code != 0 and "does not exist" in str(e.value.code)
    (tmp_path / "empty").mkdir()
    main(["runs", str(tmp_path / "empty")])
    assert capsys.readouterr().out == f"no runs in {tmp_path / 'empty'}\n"


def test_r3lab_version_says_which_checkout_runs(capsys):
    from pathlib import Path

    import r3lab
    from r3lab.cli import main

    main(["--version"])
    out = capsys.readouterr().out.strip()
    assert out.startswith("r3lab ") and out.endswith(f" from {Path(r3lab.__file__).resolve().parent}")


def test_the_comparison_table_shows_no_range_for_one_seed():
    from r3lab.experiments.rl import COMPARISON_METRICS, comparison_table

    row = {"model": "m", "mode": "R3", "seeds": 1, "steps": 4, "reward_rise": (0.2, 0.2, 0.2),
           **{key: (0.153, 0.153, 0.153) for key, _, _ in COMPARISON_METRICS}}
    line = comparison_table([row]).splitlines()[2]
    assert " - " not in line and "(" not in line and "+0.200" in line
    three = comparison_table([{**row, "seeds": 3, "reward_rise": (0.1, 0.2, 0.3)}]).splitlines()[2]
    assert "+0.200 (+0.100 - +0.300)" in three  # several seeds: median (min - max), as the committed tables


# ---- the per-sample table (format 3) -------------------------------------------------------------------------------
def test_samples_round_trip_in_compact_dtypes(tmp_path):
    import pyarrow.parquet as pq

    from r3lab.runs import Samples

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 2**31 - 1, size=n) for n in (3, 1, 7)]
    responses = [rng.integers(0, 400, size=n) for n in (5, 2, 1)]
    logps = [-rng.random(len(r)).astype(np.float32).astype(np.float64) for r in responses]  # float32 values
    logps[1][0] = np.nan  # a token the engine did not sample (a multi-turn observation)
    sampled = [np.ones(len(r), bool) for r in responses]
    sampled[1][0] = False
    w = RunWriter(tmp_path, "s", "rl", {})
    f = w.write_samples(4, Samples.from_ids(prompts, responses, logps, sampled))
    w.write_samples(5, Samples.from_ids(prompts[:1], responses[:1], logps[:1]))
    w.finish({})
    run = load(tmp_path / "s")
    assert run.sample_steps() == [4, 5] and f.name == "step-000004.parquet"
    got = run.samples(4)
    for a, b in zip(prompts + responses, got.prompt_ids + got.response_ids, strict=True):
        assert b.dtype == np.int32 and np.array_equal(a, b)
    for a, b in zip(logps, got.logp_infer, strict=True):
        assert b.dtype == np.float32 and np.array_equal(a, b.astype(np.float64), equal_nan=True)
    assert [m.tolist() for m in got.sampled] == [m.tolist() for m in sampled] and run.samples(5).sampled is None
    table = pq.read_table(f)
    assert table.column("step").to_pylist() == [4, 4, 4]
    assert str(table.schema.field("prompt_ids").type.value_type) == "int32"


def test_bad_samples_are_refused_with_the_reason(tmp_path):
    from r3lab.runs import Samples

    with pytest.raises(RunFormatError, match=r"sample 0 prompt: token ids must be in \[0, 2147483647\]"):
        Samples.from_ids([[2**31]], [[1]], [np.zeros(1, np.float32)])
    with pytest.raises(RunFormatError, match="sample 0 response: token ids must be a 1-D integer"):
        Samples.from_ids([[1]], [[1.5]], [np.zeros(1, np.float32)])
    with pytest.raises(RunFormatError, match="not float32 values; storing them would round them"):
        Samples.from_ids([[1]], [[2]], [np.array([0.1])])
    with pytest.raises(RunFormatError, match="sample 0: 2 response tokens but 1 log-probs"):
        Samples.from_ids([[1]], [[2, 3]], [np.zeros(1, np.float32)])
    with pytest.raises(RunFormatError, match="needs a prompt and a response"):
        Samples.from_ids([[]], [[2]], [np.zeros(1, np.float32)])
    with pytest.raises(RunFormatError, match="2 response_ids for 1 samples"):
        Samples.from_ids([[1]], [[2], [3]], [np.zeros(1, np.float32)])
    w = RunWriter(tmp_path, "s", "rl", {})
    with pytest.raises(RunFormatError, match="takes r3lab.runs.Samples"):
        w.write_samples(0, {"prompt_ids": [[1]]})
    w.write_samples(0, Samples.from_ids([[1]], [[2]], [np.zeros(1, np.float32)]))
    w.finish({})
    run = load(tmp_path / "s")
    with pytest.raises(RunFormatError, match=r"no per-sample table for step 3 .*at steps \[0\]"):
        run.samples(3)
    (tmp_path / "s" / "samples" / "step-000000.parquet").write_bytes(b"garbage")
    with pytest.raises(RunFormatError, match="not a readable parquet file"):
        run.samples(0)


def test_a_run_records_the_thread_count_a_bitwise_rerun_needs(tmp_path, monkeypatch):
    """config.json's "threads": torch's thread count and OMP_NUM_THREADS / MKL_NUM_THREADS as set (None: unset)."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    path, _ = _write(tmp_path)
    meta = json.loads((path / "config.json").read_text())
    assert meta["threads"] == {"torch": torch.get_num_threads(), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": None}
    assert load(path).threads == meta["threads"]


def test_a_run_records_the_processor_its_kernels_followed(tmp_path):
    """config.json's "cpu": the model name and instruction-set flags as lscpu (util-linux) reads them; a run without
    the key (written before it) reads as None."""
    import shutil
    import subprocess
    from pathlib import Path

    path, _ = _write(tmp_path)
    meta = json.loads((path / "config.json").read_text())
    assert load(path).cpu == meta["cpu"] and set(meta["cpu"]) == {"model", *writer.CPU_FLAGS}
    keys = set()
    if Path("/proc/cpuinfo").is_file():
        keys = {line.split(":", 1)[0].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()}
    if "flags" not in keys:  # not x86 Linux (Arm names them "Features"): nothing claimed about the flags
        assert {meta["cpu"][f] for f in writer.CPU_FLAGS} == {None}
    if shutil.which("lscpu") is None or "model name" not in keys:  # the model name still names something
        assert meta["cpu"]["model"]
    else:
        fields = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True,
                                                                   env={"LC_ALL": "C"}).stdout.splitlines()
                      if ":" in line)
        assert meta["cpu"]["model"] == fields["Model name"].strip()
        if "flags" in keys:
            flags = set(fields["Flags"].split())
            assert {f: f in flags for f in writer.CPU_FLAGS} == {f: meta["cpu"][f] for f in writer.CPU_FLAGS}
    del meta["cpu"]
    (path / "config.json").write_text(json.dumps(meta))
    assert load(path).cpu is None


def test_rerun_command_runs_the_same_config_under_the_recorded_threads(tmp_path, monkeypatch):
    """The command parses back (r3lab's own parser) to the run's config; the thread variables lead it. A committed
    run written before threads were recorded still reads (threads None) and gets no prefix."""
    import shlex

    from r3lab.cli import _parser
    from r3lab.config import RLConfig, config_overrides

    def parsed(cmd):
        words = shlex.split(cmd)
        env = words[:words.index("r3lab")]
        args = _parser().parse_args(words[words.index("r3lab") + 1:])
        modes, seeds = args.modes, args.seeds  # the sweep flags: one each here
        return env, args, RLConfig(**config_overrides(args, RLConfig), mode=modes[0], seed=seeds[0])

    cfg = RLConfig.quick(task="chain", engine_quant="int4", mode="R2", seed=3, tis_cap=2.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    w = RunWriter(tmp_path, "c", "rl", cfg.to_dict())
    w.finish({})
    env, args, back = parsed(load(w.path).rerun_command("/tmp/x y", "again"))
    assert env == ["OMP_NUM_THREADS=1", "MKL_NUM_THREADS=2"]
    assert back == cfg and args.modes == ["R2"] and args.seeds == [3]
    assert args.runs == "/tmp/x y" and args.name == "again"
    # a run written before "threads" existed (as the committed phase and pilot runs were): the key absent
    w = RunWriter(tmp_path, "int4-R2-s0", "rl", RLConfig.quick(engine_quant="int4", mode="R2").to_dict())
    w.finish({})
    meta = json.loads((w.path / "config.json").read_text())
    del meta["threads"]
    (w.path / "config.json").write_text(json.dumps(meta))
    old = load(w.path)
    assert "threads" not in old.meta and old.threads is None
    env, args, back = parsed(old.rerun_command())
    assert env == [] and back == RLConfig.from_dict(old.config) and args.name == "int4"  # the folder: int4-R2-s0
    w = RunWriter(tmp_path, "tis-run", "rl", cfg.to_dict())  # a name without the -<mode>-s<seed> ending: kept whole
    w.finish({})
    assert parsed(load(w.path).rerun_command())[1].name == "tis-run"
    from r3lab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"RLConfig has no field\(s\) \['modes', 'nan'\]"):
        load(_write(tmp_path, "odd")[0]).rerun_command()  # a config that is no RLConfig: refused, naming the keys

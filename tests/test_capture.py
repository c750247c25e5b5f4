"""r3lab capture's inputs and RL's refusal of an attached engine, without a server (the runs against a user-started
server are in tests/test_attach.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from r3lab.config import ATTACHED_RL_REASON, CaptureConfig, RLConfig
from r3lab.errors import AttachError, ConfigError
from r3lab.experiments.capture import read_prompts, run_capture

ROOT = Path(__file__).resolve().parents[1]
QWEN = ROOT / "data/models/tiny-qwen3-moe"


def test_prompts_file_text_one_per_line(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("ka lo mi \n\n   \nse na\r\nlast line without newline")
    assert read_prompts(f) == ["ka lo mi ", "se na", "last line without newline"]  # as written, blank lines skipped


def test_prompts_file_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "ka lo", "id": 7}) + "\n\n" + json.dumps({"prompt": [5, 6, 7]}) + "\n")
    assert read_prompts(f) == ["ka lo", [5, 6, 7]]


@pytest.mark.parametrize("line, why", [
    ('{"prompt": "a"', "2: not JSON"),
    ('{"text": "a"}', '2: needs a "prompt"'),
    ('{"prompt": ""}', '2: needs a "prompt"'),
    ('{"prompt": [1, "x"]}', '2: needs a "prompt"'),
    ('{"prompt": [true]}', '2: needs a "prompt"'),
    ('["a"]', '2: needs a "prompt"'),
])
def test_prompts_file_jsonl_errors_name_the_line(tmp_path, line, why):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=why):
        read_prompts(f)


def test_prompts_file_missing_or_empty(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_prompts(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(ConfigError, match="holds no prompt"):
        read_prompts(tmp_path / "empty.txt")


def test_capture_config_checks():
    with pytest.raises(ConfigError, match="a local engine needs --model"):
        CaptureConfig()
    with pytest.raises(ConfigError, match="--engine-url must start with http"):
        CaptureConfig(engine_url="gpu-node:8000")
    with pytest.raises(ConfigError, match="--batch must be >= 1"):
        CaptureConfig(model="tiny-qwen3-moe", batch=0)
    assert CaptureConfig(engine_url="http://gpu-node:8000").model is None  # the served model, resolved on connect


def test_capture_refuses_an_existing_run_before_any_engine(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "p.txt").write_text("ka\n")
    with pytest.raises(Exception, match="runs are never overwritten"):
        run_capture(CaptureConfig(model=str(QWEN), engine_url="http://127.0.0.1:9"), tmp_path / "p.txt",
                    tmp_path / "run")


def test_capture_cli_needs_prompts_and_out(capsys):
    from r3lab.cli import main

    with pytest.raises(SystemExit):
        main(["capture", "--engine-url", "http://127.0.0.1:9"])
    assert "--prompts" in capsys.readouterr().err


def test_rl_refuses_an_attached_engine_with_the_reason(tmp_path, monkeypatch):
    """RLConfig(engine_url=...) and r3lab rl --engine-url refuse, saying why (weights cannot be pushed); run_rl on an
    attached client refuses before it loads a trainer."""
    from r3lab.cli import main
    from r3lab.experiments.rl import loop
    from r3lab.rollout import AttachedServer

    with pytest.raises(ConfigError, match="refused for RL: the RL loop pushes the trainer's updated weights") as e:
        RLConfig(engine_url="http://gpu-node:8000")
    assert e.value.field == "engine_url" and "NCCL or CUDA IPC" in str(e.value)
    assert "engine_url=" in e.value.phrase(lambda f: f + "=")
    from r3lab import widgets

    with pytest.raises(ConfigError, match="engine_url 'http://gpu-node:8000' is refused for RL"):  # notebooks 04/05
        widgets.rl_config(engine_url="http://gpu-node:8000")
    with pytest.raises(SystemExit) as ex:
        main(["rl", "--quick", "--engine-url", "http://gpu-node:8000", "--runs", str(tmp_path)])
    assert "--engine-url 'http://gpu-node:8000' is refused for RL" in str(ex.value) and not list(tmp_path.iterdir())

    def no_trainer(*_a, **_k):
        raise AssertionError("a trainer was loaded for an engine that cannot take its weights")

    monkeypatch.setattr(loop, "start_trainer", no_trainer)
    attached = AttachedServer("http://127.0.0.1:9", model=QWEN, handshake=False)
    with pytest.raises(AttachError, match="RL cannot run on the attached server at http://127.0.0.1:9") as e2:
        loop.run_rl(RLConfig.quick(), engine=attached, runs_root=tmp_path)
    assert ATTACHED_RL_REASON in str(e2.value) and not list(tmp_path.iterdir())
    with pytest.raises(AttachError, match="cannot push the trainer's weights"):
        attached.update_weights(None, version=1)

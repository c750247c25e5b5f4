"""scripts/byte_check.py's comparison: two run folders are the same when only their timing fields and the RL runs'
start times in their names differ, and any other byte or value that differs is reported."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("byte_check", ROOT / "scripts" / "byte_check.py")
byte_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(byte_check)


def _run(root: Path, name: str, *, seconds: float, reward: float, token_byte: int) -> None:
    run = root / name
    (run / "tokens").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"seed": 0, "created": f"t{seconds}",
                                                 "versions": {"r3lab-source": str(root)}}))
    steps = [{"step": i, "reward_mean": reward, "time_step_s": seconds + i, "mismatch/time_x": seconds}
             for i in range(3)]
    (run / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (run / "tokens" / "step-000000.bin").write_bytes(bytes([1, 2, token_byte]))


def test_runs_that_differ_only_in_timings_and_start_times_are_identical(tmp_path):
    _run(tmp_path / "a", "rl-m-20261205-101010-R3-s0", seconds=1.0, reward=0.5, token_byte=3)
    _run(tmp_path / "b", "rl-m-20261205-121212-R3-s0", seconds=9.0, reward=0.5, token_byte=3)
    assert byte_check.compare(tmp_path / "a", tmp_path / "b") == []


def test_a_moved_value_or_byte_is_reported(tmp_path):
    _run(tmp_path / "a", "drift", seconds=1.0, reward=0.5, token_byte=3)
    _run(tmp_path / "b", "drift", seconds=1.0, reward=0.5000001, token_byte=3)
    _run(tmp_path / "c", "drift", seconds=1.0, reward=0.5, token_byte=4)
    assert byte_check.compare(tmp_path / "a", tmp_path / "b") == ["drift/steps.jsonl: records differ (3 against 3)"]
    assert byte_check.compare(tmp_path / "a", tmp_path / "c") == ["drift/tokens/step-000000.bin: bytes differ"]


def test_a_missing_run_is_reported(tmp_path):
    _run(tmp_path / "a", "drift", seconds=1.0, reward=0.5, token_byte=3)
    (tmp_path / "b").mkdir()
    assert byte_check.compare(tmp_path / "a", tmp_path / "b")[0].startswith("run folders differ")

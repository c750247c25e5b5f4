"""r3lab.rollout.connect against vLLM servers started the way a user starts them (not through r3lab).

Each server is ``python -m vllm.entrypoints.openai.api_server ...`` in its own process group (start_new_session;
tests/user_vllm.py), started lazily, one user server alive at a time, and its group is ended in the fixture's
teardown even when a test fails. The tests that read the Qwen3 user server run next to each other on one start of
it (the test that kills it comes last of them); the reference two tests compare with is the session's in-process
engine of the same model and seed (tests/test_rollout.py holds r3lab's own RolloutServer to the same engine). Two
user servers start in all: the Qwen3 one (another model's checkpoint is checked against it too) and, last, one
without routes.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest
from user_vllm import GLM, QWEN, UserServers
from user_vllm import free_port as _free_port

from r3lab.errors import AttachError, RolloutError
from r3lab.rollout import SamplingConfig, connect


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[UserServers]:
    s = UserServers(tmp_path_factory.mktemp("user-vllm"))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def own_engine(engine_pool):
    """The same model and seed in this process (the session's engine, as a fresh start leaves it): what an attached
    server's answers are compared with. (tests/test_rollout.py compares r3lab's own RolloutServer with it too.)"""
    return engine_pool.engine(QWEN, seed=0)


@pytest.fixture(scope="module")
def attached_drift(servers, tmp_path_factory):
    """``r3lab drift --engine-url`` on the Qwen3 user server (with an API key set that the server does not ask
    for: ignored), run once for the two tests that read it: its config, its run folder and the samples its trainer
    scored."""
    from r3lab.config import DriftConfig
    from r3lab.experiments.drift import run_drift

    cfg = DriftConfig(models=(str(QWEN),), prompts=3, max_tokens=8, seeds=(0,), trainer_dtypes=("float32",),
                      engine_url=servers.get(QWEN))
    root, seen = tmp_path_factory.mktemp("attached-drift"), []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R3LAB_ENGINE_API_KEY", "key-that-must-not-land-in-a-run")
        rows = run_drift(cfg, progress=False, runs_root=root, run_name="drift",
                         on_trainer=lambda label, trainer, res: seen.extend(res))
    return cfg, root / "drift", rows, seen


def test_capture_equals_drift_and_rescores(servers, attached_drift, tmp_path, monkeypatch):
    """r3lab capture through the attached server gives the drift run's prompts, tokens, engine log-probs and routes
    for the same prompts and sampling seed (text prompts, and the same prompts as JSONL token ids); r3lab rescore
    scores it with the trainer exactly as the drift run's trainer scored those tokens; the API key stays out of it."""
    import json

    from r3lab import doctor
    from r3lab.cli import main
    from r3lab.config import CaptureConfig
    from r3lab.experiments.capture import run_capture
    from r3lab.experiments.drift import seed_inputs
    from r3lab.experiments.rescore import rescore_run, rescore_table
    from r3lab.runs import load

    monkeypatch.setenv("R3LAB_ENGINE_API_KEY", "key-that-must-not-land-in-a-run")  # the server has none: ignored
    url = servers.get(QWEN)
    cfg, drift_dir, _, _ = attached_drift
    assert cfg.engine_url == url  # the drift ran on the server this test captures from
    prompts, sp = seed_inputs(cfg, 0)
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n\n")  # a trailing blank line is skipped
    main(["capture", "--engine-url", url, "--prompts", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "cap"),
          "--tokens", "8", "--seed", str(sp.seed), "--temperature", str(sp.temperature), "--no-progress"])
    drift, cap = load(drift_dir), load(tmp_path / "cap")
    assert (cap.kind, cap.state, cap.config["model"]) == ("capture", "finished", str(QWEN))  # --model: the served one
    assert cap.config["engine"] == {"url": url, "served_model": str(QWEN), "max_model_len": 512}
    assert "key-that-must-not" not in (tmp_path / "cap" / "config.json").read_text()
    a, b = drift.samples(0), cap.samples(0)
    assert len(a) == len(b) == 3
    assert [p.tolist() for p in a.prompt_ids] == [p.tolist() for p in b.prompt_ids]
    assert [r.tolist() for r in a.response_ids] == [r.tolist() for r in b.response_ids]
    for x, y in zip(a.logp_infer, b.logp_infer, strict=True):
        np.testing.assert_array_equal(x, y)
    ra, rb = drift.routes(0, "engine"), cap.routes(0, "engine")
    np.testing.assert_array_equal(ra.cu_seqlens, rb.cu_seqlens)
    np.testing.assert_array_equal(ra.values, rb.values)
    assert cap.tokens([0])["logp_infer"].to_numpy().size == sum(r.size for r in b.response_ids)
    report = doctor.diagnose(tmp_path / "cap")
    assert not report.failed, report.text()

    ids = tmp_path / "prompts.jsonl"
    ids.write_text("".join(json.dumps({"prompt": p.tolist(), "note": "ignored"}) + "\n" for p in a.prompt_ids))
    again = load(run_capture(CaptureConfig(model=str(QWEN), max_tokens=8, seed=sp.seed, temperature=sp.temperature,
                                           engine_url=url), ids, tmp_path / "cap-ids", progress=False))
    assert [r.tolist() for r in again.samples(0).response_ids] == [r.tolist() for r in b.response_ids]
    np.testing.assert_array_equal(again.routes(0, "engine").values, rb.values)

    rescored = load(rescore_run(tmp_path / "cap", trainer="hf"))
    assert rescored.config["source_kind"] == "capture" and rescored.config["trainer_dtypes"] == ["float32"]
    ta, tr = drift.tokens([0]), rescored.tokens([0])
    for col in ("logp_infer", "logp_none", "logp_r3", "flipped"):  # the drift run's float32 trainer, token for token
        np.testing.assert_array_equal(ta[col].to_numpy(), tr[col].to_numpy(), err_msg=col)
    np.testing.assert_array_equal(drift.routes(0, "trainer").values, rescored.routes(0, "trainer").values)
    assert np.isfinite(rescored.step_records[0]["k3_none"]) and "engine-only capture" in rescore_table(rescored)


def test_attached_equals_the_engine(servers, own_engine):
    """Same tokens, log-probabilities and routes as the in-process engine for the same seed."""
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
    sp = SamplingConfig(max_tokens=12, seed=3, n=2)
    url = servers.get(QWEN)
    with connect(url, model=QWEN) as eng:
        assert eng.served_name == str(QWEN)
        assert eng.max_model_len == 512
        attached = eng.generate(prompts, sp)
        with pytest.raises(AttachError, match="cannot push the trainer's weights"):
            eng.update_weights()
    own = own_engine.generate(prompts, sp)
    assert len(attached) == len(own) == 6
    for a, b in zip(attached, own, strict=True):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.response_ids == b.response_ids
        np.testing.assert_array_equal(a.routes.values, b.routes.values)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)  # a server's and the engine's, as test_rollout


def test_drift_through_attached_server(attached_drift, own_engine):
    """r3lab drift --engine-url: the run's samples are the ones the in-process engine gives for the same seed
    inputs."""
    from transformers import AutoTokenizer

    from r3lab.experiments.drift import seed_inputs

    cfg, _, rows, seen = attached_drift
    assert len(rows) == 1 and np.isfinite(rows[0].summary["k3_engine_floor"])
    prompts, sp = seed_inputs(cfg, 0)
    tok = AutoTokenizer.from_pretrained(str(QWEN))
    own = own_engine.generate([tok.encode(p, add_special_tokens=False) for p in prompts], sp)
    assert [r.token_ids for r in seen] == [r.token_ids for r in own]
    for a, b in zip(seen, own, strict=True):
        np.testing.assert_array_equal(a.routes.values, b.routes.values)


def test_server_of_another_model(servers):
    """A Qwen3 server, the GLM checkpoint here (same layer count, top-k and experts; GLM's layer 0 is dense): the
    probe's routes in that layer name the mismatch and both models. (The other way round, a GLM server against the
    Qwen3 checkpoint, is tests/test_attach_handshake.py's, on the probe answer a real GLM server gives.)"""
    url = servers.get(QWEN)
    with pytest.raises(AttachError, match=r"dense layers \[0\] \(from the config\) hold expert ids") as e:
        connect(url, model=GLM)
    msg = str(e.value)
    assert "tiny-qwen3-moe" in msg and "tiny-glm4-moe" in msg and "--model" in msg and url in msg


def test_server_dies_mid_run(servers, tmp_path, monkeypatch):
    """A client's next request names the server that went away; so does a capture run whose server dies after its
    first request, and that run is marked stopped (no summary, no step written), never half-written."""
    from r3lab.config import CaptureConfig
    from r3lab.corpus import corpus_prompts
    from r3lab.experiments.capture import run_capture
    from r3lab.rollout import AttachedServer
    from r3lab.runs import load, read_stopped

    url = servers.get(QWEN)
    eng = connect(url, model=QWEN, retries=1, timeout_s=30)
    eng.generate([[5, 6, 7]], SamplingConfig(max_tokens=4, seed=0))
    assert servers.proc is not None
    real, sent = AttachedServer.generate, []

    def generate_then_kill(self, *args, **kwargs):  # the server dies once the first request came back
        out = real(self, *args, **kwargs)
        sent.append(len(out))
        os.killpg(servers.proc.pid, signal.SIGKILL)
        servers.proc.wait(30)
        return out

    monkeypatch.setattr(AttachedServer, "generate", generate_then_kill)
    (tmp_path / "p.txt").write_text("\n".join(corpus_prompts(3, seed=0)))
    with pytest.raises(AttachError, match="unreachable or went away") as e:
        run_capture(CaptureConfig(model=str(QWEN), max_tokens=4, batch=1, engine_url=url), tmp_path / "p.txt",
                    tmp_path / "cap", progress=False)
    assert url in str(e.value) and sent == [1]
    run = load(tmp_path / "cap")
    assert run.state == "stopped" and not run.step_records and not (tmp_path / "cap" / "summary.json").exists()
    assert url in read_stopped(tmp_path / "cap")["reason"]
    monkeypatch.undo()
    servers.stop()
    with pytest.raises(AttachError, match="unreachable or went away") as e:
        eng.generate([[5, 6, 7]], SamplingConfig(max_tokens=4, seed=0))
    assert url in str(e.value)


def test_server_without_routes_names_the_flag(servers):
    url = servers.get(QWEN, routes=False)
    with pytest.raises(AttachError, match="--enable-return-routed-experts") as e:
        connect(url, model=QWEN)
    assert url in str(e.value)


def test_drift_run_marked_stopped_when_server_is_gone(tmp_path):
    """A drift run whose server is gone is marked stopped (stopped.json names the server), never left half-written."""
    import json

    from r3lab.config import DriftConfig
    from r3lab.experiments.drift import run_drift

    url = f"http://127.0.0.1:{_free_port()}"
    cfg = DriftConfig(models=(str(QWEN),), prompts=2, max_tokens=4, seeds=(0,), trainer_dtypes=("float32",),
                      engine_url=url)
    with pytest.raises(AttachError, match="went away"):
        run_drift(cfg, progress=False, runs_root=tmp_path, run_name="gone")
    run = tmp_path / "gone"
    assert not (run / "summary.json").exists()
    stopped = json.loads((run / "stopped.json").read_text())
    assert stopped["state"] == "stopped" and url in stopped["reason"]


def test_bad_url_and_unreachable_server():
    with pytest.raises(AttachError, match="http://"):
        connect("localhost:1", model=QWEN)
    with pytest.raises(AttachError, match="went away"):
        connect(f"http://127.0.0.1:{_free_port()}", model=QWEN, retries=0, timeout_s=2)
    assert issubclass(AttachError, RolloutError)

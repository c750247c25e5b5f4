"""NeMo-RL and prime-rl importers against dumps laid out as their writers lay them out (7ea279ab, 559b4477).

Oracles are the raw files, read here independently of the importers: NeMo's length-1 lists unwrapped by hand,
prime-rl's ``null`` log-probs and its msgpack micro-batches decoded by hand, metrics from r3lab.metrics on the
tokens the test selects itself.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import make_dumps as md
import msgpack
import numpy as np
import pytest

from r3lab import doctor, metrics, runs
from r3lab.errors import ImportFormatError
from r3lab.importers import nemo_rl, prime_rl, sample_tokens
from r3lab.importers.nemo_rl import import_nemo_rl
from r3lab.importers.prime_rl import import_prime_rl

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "data" / "models" / "tiny-qwen3-moe" / "config.json"


def _nemo_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        assert all(isinstance(v, list) and len(v) == 1 for k, v in d.items() if k != "idx")  # the writer's shape
        out.append({k: (v if k == "idx" else v[0]) for k, v in d.items()})
    return out


def test_nemo_rl_reads_length_1_values_steps_from_1_and_advantages(tmp_path):
    src = md.nemo_rl_dump(tmp_path / "logs", exp_dir="exp_001")
    run = runs.load(import_nemo_rl(tmp_path / "logs", tmp_path / "run"))
    assert run.token_steps() == [1, 2] and run.route_steps("engine") == []  # r3lab step = NeMo's N
    assert run.summary["samples"] == 16 and "samples_trainer_logprobs_placeholder" not in run.summary
    for rec in run.step_records:
        step = rec["step"]
        lines = _nemo_lines(src / "exp_001" / f"train_data_step{step}.jsonl")
        toks, full = run.tokens([step]), sample_tokens(run.path, step)
        assert rec["samples"] == len(lines) == len(full) == 8
        lt, li = [], []
        for i, d in enumerate(lines):
            n = d["input_lengths"]
            P = d["token_loss_mask"].index(1)
            t = toks[toks["sample"] == i]
            want_mask = [m * int(d["sample_loss_mask"]) for m in d["token_loss_mask"][P:n]]
            assert full[i].tolist() == d["token_ids"][:n]
            assert t["logp_infer"].tolist() == d["generation_logprobs"][P:n]
            assert t["logp_train"].tolist() == d["prev_logprobs"][P:n]
            assert t["advantage"].tolist() == d["advantages"][P:n]
            assert t["loss_mask"].tolist() == want_mask
            assert t["reward"].iloc[0] == d["rewards"] and t["index"].iloc[0] == d["idx"]
            on = np.asarray(want_mask) > 0
            lt.append(np.asarray(d["prev_logprobs"][P:n])[on])
            li.append(np.asarray(d["generation_logprobs"][P:n])[on])
        want = metrics.mismatch_metrics(np.concatenate(lt), np.concatenate(li))
        assert rec["mismatch/k3_kl"] == pytest.approx(want["k3_kl"]) and rec["mismatch/tokens"] == want["tokens"]
        sample0 = toks[toks["sample"] == 0]["loss_mask"].tolist()
        assert sample0[:3] == [1, 0, 0]  # the environment turn stays masked
        assert toks[toks["sample"] == 2]["loss_mask"].sum() == 0  # sample_loss_mask 0: not trained on


def test_nemo_rl_force_on_policy_zeros_are_not_trainer_logprobs(tmp_path):
    md.nemo_rl_dump(tmp_path / "dump", force_on_policy=True)
    run = runs.load(import_nemo_rl(tmp_path / "dump", tmp_path / "run", config=QWEN))
    assert "logp_train" not in run.tokens([1]).columns and "logp_infer" in run.tokens([1]).columns
    assert run.summary["samples_trainer_logprobs_placeholder"] == 16
    assert not any("mismatch/k3_kl" in r for r in run.step_records)
    assert "force_on_policy_ratio" in run.config["note"]
    report = doctor.diagnose(run.path)
    assert report.ok and report.check("k3").status == doctor.SKIP


def test_nemo_rl_one_placeholder_sample_among_real_ones_is_nan_not_zero(tmp_path):
    src = md.nemo_rl_dump(tmp_path / "dump", steps=1)
    f = src / "train_data_step1.jsonl"
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    lines[3]["prev_logprobs"] = [[0.0] * len(lines[3]["prev_logprobs"][0])]
    f.write_text("".join(json.dumps(d) + "\n" for d in lines))
    run = runs.load(import_nemo_rl(src, tmp_path / "run"))
    t = run.tokens([1])
    assert t[t["sample"] == 3]["logp_train"].isna().all() and t[t["sample"] != 3]["logp_train"].notna().all()
    assert run.summary["samples_trainer_logprobs_placeholder"] == 1
    d = _nemo_lines(f)
    on = [np.asarray(x["token_loss_mask"][x["token_loss_mask"].index(1):x["input_lengths"]]) > 0 for x in d]
    masked3 = int(on[3].sum()) * int(d[3]["sample_loss_mask"])
    assert run.step_records[0]["logp_missing"] == int(on[3].sum())
    assert run.step_records[0]["mismatch/tokens"] == sum(int(o.sum()) * int(x["sample_loss_mask"])
                                                        for o, x in zip(on, d, strict=True)) - masked3


def test_nemo_rl_source_folders_and_refusals(tmp_path):
    md.nemo_rl_dump(tmp_path / "logs", exp_dir="exp_001")
    md.nemo_rl_dump(tmp_path / "logs", exp_dir="exp_002")
    with pytest.raises(ImportFormatError, match="2 folders.*exp_001.*exp_002"):
        import_nemo_rl(tmp_path / "logs", tmp_path / "run")
    one = tmp_path / "logs" / "exp_002" / "train_data_step2.jsonl"
    assert runs.load(import_nemo_rl(one, tmp_path / "run1")).token_steps() == [2]
    bad = tmp_path / "bad" / "train_data_step1.jsonl"
    bad.parent.mkdir()
    d = json.loads(one.read_text().splitlines()[0])
    bad.write_text(json.dumps({**d, "token_ids": d["token_ids"] * 2}) + "\n")
    with pytest.raises(ImportFormatError, match="token_ids holds 2 sequences"):
        import_nemo_rl(bad, tmp_path / "run2")
    bad.write_text(json.dumps({k: v for k, v in d.items() if k != "prev_logprobs"}) + "\n")
    with pytest.raises(ImportFormatError, match=r"line 1: no \['prev_logprobs'\]"):
        import_nemo_rl(bad, tmp_path / "run3")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImportFormatError, match="no train_data_step"):
        import_nemo_rl(tmp_path / "empty", tmp_path / "run4")


def _prime_lines(root: Path, step: int) -> list[dict]:
    d = root / "token_exports" / f"step_{step}"
    files = sorted(d.glob("rank_*.jsonl"), key=lambda f: int(f.stem.split("_")[1]))
    return [json.loads(x) for f in files for x in f.read_text().splitlines()]


def test_prime_rl_nulls_are_missing_tokens_and_metrics_use_the_rest(tmp_path):
    src = md.prime_rl_dump(tmp_path / "out", unfinished=True)
    run = runs.load(import_prime_rl(src, tmp_path / "run"))
    assert run.token_steps() == [1, 2] and run.config["unfinished_steps"] == [3]
    missing_total = 0
    for rec in run.step_records:
        lines = _prime_lines(src, rec["step"])
        toks = run.tokens([rec["step"]])
        assert rec["samples"] == len(lines) == len(sample_tokens(run.path, rec["step"]))
        lt, li, missing = [], [], 0
        for i, d in enumerate(lines):
            P = d["loss_mask"].index(True)
            t = toks[toks["sample"] == i]
            f = [np.nan if x is None else x for x in d["trainer_logprobs"][P:]]
            g = [np.nan if x is None else x for x in d["inference_logprobs"][P:]]
            np.testing.assert_array_equal(t["logp_train"].to_numpy(), np.asarray(f))
            np.testing.assert_array_equal(t["logp_infer"].to_numpy(), np.asarray(g))
            assert t["advantage"].tolist() == d["advantages"][P:]
            assert t["loss_mask"].tolist() == [int(x) for x in d["loss_mask"][P:]]
            on = np.asarray(d["loss_mask"][P:])
            both = on & np.isfinite(f) & np.isfinite(g)
            missing += int((on & ~both).sum())
            lt.append(np.asarray(f)[both])
            li.append(np.asarray(g)[both])
        assert missing == 1 and rec.get("logp_missing", 0) == missing
        missing_total += missing
        want = metrics.mismatch_metrics(np.concatenate(lt), np.concatenate(li))
        assert rec["mismatch/k3_kl"] == pytest.approx(want["k3_kl"]) and rec["mismatch/tokens"] == want["tokens"]
    assert run.summary["masked_tokens_without_logp"] == missing_total == 2
    assert "reward" not in run.tokens([1]).columns  # prime-rl exports no reward


def test_prime_rl_a_step_without_stable_is_skipped_and_none_finished_is_refused(tmp_path):
    src = md.prime_rl_dump(tmp_path / "out", steps=0, unfinished=True)
    with pytest.raises(ImportFormatError, match=r"steps \[1\] have no STABLE"):
        import_prime_rl(src, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _bin_rows(src: Path, step: int, line: dict, cp: int) -> np.ndarray:
    """The route rows of one export line, decoded here from rank_{R // cp}.bin with msgpack and field positions."""
    mbs = msgpack.unpackb((src / "rollouts" / f"step_{step}" / f"rank_{line['rank'] // cp}.bin").read_bytes())
    mb = mbs[line["micro_step"]]
    off = sum(mb[5][:line["micro_sequence_idx"]])
    n = len(line["token_ids"])
    assert mb[0][off:off + n] == line["token_ids"]
    data, shape, dtype = mb[10]
    return np.frombuffer(data, dtype=dtype).reshape(shape)[off:off + n - 1]


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("qwen3", [True, False], ids=["tiny-qwen3-moe", "glm-style"])
def test_prime_rl_routes_from_rollout_micro_batches(tmp_path, cp, qwen3):
    src = md.prime_rl_dump(tmp_path / "out", routes_bin=True, cp=cp, qwen3=qwen3)
    cfg = QWEN if qwen3 else md.model_config(tmp_path / "m")
    run = runs.load(import_prime_rl(src, tmp_path / "run", config=cfg))
    moe = list(range(md.LAYERS)) if qwen3 else list(md.MOE)
    assert run.route_steps("engine") == [1, 2] and run.summary["samples_without_routes"] == 0
    for step in (1, 2):
        r = run.routes(step, "engine")
        lines = _prime_lines(src, step)
        assert len(r) == len(lines) and r.layer_ids.tolist() == moe
        for i, d in enumerate(lines):
            want = _bin_rows(src, step, d, cp)[:, moe, :]
            assert np.array_equal(r.sequence(i).astype(np.int64), want.astype(np.int64))
    assert doctor.diagnose(run.path).ok


def test_source_files_are_hashed_by_relative_path_so_each_steps_rank_file_is_kept(tmp_path):
    """prime-rl names every step's export rank_0.jsonl: keyed by file name, the hashes of all but one collided."""
    import hashlib

    src = md.prime_rl_dump(tmp_path / "out", routes_bin=True)
    run = runs.load(import_prime_rl(src, tmp_path / "run", config=md.model_config(tmp_path / "m")))
    got = run.config["source"]["files"]
    want = {f.relative_to(src).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in [*src.glob("token_exports/step_*/rank_*.jsonl"), *src.glob("rollouts/step_*/rank_*.bin")]}
    assert len(want) == len(run.config["source"]["paths"]) == 2 * 2 * 2  # steps x ranks x (export, micro-batches)
    assert got == want


def test_prime_rl_routes_need_config_and_a_join_that_holds(tmp_path):
    src = md.prime_rl_dump(tmp_path / "out", routes_bin=True, steps=1)
    with pytest.raises(ImportFormatError, match="--config"):
        import_prime_rl(src, tmp_path / "run0")
    b = src / "rollouts" / "step_1" / "rank_1.bin"
    mbs = msgpack.unpackb(b.read_bytes())
    mbs[0][0] = [t + 1 for t in mbs[0][0]]  # its input_ids no longer match the export: no join
    b.write_bytes(msgpack.packb(mbs, use_bin_type=True))
    run = runs.load(import_prime_rl(src, tmp_path / "run1", config=md.model_config(tmp_path / "m")))
    lost = sum(1 for d in _prime_lines(src, 1) if d["rank"] == 1 and d["micro_step"] == 0)
    assert lost > 0 and run.summary["samples_without_routes"] == lost
    assert doctor.diagnose(run.path).check("route rows").status == doctor.FAIL
    b.write_bytes(b"\xc1 not msgpack")
    with pytest.raises(ImportFormatError, match="not a msgpack list"):
        import_prime_rl(src, tmp_path / "run2", config=md.model_config(tmp_path / "m"))


def test_prime_rl_micro_batches_without_routes_import_as_a_run_without_routes(tmp_path):
    src = md.prime_rl_dump(tmp_path / "out", routes_bin=True, engine_routes=False)
    assert (src / "rollouts" / "step_1" / "rank_0.bin").exists()
    run = runs.load(import_prime_rl(src, tmp_path / "run", config=QWEN))
    assert run.route_steps("engine") == [] and run.config["model"]["moe_layer_ids"] == list(range(8))
    assert doctor.diagnose(run.path).ok


def test_detect_and_options(tmp_path):
    n = md.nemo_rl_dump(tmp_path / "logs", exp_dir="exp_001")
    p = md.prime_rl_dump(tmp_path / "out", routes_bin=True)
    assert "NeMo-RL" in nemo_rl.detect(n) and "NeMo-RL" in nemo_rl.detect(n / "exp_001")
    assert nemo_rl.detect(n / "exp_001" / "train_data_step1.jsonl")
    assert nemo_rl.detect(p) is None and prime_rl.detect(n) is None
    assert "prime-rl" in prime_rl.detect(p) and "prime-rl" in prime_rl.detect(p / "token_exports")
    for mod, fn in ((nemo_rl, import_nemo_rl), (prime_rl, import_prime_rl)):
        kw = {k for k, v in inspect.signature(fn).parameters.items() if v.kind is v.KEYWORD_ONLY}
        assert set(mod.OPTIONS) == kw and all(mod.OPTIONS.values())


@pytest.mark.parametrize("kind", ["nemo-rl", "prime-rl"])
def test_tiny_qwen3_moe_dumps_import_and_pass_the_doctor(tmp_path, capsys, kind):
    """The held-out path: a dump shaped for data/models/tiny-qwen3-moe, imported with its config, then
    ``r3lab doctor RUN`` on the command line with no failing check."""
    from r3lab.cli import main

    if kind == "nemo-rl":
        src = md.nemo_rl_dump(tmp_path / "logs", exp_dir="exp_001", vocab=md.QWEN_VOCAB)
        path = import_nemo_rl(src, tmp_path / "run", config=QWEN)
    else:
        src = md.prime_rl_dump(tmp_path / "out", routes_bin=True, qwen3=True, unfinished=True)
        path = import_prime_rl(src, tmp_path / "run", config=QWEN)
    run = runs.load(path)
    assert run.token_steps() == [1, 2] and [r["samples"] for r in run.step_records] == [8, 8]
    assert run.config["model"]["moe_layer_ids"] == list(range(8)) and "logp_train" in run.tokens([1]).columns
    assert run.route_steps("engine") == ([] if kind == "nemo-rl" else [1, 2])
    main(["doctor", str(path)])
    assert "0 failed" in capsys.readouterr().out


# --- issue 37: prime-rl's batches/ transport, payload handles, routing weights; layouts named (tests/dumps_prime.py)

def _run_cli(capsys, argv: list[str]) -> str:
    from r3lab.cli import main

    main(argv)
    return capsys.readouterr().out + capsys.readouterr().err


def _lines_of(src: Path, step: int) -> list[dict]:
    return _prime_lines(src, step)


@pytest.mark.parametrize("mode,layout", [("inline", None), ("payload", "payload-handles"),
                                         ("trr", "routes-ids-weights-int32"), ("v1", "routed-experts-v1")])
def test_prime_rl_batches_layouts_import_by_kind_and_auto_alike(tmp_path, capsys, mode, layout):
    import dumps_prime as dp

    src, truth = dp.prime_batches_dump(tmp_path / "out", routes=mode, run_id="run-7" if mode == "payload" else None)
    paths = {}
    for kind in ("prime-rl", "auto"):
        out = tmp_path / f"run-{kind}"
        _run_cli(capsys, ["import", kind, str(src), "--out", str(out), "--config", str(QWEN)])
        paths[kind] = out
    a, b = runs.load(paths["prime-rl"]), runs.load(paths["auto"])
    assert b.config["source"]["format"] == "prime-rl"
    want_layouts = ["export-v1-runs", "microbatch-20"] + ([layout] if layout else [])
    assert a.config["source_layouts"] == b.config["source_layouts"] == want_layouts
    for run in (a, b):
        assert run.token_steps() == run.route_steps("engine") == [1, 2]
        assert [r["samples"] for r in run.step_records] == [len(truth[1]), len(truth[2])] == [8, 8]
        for step in (1, 2):
            lines, toks, r = _lines_of(src, step), run.tokens([step]), run.routes(step, "engine")
            assert [d["token_ids"] for d in lines] == [t["tokens"] for t in truth[step]]
            for i, (d, want) in enumerate(zip(lines, truth[step], strict=True)):
                P = d["loss_mask"].index(True)
                t = toks[toks["sample"] == i]
                np.testing.assert_array_equal(t["logp_train"].to_numpy(), np.asarray(d["trainer_logprobs"][P:]))
                np.testing.assert_array_equal(t["logp_infer"].to_numpy(), np.asarray(d["inference_logprobs"][P:]))
                rw = t["reward"].to_numpy()
                assert (np.isnan(rw).all() if want["reward"] is None else (rw == want["reward"]).all())
                assert np.array_equal(r.sequence(i).astype(np.int64), want["routes"])  # bit-equal ids
                if mode in ("trr", "v1"):  # the routing weights beside them, bit-equal
                    w = r.weights[r.cu_seqlens[i]:r.cu_seqlens[i + 1]]
                    assert w.dtype == np.float32 and np.array_equal(w.view(np.uint32), want["weights"].view(np.uint32))
            if mode in ("inline", "payload"):
                assert r.weights is None
        assert run.summary["samples_without_routes"] == 0
        assert run.summary.get("samples_with_weights", 0) == (16 if mode in ("trr", "v1") else 0)
        rep = doctor.diagnose(run.path)
        assert rep.ok and not [c.name for c in rep.checks if c.status in (doctor.WARN, doctor.FAIL)]
    report = _run_cli(capsys, ["doctor", str(paths["auto"])])
    assert "0 failed" in report


def test_prime_rl_payload_files_missing_or_moved(tmp_path):
    import shutil

    import dumps_prime as dp

    src, truth = dp.prime_batches_dump(tmp_path / "a" / "out", routes="payload", steps=1)
    moved = tmp_path / "b" / "out"
    shutil.copytree(src, moved)
    shutil.rmtree(tmp_path / "a")  # the segments name files under a/ that are gone: their tails are under b/out
    run = runs.load(import_prime_rl(moved, tmp_path / "run", config=QWEN))
    r = run.routes(1, "engine")
    assert all(np.array_equal(r.sequence(i).astype(np.int64), t["routes"]) for i, t in enumerate(truth[1]))
    gone = sorted((moved / "payload").glob("*.bin"))[0]
    gone.unlink()
    with pytest.raises(ImportFormatError, match=f"payload file '.*{gone.name}'.* does not exist"):
        import_prime_rl(moved, tmp_path / "run2", config=QWEN)
    assert not (tmp_path / "run2").exists()  # all or nothing


def test_prime_rl_payload_gap_and_invalid_rows_keep_tokens_not_routes(tmp_path):
    import dumps_prime as dp

    # payload: the first sample of every micro-batch (2 ranks x 2); v1: sample 0 of each rank's first micro-batch
    for mode, kw, n_lost in (("payload", {"payload_gap": True}, 4), ("v1", {"invalid_row": True}, 2)):
        src, truth = dp.prime_batches_dump(tmp_path / mode, routes=mode, **kw)
        run = runs.load(import_prime_rl(src, tmp_path / f"run-{mode}", config=QWEN))
        lost = [sum(not t["complete"] for t in truth[s]) for s in (1, 2)]
        assert lost == [n_lost, n_lost] and run.summary["samples"] == 16
        assert run.summary["samples_without_routes"] == sum(lost)
        cap = run.config["capture"]["counts"]
        assert cap["prefix_capture"] == sum(lost) and cap.get("ids_out_of_range", 0) == 0  # never read as ids
        for s in (1, 2):
            r = run.routes(s, "engine")
            assert r.lengths.tolist() == [0 if not t["complete"] else len(t["tokens"]) - 1 for t in truth[s]]
            for i, t in enumerate(truth[s]):
                if t["complete"]:
                    assert np.array_equal(r.sequence(i).astype(np.int64), t["routes"])
        rep = doctor.diagnose(run.path)
        assert rep.check("route rows").status == doctor.WARN  # deserved: R3 cannot replay those samples
        assert rep.check("expert ids").status != doctor.FAIL


def test_prime_rl_unknown_layouts_are_refused_by_name(tmp_path):
    import dumps_prime as dp
    import msgspec

    from r3lab.errors import UnknownLayoutError

    src, _ = dp.prime_batches_dump(tmp_path / "v", routes="v1-bad-version", steps=1)
    with pytest.raises(UnknownLayoutError, match=r"format_version 2 .*routed-experts-v1"):
        import_prime_rl(src, tmp_path / "r1", config=QWEN)
    src, _ = dp.prime_batches_dump(tmp_path / "w", routes="inline", steps=1)
    b = src / "batches" / "step_1" / "rank_0.bin"
    mbs = msgspec.msgpack.decode(b.read_bytes())
    b.write_bytes(msgspec.msgpack.encode([mb + [None] for mb in mbs]))  # a 21st field: a newer MicroBatch
    with pytest.raises(UnknownLayoutError, match="MicroBatch array of 21 fields"):
        import_prime_rl(src, tmp_path / "r2", config=QWEN)
    src, _ = dp.prime_batches_dump(tmp_path / "x", routes=None, steps=1)
    f = src / "token_exports" / "step_1" / "rank_1.jsonl"
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    f.write_text("".join(json.dumps({**d, "schema_version": 2}) + "\n" for d in lines))
    with pytest.raises(UnknownLayoutError, match=r"rank_1.jsonl line 1: a token export line of schema_version 2"):
        import_prime_rl(src, tmp_path / "r3")
    f.write_text("".join(json.dumps({**d, "export_step": 5}) + "\n" for d in lines))
    with pytest.raises(ImportFormatError, match="export_step 5 in the folder of step 1"):
        import_prime_rl(src, tmp_path / "r4")
    assert not any((tmp_path / f"r{i}").exists() for i in range(1, 5))


def test_prime_rl_weight_bits_and_widths_are_checked(tmp_path):
    import dumps_prime as dp
    import msgspec

    src, _ = dp.prime_batches_dump(tmp_path / "t", routes="trr", steps=1)
    b = src / "batches" / "step_1" / "rank_0.bin"
    mbs = msgspec.msgpack.decode(b.read_bytes())
    data, shape, dtype = mbs[0][10]
    a = np.frombuffer(data, np.int32).reshape(shape).copy()
    a[0, 0, 2] = np.array([np.nan], np.float32).view(np.int32)[0]  # not a weight
    mbs[0][10] = [a.tobytes(), shape, dtype]
    b.write_bytes(msgspec.msgpack.encode(mbs))
    with pytest.raises(ImportFormatError, match="fp32 weight bits"):
        import_prime_rl(src, tmp_path / "r1", config=QWEN)
    with pytest.raises(ImportFormatError, match="4 wide, the model's top-k is 1"):  # a config of another top-k
        cfg = json.loads(QWEN.read_text())
        (tmp_path / "k1.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 1}))
        import_prime_rl(src, tmp_path / "r2", config=tmp_path / "k1.json")


def test_prime_rl_old_layouts_are_named_and_per_run_parents_detected(tmp_path):
    import dumps_prime as dp

    from r3lab.importers.registry import detect_kind

    old = md.prime_rl_dump(tmp_path / "old", routes_bin=True, qwen3=True)
    run = runs.load(import_prime_rl(old, tmp_path / "r-old", config=QWEN))
    assert run.config["source_layouts"] == ["export-v1", "microbatch-16"]
    assert run.summary["source_layouts"] == ["export-v1", "microbatch-16"]
    src, _ = dp.prime_batches_dump(tmp_path / "outputs", routes="inline", run_id="run-a", export="v1", trace=False)
    assert detect_kind(tmp_path / "outputs")[0] == detect_kind(src)[0] == "prime-rl"  # the folder above a run
    run = runs.load(import_prime_rl(tmp_path / "outputs", tmp_path / "r-new", config=QWEN))
    assert run.config["source_layouts"] == ["export-v1", "microbatch-20"]  # 11 fields: told by its batches/ folder
    dp.prime_batches_dump(tmp_path / "outputs", routes=None, run_id="run-b", steps=1)
    with pytest.raises(ImportFormatError, match=r"2 runs \(\['run-a', 'run-b'\]\)"):
        import_prime_rl(tmp_path / "outputs", tmp_path / "r-two")
    assert nemo_rl.detect(src) is None and nemo_rl.detect(tmp_path / "outputs") is None


def test_nemo_rl_layouts_are_recorded_and_the_table_lists_both_kinds(tmp_path, capsys):
    src = md.nemo_rl_dump(tmp_path / "d", steps=1)
    run = runs.load(import_nemo_rl(src, tmp_path / "r"))
    assert run.config["source_layouts"] == ["train-data-batched"]
    f = src / "train_data_step1.jsonl"
    flat = [{k: (v if k == "idx" else v[0]) for k, v in json.loads(x).items()} for x in f.read_text().splitlines()]
    f.write_text("".join(json.dumps(d) + "\n" for d in flat))
    run = runs.load(import_nemo_rl(src, tmp_path / "r2"))
    assert run.config["source_layouts"] == ["train-data-flat"] and run.summary["samples"] == 8
    out = _run_cli(capsys, ["import", "--formats"])
    for name in [lay.name for lay in prime_rl.LAYOUTS + nemo_rl.LAYOUTS]:
        assert f"`{name}`" in out

"""slime and Miles importers on dumps laid out as their writers lay them out today (tests/make_dumps.framework_dump):
eval rollouts kept apart, both slime train-dump versions and Miles' per-rank dumps joined on the right key, CP
slices reassembled, TP copies checked, routes/log-probs/advantages bit for bit, detect(), and the CLI + doctor."""

from __future__ import annotations

import inspect
from pathlib import Path

import make_dumps as md
import numpy as np
import pytest
import torch

from r3lab import runs
from r3lab.errors import ImportFormatError
from r3lab.importers import import_run, sample_tokens
from r3lab.importers import miles as miles_mod
from r3lab.importers import slime as slime_mod
from r3lab.importers.train_dumps import assemble_cp, cp_response_spans, infer_cp_ranks

LAYOUTS = [("slime", "v2", {}), ("slime", "v2", {"cp": 2, "tp": 2}),
           ("slime", "v1", {}), ("slime", "v1", {"cp": 2, "tp": 2}), ("slime", "v1", {"cp": 3, "pp": 2}),
           ("miles", "miles", {}), ("miles", "miles", {"cp": 2, "tp": 2}), ("miles", "miles", {"cp": 3, "pp": 2}),
           ("miles", "miles", {"cp": 4, "qkv_format": "bshd"}), ("slime", None, {}), ("miles", None, {})]


def _ids(x):
    fw, tr, kw = x
    return "-".join([fw, str(tr), *(f"{k}{v}" for k, v in kw.items())])


@pytest.mark.parametrize("layout", LAYOUTS, ids=[_ids(x) for x in LAYOUTS])
def test_every_layout_round_trips_bit_for_bit_and_leaves_eval_out(tmp_path, layout):
    fw, train, kw = layout
    src, truth = md.framework_dump(tmp_path / "dump", fw, train, **kw)
    run = runs.load(import_run(fw, src / "rollout_data", tmp_path / "run", config=md.TINY_QWEN3,
                               train=src / "train_data" if train else None))
    assert run.token_steps() == [0, 1, 2] == run.route_steps("engine")
    for rid in (0, 1, 2):
        t, r, full = run.tokens([rid]), run.routes(rid, "engine"), sample_tokens(run.path, rid)
        want = truth[rid]
        assert len(full) == len(r) == len(want) == 6  # eval_0 / eval_2 (3 samples each) are not folded in
        assert t["index"].drop_duplicates().tolist() == [w["index"] for w in want]
        for i, w in enumerate(want):
            ti = t[t["sample"] == i]
            assert full[i].tolist() == w["tokens"]
            assert ti["logp_infer"].to_numpy().tobytes() == np.asarray(w["rollout_log_probs"], np.float64).tobytes()
            assert ti["loss_mask"].tolist() == w["loss_mask"]
            assert np.array_equal(r.sequence(i).astype(np.int64), w["routes"].astype(np.int64))
            if train:
                assert ti["logp_train"].to_numpy().tobytes() == w["log_probs"].astype(np.float64).tobytes()
                assert ti["advantage"].to_numpy().tobytes() == w["advantages"].astype(np.float64).tobytes()
            else:
                assert "logp_train" not in ti and "advantage" not in ti
        assert t[t["sample"] == 0]["loss_mask"].tolist()[2:5] == [0, 0, 0]  # the tool turn stays masked
        assert t[t["sample"] == 3]["reward"].iloc[0] == 1.0  # the dict reward's "score"
    ev = run.config["eval_rollouts"]
    assert ev["imported"] is False and ev["rollout_ids"] == [0, 2] and ev["samples"] == 6
    assert set(ev["files"]) == {"eval_0.pt", "eval_2.pt"}
    assert run.summary["samples"] == 18 and run.summary["steps"] == 3


def test_slime_v1_joins_on_the_global_sample_index_not_the_position(tmp_path):
    """From rollout 1 on, Sample.index (6, 7, ...) is no position in the rollout: a positional join would fail."""
    src, truth = md.framework_dump(tmp_path / "dump", "slime", "v1", dp=3)
    d = torch.load(src / "train_data" / "1_0.pt", weights_only=True)["rollout_data"]
    assert min(d["sample_indices"]) >= 6  # rollout 1 holds Sample.index 6..11: no position of a 6-sample rollout
    run = runs.load(import_run("slime", src / "rollout_data", tmp_path / "run", config=md.TINY_QWEN3,
                               train=src / "train_data"))
    t = run.tokens([1])
    for i, w in enumerate(truth[1]):
        assert t[t["sample"] == i]["logp_train"].to_numpy().tobytes() == w["log_probs"].astype(np.float64).tobytes()


def test_dump_details_root_as_src_finds_train_data(tmp_path):
    src, truth = md.framework_dump(tmp_path / "dump", "miles", "miles", cp=2)
    run = runs.load(import_run("miles", src, tmp_path / "run", config=md.TINY_QWEN3))
    t = run.tokens([2])
    want = truth[2][5]["log_probs"].astype(np.float64)
    assert t[t["sample"] == 5]["logp_train"].to_numpy().tobytes() == want.tobytes()
    assert run.config["train_dump"]["rollouts_without_train_dump"] == []


def test_an_eval_file_alone_is_refused_and_a_single_training_file_imports(tmp_path):
    src, truth = md.framework_dump(tmp_path / "dump", "slime", None)
    with pytest.raises(ImportFormatError, match="eval rollout"):
        import_run("slime", src / "rollout_data" / "eval_0.pt", tmp_path / "run", config=md.TINY_QWEN3)
    run = runs.load(import_run("slime", src / "rollout_data" / "1.pt", tmp_path / "run1", config=md.TINY_QWEN3))
    assert run.token_steps() == [1] and len(sample_tokens(run.path, 1)) == 6


def _perturb(path: Path, key: str, row: int = 0) -> None:
    obj = torch.load(path, weights_only=False)
    v = obj["rollout_data"][key][row]
    if len(v):
        v[0] += 1.0
    else:  # an empty CP slice: the copy gains a value instead
        obj["rollout_data"][key][row] = torch.ones(1)
    torch.save(obj, path)


@pytest.mark.parametrize("fw,train", [("slime", "v1"), ("miles", "miles")])
def test_tp_copies_that_differ_are_refused(tmp_path, fw, train):
    src, _ = md.framework_dump(tmp_path / "dump", fw, train, tp=2, cp=2)
    _perturb(src / "train_data" / "1_1.pt", "log_probs")  # rank 1 = TP 1 of CP 0: a copy of rank 0
    with pytest.raises(ImportFormatError, match="TP copies|fit no CP size"):
        import_run(fw, src / "rollout_data", tmp_path / "run", config=md.TINY_QWEN3, train=src / "train_data")


def test_a_missing_cp_rank_is_refused(tmp_path):
    src, _ = md.framework_dump(tmp_path / "dump", "miles", "miles", cp=2)
    (src / "train_data" / "1_1.pt").unlink()  # rank 1 = CP 1 of DP 0
    with pytest.raises(ImportFormatError, match="CP ranks \\[1\\] of 2"):
        import_run("miles", src / "rollout_data", tmp_path / "run", config=md.TINY_QWEN3, train=src / "train_data")


def test_a_train_dump_of_another_run_is_refused(tmp_path):
    a, _ = md.framework_dump(tmp_path / "a", "slime", "v2", seed=1)
    b, _ = md.framework_dump(tmp_path / "b", "slime", "v2", seed=2)
    with pytest.raises(ImportFormatError, match="do not belong together|tokens differ"):
        import_run("slime", a / "rollout_data", tmp_path / "run", config=md.TINY_QWEN3, train=b / "train_data")


def test_cp_spans_are_the_trainers_zigzag_split():
    """The importer's offset arithmetic against the writer's slice_with_cp on token positions (make_dumps)."""
    rng = np.random.default_rng(0)
    for cp in (2, 3, 4, 8):
        for total in range(3, 60):
            for response in (1, 2, total // 2, total - 1):
                if response < 1:
                    continue
                seq = None if total % 3 else total + int(rng.integers(0, 9))  # bshd: padded length
                lp = np.arange(response, dtype=np.float64) + 0.5
                chunks = {r: md.cp_slice(lp, total, cp, r, seq) for r in range(cp)}
                for r, c in chunks.items():
                    got = np.concatenate([lp[a:b] for a, b in cp_response_spans(total, response, r, cp, seq)] or
                                         [np.zeros(0)])
                    assert got.tolist() == c.tolist(), (cp, total, response, r)
                assert assemble_cp(chunks, total, response, cp, seq, "t").tolist() == lp.tolist()
                if seq is None:
                    assert cp in infer_cp_ranks(cp, [len(chunks[r]) for r in range(cp)], total, response)


def test_speculative_samples_are_read_from_spec_info(tmp_path):
    assert not slime_mod.is_speculative({"spec_info": dict(md.SPEC_ZERO), "metadata": {}})
    src, _ = md.framework_dump(tmp_path / "dump", "slime", None, spec=True)
    run = runs.load(import_run("slime", src / "rollout_data", tmp_path / "run", config=md.TINY_QWEN3))
    cap = run.config["capture"]
    assert cap["rows"]["speculative_rows"] == 18 and cap["counts"]["speculative_rows"] == 0


def test_a_sample_with_fewer_route_rows_keeps_its_tokens_and_leaves_its_routes_out(tmp_path):
    src, truth = md.framework_dump(tmp_path / "dump", "slime", "v2", short_routes=True)
    run = runs.load(import_run("slime", src / "rollout_data", tmp_path / "run", config=md.TINY_QWEN3,
                               train=src / "train_data"))
    r = run.routes(0, "engine")
    assert r.lengths[2] == 0 and (np.delete(r.lengths, 2) > 0).all()
    t = run.tokens([0])
    want = truth[0][2]["log_probs"].astype(np.float64)
    assert t[t["sample"] == 2]["logp_train"].to_numpy().tobytes() == want.tobytes()
    assert run.config["capture"]["counts"]["row_count"] == 3


def test_numpy_scalar_rewards_load(tmp_path):
    src, _ = md.framework_dump(tmp_path / "dump", "slime", None, evals=())
    obj = torch.load(src / "rollout_data" / "0.pt", weights_only=False)
    obj["samples"][0]["reward"] = np.float64(0.75)
    torch.save(obj, src / "rollout_data" / "0.pt")
    run = runs.load(import_run("slime", src / "rollout_data", tmp_path / "run", config=md.TINY_QWEN3))
    t = run.tokens([0])
    assert t[t["sample"] == 0]["reward"].iloc[0] == 0.75


def test_detect_tells_slime_from_miles(tmp_path, monkeypatch):
    s, _ = md.framework_dump(tmp_path / "s", "slime", "v2", steps=1, evals=())
    s1, _ = md.framework_dump(tmp_path / "s1", "slime", "v1", steps=1, evals=())
    m, _ = md.framework_dump(tmp_path / "m", "miles", "miles", steps=1, evals=())
    assert "slime --save-debug-rollout-data" in slime_mod.detect(s / "rollout_data")
    assert slime_mod.detect(s) and miles_mod.detect(s) is None and miles_mod.detect(s / "rollout_data") is None
    assert "Miles --save-debug-rollout-data" in miles_mod.detect(m / "rollout_data")
    assert slime_mod.detect(m / "rollout_data") is None
    assert "#2266" in slime_mod.detect(s / "train_data") and miles_mod.detect(s / "train_data") is None
    assert "before #2266" in slime_mod.detect(s1 / "train_data") and miles_mod.detect(s1 / "train_data") is None
    assert "cp_rank" in miles_mod.detect(m / "train_data") and slime_mod.detect(m / "train_data") is None
    assert slime_mod.detect(s / "rollout_data" / "0.pt") and miles_mod.detect(m / "rollout_data" / "0.pt")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    torch.save({"weights": torch.zeros(2)}, other / "model_3.pt")
    assert slime_mod.detect(other) is None and miles_mod.detect(other) is None
    monkeypatch.setattr(slime_mod, "_DETECT_MAX_BYTES", 0)  # too large to open: names only
    assert slime_mod.detect(s / "rollout_data") and miles_mod.detect(s / "rollout_data")  # ambiguous: both say so
    assert miles_mod.detect(m) and slime_mod.detect(m) is None  # dashboard_columns/ beside rollout_data/: Miles


@pytest.mark.parametrize("mod", [slime_mod, miles_mod])
def test_options_name_the_import_functions_keywords(mod):
    fn = mod.import_miles if mod is miles_mod else mod.import_slime
    kw = {n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert set(mod.OPTIONS) == {"config", "train", "reward_key"} <= kw
    assert all(isinstance(v, str) and v for v in mod.OPTIONS.values())


@pytest.mark.parametrize("fw,train,kw", [("slime", "v2", {"cp": 2}), ("slime", "v1", {"tp": 2, "cp": 2}),
                                         ("miles", "miles", {"tp": 2, "cp": 2})])
def test_cli_import_of_a_tiny_qwen3_moe_dump_then_a_clean_doctor(tmp_path, capsys, fw, train, kw):
    from r3lab.cli import main

    src, _ = md.framework_dump(tmp_path / "dump", fw, train, **kw)
    out = tmp_path / "run"
    main(["import", fw, str(src / "rollout_data"), "--out", str(out), "--config",
          str(md.TINY_QWEN3), "--train", str(src / "train_data")])
    main(["doctor", str(out)])
    text = capsys.readouterr().out
    assert f"imported {fw} dump" in text and " 0 failed" in text
    run = runs.load(out)
    assert run.token_steps() == [0, 1, 2] and run.summary["samples"] == 18
    assert "logp_train" in run.tokens([0]) and run.route_steps("engine") == [0, 1, 2]


def test_slime_v1_ranks_numbered_cp_fastest_are_still_reassembled(tmp_path):
    """slime v1 files name no CP rank; with ranks numbered cp-fastest the TP peers are found by their values."""
    src, truth = md.framework_dump(tmp_path / "dump", "slime", "v1", cp=2, tp=2, dp=1)
    d = src / "train_data"
    for rid in (0, 1, 2):  # renumber: tp + 2 * cp  ->  cp + 2 * tp (ranks 1 and 2 swap)
        a, b = d / f"{rid}_1.pt", d / f"{rid}_2.pt"
        a.rename(d / "tmp.pt")
        b.rename(a)
        (d / "tmp.pt").rename(b)
        for f in (a, b):
            obj = torch.load(f, weights_only=True)
            obj["rank"] = int(f.stem.split("_")[1])
            torch.save(obj, f)
    run = runs.load(import_run("slime", src / "rollout_data", tmp_path / "run", config=md.TINY_QWEN3, train=d))
    for rid in (0, 1, 2):
        t = run.tokens([rid])
        for i, w in enumerate(truth[rid]):
            assert t[t["sample"] == i]["logp_train"].to_numpy().tobytes() == w["log_probs"].astype(np.float64).tobytes()


# ---- newer slime: training-recovery neighbours, sampler heads, weight versions; named layouts ------------------------
def _staleness(versions: dict) -> dict:
    """slime's staleness (slime/utils/staleness.py) from the generator's weight_versions, current = the newest version
    seen up to each rollout: ``{rollout_id: (max age, multi-version samples)}``."""
    out, newest = {}, None
    for rid in sorted(versions):
        vs = [[int(x) for x in v] for v in versions[rid]]
        newest = max([newest or 0, *(max(v) for v in vs)])
        out[rid] = (max(newest - min(v) for v in vs), sum(len(set(v)) > 1 for v in vs))
    return out


@pytest.mark.parametrize("versions,want_lag", [("sync", 0), ("fully_async", 1)])
def test_newer_slime_folder_imports_with_recovery_files_skipped_and_weight_versions_read(tmp_path, versions, want_lag):
    from r3lab import doctor

    src, truth = md.recovery_dump(tmp_path / "dump", versions=versions)
    assert (src / "rollout_data" / "1.pt.train-recovery.pt").is_file()  # what slime writes beside the dumps
    run = runs.load(import_run("slime", src, tmp_path / "run", config=md.TINY_QWEN3))
    assert run.token_steps() == [0, 1, 2] == run.route_steps("engine") and run.summary["samples"] == 18
    for rid in (0, 1, 2):
        t, r = run.tokens([rid]), run.routes(rid, "engine")
        assert len(sample_tokens(run.path, rid)) == len(r) == 6
        for i, w in enumerate(truth[rid]):
            ti = t[t["sample"] == i]
            assert ti["logp_train"].to_numpy().tobytes() == w["log_probs"].astype(np.float64).tobytes()
            assert ti["advantage"].to_numpy().tobytes() == w["advantages"].astype(np.float64).tobytes()
            assert np.array_equal(r.sequence(i).astype(np.int64), w["routes"].astype(np.int64))
    rec = run.config["recovery_files"]
    assert rec["imported"] is False and rec["count"] == len(truth["recovery"]) == 4
    assert rec["train_recovery"] == ["1.pt.train-recovery.pt", "2.pt.train-recovery.pt",
                                     "2.pt.train-recovery.pt.tmp"]
    assert rec["journal"] == [n for n in truth["recovery"] if n.startswith(".slime-recovery/")]
    assert run.config["source_layouts"] == ["rollout", "recovery-files", "train-v2-topk"] == \
        run.summary["source_layouts"]
    wv, want = run.config["weight_versions"], _staleness(truth["weight_versions"])
    for rid, (age, multi) in want.items():
        got = wv["rollouts"][str(rid)]
        assert (got["staleness_max"], got["multi_version"], got["unknown"]) == (age, multi, 0)
        assert got["min"] == min(int(x) for v in truth["weight_versions"][rid] for x in v)
    assert run.config["staleness"] == want_lag == max(a for a, _ in want.values())
    assert run.config["old_logprobs"] == "current"
    report = doctor.diagnose(run)
    lag = report.check("policy lag")
    assert lag.status == (doctor.OK if want_lag == 0 else doctor.WARN), lag.line()
    assert f"staleness {want_lag}" in lag.line()
    loud = [c.line() for c in report.checks if c.status in (doctor.WARN, doctor.FAIL) and c.name != "policy lag"]
    assert not loud, loud


def test_slime_and_auto_agree_on_the_newer_folder_through_the_cli(tmp_path, capsys):
    from r3lab.cli import main
    from r3lab.importers import detect_kind

    src, _ = md.recovery_dump(tmp_path / "dump", versions="sync")
    for p in (src, src / "rollout_data", src / "rollout_data" / "0.pt"):
        assert detect_kind(p)[0] == "slime", p
    assert miles_mod.detect(src / "rollout_data") is None and miles_mod.detect(src) is None
    main(["import", "slime", str(src), "--out", str(tmp_path / "a"), "--config", str(md.TINY_QWEN3)])
    main(["import", "auto", str(src), "--out", str(tmp_path / "b"), "--config", str(md.TINY_QWEN3)])
    main(["doctor", str(tmp_path / "b")])
    text = capsys.readouterr().out
    assert " 0 failed" in text and "policy lag" in text
    a, b = runs.load(tmp_path / "a"), runs.load(tmp_path / "b")
    assert a.config["source"]["format"] == b.config["source"]["format"] == "slime"
    for rid in (0, 1, 2):
        assert a.tokens([rid]).equals(b.tokens([rid]))
    assert a.config["source_layouts"] == b.config["source_layouts"]


def test_a_recovery_file_alone_is_refused_and_its_journal_is_never_opened(tmp_path, monkeypatch):
    src, _ = md.recovery_dump(tmp_path / "dump")
    with pytest.raises(ImportFormatError, match="training-recovery file"):
        import_run("slime", src / "rollout_data" / "1.pt.train-recovery.pt", tmp_path / "run", config=md.TINY_QWEN3)
    opened = []
    real = slime_mod.load_dump
    monkeypatch.setattr(slime_mod, "load_dump", lambda f, **kw: opened.append(Path(f).name) or real(f, **kw))
    import_run("slime", src / "rollout_data", tmp_path / "run2", config=md.TINY_QWEN3)
    assert opened and not [n for n in opened if "recovery" in n or n not in ("0.pt", "1.pt", "2.pt", "eval_0.pt",
                                                                             "eval_2.pt")]


def test_weight_versions_unknown_or_stale_without_trainer_logprobs_leave_the_policy_lag_check_skipped(tmp_path):
    from r3lab import doctor

    src, _ = md.recovery_dump(tmp_path / "named", versions="named", recovery=False)
    run = runs.load(import_run("slime", src, tmp_path / "run", config=md.TINY_QWEN3))
    assert run.config["weight_versions"]["staleness_max"] is None and "staleness" not in run.config
    assert run.config["weight_versions"]["rollouts"]["1"]["unknown"] == 6
    assert "recovery_files" not in run.config and run.config["source_layouts"] == ["rollout", "train-v2-topk"]
    assert doctor.diagnose(run).check("policy lag").status == doctor.SKIP
    src, truth = md.recovery_dump(tmp_path / "async", versions="fully_async", heads=False)
    run = runs.load(import_run("slime", src / "rollout_data", tmp_path / "run2", config=md.TINY_QWEN3))
    assert run.config["weight_versions"]["staleness_max"] == 1 and "staleness" not in run.config  # no log-probs
    assert "train-v2" not in run.config["source_layouts"] and "logp_train" not in run.tokens([1])
    run = runs.load(import_run("slime", src, tmp_path / "run3", config=md.TINY_QWEN3))
    assert run.config["source_layouts"] == ["rollout", "recovery-files", "train-v2"] and run.config["staleness"] == 1


def _resave(path: Path, edit) -> None:
    obj = torch.load(path, weights_only=False)
    edit(obj)
    torch.save(obj, path)


def test_layouts_this_r3lab_does_not_read_are_refused_as_new_naming_what_was_seen(tmp_path):
    from r3lab.errors import UnknownLayoutError

    src, _ = md.recovery_dump(tmp_path / "a", recovery=False)
    _resave(src / "rollout_data" / "1.pt", lambda o: o.update(spill_dir="1_r3_spill"))
    with pytest.raises(UnknownLayoutError, match=r"1\.pt: a rollout dump holding the keys \['rollout_id', "
                                                 r"'samples', 'spill_dir'\].*not an unsafe file.*rollout \("):
        import_run("slime", src / "rollout_data", tmp_path / "run", config=md.TINY_QWEN3)
    src, _ = md.recovery_dump(tmp_path / "b", recovery=False)
    _resave(src / "train_data" / "2.pt", lambda o: o.update(format_version=3))
    with pytest.raises(UnknownLayoutError, match="2.pt: a train dump holding the keys .*format_version 3"):
        import_run("slime", src, tmp_path / "run", config=md.TINY_QWEN3)
    m, _ = md.framework_dump(tmp_path / "m", "miles", None, steps=1, evals=())
    with pytest.raises(UnknownLayoutError, match="import it as miles"):
        import_run("slime", m / "rollout_data", tmp_path / "run", config=md.TINY_QWEN3)
    s, _ = md.framework_dump(tmp_path / "s", "slime", "v2", steps=1, evals=())
    with pytest.raises(UnknownLayoutError, match=r"the train-v2 layout.*miles dump layout"):
        import_run("miles", s, tmp_path / "run", config=md.TINY_QWEN3)


@pytest.mark.parametrize("fw,train,want", [("slime", "v1", ["rollout", "train-v1"]),
                                           ("slime", "v2", ["rollout", "train-v2"]),
                                           ("miles", "miles", ["rollout-metadata", "train-cp"]),
                                           ("miles", None, ["rollout-metadata"])])
def test_each_import_records_the_layouts_it_read(tmp_path, fw, train, want):
    src, _ = md.framework_dump(tmp_path / "dump", fw, train, steps=2, evals=())
    run = runs.load(import_run(fw, src, tmp_path / "run", config=md.TINY_QWEN3))
    assert run.config["source_layouts"] == want == run.summary["source_layouts"]


def test_older_miles_and_slime_layouts_are_declared_and_listed():
    from r3lab.importers.layouts import formats_table

    assert [lay.name for lay in slime_mod.LAYOUTS] == ["rollout", "train-v1", "train-v2", "train-v2-topk",
                                                       "recovery-files"]
    assert [lay.name for lay in miles_mod.LAYOUTS] == ["rollout", "rollout-metadata", "train-v1", "train-cp",
                                                       "recovery-files"]
    table = formats_table(kinds=["slime", "miles"])
    assert "| slime | `recovery-files` |" in table and "| miles | `train-cp` |" in table
    assert "13b347f8" in table and "d92cb5de" in table

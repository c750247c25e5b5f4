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

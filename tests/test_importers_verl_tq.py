"""verl's newer dumps: skip.rollout_tq's ``tq_batch.pt`` and skip.async_rollout's feed-index folders. Round trips
against the generators' inputs, ``r3lab import verl`` and ``auto`` agreeing, a doctor without false alarms, the
layouts named from the bytes, and every malformed file refused with a message naming the problem."""

from __future__ import annotations

import json
import pickletools
import zipfile
from pathlib import Path

import dumps_skyrl_verl as g
import dumps_verl_tq as q
import numpy as np
import pytest

from r3lab import doctor, runs
from r3lab.cli import main
from r3lab.errors import ImportFormatError, UnknownLayoutError, UnsafeFileError
from r3lab.importers import verl as vl
from r3lab.importers.layouts import formats_table
from r3lab.importers.registry import detect_kind


def _no_alarm(run: Path, *, warn: set[str] = frozenset()) -> None:
    report = doctor.diagnose(run)
    assert report.ok and {c.name for c in report.warned} == set(warn), report.text()


def _globals(data: bytes) -> set[str]:
    out, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "GLOBAL":
            out.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            out.add(".".join(strings[-2:]))
    return out


def _tq_file(src: Path) -> Path:
    return next(src.rglob("tq_batch.pt"))


def _data_pkl(f: Path) -> bytes:
    with zipfile.ZipFile(f) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


def _write_tq(tmp_path: Path, payload: dict, step: str = "1", inner: str = "0") -> Path:
    d = tmp_path / "dump" / "exp_proj" / "GBS1_N2_in8_out8" / step / inner
    d.mkdir(parents=True, exist_ok=True)
    q.tq_payload_bytes(d / "tq_batch.pt", payload)
    return d / "tq_batch.pt"


def _payload(rng_seed: int = 0, step: int = 1, **mutate) -> dict:
    keys, fields, tags, _ = q.tq_trajectories(np.random.default_rng(rng_seed), 1, 2)
    for key, fn in mutate.items():
        fields[0][key] = fn(fields[0][key])
    return {"tensordict": q._merge(fields), "tags": tags, "keys": keys, "global_steps": step}


# ---- tq_batch.pt ----------------------------------------------------------------------------------------------------
def test_tq_pickle_names_tensordicts_globals_and_torchs_only(tmp_path):
    """The generator's data.pkl names what tensordict 0.10.0 + torch write (checked against a real torch.save of a
    real TensorDict): tensordict's four names beyond torch's own; r3lab maps exactly those four."""
    src, _ = q.tq_dump(tmp_path / "dump", steps=1)
    found = _globals(_data_pkl(_tq_file(src)))
    td = {n for n in found if not n.startswith(("torch.", "collections.", "builtins.", "__builtin__."))}
    assert td == {"tensordict._reductions._make_td", "tensordict._td.TensorDict",
                  "tensordict.tensorclass.NonTensorStack", "tensordict.tensorclass.NonTensorData"}
    assert {n for _, n in vl._TQ_GLOBALS} == td
    assert "torch.nested._internal.nested_tensor._rebuild_njt" in found  # jagged fields, as TransferQueue returns


@pytest.mark.parametrize("dense", [False, True])
def test_tq_round_trip_with_inner_minibatches(tmp_path, dense):
    """Two steps x two mini-batches (parameter_sync_step=2): each step's samples in inner order, the layout named."""
    src, truth = q.tq_dump(tmp_path / "dump", steps=2, inner=2, dense=dense)
    assert all(len(v) == 8 for v in truth.values())
    run = vl.import_verl(src, tmp_path / "run", config=q.CONFIG)
    g.check_imported(run, truth, logp_train=False, reward=True, advantage=False)
    loaded = runs.load(run)
    assert loaded.config["source_layouts"] == ["tq-batch"] and loaded.summary["samples"] == 16
    t = loaded.tokens([1])
    assert 0 in t[t["sample"] == 1]["loss_mask"].tolist()  # the tool output stays masked
    _no_alarm(run)
    assert doctor.diagnose(run).check("route rows").status == "ok"


def test_tq_short_capture_keeps_tokens_and_doctor_warns_once(tmp_path):
    src, truth = q.tq_dump(tmp_path / "dump", steps=1, case="short_capture")
    run = vl.import_verl(src, tmp_path / "run", config=q.CONFIG)
    g.check_imported(run, truth, logp_train=False, reward=True, advantage=False)
    _no_alarm(run, warn={"route rows"})


def test_tq_cli_kind_and_auto_agree_from_every_folder(tmp_path, capsys):
    src, truth = q.tq_dump(tmp_path / "dump", steps=2)
    gbs = src / "exp_proj" / "GBS2_N2_in8_out8"
    for i, s in enumerate([src, src / "exp_proj", gbs, gbs / "1", gbs / "1" / "0", gbs / "1" / "0" / "tq_batch.pt"]):
        assert detect_kind(s)[0] == "verl", s
        if i in (0, 2):
            for kind in ("verl", "auto"):
                main(["import", kind, str(s), "--out", str(tmp_path / f"{kind}{i}"), "--config", str(q.CONFIG)])
            a, b = runs.load(tmp_path / f"verl{i}"), runs.load(tmp_path / f"auto{i}")
            assert a.summary["samples"] == b.summary["samples"] == 8
            g.check_imported(b.path, truth, logp_train=False, reward=True, advantage=False)
            main(["doctor", str(b.path)])
    assert "r3lab import auto: verl dump" in capsys.readouterr().err
    one = runs.load(vl.import_verl(gbs / "2" / "0" / "tq_batch.pt", tmp_path / "one", config=q.CONFIG))
    assert one.token_steps() == [2]  # one file: the step from its bytes and folders


def test_tq_and_gen_batch_of_one_step_are_refused(tmp_path):
    src, _ = q.tq_dump(tmp_path / "dump", steps=1)
    gbs = src / "exp_proj" / "GBS2_N2_in8_out8"
    (gbs / "1" / "gen_batch.dp").write_bytes(g.verl_pickle(g.verl_batch(np.random.default_rng(0), 2)[0]))
    with pytest.raises(ImportFormatError, match="step 1 is dumped twice"):
        vl.step_files(src)


def test_tq_payload_with_other_keys_is_an_unknown_layout(tmp_path):
    p = _payload()
    p["sampler_state"] = {"epoch": 1}
    f = _write_tq(tmp_path, p)
    with pytest.raises(UnknownLayoutError, match=r"new keys \['sampler_state'\].*tq-batch"):
        vl.import_verl(f, tmp_path / "run", config=q.CONFIG)
    del p["sampler_state"], p["tags"]
    f = _write_tq(tmp_path, p)
    with pytest.raises(UnknownLayoutError, match=r"no \['tags'\]"):
        vl.load_tq_batch(f)
    assert not (tmp_path / "run").exists()


def test_tq_other_tensordict_class_is_an_unknown_layout_not_an_attack(tmp_path):
    class LazyStackedTensorDict(q.NonTensorStack):
        pass

    p = _payload()
    p["tensordict"].state["_tensordict"]["uid"] = LazyStackedTensorDict("a", "b")
    with g._fake_modules("tensordict._lazy", LazyStackedTensorDict=LazyStackedTensorDict):
        f = _write_tq(tmp_path, p)
    with pytest.raises(UnknownLayoutError, match=r"names tensordict\._lazy\.LazyStackedTensorDict.*not an unsafe"):
        vl.load_tq_batch(f)


def test_tq_code_in_a_tag_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "marker"
    p = _payload()
    p["tags"][0]["evil"] = g.RunsCode(str(marker))
    f = _write_tq(tmp_path, p)
    with pytest.raises(UnsafeFileError, match="could run code"):
        vl.import_verl(f.parent.parent.parent, tmp_path / "run", config=q.CONFIG)
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_tq_step_disagreeing_with_its_folder_is_refused(tmp_path):
    f = _write_tq(tmp_path, _payload(step=7), step="3")
    with pytest.raises(ImportFormatError, match="global_steps 7 in the file, step 3 in its folder"):
        vl.import_verl(f.parent.parent, tmp_path / "run", config=q.CONFIG)


def test_tq_field_lengths_that_disagree_are_refused_naming_the_field(tmp_path):
    f = _write_tq(tmp_path, _payload(rollout_log_probs=lambda t: t[:-1]))
    with pytest.raises(ImportFormatError, match=r"trajectory 0 .*'rollout_log_probs' has shape \(\d+,\), expected"):
        vl.import_verl(f, tmp_path / "run", config=q.CONFIG)
    f = _write_tq(tmp_path / "b", _payload(routed_experts=lambda t: t[:-2]))
    with pytest.raises(ImportFormatError, match=r"'routed_experts' has shape .*prompt \+ response tokens"):
        vl.import_verl(f, tmp_path / "run2", config=q.CONFIG)


def test_tq_keys_that_do_not_match_the_batch_are_refused(tmp_path):
    p = _payload()
    p["keys"] = p["keys"][:1]
    f = _write_tq(tmp_path, p)
    with pytest.raises(ImportFormatError, match="1 keys and 2 tags for 2 trajectories"):
        vl.load_tq_batch(f)


def test_tq_folders_that_are_not_step_and_minibatch_are_refused(tmp_path):
    f = _write_tq(tmp_path, _payload(), step="latest")
    with pytest.raises(ImportFormatError, match=r"not a step and a mini-batch number"):
        vl.step_files(f.parent.parent.parent)


def test_tq_truncated_file_is_refused(tmp_path):
    f = _write_tq(tmp_path, _payload())
    f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(ImportFormatError, match="not a readable torch.save archive"):
        vl.import_verl(f, tmp_path / "run", config=q.CONFIG)


# ---- skip.async_rollout -------------------------------------------------------------------------------------------
def test_async_round_trip_feed_index_steps(tmp_path):
    """One prompt's n samples per feed-index folder (starting at 0): a step per folder, layout named by the uid."""
    src, truth = q.async_dump(tmp_path / "dump", feeds=3, n=2)
    run = vl.import_verl(src, tmp_path / "run", config=q.CONFIG)
    g.check_imported(run, truth, logp_train=False, reward=True, advantage=False)
    loaded = runs.load(run)
    assert loaded.token_steps() == [0, 1, 2] and loaded.config["source_layouts"] == ["async-gen-batch-numpy"]
    _no_alarm(run)


def test_async_without_uid_reads_as_gen_batch(tmp_path):
    """Without reward-loop-free uid copying the bytes are a plain gen_batch: same import, that layout recorded."""
    src, truth = q.async_dump(tmp_path / "dump", feeds=2, n=2, uid=False)
    run = vl.import_verl(src, tmp_path / "run", config=q.CONFIG)
    g.check_imported(run, truth, logp_train=False, reward=True, advantage=False)
    assert runs.load(run).config["source_layouts"] == ["gen-batch-numpy"]


def test_async_cli_kind_and_auto_agree(tmp_path, capsys):
    src, truth = q.async_dump(tmp_path / "dump", feeds=2, n=3, seed=1)
    for kind in ("verl", "auto"):
        main(["import", kind, str(src), "--out", str(tmp_path / kind), "--config", str(q.CONFIG)])
    assert "r3lab import auto: verl dump" in capsys.readouterr().err
    g.check_imported(tmp_path / "auto", truth, logp_train=False, reward=True, advantage=False)
    assert runs.load(tmp_path / "verl").summary["samples"] == runs.load(tmp_path / "auto").summary["samples"] == 6
    main(["doctor", str(tmp_path / "auto")])


def test_sync_gen_batch_layout_recorded_and_torch_variant_named(tmp_path):
    src, _ = g.verl_dump(tmp_path / "dump", steps=1)
    run = runs.load(vl.import_verl(src, tmp_path / "run", config=g.CONFIG))
    assert run.config["source_layouts"] == ["gen-batch-numpy"]
    bad, _ = g.verl_dump(tmp_path / "bad", steps=1, numpy_serialization=False)
    with pytest.raises(UnsafeFileError, match="gen-batch-torch.*VERL_DATAPROTO_SERIALIZATION_METHOD=numpy"):
        vl.import_verl(bad, tmp_path / "run2", config=g.CONFIG)


def test_dataproto_state_of_another_shape_is_an_unknown_layout(tmp_path):
    state, _ = g.verl_batch(np.random.default_rng(0), 2)
    f = tmp_path / "1" / "gen_batch.dp"
    f.parent.mkdir()
    f.write_bytes(g.verl_pickle((*state, {"extra": 1})))
    with pytest.raises(UnknownLayoutError, match="a DataProto state of tuple with 4 items"):
        vl.load_gen_batch(f)
    batch = (state[0][0], state[0][2])  # a tensor batch that is not the triple
    f.write_bytes(g.verl_pickle((batch, state[1], state[2])))
    with pytest.raises(UnknownLayoutError, match="not serialize_tensordict's"):
        vl.load_gen_batch(f)


def test_layouts_declared_and_in_the_formats_table():
    names = [lay.name for lay in vl.LAYOUTS]
    assert names == ["gen-batch-numpy", "gen-batch-torch", "async-gen-batch-numpy", "tq-batch"]
    assert all("1dda039b" in lay.writer for lay in vl.LAYOUTS)
    table = formats_table(kinds=["verl"])
    assert all(f"`{n}`" in table for n in names)


def test_meta_json_is_not_needed_and_not_read(tmp_path):
    src, truth = q.tq_dump(tmp_path / "dump", steps=1)
    meta = next(src.rglob("meta.json"))
    meta.write_text(json.dumps({"global_steps": 99}))  # the step comes from the payload and folders, never meta.json
    assert runs.load(vl.import_verl(src, tmp_path / "run", config=q.CONFIG)).token_steps() == [1]

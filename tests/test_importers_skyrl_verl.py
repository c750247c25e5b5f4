"""SkyRL and verl importers: round trips against the generators' truth, every SRC form, detect, the restricted
unpickler refusing code before it runs, a clean doctor on tiny-qwen3-moe dumps, and bounded memory."""

from __future__ import annotations

import os
import pickle
import pickletools
import re
import subprocess
from enum import StrEnum
from pathlib import Path

import dumps_skyrl_verl as g
import numpy as np
import pytest
from import_memory import import_rise

from r3lab import doctor, runs
from r3lab.errors import ImportFormatError, UnknownLayoutError, UnsafeFileError
from r3lab.importers import skyrl as sk
from r3lab.importers import verl as vl

ROOT = Path(__file__).resolve().parent.parent


def _globals(data: bytes) -> set[str]:
    """Every global a pickle names (GLOBAL, or STACK_GLOBAL of the last two strings pushed, memo included)."""
    out, pushed, memo = set(), [], {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            pushed.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = pushed[-1] if pushed else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(int(arg)))
        elif op.name == "STACK_GLOBAL":
            out.add(f"{pushed[-2]}.{pushed[-1]}")
            pushed.append(None)
        elif op.name == "GLOBAL":
            out.add(arg.replace(" ", "."))
            pushed.append(None)
        else:
            pushed.append(None)
    return out


# ---- SkyRL ---------------------------------------------------------------------------------------------------------
def test_skyrl_pickle_names_exactly_the_writers_globals(tmp_path):
    src, _ = g.skyrl_dump(tmp_path / "export", steps=1)
    data = (src / "dumped_data" / "global_step_1_training_input.pkl").read_bytes()
    assert _globals(data) == {"skyrl.backends.skyrl_train.training_batch._rebuild_tensor_batch",
                              "skyrl.backends.skyrl_train.training_batch.TrainingInputBatch", "torch.device"}
    allowed = set(sk._allowed("x"))
    assert {sk.REBUILD, sk.BATCH_CLASS, sk.TENSOR_FORMAT, ("torch", "device")} <= allowed
    assert {m.split(".")[0] for m, _ in allowed} == {"skyrl", "torch", "numpy"}  # nothing else is ever loadable
    assert {f"{m}.{n}" for m, n in allowed if m == "torch"} == {"torch.device"}


@pytest.mark.parametrize("case", ["clean", "pre1908"])
def test_skyrl_round_trip(tmp_path, case):
    """Pad rows dropped, left padding undone, right-aligned response values, uint8/int16/int32 routes, the
    captured prefix only (router_padding_mask since #1908, zero fill before)."""
    src, truth = g.skyrl_dump(tmp_path / "export", case=case)
    arrays, meta = sk.load_batch(src / "dumped_data" / "global_step_1_training_input.pkl")
    assert meta["pad_size"] == 2 and arrays["sequences"].shape[0] == 8
    assert {arrays["rollout_expert_indices"].dtype for _ in [0]} == {np.dtype(np.uint8)}
    run = sk.import_skyrl(src, tmp_path / "run", config=g.CONFIG)
    g.check_imported(run, truth, logp_train=True, reward=False, advantage=True)
    loaded = runs.load(run)
    assert loaded.config["source"]["format"] == "skyrl" and loaded.summary["samples"] == 18
    assert loaded.summary["samples_without_routes"] == 0
    report = doctor.diagnose(run)
    assert report.ok, report.text()
    assert report.check("route rows").status == "ok"


def test_skyrl_multi_turn_mask_is_kept(tmp_path):
    src, truth = g.skyrl_dump(tmp_path / "export", steps=1)
    run = runs.load(sk.import_skyrl(src, tmp_path / "run", config=g.CONFIG))
    t = run.tokens([1])
    s1 = t[t["sample"] == 1]["loss_mask"].tolist()
    assert s1 == truth[1][1]["loss_mask"].astype(int).tolist() and 0 in s1


def test_skyrl_short_capture_leaves_the_sample_without_routes_and_doctor_says_so(tmp_path):
    src, truth = g.skyrl_dump(tmp_path / "export", case="short_capture")
    run = sk.import_skyrl(src, tmp_path / "run", config=g.CONFIG)
    g.check_imported(run, truth, logp_train=True, reward=False, advantage=True)
    loaded = runs.load(run)
    counts = loaded.config["capture"]["counts"]
    assert counts["prefix_capture"] == 3 and counts["row_count"] == 0  # sample 2 of each of the 3 steps, marked
    report = doctor.diagnose(run)
    rows = report.check("route rows")
    assert rows.status == "warn" and "3 samples whose capture" in rows.detail
    assert report.ok, report.text()  # a gap the dump marks itself is no failure


def test_a_short_capture_the_dump_does_not_mark_is_a_wrong_row_count():
    """slime, Miles, or SkyRL before #1908 (no router_padding_mask): fewer rows than P + R - 1 is no known gap."""
    from r3lab.importers.common import CaptureLog, LayerMap, Sample, _check_routes

    lmap = LayerMap.from_config(g.CONFIG)
    rng = np.random.default_rng(0)
    routes = np.argsort(rng.random((3, len(lmap.moe_ids), lmap.layout.num_experts)), axis=2)[:, :, :lmap.layout.top_k]
    for marked in (False, True):
        log = CaptureLog()
        s = Sample(step=0, tokens=np.arange(6), response_length=2, routes=routes, prefix_capture=marked)  # 3 of 5 rows
        assert _check_routes(s, 0, lmap, log) is None
        assert log.counts.get("row_count", 0) == int(not marked) and log.counts.get("prefix_capture", 0) == int(marked)


def test_skyrl_bfloat16_tensors_are_read_through_torchs_weights_only_loader(tmp_path):
    """_serialize_tensor's fallback for dtypes numpy lacks: {"format": "torch", "data": torch.save bytes}."""
    import io

    import torch

    state, truth = g.skyrl_batch(np.random.default_rng(1), 4)
    lt = torch.from_numpy(np.frombuffer(state["batch_dict"]["action_log_probs"]["data"], np.float32)
                          .reshape(state["batch_dict"]["action_log_probs"]["shape"]).copy()).to(torch.bfloat16)
    buf = io.BytesIO()
    torch.save(lt, buf)
    state["batch_dict"]["action_log_probs"] = {"format": "torch", "data": buf.getvalue()}
    f = tmp_path / "dumped_data" / "global_step_1_training_input.pkl"
    f.parent.mkdir()
    f.write_bytes(g.skyrl_pickle(state))
    run = runs.load(sk.import_skyrl(tmp_path, tmp_path / "run", config=g.CONFIG))
    t = run.tokens([1])
    for i, s in enumerate(truth):
        want = torch.from_numpy(s["logp_train"]).to(torch.bfloat16).float().numpy().astype(np.float64)
        assert t[t["sample"] == i]["logp_train"].tolist() == want.tolist()


def test_skyrl_src_forms(tmp_path):
    src, truth = g.skyrl_dump(tmp_path / "export", steps=2)
    one = src / "dumped_data" / "global_step_2_training_input.pkl"
    for i, s in enumerate((src, src / "dumped_data", one)):
        run = runs.load(sk.import_skyrl(s, tmp_path / f"run{i}", config=g.CONFIG))
        assert run.token_steps() == ([2] if s == one else [1, 2])
    assert "global_step" in sk.detect(src) and sk.detect(src / "dumped_data") and sk.detect(one)
    assert sk.detect(tmp_path) is None and sk.detect(tmp_path / "export" / "nothing") is None
    with pytest.raises(ImportFormatError, match="global_step_<N>_training_input.pkl"):
        sk.import_skyrl(tmp_path, tmp_path / "run-none")


# ---- SkyRL's packed layout (#2235/#2236/#2238) -----------------------------------------------------------------------
PACKED_GLOBALS = {"skyrl.backends.skyrl_train.training_batch._rebuild_tensor_batch",
                  "skyrl.backends.skyrl_train.training_batch.TrainingInputBatch",
                  "skyrl.backends.skyrl_train.training_batch.TensorFormat", "torch.device", "numpy.dtype"}


def _packed_file(tmp_path: Path, state: dict, protocol: int = 4, **kw) -> Path:
    f = tmp_path / "export" / "dumped_data" / "global_step_1_training_input.pkl"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(g.skyrl_packed_pickle(state, protocol, **kw))
    return f


def _no_alarm(run: Path, *, warn: set[str] = frozenset()) -> None:
    """The doctor: no FAIL, and a WARN only from the checks named (what the data deserves)."""
    report = doctor.diagnose(run)
    assert report.ok and {c.name for c in report.warned} == set(warn), report.text()


@pytest.mark.parametrize("protocol", [4, 5])
def test_skyrl_packed_pickle_names_the_writers_globals(tmp_path, protocol):
    """Enum members pickle as REDUCE(TensorFormat, (value,)); numpy_view arrays in-band (_reconstruct + BUILD under
    protocol 4, _frombuffer under 5): every global is one r3lab maps to a stand-in."""
    src, _ = g.skyrl_packed_dump(tmp_path / "export", steps=1, protocol=protocol, sample_support=True)
    data = (src / "dumped_data" / "global_step_1_training_input.pkl").read_bytes()
    arrays = ({"numpy._core.multiarray._reconstruct", "numpy.ndarray"} if protocol == 4
              else {"numpy._core.numeric._frombuffer"})
    assert _globals(data) == PACKED_GLOBALS | arrays
    assert {f"{m}.{n}" for m, n in sk._allowed("x")} >= _globals(data)
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(data) if op.name != "MEMOIZE"]
    i = ops.index(("SHORT_BINUNICODE", "TensorFormat"))  # the first member: REDUCE(TensorFormat, (value,))
    assert [n for n, _ in ops[i + 1:i + 5]] == ["STACK_GLOBAL", "SHORT_BINUNICODE", "TUPLE1", "REDUCE"]
    assert ops[i + 2][1] in {"numpy", "numpy_view", "packed_tensor"}


@pytest.mark.parametrize("protocol", [4, 5])
def test_skyrl_packed_round_trip(tmp_path, protocol):
    """Each segment's captured prefix (P + R - 1 rows) becomes the sample's routes, DP pad segments dropped,
    uint8/int16/int32 routes, rollout_sample_support ignored; the run names the layout."""
    src, truth = g.skyrl_packed_dump(tmp_path / "export", protocol=protocol, sample_support=True)
    arrays, meta = sk.load_batch(src / "dumped_data" / "global_step_1_training_input.pkl")
    p = arrays["rollout_expert_indices"]
    assert isinstance(p, sk.Packed) and len(p) == 8 and meta["pad_size"] == 2 and p.values.dtype == np.uint8
    assert "rollout_sample_support" not in arrays  # ignored by name
    run = sk.import_skyrl(src, tmp_path / "run", config=g.CONFIG)
    g.check_imported(run, truth, logp_train=True, reward=False, advantage=True)
    loaded = runs.load(run)
    assert loaded.config["source_layouts"] == ["packed-2026-09"] == loaded.summary["source_layouts"]
    assert loaded.summary["samples"] == 18 and loaded.summary["samples_without_routes"] == 0
    _no_alarm(run)
    assert doctor.diagnose(run).check("route rows").status == "ok"


def test_skyrl_packed_cli_kind_and_auto_agree(tmp_path, capsys):
    """r3lab import skyrl and r3lab import auto on the same dump: auto picks skyrl, the runs hold the same data."""
    from r3lab.cli import main

    src, truth = g.skyrl_packed_dump(tmp_path / "export", pmax=14)
    for kind in ("skyrl", "auto"):
        main(["import", kind, str(src), "--out", str(tmp_path / kind), "--config", str(g.CONFIG)])
    assert "r3lab import auto: skyrl dump" in capsys.readouterr().err
    a, b = runs.load(tmp_path / "skyrl"), runs.load(tmp_path / "auto")
    assert a.token_steps() == b.token_steps() == [1, 2, 3] and a.summary == b.summary
    for step in (1, 2, 3):
        assert a.tokens([step]).equals(b.tokens([step]))
        assert np.array_equal(a.routes(step, "engine").sequence(5), b.routes(step, "engine").sequence(5))
    g.check_imported(tmp_path / "auto", truth, logp_train=True, reward=False, advantage=True)
    main(["doctor", str(tmp_path / "auto")])
    assert "0 failed, 0 warnings" in capsys.readouterr().out


def test_skyrl_packed_without_routes(tmp_path):
    """A packed-layout dump of a run without R3 (no routes, no mask): tokens and log-probs, no false alarm."""
    src, truth = g.skyrl_packed_dump(tmp_path / "export", with_routes=False)
    run = sk.import_skyrl(src, tmp_path / "run", config=g.CONFIG)
    loaded = runs.load(run)
    assert loaded.route_steps("engine") == [] and loaded.summary["samples"] == 18
    assert loaded.config["source_layouts"] == ["packed-2026-09"]  # told apart by the TensorFormat members alone
    for t in truth.values():
        for s in t:
            s["captured"] = 0
    g.check_imported(run, truth, logp_train=True, reward=False, advantage=True)
    _no_alarm(run)


@pytest.mark.parametrize("case", ["short_capture", "agent_loop"])
def test_skyrl_packed_short_captures_get_no_routes(tmp_path, case):
    """A capture the mask marks short, and the agent loop's trace padded with dummy rows that the mask counts as
    captured (a trailing observation the engine never ran): tokens kept, routes left out, the doctor warns once."""
    src, truth = g.skyrl_packed_dump(tmp_path / "export", case=case)
    assert all(truth[n][2]["captured"] < truth[n][2]["P"] + truth[n][2]["R"] - 1 for n in truth)
    run = sk.import_skyrl(src, tmp_path / "run", config=g.CONFIG)
    g.check_imported(run, truth, logp_train=True, reward=False, advantage=True)
    counts = runs.load(run).config["capture"]["counts"]
    assert counts["prefix_capture"] == 3 and counts.get("row_count", 0) == 0
    _no_alarm(run, warn={"route rows"})
    assert "3 samples whose capture" in doctor.diagnose(run).check("route rows").detail


def test_skyrl_packed_mixed_prompt_lengths_and_byte_values(tmp_path):
    """Prompts of 2 to 16 tokens over 8 samples, and #2235 before #2236 (packed values as numpy bytes)."""
    src, truth = g.skyrl_packed_dump(tmp_path / "export", samples=8, pmax=16, zero_copy=False, seed=3)
    assert len({s["P"] for s in truth[1]}) >= 4
    run = sk.import_skyrl(src, tmp_path / "run", config=g.CONFIG)
    g.check_imported(run, truth, logp_train=True, reward=False, advantage=True)
    assert runs.load(run).config["source_layouts"] == ["packed-2026-09"]
    _no_alarm(run)


def test_skyrl_each_file_names_its_layout(tmp_path):
    """The older layouts are named too; a folder of mixed layouts records each, in the order met."""
    for case, name in (("pre1908", "tensorbatch-2026-03"), ("clean", "tensorbatch-2026-07")):
        src, _ = g.skyrl_dump(tmp_path / case, steps=1, case=case)
        run = sk.import_skyrl(src, tmp_path / f"run-{case}", config=g.CONFIG)
        assert runs.load(run).config["source_layouts"] == [name]
    src, _ = g.skyrl_dump(tmp_path / "mixed", steps=1)
    state, _ = g.skyrl_packed_batch(np.random.default_rng(5), 4)
    (src / "dumped_data" / "global_step_2_training_input.pkl").write_bytes(g.skyrl_packed_pickle(state))
    run = runs.load(sk.import_skyrl(src, tmp_path / "run-mixed", config=g.CONFIG))
    assert run.config["source_layouts"] == ["tensorbatch-2026-07", "packed-2026-09"]
    assert [lay.name for lay in sk.LAYOUTS] == ["dict-pickle", "tensorbatch-2026-03", "tensorbatch-2026-07",
                                                "packed-2026-09"]


def test_skyrl_before_1379_is_refused_by_name(tmp_path):
    f = tmp_path / "dumped_data" / "global_step_1_training_input.pkl"
    f.parent.mkdir()
    data = g.skyrl_pre1379_pickle(np.random.default_rng(0))
    assert "torch._utils._rebuild_tensor_v2" in _globals(data)
    with pytest.raises(UnsafeFileError, match=r"before #1379 .*'dict-pickle'.*not an attack"):
        f.write_bytes(data)
        sk.import_skyrl(tmp_path, tmp_path / "run", config=g.CONFIG)
    assert not (tmp_path / "run").exists()
    with g._fake_modules("skyrl_train.training_batch", TrainingInputBatch=g.TensorBatchPre1379):
        f.write_bytes(pickle.dumps(g.TensorBatchPre1379(x=1)))  # the skyrl_train package's module name (< #1148)
    with pytest.raises(UnsafeFileError, match=r"before #1379 .*skyrl_train\.training_batch\.TrainingInputBatch"):
        sk.load_batch(f)


def _set_packed(state: dict, key: str, values: np.ndarray, cu: np.ndarray, zero_copy: bool = True) -> None:
    state["batch_dict"][key] = {"format": g.TensorFormat.PACKED_TENSOR, "values": g._serialize_tf(values, zero_copy),
                                "cu_seqlens": g._serialize_tf(cu)}


def _routes_of(state: dict) -> tuple[np.ndarray, np.ndarray]:
    v = state["batch_dict"]["rollout_expert_indices"]
    c = v["cu_seqlens"]
    return v["values"]["data"], np.frombuffer(c["data"], c["dtype"]).reshape(c["shape"]).copy()


def _bad_cu(kind: str, cu: np.ndarray, rows: int) -> np.ndarray:
    cu = cu.copy()
    if kind == "not monotone":
        cu[2], cu[3] = cu[3], cu[2]
    elif kind == "short end":
        cu[-1] = rows - 1
    elif kind == "late start":
        cu[0] = 1
    elif kind == "segments":
        cu = np.delete(cu, 3)
    elif kind == "segment length":
        cu[3] += 1
    return cu


@pytest.mark.parametrize("kind,message", [
    ("not monotone", "cu_seqlens is not monotone"),
    ("short end", r"cu_seqlens runs from 0 to \d+, not from 0 to the \d+ packed rows"),
    ("late start", "cu_seqlens runs from 1"),
    ("segments", "7 packed segments for a batch of 8"),
    ("segment length", "sample 2: its packed route segment holds"),
])
def test_skyrl_malformed_cu_seqlens_are_refused(tmp_path, kind, message):
    state, _ = g.skyrl_packed_batch(np.random.default_rng(0), 6, pad=2)
    values, cu = _routes_of(state)
    _set_packed(state, "rollout_expert_indices", values, _bad_cu(kind, cu, len(values)))
    f = _packed_file(tmp_path, state)
    with pytest.raises(ImportFormatError, match=message) as e:
        sk.import_skyrl(f, tmp_path / "run", config=g.CONFIG)
    assert "global_step_1_training_input.pkl" in str(e.value) and not isinstance(e.value, UnknownLayoutError)
    assert not (tmp_path / "run").exists()  # all or nothing


class _Reduce:
    """An object that pickles as ``fn(*args)`` (+ BUILD ``state``): how a writer's numpy array would pickle."""

    def __init__(self, fn, args, state=None):
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


@pytest.mark.parametrize("how", ["numpy bytes", "protocol 4 view", "protocol 5 view"])
def test_skyrl_packed_wrong_byte_counts_are_refused(tmp_path, how):
    from numpy._core.multiarray import _reconstruct
    from numpy._core.numeric import _frombuffer

    state, _ = g.skyrl_packed_batch(np.random.default_rng(0), 4)
    v = state["batch_dict"]["rollout_expert_indices"]["values"]
    arr = v["data"]
    short = arr.tobytes()[:-3]
    if how == "numpy bytes":
        v.update(format=g.TensorFormat.NUMPY, data=short, shape=arr.shape, dtype=str(arr.dtype))
        message = "bytes are no whole number|values for shape"
    elif how == "protocol 4 view":
        v["data"] = _Reduce(_reconstruct, (np.ndarray, (0,), b"b"), (1, arr.shape, arr.dtype, False, short))
        message = "items for shape"
    else:
        v["data"] = _Reduce(_frombuffer, (short, arr.dtype, arr.shape, "C"))
        message = r"bytes for shape .* expected"
    f = _packed_file(tmp_path, state, protocol=4 if how != "protocol 5 view" else 5)
    with pytest.raises(ImportFormatError, match=message):
        sk.load_batch(f)


def test_skyrl_unknown_format_names_and_skyrl_globals_are_a_newer_layout_not_an_attack(tmp_path):
    class TensorFormat(StrEnum):  # a newer SkyRL's enum, with a member this r3lab does not know
        NUMPY = "numpy"
        NUMPY_VIEW = "numpy_view"
        PACKED_TENSOR = "packed_tensor"
        PACKED_RAGGED = "packed_ragged"

    state, _ = g.skyrl_packed_batch(np.random.default_rng(0), 3)
    for v in state["batch_dict"].values():  # every field's format a member of the newer enum
        for d in (v, *(v or {}).values()):
            if isinstance(d, dict) and "format" in d:
                d["format"] = TensorFormat(str(d["format"]))
    state["batch_dict"]["rollout_expert_indices"]["format"] = TensorFormat.PACKED_RAGGED
    f = _packed_file(tmp_path, state, tensor_format=TensorFormat)
    with pytest.raises(UnknownLayoutError, match=r"TensorFormat\('packed_ragged'\).*not an unsafe file") as e:
        sk.load_batch(f)
    assert "packed-2026-09" in str(e.value) and "global_step_1" in str(e.value)

    state, _ = g.skyrl_packed_batch(np.random.default_rng(0), 3)
    state["batch_dict"]["loss_mask"]["format"] = "arrow"  # a plain-string format name r3lab does not know
    with pytest.raises(UnknownLayoutError, match="key 'loss_mask' has the tensor format 'arrow'"):
        sk.load_batch(_packed_file(tmp_path, state))

    state, _ = g.skyrl_packed_batch(np.random.default_rng(0), 3)
    # a field r3lab reads dense, packed
    _set_packed(state, "rollout_logprobs", np.zeros((1, 1), np.float32), np.array([0, 1, 1, 1], np.int32))
    with pytest.raises(UnknownLayoutError, match="key 'rollout_logprobs' is a packed_tensor"):
        sk.load_batch(_packed_file(tmp_path, state))

    class PackedTensor:  # a global under SkyRL's own module that this r3lab does not know
        def __reduce__(self):
            return (PackedTensor, ())

    state, _ = g.skyrl_packed_batch(np.random.default_rng(0), 3)
    state["metadata"]["extra"] = PackedTensor()
    f = tmp_path / "newer" / "global_step_1_training_input.pkl"
    f.parent.mkdir()
    with g._fake_modules("skyrl.backends.skyrl_train.utils.packed_tensor", PackedTensor=PackedTensor):
        f.write_bytes(g.skyrl_packed_pickle(state))
    with pytest.raises(UnknownLayoutError, match=r"skyrl\.backends\.skyrl_train\.utils\.packed_tensor\.PackedTensor"):
        sk.load_batch(f)


def test_skyrl_packed_routes_of_another_shape_or_dtype_are_refused(tmp_path):
    state, _ = g.skyrl_packed_batch(np.random.default_rng(0), 3)
    values, cu = _routes_of(state)
    _set_packed(state, "rollout_expert_indices", values.astype(np.float32), cu)
    with pytest.raises(ImportFormatError, match="integer"):
        sk.import_skyrl(_packed_file(tmp_path, state), tmp_path / "run", config=g.CONFIG)
    _set_packed(state, "rollout_expert_indices", values.reshape(len(values), -1), cu)
    with pytest.raises(ImportFormatError, match=r"integer \[rows, layers, top_k\]"):
        sk.import_skyrl(_packed_file(tmp_path, state), tmp_path / "run", config=g.CONFIG)


# ---- verl ----------------------------------------------------------------------------------------------------------
def test_verl_pickle_names_exactly_the_writers_globals(tmp_path):
    src, _ = g.verl_dump(tmp_path / "dump", steps=1)
    (f,) = src.rglob("gen_batch.dp")
    found = _globals(f.read_bytes())
    assert found == {"verl.protocol.DataProto", "torch.Size", "numpy._core.multiarray._reconstruct", "numpy.ndarray",
                     "numpy.dtype"}
    assert {f"{m}.{n}" for m, n in vl._allowed("x")} >= found


def test_verl_round_trip(tmp_path):
    """Left-padded prompts, right-padded responses, tool tokens masked, rewards from rm_scores, zero-filled
    routed_experts read over the captured rows only."""
    src, truth = g.verl_dump(tmp_path / "dump")
    run = vl.import_verl(src, tmp_path / "run", config=g.CONFIG)
    g.check_imported(run, truth, logp_train=False, reward=True, advantage=False)
    loaded = runs.load(run)
    assert loaded.summary["samples"] == 18 and loaded.step_records[0]["reward_mean"] == 0.5
    t = loaded.tokens([1])
    assert 0 in t[t["sample"] == 1]["loss_mask"].tolist()  # the tool response stays masked
    report = doctor.diagnose(run)
    assert report.ok, report.text()
    assert report.check("route rows").status == "ok"


def test_verl_source_files_are_hashed_by_step_folder(tmp_path):
    """verl writes one gen_batch.dp per step folder: each is its own key (the step folder names it apart)."""
    import hashlib

    src, _ = g.verl_dump(tmp_path / "dump", steps=2)
    files = runs.load(vl.import_verl(src, tmp_path / "run", config=g.CONFIG)).config["source"]["files"]
    dumps = sorted(src.rglob("gen_batch.dp"))
    root = dumps[0].parent.parent
    assert len(dumps) == 2
    assert files == {f.relative_to(root).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest() for f in dumps}


def test_verl_short_capture(tmp_path):
    src, truth = g.verl_dump(tmp_path / "dump", case="short_capture")
    run = vl.import_verl(src, tmp_path / "run", config=g.CONFIG)
    g.check_imported(run, truth, logp_train=False, reward=True, advantage=False)
    assert runs.load(run).config["capture"]["counts"]["prefix_capture"] == 3
    assert doctor.diagnose(run).ok


def test_verl_src_forms_and_detect(tmp_path):
    src, _ = g.verl_dump(tmp_path / "dump", steps=2)
    exp = src / "exp_proj"
    shape = exp / "GBS3_N2_in8_out8"
    for i, s in enumerate((src, exp, shape, shape / "2", shape / "2" / "gen_batch.dp")):
        run = runs.load(vl.import_verl(s, tmp_path / f"run{i}", config=g.CONFIG))
        assert run.token_steps() == ([2] if "2" in s.parts[-2:] else [1, 2])
        assert vl.detect(s), s
    assert vl.detect(tmp_path / "nothing") is None and vl.detect(ROOT / "tests") is None
    sky, _ = g.skyrl_dump(tmp_path / "export", steps=1)
    assert vl.detect(sky) is None and sk.detect(src) is None  # neither claims the other's dump


def test_verl_default_serialization_is_refused_with_the_setting(tmp_path):
    src, _ = g.verl_dump(tmp_path / "dump", steps=1, numpy_serialization=False)
    with pytest.raises(UnsafeFileError, match="VERL_DATAPROTO_SERIALIZATION_METHOD=numpy"):
        vl.import_verl(src, tmp_path / "run", config=g.CONFIG)
    assert vl.SERIALIZATION_SETTING == "VERL_DATAPROTO_SERIALIZATION_METHOD=numpy"


# ---- refusals that run no code --------------------------------------------------------------------------------------
class _System:
    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


class _Eval:
    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        import builtins

        return (builtins.eval, (self.code,))


class _Popen:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (subprocess.Popen, (["touch", self.marker],))


#: the global ``open`` pickles as: io.open up to Python 3.11, _io.open from 3.12 (the builtin's __module__)
OPEN_GLOBAL = f"{open.__module__}.open"


def _payloads(marker: Path):
    """Payload by the global its pickle names (os.system pickles as posix.system, open as OPEN_GLOBAL)."""
    return {"posix.system": _System(f"touch {marker}"), "builtins.eval": _Eval(f"open({str(marker)!r}, 'w')"),
            OPEN_GLOBAL: g.RunsCode(str(marker)), "subprocess.Popen": _Popen(str(marker))}


def test_reduce_payloads_are_refused_before_they_run(tmp_path):
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(_System(f"touch {live}")))  # the oracle: a plain pickle.load runs the payload
    assert live.exists()
    marker = tmp_path / "marker"
    for name, payload in _payloads(marker).items():
        data = pickle.dumps(payload)
        sky = tmp_path / "export" / name / "dumped_data" / "global_step_1_training_input.pkl"
        sky.parent.mkdir(parents=True)
        sky.write_bytes(data)
        ver = tmp_path / "dump" / name / "GBS1_N1_in8_out8" / "1" / "gen_batch.dp"
        ver.parent.mkdir(parents=True)
        ver.write_bytes(data)
        assert name in _globals(data)
        with pytest.raises(UnsafeFileError, match=f"the global {re.escape(name)}") as e:
            sk.import_skyrl(sky.parent.parent, tmp_path / f"run-s-{name}", config=g.CONFIG)
        assert str(sky) in str(e.value)
        with pytest.raises(UnsafeFileError, match=f"the global {re.escape(name)}"):
            vl.import_verl(ver.parent, tmp_path / f"run-v-{name}", config=g.CONFIG)
        assert not marker.exists(), name


def test_a_payload_inside_a_real_batch_is_refused(tmp_path):
    marker = tmp_path / "marker"
    state, _ = g.skyrl_batch(np.random.default_rng(0), 3)
    state["metadata"]["evil"] = g.RunsCode(str(marker))
    f = tmp_path / "dumped_data" / "global_step_1_training_input.pkl"
    f.parent.mkdir()
    f.write_bytes(g.skyrl_pickle(state))
    with pytest.raises(UnsafeFileError, match=f"the global {re.escape(OPEN_GLOBAL)}"):
        sk.load_batch(f)
    vstate, _ = g.verl_batch(np.random.default_rng(0), 3)
    vstate[1]["extras"][0] = g.RunsCode(str(marker))  # inside an object array of non_tensor_batch
    v = tmp_path / "1" / "gen_batch.dp"
    v.parent.mkdir()
    v.write_bytes(g.verl_pickle(vstate))
    with pytest.raises(UnsafeFileError, match=f"the global {re.escape(OPEN_GLOBAL)}"):
        vl.load_gen_batch(v)
    assert not marker.exists()


class _CallsAllowed:
    """REDUCE on an allowed global with arguments its writer never passes."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def test_allowed_globals_refuse_calls_their_writer_never_makes(tmp_path):
    import torch

    f = tmp_path / "global_step_1_training_input.pkl"
    cases = {
        "TrainingInputBatch called": lambda: _CallsAllowed(g.TrainingInputBatch, ({"batch_dict": {}},)),
        "rebuild with another class": lambda: _CallsAllowed(g._rebuild_tensor_batch, (torch.device, {})),
        "rebuild with no state": lambda: _CallsAllowed(g._rebuild_tensor_batch, (g.TrainingInputBatch, "x")),
    }
    for name, make in cases.items():
        with g._fake_modules(g.SKYRL_MODULE, _rebuild_tensor_batch=g._rebuild_tensor_batch,
                             TrainingInputBatch=g.TrainingInputBatch):
            f.write_bytes(pickle.dumps(make()))
        with pytest.raises(UnsafeFileError, match="never"):
            sk.load_batch(f)
        assert name  # each case refused by the stand-in's own check
    state, _ = g.skyrl_batch(np.random.default_rng(0), 2)
    state["batch_dict"]["sequences"]["dtype"] = "O"  # an object dtype from the file is never built
    f.write_bytes(g.skyrl_pickle(state))
    with pytest.raises(UnsafeFileError, match="not a plain numeric dtype"):
        sk.load_batch(f)
    v = tmp_path / "gen_batch.dp"
    v.write_bytes(pickle.dumps(np.zeros(3, dtype=[("a", "i4"), ("b", "f4")])))  # a structured dtype
    with pytest.raises(UnsafeFileError, match="not a plain numeric dtype"):
        vl.load_gen_batch(v)
    from numpy._core.multiarray import _reconstruct

    for bad in (_CallsAllowed(_reconstruct, (torch.Size, (0,), b"b")), _CallsAllowed(g.DataProto, ((None, {}, {}),))):
        with g._fake_modules("verl.protocol", DataProto=g.DataProto):
            v.write_bytes(pickle.dumps(bad))
        with pytest.raises(UnsafeFileError, match="never|other than numpy.ndarray"):
            vl.load_gen_batch(v)


def test_broken_files_name_the_file(tmp_path):
    f = tmp_path / "global_step_3_training_input.pkl"
    f.write_bytes(g.skyrl_pickle(g.skyrl_batch(np.random.default_rng(0), 2)[0])[:-40])
    with pytest.raises(ImportFormatError, match="global_step_3"):
        sk.load_batch(f)
    f.write_bytes(pickle.dumps({"not": "a batch"}))
    with pytest.raises(ImportFormatError, match="TrainingInputBatch"):
        sk.load_batch(f)


# ---- memory ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["skyrl", "skyrl-packed", "verl"])
def test_import_is_streaming_and_bounded_in_memory(tmp_path, kind):
    """100k samples in 8 step files (with routes) import with a peak-memory rise under the dump's size: one step's
    pickle, its unpickled tensors and its routes are held at a time (tests/import_memory.py's measure, as
    test_importers' NeMo-RL test). Measured (61 MB SkyRL, 59 MB packed, 119 MB verl dump): a rise of 0.70, 0.76 and
    0.53 times the dump; the same samples held in a list before write_run rise 3.35, 3.14 and 1.62 times it."""
    small = g.large(kind, tmp_path / "small", samples=800)
    big = g.large(kind, tmp_path / "big", samples=100_000)
    size = sum(f.stat().st_size for f in big.rglob("*") if f.is_file())
    mod = kind.split("-")[0]
    rise = import_rise(f"from r3lab.importers.{mod} import import_{mod} as imp", small, big, tmp_path / "run",
                       g.CONFIG)
    assert rise < size, (rise, size)
    run = runs.load(tmp_path / "run")
    assert run.summary["samples"] == 100_000 and run.summary["samples_without_routes"] == 0

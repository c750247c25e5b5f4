"""What every importer shares: named layouts (recorded in runs, listed by ``r3lab import --formats`` and the import
guide, docs/guides/import-and-doctor.md), an unknown layout refused as new (not as unsafe), ``-1`` rows read as
uncaptured (never as expert 255), and routing weights stored beside the ids."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from r3lab import runs
from r3lab.doctor import diagnose
from r3lab.errors import ImportFormatError, UnknownLayoutError, UnsafeFileError
from r3lab.importers.common import LayerMap, Sample, write_run
from r3lab.importers.layouts import Layout, LayoutsSeen, formats_table, unknown_layout
from r3lab.importers.registry import REGISTRY
from r3lab.routes import SENTINEL

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "data" / "models" / "tiny-qwen3-moe" / "config.json"  # 8 layers, all MoE, 16 experts, top-2
L, E, K = 8, 16, 2
TEST_LAYOUTS = (Layout("old", "a test writer", "no 'v' key", "routes"), Layout("new", "a test writer", "v=2", "all"))


def _routes(rng: np.random.Generator, rows: int) -> np.ndarray:
    """Distinct top-2 ids per (row, layer), int32 as a producer writes them."""
    ids = [np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(rows)]
    return np.stack(ids).astype(np.int32)


def _sample(rng: np.random.Generator, step: int, P: int, R: int, **kw) -> Sample:
    return Sample(step=step, tokens=rng.integers(0, 100, P + R), response_length=R,
                  logp_infer=-rng.random(R), logp_train=-rng.random(R), where=f"test step {step}", **kw)


def test_unknown_layout_is_a_format_error_that_names_what_was_seen_and_what_is_read():
    e = unknown_layout("skyrl", "dump.pkl", "a 'packed_v9' tensor format", TEST_LAYOUTS)
    assert isinstance(e, UnknownLayoutError) and isinstance(e, ImportFormatError)
    assert not isinstance(e, UnsafeFileError)  # a newer writer is not an attack
    msg = str(e)
    assert "dump.pkl" in msg and "'packed_v9'" in msg and "old (no 'v' key)" in msg and "new (v=2)" in msg
    assert "not an unsafe file" in msg and "r3lab import --formats" in msg


def test_layouts_seen_keeps_first_seen_order_and_refuses_an_undeclared_name():
    seen = LayoutsSeen(TEST_LAYOUTS)
    for name in ("new", "old", "new"):
        seen.add(name)
    assert list(seen) == ["new", "old"]
    with pytest.raises(KeyError, match="'newer' is not declared"):
        seen.add("newer")


def test_the_run_records_the_layouts_the_import_met(tmp_path):
    rng = np.random.default_rng(0)
    seen = LayoutsSeen(TEST_LAYOUTS)

    def samples():
        for step in (0, 1):
            seen.add("old" if step == 0 else "new")
            yield _sample(rng, step, 3, 4)

    run = runs.load(write_run(samples(), tmp_path / "run", source_format="test", files=[], layer_map=None,
                              layouts=seen))
    assert run.config["source_layouts"] == ["old", "new"] == run.summary["source_layouts"]


def test_whole_minus_one_rows_are_uncaptured_never_expert_ids(tmp_path):
    rng = np.random.default_rng(1)
    P, R = 3, 5
    full = _routes(rng, P + R - 1)
    trailing = np.concatenate([full, np.full((2, L, K), SENTINEL, np.int32)])  # the final position's row marked -1
    gap = full.copy()
    gap[4] = SENTINEL  # a row inside P + R - 1 was not captured
    mixed = full.copy()
    mixed[2, 3, 1] = SENTINEL  # -1 in one slot of a real row: not a sentinel row, an id out of range
    samples = [_sample(rng, 0, P, R, routes=r) for r in (trailing, gap, full, mixed)]
    lmap = LayerMap.from_config(CONFIG)
    run = runs.load(write_run(iter(samples), tmp_path / "run", source_format="test", files=[], layer_map=lmap))
    got = run.routes(0, "engine")
    assert got.lengths.tolist() == [P + R - 1, 0, P + R - 1, 0]
    np.testing.assert_array_equal(got.sequence(0), full)  # the marked rows dropped, the captured rows kept bit for bit
    np.testing.assert_array_equal(got.sequence(2), full)
    assert int(got.values.max()) < E  # no -1 became 255
    cap = run.config["capture"]
    assert cap["counts"]["sentinel_rows"] == 2 + 1  # two marked rows in the first sample, one in the second
    assert cap["counts"]["prefix_capture"] == 1 and cap["counts"]["ids_out_of_range"] == 1
    report = diagnose(run)
    assert report.check("expert ids").status == "fail"  # the mixed row is a real defect
    assert report.check("route rows").status in ("ok", "warn")  # the gap is marked by the producer: a warning


def test_a_sentinel_gap_alone_warns_and_never_fails_the_route_rows_check(tmp_path):
    rng = np.random.default_rng(2)
    P, R = 4, 6
    gap = _routes(rng, P + R - 1)
    gap[-1] = SENTINEL
    samples = [_sample(rng, 0, P, R, routes=_routes(rng, P + R - 1)), _sample(rng, 0, P, R, routes=gap)]
    run = runs.load(write_run(iter(samples), tmp_path / "run", source_format="test", files=[],
                              layer_map=LayerMap.from_config(CONFIG)))
    assert diagnose(run).check("route rows").status == "warn"


def test_routing_weights_beside_ids_are_stored_with_the_routes(tmp_path):
    rng = np.random.default_rng(3)
    P, R = 2, 6
    ids = [_routes(rng, P + R - 1) for _ in range(3)]
    w = [rng.random(r.shape).astype(np.float32) for r in ids]
    samples = [_sample(rng, 0, P, R, routes=r, weights=x) for r, x in zip(ids, w, strict=True)]
    run = runs.load(write_run(iter(samples), tmp_path / "run", source_format="test", files=[],
                              layer_map=LayerMap.from_config(CONFIG)))
    got = run.routes(0, "engine")
    assert got.weights is not None and run.summary["samples_with_weights"] == 3
    for i in range(3):
        np.testing.assert_array_equal(got.sequence(i), ids[i])
        np.testing.assert_array_equal(got.weights[got.cu_seqlens[i]:got.cu_seqlens[i + 1]], w[i])


def test_weights_on_some_samples_only_are_dropped_and_counted(tmp_path):
    rng = np.random.default_rng(4)
    P, R = 2, 3
    a, b = _routes(rng, P + R - 1), _routes(rng, P + R - 1)
    samples = [_sample(rng, 0, P, R, routes=a, weights=rng.random(a.shape).astype(np.float32)),
               _sample(rng, 0, P, R, routes=b)]
    run = runs.load(write_run(iter(samples), tmp_path / "run", source_format="test", files=[],
                              layer_map=LayerMap.from_config(CONFIG)))
    assert run.routes(0, "engine").weights is None and run.summary["samples_weights_dropped"] == 1


def test_weights_of_another_shape_than_the_ids_are_refused(tmp_path):
    rng = np.random.default_rng(5)
    r = _routes(rng, 4)
    s = _sample(rng, 0, 2, 3, routes=r, weights=np.ones((4, L, K + 1), np.float32))
    with pytest.raises(ImportFormatError, match=r"routing weights of shape \(4, 8, 3\) beside ids of shape"):
        write_run(iter([s]), tmp_path / "run", source_format="test", files=[], layer_map=LayerMap.from_config(CONFIG))
    assert not (tmp_path / "run").exists()


def test_formats_table_lists_every_layout_of_every_kind_and_the_command_prints_it():
    table = formats_table()
    for kind, spec in REGISTRY.items():
        for lay in spec.layouts:
            assert f"| {kind} | `{lay.name}` |" in table
    out = subprocess.run([sys.executable, "-m", "r3lab", "import", "--formats"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert out.strip() == table


def test_the_import_guide_carries_the_formats_table_as_the_command_prints_it():
    text = (ROOT / "docs" / "guides" / "import-and-doctor.md").read_text()
    begin, end = "<!-- r3lab import --formats -->\n", "\n<!-- end r3lab import --formats -->"
    assert begin in text and end in text, "the guide's formats table is generated: python -m r3lab import --formats"
    assert text.split(begin, 1)[1].split(end, 1)[0].strip() == formats_table()


def test_a_bare_import_says_a_kind_is_needed():
    p = subprocess.run([sys.executable, "-m", "r3lab", "import"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode != 0 and "needs a KIND" in p.stderr and "--formats" in p.stderr

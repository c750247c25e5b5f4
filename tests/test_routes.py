import numpy as np
import pytest
from conftest import random_routes

from r3lab.errors import RouteFormatError
from r3lab.routes import Routes, compact_dtype


@pytest.mark.parametrize(
    ("E", "dtype"),
    [(1, np.uint8), (2, np.uint8), (256, np.uint8), (257, np.uint16), (384, np.uint16), (512, np.uint16),
     (65536, np.uint16)],
)
def test_compact_dtype(E, dtype):
    assert compact_dtype(E) == dtype


@pytest.mark.parametrize("E", [0, -3, 65537, 2.0, True, "8"])
def test_compact_dtype_refuses(E):
    with pytest.raises(RouteFormatError):
        compact_dtype(E)


def test_512_experts_do_not_wrap():
    vals = np.array([[[511, 300]], [[256, 0]]])
    r = Routes(vals, [0, 2], 512)
    assert r.values.dtype == np.uint16
    assert r.values.tolist() == vals.tolist()


def test_construction_validates(rng):
    good = np.array([[[0, 1]], [[2, 3]]])
    with pytest.raises(RouteFormatError, match="out of range"):
        Routes(good, [0, 2], 3)
    with pytest.raises(RouteFormatError, match="out of range"):
        Routes(-good, [0, 2], 8)
    with pytest.raises(RouteFormatError, match="repeated expert id"):
        Routes(np.array([[[1, 1]]]), [0, 1], 4)
    with pytest.raises(RouteFormatError, match="repeated expert id"):
        Routes(np.tile(np.arange(17), (3, 1, 1)).reshape(3, 1, 17) % 16, [0, 3], 32)  # k > 16 path
    with pytest.raises(RouteFormatError, match="monotone"):
        Routes(good, [0, 2, 1, 2], 4)
    with pytest.raises(RouteFormatError, match="ends at"):
        Routes(good, [0, 1], 4)
    with pytest.raises(RouteFormatError, match="start at 0"):
        Routes(good, [1, 2], 4)
    with pytest.raises(RouteFormatError, match="layer_ids"):
        Routes(good, [0, 2], 4, layer_ids=[1, 1][:1] + [0])
    with pytest.raises(RouteFormatError, match="strictly increasing"):
        Routes(np.zeros((1, 2, 1), int), [0, 1], 4, layer_ids=[3, 3])
    with pytest.raises(RouteFormatError, match=r"\[total_tokens"):
        Routes(good[0], [0, 1], 4)
    with pytest.raises(RouteFormatError, match="integers"):
        Routes(good.astype(float), [0, 2], 4)
    with pytest.raises(RouteFormatError, match="top_k"):
        Routes(np.zeros((1, 1, 3), int) + np.arange(3), [0, 1], 2)


def test_immutable_and_owns_its_buffer():
    vals = np.array([[[0, 1]], [[2, 3]]], dtype=np.uint8)
    r = Routes(vals, [0, 2], 4)
    vals[0, 0, 0] = 3
    assert r.values[0, 0, 0] == 0
    with pytest.raises(ValueError):
        r.values[0, 0, 0] = 1
    with pytest.raises(AttributeError):
        r.num_experts = 3


def test_pickle_round_trip_keeps_everything_and_immutability(rng):
    import pickle

    r = random_routes(rng, lengths=[3, 0, 5], num_layers=3, top_k=2, num_experts=8).select_layers([0, 2])
    r = r.with_weights(rng.random(r.values.shape, dtype=np.float32))
    for protocol in (2, 5):  # 5: out-of-band buffers, as Ray's object store pickles
        back = pickle.loads(pickle.dumps(r, protocol=protocol))
        assert back == r and back.layer_ids.tolist() == [0, 2] and back.values.dtype == r.values.dtype
        assert not back.values.flags.writeable
        with pytest.raises(AttributeError, match="immutable"):
            back.num_experts = 3


def test_padded_round_trip_right_and_left(rng):
    r = random_routes(rng, num_experts=16, top_k=2, num_layers=3, lengths=[5, 0, 3, 7])
    for left in (False, True):
        padded = r.to_padded(left_padded=left)
        assert padded.shape == (4, 7, 3, 2)
        assert Routes.from_padded(padded, r.lengths, num_experts=16, left_padded=left) == r
        pad_rows = padded[1]  # the empty sequence: all padding, distinct ids arange(k)
        assert (pad_rows == np.arange(2)).all()
    assert r.to_padded(10).shape[1] == 10
    with pytest.raises(RouteFormatError, match="shorter"):
        r.to_padded(6)
    with pytest.raises(RouteFormatError, match="lengths"):
        Routes.from_padded(r.to_padded(), [5, 0, 3], num_experts=16)


def test_list_sequence_take_split_concat(rng):
    r = random_routes(rng, num_experts=8, top_k=2, num_layers=2, lengths=[3, 0, 4, 1, 2])
    seqs = [r.sequence(i) for i in range(len(r))]
    assert [len(s) for s in seqs] == [3, 0, 4, 1, 2]
    assert Routes.from_list(seqs, num_experts=8) == r
    assert np.array_equal(r.sequence(-1), seqs[4])
    t = r.take([4, 0])
    assert t.lengths.tolist() == [2, 3]
    assert np.array_equal(t.sequence(0), seqs[4]) and np.array_equal(t.sequence(1), seqs[0])
    parts = r.split(3)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert Routes.concat(parts) == r
    assert Routes.concat(r.split([1, 4])) == r
    assert len(r.split(7)) == 7 and Routes.concat(r.split(7)) == r
    with pytest.raises(IndexError):
        r.sequence(5)
    with pytest.raises(RouteFormatError, match="cannot concat"):
        Routes.concat([r, random_routes(rng, num_experts=9, top_k=2, num_layers=2, lengths=[1])])


def test_select_layers_keeps_global_ids(rng):
    r = random_routes(rng, num_experts=8, top_k=2, num_layers=3, lengths=[4], layer_ids=[1, 2, 5])
    s = r.select_layers([5, 1])
    assert s.layer_ids.tolist() == [1, 5]
    assert np.array_equal(s.values[:, 1], r.values[:, 2])
    with pytest.raises(RouteFormatError, match=r"layers \[0\] not in"):
        r.select_layers([0])


def test_equality_and_nbytes(rng):
    r = random_routes(rng, num_experts=300, top_k=3, num_layers=2, lengths=[2, 2])
    assert r == Routes(r.values, r.cu_seqlens, 300, r.layer_ids)
    assert r != Routes(r.values, [0, 1, 4], 300, r.layer_ids)
    assert r != Routes(r.values, r.cu_seqlens, 301, r.layer_ids)
    assert r.nbytes == r.values.nbytes + r.cu_seqlens.nbytes + r.layer_ids.nbytes == 4 * 2 * 3 * 2 + 3 * 8 + 2 * 8
    assert r.sorted_rows().values.tolist() == np.sort(r.values, axis=2).tolist()


def test_eq_compares_values_cu_seqlens_layer_ids_and_num_experts(rng):
    r = random_routes(rng, num_experts=16, top_k=2, num_layers=2, lengths=[2, 3], layer_ids=[1, 2])
    same = Routes(r.values.copy(), r.cu_seqlens.copy(), 16, [1, 2])
    assert r == same and same == r and not (r != same)
    other = np.array(r.values)
    other[4, 1] = other[4, 1][::-1]  # the same set in another order: different values
    assert r != Routes(other, r.cu_seqlens, 16, [1, 2])
    other = np.array(r.values)
    other[0, 0, 0] = next(e for e in range(16) if e not in other[0, 0])  # one id changed
    assert r != Routes(other, r.cu_seqlens, 16, [1, 2])
    assert r != Routes(r.values, [0, 1, 5], 16, [1, 2])  # same tokens, split differently
    assert r != Routes(r.values, [0, 5], 16, [1, 2])  # one sequence instead of two
    assert r != Routes(r.values, r.cu_seqlens, 16, [0, 1])  # other layer ids
    assert r != Routes(r.values, r.cu_seqlens, 17, [1, 2])  # other num_experts, same dtype and ids
    assert r != Routes(r.values[:, :1], r.cu_seqlens, 16, [1])  # fewer layers
    assert r != Routes(r.values[:, :, :1], r.cu_seqlens, 16, [1, 2])  # smaller top_k
    assert r != Routes(r.values, r.cu_seqlens, 300, [1, 2])  # wider dtype, same ids
    assert (r == "routes") is False and r != [1, 2] and r != None  # noqa: E711 - not Routes: never equal
    assert r.__eq__(object()) is NotImplemented


# ---- the library's errors (r3lab.errors lists them all; the stage modules re-export) ----------------------

#: (module, name) -> the type in r3lab.errors it must be; the staging and runs modules join when they re-export
#: stage modules that raise an error type under its name hold r3lab.errors' own class (the other stages import it
#: where they raise it; none re-exports it: its one face is r3lab.errors)
STAGE_ERRORS = {
    ("r3lab.slicing", "SlicingError"): "SlicingError",
    ("r3lab.slicing", "LayoutError"): "SlicingError",
    ("r3lab.moe_layout", "ModelConfigError"): "ConfigError",
    ("r3lab.staging.plan", "StagingError"): "StagingError",
    ("r3lab.runs.reader", "RunFormatError"): "RunFormatError",
}


def test_every_error_type_is_defined_once_in_errors_with_the_same_bases():
    import importlib

    from r3lab import errors

    types = {getattr(errors, n) for n in errors.__all__} - {errors.cli_flag}  # the two former names are aliases
    assert len(types) == len(errors.__all__) - 3  # cli_flag, LayoutError and ModelConfigError are no types
    for t in types - {errors.R3LabError}:
        # bad input is a ValueError, a failed process an R3LabFailure (a RuntimeError), a package an extra brings and
        # the environment lacks a MissingExtraError (an ImportError): exactly one of the three
        kinds = (issubclass(t, ValueError), issubclass(t, errors.R3LabFailure), issubclass(t, ImportError))
        assert issubclass(t, errors.R3LabError) and sum(kinds) == 1, t
        assert t.__module__ == "r3lab.errors", t
    for (module, name), want in STAGE_ERRORS.items():
        assert getattr(importlib.import_module(module), name) is getattr(errors, want), (module, name)

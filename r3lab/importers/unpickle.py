"""A restricted unpickler: a framework's pickle is read with r3lab's own inert stand-ins, never its classes.

SkyRL's ``TrainingInputBatch`` dumps and verl's ``DataProto`` dumps are plain pickles. ``pickle.load`` would import
and call whatever globals a file names (``os.system``, ``builtins.eval``, ...). :class:`RestrictedUnpickler`
overrides ``find_class``: each format passes the exact globals its writer records, each mapped to a stand-in
defined here (nothing from skyrl, verl, numpy's or torch's reconstructors is imported or called), and every other
global is refused by name with :class:`~r3lab.importers.common.UnsafeFileError` before anything runs. Persistent
ids are refused (the base class has no ``persistent_load``).

What a stand-in can do when the pickle calls it (``REDUCE``/``NEWOBJ``/``BUILD``) is fixed here: a
:class:`Marker` (a class the writer names) refuses to be called; a :class:`Rebuilder` checks its arguments and
returns plain data; numpy arrays are rebuilt from their raw bytes with ``np.frombuffer`` for numeric dtypes only,
and object arrays only from a list of what the pickle already produced (plain values and other stand-ins).
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import ImportFormatError, UnsafeFileError

__all__ = ["RestrictedUnpickler", "restricted_load", "Marker", "Rebuilder", "NUMPY_GLOBALS", "ArrayStandIn",
           "resolve", "numeric_dtype"]

_NUMERIC = re.compile(r"^[<>|=]?(b1|bool|[iu][1248]|u?int(8|16|32|64)|f[248]|float(16|32|64))$")
_STRINGS = re.compile(r"^[<>|=]?[US]\d+$")


def numeric_dtype(code: Any, where: str) -> np.dtype:
    """``np.dtype(code)`` for a bool/int/uint/float code only (never object, void or structured dtypes)."""
    if not isinstance(code, str) or not _NUMERIC.match(code):
        raise UnsafeFileError(f"{where}: dtype {code!r} is not a plain numeric dtype; r3lab reads bool, int, uint "
                              "and float arrays only")
    return np.dtype(code)


class Marker:
    """A class or function a format's writer names, as inert data: calling it (REDUCE/NEWOBJ on it) is refused."""

    def __init__(self, qualname: str, path: str):
        self.qualname, self.path = qualname, path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsafeFileError(f"{self.path!r} calls {self.qualname} directly; its writer never does that, so r3lab "
                              "refuses the file (a hand-made pickle, or a format r3lab does not know)")

    def __setstate__(self, state: Any) -> None:
        raise UnsafeFileError(f"{self.path!r} sets state on {self.qualname}; its writer never does that")

    def __repr__(self) -> str:
        return f"<stand-in for {self.qualname}>"


class Rebuilder:
    """A function a format's writer names: ``check(args)`` validates the call and returns plain data."""

    def __init__(self, qualname: str, path: str, check: Callable[[str, tuple[Any, ...]], Any]):
        self.qualname, self.path, self._check = qualname, path, check

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise UnsafeFileError(f"{self.path!r}: {self.qualname} called with keywords {sorted(kwargs)}")
        return self._check(f"{self.path!r}: {self.qualname}", args)

    def __setstate__(self, state: Any) -> None:
        raise UnsafeFileError(f"{self.path!r} sets state on {self.qualname}; its writer never does that")


class ArrayStandIn:
    """What numpy's ``_reconstruct(ndarray, shape, dtype)`` + ``BUILD`` yields here: a numpy array made by r3lab."""

    def __init__(self, path: str):
        self.path = path
        self.array: np.ndarray | None = None

    def __setstate__(self, state: Any) -> None:
        where = f"{self.path!r}: a numpy array"
        if not (isinstance(state, tuple) and len(state) == 5):
            raise UnsafeFileError(f"{where} with an unknown state layout")
        _, shape, dtype, fortran, data = state
        if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise ImportFormatError(f"{where} has shape {shape!r}")
        if not isinstance(dtype, DTypeStandIn):
            raise UnsafeFileError(f"{where} has a dtype r3lab did not build ({type(dtype).__name__})")
        if dtype.kind == "object":
            if not isinstance(data, list):
                raise UnsafeFileError(f"{where}: an object array whose items are not a list")
            arr = np.empty(len(data), dtype=object)
            arr[:] = [resolve(x) for x in data]
            self.array = arr.reshape(shape, order="F" if fortran else "C")
            return
        if not isinstance(data, bytes | bytearray):
            raise UnsafeFileError(f"{where}: raw data is {type(data).__name__}, not bytes")
        arr = np.frombuffer(data, dtype=dtype.dtype)
        n = int(np.prod(shape)) if shape else 1
        if arr.size != n:
            raise ImportFormatError(f"{where}: {arr.size} items for shape {shape}")
        self.array = arr.reshape(shape, order="F" if fortran else "C")


class DTypeStandIn:
    """numpy's pickled ``dtype(code, False, True)`` + ``BUILD``: numeric, str/bytes or object codes only."""

    def __init__(self, code: str, path: str):
        self.path, self.code = path, code
        if code == "O8":
            self.kind, self.dtype = "object", np.dtype(object)
        elif _STRINGS.match(code):
            self.kind, self.dtype = "string", np.dtype(code)
        else:
            self.kind, self.dtype = "numeric", numeric_dtype(code, f"{path!r}")

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and len(state) >= 2 and state[1] in ("<", ">", "|", "=")):
            raise UnsafeFileError(f"{self.path!r}: a numpy dtype with state {state!r}")
        if self.kind != "object" and state[1] in ("<", ">"):
            self.dtype = self.dtype.newbyteorder(state[1])


def _np_reconstruct(path: str, ndarray_marker: Marker) -> Rebuilder:
    def check(where: str, args: tuple[Any, ...]) -> ArrayStandIn:
        if len(args) != 3 or args[0] is not ndarray_marker:
            raise UnsafeFileError(f"{where} called with {len(args)} arguments or a class other than numpy.ndarray")
        return ArrayStandIn(path)

    return Rebuilder("numpy._core.multiarray._reconstruct", path, check)


def _np_dtype(path: str) -> Rebuilder:
    def check(where: str, args: tuple[Any, ...]) -> DTypeStandIn:
        if len(args) != 3 or not isinstance(args[0], str):
            raise UnsafeFileError(f"{where} called with {args!r}")
        return DTypeStandIn(args[0], path)

    return Rebuilder("numpy.dtype", path, check)


def _np_scalar(path: str) -> Rebuilder:
    def check(where: str, args: tuple[Any, ...]) -> Any:
        if len(args) != 2 or not isinstance(args[0], DTypeStandIn) or not isinstance(args[1], bytes):
            raise UnsafeFileError(f"{where} called with {[type(a).__name__ for a in args]}")
        if args[0].kind != "numeric":
            raise UnsafeFileError(f"{where}: a numpy scalar of dtype {args[0].code!r}")
        return np.frombuffer(args[1], dtype=args[0].dtype)[0].item()

    return Rebuilder("numpy._core.multiarray.scalar", path, check)


def NUMPY_GLOBALS(path: str) -> dict[tuple[str, str], Any]:  # noqa: N802 (a table, built per file)
    """numpy's pickle globals (numpy 1.x and 2.x module names) mapped to stand-ins for the file ``path``."""
    nd = Marker("numpy.ndarray", path)
    out: dict[tuple[str, str], Any] = {("numpy", "ndarray"): nd, ("numpy", "dtype"): _np_dtype(path)}
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        out[(mod, "_reconstruct")] = _np_reconstruct(path, nd)
        out[(mod, "scalar")] = _np_scalar(path)
    return out


def resolve(x: Any) -> Any:
    """Replace every :class:`ArrayStandIn` in nested dicts, lists and tuples by its array."""
    if isinstance(x, ArrayStandIn):
        if x.array is None:
            raise UnsafeFileError(f"{x.path!r}: a numpy array without its state")
        return x.array
    if isinstance(x, dict):
        return {k: resolve(v) for k, v in x.items()}
    if isinstance(x, list):
        return [resolve(v) for v in x]
    if isinstance(x, tuple):
        return tuple(resolve(v) for v in x)
    return x


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` returns only the stand-ins in ``allowed`` (else refuses by name)."""

    def __init__(self, file: io.BufferedIOBase, path: str, allowed: Mapping[tuple[str, str], Any], what: str):
        super().__init__(file)
        self._path, self._allowed, self._what = path, allowed, what

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._allowed:
            raise UnsafeFileError(
                f"{self._path!r} names the global {module}.{name}, which {self._what} never writes; loading it could "
                f"run code, so r3lab refuses the file (it allows only {sorted(f'{m}.{n}' for m, n in self._allowed)})")
        return self._allowed[key]

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeFileError(f"{self._path!r} holds a persistent id; {self._what} never writes one")


def restricted_load(path: Path, allowed: Mapping[tuple[str, str], Any], what: str) -> Any:
    """Unpickle ``path`` with only ``allowed`` globals (stand-ins); a broken file is an ImportFormatError."""
    p = Path(path)
    if not p.is_file():
        raise ImportFormatError(f"{str(p)!r} does not exist")
    with open(p, "rb") as f:
        try:
            return RestrictedUnpickler(f, str(p), allowed, what).load()
        except (UnsafeFileError, ImportFormatError):
            raise
        except (pickle.UnpicklingError, EOFError, TypeError, AttributeError, ValueError, IndexError, KeyError,
                MemoryError, RecursionError) as e:
            raise ImportFormatError(f"{str(p)!r} is not a readable {what} pickle: {type(e).__name__}: {e}") from e


def _np_frombuffer(path: str) -> Rebuilder:
    def check(where: str, args: tuple[Any, ...]) -> np.ndarray:
        if len(args) != 4:
            raise UnsafeFileError(f"{where} called with {len(args)} arguments (numpy passes buffer, dtype, shape, "
                                  "order)")
        buf, dtype, shape, order = args
        if not isinstance(buf, bytes | bytearray):
            raise UnsafeFileError(f"{where}: the buffer is {type(buf).__name__}, not in-band bytes (an out-of-band "
                                  "buffer is never in a file)")
        if not isinstance(dtype, DTypeStandIn) or dtype.kind != "numeric":
            raise UnsafeFileError(f"{where}: a dtype r3lab did not build as numeric ({type(dtype).__name__})")
        if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise ImportFormatError(f"{where}: shape {shape!r}")
        if order not in ("C", "F"):
            raise UnsafeFileError(f"{where}: order {order!r}")
        n = int(np.prod(shape)) if shape else 1
        if len(buf) != n * dtype.dtype.itemsize:
            raise ImportFormatError(f"{where}: {len(buf)} bytes for shape {shape} of {dtype.dtype} "
                                    f"({n * dtype.dtype.itemsize} expected)")
        return np.frombuffer(buf, dtype=dtype.dtype).reshape(shape, order=order)

    return Rebuilder("numpy._core.numeric._frombuffer", path, check)


def NUMPY_PROTOCOL5_GLOBALS(path: str) -> dict[tuple[str, str], Any]:  # noqa: N802 (a table, built per file)
    """numpy's pickle-protocol-5 array global (``ndarray.__reduce_ex__(5)``: ``_frombuffer(PickleBuffer, dtype,
    shape, order)``, the buffer in-band in a file) for the file ``path``; use beside :func:`NUMPY_GLOBALS`."""
    fb = _np_frombuffer(path)
    return {(mod, "_frombuffer"): fb for mod in ("numpy._core.numeric", "numpy.core.numeric")}

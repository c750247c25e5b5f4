"""The two codec interfaces: :class:`IdCodec` (``[T, L, K]`` ids <-> bytes) and :class:`ByteCodec` (bytes <-> bytes).

:class:`Codec` is what both share (an id, a JSON-safe config that rebuilds the codec); it fixes no
``encode``/``decode`` signature, because the two kinds take different arguments. Subclass one of the
two kinds, or :class:`RowCodec` for an id codec that codes ``[rows, top_k]`` rows one after another.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from r3lab.errors import RouteFormatError

__all__ = ["Buffer", "Shape"]

#: what a decoder reads: any flat byte buffer (the container hands a ``memoryview`` of the payload)
Buffer = bytes | bytearray | memoryview
#: routes' shape ``[tokens, layers, top_k]``
Shape = tuple[int, int, int]


class Codec(ABC):
    """Base of every codec: a registry id and a JSON-safe config ``{"id": codec_id, **params}`` that rebuilds it."""

    codec_id: ClassVar[str]

    def get_config(self) -> dict[str, Any]:
        return {"id": self.codec_id, **self._params()}

    def _params(self) -> dict[str, Any]:
        """The constructor arguments that rebuild this codec (JSON-safe)."""
        return {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Codec:
        params = {k: v for k, v in config.items() if k != "id"}
        try:
            return cls(**params)
        except TypeError as e:
            raise RouteFormatError(f"bad config for codec {cls.codec_id!r}: {dict(config)}") from e

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.get_config() == other.get_config()

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({params})"


class IdCodec(Codec):
    """Interface of the codecs that open a pipeline: ``[T, L, K]`` expert ids <-> bytes.

    ``decode`` gets exactly ``encoded_size(shape, ...)`` bytes (the container checks that first for
    byte stages) and returns a ``[T, L, K]`` array of ``dtype``.
    """

    #: whether decode returns each row sorted (set semantics) rather than in the stored order
    sorts_rows: ClassVar[bool] = False
    #: whether decode itself guarantees ids in range and distinct within each row (else the container checks)
    checks_rows: ClassVar[bool] = False
    #: the parameters this codec takes when a pipeline name puts a byte stage after it (``"raw+zstd"``);
    #: empty means its defaults
    before_byte_stage: ClassVar[Mapping[str, Any]] = {}

    @abstractmethod
    def encode(self, values: np.ndarray, num_experts: int) -> bytes:
        """Bytes for a ``[T, L, K]`` array of valid ids (each row distinct, all below ``num_experts``)."""

    @abstractmethod
    def decode(self, buf: Buffer, shape: Shape, dtype: np.dtype[Any], num_experts: int) -> np.ndarray:
        """The ``[T, L, K]`` ids of ``dtype`` back from ``buf``; malformed bytes raise :class:`RouteFormatError`."""

    @abstractmethod
    def encoded_size(self, shape: Shape, dtype: np.dtype[Any], num_experts: int) -> int:
        """Bytes this codec writes for routes of ``shape`` ([T, L, K]); decode refuses any other length."""


class ByteCodec(Codec):
    """Interface of the stages that follow the id codec: bytes <-> bytes."""

    @abstractmethod
    def encode(self, data: Buffer) -> bytes:
        """Transform the bytes of the stage before."""

    @abstractmethod
    def decode(self, buf: Buffer, expected_size: int) -> Buffer:
        """Invert :meth:`encode`, producing exactly ``expected_size`` bytes (refuse before inflating more)."""


class RowCodec(IdCodec):
    """An id codec that codes ``[rows, top_k]`` rows in token or layer order; subclasses code the rows.

    ``order="token"`` keeps the rows token-major as stored; ``"layer"`` writes each layer's rows
    together, which lets a byte stage see one layer's (skewed) expert popularity at a time.
    """

    def __init__(self, order: str = "token"):
        if order not in ("token", "layer"):
            raise RouteFormatError(f"codec order must be 'token' or 'layer', got {order!r}")
        self.order = order

    def _params(self) -> dict[str, Any]:
        return {"order": self.order}

    def encode(self, values: np.ndarray, num_experts: int) -> bytes:
        rows = values.transpose(1, 0, 2) if self.order == "layer" else values
        return self._encode_rows(np.ascontiguousarray(rows).reshape(-1, values.shape[2]), num_experts)

    def decode(self, buf: Buffer, shape: Shape, dtype: np.dtype[Any], num_experts: int) -> np.ndarray:
        T, L, K = shape
        rows = self._decode_rows(buf, T * L, K, dtype, num_experts)
        if self.order == "layer":
            return np.ascontiguousarray(rows.reshape(L, T, K).transpose(1, 0, 2))
        return rows.reshape(T, L, K)

    def encoded_size(self, shape: Shape, dtype: np.dtype[Any], num_experts: int) -> int:
        return self._rows_size(shape[0] * shape[1], shape[2], dtype, num_experts)

    @abstractmethod
    def _rows_size(self, n_rows: int, top_k: int, dtype: np.dtype[Any], num_experts: int) -> int:
        """Bytes for ``n_rows`` rows of ``top_k`` ids."""

    @abstractmethod
    def _encode_rows(self, rows: np.ndarray, num_experts: int) -> bytes:
        """Bytes for ``[rows, top_k]`` ids, rows in the order given."""

    @abstractmethod
    def _decode_rows(self, buf: Buffer, n_rows: int, top_k: int, dtype: np.dtype[Any], num_experts: int) -> np.ndarray:
        """``[n_rows, top_k]`` ids of ``dtype`` back from ``buf`` (call :meth:`_check_size` first)."""

    def _check_size(self, buf: Buffer, n_rows: int, top_k: int, dtype: np.dtype[Any], num_experts: int) -> None:
        want = self._rows_size(n_rows, top_k, dtype, num_experts)
        if len(buf) != want:
            raise RouteFormatError(
                f"{self.codec_id} payload holds {len(buf)} bytes but shape [{n_rows} rows, top_k={top_k}] needs {want}"
            )

"""Compaction for transport: compact dtypes, packed ragged routes, and codecs that beat base64.

Public, stable: :func:`compact_dtype`, :func:`encode`, :func:`decode`, :func:`to_payload`, :func:`from_payload` and the
readers of what engines send (vLLM ``.npy`` base64, vLLM 0.21 nested lists, SGLang base64 int32 and SGLang's
uint8/uint16 ``meta_info`` wire), :func:`stitch_turns` for servers that return only the rows a turn adds, and
:func:`uncaptured_rows` for rows marked -1 (:data:`r3lab.routes.SENTINEL`). Malformed input of any kind raises
:class:`~r3lab.errors.RouteFormatError`.

Codecs are numcodecs-style, one per module (:mod:`r3lab.compaction.codecs`): :class:`~r3lab.compaction.codecs.IdCodec`
(ids <-> bytes) and :class:`~r3lab.compaction.codecs.ByteCodec` (bytes <-> bytes) interfaces, a registry
(:func:`~r3lab.compaction.codecs.register_codec`, :func:`~r3lab.compaction.codecs.get_codec`), and the built-ins
:class:`~r3lab.compaction.codecs.Raw`, :class:`~r3lab.compaction.codecs.BitPack`,
:class:`~r3lab.compaction.codecs.TopKSet`, :class:`~r3lab.compaction.codecs.TopKGaps`,
:class:`~r3lab.compaction.codecs.Zstd`; :data:`~r3lab.compaction.codecs.PIPELINES` names the built-in pipelines. Encoded
buffers carry a format version; see :mod:`r3lab.compaction.container` for what each version means and
:mod:`r3lab.compaction.legacy` for the reader of version 1.

Deprecated, each warns on access and goes in 0.2: ``IdCoder`` (use :class:`~r3lab.compaction.codecs.IdCodec`),
``SetGaps`` (use :class:`~r3lab.compaction.codecs.TopKGaps`), ``ALIASES`` (use
:data:`~r3lab.compaction.codecs.PIPELINES` and :func:`~r3lab.compaction.codecs.pipeline_configs`)."""

from typing import Any

from r3lab.compaction.codecs import deprecated_name
from r3lab.compaction.codecs.weights import WEIGHT_DTYPES, WeightCodec
from r3lab.compaction.container import (
    DEFAULT_MAX_BYTES,
    FORMAT_VERSION,
    MAGIC,
    READ_VERSIONS,
    WEIGHTS_FORMAT_VERSION,
    decode,
    encode,
    read_header,
)
from r3lab.compaction.legacy import LEGACY_BITPACK, BitPackPlanesV1
from r3lab.compaction.measure import BASELINE, measure_codecs
from r3lab.compaction.payload import (
    SGLANG_WIRE_DTYPES,
    from_payload,
    read_sglang_base64_int32,
    read_sglang_meta_info,
    read_vllm_nested_list,
    read_vllm_npy_base64,
    stitch_turns,
    to_payload,
    uncaptured_rows,
    vllm_turn_start,
)
from r3lab.routes import compact_dtype  # noqa: F401  (a public name of this package: r3lab.compaction.compact_dtype)

__all__ = [
    "encode", "decode", "read_header", "to_payload", "from_payload", "read_vllm_npy_base64",
    "read_vllm_nested_list", "read_sglang_base64_int32", "read_sglang_meta_info", "SGLANG_WIRE_DTYPES",
    "uncaptured_rows", "stitch_turns", "vllm_turn_start", "BitPackPlanesV1", "measure_codecs", "BASELINE", "MAGIC",
    "FORMAT_VERSION", "WEIGHTS_FORMAT_VERSION", "READ_VERSIONS", "WeightCodec", "WEIGHT_DTYPES", "LEGACY_BITPACK",
    "DEFAULT_MAX_BYTES",
]


def __getattr__(name: str) -> Any:
    return deprecated_name(__name__, name)

"""Compaction for transport: compact dtypes, packed ragged routes, and codecs that beat base64.

Public, stable: :func:`compact_dtype`, :func:`encode`, :func:`decode`, :func:`to_payload`,
:func:`from_payload` and the readers of what engines send (vLLM ``.npy`` base64, vLLM 0.21 nested
lists, SGLang base64 int32). Malformed input of any kind raises :class:`RouteFormatError`.
"""

from r3lab.compaction.codecs import ALIASES, CODECS, BitPack, Codec, IdCoder, Raw, TopKSet, Zstd, get_codec
from r3lab.compaction.container import DEFAULT_MAX_BYTES, FORMAT_VERSION, MAGIC, decode, encode, read_header
from r3lab.compaction.payload import (
    from_payload,
    read_sglang_base64_int32,
    read_vllm_nested_list,
    read_vllm_npy_base64,
    to_payload,
)
from r3lab.errors import RouteFormatError
from r3lab.routes import compact_dtype

__all__ = [
    "compact_dtype", "encode", "decode", "read_header", "to_payload", "from_payload",
    "read_vllm_npy_base64", "read_vllm_nested_list", "read_sglang_base64_int32",
    "Codec", "IdCoder", "Raw", "BitPack", "TopKSet", "Zstd", "get_codec", "CODECS", "ALIASES",
    "MAGIC", "FORMAT_VERSION", "DEFAULT_MAX_BYTES", "RouteFormatError",
]

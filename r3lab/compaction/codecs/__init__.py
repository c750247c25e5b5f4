"""Route codecs, numcodecs-style: small classes that turn routes into bytes and back, one per module.

Every codec has a ``codec_id``, a JSON-safe ``get_config()``, and is rebuilt from that config by
:func:`get_codec`, which looks the id up in the registry that :func:`register_codec` extends
(:mod:`~r3lab.compaction.codecs.registry`). There are two kinds, each one interface with real
signatures (:mod:`~r3lab.compaction.codecs.base`):

- :class:`IdCodec`: ``[T, L, K]`` expert ids <-> bytes (:mod:`raw <r3lab.compaction.codecs.raw>`,
  :mod:`bitpack <r3lab.compaction.codecs.bitpack>`, :mod:`topk-set <r3lab.compaction.codecs.topk_set>`,
  :mod:`topk-gaps <r3lab.compaction.codecs.topk_gaps>`). It opens every pipeline.
- :class:`ByteCodec`: bytes <-> bytes (:mod:`zstd <r3lab.compaction.codecs.zstd>`). At most one
  follows the id codec.

Pipelines are checked by these interfaces, never by concrete class, so a registered codec of
either kind takes part in :func:`~r3lab.compaction.encode` / :func:`~r3lab.compaction.decode` by name.
What the bytes of each codec mean is fixed per container format version (see
:mod:`r3lab.compaction.container`); each codec's docstring describes the current version's layout.
The read-only layouts of older versions live in :mod:`r3lab.compaction.legacy`.

Deprecated (removed in 0.2, each warns on access): ``IdCoder`` (now :class:`IdCodec`), ``SetGaps``
(now :class:`TopKGaps`) and ``ALIASES`` (pipeline names are registered ids joined by ``+``; the
built-in ones are :data:`PIPELINES`, and :func:`pipeline_configs` gives what a name resolves to).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from r3lab.compaction.codecs.base import ByteCodec, Codec, IdCodec, RowCodec
from r3lab.compaction.codecs.bitpack import BitPack, id_bits
from r3lab.compaction.codecs.raw import Raw
from r3lab.compaction.codecs.registry import (
    CODECS,
    PIPELINES,
    PipelineSpec,
    get_codec,
    parse_pipeline,
    pipeline_configs,
    register_codec,
)
from r3lab.compaction.codecs.topk_gaps import TopKGaps
from r3lab.compaction.codecs.topk_set import TopKSet
from r3lab.compaction.codecs.zstd import Zstd

__all__ = [
    "Codec", "IdCodec", "ByteCodec", "RowCodec", "Raw", "BitPack", "TopKSet", "TopKGaps", "Zstd",
    "register_codec", "get_codec", "parse_pipeline", "pipeline_configs", "CODECS", "PIPELINES", "PipelineSpec",
    "id_bits",
]

_DEPRECATED: dict[str, tuple[str, Callable[[], Any]]] = {
    "IdCoder": ("IdCodec", lambda: IdCodec),
    "SetGaps": ("TopKGaps", lambda: TopKGaps),
    "ALIASES": ("PIPELINES (names) and pipeline_configs(name) (what a name resolves to)",
                lambda: {name: pipeline_configs(name) for name in PIPELINES}),
}


def deprecated_name(module: str, name: str) -> Any:
    """The value of a deprecated name of ``module``, with a DeprecationWarning naming its replacement."""
    if name not in _DEPRECATED:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new, value = _DEPRECATED[name]
    warnings.warn(f"{module}.{name} is deprecated and will be removed in r3lab 0.2; use {new}",
                  DeprecationWarning, stacklevel=3)
    return value()


def __getattr__(name: str) -> Any:
    return deprecated_name(__name__, name)

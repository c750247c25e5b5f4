"""The codec registry (numcodecs' ``codec_registry``): id -> class, and pipelines built from names or configs.

A pipeline is one :class:`~r3lab.compaction.codecs.base.IdCodec` followed by at most one
:class:`~r3lab.compaction.codecs.base.ByteCodec`. By name it is registered ids joined by ``+``: each
stage takes its defaults, except that an id codec followed by a byte stage takes its
``before_byte_stage`` parameters (the built-in row codecs write layer-major rows there, so
``"raw+zstd"`` is ``[Raw(order="layer"), Zstd(level=3)]``). The names are read from the registry;
there is no second table of them.

Another distribution adds a codec without editing r3lab by entry point, in group ``r3lab.codecs``: the entry
point's name is the codec's ``codec_id`` and its object the codec class (:mod:`r3lab._plugins`). The group is read
into :data:`CODECS` on its first lookup.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, cast

from r3lab._plugins import PluginRegistry
from r3lab.compaction.codecs.base import ByteCodec, Codec, IdCodec
from r3lab.errors import ConfigError, RouteFormatError


def _codec_id(cls: Any, what: str) -> str:
    """The ``codec_id`` of codec class ``cls``; a :class:`ConfigError` when ``cls`` cannot be registered."""
    if not (isinstance(cls, type) and issubclass(cls, (IdCodec, ByteCodec))):
        raise ConfigError(f"{what} expects a subclass of IdCodec or ByteCodec, got {cls!r}")
    cid = cls.__dict__.get("codec_id")
    if not isinstance(cid, str) or not cid or "+" in cid or cid != cid.strip():
        raise ConfigError(f"{cls.__name__} must define its own codec_id: a non-empty string without '+', got {cid!r}")
    return cid


def _plugin_codec(name: str, cls: Any) -> type[Codec]:
    """What an ``r3lab.codecs`` entry point loaded, checked: a codec class whose codec_id is the entry point's name."""
    cid = _codec_id(cls, "an r3lab.codecs entry point")
    if cid != name:
        raise ConfigError(f"its codec_id is {cid!r}: name the entry point after the codec_id")
    return cast("type[Codec]", cls)


#: the codec registry, id -> class; extend it with :func:`register_codec`, or from another distribution with an
#: ``r3lab.codecs`` entry point (read on the first lookup)
CODECS: PluginRegistry[type[Codec]] = PluginRegistry("r3lab.codecs", "codec", _plugin_codec)

#: the built-in pipelines by name, in the order benchmarks and fixtures list them (each a key of the golden files)
PIPELINES: tuple[str, ...] = (
    "raw", "bitpack", "topk-set", "raw+zstd", "bitpack+zstd", "topk-set+zstd", "topk-gaps+zstd",
)

#: what a pipeline can be given as: a name, a codec, a config dict, or a list of codecs/configs/ids
PipelineSpec = str | Codec | Sequence["Codec | Mapping[str, Any] | str"]

C = TypeVar("C", bound=type[Codec])


def register_codec(cls: C, *, replace: bool = False) -> C:
    """Make ``cls`` buildable from its config (and usable by name in encode/decode); returns ``cls``.

    ``cls`` must subclass :class:`IdCodec` or :class:`ByteCodec` and set a ``codec_id`` string
    without ``+`` (which joins pipeline names). Another class already registered under that id
    is replaced only with ``replace=True``. Usable as a class decorator. Raises :class:`ConfigError`.
    """
    cid = _codec_id(cls, "register_codec")
    held = CODECS.peek(cid)  # not CODECS.get: the built-in codecs register while their modules import, before plugins
    if held is not None and held is not cls and not replace:
        raise ConfigError(f"codec id {cid!r} is already registered to {held.__module__}.{held.__qualname__} "
                          f"(distribution {CODECS.origin(cid)})")
    CODECS[cid] = cls
    return cls


def get_codec(config: Mapping[str, Any] | str | Codec) -> Codec:
    """Build a codec from its JSON config ``{"id": ..., **params}``, or from a registered id with default params."""
    if isinstance(config, Codec):
        return config
    if isinstance(config, str):
        config = {"id": config}
    if not isinstance(config, Mapping) or not isinstance(config.get("id"), str):
        raise RouteFormatError(f"codec config must be a dict with a string 'id', got {config!r}")
    cls = CODECS.get(config["id"])
    if cls is None:
        raise RouteFormatError(f"unknown codec {config['id']!r}; known: {sorted(CODECS)}")
    return cls.from_config(config)


def _named_stages(spec: str) -> list[dict[str, Any]]:
    names = spec.split("+")
    unknown = [n for n in names if n not in CODECS]
    if unknown:
        raise RouteFormatError(f"unknown codec {spec!r}; known: registered ids {sorted(CODECS)} joined by '+'")
    first = CODECS[names[0]]
    params = first.before_byte_stage if len(names) > 1 and issubclass(first, IdCodec) else {}
    return [{"id": names[0], **params}] + [{"id": n} for n in names[1:]]


def parse_pipeline(spec: PipelineSpec | Any) -> tuple[IdCodec, list[ByteCodec]]:
    """An id codec followed by at most one byte codec.

    ``spec`` is a pipeline name (registered ids joined by ``+``, e.g. ``"topk-set+zstd"`` or
    ``"mycodec+zstd"``), a codec object, or a list of codec objects/configs/ids.
    """
    if isinstance(spec, str):
        spec = _named_stages(spec)
    if isinstance(spec, Codec):
        spec = [spec]
    if not isinstance(spec, (list, tuple)) or not spec:
        raise RouteFormatError(f"codec pipeline must be a non-empty list, got {spec!r}")
    stages = [get_codec(s) for s in spec]
    first, rest = stages[0], stages[1:]
    if not isinstance(first, IdCodec):
        raise RouteFormatError(
            f"a pipeline starts with an id codec (raw, bitpack, topk-set, topk-gaps, ...), not {first.codec_id!r}"
        )
    if len(rest) > 1:
        raise RouteFormatError(f"at most one byte stage may follow the id codec, got {[s.codec_id for s in rest]}")
    byte_stages: list[ByteCodec] = []
    for s in rest:
        if not isinstance(s, ByteCodec):
            raise RouteFormatError(f"stage {s.codec_id!r} cannot follow an id codec; only byte codecs can")
        byte_stages.append(s)
    return first, byte_stages


def pipeline_configs(spec: PipelineSpec) -> list[dict[str, Any]]:
    """The stage configs a pipeline spec resolves to (what :func:`~r3lab.compaction.encode` writes in the header)."""
    first, rest = parse_pipeline(spec)
    return [first.get_config()] + [s.get_config() for s in rest]

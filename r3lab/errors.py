"""The library's exceptions, all of them: one base class and one type per stage of the pipeline.

Every error r3lab raises on purpose is an :class:`R3LabError`, and every type below is also a
:class:`ValueError`: it means that something r3lab was given (an argument, a config, a file, a wire
buffer, a peer's chunk, or its arrival in time) is not what it must be, and the message names what
is wrong and, where it can, how to fix it. Catch ``R3LabError`` for "r3lab refused", or one type
below for one stage. A type is added only
for a stage a caller would catch separately; a layer that re-raises another layer's error as its
own type does so ``from`` it, and only to add where it happened (the type a caller of that layer
expects), never to hide it.

The modules of each stage re-export their type under the same name (``r3lab.slicing.SlicingError``
is :class:`SlicingError`), and two former names stay as aliases: ``LayoutError`` is
:class:`SlicingError` and ``ModelConfigError`` is :class:`ConfigError`.
"""

from __future__ import annotations

__all__ = [
    "R3LabError",
    "RouteFormatError",
    "RunFormatError",
    "ConfigError",
    "RolloutError",
    "SlicingError",
    "ReplayError",
    "StagingError",
    "LayoutError",
    "ModelConfigError",
]


class R3LabError(Exception):
    """Base class of every error r3lab raises on purpose."""


class RouteFormatError(R3LabError, ValueError):
    """Routes or their encoded/JSON form are malformed (:mod:`r3lab.routes`, :mod:`r3lab.compaction`).

    Raised for: bad magic or format version, unknown codec or dtype, truncated or trailing bytes,
    checksum mismatch, a shape that disagrees with the bytes, negative or non-integer dims, expert
    ids out of range, cu_seqlens that are not monotone or do not end at the token count, repeated
    ids inside a top-k row, payloads over the size cap, and something that is not Routes given to
    ``encode``. The message names what is wrong.
    """


class RunFormatError(R3LabError, ValueError):
    """A run folder or one of its files is missing, of an unknown version, or corrupt; the message names it."""


class ConfigError(R3LabError, ValueError):
    """A configuration r3lab cannot run; the message names the field.

    Raised for: an experiment config field out of range, an unknown mode or dtype; a model
    directory that is missing, unreadable, dense, or of an unknown MoE family (formerly
    ``ModelConfigError``); a codec class that :func:`~r3lab.compaction.register_codec` cannot register.
    """


class RolloutError(R3LabError, ValueError):
    """Bad input to the rollout engine, an engine that fails, or routes from the engine that fail validation."""


class SlicingError(R3LabError, ValueError):
    """A :class:`~r3lab.slicing.ParallelLayout` is invalid (formerly ``LayoutError``), or routes and a layout
    or rank coordinates do not fit together (rank out of range, missing layer, sequences that do not split)."""


class ReplayError(R3LabError, ValueError):
    """Replay cannot be set up or would be wrong: bad ids, wrong layer/token count, unsupported config."""


class StagingError(R3LabError, ValueError):
    """Staging failed: a rank could not get its chunk in time, got a corrupt or wrong one, or never reported.

    Raised on every rank of the layout with the same message, which names the failing rank and chunk.
    """


#: former name of the layout errors, now one type with the other slicing errors
LayoutError = SlicingError
#: former name of the model-config errors, now one type with the other configuration errors
ModelConfigError = ConfigError

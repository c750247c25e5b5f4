"""The library's exceptions, all of them: one base class and one type per stage of the pipeline.

Every error r3lab raises on purpose is an :class:`R3LabError`, of one of three kinds a caller can catch
apart. Most types are also a :class:`ValueError`: something r3lab was given (an argument, a config, a
file, a wire buffer, a peer's chunk) is not what it must be. The types under :class:`R3LabFailure` are
a :class:`RuntimeError` instead (the deadlines, :class:`LaunchTimeout` and :class:`StagingTimeoutError`, also a
:class:`TimeoutError`): something r3lab ran failed (a trainer rank, a launch, a Ray actor or cluster, a server's
port), whatever the input. :class:`MissingExtraError` is an :class:`ImportError`: the environment lacks a package
that one of r3lab's extras installs (torch, plotly, Ray, ...), neither bad input nor a failed process. No type is
two of these.
Each message names what is wrong and, where it can, how to fix it. Catch ``R3LabError`` for "r3lab
refused or failed", ``ValueError`` for "my input was wrong", ``R3LabFailure`` for "a process failed",
``ImportError`` for "this needs something not installed", or one type below for one stage. A type is added only
for a stage a caller would catch separately; a layer that re-raises another layer's error as its
own type does so ``from`` it, and only to add where it happened (the type a caller of that layer
expects), never to hide it.

Import them from here, their one face. Two aliases name the same types: ``LayoutError`` is :class:`SlicingError`
and ``ModelConfigError`` is :class:`ConfigError`. No exception class is defined anywhere else in the package
(``tests/test_errors.py`` checks every subclass of :class:`R3LabError`), and none is raised as the bare root class.

A :class:`ConfigError` about config fields carries their names as data (``field``, ``fields``): its
``str()`` spells each as its command-line flag (``--samples-per-prompt``, what ``r3lab rl`` prints), and
:meth:`ConfigError.phrase` spells them another way (a notebook's keywords, a widget's labels).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = [
    "R3LabError",
    "R3LabFailure",
    "RouteFormatError",
    "RunFormatError",
    "ConfigError",
    "RolloutError",
    "WeightCaptureError",
    "AttachError",
    "SlicingError",
    "ReplayError",
    "MegatronCoreAPIError",
    "StagingError",
    "BatchError",
    "MetricError",
    "FigureError",
    "ImportFormatError",
    "UnsafeFileError",
    "UnknownLayoutError",
    "ImporterMissingError",
    "MegatronLoadError",
    "MegatronTrainerError",
    "MbridgeAPIError",
    "MegatronBridgeAPIError",
    "LaunchTimeout",
    "StagingTimeoutError",
    "ClusterError",
    "ServerPortError",
    "MissingExtraError",
    "cli_flag",
    "LayoutError",
    "ModelConfigError",
]


class R3LabError(Exception):
    """Base class of every error r3lab raises on purpose."""


class R3LabFailure(R3LabError, RuntimeError):
    """Something r3lab ran failed (a process, an actor, a cluster, a deadline), not the input it was given."""


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


def cli_flag(field: str) -> str:
    """A config field's command-line flag: ``samples_per_prompt`` -> ``--samples-per-prompt``."""
    return "--" + field.replace("_", "-")


class ConfigError(R3LabError, ValueError):
    """A configuration r3lab cannot run; the message names the field.

    Raised for: an experiment config field out of range, an unknown mode or dtype; a model
    directory that is missing, unreadable, dense, or of an unknown MoE family (also caught as
    ``ModelConfigError``, its alias); a codec class that :func:`~r3lab.compaction.codecs.register_codec` cannot
    register.

    ``field`` is the config field the error is about (None: none in particular); ``message`` writes every
    field it names as ``{name}`` (``field`` and each of ``fields``), which ``str()`` spells with ``spell``
    (default: the command-line flag, :func:`cli_flag`) and :meth:`phrase` with any other speller.
    """

    def __init__(self, message: str, *, field: str | None = None, fields: Sequence[str] = (),
                 spell: Callable[[str], str] = cli_flag):
        self.template = message
        self.field = field
        self.fields = tuple(dict.fromkeys([*([field] if field else []), *fields]))
        super().__init__(self.phrase(spell))

    def phrase(self, spell: Callable[[str], str]) -> str:
        """The message with each field it names written by ``spell`` (a field name in, the words to show out)."""
        out = self.template
        for name in self.fields:
            out = out.replace("{" + name + "}", spell(name))
        return out

    def spelled(self, spell: Callable[[str], str]) -> ConfigError:
        """The same error (fields kept) whose ``str()`` spells the fields with ``spell``."""
        return ConfigError(self.template, field=self.field, fields=self.fields, spell=spell)


class RolloutError(R3LabError, ValueError):
    """Bad input to the rollout engine, an engine that fails, or routes from the engine that fail validation."""


class WeightCaptureError(RolloutError):
    """The engine's routing weights cannot be captured (a vLLM that changed under r3lab, or an unsupported setup)."""


class AttachError(RolloutError):
    """The attached vLLM server is not usable for r3lab: wrong model, no routes, gone away
    (:func:`r3lab.rollout.connect`)."""


class SlicingError(R3LabError, ValueError):
    """A :class:`~r3lab.slicing.ParallelLayout` is invalid (also caught as its alias ``LayoutError``), or routes and a
    layout or rank coordinates do not fit together (rank out of range, missing layer, sequences that do not split)."""


class ReplayError(R3LabError, ValueError):
    """Replay cannot be set up or would be wrong: bad ids, wrong layer/token count, unsupported config."""


class MegatronCoreAPIError(ReplayError):
    """The installed megatron-core is outside the releases r3lab was checked against, or changed an internal r3lab
    reaches (a renamed attribute, a new argument): :mod:`r3lab.replay.mcore_api` names which."""


class StagingError(R3LabError, ValueError):
    """Staging failed: a rank could not get its chunk in time, got a corrupt or wrong one, or never reported.

    Raised on every rank of the layout with the same message, which names the failing rank and chunk.
    """


class BatchError(R3LabError, ValueError):
    """A trainer's input data has the wrong shape: a :class:`~r3lab.trainers.TokenBatch` (no sample, prompt lengths
    that do not fit, a width shorter than a sample) or a :class:`~r3lab.trainers.PolicyUpdate` (a field whose length
    is not the mini-batch's, a loss mask that drops every token, GSPO's per-sample ids and advantages)."""


class MetricError(R3LabError, ValueError):
    """A metric, statistic or analysis was given what it cannot compute on: arrays of the wrong shape, ids out of
    range, no tokens, too few runs or seeds, a parameter outside its domain."""


class FigureError(R3LabError, ValueError):
    """A figure cannot be drawn from what it was given: values outside what its axis shows (a log axis's zero or
    negative range), records of the wrong kind (:mod:`r3lab.viz`)."""


class ImportFormatError(R3LabError, ValueError):
    """A dump does not have the documented layout (a key missing, lengths that disagree); names file and sample
    (:mod:`r3lab.importers`)."""


class UnsafeFileError(R3LabError, ValueError):
    """A file would run code, or load classes beyond tensors and plain containers, if it were opened
    (:mod:`r3lab.importers`)."""


class UnknownLayoutError(ImportFormatError):
    """A dump of a known framework in a layout this r3lab does not read (a newer writer): the message names what
    was seen and the layouts r3lab reads (:mod:`r3lab.importers.layouts`)."""


class ImporterMissingError(ImportFormatError):
    """The importer registry names a kind whose module is not in this r3lab (:mod:`r3lab.importers.registry`)."""


class MbridgeAPIError(R3LabError, ValueError):
    """The installed mbridge lacks (or changed) a private name r3lab relies on: install the pinned version
    (:mod:`r3lab.trainers.megatron.mbridge_api`)."""


class MegatronBridgeAPIError(R3LabError, ValueError):
    """The installed NVIDIA Megatron-Bridge is missing, too old, or changed something r3lab relies on to build a
    model on CPU ranks (:mod:`r3lab.trainers.megatron.megatron_bridge_api`); the message names it."""


class MegatronLoadError(R3LabError, ValueError):
    """The checkpoint cannot be loaded into (or exported from) the Megatron model: family, name or shape
    (:mod:`r3lab.trainers.megatron.checkpoint`)."""


class MegatronTrainerError(R3LabFailure):
    """A trainer rank failed, died or did not answer in time (every rank was ended), or replay did not hold
    (:mod:`r3lab.trainers.megatron.trainer`)."""


class LaunchTimeout(R3LabFailure, TimeoutError):
    """The ranks did not all finish within the launch's timeout; all were terminated
    (:mod:`r3lab.trainers.megatron.launch`; also a :class:`TimeoutError`)."""


class StagingTimeoutError(R3LabFailure, TimeoutError):
    """A staging backend's deadline passed: a rank's chunk did not arrive, or the tally could not be reached, within
    its timeout (:mod:`r3lab.staging`'s backends; also a :class:`TimeoutError`). The rank turns it into the
    :class:`StagingError` every rank of the layout raises."""


class ClusterError(R3LabFailure):
    """The Ray cluster cannot be reached or cannot place an actor (no cluster running, a named address that does
    not answer, a resource no node has), or an actor died, raised or did not answer in time: the message names the
    actor and its node, and every other actor of the job was ended (:mod:`r3lab.cluster`)."""


class ServerPortError(R3LabFailure):
    """A server r3lab launched could not bind its port: another process held it when the server started. A port
    r3lab chose is chosen again once before this is raised; a port the caller chose is not
    (:class:`~r3lab.rollout.RolloutServer`)."""


class MissingExtraError(R3LabError, ImportError):
    """Something r3lab was asked to do needs a package of one of its extras, and that package is not installed.

    The message is always ``"<what> needs <package>, which is not installed: pip install 'r3lab[<extra>]'"``;
    ``what``, ``package`` (the distribution pip installs) and ``extra`` are kept as attributes, and ``name`` (as
    for every :class:`ImportError`) is the module that could not be imported. Raised through
    :func:`r3lab._extras.importing`, which knows which extra brings which package.
    """

    def __init__(self, what: str, package: str, extra: str, *, module: str | None = None):
        self.what, self.package, self.extra = what, package, extra
        super().__init__(f"{what} needs {package}, which is not installed: pip install 'r3lab[{extra}]'",
                         name=module or package)

    def __reduce__(self) -> tuple[type[MissingExtraError], tuple[str, str, str], dict[str, str | None]]:
        return type(self), (self.what, self.package, self.extra), {"name": self.name}


#: an alias of :class:`SlicingError`: a bad layout is one type with the other slicing errors
LayoutError = SlicingError
#: an alias of :class:`ConfigError`: a bad model config is one type with the other configuration errors
ModelConfigError = ConfigError

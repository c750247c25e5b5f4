"""NVIDIA Megatron-Bridge's internals, the one place r3lab reaches into them to build a model on CPU ranks.

Megatron-Bridge (``pip install megatron-bridge==0.6.2``; Python 3.12 only) turns a Hugging Face checkpoint into a
Megatron-core GPTModel: ``AutoBridge.from_hf_pretrained(path)``, ``to_megatron_provider(load_weights=True)``, then
the provider's ``provide_distributed_model``. It assumes Transformer Engine (TE) and CUDA in four places a CPU rank
reaches; each is one function here:

* **one import**: ``megatron/bridge/peft/lora_layers.py`` imports ``transformer_engine.pytorch`` unguarded, and
  ``megatron/bridge/__init__.py`` reaches it. :func:`import_megatron_bridge` gives that one module a stand-in
  ``transformer_engine`` while its own body runs (its other imports done first) and removes it after, so every
  guarded ``try: import transformer_engine`` elsewhere (``olmoe_provider.py``, ``glm45_bridge.py``, ...) still finds
  none. The stand-in's classes refuse to be built: only LoRA would touch them;
* **the layer spec**: a provider's default ``transformer_layer_spec`` is the TE spec (``gpt_provider.py``:
  ``default_layer_spec`` -> ``get_gpt_layer_with_transformer_engine_spec``); :func:`provide_on_cpu` sets r3lab's
  local CPU spec (:func:`~r3lab.trainers.megatron.cpu.local_block_spec`), a callable taking ``vp_stage`` as
  ``GPTModelProvider.provide`` calls it;
* **the CPU provider settings**: without a process group ``ModelProviderMixin.provide_distributed_model`` sets a
  CUDA device and starts NCCL, and without ``use_cpu_initialization`` ``get_model`` moves every chunk to CUDA.
  :func:`provide_on_cpu` requires the gloo group and Megatron's parallel groups first, and sets
  ``use_cpu_initialization``, :data:`~r3lab.trainers.megatron.cpu.CPU_CONFIG` (the settings the mbridge loader
  uses: allgather dispatcher, no grouped GEMM, fusions off) and :data:`CPU_PROVIDER` (the provider's own TE/CUDA
  switches), no DDP and no ``Float16Module`` wrapper;
* **a module's tensor-parallel rule**: ``AutoMapping`` picks a weight's TP split by its module's class name (an
  unknown ``*Norm`` is replicated); :func:`register_column_parallel` names r3lab's TP-sharded modules;
* **the experts' names**: the local spec builds experts as a ``SequentialMLP``
  (``mlp.experts.local_experts.{j}.linear_fc1.weight``); some families map only the grouped names of Transformer
  Engine's ``TEGroupedMLP`` (``mlp.experts.linear_fc1.weight{j}``): 0.6.2's ``Qwen3MoEBridge`` maps both,
  ``GLM45Bridge`` and ``OlMoEBridge`` the grouped ones only. :func:`add_local_expert_aliases` gives the family's
  registry the SequentialMLP name of each per-expert mapping (the same checkpoint names, captures in the same
  order), as ``MegatronMappingRegistry`` itself adds the separate-LayerNorm names beside TE's fused ones;
* **where the checkpoint's tensors are read**: ``SafeTensorsStateSource.load_tensors`` opens the file and lists its
  keys once per tensor (quadratic: 35 s a rank for the deep Qwen3's 4,827 tensors). :func:`use_state` hands the
  bridge the tensors in memory instead (``PreTrainedBase``'s state accessor, a ``StateDict`` over a dict, the form
  it builds itself from a loaded model), also for weights loaded again (exported ones).

:func:`check_megatron_bridge_api` compares what these rely on (the public signatures r3lab calls by keyword, the
provider fields it sets, the spec call, which modules import TE unguarded) with the installed release and raises
:class:`~r3lab.errors.MegatronBridgeAPIError` naming what changed: an upgrade fails loudly at load time (and in
``tests/test_megatron_bridge_loader.py``), never as a wrong tensor.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from r3lab.errors import MegatronBridgeAPIError

__all__ = ["PINNED", "DIST", "MIN_VERSION", "TE_IMPORTERS", "EXPECTED_SIGNATURES", "CPU_PROVIDER", "installed_version",
           "import_megatron_bridge", "te_stand_in_for", "unguarded_te_importers", "check_megatron_bridge_api",
           "auto_bridge", "provide_on_cpu", "register_column_parallel", "add_local_expert_aliases", "use_state"]

DIST = "megatron-bridge"
PINNED = "megatron-bridge==0.6.2"
MIN_VERSION = (0, 6)  # the provider's apply_overrides_and_finalize and the deferred TransformerConfig checks

#: Megatron-Bridge modules that import Transformer Engine at module level outside a ``try`` (0.6.2: one).
TE_IMPORTERS: tuple[str, ...] = ("megatron.bridge.peft.lora_layers",)

#: "Class.method" -> keyword parameters r3lab passes (each must still exist by that name).
EXPECTED_SIGNATURES: dict[str, tuple[str, ...]] = {
    "AutoBridge.from_hf_pretrained": ("path",),
    "AutoBridge.to_megatron_provider": ("load_weights", "hf_path"),
    "AutoBridge.load_hf_weights": ("model", "hf_path"),
    "AutoBridge.export_hf_weights": ("model", "cpu", "show_progress"),
    "GPTModelProvider.apply_overrides_and_finalize": ("dtype", "overrides"),
    "GPTModelProvider.provide_distributed_model": ("wrap_with_ddp", "use_cpu_initialization",
                                                   "mixed_precision_wrapper"),
    "AutoMapping.register_module_type": ("module_name", "parallelism_type"),
    "MegatronMappingRegistry.__init__": ("mappings",),
    "GatedMLPMapping.__init__": ("megatron_param", "gate", "up"),
    "AutoMapping.__init__": ("megatron_param", "hf_param", "permute_dims"),
}

#: The provider's own Transformer Engine / CUDA switches, off on a CPU rank (beside CPU_CONFIG).
CPU_PROVIDER: dict[str, Any] = dict(
    moe_permute_fusion=False,  # a TE kernel; the bridges set it True
    cross_entropy_loss_fusion=False,
    use_transformer_engine_full_layer_spec=False,
    use_te_rng_tracker=False,
    init_model_with_meta_device=False,
    should_pad_vocab=False,  # the checkpoint's vocabulary, as the mbridge loader builds it
)

#: What ``GPTModelProvider.provide`` does with a callable ``transformer_layer_spec`` (the call r3lab's spec answers).
_SPEC_CALL = "transformer_layer_spec(self, vp_stage=vp_stage)"
_DEPRECATION = "ModelProviderMixin-based model configuration is deprecated"


def installed_version() -> str | None:
    """The installed megatron-bridge's version (None: not installed); read from its metadata, nothing imported."""
    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return None


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


# ---- the Transformer Engine stand-in -------------------------------------------------------------------------
class _Unavailable:
    """A Transformer Engine class in the stand-in: refuses to be built."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise MegatronBridgeAPIError(f"{type(self).__qualname__} is Transformer Engine's (not installed here): r3lab "
                                     "imports Megatron-Bridge with a stand-in for it, which only LoRA would use")


class _StandIn(types.ModuleType):
    """A stand-in ``transformer_engine`` module: any attribute is a nested stand-in (a class for a capitalized name),
    so a module-level ``te.ops.Sequential`` annotation evaluates; nothing in it runs."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value: Any = (type(name, (_Unavailable,), {"__module__": self.__name__}) if name[:1].isupper()
                      else _StandIn(f"{self.__name__}.{name}"))
        setattr(self, name, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise MegatronBridgeAPIError(f"{self.__name__} is Transformer Engine's (not installed here)")


@contextlib.contextmanager
def _te_stand_in() -> Iterator[None]:
    """``transformer_engine`` and ``transformer_engine.pytorch`` as stand-ins in ``sys.modules``, removed after."""
    names = ("transformer_engine", "transformer_engine.pytorch")
    if any(n in sys.modules for n in names):
        raise MegatronBridgeAPIError("a transformer_engine module is loaded already: the stand-in is for a machine "
                                     "without Transformer Engine")
    top = _StandIn(names[0])
    top.pytorch = _StandIn(names[1])  # type: ignore[attr-defined]
    sys.modules[names[0]], sys.modules[names[1]] = top, top.pytorch
    try:
        yield
    finally:
        for n in names:
            sys.modules.pop(n, None)


def _module_imports(tree: ast.Module, *, names: bool = False) -> list[tuple[str, bool]]:
    """(module name, guarded) for every import at a module's top level (``guarded``: inside a ``try``); ``names``:
    also ``module.name`` for each name of a ``from module import name`` (it may be a submodule)."""
    out: list[tuple[str, bool]] = []

    def visit(nodes: list[ast.stmt], guarded: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                out.extend((a.name, guarded) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.append((node.module, guarded))
                if names:
                    out.extend((f"{node.module}.{a.name}", guarded) for a in node.names if a.name != "*")
            elif isinstance(node, ast.Try):
                visit(node.body, True)
                visit(node.orelse, guarded)
                visit(node.finalbody, guarded)
            elif isinstance(node, ast.If):
                visit(node.body, guarded)
                visit(node.orelse, guarded)

    visit(tree.body, False)
    return out


def _is_te(module: str) -> bool:
    return module == "transformer_engine" or module.startswith("transformer_engine.")


def _imports_te_unguarded(path: str | Path) -> bool:
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    return any(_is_te(m) and not g for m, g in _module_imports(tree))


class _StandInLoader(importlib.abc.Loader):
    """Runs one module with the Transformer Engine stand-in in place: its other imports first, without it."""

    def __init__(self, inner: importlib.abc.Loader, origin: str):
        self.inner, self.origin = inner, origin

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        tree = ast.parse(Path(self.origin).read_text(encoding="utf-8"))
        for name, _ in _module_imports(tree, names=True):
            if not _is_te(name):
                with contextlib.suppress(ImportError):  # not a module (a name in one), or its own import raises it
                    importlib.import_module(name)
        with _te_stand_in():
            self.inner.exec_module(module)


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Finds ``modules`` as usual, with :class:`_StandInLoader` around their loader."""

    def __init__(self, modules: tuple[str, ...]):
        self.modules = modules

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or spec.origin is None or not _imports_te_unguarded(spec.origin):
            return spec  # as it is (a release that guards its import needs no stand-in)
        spec.loader = _StandInLoader(spec.loader, spec.origin)
        return spec


@contextlib.contextmanager
def te_stand_in_for(modules: tuple[str, ...]) -> Iterator[None]:
    """Inside the block, importing one of ``modules`` (a module that imports Transformer Engine unguarded) runs it
    with the stand-in: its other top-level imports first, then its body with ``transformer_engine`` and
    ``transformer_engine.pytorch`` in ``sys.modules``, removed right after. Nothing else sees the stand-in."""
    finder = _StandInFinder(tuple(modules))
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


#: Optional packages Megatron-Bridge tries to import on every call of a hot function; where one is not installed its
#: absence is recorded once (:func:`remember_absent_packages`)
PROBED_PER_CALL = ("modelopt",)  # conversion/utils.py is_modelopt_dynamic_module, once per parameter and module


def remember_absent_packages() -> None:
    """Record in ``sys.modules`` (the value ``None``, Python's own mark for "no such module") each package of
    :data:`PROBED_PER_CALL` that is not installed. Megatron-Bridge 0.6.2's ``is_modelopt_dynamic_module`` runs
    ``from modelopt.torch.opt.dynamic import DynamicModule`` inside a ``try`` for every module its weight mappings
    visit; Python caches no failed import, so each call searched every path entry again: 13,566 searches on one rank
    building the four shipped models in three layouts, 8 of its 57 s. With the mark the import fails at once with
    the same ``ImportError``, and ``importlib.util.find_spec`` answers None as before. An installed package is
    left alone."""
    for name in PROBED_PER_CALL:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = None  # type: ignore[assignment]


def import_megatron_bridge() -> types.ModuleType:
    """``megatron.bridge``, imported (once per process) on a machine without Transformer Engine: the modules of
    :data:`TE_IMPORTERS` get the stand-in while their body runs, and nothing else sees it. Packages it probes on
    every call are looked up once (:func:`remember_absent_packages`)."""
    remember_absent_packages()
    if "megatron.bridge" in sys.modules:
        return sys.modules["megatron.bridge"]
    version = installed_version()
    if version is None:
        raise MegatronBridgeAPIError(f"the megatron-bridge loader needs NVIDIA Megatron-Bridge: pip install {PINNED} "
                                     "(Python 3.12 only), or choose the mbridge loader")
    if _version_tuple(version) < MIN_VERSION:
        raise MegatronBridgeAPIError(f"megatron-bridge {version} is older than r3lab's loader supports: {PINNED}")
    has_te = importlib.util.find_spec("transformer_engine") is not None
    try:
        with contextlib.nullcontext() if has_te else te_stand_in_for(TE_IMPORTERS):
            return importlib.import_module("megatron.bridge")
    except ModuleNotFoundError as e:
        if e.name and _is_te(e.name):
            raise MegatronBridgeAPIError(f"megatron-bridge {version}: a module other than {list(TE_IMPORTERS)} "
                                         f"imports Transformer Engine unguarded ({e}); r3lab needs {PINNED}") from e
        raise MegatronBridgeAPIError(f"megatron-bridge {version} does not import: {e}") from e


def unguarded_te_importers() -> list[str]:
    """The loaded ``megatron.bridge`` modules whose source imports Transformer Engine outside a ``try``."""
    loaded = []
    for name, mod in sorted(sys.modules.items()):
        origin = getattr(mod, "__file__", None)
        if (name == "megatron.bridge" or name.startswith("megatron.bridge.")) and origin and origin.endswith(".py"):
            loaded.append((name, origin))
    return [name for name, origin in loaded if _installed_module_imports_te_unguarded(origin)]


@functools.cache
def _installed_module_imports_te_unguarded(origin: str) -> bool:
    """:func:`_imports_te_unguarded` of an installed module's file, parsed once a process (and inherited by the
    ranks a fork server starts): the check runs at every bridge a rank builds, and each model family's bridge
    loads modules of its own, so a cache of whole scans parsed the ~1000 files again at every new family."""
    return _imports_te_unguarded(origin)


# ---- the checks ----------------------------------------------------------------------------------------------
def _classes() -> dict[str, Any]:
    import_megatron_bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    return {"AutoBridge": AutoBridge, "GPTModelProvider": GPTModelProvider, "AutoMapping": AutoMapping,
            "GatedMLPMapping": GatedMLPMapping, "MegatronMappingRegistry": MegatronMappingRegistry}


def _provider_fields() -> set[str]:
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    return set(GPTModelProvider.__dataclass_fields__)


def check_megatron_bridge_api(*, provider_fields: tuple[str, ...] = ()) -> None:
    """Raise :class:`MegatronBridgeAPIError` unless the installed Megatron-Bridge still has what r3lab relies on:
    every parameter of :data:`EXPECTED_SIGNATURES`, the provider fields of ``CPU_CONFIG``, :data:`CPU_PROVIDER` and
    ``provider_fields``, ``GPTModelProvider.provide`` calling a callable spec with ``vp_stage``, and Transformer
    Engine imported unguarded by exactly :data:`TE_IMPORTERS` among the loaded modules (when TE is absent)."""
    from r3lab.trainers.megatron.cpu import CPU_CONFIG

    classes = _classes()
    problems = []
    for qual, params in EXPECTED_SIGNATURES.items():
        cls_name, _, meth = qual.partition(".")
        fn = getattr(classes[cls_name], meth, None)
        if not callable(fn):
            problems.append(f"{qual} is missing")
            continue
        got = inspect.signature(fn).parameters
        lost = [p for p in params if p not in got]
        if lost:
            problems.append(f"{qual} lost {lost} (has {tuple(got)})")
    fields = _provider_fields()
    lost_fields = sorted({*CPU_CONFIG, *CPU_PROVIDER, "transformer_layer_spec", *provider_fields} - fields)
    if lost_fields:
        problems.append(f"GPTModelProvider has no field {lost_fields}")
    try:
        provide_src = inspect.getsource(classes["GPTModelProvider"].provide)
    except (OSError, TypeError):
        provide_src = ""
    from megatron.bridge.models.hf_pretrained import base as hf_base

    try:
        state_src = inspect.getsource(hf_base.PreTrainedBase.state.fget)
    except (AttributeError, OSError, TypeError):
        state_src = ""
    if "self._state_dict_accessor" not in state_src:
        problems.append("PreTrainedBase.state no longer reads self._state_dict_accessor (use_state sets it)")
    if not isinstance(getattr(classes["AutoBridge"], "_model_bridge", None), property):
        problems.append("AutoBridge._model_bridge (the family's MegatronModelBridge) is gone")
    if _SPEC_CALL not in provide_src:
        problems.append(f"GPTModelProvider.provide no longer calls {_SPEC_CALL!r} (r3lab's CPU spec answers it)")
    if importlib.util.find_spec("transformer_engine") is None:
        found = unguarded_te_importers()
        if found != sorted(TE_IMPORTERS):
            problems.append(f"the modules importing Transformer Engine unguarded are {found}, r3lab stands in for "
                            f"{list(TE_IMPORTERS)}")
    if problems:
        raise MegatronBridgeAPIError(f"megatron-bridge {installed_version()} changed: {'; '.join(problems)}; r3lab "
                                     f"needs {PINNED}")


# ---- the reaches ---------------------------------------------------------------------------------------------
def auto_bridge(model_dir: str | Path) -> Any:
    """``AutoBridge.from_hf_pretrained(model_dir)``, the API checked first (the checkpoint's tensors are read lazily,
    from its safetensors files)."""
    check_megatron_bridge_api()
    from megatron.bridge import AutoBridge

    return AutoBridge.from_hf_pretrained(str(model_dir))


def register_column_parallel(*classes: type) -> None:
    """Have ``AutoMapping`` split the weights of modules of these classes along dim 0 across TP ranks (load) and
    gather them back (export), as a column-parallel linear's; by class name, process-wide."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    for cls in classes:
        AutoMapping.register_module_type(cls.__name__, "column")


def provide_on_cpu(provider: Any, *, spec: Callable[..., Any], dtype: Any,
                   overrides: Mapping[str, Any]) -> list[Any]:
    """This rank's GPTModel chunks from ``provider`` on CPU: the spec ``spec(config, vp_stage=None)``, the CPU
    settings, ``overrides`` (TransformerConfig fields), parameters in ``dtype``; no DDP, no Float16Module wrapper.

    The provider's registered pre-wrap hooks run as usual (``to_megatron_provider(load_weights=True)``'s loads the
    checkpoint). The gloo group and Megatron's parallel groups must exist (:func:`~r3lab.trainers.megatron.cpu.
    init_parallel`): Megatron-Bridge would start NCCL otherwise.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from r3lab.trainers.megatron.cpu import CPU_CONFIG

    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        raise MegatronBridgeAPIError("Megatron-Bridge builds on an existing process group: initialise gloo and "
                                     "Megatron's parallel groups first (init_parallel), or it starts NCCL on CUDA")
    settings = {**CPU_CONFIG, **CPU_PROVIDER, **overrides, "use_cpu_initialization": True}
    check_megatron_bridge_api(provider_fields=tuple(settings))
    provider.transformer_layer_spec = spec
    try:
        provider.apply_overrides_and_finalize(dtype=dtype, overrides=settings)
    except AttributeError as e:
        raise MegatronBridgeAPIError(f"megatron-bridge {installed_version()}: {e}") from e
    with warnings.catch_warnings():
        # 0.6 deprecates the provider path for ModelConfig + ModelBuilder; to_megatron_provider still builds on it
        warnings.filterwarnings("ignore", message=_DEPRECATION, category=DeprecationWarning)
        chunks = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True,
                                                    mixed_precision_wrapper=None)
    off_cpu = sorted({str(p.device) for c in chunks for p in c.parameters() if p.device != torch.device("cpu")})
    if off_cpu:
        raise MegatronBridgeAPIError(f"Megatron-Bridge put parameters on {off_cpu}, not the CPU")
    return list(chunks)


_GROUPED_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<fc>linear_fc[12])\.weight\*$")
_ALIASED = "_r3lab_local_expert_aliases"


def _local_expert_aliases(registry: Any) -> Any:
    """``registry`` with the SequentialMLP name of each grouped per-expert mapping it lacks (a new registry)."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping

    have = {m.megatron_param for m in registry.mappings}
    extra = []
    for m in registry.mappings:
        hit = _GROUPED_EXPERT.match(m.megatron_param)
        if hit is None:
            continue
        local = f"{hit['layer']}.local_experts.*.{hit['fc']}.weight"
        if local in have:
            continue
        if type(m) is GatedMLPMapping:
            extra.append(GatedMLPMapping(local, gate=m.hf_param["gate"], up=m.hf_param["up"]))
        elif type(m) is AutoMapping:
            extra.append(AutoMapping(local, m.hf_param, m.permute_dims))
        else:
            raise MegatronBridgeAPIError(f"{type(m).__name__} {m.megatron_param!r} -> {m.hf_param!r}: r3lab names no "
                                         "SequentialMLP (local spec) counterpart for it (a fused-experts checkpoint?)")
        have.add(local)
    return registry if not extra else type(registry)(*registry.mappings, *extra)


def add_local_expert_aliases(bridge: Any) -> None:
    """Have the family behind AutoBridge ``bridge`` map the local spec's expert names too (module docstring): its
    ``MegatronModelBridge`` class's ``mapping_registry`` wrapped once per process, adding aliases only where the
    family maps the grouped name and not the SequentialMLP one."""
    cls = type(bridge._model_bridge)
    current = cls.mapping_registry
    if getattr(current, _ALIASED, False):
        return

    @functools.wraps(current)
    def mapping_registry(self: Any) -> Any:
        return _local_expert_aliases(current(self))

    setattr(mapping_registry, _ALIASED, True)
    cls.mapping_registry = mapping_registry


@functools.cache
def _shared_state_dict() -> type:
    """Megatron-Bridge's ``StateDict``, deep-copied as itself (see :func:`use_state`)."""
    from megatron.bridge.models.hf_pretrained.state import StateDict

    class SharedStateDict(StateDict):
        def __deepcopy__(self, memo: dict) -> SharedStateDict:
            return self

    return SharedStateDict


def use_state(bridge: Any, tensors: Mapping[str, Any]) -> None:
    """AutoBridge ``bridge`` reads checkpoint tensors from ``tensors`` (name -> tensor, in memory) from now on: what
    ``to_megatron_provider(load_weights=True)``'s hook and ``load_hf_weights(model)`` load (module docstring).

    The accessor is shared, never copied, by ``copy.deepcopy``: the provider holds that hook (a ``partial`` over the
    bridge's pretrained model, so over this accessor), and megatron-core deep-copies the provider's config for
    modules it builds (``attention.py``, ``moe/experts.py``, ``moe/shared_experts.py`` at 0.19.2), so a plain
    ``StateDict`` over the dict copied every checkpoint tensor each time: 110 copies of the checkpoint on one rank
    building the four shipped models in three layouts, 40% of that rank's CPU. The tensors are read-only inputs of
    the load; upstream's own accessor (a lazy safetensors source) copies no tensor either."""
    pretrained = bridge.hf_pretrained
    if not hasattr(pretrained, "_state_dict_accessor"):
        raise MegatronBridgeAPIError(f"{type(pretrained).__name__} has no _state_dict_accessor: r3lab needs {PINNED}")
    pretrained._state_dict_accessor = _shared_state_dict()(dict(tensors))

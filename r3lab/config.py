"""Every experiment knob, defined once: the RL and drift configs, the replay modes and the run names.

Torch-free, so the command line, the widgets and the notebooks read the same dataclasses without starting
an engine. Each field carries its help text (and its choices) in its metadata; ``add_config_flags`` turns
every field into a command-line flag, so a new knob appears in ``r3lab rl``/``r3lab drift``, in the widgets'
jobs (``RLConfig.to_cli_args``) and in ``to_dict`` at once.

The names the configs share with the rest of the package (record keys, run kinds, task names) live in
:mod:`r3lab.vocabulary`; the phase diagram's objectives beside the diagram (:mod:`r3lab.runs.phase`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from r3lab.errors import ConfigError, cli_flag
from r3lab.paths import MODELS
from r3lab.trainer_registry import MEGATRON_LOADERS, TRAINER_REGISTRY, megatron_dp, megatron_loader, trainer_spec
from r3lab.vocabulary import TASKS as TASKS  # the RL tasks (names and rewards), the --task knob's choices
from r3lab.vocabulary import RLMetric as RLMetric  # the RL step records' keys, read from here by notebooks and benches
from r3lab.vocabulary import TaskName

__all__ = [
    "MODES",
    "DEFAULT_MODES",
    "WEIGHT_REPLAYS",
    "DTYPES",
    "ENGINE_QUANTS",
    "OLD_LOGPROBS",
    "POLICY_FORMATS",
    "LOSSES",
    "TRAINER_DTYPES",
    "TRAINERS",
    "RL_TRAINERS",
    "RL_SEEDS",
    "RL_QUICK_SEEDS",
    "RLConfig",
    "DriftConfig",
    "CaptureConfig",
    "ATTACHED_RL_REASON",
    "run_name",
    "run_names",
    "add_config_flags",
    "quick_help",
    "config_overrides",
]

MODES = ("none", "R2", "R3", "R3W")  # replay modes, one switch as verl's router_replay.mode (R3W: ids and weights)
# what an RL comparison runs when no modes are named (r3lab rl, run_comparison, the widgets): the three the committed
# results were made with; R3W (the engine's routing weights replayed too) is asked for by name
DEFAULT_MODES = ("none", "R2", "R3")
# R3W's two variants (r3lab.replay.hf.WEIGHT_REPLAY): the engine's weights with the router's gradient stopped
# (prime-rl #3509), or the engine's weights forward and the live router's gradient back (straight-through)
WEIGHT_REPLAYS = ("stop", "straight")
DTYPES = ("bfloat16", "float32")
ENGINE_QUANTS = ("none", "fp8", "int8", "int6", "int4")  # the mismatch dial (r3lab.rollout.quant: a simulation)
_QUANT_HELP = ("the mismatch dial: simulated weight quantization of the engine's attention and expert weights "
               "(per output channel, dequantized to its dtype; routers, norms, embeddings, LM head exact)")
# where the loss's old log-probs come from under staleness (r3lab.experiments.rl): the trainer's current weights
# (the proximal policy, the default), or matched weights: a trainer-side copy of the behaviour weights scores the batch
# (verl's fully-async recompute, slime's --keep-old-actor) and the decoupled objective weights behaviour -> proximal
OLD_LOGPROBS = ("current", "behaviour")
POLICY_FORMATS = ("r3lab-policy-1",)  # saved policies (--save-every): format-version (r3lab.runs.policy)
LOSSES = ("grpo", "gspo")  # the policy objective (r3lab.trainers.loss): token-level or sequence-level ratios
TRAINER_DTYPES = {"bfloat16": "bf16, fp32 router", "float32": "fp32"}  # the drift experiment's trainer settings
# the trainers (r3lab.trainers), from their registry (r3lab.trainer_registry): name -> description
TRAINERS = {name: spec.description for name, spec in TRAINER_REGISTRY.items()}
RL_TRAINERS = tuple(name for name, spec in TRAINER_REGISTRY.items() if spec.policy_steps)  # take policy steps
_TASK_HELP = "the reward: " + ", ".join(f"{task} ({reward})" for task, reward in TASKS.items())
_TRAINER_HELP = ("the trainer: hf (transformers, CPU), megatron (Megatron-core on tp*pp*dp gloo CPU ranks) or "
                 "megatron-bridge (GPU node, drift only)")

# running on a Ray cluster (r3lab.cluster): the same fields on both configs
_MEGATRON_LOADER_HELP = ("the Megatron trainer's checkpoint loader (--trainer megatron): "
                         + ", ".join(f"{k} ({v[1]})" for k, v in MEGATRON_LOADERS.items()))
_CLUSTER_HELP = ("run the engine and the trainer (its ranks) as Ray actors: ray ($RAY_ADDRESS, else the cluster "
                 "`ray start` made on this machine; never a new one), a GCS address HOST:PORT, or ray://HOST:PORT "
                 "(Ray Client)")
_ENGINE_RESOURCES_HELP = ("--cluster: the Ray resources the engine actor needs, a JSON object ('{\"GPU\": 1}', or a "
                          "custom resource such as '{\"CPU\": 1, \"engine\": 1}')")
_TRAINER_RESOURCES_HELP = ("--cluster: the Ray resources of each trainer rank, a JSON object (one placement-group "
                           "bundle per Megatron rank: '{\"GPU\": 1}'; the transformers trainer is one actor)")
_CLUSTER_TIMEOUT_HELP = ("--cluster: seconds any call on an actor may take (a step's scoring, a policy step, a weight "
                         "sync) before the run fails, naming the actor and its node, and every actor is ended")


def _check_cluster(config: Any) -> None:
    """The cluster knobs: a known form of address, resources as JSON objects, only with --cluster."""
    import json

    if config.cluster is not None:
        c = config.cluster
        host, sep, port = c.removeprefix("ray://").rpartition(":")
        if c != "ray" and not (sep and host and port.isdigit()):
            raise ConfigError(f"{{cluster}} must be ray, HOST:PORT or ray://HOST:PORT, got {c!r}", field="cluster")
    for name in ("engine_resources", "trainer_resources"):
        v = getattr(config, name)
        if v is None:
            continue
        if config.cluster is None:
            raise ConfigError(f"{{{name}}} places actors on a Ray cluster: it needs {{cluster}}", field=name,
                              fields=("cluster",))
        try:
            d = json.loads(v)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{{{name}}} must be a JSON object such as '{{\"GPU\": 1}}', got {v!r} ({e})",
                              field=name) from None
        if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(a, int | float)
                                              and not isinstance(a, bool) and a >= 0 for k, a in d.items()):
            raise ConfigError(f"{{{name}}} must map resource names to amounts >= 0, got {v!r}", field=name)
    if config.cluster_timeout <= 0:
        raise ConfigError(f"{{cluster_timeout}} must be > 0, got {config.cluster_timeout!r}", field="cluster_timeout")

# why RL refuses an attached server (RLConfig.engine_url; the attached client's update_weights says the same)
ATTACHED_RL_REASON = ("the RL loop pushes the trainer's updated weights into the engine after every step, and r3lab "
                      "has no weight-update path into a server it did not start (vLLM 0.30's dev-mode "
                      "/update_weights moves weights over NCCL or CUDA IPC only, GPU to GPU); run RL with a local "
                      "engine")

# the seeds an RL comparison runs when none are given (r3lab rl, run_comparison), and with --quick (and the widgets)
RL_SEEDS = (0, 1, 2)
RL_QUICK_SEEDS = (0,)

# config fields that the command line sweeps over: the flag takes a list and the experiment runs one per value
_SWEEPS = {"mode": "modes", "seed": "seeds"}

C = TypeVar("C", bound="_Config")


def knob(default: Any, help: str, *, choices: Sequence[Any] | None = None, flag: str | None = None,
         unset: str = "off", quiet: bool = False) -> Any:
    """A config field with its help text (and choices): the one place a knob is described.

    ``unset`` says what a ``None`` default means in help texts; ``flag`` renames the command-line flag; ``quiet``:
    ``to_cli_args`` spells the field out only when it differs from ``default`` (a knob that matters only with
    another one, such as ``--cluster-timeout`` with ``--cluster``, so the commands of runs without it stay as they
    were).
    """
    meta: dict[str, Any] = {"help": help, "unset": unset}
    if quiet:
        meta["quiet"] = True
    if choices is not None:
        meta["choices"] = tuple(choices)
    if flag is not None:
        meta["flag"] = flag
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults: use a tuple")
    return field(default=default, metadata=meta)


def run_name(prefix: str, mode: str, seed: int) -> str:
    """The folder name of one run of a comparison: ``{prefix}-{mode}-s{seed}``."""
    return f"{prefix}-{mode}-s{int(seed)}"


def run_names(prefix: str, modes: Sequence[str], seeds: Sequence[int]) -> list[str]:
    """The run names of a comparison, in the order it runs them (seeds outer, modes inner)."""
    return [run_name(prefix, m, s) for s in seeds for m in modes]


class _Config:
    """Shared behaviour of the experiment configs: validation helpers, dict and command-line round trips."""

    _quick: typing.ClassVar[dict[str, Any]] = {}

    @classmethod
    def quick(cls: type[C], **overrides: Any) -> C:
        """A smoke-sized run for tests and first looks."""
        return cls(**{**cls._quick, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[C], d: Mapping[str, Any]) -> C:
        """Rebuild a config from ``to_dict`` (unknown keys are an error that names them)."""
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"{cls.__name__} has no field(s) {unknown}")
        hints = typing.get_type_hints(cls)
        kw = {k: tuple(v) if _is_tuple(hints[k]) and v is not None else v for k, v in d.items()}
        return cls(**kw)

    def _check_choices(self) -> None:
        """Every field with choices (``knob(choices=...)``) holds one of them; a tuple field, each of its values."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            choices = f.metadata.get("choices")
            v = getattr(self, f.name)
            if choices is not None and any(x not in choices for x in (v if isinstance(v, tuple) else (v,))):
                raise ConfigError(f"{{{f.name}}} must be one of {choices}, got {v!r}", field=f.name)

    def _check_parallel(self) -> None:
        """The Megatron layout knobs: positive, used only by ``--trainer megatron``."""
        self._check_min(("tp", "pp", "ep"))
        layout = trainer_spec(self.trainer).parallel_layout  # type: ignore[attr-defined]
        if not layout and (self.tp, self.pp, self.ep) != (1, 1, 1):  # type: ignore[attr-defined]
            raise ConfigError(f"{{tp}}/{{pp}}/{{ep}} set a Megatron layout: they need {{trainer}} megatron, got "
                              f"{{trainer}} {self.trainer}",  # type: ignore[attr-defined]
                              field="trainer", fields=("tp", "pp", "ep"))
        world = self.tp * self.pp * megatron_dp(self.tp, self.ep)  # type: ignore[attr-defined]
        if world > 16:
            raise ConfigError(f"{{tp}} x {{pp}} x dp = {world} CPU ranks: at most 16", fields=("tp", "pp", "ep"))
        # the run's config names the loader the Megatron ranks use (None: the default, resolved here); another
        # trainer has none (None, also in a copy of a Megatron config made for it with dataclasses.replace)
        loader = self.megatron_loader  # type: ignore[attr-defined]
        object.__setattr__(self, "megatron_loader", megatron_loader(loader) if layout else None)

    @property
    def dp(self) -> int:
        """The Megatron trainer's data-parallel ranks (derived: :func:`megatron_dp`)."""
        return megatron_dp(self.tp, self.ep)  # type: ignore[attr-defined]

    def _check_min(self, names: Sequence[str], lo: int = 1) -> None:
        for name in names:
            v = getattr(self, name)
            if int(v) < lo:
                raise ConfigError(f"{{{name}}} must be >= {lo}, got {v!r}", field=name)


def _flag(name: str) -> str:
    return cli_flag(name)


@dataclass(frozen=True)
class RLConfig(_Config):
    """Everything that decides an RL run's numbers (same config, same numbers)."""

    model: str = knob("tiny-qwen3-moe", "shipped model name or model directory")
    mode: str = knob("R3", "replay mode: none (native routing), R2 (trainer's old-policy routes), R3 (engine's), "
                     "R3W (engine's ids and routing weights; the engine captures them)", choices=MODES)
    weight_replay: str = knob("stop", "R3W: stop (the engine's weights, no router gradient from the loss, as "
                              "prime-rl #3509) or straight (the engine's weights forward, the live router's gradient "
                              "back)", choices=WEIGHT_REPLAYS)
    steps: int = knob(60, "rollout batches (policy-update rounds) per run")
    prompts_per_step: int = knob(8, "corpus prompts per rollout batch")
    samples_per_prompt: int = knob(8, "completions per prompt (the GRPO group, >= 2)")
    max_tokens: int = knob(16, "tokens sampled per completion")
    prompt_words: int = knob(6, "words per corpus prompt")
    mini_batches: int = knob(4, "policy updates per rollout batch (the policy drifts off the behaviour policy)")
    lr: float = knob(1e-3, "learning rate (AdamW)")
    clip_eps: float = knob(0.2, "PPO clip range of the importance ratio")
    max_grad_norm: float = knob(1.0, "gradient-norm clip")
    tis_cap: float | None = knob(None, "truncated importance sampling with this cap (> 1)")
    temperature: float = knob(1.0, "sampling temperature")
    engine_dtype: str = knob("bfloat16", "the engine's dtype", choices=DTYPES)
    engine_quant: str = knob("none", _QUANT_HELP, choices=ENGINE_QUANTS)
    trainer_dtype: str = knob("float32", "the trainer's dtype (bfloat16: routers as --router-dtype)", choices=DTYPES)
    router_dtype: str = knob("float32", "a bf16 trainer's router dtype (fp32 as the field runs them)", choices=DTYPES)
    trainer: str = knob("hf", _TRAINER_HELP, choices=RL_TRAINERS)
    tp: int = knob(1, "Megatron tensor parallelism (with sequence parallelism when > 1; --trainer megatron)")
    pp: int = knob(1, "Megatron pipeline stages (--trainer megatron)")
    ep: int = knob(1, "Megatron expert parallelism (--trainer megatron; dp = ep ranks then)")
    megatron_loader: str | None = knob(None, _MEGATRON_LOADER_HELP, quiet=True,
                                       unset="megatron-bridge where installed, else mbridge")
    staleness: int = knob(0, "rollouts come from a policy this many updates behind the trainer (fully async)")
    old_logprobs: str = knob("current", "old log-probs under staleness: the trainer's current weights (current), or "
                             "matched weights (behaviour: a trainer copy of the weights the engine sampled with "
                             "scores the batch; decoupled objective, ratio to the current policy, weight "
                             "min(pi_current / pi_engine, --behaviour-cap))", choices=OLD_LOGPROBS)
    behaviour_cap: float = knob(2.0, "old_logprobs=behaviour: the cap of the truncated behaviour -> proximal weight")
    turns: int = knob(1, "turns per trajectory: after each turn the environment appends an observation (corpus words "
                      "the policy did not sample) and the engine continues; the loss covers sampled tokens only")
    observation_words: int = knob(3, "turns > 1: corpus words per observation")
    target_letter: str = knob("m", "the task's target letter (reward: distinct words starting with it)")
    task: str = knob(TaskName.LETTER, _TASK_HELP, choices=tuple(TASKS))
    loss: str = knob("grpo", "policy objective: grpo (token ratios, clipped per token) or gspo (one ratio per "
                     "sample, the geometric mean of its token ratios, clipped per sample)", choices=LOSSES)
    gspo_clip_eps: float = knob(3e-4, "gspo: the sequence ratio's lower clip range (the GSPO paper's 3e-4)")
    gspo_clip_eps_high: float = knob(4e-4, "gspo: the sequence ratio's upper clip range (the GSPO paper's 4e-4)")
    seed: int = knob(0, "seed of prompts, sampling and initialisation")
    token_steps: int = knob(0, "also write per-token tables every this many steps (0: first and last step only)")
    noise_every: int = knob(10, "score the engine's samples again by prefill every this many steps (0: never)")
    data: str | None = knob(None, "the data folder with models/ and corpus/", unset="the checkout's data/")
    cluster: str | None = knob(None, _CLUSTER_HELP, unset="this machine, no Ray")
    engine_resources: str | None = knob(None, _ENGINE_RESOURCES_HELP, unset='{"CPU": 1}')
    trainer_resources: str | None = knob(None, _TRAINER_RESOURCES_HELP, unset='{"CPU": 1}')
    cluster_timeout: float = knob(300.0, _CLUSTER_TIMEOUT_HELP, quiet=True)
    engine_url: str | None = knob(None, "refused: RL needs an engine it can push weights into (r3lab drift and "
                                  "r3lab capture take --engine-url)", unset="a local engine")
    save_every: int = knob(0, "save the policy (weights, optimizer and RNG state) into the run's policy/ folder after "
                           "every this many steps (0: never; --trainer hf)", quiet=True)
    save_format: str = knob(POLICY_FORMATS[0], "the saved policy's format and version", choices=POLICY_FORMATS,
                            quiet=True)
    init_from: str | None = knob(None, "start from a saved policy, RUN[:STEP] (a run folder, or a run name under the "
                                 "runs folder; STEP: the steps it had taken, default its last save): its weights, "
                                 "optimizer and RNG state, the engine synced to them; the run goes on from step STEP "
                                 "to --steps", unset="the checkpoint")

    _quick: typing.ClassVar[dict[str, Any]] = {"steps": 10, "prompts_per_step": 4, "samples_per_prompt": 8,
                                               "max_tokens": 16, "mini_batches": 2, "lr": 3e-3}

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_min(("steps", "prompts_per_step", "samples_per_prompt", "max_tokens", "prompt_words",
                         "mini_batches"))
        if self.samples_per_prompt < 2:
            raise ConfigError("{samples_per_prompt} must be >= 2 (GRPO normalizes within a group)",
                              field="samples_per_prompt")
        if (self.prompts_per_step * self.samples_per_prompt) % self.mini_batches:
            raise ConfigError(f"the batch of {self.prompts_per_step * self.samples_per_prompt} samples "
                              f"({{prompts_per_step}} x {{samples_per_prompt}}) does not split into "
                              f"{self.mini_batches} mini-batches ({{mini_batches}})", field="mini_batches",
                              fields=("prompts_per_step", "samples_per_prompt"))
        self._check_min(("staleness", "token_steps", "noise_every"), lo=0)
        self._check_min(("turns", "observation_words"))
        if self.behaviour_cap <= 1:
            raise ConfigError(f"{{behaviour_cap}} must be > 1, got {self.behaviour_cap}", field="behaviour_cap")
        if self.tis_cap is not None and self.tis_cap <= 1:
            raise ConfigError(f"{{tis_cap}} must be > 1 (or off), got {self.tis_cap}", field="tis_cap")
        positive = ("lr", "clip_eps", "max_grad_norm", "temperature")
        if any(getattr(self, name) <= 0 for name in positive):
            raise ConfigError("{lr}, {clip_eps}, {max_grad_norm} and {temperature} must be > 0, got "
                              f"{self.lr}, {self.clip_eps}, {self.max_grad_norm}, {self.temperature}",
                              field=next(name for name in positive if getattr(self, name) <= 0), fields=positive)
        if self.trainer_dtype == "float32" and self.router_dtype != "float32":
            raise ConfigError("an fp32 trainer has fp32 routers: {router_dtype} bfloat16 needs {trainer_dtype} "
                              "bfloat16", field="router_dtype", fields=("trainer_dtype",))
        if not 0 < self.gspo_clip_eps < 1 or self.gspo_clip_eps_high <= 0:
            raise ConfigError(f"{{gspo_clip_eps}} must be in (0, 1) and {{gspo_clip_eps_high}} > 0, got "
                              f"{self.gspo_clip_eps}, {self.gspo_clip_eps_high}",
                              field="gspo_clip_eps" if not 0 < self.gspo_clip_eps < 1 else "gspo_clip_eps_high",
                              fields=("gspo_clip_eps", "gspo_clip_eps_high"))
        if len(self.target_letter) != 1:
            raise ConfigError(f"{{target_letter}} must be one character, got {self.target_letter!r}",
                              field="target_letter")
        _check_cluster(self)
        if (trainer_spec(self.trainer).fp32_routers_only and self.trainer_dtype == "bfloat16"
                and self.router_dtype != "float32"):
            raise ConfigError(f"{{trainer}} {self.trainer} runs fp32 routers (moe_router_dtype=fp32): "
                              "{router_dtype} float32", field="router_dtype", fields=("trainer",))
        self._check_parallel()
        if self.weight_replay != "stop" and self.mode != "R3W":
            raise ConfigError(f"{{weight_replay}} {self.weight_replay} applies to {{mode}} R3W, got {{mode}} "
                              f"{self.mode}", field="weight_replay", fields=("mode",))
        if self.mode == "R3W" and not trainer_spec(self.trainer).weight_replay:
            raise ConfigError(f"{{mode}} R3W (the engine's routing weights replayed) needs a trainer that replays "
                              f"them; the {self.trainer} trainer replays ids only", field="mode", fields=("trainer",))
        self._check_min(("save_every",), lo=0)
        if (self.save_every or self.init_from) and self.trainer != "hf":
            raise ConfigError(f"{{save_every}} and {{init_from}} save and load the transformers trainer's state; the "
                              f"{self.trainer} trainer has none to save", field="save_every" if self.save_every
                              else "init_from", fields=("trainer",))
        if self.init_from and self.staleness:
            raise ConfigError(f"{{init_from}} with {{staleness}} {self.staleness}: the saved policy holds no stale "
                              "snapshots to sample the first steps with", field="init_from", fields=("staleness",))
        if self.engine_url is not None:
            raise ConfigError(f"{{engine_url}} {self.engine_url!r} is refused for RL: {ATTACHED_RL_REASON} (drop "
                              "{engine_url})",
                              field="engine_url")

    def to_cli_args(self, *, modes: Sequence[str] | None = None, seeds: Sequence[int] | None = None) -> list[str]:
        """The ``r3lab rl`` arguments that run exactly this config (every field spelled out).

        ``modes``/``seeds`` sweep those fields as ``r3lab rl --modes ... --seeds ...`` does (default: this
        config's own mode and seed).
        """
        return _to_cli_args(self, {"mode": modes, "seed": seeds})


@dataclass(frozen=True)
class DriftConfig(_Config):
    """Everything that decides the drift experiment's numbers (same config, same numbers)."""

    models: tuple[str, ...] = knob(MODELS, "shipped model names (data/models/) or model directories")
    prompts: int = knob(48, "corpus prompts per seed")
    max_tokens: int = knob(48, "tokens sampled per prompt", flag="tokens")
    prompt_words: int = knob(12, "words per corpus prompt")
    seeds: tuple[int, ...] = knob((0, 1, 2, 3, 4), "seeds (seed s draws prompts with s, samples with s + 1)")
    temperature: float = knob(1.0, "sampling temperature")
    trainer_dtypes: tuple[str, ...] = knob(("bfloat16", "float32"), "trainer settings to score with",
                                           choices=tuple(TRAINER_DTYPES))
    engine_quant: str = knob("none", _QUANT_HELP, choices=ENGINE_QUANTS)
    trainer: str = knob("hf", _TRAINER_HELP, choices=tuple(TRAINERS))
    tp: int = knob(1, "Megatron tensor parallelism (with sequence parallelism when > 1; --trainer megatron)")
    pp: int = knob(1, "Megatron pipeline stages (--trainer megatron)")
    ep: int = knob(1, "Megatron expert parallelism (--trainer megatron; dp = ep ranks then)")
    megatron_loader: str | None = knob(None, _MEGATRON_LOADER_HELP, quiet=True,
                                       unset="megatron-bridge where installed, else mbridge")
    gpu_memory_utilization: float | None = knob(None, "the engine's GPU memory share (a GPU trainer shares the GPU "
                                                "after it)", unset="the engine's default")
    data: str | None = knob(None, "the data folder with models/ and corpus/", unset="the checkout's data/")
    engine_url: str | None = knob(None, "a running vLLM server to sample from (started with "
                                  "--enable-return-routed-experts; its API key from $R3LAB_ENGINE_API_KEY); "
                                  "--models names the local checkpoint it serves", unset="start a local engine")
    cluster: str | None = knob(None, _CLUSTER_HELP, unset="this machine, no Ray")
    engine_resources: str | None = knob(None, _ENGINE_RESOURCES_HELP, unset='{"CPU": 1}')
    trainer_resources: str | None = knob(None, _TRAINER_RESOURCES_HELP, unset='{"CPU": 1}')
    cluster_timeout: float = knob(300.0, _CLUSTER_TIMEOUT_HELP, quiet=True)
    replay_weights: bool = knob(False, "also capture the engine's routing weights and score R3W (the engine's ids "
                                "and weights replayed; in-process engine only: vLLM's API returns ids only)")

    _quick: typing.ClassVar[dict[str, Any]] = {"prompts": 8, "max_tokens": 16, "seeds": (0,)}

    def __post_init__(self) -> None:
        self._check_choices()
        for name in ("models", "trainer_dtypes"):
            if not getattr(self, name):
                raise ConfigError(f"{{{name}}} is empty", field=name)
        self._check_min(("prompts", "max_tokens", "prompt_words"))
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"{{seeds}} must be distinct and non-empty, got {self.seeds!r}", field="seeds")
        if self.temperature <= 0:
            raise ConfigError(f"{{temperature}} must be > 0, got {self.temperature!r}", field="temperature")
        self._check_parallel()
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization < 1:
            raise ConfigError(f"{{gpu_memory_utilization}} must be in (0, 1), got {self.gpu_memory_utilization!r}",
                              field="gpu_memory_utilization")
        if self.engine_url is not None:
            if not self.engine_url.startswith(("http://", "https://")):
                raise ConfigError(f"{{engine_url}} must start with http:// or https://, got {self.engine_url!r}",
                                  field="engine_url")
            if len(self.models) != 1:
                raise ConfigError(f"{{engine_url}} serves one model; give one local checkpoint in {{models}}, "
                                  f"got {list(self.models)}", field="engine_url", fields=("models",))
            if self.engine_quant != "none":
                raise ConfigError("{engine_quant} applies to a local engine; quantise the attached server yourself",
                                  field="engine_quant", fields=("engine_url",))
            if self.engine_resources is not None:
                raise ConfigError("{engine_resources} places an engine actor; with {engine_url} the server samples",
                                  field="engine_resources", fields=("engine_url",))
            if self.replay_weights:
                raise ConfigError("{replay_weights} needs the in-process engine: vLLM's HTTP API returns expert ids "
                                  "only, never routing weights", field="replay_weights", fields=("engine_url",))
        _check_cluster(self)

    def to_cli_args(self) -> list[str]:
        """The ``r3lab drift`` arguments that run exactly this config."""
        return _to_cli_args(self, {})


@dataclass(frozen=True)
class CaptureConfig(_Config):
    """Everything that decides an engine-only capture run (``r3lab capture``): which engine, how it samples."""

    model: str | None = knob(None, "the local checkpoint the server serves (shipped name or model directory; its "
                             "config.json is the MoE layout the routes must match, its tokenizer encodes text "
                             "prompts)", unset="the server's served model, when that names a local checkpoint")
    max_tokens: int = knob(48, "tokens sampled per completion", flag="tokens")
    samples: int = knob(1, "completions per prompt")
    seed: int = knob(0, "the sampling seed (every request carries it)")
    temperature: float = knob(1.0, "sampling temperature")
    batch: int = knob(64, "prompts per completions request")
    engine_url: str | None = knob(None, "the running vLLM server to sample from (started with "
                                  "--enable-return-routed-experts; its API key from $R3LAB_ENGINE_API_KEY)",
                                  unset="start a local engine in this process (--model required)")
    data: str | None = knob(None, "the data folder with models/ and corpus/", unset="the checkout's data/")

    def __post_init__(self) -> None:
        self._check_min(("max_tokens", "samples", "batch"))
        if self.temperature < 0:
            raise ConfigError(f"{{temperature}} must be >= 0, got {self.temperature!r}", field="temperature")
        if self.engine_url is None and self.model is None:
            raise ConfigError("a local engine needs {model} (or give {engine_url})", field="model",
                              fields=("engine_url",))
        if self.engine_url is not None and not self.engine_url.startswith(("http://", "https://")):
            raise ConfigError(f"{{engine_url}} must start with http:// or https://, got {self.engine_url!r}",
                              field="engine_url")


# -- dataclass fields <-> command-line flags ------------------------------------------------------------------------


def _is_tuple(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple


def _scalar_type(hint: Any) -> type:
    """``int``/``float``/``str``/``bool`` of a field annotation (``X | None`` and ``tuple[X, ...]`` unwrapped)."""
    if _is_tuple(hint):
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint not in (int, float, str, bool):
        raise TypeError(f"config fields are int, float, str, bool, their optionals or tuples; got {hint!r}")
    return hint


def _dest(cls: type, f: dataclasses.Field) -> str:
    return _SWEEPS.get(f.name, f.name) if cls is RLConfig else f.name


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):
        return " ".join(map(str, v))
    return "off" if v is None else str(v)


def quick_help(cls: type[_Config]) -> str:
    """What ``--quick`` changes, for help texts: ``steps=10, prompts_per_step=4, ...``."""
    return ", ".join(f"{k}={_fmt(v)}" for k, v in cls._quick.items())


def add_config_flags(parser: argparse.ArgumentParser, cls: type[_Config]) -> None:
    """Add one flag per field of ``cls`` (help, type and choices from the field; the default shown).

    Flags default to ``None`` (= the field's default, or ``--quick``'s), so ``config_overrides`` can tell what the
    user set. RL's ``mode`` and ``seed`` become the sweep flags ``--modes``/``--seeds`` (``--mode``/``--seed`` too).
    """
    hints = typing.get_type_hints(cls)
    quick = cls._quick
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        hint = hints[f.name]
        typ = _scalar_type(hint)
        dest = _dest(cls, f)
        names = [_flag(dest)]
        if f.metadata.get("flag"):
            names = [_flag(f.metadata["flag"]), _flag(dest)]
        if dest != f.name:
            names.append(_flag(f.name))
        sweep = dest != f.name or _is_tuple(hint)
        default = f"default: {f.metadata['unset'] if f.default is None else _fmt(f.default)}"
        if f.name in quick:
            default += f"; --quick: {_fmt(quick[f.name])}"
        elif cls is RLConfig and f.name == "seed":
            default = f"default: {_fmt(RL_SEEDS)}; --quick: {_fmt(RL_QUICK_SEEDS)}"
        elif cls is RLConfig and f.name == "mode":
            default = f"default: {' '.join(DEFAULT_MODES)}"
        if typ is bool:  # --name / --no-name; None (not given) keeps the field's default
            parser.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                help=f"{f.metadata.get('help', '')} ({default})")
            continue
        parser.add_argument(*names, dest=dest, type=typ, nargs="+" if sweep else None, default=None,
                            choices=f.metadata.get("choices"),
                            metavar=None if f.metadata.get("choices") else typ.__name__.upper(),
                            help=f"{f.metadata.get('help', '')} ({default})")


def config_overrides(args: argparse.Namespace, cls: type[_Config]) -> dict[str, Any]:
    """The fields the user set on the command line (sweep flags excluded: read ``args.modes``/``args.seeds``)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        dest = _dest(cls, f)
        v = getattr(args, dest, None)
        if v is None or dest != f.name:
            continue
        out[f.name] = tuple(v) if _is_tuple(hints[f.name]) else v
    return out


def _to_cli_args(config: _Config, sweeps: Mapping[str, Sequence[Any] | None]) -> list[str]:
    cls = type(config)
    hints = typing.get_type_hints(cls)
    args: list[str] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        v = getattr(config, f.name)
        dest = _dest(cls, f)
        if dest != f.name:
            values = sweeps.get(f.name) or (v,)
            args += [_flag(dest), *map(str, values)]
        elif v is None:
            continue  # None is the default (off / the checkout's data)
        elif f.metadata.get("quiet") and v == f.default:
            continue  # spelled out only when set (knob(quiet=True))
        elif _is_tuple(hints[f.name]):
            args += [_flag(dest), *map(str, v)]
        elif isinstance(v, bool):
            args.append(_flag(dest) if v else "--no-" + _flag(dest)[2:])
        else:
            args += [_flag(dest), repr(v) if isinstance(v, float) else str(v)]
    return args

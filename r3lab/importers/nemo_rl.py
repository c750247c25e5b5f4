"""NeMo-RL training dumps into r3lab runs (no routes: the dump carries none).

Read from NVIDIA-NeMo/RL at commit ``7ea279ab`` (also its newest at the time of reading):

* ``nemo_rl/algorithms/grpo.py`` (``grpo_train``; ``async_grpo_train`` and ``grpo_sync.py`` ``grpo_train_sync``
  the same keys) writes ``logger.log_batched_dict_as_jsonl(log_data, f"train_data_step{total_steps + 1}.jsonl")``
  unless ``env.should_log_nemo_gym_responses`` is set. ``log_data`` holds ``content``, ``rewards`` (the unfiltered
  ``total_reward`` under dynamic sampling, then also ``filtered_rewards``), ``input_lengths``, ``token_ids``,
  ``token_loss_mask``, ``sample_loss_mask``, ``advantages``, ``generation_logprobs``, ``prev_logprobs`` (and
  ``agent_ref`` for NeMo Gym), each ``.tolist()``-ed. ``N = total_steps + 1`` counts from 1; it is the step NeMo's
  logger files the same step's ``train/`` metrics under, and r3lab keeps it: **r3lab step = NeMo's N**.
* ``nemo_rl/utils/logger.py`` ``Logger.log_batched_dict_as_jsonl``: ``BatchedDataDict(to_log)
  .make_microbatch_iterator(1)`` slices every value ``[i:i+1]``, so each line is one sample whose every value is
  a **length-1 list** (``"token_ids": [[...]]``, ``"input_lengths": [n]``, ``"rewards": [r]``) plus ``"idx": i``.
  Files go to ``base_log_dir`` = the logger's ``log_dir``, which the examples point at ``get_next_experiment_dir``
  (``logs/exp_NNN``): SRC may be a file, that folder, or a folder above it holding exactly one such folder.
* Alignment (``nemo_rl/models/policy/lm_policy.py`` ``get_logprobs``; ``models/megatron/train.py``
  ``LogprobsPostProcessor``, ``dtensor_policy_worker.py`` ``DTensorPolicyWorkerImpl.get_logprobs``): log-prob ``t`` is
  of token ``t`` given the tokens before it, and position 0 is a prepended 0 (nothing predicts the first token).
  ``generation_logprobs`` are the **engine's** (vLLM's, from the rollout's assistant messages; 0 on other messages:
  ``add_grpo_token_loss_masks_and_generation_logprobs``); ``prev_logprobs`` are the **trainer's**
  (``policy.get_logprobs`` before the update). Under ``loss_fn.force_on_policy_ratio`` (without
  ``seq_logprob_error_threshold``) that forward is skipped and ``prev_logprobs = torch.zeros_like(generation_logprobs)``
  (``grpo_train``): a placeholder, not a log-prob.

What r3lab reads: tokens ``[0, n)`` (``n = input_lengths``; the rest is padding), the response from the first
loss-masked token ``P`` (``P >= 1``, so the always-zero position 0 is never read), ``logp_infer`` =
``generation_logprobs[P:n]``, ``logp_train`` = ``prev_logprobs[P:n]``, ``loss_mask`` = ``token_loss_mask[P:n] *
sample_loss_mask`` (what the loss trains on; a multi-turn sample's environment turns stay 0), ``advantage`` =
``advantages[P:n]``, ``reward`` = ``rewards``, ``index`` = ``idx``. A sample whose ``prev_logprobs`` are exactly 0 on
every loss-masked token while its engine log-probs are not is the ``force_on_policy_ratio`` placeholder: its
``logp_train`` is left missing (no mismatch metric is computed from it) and it is counted
(``samples_trainer_logprobs_placeholder`` per step and in the summary). Lines written flat (values not wrapped
in length-1 lists) are read too.

Layouts (:data:`LAYOUTS`, recorded in the run): NeMo-RL's newest commit in the mirror read is still ``7ea279ab``;
its ``log_data`` carries no ``routed_experts``, so the ``-1`` "no route captured" rows of #3113/#3378
(``ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL``) never reach this dump. A line is recognised from its values: every one a
length-1 list (``train-data-batched``, what the writer writes) or flat values (``train-data-flat``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from r3lab.errors import ImportFormatError
from r3lab.importers.common import LayerMap, Sample, jsonl_samples, layout_config, write_run
from r3lab.importers.layouts import Layout, LayoutsSeen

__all__ = ["step_files", "iter_samples", "detect", "FORMAT", "OPTIONS", "PLACEHOLDER_FLAG", "LAYOUTS"]

FORMAT = "nemo-rl"
OPTIONS: dict[str, str] = {
    "config": "the model's config.json: recorded in the run (MoE layers, experts, top-k) for the doctor; "
              "NeMo-RL's train dump carries no routes"}
PLACEHOLDER_FLAG = "trainer_logprobs_placeholder"
_WRITER = ("NVIDIA-NeMo/RL@7ea279ab nemo_rl/algorithms/grpo.py (log_data), nemo_rl/utils/logger.py "
           "(log_batched_dict_as_jsonl)")
LAYOUTS: tuple[Layout, ...] = (
    Layout("train-data-batched", _WRITER,
           "train_data_step{N}.jsonl lines whose values are length-1 lists (make_microbatch_iterator(1)) plus idx",
           "tokens, engine & trainer log-probs, advantages, rewards, loss masks (no routes)"),
    Layout("train-data-flat", _WRITER + ", values unwrapped",
           "train_data_step{N}.jsonl lines whose token_ids is one flat list",
           "tokens, engine & trainer log-probs, advantages, rewards, loss masks (no routes)"),
)
_STEP = re.compile(r"^train_data_step(\d+)\.jsonl$")
_GLOB = "train_data_step*.jsonl"
REQUIRED = ("token_ids", "input_lengths", "token_loss_mask", "generation_logprobs", "prev_logprobs")
NOTE = ("NeMo-RL train_data_step{N}.jsonl; r3lab step = N. logp_infer = generation_logprobs (engine), logp_train = "
        "prev_logprobs (trainer). prev_logprobs exactly 0 on every loss-masked token of a sample (the "
        "force_on_policy_ratio placeholder) are left missing, counted as samples_trainer_logprobs_placeholder")


def detect(path: Path) -> str | None:
    """Why ``path`` looks like a NeMo-RL log folder (or one of its train dumps), else None (names only)."""
    p = Path(path)
    if p.is_file():
        return f"{p.name} (NeMo-RL log_batched_dict_as_jsonl)" if _STEP.match(p.name) else None
    if not p.is_dir():
        return None
    for pattern in (_GLOB, f"*/{_GLOB}"):
        hit = next(p.glob(pattern), None)
        if hit is not None and _STEP.match(hit.name):
            where = "" if hit.parent == p else f" in {hit.parent.name}/"
            return f"train_data_step*.jsonl{where} (NeMo-RL log_batched_dict_as_jsonl)"
    return None


def step_files(src: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(N, file)`` of one ``train_data_step{N}.jsonl``, or of every one in the log folder, by N.

    A folder without them directly is searched beneath; it must hold exactly one folder of them (NeMo's
    ``logs/exp_NNN``): several are refused by name, since their steps would collide.
    """
    p = Path(src)
    if p.is_file():
        found = [p]
    elif p.is_dir():
        found = sorted(p.glob(_GLOB))
        if not found:
            below = sorted(p.rglob(_GLOB))
            folders = sorted({f.parent for f in below})
            if len(folders) > 1:
                raise ImportFormatError(
                    f"{str(p)!r} holds NeMo-RL train dumps in {len(folders)} folders "
                    f"({[str(f.relative_to(p)) for f in folders][:8]}): pass the one run's log folder")
            found = below
    else:
        raise ImportFormatError(f"{str(p)!r} does not exist")
    out = []
    for f in found:
        m = _STEP.match(f.name)
        if not m:
            raise ImportFormatError(f"{str(f)!r} is not named train_data_step<N>.jsonl")
        out.append((int(m.group(1)), f))
    if not out:
        raise ImportFormatError(f"no train_data_step<N>.jsonl in or under {str(p)!r} (is it NeMo-RL's log_dir?)")
    return sorted(out)


def _unwrap(v: Any, key: str, where: str) -> Any:
    """The one sample's value: ``[x]`` (``make_microbatch_iterator(1)``) -> ``x``; flat values as they are."""
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        if len(v) != 1:
            raise ImportFormatError(f"{where}: {key} holds {len(v)} sequences; a NeMo-RL line holds one sample")
        return v[0]
    if key in ("input_lengths", "rewards", "sample_loss_mask") and isinstance(v, list):
        if len(v) != 1:
            raise ImportFormatError(f"{where}: {key} has {len(v)} values; a NeMo-RL line holds one sample")
        return v[0]
    return v


def _floats(v: Any, key: str, where: str) -> np.ndarray:
    try:
        return np.asarray([np.nan if x is None else x for x in v], dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ImportFormatError(f"{where}: {key} is not a list of numbers: {e}") from e


def _parse(d: dict[str, Any], step: int, where: str, seen: LayoutsSeen | None = None) -> Sample:
    if seen is not None:
        t = d["token_ids"]
        seen.add("train-data-batched" if isinstance(t, list) and t and isinstance(t[0], list) else "train-data-flat")
    n = _unwrap(d["input_lengths"], "input_lengths", where)
    if not isinstance(n, int | float) or int(n) != n:
        raise ImportFormatError(f"{where}: input_lengths is {n!r}, not a token count")
    n = int(n)
    tok = np.asarray(_unwrap(d["token_ids"], "token_ids", where), dtype=np.int64)
    mask = _floats(_unwrap(d["token_loss_mask"], "token_loss_mask", where), "token_loss_mask", where)
    gen = _floats(_unwrap(d["generation_logprobs"], "generation_logprobs", where), "generation_logprobs", where)
    prev = _floats(_unwrap(d["prev_logprobs"], "prev_logprobs", where), "prev_logprobs", where)
    if tok.ndim != 1 or n > min(len(tok), len(mask), len(gen), len(prev)) or n < 2:
        raise ImportFormatError(f"{where}: input_lengths {n} but token_ids/token_loss_mask/generation_logprobs/"
                                f"prev_logprobs have {len(tok)}/{len(mask)}/{len(gen)}/{len(prev)} entries")
    on = np.flatnonzero(mask[:n] > 0)
    if on.size == 0:
        raise ImportFormatError(f"{where}: token_loss_mask selects no token of the first {n}")
    P = int(on[0])
    if P < 1:
        raise ImportFormatError(f"{where}: the loss mask starts at token 0; there is no prompt (NeMo's log-prob 0 "
                                "is a placeholder, never a response token's)")
    sample_mask = _unwrap(d.get("sample_loss_mask", 1), "sample_loss_mask", where)
    loss = (mask[P:n] > 0).astype(np.int8) * np.int8(1 if sample_mask is None or float(sample_mask) > 0 else 0)
    on_r = mask[P:n] > 0
    logp_train: np.ndarray | None = prev[P:n]
    flags: tuple[str, ...] = ()
    if np.all(prev[P:n][on_r] == 0.0) and np.any(gen[P:n][on_r] != 0.0):
        logp_train, flags = None, (PLACEHOLDER_FLAG,)
    adv = d.get("advantages")
    adv_arr = None
    if adv is not None:
        a = _floats(_unwrap(adv, "advantages", where), "advantages", where)
        if len(a) < n:
            raise ImportFormatError(f"{where}: advantages has {len(a)} entries for {n} tokens")
        adv_arr = a[P:n]
    rw = d.get("rewards")
    rw = None if rw is None else _unwrap(rw, "rewards", where)
    idx = d.get("idx")
    return Sample(step=step, tokens=tok[:n], response_length=n - P, logp_infer=gen[P:n], logp_train=logp_train,
                  loss_mask=loss, reward=None if rw is None else float(rw), advantage=adv_arr,
                  index=int(idx) if isinstance(idx, int) else None, where=where, flags=flags)


def iter_samples(files: Sequence[tuple[int, Path]], seen: LayoutsSeen | None = None) -> Iterator[Sample]:
    """Every sample, one line at a time (``files`` from :func:`step_files`); ``seen`` collects the layouts met."""
    def parse(d: dict[str, Any], step: int, where: str) -> Sample:
        return _parse(d, step, where, seen)

    return jsonl_samples(files, parse, required=REQUIRED, what="a NeMo-RL train dump (train_data_step<N>.jsonl)")


def import_nemo_rl(src: str | os.PathLike, out: str | os.PathLike, *,
                   config: str | os.PathLike | None = None) -> Path:
    """Import NeMo-RL ``train_data_step{N}.jsonl`` files (a file or a log folder) into the run ``out``."""
    files = step_files(src)
    extra: dict[str, Any] = {"note": NOTE}
    if config is not None:
        extra["model"] = layout_config(LayerMap.from_config(config))
    seen = LayoutsSeen(LAYOUTS)
    return write_run(iter_samples(files, seen), out, source_format=FORMAT, files=[f for _, f in files],
                     layer_map=None, extra=extra, layouts=seen)

"""NeMo-RL training dumps into r3lab runs (no routes: NeMo-RL does not dump experts).

NeMo-RL (NVIDIA-NeMo/RL) writes ``train_data_step{N}.jsonl`` into its log folder by default (the GRPO loop's
``log_batched_dict_as_jsonl`` of the step's train batch, ``nemo_rl/algorithms/grpo.py``): one JSON object per
sample with ``token_ids`` (padded), ``input_lengths`` (valid tokens), ``token_loss_mask`` (1 on generated
tokens), ``generation_logprobs`` (the engine's) and ``prev_logprobs`` (the trainer's), both aligned with
``token_ids``, plus ``advantages`` and ``rewards``. The field names follow issue 19's reading of that source;
a line without them is refused with the keys it has.

The response starts at the first loss-masked token (``P``); tokens after it that the mask excludes (a
multi-turn sample's environment turns) keep ``loss_mask = 0`` and stay out of the mismatch metrics.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from r3lab.errors import ImportFormatError
from r3lab.importers.common import Sample, read_jsonl, write_run

__all__ = ["import_nemo_rl", "step_files", "iter_samples", "FORMAT"]

FORMAT = "nemo-rl"
_STEP = re.compile(r"train_data_step(\d+)\.jsonl$")
REQUIRED = ("token_ids", "input_lengths", "token_loss_mask", "generation_logprobs", "prev_logprobs")


def step_files(src: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, file)`` of one ``train_data_step{N}.jsonl`` or of every one in a folder, by step."""
    p = Path(src)
    found = [p] if p.is_file() else sorted(p.glob("train_data_step*.jsonl")) if p.is_dir() else []
    out = []
    for f in found:
        m = _STEP.search(f.name)
        if not m:
            raise ImportFormatError(f"{str(f)!r} is not named train_data_step<N>.jsonl")
        out.append((int(m.group(1)), f))
    if not out:
        raise ImportFormatError(f"no train_data_step<N>.jsonl in {str(p)!r}")
    return sorted(out)


def _scalar(v: object) -> float | None:
    if isinstance(v, list):
        v = v[0] if v else None
    return None if v is None else float(v)  # type: ignore[arg-type]


def iter_samples(files: Sequence[tuple[int, Path]]) -> Iterator[Sample]:
    """Every sample, one line at a time."""
    for step, f in files:
        for lineno, d in read_jsonl(f):
            where = f"{f.name} line {lineno}"
            missing = [k for k in REQUIRED if k not in d]
            if missing:
                raise ImportFormatError(f"{where}: no {missing} (keys {sorted(d)}); is this a NeMo-RL train dump?")
            n = int(_scalar(d["input_lengths"]))  # type: ignore[arg-type]
            tok = np.asarray(d["token_ids"], dtype=np.int64)
            mask = np.asarray(d["token_loss_mask"])
            gen = np.asarray(d["generation_logprobs"], dtype=np.float64)
            prev = np.asarray(d["prev_logprobs"], dtype=np.float64)
            if n > min(len(tok), len(mask), len(gen), len(prev)) or n < 2:
                raise ImportFormatError(f"{where}: input_lengths {n} but token_ids/mask/logprobs have "
                                        f"{len(tok)}/{len(mask)}/{len(gen)}/{len(prev)} entries")
            on = np.flatnonzero(mask[:n] > 0)
            if on.size == 0:
                raise ImportFormatError(f"{where}: token_loss_mask selects no token")
            P = int(on[0])
            if P < 1:
                raise ImportFormatError(f"{where}: the loss mask starts at token 0; there is no prompt")
            adv = d.get("advantages")
            adv_arr = None
            if isinstance(adv, list) and len(adv) >= n:
                adv_arr = np.asarray(adv[P:n], dtype=np.float64)
            yield Sample(step=step, tokens=tok[:n], response_length=n - P, logp_infer=gen[P:n], logp_train=prev[P:n],
                         loss_mask=mask[P:n].astype(np.int8), reward=_scalar(d.get("rewards")), advantage=adv_arr,
                         index=d.get("idx"), where=where)


def import_nemo_rl(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Import NeMo-RL ``train_data_step{N}.jsonl`` files (a file or a log folder) into the run ``out``."""
    files = step_files(src)
    return write_run(iter_samples(files), out, source_format=FORMAT, files=[f for _, f in files], layer_map=None)

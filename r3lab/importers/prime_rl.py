"""prime-rl token exports into r3lab runs (no routes).

prime-rl (PrimeIntellect-ai/prime-rl) exports ``token_exports/step_S/rank_R.jsonl``: one JSON object per sample
with ``token_ids``, ``inference_logprobs``, ``trainer_logprobs`` and ``mismatch_kl`` among others (field names as
issue 19 read them from that source). The log-probs cover the completion: when they are shorter than
``token_ids`` they belong to its last tokens; when as long, a ``loss_mask``/``completion_mask`` names the
completion. Ranks of a step are read in rank order; a step is one r3lab step.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from r3lab.errors import ImportFormatError
from r3lab.importers.common import Sample, read_jsonl, write_run

__all__ = ["import_prime_rl", "export_files", "iter_samples", "FORMAT"]

FORMAT = "prime-rl"
_STEP = re.compile(r"step_(\d+)$")
_RANK = re.compile(r"rank_(\d+)\.jsonl$")
REQUIRED = ("token_ids", "inference_logprobs", "trainer_logprobs")


def export_files(src: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, file)`` for every ``step_S/rank_R.jsonl`` under ``src`` (``token_exports`` or its parent)."""
    p = Path(src)
    if (p / "token_exports").is_dir():
        p = p / "token_exports"
    out = []
    for d in p.iterdir() if p.is_dir() else []:
        m = _STEP.search(d.name)
        if d.is_dir() and m:
            for f in d.glob("rank_*.jsonl"):
                r = _RANK.search(f.name)
                if r:
                    out.append((int(m.group(1)), int(r.group(1)), f))
    if not out:
        raise ImportFormatError(f"no token_exports/step_<S>/rank_<R>.jsonl under {str(Path(src))!r}")
    return [(s, f) for s, _, f in sorted(out)]


def iter_samples(files: Sequence[tuple[int, Path]]) -> Iterator[Sample]:
    for step, f in files:
        for lineno, d in read_jsonl(f):
            where = f"{f.parent.name}/{f.name} line {lineno}"
            missing = [k for k in REQUIRED if k not in d]
            if missing:
                raise ImportFormatError(f"{where}: no {missing} (keys {sorted(d)}); is this a prime-rl token export?")
            tok = np.asarray(d["token_ids"], dtype=np.int64)
            inf = np.asarray(d["inference_logprobs"], dtype=np.float64)
            tr = np.asarray(d["trainer_logprobs"], dtype=np.float64)
            if inf.shape != tr.shape:
                raise ImportFormatError(f"{where}: {inf.size} inference but {tr.size} trainer log-probs")
            mask = d.get("loss_mask", d.get("completion_mask"))
            if inf.size < tok.size:
                P = tok.size - inf.size
                m = None if mask is None else np.asarray(mask)[-inf.size:]
            elif inf.size == tok.size and mask is not None:
                on = np.flatnonzero(np.asarray(mask) > 0)
                if on.size == 0 or on[0] < 1:
                    raise ImportFormatError(f"{where}: the mask names no completion after a prompt")
                P = int(on[0])
                inf, tr, m = inf[P:], tr[P:], np.asarray(mask)[P:]
            else:
                raise ImportFormatError(f"{where}: {inf.size} log-probs for {tok.size} tokens; no mask places them")
            rw = d.get("reward", d.get("rewards"))
            yield Sample(step=step, tokens=tok, response_length=tok.size - P, logp_infer=inf, logp_train=tr,
                         loss_mask=None if m is None else m.astype(np.int8),
                         reward=None if rw is None else float(rw), where=where)


def import_prime_rl(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Import prime-rl token exports into the run folder ``out``; returns its path."""
    files = export_files(src)
    return write_run(iter_samples(files), out, source_format=FORMAT, files=[f for _, f in files], layer_map=None)

"""The per-sample table of a run (format version 3): every sample's token ids and the engine's log-probs of one step.

With the engine's routes of the same step (``routes/step-<step>.engine.r3``) it is all that scoring a finished run
again needs (``r3lab rescore``): the tokens, what the engine gave them, and where it routed them. One row per
sample, in the order of the step's per-token table (its ``sample`` column)::

    step          int64        the step (as in the per-token tables)
    sample        int32        the sample's index in the step
    prompt_ids    list<int32>  the prompt's token ids (multi-turn: the first prompt)
    response_ids  list<int32>  every token after the prompt (multi-turn: turns and observations)
    logp_infer    list<float32> the engine's log-prob of each response token (NaN where it did not sample one)
    sampled       list<bool>   optional (multi-turn): True where the engine sampled the token

Token ids are stored as int32 and log-probs as float32 (the engine's dtype); a value either cannot hold is an error,
never a silent change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from r3lab.errors import RunFormatError

if TYPE_CHECKING:
    import pyarrow as pa


_INT32_MAX = np.iinfo(np.int32).max


def _ids(values: Any, where: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise RunFormatError(f"{where}: token ids must be a 1-D integer array, got {arr.dtype} of shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _INT32_MAX):
        raise RunFormatError(f"{where}: token ids must be in [0, {_INT32_MAX}] to be stored as int32, got "
                             f"[{int(arr.min())}, {int(arr.max())}]")
    return arr.astype(np.int32)


def _logps(values: Any, where: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind != "f"):
        raise RunFormatError(f"{where}: log-probs must be a 1-D float array, got {arr.dtype} of shape {arr.shape}")
    out = arr.astype(np.float32)
    if not np.array_equal(out.astype(arr.dtype), arr, equal_nan=True):
        raise RunFormatError(f"{where}: log-probs are stored as float32 (the engine's dtype), but these are not "
                             "float32 values; storing them would round them")
    return out


@dataclass(frozen=True)
class Samples:
    """Every sample of one step: prompt and response token ids, the engine's log-probs, the sampled mask."""

    prompt_ids: tuple[np.ndarray, ...]  # int32 per sample
    response_ids: tuple[np.ndarray, ...]  # int32 per sample
    logp_infer: tuple[np.ndarray, ...]  # float32 per response token (NaN where the engine did not sample it)
    sampled: tuple[np.ndarray, ...] | None = None  # bool per response token (multi-turn); None: every one sampled

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        if not n:
            raise RunFormatError("a per-sample table needs at least one sample")
        for name in ("response_ids", "logp_infer") + (("sampled",) if self.sampled is not None else ()):
            if len(getattr(self, name)) != n:
                raise RunFormatError(f"{len(getattr(self, name))} {name} for {n} samples")
        object.__setattr__(self, "prompt_ids", tuple(_ids(p, f"sample {i} prompt") for i, p in
                                                     enumerate(self.prompt_ids)))
        object.__setattr__(self, "response_ids", tuple(_ids(r, f"sample {i} response") for i, r in
                                                       enumerate(self.response_ids)))
        object.__setattr__(self, "logp_infer", tuple(_logps(lp, f"sample {i}") for i, lp in
                                                     enumerate(self.logp_infer)))
        if self.sampled is not None:
            object.__setattr__(self, "sampled", tuple(np.asarray(m, dtype=bool) for m in self.sampled))
        for i in range(n):
            p, r, lp = self.prompt_ids[i], self.response_ids[i], self.logp_infer[i]
            if p.size < 1 or r.size < 1:
                raise RunFormatError(f"sample {i}: needs a prompt and a response, got {p.size} and {r.size} tokens")
            if lp.shape != r.shape or (self.sampled is not None and self.sampled[i].shape != r.shape):
                raise RunFormatError(f"sample {i}: {r.size} response tokens but {lp.size} log-probs"
                                     + ("" if self.sampled is None else f" and {self.sampled[i].size} sampled flags"))

    @classmethod
    def from_ids(cls, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                 logp_infer: Sequence[Any], sampled: Sequence[Any] | None = None) -> Samples:
        return cls(tuple(np.asarray(p) for p in prompt_ids), tuple(np.asarray(r) for r in response_ids),
                   tuple(np.asarray(lp) for lp in logp_infer), None if sampled is None else tuple(sampled))

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def to_table(self, step: int) -> pa.Table:
        import pyarrow as pa

        n = len(self)
        cols: dict[str, Any] = {
            "step": pa.array(np.full(n, int(step), dtype=np.int64)),
            "sample": pa.array(np.arange(n, dtype=np.int32)),
            "prompt_ids": pa.array(list(self.prompt_ids), type=pa.list_(pa.int32())),
            "response_ids": pa.array(list(self.response_ids), type=pa.list_(pa.int32())),
            "logp_infer": pa.array(list(self.logp_infer), type=pa.list_(pa.float32())),
        }
        if self.sampled is not None:
            cols["sampled"] = pa.array(list(self.sampled), type=pa.list_(pa.bool_()))
        return pa.table(cols)

    @classmethod
    def from_table(cls, table: pa.Table, where: str) -> Samples:
        """The samples of a table :meth:`to_table` wrote; a missing column or a row out of order names ``where``."""
        need = ("sample", "prompt_ids", "response_ids", "logp_infer")
        missing = [c for c in need if c not in table.column_names]
        if missing:
            raise RunFormatError(f"{where} lacks column(s) {missing}")
        order = table.column("sample").to_numpy()
        if not np.array_equal(order, np.arange(len(order))):
            raise RunFormatError(f"{where}: its 'sample' column is not 0..{len(order) - 1} in order")

        def lists(name: str, dtype: Any) -> tuple[np.ndarray, ...]:
            col = table.column(name).combine_chunks()
            flat = col.flatten().to_numpy(zero_copy_only=False).astype(dtype)
            offsets = col.offsets.to_numpy()
            return tuple(np.split(flat, offsets[1:-1] - offsets[0]))

        sampled = lists("sampled", bool) if "sampled" in table.column_names else None
        return cls(lists("prompt_ids", np.int32), lists("response_ids", np.int32), lists("logp_infer", np.float32),
                   sampled)

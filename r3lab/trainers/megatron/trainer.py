"""The Megatron-core trainer on CPU ranks behind :class:`~r3lab.trainers.base.Trainer` (``trainer="megatron"``).

:class:`MegatronTrainer` is a driver that owns ``tp * pp * dp`` long-lived ranks
(:mod:`~r3lab.trainers.megatron.worker`), reached through a rank transport
(:mod:`~r3lab.trainers.megatron.transport`): by default gloo processes spawned here (torch.distributed processes:
Megatron's parallel state is one torch.distributed world, the same under torchrun with NCCL, and spawned ranks start
in seconds and die with the driver), or Ray actors (:class:`r3lab.cluster.megatron.RayRanks`). Each rank builds
its GPTModel shard from the checkpoint (:func:`~r3lab.trainers.megatron.checkpoint.build_model`, fp32 or bf16) and
serves the driver's commands. Every wait is bounded and all-or-none: a rank that raises, dies or does not answer
within ``timeout_s`` makes the driver end every rank and raise the transport's error
(:class:`~r3lab.errors.MegatronTrainerError` for spawned ranks).

Routes travel the seeds' way: the driver encodes them with an r3lab codec and stages one chunk per
(DP rank, mini-batch) with :func:`r3lab.staging.stage` through the transport's backend (the key-value store the
driver hosts: :class:`~r3lab.trainers.megatron.store_backend.StoreBackend`); each rank receives only its chunk
(checksums, identity checks, the all-or-none tally), slices it with :func:`~r3lab.slicing.shard_local` and
replays it with :func:`~r3lab.replay.megatron_replay`. While replaying, every rank also records the ids its
routers used (their routing maps) and checks them against the replayed ids, row by row; the counts are kept
(:attr:`MegatronTrainer.replay_checked`, :attr:`~MegatronTrainer.replay_mismatched`) and a mismatch raises.

The DP split is contiguous (``r3lab.slicing.dp_sequence_ids``); a batch that does not split evenly is padded
with copies of its last sample, scored and discarded (no loss). ``policy_step`` runs the forward and backward
through the pipeline stages (REPLAY_FORWARD, then REPLAY_BACKWARD), the clipped objective of
:mod:`r3lab.trainers.loss` over the mini-batch's tokens, gradient all-reduce (DP; expert-DP for expert
parameters; SP norms and routers over TP), clipping on the global norm and torch AdamW on every rank; the
whole :class:`~r3lab.trainers.base.PolicyUpdate` (GRPO or GSPO, loss mask, per-token weights) as the transformers
trainer applies it. ``load_weights`` takes exported weights back (matched-weights scoring under staleness).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from r3lab._process import Closing
from r3lab.errors import ConfigError, MegatronTrainerError, R3LabError
from r3lab.families import group_routing_mismatch
from r3lab.moe_layout import MoELayout
from r3lab.routes import Routes
from r3lab.trainer_registry import TrainerOptions, megatron_dp
from r3lab.trainers.base import PolicyStepStats, PolicyUpdate, TokenBatch, Trainer, TrainerScores
from r3lab.trainers.megatron.transport import RankTransport, SpawnedRanks

__all__ = ["MegatronTrainer"]


class MegatronTrainer(Closing, Trainer):
    """Megatron-core GPTModel shards on ``tp * pp * dp`` gloo CPU ranks as a :class:`~r3lab.trainers.base.Trainer`.

    ``lr`` given: every rank has an AdamW optimizer (betas and weight decay as :class:`~r3lab.trainers.hf.HFTrainer`)
    and takes policy steps. ``dp`` defaults to :func:`~r3lab.trainer_registry.megatron_dp`. ``codec``: the r3lab
    codec routes are staged with. ``transport``: how the ranks are started and reached
    (:class:`~r3lab.trainers.megatron.transport.RankTransport`; default :class:`SpawnedRanks
    <r3lab.trainers.megatron.transport.SpawnedRanks>`, gloo processes of this machine; Ray actors:
    :class:`r3lab.cluster.megatron.RayRanks`).
    """

    name = "megatron"
    batch_forward = True  # score() runs the batch as one padded forward per DP rank

    def __init__(self, model_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1, ep: int = 1, dp: int | None = None,
                 dtype: str = "float32", lr: float | None = None, codec: str = "raw", timeout_s: float = 180.0,
                 start_timeout_s: float = 300.0, megatron_loader: str | None = None,
                 transport: RankTransport | None = None):
        self.transport: RankTransport = transport if transport is not None else SpawnedRanks()
        self._configure(model_dir, tp=tp, pp=pp, ep=ep, dp=dp, dtype=dtype, codec=codec, timeout_s=timeout_s,
                        megatron_loader=megatron_loader)
        self._start_ranks(lr, start_timeout_s)

    def _configure(self, model_dir: str | os.PathLike, *, tp: int, pp: int, ep: int, dp: int | None, dtype: str,
                   codec: str, timeout_s: float, megatron_loader: str | None = None) -> None:
        """Check the options and set the driver's state (the layout, counters, the checkpoint loader every rank
        uses: :func:`r3lab.trainer_registry.megatron_loader`); no rank starts here."""
        from r3lab.trainer_registry import megatron_loader as resolve_loader

        self.megatron_loader = resolve_loader(megatron_loader)
        from r3lab.trainers.megatron.checkpoint import GroupRoutingMismatchWarning, layout_for

        for k, v in (("tp", tp), ("pp", pp), ("ep", ep)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{k} must be a positive int, got {v!r}")
        if dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        self.model_dir = Path(model_dir)
        self.dtype, self.codec, self.timeout_s = dtype, codec, float(timeout_s)
        self._closed = False
        self.layout = layout_for(self.model_dir, tp=tp, pp=pp, ep=ep, dp=dp or megatron_dp(tp, ep),
                                 sequence_parallel=tp > 1, packed=False)
        cfg = json.loads((self.model_dir / "config.json").read_text())
        self.group_routing = group_routing_mismatch(cfg)  # None, or why native routes differ by construction
        if self.group_routing:
            warnings.warn(f"{self.model_dir.name}: {self.group_routing}", GroupRoutingMismatchWarning, stacklevel=3)
        self.num_experts = MoELayout.from_config(cfg).num_experts  # the family's experts key (r3lab.families)
        self.replay_checked = 0  # router rows whose used ids were checked against the replayed ids
        self.replay_mismatched = 0
        self.stage_stats: list[Any] = []
        self.timings: dict[str, list[float]] = {"score": [], "policy_step": [], "export": []}
        self._stages = 0

    def _rank_spec(self, lr: float | None) -> dict[str, Any]:
        """What every rank builds its shard from (picklable)."""
        return dict(model_dir=str(self.model_dir), layout=self.layout.to_dict(), dtype=self.dtype, lr=lr,
                    collective_timeout_s=self.timeout_s, staging_timeout_s=min(60.0, self.timeout_s / 2),
                    megatron_loader=self.megatron_loader)

    def _start_ranks(self, lr: float | None, start_timeout_s: float) -> None:
        """Start the ``tp * pp * dp`` ranks through the transport and wait for all (a failure ends every rank)."""
        try:
            self.ranks = self.transport.start(self._rank_spec(lr), self.layout.world_size, start_timeout_s, self._fail)
        except BaseException:
            self.close()
            raise

    # ---- plumbing ------------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        return self.transport.pids

    def _fail(self, message: str) -> R3LabError:
        self.close()
        t = self.transport
        return t.error(f"{t.label} ({self._describe()}): {message}; {t.ended}")

    def _describe(self) -> str:
        L = self.layout
        return f"{self.model_dir.name}, tp={L.tp} pp={L.pp} ep={L.ep} dp={L.dp}, {self.dtype}"

    def _call(self, cmd: str, **kwargs: Any) -> list[Any]:
        if self._closed:
            raise self.transport.error(f"the {self.transport.label} ({self._describe()}) is closed")
        return self.transport.call(cmd, kwargs, self.timeout_s, self._fail)

    def close(self) -> None:
        """End every rank through the transport; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.transport.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- batches -------------------------------------------------------------------------------
    def _padded(self, batch: TokenBatch) -> tuple[dict, list[list[int]], int]:
        """The batch as the ranks get it (padded with copies of the last sample to split over DP), and the shares."""
        from r3lab.slicing import dp_sequence_ids

        n = len(batch)
        dp = self.layout.dp
        total = max(dp, math.ceil(n / dp) * dp)
        idx = list(range(n)) + [n - 1] * (total - n)
        shares = [dp_sequence_ids(total, self.layout, d)[0].tolist() for d in range(dp)]
        return dataclasses.asdict(batch.take(idx)), shares, total  # every TokenBatch field, at the batch's width

    def _stage(self, batch: TokenBatch, routes: Routes | None, total: int,
               weights: str | None = None) -> tuple[dict | None, Any]:
        """The routes staged for the ranks (each rank fetches its own share's chunk); with ``weights`` (R3W) the
        engine's routing weights go along in the call, whole, ``[rows, router layers, top_k]`` of the padded batch
        (a rank picks its rows by the same token map it checks the replayed ids with). Staging carries ids only:
        putting the weights into its chunks would change the chunk format, so they travel beside it."""
        if weights is not None:
            from r3lab.replay.megatron_weights import MEGATRON_WEIGHT_REPLAY

            if weights not in MEGATRON_WEIGHT_REPLAY:
                raise ConfigError(f"weights must be one of {MEGATRON_WEIGHT_REPLAY} (R3W) or None, got {weights!r}")
            if routes is None:
                raise ConfigError(f"weights={weights!r} replays the engine's routing weights beside its ids: "
                                  "give the engine's routes (routes=...)")
        if routes is None:
            return None, None
        from r3lab.staging import StagingPlan, stage

        if not isinstance(routes, Routes):
            raise ConfigError(f"routes must be r3lab Routes, got {type(routes).__name__}")
        carried = routes.weights
        if weights is not None and carried is None:
            raise ConfigError(f"weights={weights!r}: the routes carry no routing weights (capture them with "
                              "RolloutEngine(capture_weights=True))")
        want = np.array([len(q) for q in batch.sequences])
        if len(routes) != len(batch) or not np.array_equal(np.asarray(routes.lengths), want):
            raise ConfigError(f"routes have {len(routes)} sequences of {np.asarray(routes.lengths).tolist()[:8]} rows; "
                              f"the batch has {len(batch)} of {want.tolist()[:8]} tokens (P + R rows per sample)")
        missing = sorted(set(self.layout.router_layers) - set(routes.layer_ids.tolist()))
        if missing:
            raise ConfigError(f"routes lack the router layers {missing} of {self.model_dir.name}")
        if total > len(routes):
            routes = routes.take(list(range(len(routes))) + [len(routes) - 1] * (total - len(routes)))
            carried = routes.weights  # the padded batch's rows (the filler samples' weights too)
        plan = StagingPlan.build(total, self.layout)
        self._stages += 1
        ids_only = routes if carried is None else routes.without_weights()
        staged, stats = stage(ids_only, plan, self.transport.backend, codec=self.codec, stage_id=f"b{self._stages}")
        self.stage_stats.append(stats)
        info = self.transport.stage_info(dict(stage_id=staged.stage_id, plan=plan.to_dict(), refs=dict(staged.refs),
                                              layer_ids=list(staged.layer_ids)), staged)
        if weights is not None and carried is not None:
            layers = [int(g) for g in self.layout.router_layers]
            have = routes.layer_ids.tolist()
            info.update(weight_mode=weights, weight_layers=layers,
                        weights=np.ascontiguousarray(carried[:, [have.index(g) for g in layers]], dtype=np.float32))
        return info, staged

    def _release(self, staged: Any) -> None:
        if staged is not None:
            self.transport.release(staged)

    def _replay_counts(self, replies: list[dict], what: str) -> None:
        checked = sum(int(r["checked"]) for r in replies)
        bad = sum(int(r["mismatched"]) for r in replies)
        self.replay_checked += checked
        self.replay_mismatched += bad
        if bad:
            per = {i: r["mismatched"] for i, r in enumerate(replies) if r["mismatched"]}
            raise MegatronTrainerError(f"{what}: record after replay differs from the given routes in {bad} of "
                                       f"{checked} router rows (by rank: {per})")

    @staticmethod
    def _flat(replies: list[dict], key: str, n: int) -> np.ndarray:
        got: dict[int, np.ndarray] = {}
        for r in replies:
            got.update(r.get(key) or {})
        return np.concatenate([got[i] for i in range(n)]).astype(np.float64)

    def _routes(self, replies: list[dict], batch: TokenBatch) -> Routes:
        layers = list(self.layout.router_layers)
        cu = np.concatenate([[0], np.cumsum([len(q) for q in batch.sequences])]).astype(np.int64)
        k = None
        vals = None
        for r in replies:
            if "rows" not in r:
                continue
            keep = r["rows"] < cu[-1]
            for g, ids in r["ids"].items():
                if vals is None:
                    k = ids.shape[1]
                    vals = np.full((int(cu[-1]), len(layers), k), -1, dtype=np.int16)
                vals[r["rows"][keep], layers.index(int(g))] = ids[keep]
        if vals is None or (vals < 0).any():
            raise MegatronTrainerError("the ranks' recorded routes do not cover every token and router layer")
        return Routes(vals, cu, self.num_experts, layers)

    # ---- the Trainer interface ------------------------------------------------------------------
    def score(self, batch: TokenBatch, *, routes: Routes | None = None, record: bool = False,
              entropy: bool = False, weights: str | None = None) -> TrainerScores:
        """:meth:`Scorer.score <r3lab.trainers.base.Scorer.score>` on the ranks; ``weights`` (``"stop"`` /
        ``"straight"``, R3W): the experts are mixed with the routing weights ``routes`` carry
        (:mod:`r3lab.replay.megatron_weights`)."""
        t0 = time.perf_counter()
        payload, shares, total = self._padded(batch)
        staged_info, staged = self._stage(batch, routes, total, weights)
        try:
            replies = self._call("score", batch=payload, shares=shares, staged=staged_info, record=record,
                                 entropy=entropy)
        finally:
            if not self._closed:
                self._release(staged)
        if routes is not None:
            self._replay_counts(replies, "score")
        n = len(batch)
        out = TrainerScores(self._flat(replies, "logprobs", n), self._routes(replies, batch) if record else None,
                            self._flat(replies, "entropy", n) if entropy else None)
        self.timings["score"].append(time.perf_counter() - t0)
        return out

    def policy_step(self, batch: TokenBatch, update: PolicyUpdate, *, routes: Routes | None = None,
                    weights: str | None = None) -> PolicyStepStats:
        """One policy step on the ranks (the whole ``update``); ``weights`` (R3W) as in :meth:`score`: ``"stop"``
        sends the router no gradient from the loss, ``"straight"`` the live router's."""
        import torch

        from r3lab.trainers.loss import clipped_policy_loss

        t0 = time.perf_counter()
        n_tok = int(batch.response_lengths.sum())
        arrays = {k: np.asarray(getattr(update, k), dtype=np.float64) for k in ("old_logprobs", "advantages",
                                                                               "infer_logprobs")}
        for k, a in arrays.items():
            if a.shape != (n_tok,):
                raise ConfigError(f"PolicyUpdate.{k} has shape {a.shape}; the batch scores {n_tok} tokens")
        if update.loss == "gspo" and update.token_sample is not None and not np.array_equal(
                np.asarray(update.token_sample), batch.token_sample):
            raise ConfigError("PolicyUpdate.token_sample must be the batch's token_sample (each token's sample)")
        clipped_policy_loss(torch.from_numpy(arrays["old_logprobs"]).float(),  # a bad update raises here, not on
                            dataclasses.replace(update, token_sample=batch.token_sample))  # a rank
        payload, shares, total = self._padded(batch)
        ends = np.cumsum(batch.response_lengths)
        index = [np.arange(e - k, e) for e, k in zip(ends, batch.response_lengths, strict=True)]
        mask = None if update.loss_mask is None else np.asarray(update.loss_mask, dtype=bool)
        kept = batch.token_sample if mask is None else batch.token_sample[mask]
        token_weights = None if update.token_weights is None else np.asarray(update.token_weights, dtype=np.float64)
        # the whole update crosses to the ranks (every field, dataclasses.asdict), its arrays as numpy
        sent = dataclasses.replace(update, old_logprobs=arrays["old_logprobs"], advantages=arrays["advantages"],
                                   infer_logprobs=arrays["infer_logprobs"], loss_mask=mask,
                                   token_weights=token_weights, token_sample=batch.token_sample)
        staged_info, staged = self._stage(batch, routes, total, weights)
        try:
            replies = self._call("policy_step", batch=payload, shares=shares, staged=staged_info,
                                 update=dataclasses.asdict(sent), index=index, real_samples=len(batch),
                                 # what the loss averages over: kept tokens (grpo) or samples with a kept token (gspo)
                                 loss_count=len(np.unique(kept)) if update.loss == "gspo" else len(kept))
        finally:
            if not self._closed:
                self._release(staged)
        if routes is not None:
            self._replay_counts(replies, "policy_step")
        logp = self._flat(replies, "logprobs", len(batch))
        ent = self._flat(replies, "entropy", len(batch))
        stats = clipped_policy_loss(torch.from_numpy(logp).float(),
                                    dataclasses.replace(update, token_sample=batch.token_sample)).stats()
        self.timings["policy_step"].append(time.perf_counter() - t0)
        return PolicyStepStats(loss=float(stats["loss"] or 0.0), clip_frac=float(stats["clip_frac"] or 0.0),
                               approx_kl=float(stats["approx_kl"] or 0.0),
                               grad_norm=float(replies[0]["grad_norm"]), entropy=float(ent.mean()),
                               tis_weight_mean=stats["tis_weight_mean"], logprobs=logp)

    def receive_stats(self) -> list[list[dict]]:
        """Per rank, the route chunks it received since the last call (chunk name, bytes read, seconds per phase:
        :class:`~r3lab.staging.ReceiveStats` as dicts): what each rank fetched against its share."""
        return self._call("staging_stats")

    def export_weights(self) -> Mapping[str, Any]:
        """The weights gathered from every shard, in the checkpoint's names and shapes (CPU tensors, model dtype; a
        transport may leave them where its ranks run and hand back a lazy mapping, as Ray's object store)."""
        if self._closed:
            raise self.transport.error(f"the {self.transport.label} ({self._describe()}) is closed")
        t0 = time.perf_counter()
        out = self.transport.export(self.timeout_s, self._fail)
        self.timings["export"].append(time.perf_counter() - t0)
        return out

    def load_weights(self, weights: Mapping[str, Any]) -> None:
        """The inverse of :meth:`export_weights` (:class:`~r3lab.trainers.base.LoadsWeights`): checkpoint-named
        weights (every name of the checkpoint, its shapes) into every rank's shards, converted to the model's dtype.

        The driver checks names and shapes against the checkpoint, saves the weights as one safetensors file and
        every rank loads its TP/PP/EP shard from it as it loaded the checkpoint (:func:`load_checkpoint`). Exact:
        exporting again gives the same tensors (in the model's dtype). The optimizer's state is kept, as
        :meth:`HFTrainer.load_weights <r3lab.trainers.hf.HFTrainer.load_weights>` keeps it.
        """
        import torch
        from safetensors.torch import save_file

        from r3lab.trainers.megatron.model import checkpoint_shapes

        t0 = time.perf_counter()
        want = checkpoint_shapes(self.model_dir)
        got = {}
        for n, t in weights.items():
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"load_weights: {n!r} is a {type(t).__name__}, not a torch tensor")
            got[n] = t
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or extra:
            raise ConfigError(f"load_weights: the weights lack {missing[:6]} and have unknown names {extra[:6]} "
                              f"({len(missing)} missing, {len(extra)} unknown; {self.model_dir.name}'s names)")
        bad = [f"{n} {tuple(got[n].shape)} (checkpoint {want[n]})" for n in want if tuple(got[n].shape) != want[n]]
        if bad:
            raise ConfigError(f"load_weights: shapes differ from {self.model_dir.name}'s: {bad[:6]}")
        with tempfile.TemporaryDirectory(prefix="r3lab_megatron_load_") as d:
            path = os.path.join(d, "weights.safetensors")
            save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in got.items()}, path)
            self._call("load", path=path)
        self.timings.setdefault("load", []).append(time.perf_counter() - t0)


def load(path: str | os.PathLike, options: TrainerOptions) -> MegatronTrainer:
    """The registry's loader (``trainer="megatron"``, :mod:`r3lab.trainer_registry`): ranks in the options' layout."""
    return MegatronTrainer(path, tp=options.tp, pp=options.pp, ep=options.ep, dp=options.dp, dtype=options.dtype,
                           lr=options.lr, megatron_loader=options.megatron_loader)

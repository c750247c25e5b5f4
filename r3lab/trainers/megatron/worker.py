"""One trainer rank of :class:`~r3lab.trainers.megatron.trainer.MegatronTrainer`: a long-lived gloo process.

:func:`rank_main` joins the ranks' gloo world, builds this rank's GPTModel shard (:func:`build_model`), reports
ready, then serves the driver's commands from its pipe until ``close``: ``score``, ``policy_step``, ``export``,
``load``.
Each command's reply is ``("ok", result)`` or ``("error", traceback)``; results are numpy (no tensors cross the
pipe). Routes arrive through :mod:`r3lab.staging` (:class:`StoreBackend`): this rank receives only its DP
share's chunk, :func:`~r3lab.slicing.shard_local` slices it and :func:`~r3lab.replay.megatron_replay` replays it.
Under R3W the engine's routing weights come beside them in the call, and
:func:`~r3lab.replay.megatron_weight_replay` replays ids and weights together.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from r3lab.errors import ConfigError, MegatronTrainerError

__all__ = ["rank_main", "build_rank", "RankState"]


def _used_ids(routing_map: torch.Tensor, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids each row of a router's ``routing_map`` ``[tokens, E]`` selected (sorted), and rows with != top_k."""
    m = routing_map.detach().bool()
    bad = m.sum(1) != top_k
    ids = torch.sort(torch.topk(m.to(torch.int8), top_k, dim=1, sorted=False)[1], dim=1)[0]
    return ids.numpy(), bad.numpy()


class RankState:
    """This rank's model, optimizer and coordinates; one method per driver command."""

    def __init__(self, model: Any, layout: Any, backend: Any, *, lr: float | None, staging_timeout: float):
        from megatron.core import parallel_state as ps

        from r3lab.replay.megatron import megatron_routers

        self.model, self.layout, self.backend, self.staging_timeout = model, layout, backend, staging_timeout
        self.dp = ps.get_data_parallel_rank()
        self.pp = ps.get_pipeline_model_parallel_rank()
        self.tp = ps.get_tensor_model_parallel_rank()
        self.last = self.pp == layout.pp - 1
        self.routers = megatron_routers(model.chunks)[0]
        self.top_k = int(model.config.moe_router_topk)
        self.params = [p for c in model.chunks for p in c.parameters()]
        self.receive_stats: list[dict] = []  # every receive's ReceiveStats (chunk, bytes read, seconds), as dicts
        self.optimizer = None
        if lr is not None:
            for c in model.chunks:
                c.train()
            self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)

    # ---- inputs ------------------------------------------------------------------------------
    def _inputs(self, batch: Any, shares: list[list[int]]):
        from r3lab.slicing import token_rows

        mine = shares[self.dp]
        S = -(-int(batch.width) // self.layout.seq_alignment) * self.layout.seq_alignment
        lay = dataclasses.replace(self.layout, seq_length=S)
        seqs = [batch.sequences[i] for i in mine]
        tokens = torch.zeros((len(mine), S), dtype=torch.long)
        for b, q in enumerate(seqs):
            tokens[b, : len(q)] = torch.tensor(q)
        lens = np.array([len(q) for q in seqs], dtype=np.int64)
        rows = token_rows(lens, lay, tp_rank=self.tp)  # micro-batch token index per router row, -1 = padding
        cu_all = np.concatenate([[0], np.cumsum([len(q) for q in batch.sequences])]).astype(np.int64)
        share_cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        real = rows >= 0
        q = np.searchsorted(share_cu, rows[real], side="right") - 1
        global_rows = cu_all[np.asarray(mine, dtype=np.int64)[q]] + rows[real] - share_cu[q]
        return mine, lay, tokens, real, global_rows

    def _replay_ids(self, staged: dict | None, lay: Any) -> list[torch.Tensor] | None:
        if staged is None:
            return None
        from r3lab.slicing import shard_local
        from r3lab.staging import RankCoords, StagedBatch, StagingPlan, receive

        plan = StagingPlan.from_dict(staged["plan"])
        # the tally: the coordinator the driver sent (Ray: an actor handle), else the backend's own (the store's keys)
        coordinator = staged["coordinator"] if "coordinator" in staged else self.backend.tally(staged["stage_id"], plan)
        sb = StagedBatch(staged["stage_id"], plan, dict(staged["refs"]), self.backend, coordinator,
                         tuple(staged["layer_ids"]))
        share, stats = receive(sb, RankCoords(self.dp, self.pp, 0, self.tp), 0, timeout=self.staging_timeout)
        self.receive_stats.append(dataclasses.asdict(stats))
        ids = shard_local(share, lay, pp_rank=self.pp, cp_rank=0, tp_rank=self.tp)
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in ids]

    def _replay_weights(self, staged: dict | None, ids: list[torch.Tensor] | None, real: np.ndarray,
                        global_rows: np.ndarray) -> tuple[list[torch.Tensor], str] | None:
        """R3W: per router of this rank, the engine's routing weights at the rows of its replayed ids (``real``
        rows: the batch rows ``global_rows``; padding rows get 1 / top_k, which no loss reads), and the driver's
        weight mode (``"stop"`` / ``"straight"``); None without weights."""
        if staged is None or staged.get("weights") is None or ids is None:
            return None
        full, layers = staged["weights"], list(staged["weight_layers"])
        out = []
        for g, t in zip(self.routers, ids, strict=True):
            w = np.full(tuple(t.shape), 1.0 / t.shape[1], dtype=np.float32)
            w[real] = full[global_rows, layers.index(int(g))]
            out.append(torch.from_numpy(w))
        return out, staged["weight_mode"]

    def _hooks(self, used: dict[int, torch.Tensor]) -> list[Any]:
        """Forward hooks keeping each router's routing map: the ids it actually used (replayed or chosen)."""

        def keep(g: int):
            def hook(module, args, out):
                used[g] = out[1].detach()

            return hook

        return [r.register_forward_hook(keep(g)) for g, r in self.routers.items()]

    def _check_replay(self, ids: list[torch.Tensor], used: dict[int, torch.Tensor], real: np.ndarray):
        """Record after replay against the replayed ids, row by row (real rows): rows checked, rows differing."""
        mismatched = 0
        for g, want in zip(self.routers, ids, strict=True):
            got, bad = _used_ids(used[g], self.top_k)
            w = np.sort(want.numpy(), axis=1)
            differ = (got != w).any(axis=1) | bad
            mismatched += int(differ[real].sum())
        return int(real.sum()) * len(ids), mismatched

    def _forward(self, tokens: torch.Tensor, ids: list[torch.Tensor] | None, record: bool, grad_fn=None,
                 weights: tuple[list[torch.Tensor], str] | None = None):
        """One micro-batch forward (and backward when ``grad_fn`` is given) with replay (of the ids, and with
        ``weights``, :meth:`_replay_weights`'s, of the routing weights too: R3W), recording or neither."""
        from r3lab.replay import megatron_replay, megatron_weight_replay

        used: dict[int, torch.Tensor] = {}
        hooks = self._hooks(used)
        recorded = None
        try:
            if ids is not None:
                replay = megatron_replay(self.model.chunks, [ids]) if weights is None else \
                    megatron_weight_replay(self.model.chunks, [ids], [weights[0]], weights=weights[1])
                with replay as rep:
                    rep.begin_microbatch(forward_only=grad_fn is None)
                    out = self._run(tokens, rep.after_forward, grad_fn)
            elif record:
                with megatron_replay(self.model.chunks, mode="record") as rec:
                    rec.begin_microbatch()
                    box: dict = {}
                    out = self._run(tokens, lambda: box.setdefault("r", rec.after_forward()), grad_fn)
                    recorded = box["r"]
            else:
                out = self._run(tokens, None, grad_fn)
        finally:
            for h in hooks:
                h.remove()
        return out, used, recorded

    def _run(self, tokens: torch.Tensor, after_forward, grad_fn):
        """The pipeline: forward through this stage (recv/send activations), then backward (send/recv grads)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from r3lab.trainers.megatron.forward import forward_tokens

        if self.layout.vpp != 1:
            raise ConfigError("the Megatron trainer runs vpp=1 (no virtual pipeline chunks)")
        cfg = self.model.config
        B, S = tokens.shape
        seq_local = S // self.layout.tp if cfg.sequence_parallel else S
        first = self.pp == 0
        inp = None
        if not first:
            inp = torch.empty(seq_local, B, int(cfg.hidden_size), dtype=cfg.params_dtype)
            dist.recv(inp, src=ps.get_pipeline_model_parallel_prev_rank())
            inp.requires_grad_(grad_fn is not None)
        y = forward_tokens(self.model.chunks[0], tokens, input_tensor=inp, grad=grad_fn is not None)
        if after_forward is not None:
            after_forward()
        out = None
        if self.last:
            out = grad_fn(y) if grad_fn is not None else y
        else:
            dist.send(y.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            if grad_fn is not None:
                g = torch.empty_like(y)
                dist.recv(g, src=ps.get_pipeline_model_parallel_next_rank())
                y.backward(g)
        if grad_fn is not None and inp is not None:
            if inp.grad is None:
                raise MegatronTrainerError(f"pipeline stage {self.pp}: no gradient reached this stage's input")
            dist.send(inp.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
        return out

    # ---- commands ------------------------------------------------------------------------------
    def score(self, batch: dict, shares: list[list[int]], staged: dict | None, record: bool, entropy: bool) -> dict:
        from r3lab.trainers.base import TokenBatch
        from r3lab.trainers.megatron.forward import response_values, token_entropy, vocab_log_softmax

        tb = TokenBatch(**batch)  # the driver's batch, every field (dataclasses.asdict)
        mine, lay, tokens, real, global_rows = self._inputs(tb, shares)
        ids = self._replay_ids(staged, lay)
        w = self._replay_weights(staged, ids, real, global_rows)
        with torch.no_grad():
            logits, used, recorded = self._forward(tokens, ids, record and ids is None, weights=w)
        out: dict[str, Any] = {"checked": 0, "mismatched": 0}
        if ids is not None:
            out["checked"], out["mismatched"] = self._check_replay(ids, used, real)
        if record and (self.layout.sequence_parallel or self.tp == 0):
            if recorded is None:
                recorded = {g: torch.from_numpy(_used_ids(m, self.top_k)[0]) for g, m in used.items()}
            out["rows"] = global_rows
            out["ids"] = {g: t.numpy()[real].astype(np.int16) for g, t in recorded.items()}
        if self.last:
            with torch.no_grad():
                lsm = vocab_log_softmax(logits)  # a TP collective: every TP rank of the last stage takes part
                lp = lsm.gather(2, tokens[:, 1:, None])[..., 0]
                ent = token_entropy(lsm) if entropy else None
            if self.tp == 0:
                rows = list(enumerate(mine))
                out["logprobs"] = response_values(lp, rows, tb.prompt_lens, tb.sequences)
                if ent is not None:
                    out["entropy"] = response_values(ent, rows, tb.prompt_lens, tb.sequences)
        return out

    def policy_step(self, batch: dict, shares: list[list[int]], staged: dict | None, update: dict,
                    index: list[np.ndarray], loss_count: int, real_samples: int) -> dict:
        """One policy step on this rank's share. ``update``: the driver's whole :class:`PolicyUpdate`
        (``dataclasses.asdict``), per-token arrays over the mini-batch's tokens; ``index[i]``: sample i's tokens in
        them; ``loss_count``: what the loss averages over (kept tokens, or kept samples for gspo)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        from r3lab.trainers.base import PolicyUpdate, TokenBatch
        from r3lab.trainers.loss import clipped_policy_loss
        from r3lab.trainers.megatron.forward import response_values, token_entropy, vocab_log_softmax

        if self.optimizer is None:
            raise ConfigError("this trainer has no optimizer: build it with lr=...")
        tb, whole = TokenBatch(**batch), PolicyUpdate(**update)
        mine, lay, tokens, real, global_rows = self._inputs(tb, shares)
        ids = self._replay_ids(staged, lay)
        w = self._replay_weights(staged, ids, real, global_rows)
        pl, seqs = tb.prompt_lens, tb.sequences
        keep = [(b, i) for b, i in enumerate(mine) if i < real_samples]  # filler samples carry no loss
        result: dict[str, Any] = {}

        def loss_of(y: torch.Tensor) -> None:
            # a copy: Megatron's cross entropy works in place on its input (a view of y when B == 1)
            lp = -vocab_parallel_cross_entropy(y[:, :-1].float().contiguous().clone(), tokens[:, 1:])
            parts = [lp[b, pl[i] - 1 : len(seqs[i]) - 1] for b, i in keep]
            loss = lp.sum() * 0.0
            if parts:
                sel = np.concatenate([index[i] for _, i in keep])
                sample = np.repeat(np.arange(len(keep)), [len(index[i]) for _, i in keep])
                mask = np.ones(len(sel), dtype=bool) if whole.loss_mask is None else whole.loss_mask[sel]
                if mask.any():  # the loss mask applied here, as clipped_policy_loss applies it (same terms)
                    cur = torch.cat(parts)[torch.from_numpy(mask)]
                    sel, sample = sel[mask], np.unique(sample[mask], return_inverse=True)[1]
                    # this rank's kept tokens: every per-token field sliced, the mask applied already
                    mb = dataclasses.replace(whole, **{**whole.token_slices(sel), "loss_mask": None,
                                                       "token_sample": sample})
                    # this rank's share of the mini-batch's mean (over kept tokens, or kept samples for gspo):
                    # the DP all-reduce sums the shares' gradients into the gradient of the whole mean
                    share = (int(sample.max()) + 1 if whole.loss == "gspo" else len(sel)) / loss_count
                    loss = clipped_policy_loss(cur, mb).loss * share
            loss.backward()
            with torch.no_grad():
                ent = token_entropy(vocab_log_softmax(y.detach()))
            if self.tp == 0:
                result["logprobs"] = response_values(lp, keep, pl, seqs)
                result["entropy"] = response_values(ent, keep, pl, seqs)

        self.optimizer.zero_grad(set_to_none=False)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        _, used, _ = self._forward(tokens, ids, False, grad_fn=loss_of, weights=w)
        result["checked"], result["mismatched"] = self._check_replay(ids, used, real) if ids is not None else (0, 0)
        norm = self._reduce_and_clip(float(whole.max_grad_norm))
        self.optimizer.step()
        result["grad_norm"] = norm
        return result

    def _reduce_and_clip(self, max_norm: float) -> float:
        """All-reduce gradients (SP norms over TP, dense over DP, experts over expert-DP), clip on the global norm."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        tp_group, dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        edp_group = ps.get_expert_data_parallel_group()
        sq = torch.zeros((), dtype=torch.float64)
        for c in self.model.chunks:
            for name, p in c.named_parameters():
                g = p.grad
                expert = ".mlp.experts." in name
                if getattr(p, "sequence_parallel", False) and self.layout.tp > 1:
                    dist.all_reduce(g, group=tp_group)
                if expert:
                    if ps.get_expert_data_parallel_world_size() > 1:
                        dist.all_reduce(g, group=edp_group)
                    owner = ps.get_expert_data_parallel_rank() == 0 and (
                        getattr(p, "tensor_model_parallel", False) or ps.get_expert_tensor_parallel_rank() == 0)
                else:
                    if self.layout.dp > 1:
                        dist.all_reduce(g, group=dp_group)
                    owner = self.dp == 0 and (getattr(p, "tensor_model_parallel", False) or self.tp == 0)
                if owner:
                    sq += g.double().pow(2).sum()
        dist.all_reduce(sq)
        norm = float(sq.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.params:
                p.grad.mul_(coef)
        return norm

    def staging_stats(self) -> list[dict]:
        """The receives since the last call (chunk, bytes read, seconds per phase), and forget them."""
        out, self.receive_stats = self.receive_stats, []
        return out

    def load(self, path: str) -> None:
        """This rank's shards from a safetensors file of checkpoint-named weights (the driver's ``load_weights``)."""
        from r3lab.trainers.megatron.checkpoint import load_checkpoint

        load_checkpoint(self.model, files=[path])

    def export(self) -> dict | None:
        from r3lab.trainers.megatron.checkpoint import export_hf_state_dict

        state = export_hf_state_dict(self.model, dst=0)
        if state is None:
            return None
        out = {}
        for n, t in state.items():
            t = t.detach().contiguous()
            out[n] = ("bfloat16", t.view(torch.int16).numpy()) if t.dtype == torch.bfloat16 else (None, t.numpy())
        return out


def build_rank(rank: int, world: int, master_addr: str, port: int, spec: dict,
               make_backend: Callable[[], Any], store: Any = None) -> RankState:
    """Join the ranks' gloo world through the rendezvous store at ``master_addr:port`` (``store``: the server
    itself, where this process hosts it) and build this rank's shard: its :class:`RankState`.

    ``make_backend()`` (called after the join) gives the staging backend routes arrive through. A spawned rank
    (:func:`rank_main`) and a Ray actor (:mod:`r3lab.cluster`) start the same way."""
    from r3lab.slicing import ParallelLayout
    from r3lab.trainers.megatron.checkpoint import build_model
    from r3lab.trainers.megatron.cpu import patch_megatron_for_cpu
    from r3lab.trainers.megatron.launch import join_world

    torch.set_num_threads(1)
    patch_megatron_for_cpu()
    join_world(rank, world, master_addr, port, float(spec["collective_timeout_s"]), store=store)
    layout = ParallelLayout.from_dict(spec["layout"])
    model = build_model(spec["model_dir"], layout, dtype=spec["dtype"], group_routing="ignore",
                        loader=spec.get("megatron_loader"))
    return RankState(model, layout, make_backend(), lr=spec["lr"], staging_timeout=float(spec["staging_timeout_s"]))


def rank_main(rank: int, world: int, store_port: int, conn: Any, spec: dict,
              environ: dict[str, str] | None = None) -> None:
    """A trainer rank's whole life: join (through the driver's store), build, serve commands until ``close`` (or
    the pipe closes).

    ``environ``: the driver's environment when it started the ranks, made this process's own first
    (:func:`~r3lab.trainers.megatron.adopt_environment`)."""
    import torch.distributed as dist

    from r3lab.trainers.megatron.cpu import destroy_parallel
    from r3lab.trainers.megatron.launch import adopt_environment
    from r3lab.trainers.megatron.store_backend import StoreBackend

    adopt_environment(environ)
    try:
        coll = datetime.timedelta(seconds=float(spec["collective_timeout_s"]))
        state = build_rank(rank, world, "127.0.0.1", store_port, spec, lambda: StoreBackend(
            dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=coll)))
        conn.send(("ready", dict(rank=rank, dp=state.dp, pp=state.pp, tp=state.tp, pid=os.getpid())))
    except BaseException:  # noqa: BLE001 - the driver gets the reason, then ends every rank
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            try:
                cmd, kwargs = conn.recv()
            except EOFError:
                break
            if cmd == "close":
                break
            try:
                conn.send(("ok", getattr(state, cmd)(**kwargs)))
            except BaseException:  # noqa: BLE001 - the driver raises it and ends every rank
                conn.send(("error", traceback.format_exc()))
    finally:
        try:
            destroy_parallel(keep_process_group=False)
        except Exception:  # noqa: BLE001 - teardown must not hide the rank's own error
            pass

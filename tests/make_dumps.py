"""Small dumps in each framework's documented layout, written by code (never hand-edited bytes).

The tests call these into temporary folders. Layouts follow r3lab.importers' module docstrings (slime/Miles
``Sample.to_dict()`` rollout dumps and train dumps, NeMo-RL ``train_data_step{N}.jsonl``, prime-rl
``token_exports/step_S/rank_R.jsonl``), on a tiny GLM-4-style model: 8 decoder layers, layer 0 dense, 16 routed
experts, top-2. ``slime_dump(case=...)`` builds the nasty and the broken cases; :data:`DOCTOR_CASES` says which
doctor check each broken case must trip. :func:`framework_dump` writes slime's and Miles' ``--dump-details``
folders as their writers do today (slime train dumps v2 and v1, Miles' per-rank dumps with CP/TP/PP, eval rollouts)
on the shipped tiny-qwen3-moe shape. ``python tests/make_dumps.py OUT`` writes one of each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

E, K, LAYERS, DENSE = 16, 2, 8, (0,)
MOE = tuple(i for i in range(LAYERS) if i not in DENSE)

# broken case -> (builder, the doctor check that must fire, its status)
DOCTOR_CASES = {
    "zero_routes": ("slime", "expert ids", "fail"),
    "constant_routes": ("slime", "constant routes", "fail"),
    "out_of_range": ("slime", "expert ids", "fail"),
    "repeated": ("slime", "expert ids", "fail"),
    "none_routes": ("slime", "route rows", "fail"),
    "multi_turn": ("slime", "route rows", "fail"),
    "shifted": ("slime", "layer axis", "fail"),
    "dense_routes": ("slime", "layer axis", "fail"),
    "speculative": ("slime", "speculative rows", "fail"),
    "drift": ("slime", "k3", "warn"),
    "drift_f2": ("slime", "F(2)", "warn"),
    "drift_abs": ("slime", "max |dlogp|", "warn"),
    "drift_ess": ("slime", "IS ESS", "warn"),
    "drift_tis": ("slime", "TIS clip", "warn"),
    "jump": ("slime", "k3 jumps", "warn"),
    "collapse": ("slime", "max_vio", "warn"),
    "prefix_padding": ("slime", "route prefix", "fail"),
    "dummy_rows": ("slime", "dummy rows", "fail"),
    "physical_ids": ("slime", "expert numbering", "fail"),
    "permuted_layer": ("slime", "expert numbering", "fail"),
    "mtp_collision": ("slime", "MTP rows", "fail"),
    "replay_noop": ("own", "replay effect", "fail"),
    "replay_mismatch": ("own", "replayed routes", "fail"),
    "mtp_trainer": ("own", "MTP rows", "fail"),
    "layer_outlier": ("own", "layer disagreement", "warn"),
}


def model_config(folder: str | Path, *, mtp: int = 0) -> Path:
    """A GLM-4-MoE config.json: layer 0 dense (first_k_dense_replace=1), layers 1-7 MoE, 16 experts, top-2; with
    ``mtp`` MTP layers (``num_nextn_predict_layers``, as GLM-4.5's config declares them)."""
    p = Path(folder) / "config.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "num_hidden_layers": LAYERS,
           "first_k_dense_replace": 1, "n_routed_experts": E, "num_experts_per_tok": K, "max_position_embeddings": 512}
    if mtp:
        cfg["num_nextn_predict_layers"] = mtp
    p.write_text(json.dumps(cfg))
    return p


def routes(rng: np.random.Generator, rows: int, layers: int = LAYERS) -> np.ndarray:
    """``[rows, layers, K]`` int32 routes with distinct ids in each row; dense layers (all-layer axis, and an
    all-layer axis followed by MTP layers' rows) all zero."""
    r = np.argsort(rng.random((rows, layers, E)), axis=2)[:, :, :K].astype(np.int32)
    if layers >= LAYERS:
        r[:, list(DENSE), :] = 0
    return r


def _sample(rng: np.random.Generator, i: int, layers: int) -> dict:
    P, R = int(rng.integers(4, 8)), int(rng.integers(6, 12))
    tokens = rng.integers(0, 1000, P + R).tolist()
    return {"tokens": tokens, "response_length": R, "loss_mask": [1] * R,
            "rollout_log_probs": (-rng.exponential(1.0, R)).tolist(), "rollout_routed_experts": routes(rng, P + R - 1,
                                                                                                     layers),
            "reward": float(rng.integers(0, 2)), "index": i, "group_index": i // 4, "status": "completed",
            "weight_versions": ["0"], "metadata": {}}


def _break(s: dict, case: str, rng: np.random.Generator, step: int, steps: int) -> None:
    r = s["rollout_routed_experts"]
    if case == "zero_routes":
        r[:] = 0
    elif case == "constant_routes":
        r[:, 3, :] = [3, 5]
    elif case == "out_of_range":
        r[2, 4, 0] = E
    elif case == "repeated":
        r[1, 2, :] = r[1, 2, 0]
    elif case == "none_routes":
        s["rollout_routed_experts"] = None
    elif case == "multi_turn":  # two turns; the engine returned routes of the last turn only
        first = len(s["tokens"]) - 1 - 4
        s["rollout_routed_experts"] = r[first:]
    elif case == "speculative":
        s["metadata"]["spec_accept_token_num"] = 3
        s["rollout_routed_experts"] = np.concatenate([r, r[-1:]])  # a draft token's row kept
    elif case == "prefix_padding":  # routes captured for a prefix; the last two rows padded with [0..k-1] (SkyRL)
        r[-2:, list(MOE), :] = np.arange(K)
    elif case == "dummy_rows":  # a row with no capture filled with [0..k-1] on every layer, inside the sequence
        r[2, list(MOE), :] = np.arange(K)
    elif case == "physical_ids":  # EPLB: a redundant expert's physical slot (>= E) instead of its logical id
        r[4, 4, 0] = E + 1
    elif case == "collapse":
        r[:, 5, 0] = 0
        r[:, 5, 1] = rng.integers(1, 3, r.shape[0])


def _to_routes_form(r: np.ndarray | None, i: int, numpy_routes: bool):
    import torch

    if r is None or numpy_routes:
        return r
    return torch.from_numpy(r) if i % 2 == 0 else r.tolist()  # slime: int32 tensors or nested lists


def slime_dump(folder: str | Path, case: str = "clean", *, steps: int = 2, samples: int = 8, seed: int = 0,
               numpy_routes: bool = False, layers: int = LAYERS, train: bool = True) -> Path:
    """``rollout_{id}.pt`` files (and ``train/`` dumps over two ranks unless ``train=False``) in ``folder``.

    The clean case already holds the nasty-but-valid shapes: int32 tensors and nested lists, a dict reward, a
    truncated sample, dense-layer rows of zeros (all-layer axis). ``case`` breaks it (see :data:`DOCTOR_CASES`).
    """
    import torch

    out = Path(folder)
    (out / "train").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    if case == "jump":
        steps = max(steps, 7)
    if case in ("permuted_layer", "large"):  # enough rows for the histogram test (>= 100 picks per expert per layer)
        samples = max(samples, 64)
    sigma = np.random.default_rng(seed + 1).permutation(E).astype(np.int32)
    for step in range(steps):
        raw = [_sample(rng, i, layers) for i in range(samples)]
        raw[1]["reward"] = {"score": 1.0, "format": 0.5}
        raw[2]["status"] = "truncated"
        if case == "shifted":  # every MoE layer's routes one layer early: dense layer 0 routed, layer 7 zeros
            for s in raw:
                r = s["rollout_routed_experts"]
                r[:, :-1] = r[:, 1:].copy()
                r[:, -1] = 0
        elif case == "permuted_layer":  # layer 5 holds layer 4's routes through a relabelling of the experts
            for s in raw:
                r = s["rollout_routed_experts"]
                r[:, 5] = sigma[r[:, 4]]
        elif case == "mtp_collision":  # an MTP layer numbered 1 recorded with decoder layer 1's routes, in slot 7
            for s in raw:
                r = s["rollout_routed_experts"]
                r[:, 7] = r[:, 1]
        elif case == "dense_routes":
            for s in raw:
                s["rollout_routed_experts"][:, 0] = routes(rng, len(s["tokens"]) - 1, 2)[:, 1]
        elif case not in ("clean", "drift", "drift_f2", "drift_abs", "drift_ess", "drift_tis", "jump", "large"):
            _break(raw[3], case, rng, step, steps)
            if case == "collapse":
                for s in raw:
                    _break(s, case, rng, step, steps)
        noise = 0.01
        if case.startswith("drift") or (case == "jump" and step == steps - 1):
            noise = 3.0
        logps = [np.asarray(s["rollout_log_probs"]) + rng.normal(0, noise, s["response_length"]) for s in raw]
        for i, s in enumerate(raw):
            s["rollout_routed_experts"] = _to_routes_form(s["rollout_routed_experts"], i, numpy_routes)
        torch.save({"rollout_id": step, "samples": raw}, out / f"rollout_{step}.pt")
        if train:
            for rank in range(2):
                idx = list(range(rank, samples, 2))
                torch.save({"rollout_id": step, "rank": rank, "rollout_data": {
                    "sample_indices": idx, "log_probs": [torch.from_numpy(logps[i].copy()) for i in idx]}},
                    out / "train" / f"train_{step}_{rank}.pt")
    return out


def miles_dump(folder: str | Path, case: str = "clean", **kw) -> Path:
    """Miles: slime's layout with numpy int32 routes."""
    return slime_dump(folder, case, numpy_routes=True, **kw)


# ---- slime / Miles as their writers lay them out today ---------------------------------------------------------------
# slime 624b824a: slime/observability/rollout_data_utils.py:140-153 (rollout), train_data_utils.py:104-242 (train v2);
# slime d38dc29c9 (before #2266): slime/utils/train_dump_utils.py (train v1, one file per global rank);
# Miles 31f1ca96: miles/ray/rollout/debug_data.py (rollout), miles/utils/train_dump_utils.py (train, + cp_rank...).
TINY_QWEN3 = Path(__file__).resolve().parent.parent / "data" / "models" / "tiny-qwen3-moe" / "config.json"
SPEC_ZERO = {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0, "completion_token_num": 0}


def _shape_of(config: str | Path) -> tuple[int, int, int, int]:
    """(decoder layers, routed experts, top-k, vocab) of a config.json (Qwen3-MoE or GLM-4-MoE keys)."""
    c = json.loads(Path(config).read_text())
    return (int(c["num_hidden_layers"]), int(c.get("num_experts") or c["n_routed_experts"]),
            int(c["num_experts_per_tok"]), int(c.get("vocab_size", 1000)))


def zigzag_positions(length: int, cp_size: int, cp_rank: int, seq_len: int | None = None) -> np.ndarray:
    """Token positions CP rank ``cp_rank`` holds: Megatron's ``slice_with_cp`` (pad to 2*cp chunks, take chunks
    ``r`` and ``2*cp-1-r``), applied to ``arange`` so padding positions (>= length) show as such."""
    L = length if seq_len is None else seq_len
    chunk = (L + 2 * cp_size - 1) // (2 * cp_size)
    pos = np.arange(2 * cp_size * chunk)
    return np.concatenate([pos[chunk * cp_rank:chunk * (cp_rank + 1)],
                           pos[chunk * (2 * cp_size - cp_rank - 1):chunk * (2 * cp_size - cp_rank)]])


def cp_slice(values: np.ndarray, total: int, cp_size: int, cp_rank: int, seq_len: int | None = None) -> np.ndarray:
    """A CP rank's share of a per-response-token array: the logits rows ``t`` it computes (its token positions)
    that predict a response token (``P - 1 <= t <= total - 2``), in its storage order. ``values`` has R entries."""
    if cp_size == 1:
        return values
    P = total - len(values)
    t = zigzag_positions(total, cp_size, cp_rank, seq_len)
    t = t[(t >= P - 1) & (t <= total - 2)]
    return values[t - (P - 1)]


def _framework_sample(rng, index: int, group: int, layers: int, E: int, K: int, vocab: int, *, numpy_routes: bool,
                      multi_turn: bool, long_prompt: bool, spec: bool) -> dict:
    """One ``Sample.to_dict()`` as slime/Miles write it: tokens a list, routes ``[len(tokens) - 1, layers, K]``."""
    import torch

    P = int(rng.integers(20, 30)) if long_prompt else int(rng.integers(3, 9))
    R = int(rng.integers(2, 4)) if long_prompt else int(rng.integers(8 if multi_turn else 5, 14))
    tokens = rng.integers(4, vocab, P + R).tolist()
    mask = [1] * R
    lp = (-rng.exponential(1.0, R)).tolist()
    if multi_turn:  # a tool turn inside the response: loss mask 0, rollout log-prob 0.0 (append_response_tokens)
        for j in range(2, 5):
            mask[j], lp[j] = 0, 0.0
    r = np.argsort(rng.random((P + R - 1, layers, E)), axis=2)[:, :, :K].astype(np.int32)
    spec_info = dict(SPEC_ZERO)
    if spec:
        spec_info = {"spec_accept_token_num": R // 2, "spec_draft_token_num": R, "spec_verify_ct": R - R // 2,
                     "completion_token_num": R}
    return {"group_index": group, "index": index, "rollout_id": None, "prompt": f"prompt {group}", "tokens": tokens,
            "multimodal_inputs": None, "multimodal_train_inputs": None, "multimodal_train_input_id": None,
            "apply_chat_template_kwargs": {}, "response": f"response {index}", "response_length": R, "label": "1",
            "reward": float(rng.integers(0, 2)), "loss_mask": mask, "weight_versions": ["3"],
            "rollout_log_probs": lp, "rollout_top_p_token_ids": None, "rollout_top_p_token_offsets": None,
            "rollout_routed_experts": r if numpy_routes else torch.from_numpy(r), "remove_sample": False,
            "teacher_log_probs": None, "status": "completed", "metadata": {}, "generate_function_path": None,
            "custom_rm_path": None, "train_metadata": None, "session_id": None, "non_generation_time": 0.0,
            "spec_info": spec_info, "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": P}}


def framework_dump(folder: str | Path, framework: str = "slime", train: str | None = "v2", *,
                   config: str | Path = TINY_QWEN3, steps: int = 3, prompts: int = 3, per_prompt: int = 2,
                   dp: int = 2, cp: int = 1, tp: int = 1, pp: int = 1, qkv_format: str = "thd",
                   evals: tuple[int, ...] = (0, 2), seed: int = 0, short_routes: bool = False,
                   spec: bool = False) -> tuple[Path, dict]:
    """A ``--dump-details`` folder as slime (``train`` "v2" or "v1") or Miles (``train`` "miles") writes it.

    ``folder/rollout_data/{N}.pt`` and ``eval_{N}.pt`` (eval rollouts: the same template, ``"rollout_id": N``,
    their own sample indices colliding with training ones); ``folder/train_data/{N}.pt`` (v2: one file, CP
    gathered) or ``{N}_{rank}.pt`` (v1/Miles: every global rank, Megatron order tp-cp-dp-pp, TP copies identical,
    CP fields zigzag-sliced, only the last PP stage with ``log_probs``/``advantages``). Sample.index is global
    across rollouts; DP partitions are a shuffled split; sample 0 of each rollout is multi-turn, one sample has a
    long prompt and a short response (CP ranks with empty or uneven slices). ``short_routes`` drops the last route
    row of one sample; ``spec`` marks every sample speculative (spec_info non-zero). Returns the folder and the
    truth: ``{rollout_id: [per-sample dict with tokens, log_probs, advantages, routes, index]}`` and ``"eval"``.
    """
    import torch

    if framework not in ("slime", "miles"):
        raise ValueError(framework)
    layers, E, K, vocab = _shape_of(config)
    out = Path(folder)
    (out / "rollout_data").mkdir(parents=True, exist_ok=True)
    if framework == "miles":
        (out / "dashboard_columns").mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    numpy_routes = framework == "miles"
    truth: dict = {"eval": {}}
    index = 0
    for rid in range(steps):
        if rid in evals:  # eval_N.pt beside N.pt, written by RolloutManager.eval(rollout_id)
            ev = [_framework_sample(rng, 1000 + j, j, layers, E, K, vocab, numpy_routes=numpy_routes,
                                    multi_turn=False, long_prompt=False, spec=spec) for j in range(3)]
            for j, s in enumerate(ev):
                s["index"] = j  # eval datasets number their own samples: indices collide with training ones
            payload = {"rollout_id": rid, "samples": ev}
            if framework == "miles":
                payload = {"rollout_id": rid, "metadata": {}, "samples": ev}
            torch.save(payload, out / "rollout_data" / f"eval_{rid}.pt")
            truth["eval"][rid] = len(ev)
        samples = []
        for g in range(prompts):
            for _ in range(per_prompt):
                n = len(samples)
                samples.append(_framework_sample(rng, index, rid * prompts + g, layers, E, K, vocab,
                                                 numpy_routes=numpy_routes, multi_turn=n == 0,
                                                 long_prompt=n == 1, spec=spec))
                index += 1
        if short_routes:
            samples[2]["rollout_routed_experts"] = samples[2]["rollout_routed_experts"][:-1]
        samples[3]["reward"] = {"score": 1.0, "format": 0.25}
        samples[4]["status"] = "truncated"
        payload = {"rollout_id": rid, "samples": samples}
        if framework == "miles":
            payload = {"rollout_id": rid, "metadata": {"dynamic_filter": {}}, "samples": samples}
        torch.save(payload, out / "rollout_data" / f"{rid}.pt")
        rows = []
        for s in samples:
            R = s["response_length"]
            rl = np.asarray(s["rollout_log_probs"], np.float32)
            rows.append({"index": s["index"], "tokens": list(s["tokens"]), "response_length": R,
                         "rollout_log_probs": list(s["rollout_log_probs"]),
                         "log_probs": (rl + rng.normal(0, 0.01, R)).astype(np.float32),
                         "advantages": rng.normal(0, 1, R).astype(np.float32),
                         "routes": np.asarray(s["rollout_routed_experts"]), "loss_mask": list(s["loss_mask"])})
        truth[rid] = rows
        if train is not None:
            _write_train(out / "train_data", framework, train, rid, samples, rows, rng, dp=dp, cp=cp, tp=tp, pp=pp,
                         qkv_format=qkv_format)
    return out, truth


def _train_columns(samples: list[dict], rows: list[dict], part: list[int]) -> dict:
    """One DP shard's ``rollout_data`` before CP slicing, as the trainer holds it (full-response tensors)."""
    import torch

    raw = [s["reward"]["score"] if isinstance(s["reward"], dict) else s["reward"] for s in samples]
    return {"tokens": [torch.tensor(samples[j]["tokens"]) for j in part],
            "response_lengths": [samples[j]["response_length"] for j in part],
            "rewards": [float(raw[j]) - 0.5 for j in part], "truncated": [0 for _ in part],
            "loss_masks": [torch.tensor(samples[j]["loss_mask"], dtype=torch.int) for j in part],
            "sample_indices": [samples[j]["index"] for j in part], "rollout_ids": [samples[j]["index"] for j in part],
            "rollout_mask_sums": torch.tensor([sum(samples[j]["loss_mask"]) for j in part], dtype=torch.float32),
            "rollout_log_probs": [torch.tensor(rows[j]["rollout_log_probs"], dtype=torch.float32) for j in part],
            "total_lengths": [len(samples[j]["tokens"]) for j in part], "raw_reward": raw,
            "local_raw_reward": [raw[j] for j in part],
            "log_probs": [torch.from_numpy(rows[j]["log_probs"].copy()) for j in part],
            "advantages": [torch.from_numpy(rows[j]["advantages"].copy()) for j in part],
            "returns": [torch.from_numpy(rows[j]["advantages"].copy()) for j in part],
            "global_batch_sizes": [len(samples)], "num_microbatches": [1],
            "micro_batch_indices": [[list(range(len(part)))]]}


def _write_train(d: Path, framework: str, layout: str, rid: int, samples: list[dict], rows: list[dict], rng, *,
                 dp: int, cp: int, tp: int, pp: int, qkv_format: str) -> None:
    import torch

    d.mkdir(parents=True, exist_ok=True)
    order = rng.permutation(len(samples)).tolist()
    parts = [sorted(order[r::dp]) for r in range(dp)]
    if layout == "v2":  # slime >= #2266: _build_dump_payload over the DP shards (CP gathered, partition kept)
        flat, layout_rows, whole = [], [], {}
        for dp_rank, part in enumerate(parts):
            cols = _train_columns(samples, rows, part)
            whole.setdefault("raw_reward", cols.pop("raw_reward"))
            shard = {"rank": dp_rank * tp * cp, "data_parallel_rank": dp_rank, "sample_indices": cols["sample_indices"],
                     "partition": part}
            for k in ("global_batch_sizes", "num_microbatches", "micro_batch_indices"):
                shard[k] = cols.pop(k)
            ids = cols.pop("sample_indices")
            for i, pos in enumerate(part):
                s = {"data_parallel_rank": dp_rank, "sample_index": ids[i], "rollout_position": pos}
                s.update({k: v[i] for k, v in cols.items()})
                flat.append(s)
            layout_rows.append(shard)
        flat.sort(key=lambda s: s["rollout_position"])
        torch.save({"format_version": 2, "rollout_id": rid, "rank": 0, "samples": flat, "dp_shards": layout_rows,
                    **whole}, d / f"{rid}.pt")
        return
    cp_fields = ("log_probs", "rollout_log_probs", "advantages", "returns")
    for pp_rank in range(pp):
        for dp_rank, part in enumerate(parts):
            for cp_rank in range(cp):
                cols = _train_columns(samples, rows, part)
                if pp_rank != pp - 1:  # only the last stage computes log-probs and advantages
                    for k in ("log_probs", "advantages", "returns"):
                        cols.pop(k)
                max_seq = [int(-(-len(samples[j]["tokens"]) // 8) * 8) for j in part]
                if qkv_format == "bshd":
                    cols["max_seq_lens"] = max_seq
                for k in cp_fields:
                    if k in cols:
                        cols[k] = [torch.from_numpy(cp_slice(v.numpy(), len(samples[j]["tokens"]), cp, cp_rank,
                                                             max_seq[i] if qkv_format == "bshd" else None).copy())
                                   for i, (j, v) in enumerate(zip(part, cols[k], strict=True))]
                if framework == "miles":  # the object store's ndarray codec
                    cols["sample_indices"] = np.asarray(cols["sample_indices"], np.int64)
                for tp_rank in range(tp):  # TP copies: identical bytes
                    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
                    obj = {"rollout_id": rid, "rank": rank, "rollout_data": cols}
                    if framework == "miles":
                        obj.update(cp_rank=cp_rank, cp_size=cp, qkv_format=qkv_format)
                    torch.save(obj, d / f"{rid}_{rank}.pt")


# ---- newer slime: training-recovery neighbours, sampler heads, weight versions --------------------------------------
# THUDM/slime 13b347f8 slime/ray/training_recovery.py (TrainingRecovery.remember_converted, persist); d92cb5de
# slime/observability/train_data_utils.py (_SAMPLER_HEAD_FIELDS in the v2 payload); slime/utils/types.py
# (Sample.weight_versions: one SGLang meta_info["weight_version"] per engine call).
TOPK_HEADS = 4  # the sampler's top-k width in the fixtures


def _heads(rng, R: int) -> tuple:
    """``rollout_topk_token_ids`` (int32) and ``rollout_topk_log_probs`` (float32), ``[R, TOPK_HEADS]``."""
    import torch

    ids = torch.from_numpy(np.argsort(rng.random((R, 64)), axis=1)[:, :TOPK_HEADS].astype(np.int32))
    lp = torch.from_numpy(np.sort(-rng.exponential(1.0, (R, TOPK_HEADS)), axis=1)[:, ::-1].astype(np.float32).copy())
    return ids, lp


def _weight_versions(mode: str, rid: int, j: int, base: int) -> list[str]:
    """A sample's ``weight_versions``: ``sync`` every sample at version base + rid (slime's train.py: one update per
    rollout); ``fully_async`` a third one version behind and a third continued across the update (two versions);
    ``none`` the default empty list; ``named`` SGLang's non-numeric default version."""
    v = base + rid
    if mode == "sync":
        return [str(v)]
    if mode == "fully_async":
        if rid == 0 or j % 3 == 2:
            return [str(v)]
        return [str(v - 1)] if j % 3 == 0 else [str(v - 1), str(v)]
    if mode == "named":
        return ["default"]
    return []


def recovery_dump(folder: str | Path, *, versions: str = "sync", heads: bool = True, recovery: bool = True,
                  seed: int = 0, base_version: int = 5, **kw) -> tuple[Path, dict]:
    """A ``--dump-details`` folder as newer slime writes it: :func:`framework_dump` (train v2, eval rollouts), then
    per sample ``weight_versions`` (:func:`_weight_versions`) and, with ``heads``, the sampler's top-k heads in the
    rollout dump's samples and the v2 train dump's samples; with ``recovery``, ``{N}.pt.train-recovery.pt`` (the
    converted global batch, ``torch.save`` of per-sample lists) for rollouts 1 and 2 (rollout 0's released after a
    checkpoint), a leftover ``2.pt.train-recovery.pt.tmp``, and the journal ``.slime-recovery/<sha256>.pt``
    (``RestorePlan`` / ``ReplayBatch`` dataclasses pickled under slime's module names: not loadable without running
    code). Returns the folder and :func:`framework_dump`'s truth plus ``weight_versions``
    ``{rollout_id: [per-sample list]}`` and ``recovery`` (the names written)."""
    import hashlib
    from dataclasses import dataclass, field

    import torch
    from dumps_skyrl_verl import _fake_modules

    out, truth = framework_dump(folder, "slime", "v2", seed=seed, **kw)
    rng = np.random.default_rng(seed + 100)
    rd, td = out / "rollout_data", out / "train_data"
    truth["weight_versions"], truth["recovery"] = {}, []
    rids = sorted(k for k in truth if isinstance(k, int))
    for rid in rids:
        obj = torch.load(rd / f"{rid}.pt", weights_only=False)
        truth["weight_versions"][rid] = []
        for j, smp in enumerate(obj["samples"]):
            smp["weight_versions"] = _weight_versions(versions, rid, j, base_version)
            truth["weight_versions"][rid].append(list(smp["weight_versions"]))
            if heads:
                smp["rollout_topk_token_ids"], smp["rollout_topk_log_probs"] = _heads(rng, smp["response_length"])
        torch.save(obj, rd / f"{rid}.pt")
        if heads and (td / f"{rid}.pt").exists():
            tr = torch.load(td / f"{rid}.pt", weights_only=False)
            for row in tr["samples"]:
                src = obj["samples"][row["rollout_position"]]
                row["rollout_topk_token_ids"] = src["rollout_topk_token_ids"].clone()
                row["rollout_topk_log_probs"] = src["rollout_topk_log_probs"].clone()
            torch.save(tr, td / f"{rid}.pt")
        if recovery and rid >= 1:  # remember_converted: the global batch before DP sharding
            ss = obj["samples"]
            raw = [x["reward"]["score"] if isinstance(x["reward"], dict) else x["reward"] for x in ss]
            conv = {"tokens": [torch.tensor(x["tokens"]) for x in ss],
                    "response_lengths": [x["response_length"] for x in ss],
                    "rewards": [float(r) - float(np.mean(raw)) for r in raw], "raw_reward": raw,
                    "truncated": [int(x["status"] == "truncated") for x in ss],
                    "sample_indices": [x["index"] for x in ss],
                    "loss_masks": [torch.tensor(x["loss_mask"], dtype=torch.int) for x in ss],
                    "rollout_log_probs": [torch.tensor(x["rollout_log_probs"], dtype=torch.float32) for x in ss]}
            name = f"{rid}.pt.train-recovery.pt"
            torch.save(conv, rd / name)
            truth["recovery"].append(name)
    if recovery:
        (rd / f"{rids[-1]}.pt.train-recovery.pt.tmp").write_bytes(b"")  # a crash between torch.save and replace
        truth["recovery"].append(f"{rids[-1]}.pt.train-recovery.pt.tmp")

        @dataclass
        class RestorePlan:
            source_state: dict = field(default_factory=dict)

        @dataclass
        class ReplayBatch:
            raw: object
            converted: object = None
            batch_id: str | None = None

        jd = rd / ".slime-recovery"
        jd.mkdir()
        session = hashlib.sha256(str(rd.resolve()).encode()).hexdigest()
        with _fake_modules("slime.data.checkpoint", RestorePlan=RestorePlan), \
                _fake_modules("slime.ray.training_recovery", ReplayBatch=ReplayBatch):
            state = {"configuration": {"rollout_batch_size": 3}, "restore_plan": RestorePlan(),
                     "role_configuration": {}, "resume_configuration": {"start_rollout_id": 0},
                     "batches": {rid: ReplayBatch(str(rd / f"{rid}.pt"), str(rd / f"{rid}.pt.train-recovery.pt"),
                                                  f"batch-{rid}") for rid in rids[1:]},
                     "incarnation": "0" * 32, "loaded": True, "checkpoint_step": rids[0], "source_state": None}
            torch.save(state, jd / f"{session}.pt")
        truth["recovery"].append(f".slime-recovery/{session}.pt")
    return out, truth


QWEN_VOCAB = 388  # data/models/tiny-qwen3-moe: 8 decoder layers, all MoE, 16 experts, top-2


def _nemo_line(d: dict) -> str:
    """One line as NeMo-RL's ``log_batched_dict_as_jsonl`` writes it: ``make_microbatch_iterator(1)`` slices every
    value ``[i:i+1]`` (``nemo_rl/utils/logger.py`` l.1071-1097 at 7ea279ab), then ``{**sample, "idx": i}``."""
    i = d.pop("idx")
    return json.dumps({**{k: [v] for k, v in d.items()}, "idx": i}, default=str) + "\n"


def nemo_rl_dump(folder: str | Path, *, steps: int = 2, samples: int = 8, seed: int = 0, divisible: int = 8,
                 multi_turn: bool = True, force_on_policy: bool = False, truncated: bool = True,
                 vocab: int = 1000, exp_dir: str | None = None) -> Path:
    """NeMo-RL GRPO's ``train_data_step{N}.jsonl``, N from 1 (``nemo_rl/algorithms/grpo.py`` ~l.3630-3655).

    Per step the batch is padded to its longest sample rounded up to ``divisible`` (``batched_message_log_to_flat_
    message``'s ``make_sequence_length_divisible_by``; pad id 0, log-probs and masks 0). ``generation_logprobs`` are
    the engine's on assistant tokens, 0 on prompt and environment turns; ``prev_logprobs`` the trainer's on every
    position but 0 (a prepended 0), or all zeros under ``force_on_policy``; ``advantages`` the sample's advantage
    times the token mask. Sample 0 is multi-turn (an environment turn inside the response, loss mask 0), sample 2
    truncated (``sample_loss_mask`` 0). ``exp_dir`` writes into that subfolder (``logs/exp_001``).
    """
    out = Path(folder) / exp_dir if exp_dir else Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1):
        rows = []
        for i in range(samples):
            P, R = int(rng.integers(3, 7)), int(rng.integers(5, 10))
            n = P + R
            mask = [0] * P + [1] * R
            if multi_turn and i == 0:  # an environment turn inside the response: masked out, no engine log-prob
                mask[P + 1] = mask[P + 2] = 0
            gen = [(-float(rng.exponential(1.0)) if m else 0.0) for m in mask]
            prev = [0.0] + [(g + float(rng.normal(0, 0.01)) if m else -float(rng.exponential(2.0)))
                            for g, m in zip(gen[1:], mask[1:], strict=True)]
            if force_on_policy:
                prev = [0.0] * n
            adv = float(rng.normal())
            rows.append({"tokens": rng.integers(1, vocab, n).tolist(), "mask": mask, "gen": gen, "prev": prev,
                         "adv": [adv * m for m in mask], "reward": float(i % 2),
                         "sample_mask": 0.0 if truncated and i == 2 else 1.0})
        width = -(-max(len(r["tokens"]) for r in rows) // divisible) * divisible
        with open(out / f"train_data_step{step}.jsonl", "w") as f:
            for i, r in enumerate(rows):
                z = width - len(r["tokens"])
                f.write(_nemo_line({"content": [f"prompt {i}", f"response {i}"], "rewards": r["reward"],
                                    "input_lengths": len(r["tokens"]), "token_ids": r["tokens"] + [0] * z,
                                    "token_loss_mask": r["mask"] + [0] * z, "sample_loss_mask": r["sample_mask"],
                                    "advantages": r["adv"] + [0.0] * z, "generation_logprobs": r["gen"] + [0.0] * z,
                                    "prev_logprobs": r["prev"] + [0.0] * z, "idx": i}))
        (out / f"val_data_step{step}.jsonl").write_text(_nemo_line({"content": ["val"], "rewards": 1.0, "idx": 0}))
    return Path(folder)


def nemo_rl_large(folder: str | Path, *, samples: int, steps: int = 4, seed: int = 0) -> Path:
    """A large NeMo-RL dump (``samples`` in all, 12 tokens each) for the memory test; written line by line."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per = samples // steps
    tok = rng.integers(0, 1000, (per, 12)).tolist()
    lp = np.round(-rng.exponential(1.0, (per, 12)), 4)
    lp[:, :4] = 0.0
    lp = lp.tolist()
    for step in range(1, steps + 1):
        with open(out / f"train_data_step{step}.jsonl", "w") as f:
            for i in range(per):
                f.write(_nemo_line({"rewards": 1.0, "input_lengths": 12, "token_ids": tok[i],
                                    "token_loss_mask": [0] * 4 + [1] * 8, "sample_loss_mask": 1.0,
                                    "advantages": [0.0] * 4 + [0.5] * 8, "generation_logprobs": lp[i],
                                    "prev_logprobs": [0.0] + lp[i][1:], "idx": i}))
    return out


def _prime_sample(rng: np.random.Generator, vocab: int, all_moe: bool, multi_turn: bool, env: str) -> dict:
    """One prime-rl training sample (``TrainingSample``): a branch's tokens, trainable mask, engine log-probs and
    verifiers' per-token routes (the final row a copy of the one before: ``_attribute_routed_experts``)."""
    P, R = int(rng.integers(3, 7)), int(rng.integers(5, 10))
    mask = [False] * P + [True] * R
    if multi_turn:  # a tool turn (context, mask False) between two completions
        mask = [False] * P + [True] * 3 + [False] * 2 + [True] * (R - 3)
    n = len(mask)
    lp = [(-float(rng.exponential(1.0)) if m else 0.0) for m in mask]
    if all_moe:  # tiny-qwen3-moe: every decoder layer routed
        r = np.argsort(rng.random((n - 1, LAYERS, E)), axis=2)[:, :, :K].astype(np.uint8)
    else:  # the GLM-style model_config(): every decoder layer, dense layer 0 all zeros
        r = routes(rng, n - 1).astype(np.uint8)
    r = np.concatenate([r, r[-1:]])
    adv = float(rng.normal())
    return {"ids": rng.integers(1, vocab, n).tolist(), "mask": mask, "lp": lp, "routes": r,
            "adv": [adv if m else 0.0 for m in mask], "env": env}


def _micro_batch(samples: list[dict], pad_to: int, with_routes: bool) -> list:
    """``MicroBatch`` as msgspec encodes an ``array_like`` struct (``transports/rollouts/types.py`` at 559b4477):
    its 16 fields in declaration order (checked once against msgspec 0.23.0's encoder); the pack padded as
    ``trainer/batch.py``'s ``pad_micro_batch`` pads (ids 1, mask False, env "" and zero route rows)."""
    ids = [t for s in samples for t in s["ids"]]
    lens = [len(s["ids"]) for s in samples]
    pad = (pad_to - len(ids) % pad_to) % pad_to
    mb = [ids + [1] * pad, [m for s in samples for m in s["mask"]] + [False] * pad,
          [a for s in samples for a in s["adv"]] + [0.0] * pad, [x for s in samples for x in s["lp"]] + [0.0] * pad,
          [p for s in samples for p in range(len(s["ids"]))] + list(range(pad)), lens[:-1] + [lens[-1] + pad],
          [1.0] * (len(ids) + pad), [s["env"] for s in samples for _ in s["ids"]] + [""] * pad,
          lens[:-1] + [lens[-1] + pad]]
    re_ = None
    if with_routes:
        r = np.concatenate([s["routes"] for s in samples] + [np.zeros((pad, *samples[0]["routes"].shape[1:]),
                                                                      np.uint8)])
        re_ = [r.tobytes(), list(r.shape), "uint8"]
    # ref_logprobs, routed_experts, mm_kwargs, mm_token_type_ids, rl/ce/ref_kl weights: msgspec writes all 16
    return mb + [None, re_, None, None, None, None, None]


def prime_rl_dump(folder: str | Path, *, steps: int = 2, ranks: int = 2, micro_batches: int = 2, per_pack: int = 2,
                  seed: int = 0, routes_bin: bool = False, cp: int = 1, unfinished: bool = False,
                  nulls: bool = True, qwen3: bool = False, engine_routes: bool = True) -> Path:
    """prime-rl's output folder: ``token_exports/step_S/rank_R.jsonl`` + ``STABLE`` (S from 1), and with
    ``routes_bin`` the filesystem transport's ``rollouts/step_S/rank_D.bin`` (msgpack ``list[MicroBatch]``).

    The token export follows ``trainer/rl/token_export.py`` at 559b4477: per micro-batch, each packed sequence with
    a loss-masked token is a line, its trailing padding trimmed; every array as long as ``token_ids``;
    ``trainer_logprobs`` shifted right over the pack (``log(1/vocab)`` at the pack's position 0); non-finite values
    as ``null`` (``nulls``: one masked and one unmasked token per step). Each data rank's last micro-batch is a
    zero-loss dummy copy (nothing exported). With ``cp`` > 1 only CP rank 0 of each data rank exports, as world rank
    ``D * cp``. ``unfinished`` adds a step folder without ``STABLE`` (still being written);
    ``engine_routes=False`` writes the micro-batches without ``routed_experts`` (an engine run without
    ``enable_return_routed_experts``). ``qwen3``: shaped for
    data/models/tiny-qwen3-moe (vocab 388, all 8 layers MoE); else for :func:`model_config`.
    """
    out = Path(folder)
    vocab = QWEN_VOCAB if qwen3 else 1000
    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1 + int(unfinished)):
        ex = out / "token_exports" / f"step_{step}"
        ex.mkdir(parents=True, exist_ok=True)
        for dp in range(ranks):
            packs = [[_prime_sample(rng, vocab, qwen3, (m + j) % 3 == 1, "gsm8k") for j in range(per_pack)]
                     for m in range(micro_batches)]
            mbs = [_micro_batch(p, 8, engine_routes) for p in packs]
            dummy = [list(x) if isinstance(x, list) else x for x in mbs[0]]
            dummy[1] = [False] * len(dummy[1])
            dummy[2] = [0.0] * len(dummy[2])
            mbs.append(dummy)
            if routes_bin:
                import msgpack

                rd = out / "rollouts" / f"step_{step}"
                rd.mkdir(parents=True, exist_ok=True)
                (rd / f"rank_{dp}.bin").write_bytes(msgpack.packb(mbs, use_bin_type=True))
            lines = []
            for m, mb in enumerate(mbs):
                ids, mask, adv, inf = mb[0], mb[1], mb[2], mb[3]
                tr = [x + float(rng.normal(0, 0.02)) if k else -float(rng.exponential(2.0))
                      for x, k in zip(inf, mask, strict=True)]
                tr[0] = float(np.log(1.0 / vocab))  # shift_tensor_right's pad at the pack's position 0
                start = 0
                for j, L in enumerate(mb[5]):
                    raw_end = end = start + L
                    while end > start and mb[7][end - 1] == "" and not mask[end - 1]:
                        end -= 1
                    if end > start and any(mask[start:end]):
                        rec = {"schema_version": 1, "step": step, "rank": dp * cp, "micro_step": m,
                               "micro_sequence_idx": j, "export_sequence_idx": len(lines), "env_name": mb[7][start],
                               "token_ids": ids[start:end], "position_ids": mb[4][start:end],
                               "loss_mask": mask[start:end], "advantages": adv[start:end],
                               "inference_logprobs": inf[start:end], "trainer_logprobs": tr[start:end],
                               "entropy": [1.0] * (end - start), "mismatch_kl": [0.0] * (end - start),
                               "is_masked": [None] * (end - start), "rl_weights": [None] * (end - start)}
                        lines.append(rec)
                    start = raw_end
            if nulls and dp == 0:  # a non-finite trainer log-prob on a masked token, an engine one on a prompt token
                d = lines[0]
                d["trainer_logprobs"][d["loss_mask"].index(True) + 1] = None
                d["inference_logprobs"][1] = None
            with open(ex / f"rank_{dp * cp}.jsonl", "w") as f:
                for rec in lines:
                    f.write(json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n")
        if step <= steps:
            (ex / "STABLE").touch()
    return out


class RunsCode:
    """A pickle that would run code when loaded (it creates ``marker``): what a hostile or careless dump holds."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def evil_dump(path: str | Path, marker: str | Path) -> Path:
    """A ``.pt`` rollout dump whose samples hold :class:`RunsCode` (torch.save pickles it as is)."""
    import torch

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": 0, "samples": [RunsCode(str(marker))]}, p)
    return p


def own_run(root: str | Path, case: str = "clean", *, steps: int = 2, samples: int = 6, seed: int = 0) -> Path:
    """An r3lab run like the drift experiment's: engine/trainer/replayed routes, log-probs with and without R3."""
    from r3lab import metrics
    from r3lab.routes import Routes
    from r3lab.runs import RunWriter

    rng = np.random.default_rng(seed)
    cfg = {"model": {"moe_layer_ids": list(MOE), "num_experts": E, "top_k": K}}
    with RunWriter(root, f"own-{case}", "drift", cfg) as w:
        for step in range(steps):
            P = rng.integers(4, 8, samples)
            R = rng.integers(6, 12, samples)
            eng = [routes(rng, int(p + r - 1), len(MOE)) for p, r in zip(P, R, strict=True)]
            trn = []
            for e in eng:
                t = e.copy()
                rate = np.full(len(MOE), 0.05)
                if case == "layer_outlier":
                    rate[3] = 0.6
                flip = rng.random((t.shape[0], len(MOE))) < rate
                t[flip] = np.argsort(rng.random((int(flip.sum()), E)), axis=1)[:, :K]
                if case == "mtp_trainer":  # the trainer's MTP router (numbered 1) recorded in layer 7's slot with
                    t[:, -1] = t[:, 0]  # decoder layer 1's routes (NeMo-RL #3903); the engine's routes are clean
                trn.append(t)
            er = Routes.from_list(eng, num_experts=E, layer_ids=MOE)
            tr = Routes.from_list(trn, num_experts=E, layer_ids=MOE)
            flipped = metrics.set_differs(er.values, tr.values)[metrics.response_rows(er.cu_seqlens, R)].any(axis=1)
            n = int(R.sum())
            li = -rng.exponential(1.0, n)
            lr3 = li + rng.normal(0, 0.005, n)
            lnone = lr3 + np.where(flipped, rng.normal(0, 0.05, n), 0.0)
            if case == "replay_noop":
                lr3 = lnone.copy()
            w.write_tokens(step, {"sample": np.repeat(np.arange(samples), R),
                                  "position": np.concatenate([np.arange(r) for r in R]),
                                  "logp_infer": li, "logp_none": lnone, "logp_r3": lr3, "flipped": flipped})
            w.write_routes(step, "engine", er)
            w.write_routes(step, "trainer", tr)
            rep = er
            if case == "replay_mismatch":
                rep = Routes.from_list([e[:, ::-1] if i else np.roll(e, 1, axis=0) for i, e in enumerate(eng)],
                                       num_experts=E, layer_ids=MOE)
            w.write_routes(step, "replayed", rep)
            w.log_step({"step": step, "tokens": n})
        w.finish({"steps": steps})
    return Path(root) / f"own-{case}"


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "dumps")
    model_config(out / "model")
    slime_dump(out / "slime")
    miles_dump(out / "miles")
    nemo_rl_dump(out / "nemo-rl")
    prime_rl_dump(out / "prime-rl")
    framework_dump(out / "slime-dump-details-v2", "slime", "v2", cp=2)
    framework_dump(out / "slime-dump-details-v1", "slime", "v1", cp=2, tp=2)
    framework_dump(out / "miles-dump-details", "miles", "miles", cp=2, tp=2)
    recovery_dump(out / "slime-dump-details-recovery", versions="fully_async", cp=2)
    print(f"wrote dumps under {out}")


def imported_run(tmp: Path) -> Path:
    """A generated slime dump (with its train dump) imported as an r3lab run under ``tmp``: what notebook 06 opens."""
    from r3lab.importers import import_run

    src = slime_dump(tmp / "dump")
    return import_run("slime", src, tmp / "imported", config=model_config(tmp / "model"), train=src / "train")

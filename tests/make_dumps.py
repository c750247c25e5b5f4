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


def nemo_rl_dump(folder: str | Path, *, steps: int = 2, samples: int = 8, seed: int = 0, pad: int = 4,
                 multi_turn: bool = True) -> Path:
    """``train_data_step{N}.jsonl``: padded token_ids, input_lengths, token_loss_mask, both log-probs, advantages."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for step in range(1, steps + 1):
        with open(out / f"train_data_step{step}.jsonl", "w") as f:
            for i in range(samples):
                P, R = int(rng.integers(3, 7)), int(rng.integers(4, 10))
                n = P + R
                mask = [0] * P + [1] * R
                if multi_turn and i == 0:  # an environment turn inside the response: masked out
                    mask[P + 1] = mask[P + 2] = 0
                gen = [0.0] * P + (-rng.exponential(1.0, R)).tolist()
                prev = [g + float(rng.normal(0, 0.01)) if j >= P else 0.0 for j, g in enumerate(gen)]
                z = [0] * pad
                f.write(json.dumps({"token_ids": rng.integers(0, 1000, n).tolist() + z, "input_lengths": n,
                                    "token_loss_mask": mask + z, "generation_logprobs": gen + [0.0] * pad,
                                    "prev_logprobs": prev + [0.0] * pad, "advantages": [0.5] * (n + pad),
                                    "rewards": float(i % 2), "idx": i}) + "\n")
    return out


def nemo_rl_large(folder: str | Path, *, samples: int, steps: int = 4, seed: int = 0) -> Path:
    """A large NeMo-RL dump (``samples`` in all, short sequences) for the memory test; written line by line."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per = samples // steps
    tok = rng.integers(0, 1000, (per, 12)).tolist()
    lp = np.round(-rng.exponential(1.0, (per, 12)), 4).tolist()
    for step in range(1, steps + 1):
        with open(out / f"train_data_step{step}.jsonl", "w") as f:
            for i in range(per):
                f.write(json.dumps({"token_ids": tok[i], "input_lengths": 12, "token_loss_mask": [0] * 4 + [1] * 8,
                                    "generation_logprobs": lp[i], "prev_logprobs": lp[i], "rewards": 1.0}) + "\n")
    return out


def prime_rl_dump(folder: str | Path, *, steps: int = 2, ranks: int = 2, samples: int = 4, seed: int = 0) -> Path:
    """``token_exports/step_S/rank_R.jsonl``: log-probs over the completion (the last tokens)."""
    root = Path(folder) / "token_exports"
    rng = np.random.default_rng(seed)
    for step in range(steps):
        d = root / f"step_{step}"
        d.mkdir(parents=True, exist_ok=True)
        for rank in range(ranks):
            with open(d / f"rank_{rank}.jsonl", "w") as f:
                for _ in range(samples):
                    P, R = int(rng.integers(3, 7)), int(rng.integers(4, 10))
                    inf = (-rng.exponential(1.0, R)).tolist()
                    tr = [x + float(rng.normal(0, 0.01)) for x in inf]
                    f.write(json.dumps({"token_ids": rng.integers(0, 1000, P + R).tolist(), "inference_logprobs": inf,
                                        "trainer_logprobs": tr, "mismatch_kl": 0.0, "reward": 1.0}) + "\n")
    return Path(folder)


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
    print(f"wrote dumps under {out}")


def imported_run(tmp: Path) -> Path:
    """A generated slime dump (with its train dump) imported as an r3lab run under ``tmp``: what notebook 06 opens."""
    from r3lab.importers import import_run

    src = slime_dump(tmp / "dump")
    return import_run("slime", src, tmp / "imported", config=model_config(tmp / "model"), train=src / "train")

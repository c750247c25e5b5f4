"""Runs on disk: what every experiment writes, and the reader notebooks, figures and the command line use.

A run is one folder (format ``r3lab-run``, version 3; versions 1 and 2 still read)::

    <runs>/<name>/
      config.json      {"format": "r3lab-run", "version": 3, "kind", "name", "created", "config": {...},
                        "versions": {package: version, "r3lab-source": path},
                        "threads": {"torch": n, "OMP_NUM_THREADS": str, "MKL_NUM_THREADS": str},
                        "cpu": {"model": str, "avx512f": bool, ...}}  -- everything
                       needed to rerun it (``Run.rerun_command()``), and which r3lab checkout wrote it;
                       "threads" (the CPU thread count a bitwise rerun needs, r3lab.runs.writer.threads) is
                       optional: runs written before it have none, and read as "not recorded"; so is "cpu" (the
                       processor and the instruction sets its kernels follow, r3lab.runs.writer.cpu)
      steps.jsonl      one JSON object per step ({"step": int, ...metrics}), appended and flushed as the
                       run goes, so a reader can follow a running job; a half-written last line is ignored
      tokens/step-<step:06d>.parquet   per-token arrays of that step (any columns; step is added)
      samples/step-<step:06d>.parquet  (version 3) every sample of that step: prompt and response token ids and the
                       engine's log-probs (r3lab.runs.samples); the experiments write one for every step, with
                       that step's engine routes, so any finished run can be scored again (``r3lab rescore``)
      routes/step-<step:06d>.<what>.r3 routes of selected steps, in r3lab's own container (r3lab.compaction)
      summary.json     written last: the run's summary; its absence means the run is unfinished or was killed
      stopped.json     (version 2) the run was stopped before its end: {"state": "stopped", "at", "steps", "reason"},
                       written by whoever ended it (the dashboard's Stop; a writer left by an exception)

Version rule (as for the route container): any change to what these files mean bumps ``RUN_FORMAT_VERSION``,
and the reader refuses versions it does not know instead of guessing. A run folder is never overwritten:
a writer refuses an existing folder, so a user's run cannot replace a committed reference run.

Modules: ``format`` (the version, the error, file names), ``writer`` (:class:`RunWriter`), ``reader``
(:func:`load`, :class:`Run`, :func:`list_runs`), ``samples`` (:class:`Samples`: the per-sample table), ``follow``
(:class:`RunFollower`: runs another process is writing, read as they grow) and ``tokens`` (per-token tables pooled
per replay mode).
"""

from r3lab.runs.follow import FollowedRun, Job, RunFollower
from r3lab.runs.format import IMPORT_KIND, READABLE_VERSIONS, RUN_FORMAT, RUN_FORMAT_VERSION
from r3lab.runs.reader import Run, list_runs, load, load_runs, parse_step_line, read_stopped, reference_runs_dir
from r3lab.runs.samples import Samples
from r3lab.runs.tokens import mode_order, rl_token_logprobs
from r3lab.runs.writer import RunWriter, cpu, mark_stopped, r3lab_source, threads, versions

__all__ = ["IMPORT_KIND", "RUN_FORMAT",
           "RUN_FORMAT_VERSION", "READABLE_VERSIONS", "RunWriter", "Run", "load",
           "list_runs", "versions", "threads", "cpu", "r3lab_source", "mark_stopped", "read_stopped",
           "parse_step_line", "load_runs", "reference_runs_dir", "RunFollower", "FollowedRun", "Job", "mode_order",
           "rl_token_logprobs", "Samples"]

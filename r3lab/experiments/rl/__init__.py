"""A small GRPO loop on CPU that compares routing replay modes: none, R2, R3 and R3W.

Each step: the embedded engine (vLLM) samples ``samples_per_prompt`` completions of corpus prompts with
the policy it holds (``staleness`` updates behind the trainer); a verifiable reward scores them; the
transformers trainer recomputes the old log-probabilities, then takes ``mini_batches`` clipped-objective
steps (AdamW) over the batch, and the new weights are pushed into the engine (``update_weights``).

Replay modes (one switch, as verl's ``router_replay.mode``):

* ``none``: the trainer routes natively everywhere.
* ``R2`` (GSPO's Routing Replay): the routes the trainer chose at the old-log-prob recompute are replayed
  in every mini-batch forward and backward of that batch (on the first mini-batch this is a no-op).
* ``R3``: the engine's routes are replayed in the old-log-prob recompute and in every mini-batch forward
  and backward.
* ``R3W`` (routing-weight replay, prime-rl #3509 "Total Router Recall"): as R3, and the experts are mixed with the
  engine's own top-k routing weights (the engine captures them: ``RolloutEngine(capture_weights=True)``, which
  :func:`engine_options` asks for) instead of the weights the trainer's router computes at the replayed ids.
  ``weight_replay="stop"`` (the default, prime-rl #3509's variant): the weights are constants, so the loss sends no
  gradient into the routers (they still move through the layers below them); ``"straight"``: the engine's weights
  forward, the live rule's gradient back (straight-through), so the routers keep learning. Both RL trainers: the
  transformers one (``hf_replay``) and Megatron on CPU ranks (``megatron_weight_replay`` on every rank).

Every step also logs the router's own drift (``router/*``, :class:`~r3lab.vocabulary.RLMetric`): per mini-batch, the
current policy's live routing (what its routers choose natively) against the ids the forward replays (R2, R3,
R3W), against the engine's ids (every mode), and the L1 over experts between the live and the engine's routing
weights (where the engine captured them: always under R3W).

Orthogonal: truncated importance sampling (``tis_cap``) weights each token's loss by
``min(pi_old_trainer / pi_engine, cap)``, as verl/slime apply it.

Staleness (``staleness=k``: the engine samples with the weights of k updates ago) and where the old log-probs come
from (``old_logprobs``):

* ``current`` (default): the trainer's current weights recompute them, so their gap to the engine is the policy lag
  and the engine-trainer mismatch together.
* ``behaviour`` (matched weights, as verl's fully-async trainer and slime's ``--keep-old-actor``): a second scorer of
  the trainer's kind holds the snapshot the engine sampled with (:func:`scorer_at`) and scores the batch at those
  weights (R3 replays the engine's routes there and in every later forward; R2 records its routes there). Each step
  reports the engine-trainer mismatch at matched weights (``mismatch/*``, ``async/k3_kl_engine_trainer``: what replay
  addresses) apart from the policy lag (``async/k3_kl_policy_lag``: the current weights against the behaviour
  weights). The objective is decoupled (Hilton et al.; AReaL): the ratio is taken to the proximal policy (the
  current weights before the update, under the mode's routing) and each token is weighted by the truncated
  behaviour -> proximal weight ``min(pi_proximal / pi_engine, behaviour_cap)``; with ``tis_cap`` as well the weight
  is split at the behaviour weights, ``min(pi_proximal / pi_behaviour, behaviour_cap) * min(pi_behaviour /
  pi_engine, tis_cap)``.

Multi-turn (``turns > 1``, :mod:`r3lab.experiments.multiturn`): each trajectory is sampled turn by turn with an
observation of corpus words appended between turns; the routes replayed are stitched per turn (decode routes for
sampled tokens, prefill routes for prompt and observation tokens) and the loss covers sampled tokens only
(``PolicyUpdate.loss_mask``).

Objectives (``loss``): token-level GRPO (the default) or sequence-level GSPO (``r3lab.trainers.loss``); TIS is
orthogonal to both.

Tasks (``task``, :mod:`r3lab.experiments.tasks`): ``letter`` (distinct words starting with a target letter) and
``edges`` (distinct uncommon corpus transitions), on the made-up words of the shipped Markov corpus; responses of
``max_tokens`` tokens (up to 256 on CPU).

Collapse (:func:`r3lab.metrics.reward_collapse`): the reward stays below a share of its running peak for some steps
after a warm-up, the numbers of :data:`r3lab.vocabulary.COLLAPSE_RULE`; every step logs the detector's state
(``collapse/*``) and the precursors the field reports (clip fraction, F(2), the largest ``|dlogp|``, the IS
effective sample size, on the engine-trainer and on the policy side); the summary gives ``collapse/step`` and
``collapse/reason``.

One job per module: :mod:`~r3lab.experiments.rl.batch` (a step's rollouts, rewards, advantages),
:mod:`~r3lab.experiments.rl.trainer` (the trainer and the behaviour scorer), :mod:`~r3lab.experiments.rl.old_policy`
(old log-probs and the mismatch), :mod:`~r3lab.experiments.rl.update` (the mini-batch updates),
:mod:`~r3lab.experiments.rl.loop` (the steps, weight sync and staleness, the comparison over modes and seeds) and
:mod:`~r3lab.experiments.rl.report` (the run's files, summary, collapse and comparison table).
"""


from r3lab.experiments.rl.batch import RolloutBatch, step_samples
from r3lab.experiments.rl.loop import RLRun, engine_options, run_comparison, run_rl
from r3lab.experiments.rl.old_policy import OldPolicy, old_policy
from r3lab.experiments.rl.report import COMPARISON_METRICS, collapse_summary, comparison_rows, comparison_table
from r3lab.experiments.rl.trainer import scorer_at, start_trainer, trainer_notes, trainer_options
from r3lab.experiments.rl.update import UPDATE_STATS, StepResult, policy_updates, train_step

__all__ = [
    "RolloutBatch",
    "step_samples",
    "UPDATE_STATS",
    "OldPolicy",
    "StepResult",
    "RLRun",
    "start_trainer",
    "trainer_options",
    "scorer_at",
    "trainer_notes",
    "old_policy",
    "policy_updates",
    "train_step",
    "run_rl",
    "run_comparison",
    "engine_options",
    "collapse_summary",
    "comparison_rows",
    "comparison_table",
    "COMPARISON_METRICS",
]

"""Trainers behind one interface (:mod:`r3lab.trainers.base`): what the drift experiment and the RL loop run.

* :mod:`r3lab.trainers.base`: :class:`Scorer` / :class:`Trainer` protocols, :class:`TokenBatch` and the results.
* :mod:`r3lab.trainers.hf`: :class:`~r3lab.trainers.hf.HFTrainer`, transformers on one process (the default
  ``trainer="hf"``).
* :mod:`r3lab.trainers.megatron_bridge`: :class:`~r3lab.trainers.megatron_bridge.MegatronBridgeTrainer`, a one-rank
  Megatron GPTModel loaded by megatron-bridge on a GPU node (scoring only, ``trainer="megatron-bridge"``).
* :mod:`r3lab.trainers.megatron`: Megatron-core GPTModels built from the shipped checkpoints on CPU (gloo) ranks in
  any TP/PP/EP/DP layout (mbridge's mappings, the local spec), and their weights exported in checkpoint names;
  :class:`~r3lab.trainers.megatron.trainer.MegatronTrainer` drives such ranks as a trainer (``trainer="megatron"``).
* :mod:`r3lab.trainers.loss`: the clipped policy-gradient objective every trainer's ``policy_step`` uses.

The trainer modules import torch (and transformers / megatron-core when used); this package's own import stays
light: the protocols and :class:`TokenBatch` are numpy.
"""

from r3lab.trainers.base import PolicyStepStats, PolicyUpdate, Scorer, TokenBatch, Trainer, TrainerScores

__all__ = ["Scorer", "Trainer", "TokenBatch", "TrainerScores", "PolicyUpdate", "PolicyStepStats"]

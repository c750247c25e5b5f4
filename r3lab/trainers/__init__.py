"""Trainers: the models that score and update the policy (transformers, Megatron-core)."""

"""Helpers for tests, benchmarks and notebooks (in the spirit of ``numpy.testing``): not part of the R3 path."""

from r3lab.testing.corpus import corpus_prompts

__all__ = ["corpus_prompts"]

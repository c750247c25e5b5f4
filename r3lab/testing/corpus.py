"""Re-export: the corpus prompts moved to :mod:`r3lab.corpus` (product code reads them there)."""

from r3lab.corpus import corpus_prompts

__all__ = ["corpus_prompts"]

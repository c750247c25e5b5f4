"""Re-export: the corpus prompts moved to :mod:`r3lab.corpus` (product code reads them there)."""


from r3lab.corpus import corpus_prompts  # noqa: F401  (importable here as before; exported by r3lab.corpus)

__all__ = []

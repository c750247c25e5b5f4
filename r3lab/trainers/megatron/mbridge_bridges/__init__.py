"""mbridge bridges r3lab owns: Megatron mappings for families mbridge 0.15.1 does not map (one module per family).

These are bridges of mbridge (verl's), not of NVIDIA's Megatron-Bridge (:mod:`r3lab.trainers.megatron_bridge`). A
family's entry in :mod:`r3lab.families` names its class (``mbridge_bridge="module:Class"``);
:func:`r3lab.trainers.megatron.checkpoint.build_model` uses it in place of mbridge's registry. A class is an mbridge
``Bridge`` (the same five mapping methods, :mod:`~r3lab.trainers.megatron.mbridge_api`), and may define
``local_spec_hook(block_spec) -> block_spec``, which edits Megatron's local layer spec after the CPU norms are in
(:func:`~r3lab.trainers.megatron.cpu.local_block_spec`).

* :mod:`~r3lab.trainers.megatron.mbridge_bridges.olmoe`: OLMoE (softmax top-k, qk-norm over all heads).
"""

"""Forward passes of a Megatron-core GPTModel on CPU ranks: masks, pipeline stages, token log-probs.

Megatron's local attention takes an explicit mask (:func:`causal_mask`). :func:`pipeline_forward` runs one
forward-only micro-batch through every (virtual) pipeline stage with gloo point-to-point sends; the last
stage gets the logits ``[B, S, V/tp]``, which :func:`logits_logprobs` gathers over the tensor-parallel group
into fp32 log-probabilities of the given tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from r3lab.errors import ConfigError

__all__ = ["vocab_log_softmax", "token_entropy", "response_values"]


def causal_mask(seq_len: int, segment_ids: torch.Tensor | None = None, batch: int = 1) -> torch.Tensor:
    """Megatron attention mask ``[B, 1, S, S]`` (True = masked): causal, and block-diagonal per segment.

    ``segment_ids`` ``[B, S]`` emulates a packed (THD) micro-batch with the local attention: tokens
    attend only to earlier tokens of the same segment.
    """
    m = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None].expand(
        batch, 1, seq_len, seq_len
    )
    if segment_ids is not None:
        m = m | (segment_ids[:, None, :, None] != segment_ids[:, None, None, :])
    return m.contiguous()


def forward_tokens(
    model: torch.nn.Module,
    tokens: torch.Tensor | None,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    input_tensor: torch.Tensor | None = None,
    grad: bool = False,
) -> torch.Tensor:
    """One forward of one (micro)batch ``tokens`` ``[B, S]`` on this rank's model chunk.

    Non-first pipeline stages take the previous stage's output ``[S_local, B, H]`` as ``input_tensor``
    (``model.set_input_tensor``). Returns logits ``[B, S, V/tp]`` on the last stage, else hidden states.
    ``position_ids`` default to ``arange(S)``; ``attention_mask`` to :func:`causal_mask`.
    """
    if tokens is None and input_tensor is None:
        raise ConfigError("forward_tokens needs tokens (first stage) or input_tensor (later stages)")
    if tokens is not None:
        B, S = tokens.shape
    else:
        B = input_tensor.shape[1]
        S = attention_mask.shape[-1] if attention_mask is not None else None
        if S is None:
            raise ConfigError("later pipeline stages need tokens or attention_mask to know the sequence length")
    if position_ids is None:
        position_ids = torch.arange(S, dtype=torch.long)[None].expand(B, S)
    if attention_mask is None:
        attention_mask = causal_mask(S, batch=B)
    model.set_input_tensor(input_tensor)
    with torch.set_grad_enabled(grad):
        return model(input_ids=tokens, position_ids=position_ids, attention_mask=attention_mask)


def pipeline_forward(
    chunks: Sequence[torch.nn.Module],
    tokens: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    hidden_size: int | None = None,
) -> torch.Tensor | None:
    """Forward-only pass of one micro-batch through all (virtual) pipeline stages, activations sent by gloo p2p.

    Every rank passes the same full ``tokens`` ``[B, S]``. Order: chunk 0 on stages 0..pp-1, then
    chunk 1, ... Returns the logits on the last stage's last chunk, else None. ``hidden_size`` defaults
    to the model config's.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    cfg = chunks[0].config
    hidden_size = int(hidden_size if hidden_size is not None else cfg.hidden_size)
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    B, S = tokens.shape
    seq_local = S // ps.get_tensor_model_parallel_world_size() if cfg.sequence_parallel else S
    out = None
    for c, model in enumerate(chunks):
        for stage in range(pp):
            if stage != pp_rank:
                continue
            first = c == 0 and stage == 0
            last = c == len(chunks) - 1 and stage == pp - 1
            inp = None
            if not first:
                inp = torch.empty(seq_local, B, hidden_size, dtype=cfg.params_dtype)
                dist.recv(inp, src=ps.get_pipeline_model_parallel_prev_rank())
            y = forward_tokens(
                model, tokens, position_ids=position_ids, attention_mask=attention_mask, input_tensor=inp
            )
            if last:
                out = y
            else:
                dist.send(y.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return out


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Logits ``[..., V/tp]`` of this tensor-parallel rank -> the full vocabulary ``[..., V]`` (all-gather over TP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def vocab_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """fp32 log-softmax over the full vocabulary at positions 0..S-2, ``[B, S - 1, V]``, from this rank's
    ``[B, S, V/tp]`` (a TP collective: every TP rank of the stage takes part). Position t scores token t + 1."""
    full = gather_vocab(logits).float()
    return torch.log_softmax(full[:, :-1], dim=-1)


def logits_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 ``log p(tokens[:, t] | tokens[:, :t])`` for t >= 1, ``[B, S - 1]``, from this rank's ``[B, S, V/tp]``."""
    return vocab_log_softmax(logits).gather(2, tokens[:, 1:, None].long())[..., 0]


def token_entropy(log_softmax: torch.Tensor) -> torch.Tensor:
    """The entropy of each position's distribution, ``[B, S - 1]``, from :func:`vocab_log_softmax`'s output."""
    return -(log_softmax.exp() * log_softmax).sum(-1)


def response_values(values: torch.Tensor, rows: Sequence[tuple[int, int]], prompt_lens: Sequence[int],
                    sequences: Sequence[Sequence[int]]) -> dict[int, np.ndarray]:
    """Per sample, the values ``[B, S - 1]`` (position t scores token t + 1) of its response tokens, float64.

    ``rows``: (row in ``values``, sample id) pairs; sample i's response is tokens ``prompt_lens[i]`` to the end of
    ``sequences[i]``, so its values are positions ``prompt_lens[i] - 1`` to ``len(sequences[i]) - 2``.
    """
    return {i: values[b, prompt_lens[i] - 1 : len(sequences[i]) - 1].detach().double().numpy() for b, i in rows}

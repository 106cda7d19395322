"""What truncated sampling keeps: the top-k / top-p rule of the rollout engines as pure tensor functions, so that the
rollout's logprobs and the trainer's are compared under the same distribution.

    kept_log_mass(logits / T, top_p=0.8)                     # [N, R]: log of the probability mass sampling keeps
    sampler_logprobs(logits / T, response_ids, top_p=0.8)    # [N, R]: log-prob of each token as it was sampled

With `top_p < 1` (or a top-k) every engine samples from softmax(logits / T) cut to its kept set and renormalised: the
smallest set of most likely tokens whose mass reaches top_p, after the top-k cut (the rule of transformers'
`TopPLogitsWarper` and vLLM's `apply_top_k_top_p_pytorch`: ascending sort, drop while the cumulative mass <= 1 − p,
keep at least the most likely token). vLLM's `processed_logprobs` are that renormalised distribution's, so a sampled
token's logprob is log p(y) − log S, S the kept mass; the trainer's are under the full softmax, log p(y). Compared as
they are, every rollout-mismatch ratio is S (0.9 at top_p 0.8 on Qwen2.5-1.5B, trl#6789). The trainer
(`train/step.py`) adds log S of its own logits to the engine's logprobs (the engine's on the trainer's support) and the
hf engine returns `sampler_logprobs` (`rollout/hf.py`), so both sides agree and on-policy rows weigh 1; the GRPO
ratio itself stays under the full softmax (TRL's). A token outside the kept set (rounding at the boundary) gets
log p(y) − log S, finite, instead of −inf.
"""

from __future__ import annotations

import torch
from torch import Tensor

# positions sorted at once: [256, V] float32 values, int64 indices, the cumulative sums (~0.8 GB at V = 152k)
BLOCK_POSITIONS = 256


def cuts(top_p: float, top_k: int = 0) -> bool:
    """Whether sampling with this top_p / top_k (0: off) drops any token."""
    return top_p < 1.0 or top_k > 0


def kept_log_mass(logits: Tensor, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """log S per position: the softmax(logits) mass of the tokens top-k (0: off) then top-p keep. [..., V] -> [...]
    (at least float32; 0 where nothing is cut). `logits` are already divided by the temperature; no gradient."""
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    out_dtype = torch.promote_types(logits.dtype, torch.float32)
    if not cuts(top_p, top_k):
        return torch.zeros(shape, dtype=out_dtype, device=logits.device)
    flat = logits.detach().reshape(-1, vocab)  # [M, V]
    parts = []
    for start in range(0, flat.shape[0], BLOCK_POSITIONS):
        block = flat[start : start + BLOCK_POSITIONS].to(out_dtype)  # [b, V]
        kept = truncated_logits(block, top_p, top_k)  # [b, V]
        parts.append(torch.logsumexp(kept, dim=-1) - torch.logsumexp(block, dim=-1))  # [b]
    return torch.cat(parts).reshape(shape)


def truncated_logits(logits: Tensor, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """`logits` with every token that top-k (0: off) then top-p drop set to -inf, in vocabulary order: what the
    engines sample from (the hf engine's `decode` samples softmax of this). [B, V] -> [B, V]; `logits` itself when
    nothing is cut. Ties at the k-th largest logit are all kept, as in transformers' `TopKLogitsWarper`."""
    if not cuts(top_p, top_k):
        return logits
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)  # [B, V]
    if 0 < top_k < vocab:
        kth = ascending[:, vocab - top_k].unsqueeze(-1)  # [B, 1], the k-th largest logit
        ascending = ascending.masked_fill(ascending < kth, -torch.inf)
    if top_p < 1.0:
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
        dropped = cumulative <= 1.0 - top_p
        dropped[:, -1] = False  # the most likely token is always kept
        ascending = ascending.masked_fill(dropped, -torch.inf)
    return torch.empty_like(logits).scatter_(-1, order, ascending)  # back in vocabulary order


def sampler_logprobs(logits: Tensor, token_ids: Tensor, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """Log-prob of each token under the distribution it was sampled from: log softmax(logits)[id] − log S (see
    `kept_log_mass`). logits [N, T, V] (already / temperature), token_ids [N, T] -> [N, T], at least float32."""
    wide = logits.detach().to(torch.promote_types(logits.dtype, torch.float32))  # [N, T, V]
    full = wide.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(wide, dim=-1)  # [N, T]
    return full - kept_log_mass(wide, top_p, top_k)

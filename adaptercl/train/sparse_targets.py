"""What the hybrid method adds to GRPO: a sparse self-distillation target (docs/design.md §4, "Hybrid (ours)").

The hybrid loss is the GRPO loss plus λ (`hybrid.distill_weight`) × the distillation loss of `distill:` (support
`sampled` or `topk`, a frozen `base`/`stage_start` or a `trust_region` teacher; recipe/grammar.py refuses moving
teachers), on a sparse set of response tokens chosen by `hybrid.distill_on`:

- `failed_groups` (default): only samples of groups in which no sample succeeded (`domains.is_success`: the domain's
  correct decision for TRL-style rewards, reward >= distill.success_threshold for native ones; a sample every TRL
  function returned None for is no success) — exactly where GRPO has no signal (all advantages 0). Their teacher
  context cannot be a successful sibling, so it is the example's demonstration when it has one (shown as SDPO's
  "Correct solution") and/or the reward feedback (SDPO's feedback block); a sample with neither gets no target.
- `high_entropy`: the top `hybrid.entropy_top_q` fraction of all response tokens of the batch by the student's
  token entropy (at the rollout policy, before the update), among samples that have a teacher context.
- `all`: every response token of samples with a teacher context.
For `high_entropy` and `all`, a sample in a group with a success is shown the first successful sibling (as SDPO,
itself excluded); otherwise the demonstration and/or feedback as above. The stage's usual distillation mask
(skip_first_tokens, mask_ratio) applies on top. With λ = 0 the distillation term is not added at all, so a hybrid
stage then makes GRPO's update bit for bit (tests/train/test_regularizers.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from adaptercl.measure import token_chunk
from adaptercl.model import TokenBatch, decoder_and_head, response_hidden, response_logits
from adaptercl.recipe import RecipeError
from adaptercl.train.losses import token_entropy
from adaptercl.train.token_terms import ResponseScores


def top_entropy_mask(entropy: Tensor, mask: Tensor, top_q: float) -> Tensor:
    """The ceil(top_q · #tokens) highest-entropy tokens among mask > 0 (ties: the first found).

    entropy, mask: [N, R] -> [N, R] float 0/1."""
    flat_mask = mask.reshape(-1) > 0  # [N*R]
    n_tokens = int(flat_mask.sum())
    out = torch.zeros_like(mask, dtype=torch.float32).reshape(-1)  # [N*R]
    if n_tokens == 0:
        return out.view_as(mask)
    k = max(1, math.ceil(top_q * n_tokens))
    scores = torch.where(flat_mask, entropy.reshape(-1).to(out.dtype), torch.full_like(out, -math.inf))  # [N*R]
    out[torch.topk(scores, k).indices] = 1.0
    return out.view_as(mask).to(mask.dtype)


@torch.no_grad()
def rollout_entropy(model: torch.nn.Module, batch: TokenBatch, micro: int, temperature: float) -> Tensor:
    """Student token entropies [N, R] (CPU) at the current policy, in micro-batches of `micro` rows. A micro-batch's
    forward keeps its final hidden states [n_mb, R, H]; the full-vocabulary logits exist for one chunk of
    `measure.policy_divergence.token_chunk(V)` positions at a time ([c, V] float32: 64 MiB), never for the whole
    micro-batch (the memory plan's `plan.step_memory.entropy_pass_terms`). A model whose LM head is not a plain linear
    map (logit soft-capping, LoRA on lm_head: `model.base.decoder_and_head` refuses it) gives its full logits [n_mb, R,
    V]."""
    n, device = batch.input_ids.shape[0], next(model.parameters()).device
    parts = []
    for start in range(0, n, micro):
        mb = batch.select(slice(start, min(n, start + micro))).to(device)
        try:
            _, head = decoder_and_head(model)
        except RecipeError:
            parts.append(token_entropy(response_logits(model, mb, temperature=temperature)).cpu())  # [n_mb, R]
            continue
        scores = ResponseScores(hidden=response_hidden(model, mb), head=head, temperature=temperature)
        flat = scores.hidden.reshape(-1, scores.hidden.shape[-1])  # [n_mb * R, H]
        step = token_chunk(head.out_features)
        entropy = [token_entropy(scores.chunk_logits(flat[i : i + step])) for i in range(0, flat.shape[0], step)]
        parts.append(torch.cat(entropy).view(scores.hidden.shape[:2]).cpu())  # [c] each -> [n_mb, R]
    return torch.cat(parts)

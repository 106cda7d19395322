"""What the hybrid method adds to GRPO: a sparse self-distillation target (DESIGN.md §4, "Hybrid (ours)").

The hybrid loss is the GRPO loss plus λ (`hybrid.distill_weight`) × the distillation loss of `distill:` (support
`sampled` or `topk`, a frozen `base`/`stage_start` or a `trust_region` teacher; config.py refuses moving teachers),
on a sparse set of response tokens chosen by `hybrid.distill_on`:

- `failed_groups` (default): only samples of groups in which no sample succeeded (reward >= distill.success_threshold)
  — exactly where GRPO has no signal (all advantages 0). Their teacher context cannot be a successful sibling, so it
  is the example's demonstration when it has one (shown as SDPO's "Correct solution") and/or the reward feedback
  (SDPO's feedback block); a sample with neither gets no target.
- `high_entropy`: the top `hybrid.entropy_top_q` fraction of all response tokens of the batch by the student's
  token entropy (at the rollout policy, before the update), among samples that have a teacher context.
- `all`: every response token of samples with a teacher context.
For `high_entropy` and `all`, a sample in a group with a success is shown the first successful sibling (as SDPO,
itself excluded); otherwise the demonstration and/or feedback as above. The stage's usual distillation mask
(skip_first_tokens, mask_ratio) applies on top. With λ = 0 the distillation term is not added at all, so a hybrid
stage then makes GRPO's update bit for bit (tests/test_regularizers.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from adaptercl.batching import TokenBatch, response_logits
from adaptercl.losses import token_entropy
from adaptercl.method_config import DistillConfig
from adaptercl.teacher_prompts import TeacherPrompts, last_user_index, strip_think, with_last_user_turn


def hybrid_teacher_prompts(
    prompts: list[list[dict[str, str]]],
    responses: list[str],
    scores: list[float],
    feedbacks: list[str | None],
    demonstrations: list[str | None],
    group_size: int,
    cfg: DistillConfig,
    failed_groups_only: bool,
) -> TeacherPrompts:
    """Teacher prompts of N = P x G group-contiguous samples (see the module docstring)."""
    n = len(prompts)
    if not (len(responses) == len(scores) == len(feedbacks) == len(demonstrations) == n) or n % group_size:
        raise ValueError(f"hybrid_teacher_prompts: {n} prompts do not match the other lists or groups of {group_size}")
    succeeded = [s >= cfg.success_threshold for s in scores]
    out = TeacherPrompts([], [], [], [], succeeded)
    for i in range(n):
        start = (i // group_size) * group_size
        group_failed = not any(succeeded[start : start + group_size])
        allowed = group_failed or not failed_groups_only
        sibling = next((j for j in range(start, start + group_size) if j != i and succeeded[j]), None)
        solution_text = None
        if allowed and sibling is not None:
            solution_text = strip_think(responses[sibling]) if cfg.strip_think else responses[sibling]
        elif allowed and isinstance(demonstrations[i], str) and demonstrations[i].strip():
            solution_text = demonstrations[i]
        feedback = feedbacks[i]
        use_feedback = (
            allowed and sibling is None and cfg.use_feedback and bool(isinstance(feedback, str) and feedback.strip())
        )
        if solution_text is None and not use_feedback:
            out.append(prompts[i], has_target=False)
            continue
        solution = (
            "" if solution_text is None else cfg.solution_template.format(successful_previous_attempt=solution_text)
        )
        feedback_text = cfg.feedback_template.format(feedback_raw=feedback) if use_feedback else ""
        question = prompts[i][last_user_index(prompts[i])]["content"]
        reprompt = cfg.reprompt_template.format(prompt=question, solution=solution, feedback=feedback_text)
        out.append(with_last_user_turn(prompts[i], reprompt), True, sibling is not None, use_feedback)
    return out


def top_entropy_mask(entropy: Tensor, mask: Tensor, top_q: float) -> Tensor:
    """The ceil(top_q · #tokens) highest-entropy tokens among mask > 0 (ties: the first found).

    entropy, mask: [N, R] -> [N, R] float 0/1."""
    flat_mask = mask.reshape(-1) > 0  # [N*R]
    n_tokens = int(flat_mask.sum())
    out = torch.zeros_like(mask, dtype=torch.float32).reshape(-1)  # [N*R]
    if n_tokens == 0:
        return out.view_as(mask)
    k = max(1, math.ceil(top_q * n_tokens))
    scores = torch.where(flat_mask, entropy.reshape(-1).float(), torch.full_like(out, -math.inf))  # [N*R]
    out[torch.topk(scores, k).indices] = 1.0
    return out.view_as(mask).to(mask.dtype)


@torch.no_grad()
def rollout_entropy(model: torch.nn.Module, batch: TokenBatch, grad_accum: int, temperature: float) -> Tensor:
    """Student token entropies [N, R] (CPU) at the current policy, in `grad_accum` micro-batches."""
    n, device = batch.input_ids.shape[0], next(model.parameters()).device
    micro = math.ceil(n / grad_accum)
    parts = []
    for start in range(0, n, micro):
        mb = batch.select(slice(start, min(n, start + micro))).to(device)
        parts.append(token_entropy(response_logits(model, mb, temperature=temperature)).cpu())  # [n_mb, R]
    return torch.cat(parts)

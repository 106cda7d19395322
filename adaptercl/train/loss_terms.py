"""The terms of the training loss, as the training step (`step.py`) adds them: pure tensor functions, each
returning its per-token loss [N, T] and its per-token statistics {name: [N, T]} (logged as masked token means).

- `policy_term`: the clipped policy-gradient (GRPO/DAPO) token loss, with the truncated importance correction for
  rollouts from another engine and the optional k3 KL to a reference (added per token before aggregation, as TRL).
- `distill_term`: the distillation divergence (full / top-k / sampled support) times the detached importance
  weights (the SDPO code's correction for stale and off-engine rollouts); `weighted_distillation` is its second
  half, on a divergence already computed per token (the training step's path: `token_terms.token_terms`).
- The regularisers' terms are `losses.kl_to_previous` (per token, taken in `token_terms.token_terms`) and
  `StageRegularizers.parameter_loss` (per adapter).

A term is turned into the step's loss by `losses.micro_batch_aggregate` with the batch-global denominator of its
aggregation, so any `grad_accum` gives the same update. The TRL-equality tests (tests/train/test_losses.py) call
exactly `policy_term` and `micro_batch_aggregate`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from adaptercl.train.losses import (
    Support,
    clipped_policy_loss,
    distillation_divergence,
    gather_logprobs,
    importance_weights,
    k3_kl,
)


def policy_term(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    dual_clip: float | None = None,
    logp_rollout: Tensor | None = None,
    is_cap: float = 2.0,
    logp_ref: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's token loss [N, T] and its statistics.

    logp, logp_old [N, T]: the current and the rollout policy's log-probs of the sampled tokens (logp_old is logp
    detached on a single pass); advantages [N] or [N, T]. With `logp_rollout` [N, T] (the engine's own logprobs)
    the clipped loss is multiplied by min(exp(logp_old − logp_rollout), is_cap) (token-level truncated IS; under
    top-p sampling `logp_rollout` is already on the trainer's support: `step.py`). With `kl_coef` > 0,
    kl_coef · k3(logp, logp_ref) is added per token. Stats: `policy_loss` (after the IS factor, before the KL),
    `rollout_is_weight` (the IS factor, with `logp_rollout`), `kl_base` (when on), `clip_low_frac`,
    `clip_high_frac` (0/1 per token).
    """
    token_loss, clip_low, clip_high = clipped_policy_loss(
        logp, logp_old, advantages, epsilon_low, epsilon_high, dual_clip
    )  # [N, T]
    stats = {}
    if logp_rollout is not None:
        mismatch = torch.exp(logp_old - logp_rollout).clamp(max=is_cap)  # [N, T]
        token_loss = token_loss * mismatch
        stats["rollout_is_weight"] = mismatch.detach()
    stats.update(policy_loss=token_loss.detach(), clip_low_frac=clip_low.float(), clip_high_frac=clip_high.float())
    if kl_coef > 0:
        if logp_ref is None:
            raise ValueError("kl_coef > 0 needs logp_ref")
        kl = k3_kl(logp, logp_ref)  # [N, T]
        stats["kl_base"] = kl.detach()
        token_loss = token_loss + kl_coef * kl
    return token_loss, stats


def distill_term(
    student_logits: Tensor,
    teacher_logits: Tensor,
    logp: Tensor,
    logp_old: Tensor,
    response_ids: Tensor,
    alpha: float,
    support: Support = "full",
    topk: int = 100,
    tail: bool = True,
    is_cap: float = 2.0,
    logp_rollout: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Distillation token loss [N, T] = divergence(student, teacher) · min(ρ, cap) (detached), and its statistics.

    student_logits, teacher_logits [N, T, V] (already / temperature); logp, logp_old, response_ids [N, T]. Stats:
    `teacher_divergence` (the per-token divergence; for `sampled` support, whose loss value is a surrogate, the
    estimate log p(y) − log q(y)) and `is_weight_mean` (the importance weight).
    """
    per_token = distillation_divergence(
        student_logits, teacher_logits, alpha, support, topk, tail, response_ids
    )  # [N, T]
    with torch.no_grad():
        teacher_logp = gather_logprobs(teacher_logits, response_ids) if support == "sampled" else None
    return weighted_distillation(per_token, logp, logp_old, teacher_logp, is_cap, logp_rollout)


def weighted_distillation(
    divergence: Tensor,
    logp: Tensor,
    logp_old: Tensor,
    teacher_logp: Tensor | None = None,
    is_cap: float = 2.0,
    logp_rollout: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`distill_term` from its per-token divergence [N, T]: divergence · min(ρ, cap) (detached) and the statistics.

    teacher_logp [N, T]: the teacher's log-probs of the sampled tokens for `sampled` support (whose divergence is a
    surrogate; its logged `teacher_divergence` is then log p(y) − log q(y)), None for the other supports."""
    weight = importance_weights(logp, logp_old, logp_rollout, is_cap)  # [N, T]
    with torch.no_grad():
        logged = divergence if teacher_logp is None else logp - teacher_logp
    return divergence * weight, {"teacher_divergence": logged.detach(), "is_weight_mean": weight}

"""Loss math for every training method: pure tensor functions, no models, files or config.

What lives here (shapes: N sequences = prompts x group size, T response positions, V vocabulary):

- GRPO: `group_advantages`, `zero_variance_group_fraction`, `clipped_policy_loss`, `k3_kl`.
- Aggregation: `aggregate` (token values -> one number), `micro_batch_aggregate` (a micro-batch's share of it) and
  `aggregate_denominator` (what it divides by; summed over data-parallel ranks).
- SDPO / SDFT distillation: `distillation_divergence` (full / top-k / sampled-token support), `importance_weights`,
  `distillation_token_mask` (the trust-region teacher's mixture of logits is the teacher's: `teacher/kinds.py`).
- Shared pieces: `gather_logprobs`, `token_entropy`.

The loss terms the training step adds are composed from these in `loss_terms.py`.

Typical use in a stage::

    logp = gather_logprobs(student_logits, response_ids)                              # [N, T]
    token_loss, low, high = clipped_policy_loss(logp, logp_old, advantages)           # [N, T]
    loss = aggregate(token_loss, response_mask, "token_mean")                         # []

    per_token = distillation_divergence(student_logits / temp, teacher_logits / temp, alpha=0.5)   # [N, T]
    weight = importance_weights(logp, logp_old)                                       # [N, T], detached
    loss = aggregate(per_token * weight, distillation_token_mask(response_mask, 0.5), "token_mean")

Conventions and where they come from or depart from the references:

- Divergence convention: α=0 forward KL(q‖p) (teacher q, student p), α=1 reverse KL(p‖q), otherwise
  m = (1-α)p + αq and L = α·KL(q‖m) + (1-α)·KL(p‖m). Matched line for line (mixture via logsumexp, `lerp`) to
  lasgroup/SDPO `verl/trainer/ppo/core_algos.py::compute_self_distillation_loss` (commit 842fc21) and TRL 1.16
  `trl/experimental/{sdpo,sdft}/loss_utils.py::compute_divergence` (the SDPO and SDFT copies are identical); the
  tests check equality with TRL's functions. The original SDFT repo was not in our code index, so its convention is
  taken from docs/design.md §4 and TRL's SDFT port. One stored lasgroup/SDPO revision (229d137) special-cases α=0.25
  and α=0.75 to Rényi divergences; we do not. Note the family is not continuous in scale at the ends: as α→0 the
  JSD branch tends to α·KL(q‖p), not KL(q‖p), so α=0.01 gives a loss ~100x smaller than α=0.
- Top-k support uses the *student's* top-k indices with a tail bucket (as SDPO/TRL). Without the tail both
  distributions are renormalised over the k indices (a KL of the conditionals, never negative — unlike top-k
  without renormalisation, verl #7855).
- Divergences, log-probs and entropies are computed in at least float32 whatever the logits' dtype (bf16
  log-softmax loses too much); the references compute in the input dtype. Full-vocab divergences hold several
  [N, T, V] float32 temporaries: the caller should chunk over N if that is too much.
- The teacher is detached inside `distillation_divergence`; gradients reach the student logits only.
- `clipped_policy_loss` clamps log ρ to [-20, 20] before exp (as verl/SDPO; TRL does not) so an extreme token gives a
  finite loss. Its clip masks follow TRL: low = ρ < 1-ε_low with A<0, high = ρ > 1+ε_high with A>0 (the tokens whose
  gradient the clip removes); tokens stopped by the dual clip are in neither.
- `aggregate(..., "seq_mean_token_mean")` leaves sequences with no unmasked token out of the denominator (verl
  `agg_loss`). `"seq_mean_token_mean_all"` counts them as 0 over all N sequences: Σ_i mean_t(v_i) / N, the
  distillation loss of every reference: lasgroup/SDPO in effect (its `verl/trainer/config/user.yaml` sets
  `ppo_micro_batch_size_per_gpu: 1`, so each one-sequence micro-batch's `token-mean` is that sequence's token mean,
  0 without a target, scaled by 1/`gradient_accumulation` in `dp_actor.py`), and TRL 1.16's SDPO/SDFT trainers
  (`(l·m).sum(-1) / m.sum(-1).clamp(min=1)` then `.mean()` over all sequences,
  `trl/experimental/sdpo/sdpo_trainer.py:1252`, `sdft/sdft_trainer.py:890`), as TRL's GRPO `loss_type="grpo"`.
  With it the distillation gradient shrinks in proportion to the fraction of samples that have a teacher target;
  with `seq_mean_token_mean` (and `token_mean`) it does not. The two agree whenever every sequence has a token.
- `seq_mean_token_sum_norm` is mean over sequences of Σ_t v·m / max_len, as TRL's `dr_grpo`; verl's variant sums
  over sequences instead of averaging (a constant factor N).
- `group_advantages` with `scale_by_std` uses the Bessel-corrected group std and ε=1e-4, as TRL's `scale_rewards=
  "group"`; unscored samples (every TRL reward function returned None) are left out of the group's statistics with
  advantage 0, as TRL 1.16.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_mean_all", "seq_mean_token_sum_norm"]
Support = Literal["full", "topk", "sampled"]

AGGREGATIONS: tuple[str, ...] = Aggregation.__args__
SUPPORTS: tuple[str, ...] = ("full", "topk", "sampled")


def _upcast(x: Tensor) -> Tensor:
    """float16/bfloat16 -> float32; float32/float64 unchanged (tests run in float64)."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


# --------------------------------------------------------------------------------------------------------- GRPO


def group_advantages(
    rewards: Tensor, group_size: int, scale_by_std: bool = False, eps: float = 1e-4, scored: Tensor | None = None
) -> Tensor:
    """A_i = r_i - mean_group(r) (Dr.GRPO), optionally ÷ (std_group + eps). `rewards` [N] is group-contiguous.

    `scored` [N] bool (None: all): a sample that is not scored (every TRL reward function returned None) is left
    out of its group's mean and std and gets advantage 0, as TRL 1.16's GRPOTrainer (its reward NaN, nanmean,
    nanstd, then nan_to_num); a group with fewer than two scored samples has advantage 0 throughout. A NaN reward
    of a scored sample still gives NaN advantages (the collapse guard's non-finite step)."""
    if group_size < 1 or rewards.ndim != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} cannot be split into groups of {group_size}")
    grouped = (_upcast(rewards) if rewards.is_floating_point() else rewards.float()).view(-1, group_size)  # [P, G]
    if scored is not None and not bool(scored.all()):
        return _partly_scored_advantages(grouped, scored.view(-1, group_size), scale_by_std, eps).view(-1)  # [N]
    advantages = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    if scale_by_std:
        # A group of one has no spread; correction=0 gives std 0 (advantage is 0 anyway) instead of NaN.
        std = grouped.std(dim=1, keepdim=True, correction=1 if group_size > 1 else 0)  # [P, 1]
        advantages = advantages / (std + eps)
    return advantages.view(-1)  # [N]


def _partly_scored_advantages(grouped: Tensor, scored: Tensor, scale_by_std: bool, eps: float) -> Tensor:
    """`group_advantages` over the scored samples only. grouped [P, G] float, scored [P, G] bool -> [P, G]."""
    count = scored.sum(dim=1, keepdim=True)  # [P, 1]
    kept = torch.where(scored, grouped, torch.zeros_like(grouped))  # [P, G]
    mean = kept.sum(dim=1, keepdim=True) / count.clamp(min=1)  # [P, 1]
    advantages = torch.where(scored, grouped - mean, torch.zeros_like(grouped))  # [P, G]
    if scale_by_std:
        # Bessel-corrected std over the scored samples (TRL's nanstd); fewer than two: TRL's NaN -> advantage 0.
        var = (advantages**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)  # [P, 1]
        advantages = torch.where(count > 1, advantages / (var.sqrt() + eps), torch.zeros_like(advantages))
    return advantages


def zero_variance_group_fraction(rewards: Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all equal (they carry no GRPO signal)."""
    grouped = rewards.view(-1, group_size)  # [P, G]
    return (grouped.amax(dim=1) == grouped.amin(dim=1)).float().mean().item()


def clipped_policy_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO/GRPO token loss max(-A·ρ, -A·clip(ρ, 1-ε_low, 1+ε_high)), ρ = exp(logp - logp_old).

    With `dual_clip` c (> 1) the loss of tokens with A<0 is further capped at -A·c. Returns the token loss [N, T]
    and the boolean masks of tokens clipped at the low and the high side [N, T] (see module docstring).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    adv = advantages.unsqueeze(-1) if advantages.ndim == 1 else advantages  # [N, 1] or [N, T]
    ratio = torch.exp(torch.clamp(logp - logp_old, -20.0, 20.0))  # [N, T]
    unclipped = -adv * ratio  # [N, T]
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # [N, T]
    token_loss = torch.maximum(unclipped, clipped)  # [N, T]
    if dual_clip is not None:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -adv * dual_clip), token_loss)
    ratio = ratio.detach()
    clipped_low = (ratio < 1.0 - eps_low) & (adv < 0)  # [N, T]
    clipped_high = (ratio > 1.0 + eps_high) & (adv > 0)  # [N, T]
    return token_loss, clipped_low, clipped_high


def k3_kl(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(π‖π_ref) per token: exp(ref - logp) - (ref - logp) - 1. [N, T]"""
    delta = logp_ref - logp  # [N, T]
    return torch.exp(delta) - delta - 1.0


def aggregate(token_values: Tensor, mask: Tensor, mode: Aggregation, max_len: int | None = None) -> Tensor:
    """Reduce token values [N, T] under a (0/1 or weight) mask [N, T] to a scalar.

    - token_mean: Σ v·m / Σ m over the whole batch (DAPO).
    - seq_mean_token_mean: per-sequence masked mean, then mean over sequences that have any mask; 0 if none has.
    - seq_mean_token_mean_all: per-sequence masked mean, then mean over all N sequences, a sequence without any
      mask counting 0 (SDPO/SDFT references, TRL `loss_type="grpo"`).
    - seq_mean_token_sum_norm: mean over all N sequences of Σ_t v·m / max_len (Dr.GRPO); max_len defaults to T.
    """
    mask = mask.to(token_values.dtype)
    masked_sum = token_values * mask  # [N, T]
    if mode == "token_mean":
        return masked_sum.sum() / mask.sum().clamp(min=1.0)
    if mode == "seq_mean_token_mean":
        tokens_per_seq = mask.sum(dim=-1)  # [N]
        seq_means = masked_sum.sum(dim=-1) / tokens_per_seq.clamp(min=1e-8)  # [N]
        has_tokens = (tokens_per_seq > 0).to(token_values.dtype)  # [N]
        return (seq_means * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    if mode == "seq_mean_token_mean_all":
        seq_means = masked_sum.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1e-8)  # [N], 0 where no token
        return seq_means.mean()
    if mode == "seq_mean_token_sum_norm":
        norm = token_values.shape[-1] if max_len is None else max_len
        return masked_sum.sum(dim=-1).mean() / norm
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")


def micro_batch_aggregate(
    token_values: Tensor,
    mask: Tensor,
    batch_mask: Tensor,
    mode: Aggregation,
    max_len: int | None = None,
    denominator: Tensor | None = None,
) -> Tensor:
    """A micro-batch's share of the whole batch's aggregated loss: summed over the micro-batches of a batch, these
    give `aggregate` of the whole batch, so any `grad_accum` makes the same update.

    token_values, mask [n, T] are the micro-batch's rows; batch_mask [N, T] is the whole batch's mask (its global
    denominator: tokens, sequences with a token, or sequences). With batch_mask = mask it is `aggregate` itself.
    `denominator` overrides `aggregate_denominator(batch_mask, mode)` when the batch spans more rows than this
    process holds (data-parallel ranks: the sum of every rank's denominator, `system/distributed.py`).
    """
    return micro_batch_share(mask, batch_mask, mode, denominator) * aggregate(token_values, mask, mode, max_len)


def micro_batch_share(
    mask: Tensor, batch_mask: Tensor, mode: Aggregation, denominator: Tensor | None = None
) -> Tensor:
    """Factor on a micro-batch's aggregated loss such that the micro-batch terms sum to the whole batch's loss."""
    total = aggregate_denominator(batch_mask, mode) if denominator is None else denominator
    return aggregate_denominator(mask, mode) / total.clamp(min=1)


def aggregate_denominator(mask: Tensor, mode: Aggregation) -> Tensor:
    """What `aggregate` divides by over the rows of `mask` [N, T]: tokens (token_mean), sequences with a token
    (seq_mean_token_mean) or sequences (the other modes). Additive over disjoint sets of rows, so a batch split
    over processes has the sum of theirs."""
    if mode == "token_mean":
        return mask.sum()
    if mode == "seq_mean_token_mean":  # sequences without a token are left out of the mean (see `aggregate`)
        return (mask.sum(-1) > 0).sum()
    # seq_mean_token_mean_all, seq_mean_token_sum_norm: mean over all sequences, those without a token included
    return torch.tensor(float(mask.shape[0]), device=mask.device)


# ------------------------------------------------------------------------------------------ per-token quantities


def gather_logprobs(logits: Tensor, token_ids: Tensor) -> Tensor:
    """log softmax(logits)[token_ids], one sequence at a time to keep peak memory at one [T, V] row. [N, T]"""
    rows = []
    for row_logits, row_ids in zip(logits, token_ids, strict=True):  # [T, V], [T]
        # at least float32: bf16 logsumexp loses the small differences that matter for ratios.
        row_logits = _upcast(row_logits)
        selected = row_logits.gather(-1, row_ids.unsqueeze(-1)).squeeze(-1)  # [T]
        rows.append(selected - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)  # [N, T]


def token_entropy(logits: Tensor, chunk_size: int = 256) -> Tensor:
    """Shannon entropy (nats) of softmax(logits) per position, in chunks of rows. [N, T, V] -> [N, T]"""
    flat = logits.reshape(-1, logits.shape[-1])  # [N*T, V]
    parts = []
    for chunk in flat.split(chunk_size, dim=0):
        logp = F.log_softmax(_upcast(chunk), dim=-1)  # [C, V]
        parts.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(parts).reshape(logits.shape[:-1])  # [N, T]


# --------------------------------------------------------------------------------------------- distillation


def _divergence(student_logp: Tensor, teacher_logp: Tensor, alpha: float) -> Tensor:
    """α-family divergence between normalised log-distributions over the last dim [..., K] -> [...]."""
    if alpha == 0.0:  # forward KL(q‖p)
        kl = F.kl_div(student_logp, teacher_logp, reduction="none", log_target=True)
    elif alpha == 1.0:  # reverse KL(p‖q)
        kl = F.kl_div(teacher_logp, student_logp, reduction="none", log_target=True)
    else:
        alpha_t = torch.tensor(alpha, dtype=student_logp.dtype, device=student_logp.device)
        mixture_logp = torch.logsumexp(
            torch.stack([student_logp + torch.log1p(-alpha_t), teacher_logp + torch.log(alpha_t)]), dim=0
        )  # log m, m = (1-α)p + αq
        kl_teacher = F.kl_div(mixture_logp, teacher_logp, reduction="none", log_target=True)  # KL(q‖m) terms
        kl_student = F.kl_div(mixture_logp, student_logp, reduction="none", log_target=True)  # KL(p‖m) terms
        kl = torch.lerp(kl_student, kl_teacher, alpha)  # (1-α)·KL(p‖m) + α·KL(q‖m)
    return kl.sum(-1)


def _with_tail_bucket(topk_logp: Tensor) -> Tensor:
    """Append log(1 - Σ_k p) so k log-probs [..., k] become a distribution over k+1 categories [..., k+1]."""
    captured = torch.logsumexp(topk_logp, dim=-1, keepdim=True).clamp(max=-1e-7)  # log Σ_k p, kept < 0
    return torch.cat([topk_logp, torch.log(-torch.expm1(captured))], dim=-1)


def distillation_divergence(
    student_logits: Tensor,
    teacher_logits: Tensor,
    alpha: float,
    support: Support = "full",
    topk: int = 100,
    tail: bool = True,
    sampled_ids: Tensor | None = None,
) -> Tensor:
    """Per-token distillation loss [N, T] between student p and teacher q given logits [N, T, V].

    Logits must already be divided by the temperature. The teacher is detached. Supports:
    - full: the α-divergence over the whole vocabulary;
    - topk: over the student's top-k tokens (teacher gathered there), plus a tail bucket (`tail=True`) or with both
      renormalised over the k tokens (`tail=False`); k is capped at V;
    - sampled: reverse KL only (α must be 1), ℓ_t = (log p(y_t) - log q(y_t)).detach() · log p(y_t) at
      `sampled_ids` [N, T]. Its value is not a divergence; its gradient is an unbiased estimate of ∇KL(p‖q) when
      y_t ~ p.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    teacher_logits = teacher_logits.detach()
    if support == "full":
        student_logp = F.log_softmax(_upcast(student_logits), dim=-1)  # [N, T, V]
        teacher_logp = F.log_softmax(_upcast(teacher_logits), dim=-1)  # [N, T, V]
        return _divergence(student_logp, teacher_logp, alpha)  # [N, T]
    if support == "topk":
        k = min(topk, student_logits.shape[-1])
        student_logits = _upcast(student_logits)
        teacher_logits = _upcast(teacher_logits)
        top_logits, top_ids = torch.topk(student_logits, k=k, dim=-1)  # [N, T, k]
        student_logp = top_logits - torch.logsumexp(student_logits, dim=-1, keepdim=True)  # [N, T, k]
        teacher_logp = teacher_logits.gather(-1, top_ids) - torch.logsumexp(teacher_logits, dim=-1, keepdim=True)
        if tail:
            student_logp = _with_tail_bucket(student_logp)  # [N, T, k+1]
            teacher_logp = _with_tail_bucket(teacher_logp)  # [N, T, k+1]
        else:
            student_logp = student_logp - torch.logsumexp(student_logp, dim=-1, keepdim=True)  # [N, T, k]
            teacher_logp = teacher_logp - torch.logsumexp(teacher_logp, dim=-1, keepdim=True)  # [N, T, k]
        return _divergence(student_logp, teacher_logp, alpha)  # [N, T]
    if support == "sampled":
        if alpha != 1.0:
            raise ValueError(f"support='sampled' supports only reverse KL (alpha=1), got alpha={alpha}")
        if sampled_ids is None:
            raise ValueError("support='sampled' needs sampled_ids")
        student_token_logp = gather_logprobs(student_logits, sampled_ids)  # [N, T]
        teacher_token_logp = gather_logprobs(teacher_logits, sampled_ids)  # [N, T]
        return (student_token_logp - teacher_token_logp).detach() * student_token_logp  # [N, T]
    raise ValueError(f"unknown support {support!r}; choose one of {SUPPORTS}")


def importance_weights(logp: Tensor, logp_old: Tensor, logp_rollout: Tensor | None = None, cap: float = 2.0) -> Tensor:
    """Detached per-token weight min(ρ, cap), ρ = exp(logp - logp_old), times min(exp(logp_old - logp_rollout), cap)
    when the rollout engine's logprobs are given (engine/trainer mismatch). [N, T]"""
    weight = torch.exp(torch.clamp(logp - logp_old, -20.0, 20.0)).clamp(max=cap)  # [N, T]
    if logp_rollout is not None:
        weight = weight * torch.exp(torch.clamp(logp_old - logp_rollout, -20.0, 20.0)).clamp(max=cap)
    return weight.detach()


def distillation_token_mask(
    response_mask: Tensor,
    mask_ratio: float = 0.0,
    skip_first: int = 0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Float mask [N, T] of response tokens that get a distillation loss.

    The first `skip_first` response tokens of each sequence are dropped (SDFT skips 3), counted along the mask so any
    padding side works; every other response token is dropped independently with probability `mask_ratio` (the
    SDPO-CL density knob). Kept tokens are not rescaled: `aggregate` normalises by the kept count.
    """
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
    mask = response_mask.float()  # [N, T]
    if skip_first > 0:
        position = torch.cumsum(mask, dim=-1)  # [N, T], 1-based index among response tokens
        mask = mask * (position > skip_first).float()
    if mask_ratio > 0.0:
        keep = torch.rand(mask.shape, generator=generator, device=mask.device) >= mask_ratio  # [N, T]
        mask = mask * keep.float()
    return mask


def kl_to_previous(logits: Tensor, prev_logits: Tensor) -> Tensor:
    """KL(p ‖ q) per token over the full vocabulary; p = softmax(logits) (gradient), q from prev_logits (none).

    logits, prev_logits: [N, R, V] -> [N, R]."""
    logp = torch.log_softmax(_upcast(logits), dim=-1)  # [N, R, V]
    logq = torch.log_softmax(_upcast(prev_logits.detach()), dim=-1)  # [N, R, V]
    return (logp.exp() * (logp - logq)).sum(-1)  # [N, R]

"""What SRPO (Sample-Routed Policy Optimization, arXiv 2604.02288; docs/design.md §4a) adds to GRPO and SDPO.

Each rollout goes to exactly one term. A wrong rollout with a correct sibling (z^S = 1, `teacher.prompts.srpo_routes`;
"correct" is `domains.is_success`, SDPO's own success decision) goes to the SDPO term, its teacher shown that sibling;
every other rollout goes to the GRPO term with the usual group advantages over all G rollouts (a success in a mixed
group is pushed up, an all-wrong group has advantage 0). No mixing coefficient and no advantage blending: the paper's
losing control "advantage mix" is a different method. The step's loss, over the whole batch's response tokens:

    L = [Σ_{i,t} z^G_i ℓ^GRPO_{i,t} + Σ_{i,t} z^S_i w_{i,t} ℓ^SDPO_{i,t}] / [Σ_{i,t} z^G_i + Σ_{i,t} z^S_i]

one shared denominator over every micro-batch and every data-parallel rank (summed over ranks, as
`losses.aggregate_denominator`); ℓ^GRPO is `loss_terms.policy_term`, ℓ^SDPO the reference SDPO token term
(`loss_terms.weighted_distillation`: the `distill` divergence times the capped importance weight) and w the DW-SDPO
weight:

    H_{i,t} = -Σ_v q log q     the teacher's entropy over the full vocabulary (`teacher_entropy`, chunks of positions)
    w̃ = exp(-β·H),  w = w̃ / mean(w̃ over every SDPO token of the batch)     β = srpo.entropy_beta (0: w = 1)

`routed_step` prepares what the loss needs before the step's first backward (the normaliser of w is a mean over the
whole batch, so every SDPO row's teacher entropy must be known first). It runs the teacher once per step and only on
the SDPO-routed rows (the method's compute saving: a step without SDPO rows runs no teacher forward at all), grouped
as the training micro-batches group them, and keeps the teacher's final hidden states [n_t, R, H] rather than its
[n_t, R, V] logits; the micro-batch loop computes the logits from them (all at once, or a chunk of positions at a
time under `optim.logits_chunk_size`), as a teacher forward there would (`chunked_logits.ResponseScores`). The
teacher does not change during a step, so this one forward serves every pass of `grpo.iterations`.

Logged with every step (metrics.jsonl): `sdpo_route_frac` and `all_wrong_group_frac` (the share of groups without a
correct rollout; both from `distill_targets`), `teacher_rows` (the rows the teacher forward ran on, whole batch: the
compute it costs), and over the batch's SDPO tokens `teacher_entropy_mean`, `dw_weight_min`, `dw_weight_max` (absent
on a step without one, as the other distillation statistics).

Departures, both inactive at the defaults: the SDPO tokens are those of `DistillTargets.mask` (the response tokens
less `distill.skip_first_tokens` and the `distill.mask_ratio` draw, both 0 for srpo as in the paper); a
`grpo.kl_coef` KL is part of ℓ^GRPO, so it acts on the GRPO-routed rows only. A third-party reproduction saw format
collapse after ~400 steps: the collapse guard (`monitor`) stays on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from adaptercl.model import TokenBatch
from adaptercl.system import distributed
from adaptercl.train.context import StageContext
from adaptercl.train.distill_targets import DistillTargets
from adaptercl.train.losses import token_entropy
from adaptercl.train.micro_batch_rows import Rows, cut
from adaptercl.train.token_terms import ResponseScores

ENTROPY_CHUNK = 256  # positions per chunk of the teacher-entropy logits when the step itself keeps full logits


def teacher_entropy(scores: ResponseScores, chunk_size: int) -> Tensor:
    """Entropy (nats) of softmax over the full vocabulary at each response position, from `chunk_size` positions'
    logits [n, c, V] at a time: full logits [n, R, V], or hidden states [n, R, H] and the LM head. -> [n, R]"""
    source = scores.logits if scores.logits is not None else scores.hidden  # [n, R, V] or [n, R, H]
    parts = []
    for start in range(0, source.shape[1], chunk_size):
        chunk = source[:, start : start + chunk_size]
        logits = chunk if scores.logits is not None else scores.chunk_logits(chunk)  # [n, c, V]
        parts.append(token_entropy(logits))  # [n, c]
    return torch.cat(parts, dim=1)


def unnormalised_weights(entropy: Tensor, beta: float) -> Tensor:
    """w̃ = exp(-β·H) per token. [n, R] -> [n, R]"""
    return torch.exp(-beta * entropy)


@dataclass
class RoutedStep:
    """The SRPO inputs of one batch of N rows split into micro-batches (index k), known before the first backward.
    Micro-batch k is R'_k columns wide: its rows' longest response (`micro_batch_rows.cut`)."""

    grpo_mask: Tensor  # [N, R] response tokens of the GRPO-routed rows (z^G)
    sdpo_rows: list[Tensor]  # per micro-batch: [n_t] indices, within it, of its SDPO-routed rows
    teacher: list[ResponseScores | None]  # per micro-batch: the teacher's hidden states on those rows [n_t, R'_k, H]
    weights: list[Tensor | None]  # per micro-batch: the DW-SDPO weights w of those rows [n_t, R'_k]
    denominator: Tensor  # []: Σ z^G tokens + Σ z^S tokens of the whole batch, all ranks
    grpo_tokens: Tensor  # []: Σ z^G tokens, all ranks
    sdpo_tokens: Tensor  # []: Σ z^S tokens, all ranks
    stats: dict[str, float]  # the whole batch's: teacher_rows, teacher_entropy_mean, dw_weight_min/max

    def teacher_scores(self, k: int, chunk_size: int | None) -> ResponseScores | None:
        """Micro-batch k's teacher scores as `token_terms.token_terms` takes them: the hidden states under
        chunking, else the full logits [n_t, R, V] computed from them (None: no SDPO row in it)."""
        scores = self.teacher[k]
        if scores is None or chunk_size is not None:
            return scores
        return ResponseScores(logits=scores.chunk_logits(scores.hidden))


@torch.no_grad()
def routed_step(
    ctx: StageContext, batch: TokenBatch, targets: DistillTargets, parts: list[Rows], chunk_size: int | None
) -> RoutedStep:
    """The teacher's forward on the SDPO-routed rows (`targets.has_target`), their entropies and DW-SDPO weights,
    and the shared denominator, for `batch` [N, P+R] in the training step's micro-batches `parts` (their rows,
    `micro_batch_rows`), each cut to its rows' longest response as the step cuts it (see the module docstring)."""
    stage = ctx.stage
    device = batch.response_mask.device
    routed = torch.tensor(targets.has_target, dtype=torch.bool, device=device)  # [N] z^S
    grpo_mask = batch.response_mask * (~routed).unsqueeze(-1).to(batch.response_mask.dtype)  # [N, R]
    sdpo_rows, teacher, raw, extremes = [], [], [], []
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # Σ w̃·m, Σ H·m, Σ m (SDPO), Σ z^G tokens, rows
    sums[3] = grpo_mask.sum()
    for rows in parts:
        width = cut(batch, rows, len(parts)).response_ids.shape[1]  # R', the step's micro-batch
        target_rows = routed[rows].nonzero().squeeze(-1)  # [n_t]
        sdpo_rows.append(target_rows)
        if target_rows.numel() == 0:
            teacher.append(None)
            raw.append(None)
            continue
        teacher_mb = cut(targets.teacher_batch.select(rows), target_rows, len(parts), width)
        # any chunk size asks for the hidden states [n_t, R', H] (never [n_t, R', V] logits for the whole step)
        scores = ctx.teacher.scores(ctx.model, teacher_mb, stage.rollout.temperature, chunk_size or width)
        entropy = teacher_entropy(scores, chunk_size or ENTROPY_CHUNK)  # [n_t, R']
        weight = unnormalised_weights(entropy, stage.srpo.entropy_beta)  # [n_t, R']
        mask = targets.mask[rows][target_rows][:, :width]  # [n_t, R']
        sums += torch.stack([(weight * mask).sum(), (entropy * mask).sum(), mask.sum(), sums.new_zeros(()),
                             sums.new_tensor(float(target_rows.numel()))]).to(sums.dtype)  # fmt: skip
        if mask.sum() > 0:
            valid = weight[mask > 0]
            extremes.append((valid.min().item(), valid.max().item()))
        teacher.append(scores)
        raw.append(weight)
    weight_sum, entropy_sum, sdpo_tokens, grpo_tokens, teacher_rows = distributed.all_reduce_sum(sums).tolist()
    mean = weight_sum / sdpo_tokens if sdpo_tokens > 0 else 1.0
    weights = [None if w is None else w / mean for w in raw]
    stats = {"teacher_rows": teacher_rows}
    if sdpo_tokens > 0:
        extremes = [e for rank in distributed.all_gather_objects(extremes) for e in rank]
        stats["teacher_entropy_mean"] = entropy_sum / sdpo_tokens
        stats["dw_weight_min"] = min(lo for lo, _ in extremes) / mean
        stats["dw_weight_max"] = max(hi for _, hi in extremes) / mean
    dtype = batch.response_mask.dtype
    return RoutedStep(
        grpo_mask=grpo_mask,
        sdpo_rows=sdpo_rows,
        teacher=teacher,
        weights=weights,
        denominator=torch.tensor(grpo_tokens + sdpo_tokens, dtype=dtype, device=device),
        grpo_tokens=torch.tensor(grpo_tokens, dtype=dtype, device=device),
        sdpo_tokens=torch.tensor(sdpo_tokens, dtype=dtype, device=device),
        stats=stats,
    )

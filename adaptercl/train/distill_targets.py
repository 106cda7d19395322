"""The distillation inputs of one step: teacher prompts (SDPO reprompts, SDFT demonstrations, the hybrid's sparse
choice or SRPO's routing) on the very same sampled responses, and the token mask that gets a distillation loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptercl.domains import Example, RewardResult, is_success
from adaptercl.model import TokenBatch, build_batch, encode_chat
from adaptercl.recipe import METHODS
from adaptercl.rollout import Completion
from adaptercl.teacher import TEACHER_PROMPTS, srpo_route_stats
from adaptercl.train import losses
from adaptercl.train.context import StageContext, step_seed
from adaptercl.train.sparse_targets import rollout_entropy, top_entropy_mask


@dataclass
class DistillTargets:
    """What the distillation loss of one batch needs besides the student batch."""

    teacher_batch: TokenBatch  # [N, P_T+R]: teacher prompts, then the very same response tokens
    mask: torch.Tensor  # [N, R] float: response tokens that get a distillation loss
    stats: dict[str, float]
    has_target: list[bool]  # [N] whether the sample has a teacher context (run_dir/samples.py keeps it; srpo: z^S)

    def to(self, device: torch.device) -> DistillTargets:
        return DistillTargets(self.teacher_batch.to(device), self.mask.to(device), self.stats, self.has_target)


def distill_targets(
    ctx: StageContext,
    step: int,
    samples: list[Example],
    completions: list[Completion],
    results: list[RewardResult],
    batch: TokenBatch,
) -> DistillTargets:
    """Teacher prompts (the method's builder, `teacher.prompts.TEACHER_PROMPTS`) and the distillation token mask of
    one step.

    The mask is the response mask, minus the first `distill.skip_first_tokens` tokens, minus a seeded random
    `distill.mask_ratio` share, times 0 for samples without a teacher context. Drawn once per step for the
    whole batch, so micro-batching cannot change it and a resumed stage draws the same one.
    """
    stage, tok, cfg = ctx.stage, ctx.tokenizer, ctx.stage.distill
    spec = METHODS[stage.method]
    teacher_prompts = TEACHER_PROMPTS[stage.method](
        [ex.messages for ex in samples],
        [c.text for c in completions],
        [is_success(r, cfg.success_threshold) for r in results],
        [r.feedback for r in results],
        [ex.demonstration for ex in samples],
        stage.rollout.group_size,
        cfg,
        stage.hybrid,
    )
    teacher_batch = build_batch(
        [encode_chat(tok, m) for m in teacher_prompts.messages],
        [c.token_ids for c in completions],
        tok.pad_token_id,
    )
    generator = torch.Generator().manual_seed(step_seed(ctx.recipe.seed, ctx.index, 2_000_000 + step))
    mask = losses.distillation_token_mask(
        batch.response_mask, cfg.mask_ratio, cfg.skip_first_tokens, generator=generator
    )  # [N, R]
    mask = mask * torch.tensor(teacher_prompts.has_target, dtype=mask.dtype).unsqueeze(-1)
    if spec.entropy_pass(stage.hybrid):
        micro = ctx.micro_rows(batch.input_ids.shape[0])
        entropy = rollout_entropy(ctx.model, batch, micro, stage.rollout.temperature)  # [N, R]
        mask = top_entropy_mask(entropy, mask, stage.hybrid.entropy_top_q)  # [N, R]
    stats = {
        **teacher_prompts.stats(),
        "distill_token_frac": (mask.sum() / batch.response_mask.sum().clamp(min=1.0)).item(),
    }
    if spec.sample_routed:  # srpo: a sample has a teacher target exactly when it is routed to SDPO
        group = stage.rollout.group_size
        stats.update(srpo_route_stats(teacher_prompts.succeeded, teacher_prompts.has_target, group))
    return DistillTargets(teacher_batch, mask, stats, teacher_prompts.has_target)

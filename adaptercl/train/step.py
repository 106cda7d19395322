"""One training step on a batch of rollouts: the loss terms of the stage's method composed, backward, clip, and
the optimiser step.

`train_on_batch` makes `grpo.iterations` passes of micro-batches over the batch (`optim.grad_accum` of them, or of
`optim.micro_batch_size` sequences: `StageContext.micro_rows`), one optimiser step per pass. Each micro-batch's loss
is the sum of the terms the method declares (`recipe.method_table.METHODS`), each a function of `loss_terms.py` or the
regularisers returning per-token losses, aggregated by `losses.micro_batch_aggregate` with its own batch-global
denominator (so any split gives the same update):

    loss = kl_prev · KL(current ‖ previous stage)            regularizers.kl_prev, when > 0
         + policy_term                                        grpo, hybrid, srpo (its GRPO-routed rows)
         + distill_weight · distill_term                      sdpo, sdft (weight 1), hybrid (hybrid.distill_weight),
                                                              srpo (its SDPO-routed rows, entropy-weighted)
    then, once per pass: l2_prev · ‖ΔW − ΔW_0‖² + orthogonal · Σ‖A A_oldᵀ‖²

srpo's two terms share one token denominator, and its teacher runs once per step before the micro-batches, on the
SDPO-routed rows only (`srpo.routed_step`). sdpo and sdft have no policy term (the released SDPO code replaces the GRPO
loss; advantages unused). A hybrid with λ = 0 logs its distillation term but does not add it (GRPO's update exactly). A
distillation-only step with no distilled token (SDPO: no sibling succeeded and no feedback) has no gradient and makes
no update. A pass whose gradient norm is NaN/inf makes no update either (`nonfinite_step` 1, as verl): the stage then
leaves the teacher and the rollout engine as they are, and the collapse guard sees the non-finite `grad_norm`.

Rollout mismatch (vLLM engines, which return their own logprobs `rollout_logp`): the policy term and the distillation
weights multiply by min(exp(logp_old − logp_rollout), cap). Under `rollout.top_p` < 1 the engine's logprobs are those
of the nucleus it sampled from, renormalised (log p(y) − log S, S the kept mass), the trainer's under the full softmax:
on the first pass, whose policy is the rollout's old one, each micro-batch adds log S of its own logits
(`TokenTerms.log_kept`, `rollout.kept_log_mass`) to the engine's logprobs, so the ratio compares the same
distribution and on-policy rows weigh 1 (not S: trl#6789). The GRPO ratio exp(logp − logp_old) stays under the full
softmax, as TRL's.

Data-parallel ranks (`system/distributed.py`): each rank's batch is its share of the step's rows; every denominator
above is the whole batch's (summed over ranks), so the ranks' losses sum to the 1-process loss, and the gradients are
summed before clipping (the L2/orthogonality term is added on rank 0 only). Logged statistics are the whole batch's.

Padding: `micro_batch_rows` chooses which rows go together (the rollout order, or sorted by length where that
computes fewer positions) and each micro-batch is cut to its own rows' longest prompt and response (R' <= R columns),
not the whole batch's; with one micro-batch the batch is used as it is. srpo's teacher runs before the loop on the
same micro-batches (`srpo.routed_step`).

Memory: the split bounds the rows n_mb of a micro-batch (`micro_batch.py`: auto sizes it to the card). The
per-token quantities (log-probs, entropies, KL to the previous stage, the divergence to the teacher) come from
`token_terms.token_terms`: with `optim.logits_chunk_size` (auto: 1024 on CUDA) only a chunk of positions'
full-vocabulary logits exists at a time, forward and backward; off (the CPU default) the student's, the teacher's
and the previous policy's logits are full [n_mb, R, V] float32. `optim.activation_checkpointing` (auto: on for CUDA)
recomputes each decoder layer in backward during the step (`model.checkpointing`; prompt prefixes are still shared).
"""

from __future__ import annotations

import math

import torch

from adaptercl.adapters import active_adapters, lora_parameters
from adaptercl.model import (
    TokenBatch,
    activation_checkpointing,
    resolve_activation_checkpointing,
    response_scores,
    shared_prefix_limit,
)
from adaptercl.recipe import METHODS
from adaptercl.system import distributed
from adaptercl.train import losses
from adaptercl.train.context import StageContext
from adaptercl.train.distill_targets import DistillTargets
from adaptercl.train.loss_terms import policy_term, weighted_distillation
from adaptercl.train.micro_batch_rows import cut, micro_batch_rows
from adaptercl.train.regularizers import StageRegularizers
from adaptercl.train.srpo import routed_step
from adaptercl.train.token_terms import TokenTerms, resolve_logits_chunk_size, token_logprobs, token_terms


def train_on_batch(
    ctx: StageContext,
    batch: TokenBatch,
    advantages: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    targets: DistillTargets | None,
    rollout_logp: torch.Tensor | None,
    regs: StageRegularizers | None = None,
    method: str | None = None,
) -> dict[str, float]:
    """Train on one batch (see the module docstring); returns the step's statistics (pass means).

    batch [N, P+R] with advantages [N]; `targets` the distillation inputs of distilling methods; `rollout_logp`
    [N, R] the rollout engine's own logprobs when it returned them (else None: on-policy hf rollouts). `method`: the
    method whose terms make the loss, None for the stage's (a closed lift gate passes "grpo" and no targets:
    `lift_gate.py`).
    """
    stage, model = ctx.stage, ctx.model
    spec = METHODS[method or stage.method]
    if not spec.policy_term and targets is not None and _global_count(targets.mask, "token_mean") == 0:
        # Nothing to distil: no gradient, and no update either; a zero gradient would still move the weights through
        # AdamW's momentum, while a step over parameters without .grad changes nothing.
        optimizer.zero_grad(set_to_none=True)
        optimizer.step()
        return {"loss": 0.0, "grad_norm": 0.0, "nonfinite_step": 0.0, "skipped_step": 1.0}
    temperature = stage.rollout.temperature
    n = batch.input_ids.shape[0]
    micro = ctx.micro_rows(n)  # optim.micro_batch_size or grad_accum's split
    total_tokens = _global_count(batch.response_mask, "token_mean").clamp(min=1.0)
    device = next(model.parameters()).device
    chunk = resolve_logits_chunk_size(stage.optim.logits_chunk_size, device)
    checkpointing = resolve_activation_checkpointing(stage.optim.activation_checkpointing, device)
    # which rows go together; each micro-batch is then cut to its own rows' longest prompt and response
    _, parts = micro_batch_rows(batch, micro, share_prompts=shared_prefix_limit(model))
    routed = None
    if spec.sample_routed:  # srpo: its teacher forward, entropy weights and shared denominator, before any backward
        routed = routed_step(ctx, batch, targets, parts, chunk)
        policy_denominator = routed.denominator
        distill_denominators = (routed.denominator, routed.sdpo_tokens)
    else:
        policy_denominator = _global_count(batch.response_mask, stage.grpo.aggregation)
        distill_denominators = (
            None if targets is None else _distill_denominators(targets.mask, stage.distill.aggregation)
        )
    logp_old = None
    if stage.grpo.iterations > 1:  # off-policy passes need the rollout policy's logprobs
        logp_old = logprobs(model, batch, temperature, chunk)
    # Under top-p the engine's logprobs are the nucleus-renormalised ones: the first pass (the rollout's old policy)
    # moves them onto the trainer's full support, + log of the mass it keeps (see the module docstring).
    top_p = stage.rollout.top_p if rollout_logp is not None else 1.0
    if top_p < 1.0:
        rollout_logp = rollout_logp.clone()
    sums: dict[str, float] = {}  # additive over data-parallel ranks (global denominators): summed at the end
    shared: dict[str, float] = {}  # the same on every rank (computed from the reduced gradients or the weights)
    params = list(lora_parameters(model, ctx.student).values())
    for iteration in range(stage.grpo.iterations):
        optimizer.zero_grad(set_to_none=True)
        for k, rows in enumerate(parts):
            mb = cut(batch, rows, len(parts))
            r_width = mb.response_ids.shape[1]  # R'
            mask = mb.response_mask  # [n_mb, R']
            with activation_checkpointing(model, checkpointing):
                student = response_scores(model, mb, temperature, chunk)  # [n_mb, R, V] logits or [n_mb, R, H]
            previous = regs.previous_scores(model, mb, temperature, chunk) if regs is not None else None
            target_rows = teacher = None
            t_mask = None if targets is None else targets.mask[rows][:, :r_width]  # [n_mb, R']
            if routed is not None:  # srpo: the teacher already ran on this micro-batch's SDPO rows
                if routed.teacher[k] is not None:
                    target_rows, teacher = routed.sdpo_rows[k], routed.teacher_scores(k, chunk)
            elif t_mask is not None and t_mask.sum() > 0:
                # The teacher runs only on the rows with a target (hybrid: the failed groups), so sparse
                # distillation costs a teacher forward in proportion to how sparse it is.
                target_rows = (t_mask.sum(-1) > 0).nonzero().squeeze(-1)  # [n_t]
                teacher_mb = cut(targets.teacher_batch.select(rows), target_rows, len(parts), r_width)
                teacher = ctx.teacher.scores(model, teacher_mb, temperature, chunk)  # [n_t, R', V] or [n_t, R', H]
            kept_top_p = top_p if iteration == 0 else 1.0  # log_kept on the first pass only
            terms = token_terms(
                student, mb.response_ids, chunk, previous, teacher, target_rows, stage.distill, kept_top_p
            )
            logp = terms.logp  # [n_mb, R']
            old = logp.detach() if logp_old is None else logp_old[rows][:, :r_width]
            if terms.log_kept is not None:  # the engine's logprobs of these rows on the trainer's support, once
                rollout_logp[rows, :r_width] += terms.log_kept.to(rollout_logp.dtype)
            mb_rollout_logp = None if rollout_logp is None else rollout_logp[rows][:, :r_width]
            token_share = mask.sum() / total_tokens
            loss = logp.new_zeros(())
            if terms.kl_prev is not None:
                loss = loss + regs.kl_weight * losses.micro_batch_aggregate(
                    terms.kl_prev, mask, batch.response_mask, "token_mean", denominator=total_tokens
                )
                add_token_means(sums, {"kl_prev": terms.kl_prev.detach()}, mask, token_share)
            if spec.policy_term:
                policy_mask = mask if routed is None else routed.grpo_mask[rows][:, :r_width]  # [n_mb, R']
                per_token, stats = policy_term(
                    logp,
                    old,
                    advantages[rows],
                    stage.grpo.epsilon_low,
                    stage.grpo.epsilon_high,
                    stage.grpo.dual_clip,
                    mb_rollout_logp,
                    stage.grpo.is_cap,
                    reference_logprobs(model, mb, temperature, chunk) if stage.grpo.kl_coef > 0 else None,
                    stage.grpo.kl_coef,
                )
                loss = loss + losses.micro_batch_aggregate(
                    per_token,
                    policy_mask,
                    batch.response_mask,
                    stage.grpo.aggregation,
                    stage.rollout.max_new_tokens,
                    policy_denominator,
                )
                share = token_share if routed is None else policy_mask.sum() / routed.grpo_tokens.clamp(min=1.0)
                add_token_means(sums, stats, policy_mask, share)
            if target_rows is not None:
                token_weight = None if routed is None else routed.weights[k]
                loss = loss + _distillation(
                    ctx,
                    t_mask,
                    target_rows,
                    terms,
                    old,
                    mb_rollout_logp,
                    targets,
                    distill_denominators,
                    sums,
                    token_weight,
                )
            if loss.requires_grad:  # checkpointed layers replay their forward here, whatever the flag says now
                loss.backward()
            with torch.no_grad():
                _add(sums, "loss", loss.item())
                entropy = losses.aggregate(terms.entropy, mask, "token_mean")
                _add(sums, "entropy", (entropy * token_share).item())
        param_loss, param_stats = regs.parameter_loss() if regs is not None else (None, {})
        # L2 to the previous ΔW, O-LoRA orthogonality: once per pass, and on one rank only (its gradient is a
        # function of the weights, the same on every rank, and the ranks' gradients are summed)
        if param_loss is not None and distributed.is_main():
            param_loss.backward()
        for key, value in param_stats.items():
            _add(shared, key, value)
        distributed.all_reduce_grads(params)  # the sum over ranks: every rank now steps identically
        grad_norm = torch.nn.utils.clip_grad_norm_(params, stage.optim.max_grad_norm).item()
        _add(shared, "grad_norm", grad_norm)  # NaN/inf stays in the log: the guard's nonfinite rule acts on it
        if math.isfinite(grad_norm):
            _add(shared, "nonfinite_step", 0.0)
            optimizer.step()
        else:  # no update from a NaN/inf gradient (as verl's dp_actor._optimizer_step); AdamW's state is untouched
            _add(shared, "nonfinite_step", 1.0)
            optimizer.zero_grad(set_to_none=True)
    sums = {**distributed.sum_dicts(sums), **shared}
    stats = {k: v / stage.grpo.iterations for k, v in sums.items()}
    if routed is not None:
        stats.update(routed.stats)  # the whole batch's already, and the same for every pass
    if targets is not None:
        stats["skipped_step"] = float(stats["nonfinite_step"] == 1.0)
    return stats


def _distillation(
    ctx: StageContext,
    mb_mask: torch.Tensor,
    target_rows: torch.Tensor,
    terms: TokenTerms,
    old: torch.Tensor,
    rollout_logp: torch.Tensor | None,
    targets: DistillTargets,
    denominators: tuple[torch.Tensor, torch.Tensor],
    sums: dict[str, float],
    token_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weighted distillation term of one micro-batch (0 added when its weight is 0); logs its statistics.
    `mb_mask` [n_mb, R'] is `targets.mask` on the micro-batch's rows and columns; `terms` holds the divergence on its
    rows `target_rows` [n_t] (those with a target);
    `denominators` the batch-global (aggregation's denominator, distilled tokens) of `targets.mask` (srpo: the shared
    token denominator of both its terms); `token_weight` [n_t, R] multiplies the token losses (srpo's DW-SDPO
    weights; None: 1)."""
    stage, distill = ctx.stage, ctx.stage.distill
    d_mask = mb_mask[target_rows]  # [n_t, R']
    per_token, stats = weighted_distillation(
        terms.divergence,
        terms.logp[target_rows],
        old[target_rows],
        terms.teacher_logp,
        distill.is_cap,
        None if rollout_logp is None else rollout_logp[target_rows],
    )  # [n_t, R]
    if token_weight is not None:
        per_token = per_token * token_weight
    # targets.mask [N, R] is the whole batch's: under seq_mean_token_mean_all the N rows, those without a target
    # included, are the denominator (the rows left out here would add 0 to the numerator).
    denominator, distilled_tokens = denominators
    distill_loss = losses.micro_batch_aggregate(
        per_token, d_mask, targets.mask, distill.aggregation, stage.rollout.max_new_tokens, denominator
    )
    with torch.no_grad():
        _add(sums, "distill_loss", distill_loss.item())
        add_token_means(sums, stats, d_mask, d_mask.sum() / distilled_tokens)
    weight = METHODS[stage.method].distill_weight(stage.hybrid)
    if weight > 0:  # hybrid with λ = 0: logged, not added (GRPO's update exactly)
        return weight * distill_loss
    return per_token.new_zeros(())


def _global_count(mask: torch.Tensor, mode: losses.Aggregation) -> torch.Tensor:
    """The batch-global denominator of `mode` over `mask` [N, T]: summed over data-parallel ranks, so the ranks'
    losses (each over its own rows) sum to the loss of the whole batch."""
    return distributed.all_reduce_sum(losses.aggregate_denominator(mask, mode))


def _distill_denominators(mask: torch.Tensor, mode: losses.Aggregation) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distillation aggregation's denominator, the distilled tokens) of the whole batch, in one all-reduce."""
    local = torch.stack([losses.aggregate_denominator(mask, mode).to(mask.dtype), mask.sum()])  # [2]
    total = distributed.all_reduce_sum(local)
    return total[0], total[1]


@torch.no_grad()
def logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float, chunk: int | None = None) -> torch.Tensor:
    """Log-probs of the response tokens under the model as it is [N, R] (`chunk`: see `chunked_logits`)."""
    return token_logprobs(response_scores(model, batch, temperature, chunk), batch.response_ids, chunk)


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module, batch: TokenBatch, temperature: float, chunk: int | None = None
) -> torch.Tensor:
    """Log-probs of the response tokens under the base model, every adapter disabled (`grpo.kl_coef`) [N, R]."""
    with active_adapters(model, None):
        return logprobs(model, batch, temperature, chunk)


def add_token_means(sums: dict[str, float], stats: dict[str, torch.Tensor], mask: torch.Tensor, share) -> None:
    """Add each per-token statistic's masked mean × `share` (the micro-batch's share of the batch's tokens)."""
    with torch.no_grad():
        for name, values in stats.items():
            _add(sums, name, (losses.aggregate(values, mask, "token_mean") * share).item())


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value

"""One training stage, top to bottom: rollout -> reward -> teacher -> loss -> step -> log -> save.

`run_stage` trains the student adapter of one stage on its domain with the stage's method:
- grpo: group sampling, Dr.GRPO advantages, clipped ratio, optional k3 KL to the base (DESIGN.md §4);
- sdpo / sdft: the same loop, with the self-teacher's logits (`ctx.teacher`, see `teacher.py`) on a teacher
  prompt distilled into the student on the same sampled responses. The distillation loss replaces the GRPO loss
  (as the released SDPO code; advantages unused). SDPO's teacher prompt shows a successful sibling or the reward
  feedback; SDFT's shows the example's demonstration (one sample per prompt). After each optimiser step the
  teacher follows the student (`Teacher.update`: EMA of ΔW or a periodic copy). A step without any distilled
  token (SDPO with no success and no feedback) has no gradient and makes no optimiser step; `teacher_target_frac`
  and `skipped_step` record it;
- hybrid: GRPO + `hybrid.distill_weight` x distillation on a sparse token mask (`hybrid.py`: failed groups,
  high-entropy tokens or all) with a frozen or trust-region teacher; λ = 0 adds nothing (GRPO's update exactly).
Every method adds the continual regularisers of `regularizers.py` (KL / L2 to the previous stage, O-LoRA
orthogonality; replay of earlier domains' prompts), each only when its weight is > 0.

Memory: student and teacher logits are full-vocabulary [n_mb, R, V] float32 per micro-batch (two more for the
trust-region teacher); `grad_accum` bounds n_mb. Chunking the divergence over R is future work for large vocabularies.

What the run hands a stage is `stage_context.StageContext`; the teacher prompts and distillation mask of a step
are built in `distill_targets.py`.

The data order and sampling seeds are pure functions of (recipe seed, stage index, step), so a stage resumed
from a checkpoint draws the same prompts as an uninterrupted one. Token losses are aggregated with the batch-
global denominator in every micro-batch, so any `grad_accum` gives the same update.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from adaptercl import losses
from adaptercl.adapters import active_adapters, lora_parameters
from adaptercl.atomic import append_line, read_jsonl, write_text
from adaptercl.batching import TokenBatch, build_batch, encode_chat, response_logits
from adaptercl.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from adaptercl.distill_targets import DistillTargets, distill_targets
from adaptercl.drift import parameter_drift_report
from adaptercl.metrics import repeated_ngram_rate
from adaptercl.monitor import CollapseGuard
from adaptercl.regularizers import StageRegularizers, replay_count, replay_examples
from adaptercl.rollout import Completion, SamplingParams
from adaptercl.stage_context import StageContext, prompts_for_step, step_seed
from adaptercl.teacher import DISTILL_METHODS

GRPO_LOSS_METHODS = ("grpo", "hybrid")  # methods whose loss has the clipped policy-gradient term


def make_optimizer(ctx: StageContext) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    optim = ctx.stage.optim
    params = list(lora_parameters(ctx.model, ctx.student).values())
    optimizer = torch.optim.AdamW(params, lr=optim.lr, weight_decay=optim.weight_decay)

    def lr_factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / (optim.warmup_steps + 1)
        progress = (step - optim.warmup_steps) / max(1, optim.steps - optim.warmup_steps)
        if optim.schedule == "linear":
            return max(0.0, 1.0 - progress)
        if optim.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def run_stage(ctx: StageContext, start_step: int = 0, optimizer=None, scheduler=None) -> dict[str, float]:
    """Train `ctx.student` for the stage's steps; append one JSON line per step to metrics.jsonl."""
    stage, model, tok = ctx.stage, ctx.model, ctx.tokenizer
    if stage.method in DISTILL_METHODS and ctx.teacher is None:
        raise ValueError(f"a {stage.method} stage needs ctx.teacher (see teacher.create_teacher)")
    if optimizer is None:
        optimizer, scheduler = make_optimizer(ctx)
    regs = StageRegularizers.start(model, ctx.student, ctx.frozen, ctx.previous, stage.regularizers)
    metrics_path = ctx.stage_dir / "metrics.jsonl"
    device = next(model.parameters()).device
    group = stage.rollout.group_size
    last: dict[str, float] = {}
    guard = CollapseGuard(stage.monitor)
    checkpoint_dir = ctx.stage_dir / "checkpoint"
    history: list[dict] = []  # this stage's step metrics, for the guard's rules
    step = start_step
    if has_checkpoint(checkpoint_dir):  # resume exactly where the last checkpoint left off
        step, history = _restore(ctx, checkpoint_dir, optimizer, scheduler, guard)
    else:
        _checkpoint(ctx, checkpoint_dir, optimizer, scheduler, step, guard)
    while step < stage.optim.steps:
        t0 = time.perf_counter()
        # ---- rollout: G samples for each prompt, from the current student (on top of frozen earlier adapters)
        per_step = stage.optim.prompts_per_step
        n_replay = replay_count(stage.regularizers.replay_fraction, per_step, len(ctx.replay_domains))
        indices = prompts_for_step(len(ctx.domain.train), per_step - n_replay, ctx.recipe.seed, ctx.index, step)
        pairs = [(ctx.domain.train[i], ctx.domain) for i in indices] + replay_examples(
            ctx.replay_domains, n_replay, step_seed(ctx.recipe.seed, ctx.index, 3_000_000 + step)
        )  # (example, domain whose reward scores it)
        examples = [ex for ex, _ in pairs]
        prompt_ids = [encode_chat(tok, ex.messages) for ex in examples]
        params = SamplingParams(
            max_new_tokens=stage.rollout.max_new_tokens,
            temperature=stage.rollout.temperature,
            top_p=stage.rollout.top_p,
            n=group,
            seed=step_seed(ctx.recipe.seed, ctx.index, step),
            logprobs=stage.rollout.engine != "hf",  # hf samples from the trained weights themselves: on-policy
        )
        groups = ctx.engine.generate(prompt_ids, ctx.policy_adapters, params)
        ctx.engine.sleep()  # vLLM on CUDA frees its memory for the training step (no-op elsewhere)
        completions = [c for g in groups for c in g]  # [N] group-contiguous, N = prompts x G
        samples = [ex for ex in examples for _ in range(group)]
        sample_domains = [d for _, d in pairs for _ in range(group)]
        t_rollout = time.perf_counter() - t0

        # ---- reward
        results = [d.reward(c.text, ex) for c, ex, d in zip(completions, samples, sample_domains)]
        rewards = torch.tensor([r.score for r in results], dtype=torch.float32)  # [N]
        advantages = losses.group_advantages(rewards, group, scale_by_std=stage.grpo.scale_rewards)  # [N]
        batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], tok.pad_token_id)

        # ---- teacher: the same responses behind the teacher's prompts, and which tokens are distilled
        targets = None
        if stage.method in DISTILL_METHODS:
            targets = distill_targets(ctx, step, samples, completions, results, batch).to(device)

        # ---- loss and optimiser step, then the teacher follows the student (ema, lag)
        model.train()
        rollout_logp = _rollout_logprobs(completions, batch)
        train_stats = _train_on_batch(
            ctx,
            batch.to(device),
            advantages.to(device),
            optimizer,
            targets,
            None if rollout_logp is None else rollout_logp.to(device),
            regs,
        )
        scheduler.step()
        if ctx.teacher is not None:
            ctx.teacher.update(model)
        ctx.engine.sync_adapters([ctx.student])  # adapter-only sync under a new name and id (no-op for hf)

        # ---- log
        last = {
            "step": step + 1,
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "correct_frac": sum(r.correct for r in results) / len(results),
            "replay_frac": n_replay / len(examples),
            "zero_variance_groups": losses.zero_variance_group_fraction(rewards, group),
            **(targets.stats if targets is not None else {}),
            **train_stats,
            **_length_stats(completions),
            "lr": scheduler.get_last_lr()[0],
            "time_rollout_s": t_rollout,
            "time_step_s": time.perf_counter() - t0,
        }
        if ctx.teacher is not None and ctx.teacher.kind == "ema":
            last["teacher_ema_dropped"] = ctx.teacher.ema_dropped
        last["repetition_rate"] = sum(repeated_ngram_rate(c.token_ids) for c in completions) / len(completions)
        if stage.monitor.drift_every and (step + 1) % stage.monitor.drift_every == 0:
            drift = parameter_drift_report(model, ctx.policy_adapters, ctx.base_weights)["aggregate"]
            last.update({f"drift_{k}": v for k, v in drift.items() if k.endswith("_mean")})

        # ---- collapse guard: warn; roll back to the last checkpoint with a smaller LR; or stop at that checkpoint
        alarms = guard.check([*history, last])
        action = guard.decide(alarms)
        for alarm in alarms:
            event = {"event": alarm.rule, "action": action, "step": step + 1, "message": alarm.message}
            append_line(metrics_path, json.dumps(event))
        if action in ("rollback", "stop"):  # back to the last good checkpoint; stop ends the stage there
            step, history = _restore(ctx, checkpoint_dir, optimizer, scheduler, guard)
            last = history[-1] if history else {}
            if action == "stop":
                break
            continue
        append_line(metrics_path, json.dumps(last))
        history.append(last)
        step += 1
        if ctx.on_step is not None:
            ctx.on_step(step, last)
        if step % stage.monitor.checkpoint_every == 0 and step < stage.optim.steps:
            _checkpoint(ctx, checkpoint_dir, optimizer, scheduler, step, guard)
    return last


def _checkpoint(ctx: StageContext, path: Path, optimizer, scheduler, next_step: int, guard: CollapseGuard) -> None:
    teacher = ctx.teacher
    adapters = [ctx.student] + ([teacher.adapter] if teacher is not None and teacher.adapter else [])
    extra = {"rollbacks_used": guard.rollbacks_used, "teacher": teacher.state() if teacher is not None else None}
    save_checkpoint(path, ctx.model, adapters, optimizer, scheduler, next_step, extra)


def _restore(ctx: StageContext, path: Path, optimizer, scheduler, guard: CollapseGuard) -> tuple[int, list[dict]]:
    """Load the checkpoint (student, teacher, optimiser, scheduler, RNG), apply the guard's LR scale, and cut
    metrics.jsonl back to the checkpoint's step (alarm events are kept). Returns (next step, step history)."""
    rollbacks_used = guard.rollbacks_used  # a rollback has already counted itself; a resume reads it back
    state = load_checkpoint(path, ctx.model, optimizer, scheduler)
    guard.rollbacks_used = max(rollbacks_used, state["rollbacks_used"])
    if ctx.teacher is not None and state["teacher"] is not None:
        for key, value in state["teacher"].items():
            setattr(ctx.teacher, key, value)
    scale = guard.lr_scale()
    scheduler.base_lrs = [ctx.stage.optim.lr * scale for _ in scheduler.base_lrs]
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = ctx.stage.optim.lr * scale * lr_lambda(scheduler.last_epoch)
    next_step = state["next_step"]
    metrics_path = ctx.stage_dir / "metrics.jsonl"
    kept = [r for r in read_jsonl(metrics_path) if "event" in r or r["step"] <= next_step]
    write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
    return next_step, [r for r in kept if "event" not in r]


def _train_on_batch(
    ctx: StageContext,
    batch: TokenBatch,
    advantages: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    targets: DistillTargets | None,
    rollout_logp: torch.Tensor | None,
    regs: StageRegularizers | None = None,
) -> dict[str, float]:
    """`grpo.iterations` passes of `grad_accum` micro-batches over one batch of rollouts, one step per pass.

    The loss is the GRPO loss (grpo, hybrid) plus the distillation loss: weight 1 for sdpo and sdft, which use no
    GRPO term at all (the released SDPO code replaces the GRPO loss, advantages unused), `hybrid.distill_weight`
    for hybrid. Each term is aggregated with its own batch-global denominator (`_micro_share`), so any
    `grad_accum` gives the same update.
    """
    stage, model, distill = ctx.stage, ctx.model, ctx.stage.distill
    temperature, max_len = stage.rollout.temperature, stage.rollout.max_new_tokens
    use_policy = stage.method in GRPO_LOSS_METHODS
    distill_weight = stage.hybrid.distill_weight if stage.method == "hybrid" else 1.0
    if not use_policy and targets is not None and targets.mask.sum() == 0:
        # Nothing to distil (SDPO: no sibling succeeded and no feedback): no gradient, and no update either; a
        # zero gradient would still move the weights through AdamW's momentum, while a step over parameters
        # without .grad changes nothing (and keeps the LR scheduler's bookkeeping in order).
        optimizer.zero_grad(set_to_none=True)
        optimizer.step()
        return {"loss": 0.0, "grad_norm": 0.0, "skipped_step": 1.0}
    n = batch.input_ids.shape[0]
    micro = math.ceil(n / stage.optim.grad_accum)
    total_tokens = batch.response_mask.sum().clamp(min=1.0)
    logp_old = None
    if stage.grpo.iterations > 1:  # off-policy passes need the rollout policy's logprobs
        with torch.no_grad():
            logp_old = _logprobs(model, batch, temperature)
    sums: dict[str, float] = {}
    params = list(lora_parameters(model, ctx.student).values())
    for _ in range(stage.grpo.iterations):
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, n, micro):
            rows = slice(start, min(n, start + micro))
            mb = batch.select(rows)
            mask = mb.response_mask  # [n_mb, R]
            logits = response_logits(model, mb, temperature=temperature)  # [n_mb, R, V]
            logp = losses.gather_logprobs(logits, mb.response_ids)  # [n_mb, R]
            old = logp.detach() if logp_old is None else logp_old[rows]
            loss = logits.new_zeros(())
            if regs is not None:  # KL to the previous stage's policy (0 and no forward when its weight is 0)
                loss = loss + regs.micro_loss(model, mb, logits, mask.sum() / total_tokens, temperature, sums)
            if use_policy:
                token_loss, clip_low, clip_high = losses.clipped_policy_loss(
                    logp, old, advantages[rows], stage.grpo.epsilon_low, stage.grpo.epsilon_high, stage.grpo.dual_clip
                )
                if rollout_logp is not None:  # rollouts from another engine/base: truncated IS correction
                    token_loss = token_loss * torch.exp(old - rollout_logp[rows]).clamp(max=stage.distill.is_cap)
                terms = {"policy_loss": token_loss}
                if stage.grpo.kl_coef > 0:
                    with torch.no_grad(), active_adapters(model, None):
                        ref_logp = _logprobs(model, mb, temperature)
                    terms["kl_base"] = losses.k3_kl(logp, ref_logp)
                    token_loss = token_loss + stage.grpo.kl_coef * terms["kl_base"]
                share = _micro_share(mask, batch.response_mask, stage.grpo.aggregation)
                loss = loss + share * losses.aggregate(token_loss, mask, stage.grpo.aggregation, max_len)
                with torch.no_grad():
                    token_share = mask.sum() / total_tokens
                    for name, values in terms.items():
                        _add(sums, name, (losses.aggregate(values, mask, "token_mean") * token_share).item())
                    _add(sums, "clip_low_frac", ((clip_low.float() * mask).sum() / total_tokens).item())
                    _add(sums, "clip_high_frac", ((clip_high.float() * mask).sum() / total_tokens).item())
            if targets is not None and targets.mask[rows].sum() > 0:
                # The teacher runs only on the rows with a target (hybrid: the failed groups), so sparse
                # distillation costs a teacher forward in proportion to how sparse it is.
                has_target = (targets.mask[rows].sum(-1) > 0).nonzero().squeeze(-1)  # [n_t]
                d_mask = targets.mask[rows][has_target]  # [n_t, R]
                teacher_mb = targets.teacher_batch.select(rows).select(has_target)
                t_logits = ctx.teacher.logits(model, teacher_mb, temperature)  # [n_t, R, V]
                s_logits, s_logp = logits[has_target], logp[has_target]  # [n_t, R, V], [n_t, R]
                response_ids = mb.response_ids[has_target]  # [n_t, R]
                per_token = losses.distillation_divergence(
                    s_logits, t_logits, distill.alpha, distill.support, distill.topk, distill.tail, response_ids
                )  # [n_t, R]
                weight = losses.importance_weights(
                    s_logp,
                    old[has_target],
                    None if rollout_logp is None else rollout_logp[rows][has_target],
                    distill.is_cap,
                )  # [n_t, R]
                share = _micro_share(d_mask, targets.mask, distill.aggregation)
                distill_loss = share * losses.aggregate(per_token * weight, d_mask, distill.aggregation, max_len)
                if distill_weight > 0:  # hybrid with λ = 0: logged, not added (GRPO's update exactly)
                    loss = loss + distill_weight * distill_loss
                with torch.no_grad():
                    # `sampled` values are a surrogate, not a divergence: log its estimate log p(y) - log q(y).
                    divergence = (
                        s_logp - losses.gather_logprobs(t_logits, response_ids)
                        if distill.support == "sampled"
                        else per_token
                    )
                    d_share = d_mask.sum() / targets.mask.sum()
                    _add(sums, "distill_loss", distill_loss.item())
                    _add(
                        sums,
                        "teacher_divergence",
                        (losses.aggregate(divergence, d_mask, "token_mean") * d_share).item(),
                    )
                    _add(sums, "is_weight_mean", (losses.aggregate(weight, d_mask, "token_mean") * d_share).item())
            if loss.requires_grad:
                loss.backward()
            with torch.no_grad():
                token_share = mask.sum() / total_tokens
                _add(sums, "loss", loss.item())
                _add(
                    sums,
                    "entropy",
                    (losses.aggregate(losses.token_entropy(logits), mask, "token_mean") * token_share).item(),
                )
        param_loss, param_stats = regs.parameter_loss() if regs is not None else (None, {})
        if param_loss is not None:  # L2 to the previous ΔW, O-LoRA orthogonality: once per pass
            param_loss.backward()
        for key, value in param_stats.items():
            _add(sums, key, value)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, stage.optim.max_grad_norm)
        _add(sums, "grad_norm", grad_norm.item())
        optimizer.step()
    stats = {k: v / stage.grpo.iterations for k, v in sums.items()}
    if targets is not None:
        stats["skipped_step"] = 0.0
    return stats


def _micro_share(mb_mask: torch.Tensor, batch_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Factor on a micro-batch's aggregated loss such that the micro-batch terms sum to the whole batch's loss."""
    if mode == "token_mean":
        return mb_mask.sum() / batch_mask.sum().clamp(min=1.0)
    if mode == "seq_mean_token_mean":  # sequences without a token are left out of the mean (losses.aggregate)
        return (mb_mask.sum(-1) > 0).sum() / (batch_mask.sum(-1) > 0).sum().clamp(min=1)
    return torch.tensor(mb_mask.shape[0] / batch_mask.shape[0])  # seq_mean_token_sum_norm: mean over sequences


def _rollout_logprobs(completions: list[Completion], batch: TokenBatch) -> torch.Tensor | None:
    """The engine's per-token logprobs as [N, R] (0 on padding), or None when it returned none."""
    if any(c.logprobs is None for c in completions):
        return None
    out = torch.zeros_like(batch.response_mask)
    for i, c in enumerate(completions):
        out[i, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=out.dtype)
    return out


def _logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    return losses.gather_logprobs(response_logits(model, batch, temperature=temperature), batch.response_ids)  # [N, R]


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def _length_stats(completions: list[Completion]) -> dict[str, float]:
    lengths = [len(c.token_ids) for c in completions]
    return {
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": float(max(lengths)),
        "truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
    }

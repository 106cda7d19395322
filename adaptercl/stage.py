"""One training stage, top to bottom: rollout -> reward -> teacher -> loss -> step -> log -> save.

`run_stage` trains the student adapter of one stage on its domain with the stage's method:
- grpo: group sampling, Dr.GRPO advantages, clipped ratio, optional k3 KL to the base (DESIGN.md §4);
- sdpo / sdft / hybrid: the same loop, with a self-teacher's logits on a teacher prompt (see `teacher.py`)
  distilled into the student; hybrid adds the distillation term with weight lambda on top of GRPO.

The data order and sampling seeds are pure functions of (recipe seed, stage index, step), so a stage resumed
from a checkpoint draws the same prompts as an uninterrupted one. Token losses are aggregated with the batch-
global denominator in every micro-batch, so any `grad_accum` gives the same update.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from adaptercl import losses
from adaptercl.adapters import active_adapters, lora_parameters
from adaptercl.atomic import append_line
from adaptercl.batching import TokenBatch, build_batch, encode_chat, response_logits
from adaptercl.config import RecipeConfig, StageConfig
from adaptercl.domains import Domain
from adaptercl.rollout import Completion, RolloutEngine, SamplingParams


@dataclass
class StageContext:
    """What the run hands a stage."""

    recipe: RecipeConfig
    index: int  # 0-based position in recipe.stages
    model: torch.nn.Module  # the PeftModel holding every adapter
    tokenizer: PreTrainedTokenizerBase
    engine: RolloutEngine
    domain: Domain
    student: str  # name of the adapter trained in this stage
    frozen: list[str] = field(default_factory=list)  # earlier adapters active (frozen) under the student
    stage_dir: Path = Path(".")
    on_step: Any = None  # callback(step, metrics) for progress display

    @property
    def stage(self) -> StageConfig:
        return self.recipe.stages[self.index]

    @property
    def policy_adapters(self) -> list[str]:
        return [*self.frozen, self.student]


def step_seed(recipe_seed: int, stage_index: int, step: int) -> int:
    return (recipe_seed * 1_000_003 + stage_index * 10_007 + step) % (2**31 - 1)


def prompts_for_step(n_train: int, per_step: int, recipe_seed: int, stage_index: int, step: int) -> list[int]:
    """Indices of the training examples used at `step`: consecutive slices of seeded per-epoch permutations."""
    out = []
    for pos in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(pos, n_train)
        g = torch.Generator().manual_seed(step_seed(recipe_seed, stage_index, 1_000_000 + epoch))
        out.append(int(torch.randperm(n_train, generator=g)[offset]))
    return out


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
    if optimizer is None:
        optimizer, scheduler = make_optimizer(ctx)
    metrics_path = ctx.stage_dir / "metrics.jsonl"
    device = next(model.parameters()).device
    group = stage.rollout.group_size
    last: dict[str, float] = {}
    for step in range(start_step, stage.optim.steps):
        t0 = time.perf_counter()
        # ---- rollout: G samples for each prompt, from the current student (on top of frozen earlier adapters)
        indices = prompts_for_step(
            len(ctx.domain.train), stage.optim.prompts_per_step, ctx.recipe.seed, ctx.index, step
        )
        examples = [ctx.domain.train[i] for i in indices]
        prompt_ids = [encode_chat(tok, ex.messages) for ex in examples]
        params = SamplingParams(
            max_new_tokens=stage.rollout.max_new_tokens,
            temperature=stage.rollout.temperature,
            top_p=stage.rollout.top_p,
            n=group,
            seed=step_seed(ctx.recipe.seed, ctx.index, step),
        )
        groups = ctx.engine.generate(prompt_ids, ctx.policy_adapters, params)
        completions = [c for g in groups for c in g]  # [N] group-contiguous, N = prompts x G
        samples = [ex for ex in examples for _ in range(group)]
        t_rollout = time.perf_counter() - t0

        # ---- reward
        results = [ctx.domain.reward(c.text, ex) for c, ex in zip(completions, samples)]
        rewards = torch.tensor([r.score for r in results], dtype=torch.float32)  # [N]
        advantages = losses.group_advantages(rewards, group, scale_by_std=stage.grpo.scale_rewards)  # [N]

        # ---- loss and optimiser step
        batch = build_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions], tok.pad_token_id)
        model.train()
        train_stats = _train_on_batch(ctx, batch.to(device), advantages.to(device), optimizer)
        scheduler.step()

        # ---- log
        last = {
            "step": step + 1,
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "correct_frac": sum(r.correct for r in results) / len(results),
            "zero_variance_groups": losses.zero_variance_group_fraction(rewards, group),
            **train_stats,
            **_length_stats(completions),
            "lr": scheduler.get_last_lr()[0],
            "time_rollout_s": t_rollout,
            "time_step_s": time.perf_counter() - t0,
        }
        append_line(metrics_path, json.dumps(last))
        if ctx.on_step is not None:
            ctx.on_step(step + 1, last)
    return last


def _train_on_batch(
    ctx: StageContext, batch: TokenBatch, advantages: torch.Tensor, optimizer: torch.optim.Optimizer
) -> dict[str, float]:
    """`grpo.iterations` passes of `grad_accum` micro-batches over one batch of rollouts, one step per pass."""
    stage, model = ctx.stage, ctx.model
    n = batch.input_ids.shape[0]
    micro = math.ceil(n / stage.optim.grad_accum)
    total_tokens = batch.response_mask.sum().clamp(min=1.0)
    logp_old = None
    if stage.grpo.iterations > 1:  # off-policy passes need the rollout policy's logprobs
        with torch.no_grad():
            logp_old = _logprobs(model, batch, stage.rollout.temperature)
    sums: dict[str, float] = {}
    params = list(lora_parameters(model, ctx.student).values())
    for _ in range(stage.grpo.iterations):
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, n, micro):
            rows = slice(start, min(n, start + micro))
            mb = batch.select(rows)
            weight = (
                mb.response_mask.sum() / total_tokens
                if stage.grpo.aggregation == "token_mean"
                else torch.tensor(mb.input_ids.shape[0] / n)
            )
            logits = response_logits(model, mb) / stage.rollout.temperature  # [n_mb, R, V]
            logp = losses.gather_logprobs(logits, mb.response_ids)  # [n_mb, R]
            old = logp.detach() if logp_old is None else logp_old[rows]
            token_loss, clip_low, clip_high = losses.clipped_policy_loss(
                logp, old, advantages[rows], stage.grpo.epsilon_low, stage.grpo.epsilon_high, stage.grpo.dual_clip
            )
            terms = {"policy_loss": token_loss}
            if stage.grpo.kl_coef > 0:
                with torch.no_grad(), active_adapters(model, None):
                    ref_logp = _logprobs(model, mb, stage.rollout.temperature)
                terms["kl_base"] = losses.k3_kl(logp, ref_logp)
                token_loss = token_loss + stage.grpo.kl_coef * terms["kl_base"]
            loss = losses.aggregate(token_loss, mb.response_mask, stage.grpo.aggregation, stage.rollout.max_new_tokens)
            (loss * weight).backward()
            with torch.no_grad():
                mask = mb.response_mask
                share = mask.sum() / total_tokens
                for name, values in terms.items():
                    _add(sums, name, (losses.aggregate(values, mask, "token_mean") * share).item())
                _add(sums, "loss", (loss * weight).item())
                _add(
                    sums,
                    "entropy",
                    (losses.aggregate(losses.token_entropy(logits), mask, "token_mean") * share).item(),
                )
                _add(sums, "clip_low_frac", ((clip_low.float() * mask).sum() / total_tokens).item())
                _add(sums, "clip_high_frac", ((clip_high.float() * mask).sum() / total_tokens).item())
        grad_norm = torch.nn.utils.clip_grad_norm_(params, stage.optim.max_grad_norm)
        _add(sums, "grad_norm", grad_norm.item())
        optimizer.step()
    return {k: v / stage.grpo.iterations for k, v in sums.items()}


def _logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float) -> torch.Tensor:
    return losses.gather_logprobs(response_logits(model, batch) / temperature, batch.response_ids)  # [N, R]


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def _length_stats(completions: list[Completion]) -> dict[str, float]:
    lengths = [len(c.token_ids) for c in completions]
    return {
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": float(max(lengths)),
        "truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
    }

"""Per-stage diagnostics measured on the live model, never trained on (docs/design.md §5).

Teacher lift (`teacher_lift`, at the start of a stage whose method has a self-teacher; `eval.teacher_lift_prompts`
> 0): does the teacher, shown its context, answer better than the student? SDPO's premise holds only where it does.
On the stage domain's *train* prompts (never its eval set, which the accuracy matrix reports) in a seeded order, the
first `eval.teacher_lift_prompts` that some rollout could give a context (`teacher.may_get_context`, known from the
method's builder alone: e.g. an SDFT example without a demonstration is passed over without a rollout;
`prompts_tried` counts both):
1. the student samples its group as a rollout of the stage would (`rollout.group_size`, temperature, top_p; a
   seeded draw of its own) and the domain's reward scores it;
2. the method's own builder (`teacher.prompts.TEACHER_PROMPTS[method]`) turns each sample into its teacher prompt
   (a successful sibling, the example's demonstration, and/or the reward's feedback), exactly as a training step;
3. the teacher at stage start answers every teacher prompt that got a context greedily, and the student answers
   the plain prompts that got one greedily (`eval.max_new_tokens`); the domain's reward marks both.
It stops where the answer is known: no prompt that could get a context, nothing is generated; no context after the
rollout, no greedy answer (n = 0 costs the rollout alone).
Steps 2 and 3 are `train.paired_answers`, the measurement the lift gate (`distill.gate`, `train/lift_gate.py`) makes
inside a stage too. Per prompt with at least one context: t_p = the teacher's accuracy over that prompt's contexts,
s_p = the student's greedy correctness. lift = mean_p (t_p − s_p) = teacher accuracy − student accuracy over those n
prompts, with a paired percentile-bootstrap 95 % interval over prompts (`measure.stats.paired_bootstrap_interval`).
`by_context` repeats it per kind of context shown (sibling / demonstration / feedback, "+"-joined when several). Read
with care: a sibling context shows an answer that already solved the prompt, so there the lift measures in-context
copying; and only prompts whose context exists count (for SDPO, prompts the student sometimes solves). The teacher
at stage start is the student itself for stage_start, ema (at rank >= lora.r), lag and trust_region, and the base
for `base`. Written to the stage's `teacher_lift.json` before the first step; a resumed stage keeps the file.

KL from the previous policy (`stage_kl`, after each stage; `eval.stage_kl_prompts` > 0; drift.json `stage_kl`):
RL's Razor (Shenfeld et al. 2025) finds that forgetting follows the forward KL E_{x~τ}[KL(π_0 ‖ π)] from the
pre-training policy π_0 to the trained π on the new task's prompts x ~ τ. Here π_0 = π_{k−1}, the model after the
previous stage (`AdapterPlan.previous`; the base for stage 1), whose accuracies are row k−1 of the matrix against
which the stage's forgetting is measured (`measure.metrics.stage_forgetting`), and π = π_k, the model after the stage.
For a merge init π_{k−1} is the sum of the earlier adapters, not the merged start: the merge's own change counts. On a
seeded sample of the stage domain's train prompts, one response each is sampled from π_{k−1} (temperature 1, top_p
1, the stage's rollout.max_new_tokens); on those tokens the full-vocabulary KL(π_{k−1}(·|y_<t) ‖ π_k(·|y_<t)) is
taken per token (nats, logits at temperature 1). Sampling the prefixes from π_{k−1} is what makes it the forward
KL: by the chain rule the per-response sum of these token KLs is an unbiased estimate of the sequence-level
KL(π_{k−1} ‖ π_k) (`kl_sequence_mean`); `kl_token_mean` averages over response tokens instead. (Prefixes sampled
from π_k would estimate neither direction.) 0 exactly when the stage left the policy unchanged. The full-vocabulary
KL is taken a few responses and a chunk of tokens at a time (`measure/policy_divergence.py`).

Isolation: every measurement runs under `isolated` (global CPU and CUDA RNGs forked, eval mode, the mode restored;
the engines restore active adapters and trainable flags) with seeds of its own, so a run with a diagnostic on trains
bit-identical adapters to one with it off (tests/run/test_diagnostics.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adaptercl.domains import Domain, Example
from adaptercl.measure import ROWS_PER_FORWARD, divergence_sums, token_scores
from adaptercl.model import build_batch, encode_chat
from adaptercl.recipe import StageConfig
from adaptercl.rollout import RolloutEngine, SamplingParams, packed_linears
from adaptercl.teacher import TEACHER_PROMPTS, may_get_context
from adaptercl.train import (  # the lift's measurement and helpers live in train/lift.py, shared with the lift gate
    StageContext,
    isolated,
    lift_summary,
    paired_answers,
    rollout_sampling,
    scored_rollout,
    seeded_sample,
    step_seed,
)

# step_seed offsets of the diagnostics' own draws (the stage's: 1_000_000 data order, 2_000_000 distillation mask,
# 3_000_000 replay); distinct, so no diagnostic reuses a training draw.
LIFT_PROMPTS_SEED = 4_000_000
LIFT_ROLLOUT_SEED = 4_000_001
STAGE_KL_SEED = 5_000_000


def teacher_lift(ctx: StageContext, num_prompts: int, max_new_tokens: int) -> dict[str, Any]:
    """The teacher lift of the stage about to start (see the module docstring): JSON-ready."""
    stage, domain, teacher = ctx.stage, ctx.domain, ctx.teacher
    if teacher is None:
        raise ValueError(f"teacher lift needs the stage's teacher: a {stage.method} stage has none")
    group = stage.rollout.group_size
    order = seeded_sample(domain.train, len(domain.train), step_seed(ctx.recipe.seed, ctx.index, LIFT_PROMPTS_SEED))
    examples, tried = lift_prompts(order, num_prompts, stage)
    record = {
        "method": stage.method,
        "teacher_kind": teacher.kind,
        "prompts": len(examples),  # train prompts rolled out; `n` of them had a context
        "prompts_tried": tried,  # train prompts looked at: those rolled out and those no rollout could give a context
        "group_size": group,
        "interval": "paired percentile bootstrap over prompts, 10000 resamples, 95 %",
    }
    if not examples:  # no train prompt could get a context: nothing to generate
        return {**record, "context_frac": 0.0, "rollout_correct_frac": None, **lift_summary([], [], [], [])}
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    rollout = rollout_sampling(stage, step_seed(ctx.recipe.seed, ctx.index, LIFT_ROLLOUT_SEED))
    with isolated(ctx.model):
        completions, results = scored_rollout(ctx, examples, rollout)  # [N] group-contiguous, N = prompts x G
        pairs = paired_answers(ctx, examples, completions, results, greedy)  # where a context is
    return {
        **record,
        "context_frac": pairs.context_frac,  # samples given a teacher context
        "rollout_correct_frac": pairs.rollout_correct_frac,
        **lift_summary(pairs.prompt_of, pairs.kinds, pairs.teacher_correct, pairs.student_correct),
    }


def lift_prompts(order: list[Example], count: int, stage: StageConfig) -> tuple[list[Example], int]:
    """The first `count` prompts of `order` that some rollout could give a teacher context (`may_get_context`), and how
    many of `order` were looked at to find them; the others are passed over without a rollout."""
    chosen: list[Example] = []
    for start in range(0, len(order), count):
        chunk = order[start : start + count]
        possible = may_get_context(
            TEACHER_PROMPTS[stage.method],
            [ex.messages for ex in chunk],
            [ex.demonstration for ex in chunk],
            stage.rollout.group_size,
            stage.distill,
            stage.hybrid,
        )
        for i, (example, ok) in enumerate(zip(chunk, possible)):
            chosen += [example] if ok else []
            if len(chosen) == count:
                return chosen, start + i + 1
    return chosen, len(order)


@torch.no_grad()
def stage_kl(
    model: torch.nn.Module,
    tokenizer: Any,
    engine: RolloutEngine,
    domain: Domain,
    before: list[str],
    after: list[str],
    num_prompts: int,
    max_new_tokens: int,
    seed: int,
    on_response: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Forward KL(π_before ‖ π_after) on `num_prompts` seeded train prompts of `domain`, one response each sampled
    from π_before (see the module docstring); `before`/`after` are adapter lists ([] = the base). The engine sleeps
    after generating (a colocated vLLM gives the card back), then the responses are scored `ROWS_PER_FORWARD` at a
    time, a chunk of tokens at a time (`measure/policy_divergence.py`); `on_response(done, total)` is called after each
    such batch (progress, in responses)."""
    examples = seeded_sample(domain.train, num_prompts, seed)
    prompts = [encode_chat(tokenizer, ex.messages) for ex in examples]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, seed=seed)
    device = next(model.parameters()).device
    kl_sum, tokens = 0.0, 0
    with isolated(model):
        completions = [g[0] for g in engine.generate(prompts, before or None, params)]
        engine.sleep()  # a colocated vLLM frees the card for the forwards (no-op for the hf engine)
        with packed_linears(model, use="sequences"):  # scoring forwards on oneDNN-packed weights (float32 CPU)
            for start in range(0, len(completions), ROWS_PER_FORWARD):
                chunk = completions[start : start + ROWS_PER_FORWARD]
                prompt_ids, response_ids = [c.prompt_ids for c in chunk], [c.token_ids for c in chunk]
                batch = build_batch(prompt_ids, response_ids, tokenizer.pad_token_id).to(device)
                if batch.response_mask.any():
                    p, q = token_scores(model, batch, before), token_scores(model, batch, after)
                    kl_sum += divergence_sums(p, q, ("kl",))["kl"]
                    tokens += p.tokens
                if on_response is not None:
                    on_response(start + len(chunk), len(completions))
    return {
        "kl_token_mean": kl_sum / tokens if tokens else float("nan"),  # nats per response token
        "kl_sequence_mean": kl_sum / max(1, len(completions)),  # nats per response: the sequence-level KL
        "prompts": len(completions),
        "response_tokens": tokens,
        "before": list(before),
        "after": list(after),
    }

"""Per-stage diagnostics measured on the live model, never trained on (docs/design.md §5).

Teacher lift (`teacher_lift`, at the start of a stage whose method has a self-teacher; `eval.teacher_lift_prompts`
> 0): does the teacher, shown its context, answer better than the student? SDPO's premise holds only where it does.
On a seeded sample of the stage domain's *train* prompts (never its eval set, which the accuracy matrix reports):
1. the student samples its group as a rollout of the stage would (`rollout.group_size`, temperature, top_p; a
   seeded draw of its own) and the domain's reward scores it;
2. the method's own builder (`teacher.prompts.TEACHER_PROMPTS[method]`) turns each sample into its teacher prompt
   (a successful sibling, the example's demonstration, and/or the reward's feedback), exactly as a training step;
3. the teacher at stage start answers every teacher prompt that got a context greedily, and the student answers
   each plain prompt greedily (`eval.max_new_tokens`); the domain's reward marks both.
Per prompt with at least one context: t_p = the teacher's accuracy over that prompt's contexts, s_p = the student's
greedy correctness. lift = mean_p (t_p − s_p) = teacher accuracy − student accuracy over those n prompts, with a
paired percentile-bootstrap 95 % interval over prompts (`measure.stats.paired_bootstrap_interval`). `by_context`
repeats it per kind of context shown (sibling / demonstration / feedback, "+"-joined when several). Read with care: a
sibling context shows an answer that already solved the prompt, so there the lift measures in-context copying;
and only prompts whose context exists count (for SDPO, prompts the student sometimes solves). The teacher at stage
start is the student itself for stage_start, ema (at rank >= lora.r), lag and trust_region, and the base for
`base`. Written to the stage's `teacher_lift.json` before the first step; a resumed stage keeps the file.

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

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from adaptercl.domains import Domain, Example, is_success
from adaptercl.measure import ROWS_PER_FORWARD, divergence_sums, paired_bootstrap_interval, token_scores
from adaptercl.model import build_batch, encode_chat
from adaptercl.rollout import RolloutEngine, SamplingParams
from adaptercl.teacher import TEACHER_PROMPTS, Teacher, TeacherPrompts
from adaptercl.train import StageContext, rollout_sampling, step_seed

# step_seed offsets of the diagnostics' own draws (the stage's: 1_000_000 data order, 2_000_000 distillation mask,
# 3_000_000 replay); distinct, so no diagnostic reuses a training draw.
LIFT_PROMPTS_SEED = 4_000_000
LIFT_ROLLOUT_SEED = 4_000_001
STAGE_KL_SEED = 5_000_000

T = TypeVar("T")


@contextmanager
def isolated(model: torch.nn.Module) -> Iterator[None]:
    """Run a measurement without touching training: global RNGs forked (CPU and CUDA), eval mode, mode restored."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    was_training = model.training
    with torch.random.fork_rng(devices=devices):
        model.eval()
        try:
            yield
        finally:
            model.train(was_training)


def seeded_sample(items: Sequence[T], count: int, seed: int) -> list[T]:
    """`count` distinct items (all when there are fewer), in a seeded random order; the global RNG is untouched."""
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed))[:count].tolist()
    return [items[i] for i in order]


def teacher_lift(ctx: StageContext, num_prompts: int, max_new_tokens: int) -> dict[str, Any]:
    """The teacher lift of the stage about to start (see the module docstring): JSON-ready."""
    stage, tok, domain, teacher = ctx.stage, ctx.tokenizer, ctx.domain, ctx.teacher
    if teacher is None:
        raise ValueError(f"teacher lift needs the stage's teacher: a {stage.method} stage has none")
    group = stage.rollout.group_size
    examples = seeded_sample(domain.train, num_prompts, step_seed(ctx.recipe.seed, ctx.index, LIFT_PROMPTS_SEED))
    prompt_ids = [encode_chat(tok, ex.messages) for ex in examples]
    samples = [ex for ex in examples for _ in range(group)]  # [N] group-contiguous, N = prompts x G
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    rollout = rollout_sampling(stage, step_seed(ctx.recipe.seed, ctx.index, LIFT_ROLLOUT_SEED))
    with isolated(ctx.model):
        completions = [c for g in ctx.engine.generate(prompt_ids, ctx.policy_adapters, rollout) for c in g]  # [N]
        results = domain.score([c.text for c in completions], [c.token_ids for c in completions], samples)
        shown = TEACHER_PROMPTS[stage.method](
            [ex.messages for ex in samples],
            [c.text for c in completions],
            [is_success(r, stage.distill.success_threshold) for r in results],
            [r.feedback for r in results],
            [ex.demonstration for ex in samples],
            group,
            stage.distill,
            stage.hybrid,
        )
        student = greedy_correct(ctx.engine, domain, examples, prompt_ids, ctx.policy_adapters, greedy)  # [P]
        with_context = [i for i, has in enumerate(shown.has_target) if has]
        teacher_prompts = [encode_chat(tok, shown.messages[i]) for i in with_context]
        with_context_examples = [samples[i] for i in with_context]
        teacher_correct = greedy_correct(
            ctx.engine, domain, with_context_examples, teacher_prompts, teacher_adapters(teacher), greedy
        )
    summary = lift_summary(
        [i // group for i in with_context], [context_kind(shown, i) for i in with_context], teacher_correct, student
    )
    return {
        "method": stage.method,
        "teacher_kind": teacher.kind,
        "prompts": len(examples),  # sampled train prompts; `n` of them had a context
        "group_size": group,
        "context_frac": len(with_context) / max(1, len(samples)),  # samples given a teacher context
        "rollout_correct_frac": sum(r.correct for r in results) / max(1, len(results)),
        "student_accuracy_all": sum(student) / max(1, len(student)),  # greedy, over every sampled prompt
        "interval": "paired percentile bootstrap over prompts, 10000 resamples, 95 %",
        **summary,
    }


def teacher_adapters(teacher: Teacher) -> list[str] | None:
    """The adapters that decode as the teacher at stage start (None: the base). A trust-region teacher mixes its
    stage-start copy with the student, which are equal at stage start, so its copy alone is that teacher."""
    return None if teacher.adapter is None else [*teacher.frozen, teacher.adapter]


def context_kind(shown: TeacherPrompts, i: int) -> str:
    """What sample i's teacher prompt shows: sibling, demonstration and/or feedback, "+"-joined."""
    parts = (
        ("sibling", shown.used_solution[i]),
        ("demonstration", shown.used_demonstration[i]),
        ("feedback", shown.used_feedback[i]),
    )
    return "+".join(name for name, used in parts if used) or "none"


def greedy_correct(
    engine: RolloutEngine,
    domain: Domain,
    examples: list[Example],
    prompt_ids: list[list[int]],
    adapters: list[str] | None,
    params: SamplingParams,
) -> list[bool]:
    """Whether the greedy answer to each prompt is correct by the domain's reward; identical prompts decode once."""
    unique = list(dict.fromkeys(tuple(p) for p in prompt_ids))
    if not unique:
        return []
    answers = engine.generate([list(p) for p in unique], adapters, params)
    answer_of = {p: g[0] for p, g in zip(unique, answers)}
    chosen = [answer_of[tuple(p)] for p in prompt_ids]
    return [bool(r.correct) for r in domain.score([c.text for c in chosen], [c.token_ids for c in chosen], examples)]


def lift_summary(
    prompt_of: list[int], kinds: list[str], teacher_correct: list[bool], student_correct: list[bool], seed: int = 0
) -> dict[str, Any]:
    """Teacher lift from the samples that had a context (pure; see the module docstring).

    prompt_of[i], kinds[i], teacher_correct[i]: sample i's prompt index, context kind and whether the teacher's
    greedy answer to its teacher prompt was correct; student_correct[p]: the student's greedy answer to prompt p.
    Returns n (prompts), teacher_accuracy, student_accuracy, lift, lift_ci95 ([lo, hi]) and by_context (the same
    per context kind); accuracies are None where n = 0.
    """

    def summarise(rows: list[int]) -> dict[str, Any]:
        per_prompt: dict[int, list[bool]] = {}
        for i in rows:
            per_prompt.setdefault(prompt_of[i], []).append(teacher_correct[i])
        t = [sum(v) / len(v) for v in per_prompt.values()]  # [n] teacher accuracy per prompt
        s = [float(student_correct[p]) for p in per_prompt]  # [n]
        interval = paired_bootstrap_interval([a - b for a, b in zip(t, s)], seed=seed)
        n = len(t)
        return {
            "n": n,
            "teacher_accuracy": sum(t) / n if n else None,
            "student_accuracy": sum(s) / n if n else None,
            "lift": (sum(t) - sum(s)) / n if n else None,
            "lift_ci95": None if interval is None else list(interval),
        }

    rows = list(range(len(prompt_of)))
    by_context = {kind: summarise([i for i in rows if kinds[i] == kind]) for kind in sorted(set(kinds))}
    return {**summarise(rows), "by_context": by_context}


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
        for start in range(0, len(completions), ROWS_PER_FORWARD):
            chunk = completions[start : start + ROWS_PER_FORWARD]
            batch = build_batch([c.prompt_ids for c in chunk], [c.token_ids for c in chunk], tokenizer.pad_token_id)
            batch = batch.to(device)
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

"""The teacher's lift over the student, measured on the live model: the paired measurement that the `teacher_lift`
diagnostic (`run/diagnostics.py`, at a stage's start) and the lift gate (`lift_gate.py`, inside a stage) both make.

Given a group rollout of some train prompts, already scored by the domain's reward (`paired_answers`):
1. the method's own builder (`teacher.TEACHER_PROMPTS[method]`) turns each sample into its teacher prompt (a
   successful sibling, the example's demonstration, and/or the reward's feedback), exactly as a training step;
2. the teacher as it is now answers every teacher prompt that got a context greedily, and the student answers the
   plain prompts greedily; the domain's reward marks both. Identical prompts decode once (`greedy_correct`): an SDPO
   group whose failures are all shown the same sibling costs one teacher decode.
Per prompt with at least one context (`lift_evidence`, pure): t_p = the teacher's accuracy over that prompt's
contexts, s_p = the student's greedy correctness. lift = mean_p (t_p − s_p) over those n prompts. The exact test the
lift gate decides on needs one binary outcome a side per prompt: the teacher's answer on one of the prompt's contexts,
picked uniformly by a seeded draw that sees only how many contexts each prompt has. Its expectation is t_p, so a
teacher-only win (picked answer right, student wrong) is at least as likely as a student-only win exactly when the
teacher is at least as accurate as the student: the one-sided sign test on those discordant prompts
(`measure.stats.sign_test_p`, ties dropped) is an exact test of lift <= 0 at any n. Counting t_p > s_p instead
would not be: a prompt with k contexts, each right with the student's own accuracy q, would be a teacher win with
chance (1 − q)(1 − (1 − q)^k) and a student win with q(1 − q^k), unequal for k > 1. `lift_summary` adds a
descriptive paired percentile-bootstrap 95 % interval of the lift over prompts (`measure.paired_bootstrap_interval`;
with fewer than ~20 prompts it is narrower than it should be, so nothing decides on it). Greedy on both sides, the
student's answer independent of the draw that gave the contexts: the rollouts' own correctness would compare a
sampled student with a greedy teacher, and for a sibling context it is conditioned on a success in that very group.

Which adapters decode as the teacher (`teacher_adapters`): its own adapter over the frozen earlier ones (None: the
base). A trust-region teacher mixes logits, which no engine decodes: its stage-start copy stands for it, exact at the
stage start (the student and the copy are equal there) and afterwards the mixture's (1 − c) = 0.95 share.

Isolation (`isolated`): the measurement forks the global CPU and CUDA RNGs and runs in eval mode, restoring the mode;
the engines restore active adapters and trainable flags; its draws have seeds of their own. So a stage that measures
trains bit-identical adapters to one that does not (tests/run/test_diagnostics.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from adaptercl.domains import Domain, Example, RewardResult, is_success
from adaptercl.measure import paired_bootstrap_interval, sign_test_p
from adaptercl.model import encode_chat
from adaptercl.rollout import Completion, RolloutEngine, SamplingParams
from adaptercl.teacher import TEACHER_PROMPTS, Teacher, TeacherPrompts
from adaptercl.train.context import StageContext

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


def scored_rollout(
    ctx: StageContext, examples: list[Example], params: SamplingParams
) -> tuple[list[Completion], list[RewardResult]]:
    """A group rollout of `examples` [P] from the student at `params` (`params.n` samples each), scored by the
    domain's reward: completions and results [P x n], group-contiguous."""
    prompts = [encode_chat(ctx.tokenizer, ex.messages) for ex in examples]
    completions = [c for g in ctx.engine.generate(prompts, ctx.policy_adapters, params) for c in g]  # [P x n]
    samples = [ex for ex in examples for _ in range(params.n)]
    return completions, ctx.domain.score([c.text for c in completions], [c.token_ids for c in completions], samples)


@dataclass
class LiftPairs:
    """The greedy answers of one measurement on P prompts (N = P x G samples, group-contiguous)."""

    prompt_of: list[int]  # [n_c] per sample with a context: its prompt's index
    kinds: list[str]  # [n_c] what its teacher prompt shows (`context_kind`)
    teacher_correct: list[bool]  # [n_c] the teacher's greedy answer to its teacher prompt is correct
    student_correct: list[bool | None]  # [P] the student's greedy answer; None where not decoded (no context)
    context_frac: float  # samples given a teacher context
    rollout_correct_frac: float  # the rollouts' own correctness (`RewardResult.correct`)


def paired_answers(
    ctx: StageContext,
    examples: list[Example],
    completions: list[Completion],
    results: list[RewardResult],
    params: SamplingParams,
) -> LiftPairs:
    """The teacher's and the student's greedy answers on `examples` [P] whose group rollout `completions` [P x G] was
    scored `results` (see the module docstring); `params` the greedy decoding. The student is decoded only on the
    prompts where a context exists (the lift needs no more). Call it inside `isolated`."""
    stage, tok, domain, group = ctx.stage, ctx.tokenizer, ctx.domain, ctx.stage.rollout.group_size
    samples = [ex for ex in examples for _ in range(group)]  # [N]
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
    with_context = [i for i, has in enumerate(shown.has_target) if has]
    prompt_of = [i // group for i in with_context]
    decoded = sorted(set(prompt_of))
    student_ids = [encode_chat(tok, examples[p].messages) for p in decoded]
    answers = greedy_correct(
        ctx.engine, domain, [examples[p] for p in decoded], student_ids, ctx.policy_adapters, params
    )
    student: list[bool | None] = [None] * len(examples)
    for p, correct in zip(decoded, answers):
        student[p] = correct
    teacher_ids = [encode_chat(tok, shown.messages[i]) for i in with_context]
    teacher = greedy_correct(
        ctx.engine, domain, [samples[i] for i in with_context], teacher_ids, teacher_adapters(ctx.teacher), params
    )
    return LiftPairs(
        prompt_of=prompt_of,
        kinds=[context_kind(shown, i) for i in with_context],
        teacher_correct=teacher,
        student_correct=student,
        context_frac=len(with_context) / max(1, len(samples)),
        rollout_correct_frac=sum(r.correct for r in results) / max(1, len(results)),
    )


def teacher_adapters(teacher: Teacher) -> list[str] | None:
    """The adapters that decode as the teacher (None: the base). A trust-region teacher mixes its stage-start copy
    with the student, which are equal at stage start, so its copy alone is that teacher there (module docstring)."""
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


def lift_evidence(
    prompt_of: Sequence[int], teacher_correct: Sequence[bool], student_correct: Sequence[bool | None], seed: int = 0
) -> dict[str, Any]:
    """The lift and its exact test from the samples that had a context (pure; see the module docstring).

    prompt_of[i], teacher_correct[i]: sample i's prompt index and whether the teacher's greedy answer to its teacher
    prompt was correct; student_correct[p]: the student's greedy answer to prompt p; `seed`: the draw of one context
    per prompt. Returns n (prompts with a context), teacher_accuracy, student_accuracy and lift (None where n = 0),
    teacher_wins and student_wins (discordant prompts of the picked answers) and sign_test_p (one-sided, ties
    dropped; 1.0 without a discordant prompt).
    """
    per_prompt: dict[int, list[bool]] = {}
    for p, correct in zip(prompt_of, teacher_correct):
        per_prompt.setdefault(p, []).append(bool(correct))
    n = len(per_prompt)
    contexts = torch.tensor([len(v) for v in per_prompt.values()], dtype=torch.float64)  # [n]
    uniform = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)  # [n]
    pick = torch.minimum((uniform * contexts).long(), contexts.long() - 1).tolist()  # [n] in 0..k_p - 1
    t = [sum(v) / len(v) for v in per_prompt.values()]  # [n] teacher accuracy per prompt
    s = [bool(student_correct[p]) for p in per_prompt]  # [n]
    picked = [v[k] for v, k in zip(per_prompt.values(), pick)]  # [n] one teacher answer per prompt
    wins = sum(a and not b for a, b in zip(picked, s))
    losses = sum(b and not a for a, b in zip(picked, s))
    return {
        "n": n,
        "teacher_accuracy": sum(t) / n if n else None,
        "student_accuracy": sum(s) / n if n else None,
        "lift": (sum(t) - sum(s)) / n if n else None,
        "teacher_wins": wins,
        "student_wins": losses,
        "sign_test_p": sign_test_p(wins, losses),
    }


def lift_summary(
    prompt_of: list[int],
    kinds: list[str],
    teacher_correct: list[bool],
    student_correct: Sequence[bool | None],
    seed: int = 0,
) -> dict[str, Any]:
    """`lift_evidence` with the lift's descriptive bootstrap interval, overall and per context kind (pure).

    kinds[i]: what sample i's teacher prompt shows (the rest as `lift_evidence`). Returns `lift_evidence`'s figures,
    lift_ci95 ([lo, hi], the paired percentile bootstrap over prompts; None where n = 0) and by_context (the same per
    context kind).
    """

    def summarise(rows: list[int]) -> dict[str, Any]:
        prompts, teacher = [prompt_of[i] for i in rows], [teacher_correct[i] for i in rows]
        evidence = lift_evidence(prompts, teacher, student_correct, seed)
        per_prompt: dict[int, list[bool]] = {}
        for i in rows:
            per_prompt.setdefault(prompt_of[i], []).append(teacher_correct[i])
        lifts = [sum(v) / len(v) - float(student_correct[p]) for p, v in per_prompt.items()]  # [n] t_p - s_p
        interval = paired_bootstrap_interval(lifts, seed=seed)
        return {**evidence, "lift_ci95": None if interval is None else list(interval)}

    rows = list(range(len(prompt_of)))
    by_context = {kind: summarise([i for i in rows if kinds[i] == kind]) for kind in sorted(set(kinds))}
    return {**summarise(rows), "by_context": by_context}

"""Teacher prompts for SDPO and SDFT (pure functions on messages and strings; docs/design.md §4).

- `sdpo_teacher_prompts`: each sample's prompt is re-asked with the first *successful sibling* of its group
  (`domains.is_success`: the domain's correct decision for TRL-style rewards, reward >= `distill.success_threshold`
  for native ones; the sample itself excluded, `<think>...</think>` stripped) and, only when no sibling succeeded,
  with the reward function's feedback string. As lasgroup/SDPO and TRL's
  `SuccessfulRolloutTeacherContextBuilder` (same regex, same templates, `dont_reprompt_on_self_success=True`,
  `environment_feedback_only_without_solution=True`).
- `sdft_teacher_prompts`: the SDFT demonstration prompt from the example's `demonstration` field.
The teacher message keeps every message before the last user turn (system messages, earlier turns, as TRL
does) and replaces that turn with the reprompt. A sample with no context keeps its own prompt and gets
`has_target = False`: the stage gives it distillation mask 0 and logs the fraction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from adaptercl.method_config import DistillConfig

THINK_BLOCK = re.compile(r"<think>.*?</think>", flags=re.DOTALL)


@dataclass
class TeacherPrompts:
    """Teacher prompts of one batch, one per sample (group-contiguous, as the rollouts)."""

    messages: list[list[dict[str, str]]]  # [N] the teacher's chat; a sample without a target keeps its own prompt
    has_target: list[bool]  # [N] whether the sample has a teacher context (else distillation mask 0)
    used_solution: list[bool]  # [N] a successful sibling was shown
    used_feedback: list[bool]  # [N] the reward function's feedback was shown
    succeeded: list[bool]  # [N] the sample itself is a success (`domains.is_success`)
    used_demonstration: list[bool] = field(default_factory=list)  # [N] the example's demonstration was shown

    def append(
        self,
        messages: list[dict[str, str]],
        has_target: bool,
        used_solution: bool = False,
        used_feedback: bool = False,
        used_demonstration: bool = False,
    ) -> None:
        """One more sample's teacher prompt and what it shows."""
        self.messages.append(messages)
        self.has_target.append(has_target)
        self.used_solution.append(used_solution)
        self.used_feedback.append(used_feedback)
        self.used_demonstration.append(used_demonstration)

    def stats(self) -> dict[str, float]:
        n = max(1, len(self.has_target))
        return {
            "teacher_target_frac": sum(self.has_target) / n,
            "success_frac": sum(self.succeeded) / n,
            "solution_used_frac": sum(self.used_solution) / n,
            "feedback_used_frac": sum(self.used_feedback) / n,
        }


def strip_think(text: str) -> str:
    """Remove `<think>...</think>` blocks and surrounding whitespace (lasgroup/SDPO, TRL)."""
    return THINK_BLOCK.sub("", text).strip()


def last_user_index(messages: list[dict[str, str]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            return i
    raise ValueError("a prompt needs a user message to build a teacher prompt from")


def with_last_user_turn(messages: list[dict[str, str]], content: str) -> list[dict[str, str]]:
    """The messages before the last user turn (system messages, earlier turns), then a user turn `content`."""
    i = last_user_index(messages)
    return [dict(m) for m in messages[:i]] + [{"role": "user", "content": content}]


def sdpo_teacher_prompts(
    prompts: list[list[dict[str, str]]],
    responses: list[str],
    succeeded: list[bool],
    feedbacks: list[str | None],
    group_size: int,
    cfg: DistillConfig,
) -> TeacherPrompts:
    """SDPO reprompts for N = P x G group-contiguous samples (see the module docstring); `succeeded` [N] is
    `domains.is_success` of each sample."""
    n = len(prompts)
    if not (len(responses) == len(succeeded) == len(feedbacks) == n) or n % group_size != 0:
        raise ValueError(f"sdpo_teacher_prompts: {n} prompts do not match the responses/scores/groups of {group_size}")
    out = TeacherPrompts([], [], [], [], list(succeeded))
    for i in range(n):
        start = (i // group_size) * group_size
        sibling = next((j for j in range(start, start + group_size) if j != i and succeeded[j]), None)
        feedback = feedbacks[i]
        use_feedback = sibling is None and cfg.use_feedback and isinstance(feedback, str) and feedback.strip() != ""
        if sibling is None and not use_feedback:
            out.append(prompts[i], has_target=False)
            continue
        solution = ""
        if sibling is not None:
            demo = strip_think(responses[sibling]) if cfg.strip_think else responses[sibling]
            solution = cfg.solution_template.format(successful_previous_attempt=demo)
        feedback_text = cfg.feedback_template.format(feedback_raw=feedback) if use_feedback else ""
        question = prompts[i][last_user_index(prompts[i])]["content"]
        reprompt = cfg.reprompt_template.format(prompt=question, solution=solution, feedback=feedback_text)
        out.append(with_last_user_turn(prompts[i], reprompt), True, sibling is not None, use_feedback)
    return out


def sdft_teacher_prompts(
    prompts: list[list[dict[str, str]]],
    demonstrations: list[str | None],
    succeeded: list[bool],
    cfg: DistillConfig,
) -> TeacherPrompts:
    """SDFT demonstration prompts; a sample whose example has no demonstration gets no target (`succeeded` [N]
    only feeds the success_frac statistic)."""
    out = TeacherPrompts([], [], [], [], list(succeeded))
    for messages, demo in zip(prompts, demonstrations, strict=True):
        has = isinstance(demo, str) and demo.strip() != ""
        if has:
            question = messages[last_user_index(messages)]["content"]
            messages = with_last_user_turn(
                messages, cfg.demonstration_template.format(question=question, demonstration=demo)
            )
        out.append(messages, has_target=has, used_demonstration=has)
    return out


def hybrid_teacher_prompts(
    prompts: list[list[dict[str, str]]],
    responses: list[str],
    succeeded: list[bool],
    feedbacks: list[str | None],
    demonstrations: list[str | None],
    group_size: int,
    cfg: DistillConfig,
    failed_groups_only: bool,
) -> TeacherPrompts:
    """Hybrid teacher prompts of N = P x G group-contiguous samples: where `failed_groups_only`, only samples of
    groups without a success get a context (see `hybrid.py`'s docstring); the context is the first successful
    sibling, else the example's demonstration, and/or the reward feedback when no sibling succeeded. `succeeded`
    [N] is `domains.is_success` of each sample."""
    n = len(prompts)
    if not (len(responses) == len(succeeded) == len(feedbacks) == len(demonstrations) == n) or n % group_size:
        raise ValueError(f"hybrid_teacher_prompts: {n} prompts do not match the other lists or groups of {group_size}")
    out = TeacherPrompts([], [], [], [], list(succeeded))
    for i in range(n):
        start = (i // group_size) * group_size
        group_failed = not any(succeeded[start : start + group_size])
        allowed = group_failed or not failed_groups_only
        sibling = next((j for j in range(start, start + group_size) if j != i and succeeded[j]), None)
        solution_text, from_demonstration = None, False
        if allowed and sibling is not None:
            solution_text = strip_think(responses[sibling]) if cfg.strip_think else responses[sibling]
        elif allowed and isinstance(demonstrations[i], str) and demonstrations[i].strip():
            solution_text, from_demonstration = demonstrations[i], True
        feedback = feedbacks[i]
        use_feedback = (
            allowed and sibling is None and cfg.use_feedback and bool(isinstance(feedback, str) and feedback.strip())
        )
        if solution_text is None and not use_feedback:
            out.append(prompts[i], has_target=False)
            continue
        solution = (
            "" if solution_text is None else cfg.solution_template.format(successful_previous_attempt=solution_text)
        )
        feedback_text = cfg.feedback_template.format(feedback_raw=feedback) if use_feedback else ""
        question = prompts[i][last_user_index(prompts[i])]["content"]
        reprompt = cfg.reprompt_template.format(prompt=question, solution=solution, feedback=feedback_text)
        shown = with_last_user_turn(prompts[i], reprompt)
        out.append(shown, True, sibling is not None, use_feedback, from_demonstration)
    return out

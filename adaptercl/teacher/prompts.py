"""Teacher prompts for SDPO and SDFT (pure functions on messages and strings; docs/design.md §4).

- `sdpo_teacher_prompts`: each sample's prompt is re-asked with the first *successful sibling* of its group
  (`domains.is_success`: the domain's correct decision for TRL-style rewards, reward >= `distill.success_threshold`
  for native ones; the sample itself excluded, `<think>...</think>` stripped) and, only when no sibling succeeded,
  with the reward function's feedback string. As lasgroup/SDPO and TRL's
  `SuccessfulRolloutTeacherContextBuilder` (same regex, same templates, `dont_reprompt_on_self_success=True`,
  `environment_feedback_only_without_solution=True`).
- `sdft_teacher_prompts`: the SDFT demonstration prompt from the example's `demonstration` field.
- `hybrid_teacher_prompts`: the hybrid's sparse choice (`train/sparse_targets.py`).
`TEACHER_PROMPTS` holds each self-teacher method's builder under one signature (`TeacherPromptBuilder`): the
training step (`distill_targets`) and the teacher lift (`diagnostics`) call it; `recipe.method_table.METHODS` says
which methods have one (`needs_teacher`), and the two are checked to agree. `may_get_context` says, from a builder
alone, which prompts no rollout can give a context (the teacher lift passes them over without rolling them out).
- `srpo_teacher_prompts`: SRPO's routing (`srpo_routes`, docs/design.md §4a): only a sample that failed and has a
  successful sibling gets a context, SDPO's reprompt with that sibling; every other sample goes to GRPO.
The teacher message keeps every message before the last user turn (system messages, earlier turns, as TRL
does) and replaces that turn with the reprompt. A sample with no context keeps its own prompt and gets
`has_target = False`: the stage gives it distillation mask 0 and logs the fraction.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from adaptercl.recipe import METHODS, DistillConfig, HybridConfig

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
    groups without a success get a context (see `train/sparse_targets.py`'s docstring); the context is the first
    successful sibling, else the example's demonstration, and/or the reward feedback when no sibling succeeded.
    `succeeded` [N] is `domains.is_success` of each sample."""
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


def srpo_routes(succeeded: list[bool], group_size: int) -> list[bool]:
    """SRPO's route of N = P x G group-contiguous samples: z^S_i = (1 - c_i)·m_i, True for the SDPO term, False for
    GRPO's. c_i = `succeeded[i]`; m_i = some *other* sample of i's group succeeded. So a success goes to GRPO (with or
    without a successful sibling), a failure with a successful sibling to SDPO, a failure of an all-failed group to
    GRPO (advantage 0 there)."""
    if len(succeeded) % group_size:
        raise ValueError(f"srpo_routes: {len(succeeded)} samples do not split into groups of {group_size}")
    routes = []
    for start in range(0, len(succeeded), group_size):
        group = succeeded[start : start + group_size]
        routes += [not c and sum(group) - c > 0 for c in group]
    return routes


def srpo_route_stats(succeeded: list[bool], routed: list[bool], group_size: int) -> dict[str, float]:
    """The step's routing: the share of samples routed to SDPO and the share of groups with no success."""
    groups = [succeeded[i : i + group_size] for i in range(0, len(succeeded), group_size)]
    return {
        "sdpo_route_frac": sum(routed) / max(1, len(routed)),
        "all_wrong_group_frac": sum(not any(g) for g in groups) / max(1, len(groups)),
    }


def srpo_teacher_prompts(
    prompts: list[list[dict[str, str]]],
    responses: list[str],
    succeeded: list[bool],
    group_size: int,
    cfg: DistillConfig,
) -> TeacherPrompts:
    """SRPO teacher prompts of N = P x G group-contiguous samples: a sample routed to SDPO (`srpo_routes`) gets
    exactly SDPO's reprompt (`sdpo_teacher_prompts`: the first successful sibling, itself excluded); every other sample
    keeps its own prompt and gets no target (it goes to GRPO). `succeeded` [N] is `domains.is_success` of each sample,
    the one success decision SDPO's sibling choice also uses (for TRL-style rewards the domain's `correct_from`, the
    accuracy matrix's): c_i of the route and the sibling shown are the same decision. No feedback: SRPO routes by
    siblings only.

    Wording: lasgroup/SDPO's reprompt strings (`distill.reprompt_template`, `solution_template`), not the SRPO paper's
    "{question}\nCorrect solution:\n{sibling_response}\nCorrectly solve the original question.", which differs only
    in blank lines as printed in the paper's text; the reference code's exact strings are the ones a run can be
    compared with. A recipe can set the paper's through those two templates.
    """
    sdpo = sdpo_teacher_prompts(prompts, responses, succeeded, [None] * len(prompts), group_size, cfg)
    routed = srpo_routes(sdpo.succeeded, group_size)
    out = TeacherPrompts([], [], [], [], sdpo.succeeded)
    for i, to_sdpo in enumerate(routed):
        if to_sdpo:  # a failure with a successful sibling: SDPO showed it that sibling
            out.append(sdpo.messages[i], has_target=True, used_solution=True)
        else:
            out.append(prompts[i], has_target=False)
    return out


# ------------------------------------------------------------------------------------ the builder of each method

Messages = list[dict[str, str]]

# (prompts [N], responses [N], succeeded [N] (`domains.is_success`), feedbacks [N], demonstrations [N], group size,
# the stage's distill and hybrid blocks) -> the teacher's prompts [N]
TeacherPromptBuilder = Callable[
    [list[Messages], list[str], list[bool], list["str | None"], list["str | None"], int, DistillConfig, HybridConfig],
    TeacherPrompts,
]


def _sdpo(prompts, responses, succeeded, feedbacks, demonstrations, group_size, distill, hybrid) -> TeacherPrompts:
    return sdpo_teacher_prompts(prompts, responses, succeeded, feedbacks, group_size, distill)


def _sdft(prompts, responses, succeeded, feedbacks, demonstrations, group_size, distill, hybrid) -> TeacherPrompts:
    return sdft_teacher_prompts(prompts, demonstrations, succeeded, distill)


def _hybrid(prompts, responses, succeeded, feedbacks, demonstrations, group_size, distill, hybrid) -> TeacherPrompts:
    failed_groups_only = hybrid.distill_on == "failed_groups"
    return hybrid_teacher_prompts(
        prompts, responses, succeeded, feedbacks, demonstrations, group_size, distill, failed_groups_only
    )


def _srpo(prompts, responses, succeeded, feedbacks, demonstrations, group_size, distill, hybrid) -> TeacherPrompts:
    return srpo_teacher_prompts(prompts, responses, succeeded, group_size, distill)


TEACHER_PROMPTS: dict[str, TeacherPromptBuilder] = {"sdpo": _sdpo, "sdft": _sdft, "hybrid": _hybrid, "srpo": _srpo}
assert set(TEACHER_PROMPTS) == {name for name, spec in METHODS.items() if spec.needs_teacher}, (
    "TEACHER_PROMPTS has a builder for every method of METHODS with a self-teacher, and only those"
)


def may_get_context(
    build: TeacherPromptBuilder,
    prompts: list[Messages],
    demonstrations: list[str | None],
    group_size: int,
    distill: DistillConfig,
    hybrid: HybridConfig,
) -> list[bool]:
    """[P] whether some rollout of prompt p's group could give one of its samples a teacher context under `build`,
    known without rolling out: the union over three outcomes of the group, each sample with a feedback string: all
    failed, the first succeeded and the others failed, all succeeded. A builder of `TEACHER_PROMPTS` shows a successful
    sibling (the second outcome gives one to every sample but the first, SRPO's failures included), feedback (the
    first, a group without a success) or the example's demonstration (any), and more feedback never takes a context
    away: so a prompt without a context in all three gets none from any rollout (tests/teacher/test_teacher.py checks
    every outcome of small groups). The teacher lift passes such prompts over without rolling them out."""
    samples = [m for m in prompts for _ in range(group_size)]  # [N] group-contiguous
    demos = [d for d in demonstrations for _ in range(group_size)]  # [N]
    placeholder = ["..."] * len(samples)  # [N] a response, a feedback string
    possible = [False] * len(prompts)
    for outcome in ([False] * group_size, [True] + [False] * (group_size - 1), [True] * group_size):
        shown = build(samples, placeholder, outcome * len(prompts), placeholder, demos, group_size, distill, hybrid)
        for i, has in enumerate(shown.has_target):
            possible[i // group_size] = possible[i // group_size] or has
    return possible

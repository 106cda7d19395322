"""The training methods, one row each in `METHODS`: which loss terms a method's step adds, whether it needs a
self-teacher and how that teacher's prompts are built, and the method's defaults and constraints.

Everything that differs between grpo, sdpo, sdft and hybrid is declared here, so adding a method is one row (and its
teacher-prompt builder): the recipe grammar reads the defaults and constraints (`config.StageConfig`), the run
creates a teacher when `needs_teacher`, `distill_targets` calls `teacher_prompts`, and the training step adds the
policy term when `policy_term` and the distillation term with weight `distill_weight(stage.hybrid)`. Nothing else
compares a method's name. No torch import (the grammar uses this table).

| method | policy term (clipped GRPO) | distillation term     | default teacher | α   | τ    | skipped | support   |
|--------|----------------------------|-----------------------|-----------------|-----|------|---------|-----------|
| grpo   | yes                        | no                    | (none)          | -   | -    | -       | -         |
| sdpo   | no (as the released code)  | weight 1              | ema             | 0.5 | 0.05 | 0       | top-100   |
| sdft   | no                         | weight 1              | ema             | 0   | 0.01 | 3       | full      |
| hybrid | yes                        | hybrid.distill_weight | stage_start     | 1   | 0.05 | 0       | top-100   |

(skipped: first response tokens without a distillation loss; top-100 has a tail bucket.) sdpo's α 0.5 / τ 0.05 /
top-100 + tail and sdft's α 0 (forward KL) / τ 0.01 / 3 skipped tokens / full vocabulary are the reference codes'
settings (lasgroup/SDPO, the SDFT trainer); the hybrid's sparse, frozen-teacher reverse KL is this toolkit's own
method (`hybrid.py`). The default distillation aggregation of sdpo and sdft is the references'
`seq_mean_token_mean_all` (a sample without a teacher target counts 0, so sparse targets give a smaller step); the
hybrid's is `token_mean` over its distilled tokens, so λ weights the mean divergence whatever fraction of the batch
is distilled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from adaptercl.method_config import Aggregation, DistillConfig, HybridConfig, Support, TeacherKind
from adaptercl.teacher_prompts import (
    TeacherPrompts,
    hybrid_teacher_prompts,
    sdft_teacher_prompts,
    sdpo_teacher_prompts,
)

Method = Literal["grpo", "sdpo", "sdft", "hybrid"]
Messages = list[dict[str, str]]

# (prompts [N], responses [N], succeeded [N] (`domains.is_success`), feedbacks [N], demonstrations [N], group size,
# the stage's distill and hybrid blocks) -> the teacher's prompts [N]
TeacherPromptBuilder = Callable[
    [list[Messages], list[str], list[bool], list["str | None"], list["str | None"], int, DistillConfig, HybridConfig],
    TeacherPrompts,
]


@dataclass(frozen=True)
class MethodSpec:
    """What one training method is made of."""

    policy_term: bool  # the step adds the clipped policy-gradient (GRPO) term
    teacher_prompts: TeacherPromptBuilder | None  # distillation: how the teacher's context is built (None: no teacher)
    distill_weight: Callable[[HybridConfig], float]  # weight of the distillation term (from the stage's hybrid block)
    teacher_kind: TeacherKind  # default distill.teacher.kind
    tau: float  # default distill.teacher.tau (EMA rate)
    alpha: float  # default distill.alpha (0 forward KL, 1 reverse KL, else JSD)
    skip_first_tokens: int  # default distill.skip_first_tokens
    support: Support  # default distill.support
    topk: int  # default distill.topk (for `topk` support)
    distill_aggregation: Aggregation = "token_mean"  # default distill.aggregation
    teacher_kinds: tuple[TeacherKind, ...] | None = None  # the teacher kinds allowed (None: any)
    one_sample_per_prompt: bool = False  # rollout.group_size must be 1
    sparse_token_selection: bool = False  # hybrid.distill_on chooses the distilled tokens (`hybrid.py`)

    @property
    def needs_teacher(self) -> bool:
        return self.teacher_prompts is not None


def _sdpo(prompts, responses, succeeded, feedbacks, demonstrations, group_size, distill, hybrid) -> TeacherPrompts:
    return sdpo_teacher_prompts(prompts, responses, succeeded, feedbacks, group_size, distill)


def _sdft(prompts, responses, succeeded, feedbacks, demonstrations, group_size, distill, hybrid) -> TeacherPrompts:
    return sdft_teacher_prompts(prompts, demonstrations, succeeded, distill)


def _hybrid(prompts, responses, succeeded, feedbacks, demonstrations, group_size, distill, hybrid) -> TeacherPrompts:
    failed_groups_only = hybrid.distill_on == "failed_groups"
    return hybrid_teacher_prompts(
        prompts, responses, succeeded, feedbacks, demonstrations, group_size, distill, failed_groups_only
    )


def _no_distillation(hybrid: HybridConfig) -> float:
    return 0.0


def _full_distillation(hybrid: HybridConfig) -> float:
    return 1.0


def _hybrid_distillation(hybrid: HybridConfig) -> float:
    return hybrid.distill_weight


METHODS: dict[str, MethodSpec] = {
    "grpo": MethodSpec(
        policy_term=True,
        teacher_prompts=None,
        distill_weight=_no_distillation,
        teacher_kind="base",
        tau=0.05,
        alpha=0.5,
        skip_first_tokens=0,
        support="topk",
        topk=100,
    ),
    "sdpo": MethodSpec(
        policy_term=False,  # the released SDPO code replaces the GRPO loss (advantages unused)
        teacher_prompts=_sdpo,
        distill_weight=_full_distillation,
        teacher_kind="ema",
        tau=0.05,
        alpha=0.5,
        skip_first_tokens=0,
        support="topk",  # lasgroup/SDPO: the student's top-100 tokens plus a tail bucket
        topk=100,
        distill_aggregation="seq_mean_token_mean_all",
    ),
    "sdft": MethodSpec(
        policy_term=False,
        teacher_prompts=_sdft,
        distill_weight=_full_distillation,
        teacher_kind="ema",
        tau=0.01,
        alpha=0.0,
        skip_first_tokens=3,
        support="full",  # the SDFT trainer distils over the whole vocabulary
        topk=100,
        distill_aggregation="seq_mean_token_mean_all",
        one_sample_per_prompt=True,
    ),
    "hybrid": MethodSpec(
        policy_term=True,
        teacher_prompts=_hybrid,
        distill_weight=_hybrid_distillation,
        teacher_kind="stage_start",
        tau=0.05,
        alpha=1.0,
        skip_first_tokens=0,
        support="topk",
        topk=100,
        teacher_kinds=("base", "stage_start", "trust_region"),  # a frozen or trust-region teacher
        sparse_token_selection=True,
    ),
}
assert set(METHODS) == set(Method.__args__), "METHODS and the Method literal list the same methods"

"""The training methods, one row each in `METHODS`: which loss terms a method's step adds, whether it needs a
self-teacher and how that teacher's prompts are built, and the method's defaults and constraints.

Everything that differs between grpo, sdpo, sdft, hybrid and srpo is declared here, so adding a method is one row (and
its teacher-prompt builder): the recipe grammar reads the defaults and constraints (`grammar.StageConfig`), the run
creates a teacher when `needs_teacher`, `distill_targets` calls `teacher_prompts`, and the training step adds the
policy term when `policy_term` and the distillation term with weight `distill_weight(stage.hybrid)`, each on the rows
of its route when `sample_routed`; the memory plan reads the same rows (`entropy_pass`, `sample_routed`). Nothing
else compares a method's name. No torch import (the grammar uses this table).

`rollout.group_size` per method: sdft samples one response per prompt (`one_sample_per_prompt`); grpo and srpo
need 2 or more (`needs_siblings`: with one sample per prompt every advantage is 0 and srpo has no sibling to distil
from, so the stage would spend its budget and train nothing; the grammar refuses it). sdpo and the hybrid accept a
group of one: sdpo's teacher is then shown only the reward's feedback (a sample without feedback gets no target),
the hybrid's policy term is 0 and it distils from the example's demonstration or the feedback alone.

| method | policy term (clipped GRPO) | distillation term     | default teacher | α   | τ    | skipped | support   |
|--------|----------------------------|-----------------------|-----------------|-----|------|---------|-----------|
| grpo   | yes                        | no                    | (none)          | -   | -    | -       | -         |
| sdpo   | no (as the released code)  | weight 1              | ema             | 0.5 | 0.05 | 0       | top-100   |
| sdft   | no                         | weight 1              | ema             | 0   | 0.01 | 3       | full      |
| hybrid | yes                        | hybrid.distill_weight | stage_start     | 1   | 0.05 | 0       | top-100   |
| srpo   | on GRPO-routed samples     | on SDPO-routed ones   | ema             | 0.5 | 0.05 | 0       | top-100   |

(skipped: first response tokens without a distillation loss; top-100 has a tail bucket.) sdpo's α 0.5 / τ 0.05 /
top-100 + tail and sdft's α 0 (forward KL) / τ 0.01 / 3 skipped tokens / full vocabulary are the reference codes'
settings (lasgroup/SDPO, the SDFT trainer); the hybrid's sparse, frozen-teacher reverse KL is this toolkit's own
method (`train/sparse_targets.py`). The default distillation aggregation of sdpo and sdft is the references'
`seq_mean_token_mean_all` (a sample without a teacher target counts 0, so sparse targets give a smaller step); the
hybrid's is `token_mean` over its distilled tokens, so λ weights the mean divergence whatever fraction of the batch
is distilled.

srpo (`train/srpo.py`, docs/design.md §4a) routes each sample to exactly one of the two terms: a wrong sample with a
correct sibling to the distillation term (teacher shown that sibling), every other sample to the policy term, both
divided by one shared token count (so both aggregations are `token_mean`), the distilled tokens weighted by the
teacher's entropy (`srpo.entropy_beta`). Its defaults are the SRPO paper's (Table 3): EMA teacher τ 0.05, top-100 +
tail JSD α 0.5, importance-weight cap 2, clip-high 0.28, and the optimiser's lr 5e-6, AdamW weight decay 0.01 and 10
warm-up steps, the one method whose `optim` defaults are not the block's own (lr 1e-5, weight decay 0.0 as TRL's
and the HF Trainer's AdamW, no warm-up): `lr`, `weight_decay`, `warmup_steps`, each applied only where the stage sets
none. The paper warms up once over one long run; here every stage's schedule starts again, so a stage of ~10 steps
spends most of itself warming up: a short-stage recipe sets `optim.warmup_steps` itself. The paper trains one
domain; in a continual run whose stages continue one adapter (`adapter.init: continue`), decay pulls the earlier
stages' share of that adapter towards 0 as well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from adaptercl.recipe.method_blocks import Aggregation, HybridConfig, Support, TeacherKind

Method = Literal["grpo", "sdpo", "sdft", "hybrid", "srpo"]


@dataclass(frozen=True)
class MethodSpec:
    """What one training method is made of."""

    policy_term: bool  # the step adds the clipped policy-gradient (GRPO) term
    needs_teacher: bool  # distils from a self-teacher (its prompts: `teacher.prompts.TEACHER_PROMPTS[method]`)
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
    # rollout.group_size must be 2 or more: why the method learns nothing from a group of one (None: it can)
    needs_siblings: str | None = None
    sparse_token_selection: bool = False  # hybrid.distill_on chooses the distilled tokens (`train/sparse_targets.py`)
    # Each sample gets one term: the policy term on the samples without a teacher target, the entropy-weighted
    # distillation term on those with one, over one shared token denominator (`train/srpo.py`)
    # (its teacher's forward over the routed rows runs before any backward and stays alive across the step)
    sample_routed: bool = False
    # default optim.lr / optim.weight_decay / optim.warmup_steps when the stage does not set it (None: the field's own)
    lr: float | None = None
    weight_decay: float | None = None
    warmup_steps: int | None = None

    def entropy_pass(self, hybrid: HybridConfig) -> bool:
        """Whether each step first takes the student's entropy of every response token (a no-grad pass over the
        batch): the sparse token choice `hybrid.distill_on: high_entropy` (`train/sparse_targets.py`)."""
        return self.sparse_token_selection and hybrid.distill_on == "high_entropy"


def _no_distillation(hybrid: HybridConfig) -> float:
    return 0.0


def _full_distillation(hybrid: HybridConfig) -> float:
    return 1.0


def _hybrid_distillation(hybrid: HybridConfig) -> float:
    return hybrid.distill_weight


METHODS: dict[str, MethodSpec] = {
    "grpo": MethodSpec(
        policy_term=True,
        needs_teacher=False,
        distill_weight=_no_distillation,
        teacher_kind="base",
        tau=0.05,
        alpha=0.5,
        skip_first_tokens=0,
        support="topk",
        topk=100,
        needs_siblings="its advantages are rewards centred on their group's mean, 0 in a group of one",
    ),
    "sdpo": MethodSpec(
        policy_term=False,  # the released SDPO code replaces the GRPO loss (advantages unused)
        needs_teacher=True,
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
        needs_teacher=True,
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
        needs_teacher=True,
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
    "srpo": MethodSpec(
        policy_term=True,  # on the GRPO-routed samples only
        needs_teacher=True,
        distill_weight=_full_distillation,  # on the SDPO-routed samples only; no mixing coefficient
        teacher_kind="ema",  # the paper's teacher: an EMA of the student at rate 0.05
        tau=0.05,
        alpha=0.5,
        skip_first_tokens=0,
        support="topk",  # the reference SDPO term: the student's top-100 tokens plus a tail bucket
        topk=100,
        distill_aggregation="token_mean",  # the shared token denominator (grammar.py refuses any other)
        sample_routed=True,
        needs_siblings=(
            "a failed sample is distilled only from a successful sibling, every other gets GRPO's group-centred "
            "advantage, 0 in a group of one"
        ),
        lr=5e-6,  # SRPO paper Table 3 (GRPO 1e-6, SDPO 1e-5 there)
        weight_decay=0.01,  # Table 3: AdamW, weight decay 0.01
        warmup_steps=10,  # Table 3: 10 warm-up steps (here per stage: each stage's schedule starts again)
    ),
}
assert set(METHODS) == set(Method.__args__), "METHODS and the Method literal list the same methods"

"""The method blocks of the recipe grammar: `grpo`, `distill` (with its `teacher` and its lift `gate`), `hybrid`,
`srpo`, `regularizers` and `monitor`, each field typed and documented, plus the reference prompt strings.
Method-dependent defaults live in the method table (`method_table.METHODS`); `grammar.py` assembles the blocks into
stages and recipes. No torch import."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, PrivateAttr, model_validator

from adaptercl.recipe.config_block import ConfigBlock

Action = Literal["off", "warn", "stop", "rollback"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_mean_all", "seq_mean_token_sum_norm"]
Support = Literal["full", "topk", "sampled"]
TeacherKind = Literal["base", "stage_start", "ema", "lag", "trust_region", "restart_freeze", "gated"]
TeacherAutocast = Literal["none", "bfloat16", "auto"]

# The lift gate's `lower_bound` rule: the one-sided level of its exact sign test (the lower end of a two-sided 95 %
# interval, the rule's meaning from the start), and the fewest teacher-only wins that can pass it, all discordant
# prompts the teacher's: 2^-w <= 0.025 from w = 6 (`train.lift_gate.smallest_opening_lift` computes the general case)
LIFT_GATE_LEVEL = 0.025
FEWEST_OPENING_WINS = math.ceil(-math.log2(LIFT_GATE_LEVEL))


# Reference strings (docs/design.md §4): lasgroup/SDPO reprompting and the SDFT repo's demonstration prompt.
SDPO_REPROMPT = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question."
SDPO_SOLUTION = "\nCorrect solution:\n\n{successful_previous_attempt}"
SDPO_FEEDBACK = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}"
SDFT_DEMONSTRATION = (
    "\n{question}\n\nThis is an example for a response to the question:\n{demonstration}\n\n"
    "Now answer with a response of your own, including the thinking process.\n"
)


class GrpoConfig(ConfigBlock):
    epsilon_low: float = Field(0.2, ge=0.0, lt=1.0, description="Lower clip: rho >= 1 - epsilon_low.")
    epsilon_high: float = Field(0.28, ge=0.0, description="Upper clip (DAPO clip-higher): rho <= 1 + epsilon_high.")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip constant c for negative advantages.")
    scale_rewards: bool = Field(False, description="Divide advantages by the group std (off = Dr.GRPO).")
    kl_coef: float = Field(0.0, ge=0.0, description="Weight of the k3 KL to the base model (adapter disabled).")
    aggregation: Aggregation = Field("token_mean", description="How token losses become one number.")
    iterations: int = Field(1, ge=1, description="Optimisation passes over each batch of rollouts.")
    is_cap: float = Field(
        2.0,
        gt=0.0,
        description="Cap of the policy term's token-level truncated importance weight exp(logp_old - logp_rollout) "
        "when the rollout engine returns its own logprobs (vllm): TRL's `token_truncate` mode. 2.0 is the value the "
        "policy term shared with distill.is_cap before it had its own setting; TRL's C_max default is 3.0 (with "
        "sequence-level masking as its default mode).",
    )


class TeacherConfig(ConfigBlock):
    kind: TeacherKind | None = Field(None, description="Self-teacher; default depends on the method.")
    tau: float | None = Field(None, gt=0.0, le=1.0, description="EMA rate; default 0.05 (SDPO) or 0.01 (SDFT).")
    ema_rank: int | None = Field(None, ge=1, description="Rank of the EMA teacher adapter; default 2 x lora.r.")
    lag_steps: int = Field(10, ge=1, description="`lag` teacher: hard copy of the student every N steps.")
    refresh_every: int = Field(
        10,
        ge=1,
        description="`restart_freeze` (StableSDPO, SDPO-CL arXiv 2607.01763): copy the student into the teacher "
        "every N optimiser steps, frozen in between; `gated` (CGTR, arXiv 2606.03532): check the gate every N steps. "
        "10 = `lag_steps`' default. SDPO-CL reports its StableSDPO as 'γ = 40 %' beside EMA 5 %, and "
        "1 − 0.95^10 ≈ 0.40 reads as a restart every 10 steps matched to EMA-5 %; neither paper's text could be "
        "checked offline, so this default is the toolkit's, not a confirmed reference value.",
    )
    gate_window: int | None = Field(
        None,
        ge=1,
        description="`gated`: how many recent optimiser steps' training rollouts (the stage's own prompts, not "
        "replay) make the evidence: their pooled reward mean and response-length p95. Default refresh_every: each "
        "check reads the steps since the previous one. At most refresh_every (a longer window would share steps "
        "with the one it is compared with, and is refused). The first full window is the baseline (the stage-start "
        "teacher's reward and p95); checks start after it. The toolkit's choice (CGTR's window not checked).",
    )
    gate_reward_delta: float = Field(
        0.05,
        ge=0.0,
        description="`gated`: refresh only if the window's reward mean exceeds the one at the last refresh by at "
        "least this. 0.05 is the toolkit's (CGTR's value not checked): with the shipped recipes' 32 rollouts a step "
        "and a 10-step window, two windows' means of a flat 0/1 reward at p = 0.5 differ with a standard error of "
        "0.04, so noise alone opens the gate at about 1 check in 10.",
    )
    gate_length_eps: float = Field(
        0.1,
        ge=0.0,
        description="`gated`: refresh only if the window's response-length p95 is at most (1 + eps) x its value at "
        "the last refresh (CGTR's length-tail safety: a growing tail precedes collapse). 0.1 is the toolkit's; "
        "CGTR's value not checked.",
    )
    trust_region_coef: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="`trust_region`: teacher logits z = (1-c) z_ref + c z_student; default 0.05 (95 % reference), "
        "lasgroup/SDPO's actor.yaml teacher_update_rate.",
    )
    autocast: TeacherAutocast = Field(
        "none",
        description="Run the teacher's no-grad forward under torch.autocast to bfloat16: `bfloat16` always, "
        "`auto` only for a float32 model on a CPU with bf16 matrix instructions (AMX-BF16, AVX512-BF16), where the "
        "teacher forward gets 1.5-2x cheaper at a per-token KL of ~1e-3 to the float32 logits. On a bf16 base "
        "(CUDA; NF4 with bf16 compute) it changes nothing. The student's forward, the divergence and the gradients "
        "stay in the model's precision.",
    )


class LiftGateConfig(ConfigBlock):
    """`distill.gate`: distil only while the self-teacher, shown its context, measurably answers better than the
    student on the stage's own training prompts; otherwise the step's update is GRPO's on the same rollouts (sdpo and
    sdft too: the clipped policy term with the stage's `grpo` block). For sdpo, sdft, hybrid and srpo; a grpo stage
    ignores it. Checked at the stage's start and every `every` steps; each check logged with its evidence in
    metrics.jsonl (`lift_gate_*`); docs/design.md §4c, `train/lift_gate.py`.

    The measurement is the `teacher_lift` diagnostic's: per train prompt with a teacher context, the teacher's greedy
    accuracy with its context minus the student's greedy accuracy, paired over prompts. Its contexts come from the
    step's own rollouts first (no extra generation), then from a group rollout of further seeded train prompts; never
    the eval set.

    Why the default rule is `lower_bound`: GRPO on the same rollouts is the method every distilling method is measured
    against, so the gate stays on GRPO's side until the data show the teacher knows more (self-distillation's gain is
    linear in that gap, arXiv 2605.30070; a teacher without lift is what SDPO distilled from where it collapsed in
    benchmarks/science). Its test is exact: the one-sided sign test on the discordant prompts (teacher right and
    student wrong against the reverse, ties dropped; one context per prompt, `train/lift.py`) at 2.5 %, the level of
    the lower end of a two-sided 95 % interval. With teacher = student it opens at most 2.5 % of checks at any n;
    the percentile bootstrap it replaced opened on 3 teacher-only wins and 5 ties of 8 (exact p 1/8) and opened
    4.8 % of null checks at 8 prompts (gate_simulation.json). The price is evidence: a check opens only on at least 6
    teacher-only wins (2^-6 <= 0.025 < 2^-5), so the smallest measured lift that can open it is 6 / `prompts`: 1.0 at
    6 prompts, 0.75 at 8, 0.5 at 12, 0.375 at 16 (the default), 0.25 at 24, 0.1875 at 32, 0.125 at 48, 0.094 at 64
    (`train.lift_gate.smallest_opening_lift`). So a check of 16 prompts rarely opens on a true lift of 0.2-0.3:
    by benchmarks/science/gate_simulation.json (teacher and student answers independent / the teacher right wherever
    the student is) a true lift of 0.2 opens 11 % / 8 % of 16-prompt checks and 0.3 opens 27 % / 34 %; at 32
    prompts 28 % / 64 % and 62 % / 95 %; at 64 prompts 56 % / 99 % and 93 % / 100 %. Raise `prompts` where the
    teacher's lift is expected to be small (each prompt beyond the step's own costs a group rollout and two greedy
    answers). `mean` opens on any positive estimate (no test: with teacher = student, whenever chance favours the
    teacher, up to nearly half the checks): more distillation, less evidence. `min_pairs` 8 keeps either rule from
    deciding on a handful of prompts."""

    kind: Literal["off", "lift"] = Field(
        "off", description="`lift`: gate distillation on the teacher's measured lift; `off`: always distil."
    )
    every: int = Field(
        10,
        ge=1,
        description="Steps between checks: at 0-based steps 0, every, 2 x every, ... (each before that step's update; "
        "the decision holds until the next). 10, the teachers' refresh_every default, is the toolkit's choice.",
    )
    prompts: int = Field(
        16,
        ge=1,
        description="Train prompts a check tries at most: the step's own first, then a seeded draw, prompts_per_step "
        "at a time. A check stops early once even a context on every prompt left could not reach min_pairs. 16 is "
        "the toolkit's: 4 of the CPU recipes' steps of rollouts when no prompt is the step's. Under `lower_bound` "
        "it sets the smallest measured lift that can open the gate, 6 / prompts (0.375 at 16, 0.1875 at 32), and "
        "must be >= 6.",
    )
    min_pairs: int = Field(
        8, ge=1, description="Prompts with a teacher context needed before the gate can open (the rule's n)."
    )
    rule: Literal["lower_bound", "mean"] = Field(
        "lower_bound",
        description="What opens the gate, with n >= min_pairs: `lower_bound` the exact one-sided sign test on the "
        "discordant prompts at 2.5 % (equivalently the exact 95 % interval of the teacher's share of them above 1/2; "
        "the default: see the block's docstring), `mean` the lift > 0.",
    )
    max_new_tokens: int | None = Field(
        None, ge=1, description="Tokens of each greedy answer; default the stage's rollout.max_new_tokens."
    )

    @model_validator(mode="after")
    def _can_open(self) -> LiftGateConfig:
        if self.kind == "lift" and self.min_pairs > self.prompts:
            raise ValueError(
                f"min_pairs ({self.min_pairs}) is more than prompts ({self.prompts}): the gate could never open; "
                "lower min_pairs or raise prompts"
            )
        if self.kind == "lift" and self.rule == "lower_bound" and self.prompts < FEWEST_OPENING_WINS:
            raise ValueError(
                f"prompts ({self.prompts}) is below {FEWEST_OPENING_WINS}, the fewest teacher-only wins on which the "
                f"rule lower_bound (an exact one-sided test at {LIFT_GATE_LEVEL}) can open the gate: it could never "
                f"open; raise prompts to {FEWEST_OPENING_WINS} or more, or use rule: mean"
            )
        return self


def first_gated_check(window: int, every: int) -> int:
    """The first step at which a `gated` teacher can refresh: the first multiple of `every` after the baseline's
    step `window`."""
    return (window // every + 1) * every


def check_refresh_schedule(teacher: TeacherConfig, steps: int) -> None:
    """A restart_freeze or gated teacher that could never refresh within the stage is a stage_start teacher in
    disguise: refuse it, saying what to change. A gated window longer than its check period is refused too: right
    after the baseline or a refresh, the next check's window repeats gate_window − refresh_every steps of the
    reference window, which cancel in the difference, so the rule would compare two refresh_every-step blocks with
    its delta scaled by gate_window / refresh_every."""
    if teacher.kind == "restart_freeze" and teacher.refresh_every > steps:
        raise ValueError(
            f"distill.teacher.refresh_every ({teacher.refresh_every}) is more than optim.steps ({steps}): the "
            "restart_freeze teacher would never refresh; lower it, or use distill.teacher.kind stage_start"
        )
    if teacher.kind == "gated" and teacher.gate_window > teacher.refresh_every:
        raise ValueError(
            f"distill.teacher.gate_window ({teacher.gate_window}) is longer than refresh_every "
            f"({teacher.refresh_every}): each check's window would share "
            f"{teacher.gate_window - teacher.refresh_every} steps with the window it is compared with; set "
            "gate_window <= refresh_every"
        )
    first = first_gated_check(teacher.gate_window, teacher.refresh_every)
    if teacher.kind == "gated" and first > steps:
        raise ValueError(
            f"distill.teacher: the gated teacher's first check would be at step {first} (gate_window "
            f"{teacher.gate_window} steps of baseline, then every refresh_every {teacher.refresh_every}), after "
            f"optim.steps ({steps}); lower gate_window or refresh_every, or use distill.teacher.kind stage_start"
        )


class DistillConfig(ConfigBlock):
    alpha: float | None = Field(
        None, ge=0.0, le=1.0, description="0 forward KL(q||p), 1 reverse KL(p||q), else generalized JSD."
    )
    support: Support | None = Field(
        None,
        description="Vocabulary support of the divergence; default depends on the method: `full` for SDFT (the SDFT "
        "trainer's whole vocabulary), `topk` for SDPO (top-100 + tail, lasgroup/SDPO) and the hybrid.",
    )
    topk: int | None = Field(None, ge=1, description="`topk` support: the student's top-k tokens; default 100.")
    tail: bool = Field(True, description="`topk`: add the tail bucket (off = renormalise over the k tokens).")
    mask_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Drop each response token from the loss w.p. this.")
    is_cap: float = Field(2.0, gt=0.0, description="Cap of the per-token importance weights.")
    skip_first_tokens: int | None = Field(None, ge=0, description="Response tokens skipped; default 3 for SDFT.")
    success_threshold: float = Field(
        0.5,
        description="Native rewards: a sample with reward >= this is a success (a sibling SDPO shows as the 'Correct "
        "solution'; a group with one is not failed for the hybrid). 0.5 as lasgroup/SDPO's actor.yaml: the "
        "builtin rewards' partial credit stays below it (TRL's SDPO uses 1.0). Unused for TRL-style rewards "
        "(reward_funcs): their success is the domain's correct decision (correct_from, correct_threshold), the "
        "accuracy matrix's.",
    )
    use_feedback: bool = Field(
        True,
        description="SDPO: use reward feedback when no sibling succeeded; which feedback is each domain's `feedback` "
        "(default: format problems only, as the reference rewards).",
    )
    strip_think: bool = Field(True, description="Strip <think>...</think> from demonstrations.")
    aggregation: Aggregation | None = Field(
        None,
        description="How distillation token losses become one number; default depends on the method: sdpo/sdft "
        "`seq_mean_token_mean_all` (per-sequence token mean averaged over every sequence of the batch, a sequence "
        "without a teacher target counting 0, as the SDPO/SDFT references), hybrid `token_mean` (over the distilled "
        "tokens). `seq_mean_token_mean` leaves sequences without a target out of the mean instead (verl).",
    )
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    gate: LiftGateConfig = Field(default_factory=LiftGateConfig)
    reprompt_template: str = SDPO_REPROMPT
    solution_template: str = SDPO_SOLUTION
    feedback_template: str = SDPO_FEEDBACK
    demonstration_template: str = SDFT_DEMONSTRATION


class HybridConfig(ConfigBlock):
    distill_weight: float = Field(
        0.1, ge=0.0, description="lambda: weight of the sparse distillation loss added to GRPO's (0 = plain GRPO)."
    )
    distill_on: Literal["failed_groups", "high_entropy", "all"] = Field(
        "failed_groups",
        description="Which tokens are distilled: samples of groups with no success (teacher shown the example's "
        "demonstration and/or the reward feedback), the top-q highest-entropy tokens of the batch, or all.",
    )
    entropy_top_q: float = Field(
        0.2, gt=0.0, le=1.0, description="`high_entropy`: fraction of the batch's response tokens distilled."
    )


class SrpoConfig(ConfigBlock):
    """SRPO (Sample-Routed Policy Optimization, arXiv 2604.02288; `train/srpo.py`): what it adds to the `grpo` and
    `distill` blocks. Its other paper defaults (Table 3) are the method's defaults there: EMA teacher rate 0.05,
    top-100 + tail JSD with alpha 0.5, importance-weight cap 2 (distill), clip-high 0.28 (grpo), lr 5e-6, weight decay
    0.01 and 10 warm-up steps (optim, where the stage sets none)."""

    entropy_beta: float = Field(
        1.0,
        ge=0.0,
        description="DW-SDPO: each SDPO-routed token's distillation loss is weighted by exp(-beta x H), H the "
        "teacher's entropy (nats, full vocabulary) at that token, normalised to mean 1 over the batch's SDPO tokens. "
        "1.0 is the paper's; 0 gives every token weight 1.",
    )


class RegularizerConfig(ConfigBlock):
    kl_prev: float = Field(
        0.0,
        ge=0.0,
        description="Weight of the token-mean KL(current || previous stage's policy) on the current rollouts; the "
        "previous policy is the model after the previous stage (stage 1: the base). Costs one forward per step.",
    )
    l2_prev: float = Field(
        0.0,
        ge=0.0,
        description="Weight of sum over modules of ||dW - dW_0||_F^2, dW_0 = the student's dW at stage start (the "
        "previous stage's dW under init continue, 0 under new, the merge under merge).",
    )
    orthogonal: float = Field(
        0.0, ge=0.0, description="O-LoRA weight: sum of ||A A_old^T||_F^2 against earlier adapters active under it."
    )
    replay_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Share of each step's prompts drawn from earlier stages' domains (scored by their own reward, "
        "rolled out by the current policy and trained with the stage's loss); replay_rounding makes it a count.",
    )
    replay_domains: list[str] | None = Field(
        None,
        description="The domains replay draws from instead of the earlier stages' (None: every earlier stage's "
        "domain). Naming domains no earlier stage trained makes a multitask stage: `replay_fraction: 0.5` with the "
        "other domain of a pair trains both on every step, half the prompts each (the `joint` reference of "
        "continual learning; benchmarks/science). Not the stage's own domain, not a retention probe.",
    )
    replay_rounding: Literal["at_least_one", "stochastic"] = Field(
        "at_least_one",
        description="How replay_fraction x prompts_per_step becomes a whole number of prompts per step (at most "
        "prompts_per_step - 1): `at_least_one` rounds it, at least 1 (what the hybrid and SRPO recipes ran with; 0.01 "
        "of 4 prompts replays 1 every step); `stochastic` replays its whole part and one more with probability its "
        "fractional part, drawn from the step's seed (the same on resume), so the share is the fraction in "
        "expectation: 0.01 of 4 prompts replays 1 prompt on about 1 step in 25.",
    )


class MonitorConfig(ConfigBlock):
    """Collapse guard and checkpoints (see adaptercl/train/collapse_guard.py for the rules)."""

    checkpoint_every: int = Field(
        10,
        ge=1,
        description="Steps between checkpoints (rollback targets and resume); a kill loses at most this many steps. "
        "More than the stage's optim.steps is capped to them (a checkpoint only at the stage's end; `recipe "
        "validate` says so): a resume then starts the short stage over, and says it does.",
    )
    drift_every: int = Field(
        0, ge=0, description="Log aggregate parameter drift (vs the base) every N steps in metrics.jsonl; 0 = off."
    )
    window: int = Field(5, ge=2, description="Steps over which trends (reward fall, divergence fall) are measured.")
    nonfinite: Action = Field("rollback", description="NaN/inf loss or grad norm.")
    divergence_collapse: Action = Field(
        "rollback", description="Teacher-student divergence below divergence_floor while the reward falls."
    )
    divergence_floor: float = Field(1e-3, ge=0.0, description="Divergence under which the teacher adds nothing.")
    reward_fall: float = Field(0.1, ge=0.0, description="A reward fall (window mean vs previous window) this big.")
    target_starvation: Action = Field(
        "warn", description="No sample had a teacher target and no update was made, for `window` steps."
    )
    repetition: Action = Field("rollback", description="Repeated-4-gram rate of responses above repetition_max.")
    repetition_max: float = Field(0.5, gt=0.0, le=1.0, description="Repetition rate that counts as a spike.")
    reward_collapse: Action = Field(
        "warn",
        description="The training reward's mean over the last `window` steps fell below reward_collapse_ratio x its "
        "best earlier window mean in the stage (the SDPO failure seen in benchmarks/science: entropy rises, the "
        "format is lost, the reward goes to 0 while the divergence stays large).",
    )
    reward_collapse_ratio: float = Field(0.5, gt=0.0, lt=1.0, description="Share of the best window mean kept.")
    reward_collapse_min: float = Field(
        0.1, ge=0.0, description="Best window mean needed before a fall counts (a reward near 0 cannot collapse)."
    )
    entropy_collapse: Action = Field("warn", description="Mean policy entropy below entropy_min.")
    entropy_min: float = Field(0.02, ge=0.0, description="Entropy (nats/token) that counts as collapsed.")
    max_rollbacks: int = Field(2, ge=0, description="Rollbacks allowed per stage; then a rollback alarm stops it.")
    lr_scale_on_rollback: float = Field(0.5, gt=0.0, le=1.0, description="LR multiplier applied at each rollback.")
    # checkpoint_every as the recipe gave it, when StageConfig capped it to the stage's steps (None: not capped);
    # not a field: the resolved recipe holds the capped value, `RecipeConfig.validation_notes` says what it was.
    _capped_from: int | None = PrivateAttr(None)

"""The lift gate (`distill.gate.kind: lift`; docs/design.md §4c): a distilling stage (sdpo, sdft, hybrid, srpo)
distils only while its self-teacher, shown its context, measurably answers better than the student on the stage's
own training prompts; otherwise the step's update is GRPO's on the same rollouts.

Self-distillation's final gain is linear in the initial accuracy gap between the self-teacher and the student (arXiv
2605.30070), and benchmarks/science found a sibling-shown teacher with no lift past the first domain at 135M while
SDPO distilled on most tokens there and collapsed. So the gap is measured before distilling, and again as training
moves the student and the teacher.

When: a check at the stage's start (step 0) and at every `every`-th step after it (0-based steps 0, K, 2K, ...), each
after that step's rollouts and before its update; the decision holds until the next check.

What (`measure_lift`): the paired measurement of `lift.py` (the `teacher_lift` diagnostic's: the teacher with its
context against the student, both greedy, on the same prompts) on at most `prompts` train prompts of the stage's
domain, never its eval set. First the step's own prompts: their rollouts exist already, so their contexts cost no
generation. Then a seeded draw of further train prompts (not the step's), a group rollout each at the rollout's
settings, `optim.prompts_per_step` prompts at a time, seeded by the `lift_gate.rollout` call family
(`context.family_seed`: never a training row's seed). Greedy answers are cut at `max_new_tokens` (default the
rollout's). It stops early once even a context on every prompt left could not bring n to `min_pairs`: a teacher
that gets no context (SDPO where nothing succeeds) costs a few chunks, not the budget.

Rule (`passes`, pure; `GATE_RULES`): n >= `min_pairs` prompts with a context and
- `lower_bound` (default): the exact one-sided sign test on the discordant prompts (`lift.lift_evidence`: teacher-only
  wins against student-only wins, ties dropped) rejects "no lift" at `LIFT_GATE_LEVEL` 2.5 %, the level the rule had
  as the lower end of a two-sided 95 % interval; equivalently the exact (Clopper–Pearson) 95 % interval of the
  teacher's share of the discordant prompts lies above 1/2. It replaced a percentile-bootstrap interval of the lift,
  which over 8-16 outcomes in {−1, 0, 1} opened without lift several times more often than 2.5 % (3 teacher-only wins
  and 5 ties of 8 opened it; their exact p is 1/8). A check opens it only with at least 6 teacher-only wins
  (2^-6 <= 0.025 < 2^-5): `smallest_opening_lift`; benchmarks/science/gate_simulation.py measures its false-open
  rate and power through `lift_evidence` and `passes`;
- `mean`: the lift's point estimate > 0 (no test: with teacher = student it opens nearly half the time).
A closed gate is the safe side: GRPO on the same rollouts is the method every distilling method is measured against,
so distillation has to show its teacher knows more (docs: `recipe.method_blocks.LiftGateConfig`).

Closed: no teacher prompts, no teacher forward, and `step.train_on_batch(method="grpo")`: the clipped policy term on
every sample with the stage's `grpo` block (sdpo and sdft too, whose own loss has no policy term; sdft's one sample
per prompt gives GRPO advantages of 0), over the same rollouts and with the same regularisers. The teacher keeps
following the student as its kind says (EMA, refreshes): its schedule is the teacher's, not the gate's.

Logged (metrics.jsonl): `lift_gate_open` at every step (whether that step distilled); at a check also
`lift_gate_check` 1, `lift_gate_prompts` (tried), `lift_gate_n`, `lift_gate_lift`, `lift_gate_lift_lo`,
`lift_gate_lift_hi` (the lift's descriptive bootstrap interval), `lift_gate_teacher_accuracy`,
`lift_gate_student_accuracy`, `lift_gate_teacher_wins`, `lift_gate_student_wins`, `lift_gate_p` (the sign test's;
these nine absent when n = 0) and `lift_gate_seconds`.

State: whether the gate is open and the step of its last check (`state`, `load_state`), in the stage's checkpoint;
the measurement is a function of the weights, the step and seeds of its own, and runs `isolated` (global RNGs
forked), so a resumed stage checks, decides and trains exactly as an uninterrupted one. Data-parallel ranks: the
step's own rollouts are gathered from every rank, every rank measures the same prompts, and rank 0's decision is
broadcast.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from adaptercl.domains import Example, RewardResult
from adaptercl.measure import sign_test_p
from adaptercl.recipe import LIFT_GATE_LEVEL, METHODS, LiftGateConfig, StageConfig
from adaptercl.rollout import Completion, SamplingParams
from adaptercl.system import distributed
from adaptercl.train.context import StageContext, family_seed, rollout_sampling
from adaptercl.train.lift import isolated, lift_summary, paired_answers, scored_rollout, seeded_sample

# call families of the gate's own draws (`context.family_seed`), each seeded per check step
GATE_PROMPTS = "lift_gate.prompts"  # which further train prompts a check draws
GATE_ROLLOUT = "lift_gate.rollout"  # their group rollouts
GATE_PICK = "lift_gate.pick"  # which context of a prompt the sign test reads (`lift.lift_evidence`)

Group = tuple[Example, list[Completion], list[RewardResult]]  # one prompt, its G rollouts and their rewards

GATE_RULES: dict[str, Callable[[dict[str, Any]], bool]] = {
    "lower_bound": lambda summary: summary["sign_test_p"] <= LIFT_GATE_LEVEL,
    "mean": lambda summary: summary["lift"] > 0.0,
}


def passes(summary: dict[str, Any], rule: str, min_pairs: int) -> bool:
    """Whether a lift measurement (`lift.lift_evidence`, or `lift_summary` which holds it) opens the gate:
    n >= min_pairs and the rule holds."""
    return summary["n"] >= min_pairs and GATE_RULES[rule](summary)


def smallest_opening_lift(prompts: int, level: float = LIFT_GATE_LEVEL) -> float | None:
    """The smallest measured lift with which a check of at most `prompts` prompts (one context each) can pass the
    `lower_bound` rule, or None where none can (pure). Over d discordant prompts of n, the sign test passes from w*(d)
    teacher-only wins on (the fewest with `sign_test_p`(w, d − w) <= level); the lift is then (2 w*(d) − d) / n,
    smallest at n = prompts (with min_pairs <= prompts, which the config checks). At 2.5 %: d = w = 6 at every
    prompts >= 6, so 6 / prompts."""
    steps = []
    for d in range(1, prompts + 1):
        wins = next((w for w in range(d + 1) if sign_test_p(w, d - w) <= level), None)
        if wins is not None:
            steps.append(2 * wins - d)
    return min(steps) / prompts if steps else None


@dataclass
class LiftGate:
    """The gate of one stage (see the module docstring)."""

    config: LiftGateConfig
    open: bool = False  # the last check's decision
    checked_step: int | None = None  # the 0-based step of the last check

    def due(self, step: int) -> bool:
        return step % self.config.every == 0

    def check(self, ctx: StageContext, step: int, own_indices: list[int], own: list[Group]) -> dict[str, float]:
        """Measure the lift at 0-based `step` (the step's own prompts `own_indices` into the domain's train set, whose
        groups `own` every rank holds), decide, and return what the step's metrics log about the check."""
        t0 = time.perf_counter()
        summary, tried = measure_lift(ctx, step, own_indices, own)
        decision = distributed.broadcast_object(passes(summary, self.config.rule, self.config.min_pairs))
        self.open, self.checked_step = decision, step
        return {"lift_gate_check": 1.0, **evidence(summary, tried), "lift_gate_seconds": time.perf_counter() - t0}

    def state(self) -> dict[str, Any]:
        return {"open": self.open, "checked_step": self.checked_step}

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Back to a checkpoint's state (None: a checkpoint from before the first check, the stage's start)."""
        state = state or {"open": False, "checked_step": None}
        self.open, self.checked_step = state["open"], state["checked_step"]


GATE_KINDS: dict[str, Callable[[LiftGateConfig], LiftGate] | None] = {"off": None, "lift": LiftGate}  # gate.kind


def create_gate(stage: StageConfig) -> LiftGate | None:
    """The stage's gate, or None: `distill.gate.kind` off, or a method that does not distil (grpo ignores it)."""
    make = GATE_KINDS[stage.distill.gate.kind]
    return make(stage.distill.gate) if make is not None and METHODS[stage.method].needs_teacher else None


def evidence(summary: dict[str, Any], tried: int) -> dict[str, float]:
    """A check's evidence as metrics.jsonl numbers: the lift's figures are absent when no prompt had a context."""
    out = {"lift_gate_prompts": float(tried), "lift_gate_n": float(summary["n"])}
    if summary["n"]:
        lo, hi = summary["lift_ci95"]
        out.update(
            lift_gate_lift=summary["lift"],
            lift_gate_lift_lo=lo,
            lift_gate_lift_hi=hi,
            lift_gate_teacher_accuracy=summary["teacher_accuracy"],
            lift_gate_student_accuracy=summary["student_accuracy"],
            lift_gate_teacher_wins=float(summary["teacher_wins"]),
            lift_gate_student_wins=float(summary["student_wins"]),
            lift_gate_p=summary["sign_test_p"],
        )
    return out


def own_groups(
    examples: list[Example], completions: list[Completion], results: list[RewardResult], first: int, own: int
) -> list[Group]:
    """The step's own-domain prompts with their groups, every rank's, in order: this rank holds the step's prompts
    `first`, `first` + 1, ... (its share; group-contiguous rollouts), of which the first `own` of the whole step are
    the stage's own (the rest replayed)."""
    group = len(completions) // max(1, len(examples))
    mine = [
        (ex, completions[k * group : (k + 1) * group], results[k * group : (k + 1) * group])
        for k, ex in enumerate(examples)
        if first + k < own
    ]
    return distributed.gather_lists(mine)


def measure_lift(ctx: StageContext, step: int, own_indices: list[int], own: list[Group]) -> tuple[dict[str, Any], int]:
    """The lift on at most `distill.gate.prompts` train prompts (the module docstring's What): (`lift_summary`'s
    summary, prompts tried)."""
    stage, cfg = ctx.stage, ctx.stage.distill.gate
    greedy = SamplingParams(max_new_tokens=cfg.max_new_tokens or stage.rollout.max_new_tokens, greedy=True)
    taken = set(own_indices)
    others = [i for i in range(len(ctx.domain.train)) if i not in taken]
    drawn = seeded_sample(others, cfg.prompts - min(cfg.prompts, len(own)), gate_seed(ctx, GATE_PROMPTS, step))
    prompt_of, kinds, teacher, student, tried = [], [], [], [], 0
    with isolated(ctx.model):
        for groups in _chunks(ctx, step, own[: cfg.prompts], drawn):
            pairs = paired_answers(
                ctx, [g[0] for g in groups], [c for g in groups for c in g[1]], [r for g in groups for r in g[2]],
                greedy,
            )  # fmt: skip
            prompt_of += [tried + p for p in pairs.prompt_of]  # prompt indices over the whole check
            kinds += pairs.kinds
            teacher += pairs.teacher_correct
            student += pairs.student_correct
            tried += len(groups)
            if len(set(prompt_of)) + (cfg.prompts - tried) < cfg.min_pairs:
                break  # the gate cannot open on this check whatever the prompts left show
    ctx.engine.sleep()  # a colocated vLLM frees the card for the training step again (no-op for hf)
    return lift_summary(prompt_of, kinds, teacher, student, seed=gate_seed(ctx, GATE_PICK, step)), tried


def gate_seed(ctx: StageContext, family: str, step: int) -> int:
    """The seed of the gate's `family` draw at the check of `step` (`context.family_seed`)."""
    return family_seed(family, ctx.recipe.seed, ctx.index, step)


def _chunks(ctx: StageContext, step: int, own: list[Group], drawn: list[int]) -> Iterator[list[Group]]:
    """The check's prompts with their groups, a chunk at a time: the step's own (rolled out already), then the drawn
    train prompts `drawn`, `optim.prompts_per_step` at a time, each chunk rolled out only when it is reached."""
    if own:
        yield own
    size = ctx.stage.optim.prompts_per_step
    for start in range(0, len(drawn), size):
        yield _roll_out(ctx, [ctx.domain.train[i] for i in drawn[start : start + size]], step, first_row=start)


def _roll_out(ctx: StageContext, examples: list[Example], step: int, first_row: int) -> list[Group]:
    """A group rollout of `examples` from the student at the rollout's settings, seeded by the check's step (rows
    numbered from `first_row` x G, so each chunk samples with seeds of its own), scored by the domain's reward."""
    group = ctx.stage.rollout.group_size
    params = rollout_sampling(ctx.stage, gate_seed(ctx, GATE_ROLLOUT, step), first_row=first_row * group)
    completions, results = scored_rollout(ctx, examples, params)  # [P x G]
    return [
        (ex, completions[k * group : (k + 1) * group], results[k * group : (k + 1) * group])
        for k, ex in enumerate(examples)
    ]

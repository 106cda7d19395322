"""The lift gate's operating characteristics (issue 43 item 6): how often its default rule opens without lift, and how
often it opens at a known lift, at each `prompts` setting, measured through the gate's own decision functions.

Every simulated check hands paired greedy outcomes to `adaptercl.train.lift.lift_evidence` (the per-prompt lift, the
seeded pick of one context a prompt and the exact one-sided sign test on the discordant prompts) and decides with
`adaptercl.train.lift_gate.passes` under the `lower_bound` rule with the default `min_pairs` (8); `lift_summary`,
which the gate calls, is `lift_evidence` plus a descriptive bootstrap interval no rule reads. Each check has one
teacher context on every prompt (n = `prompts`, the most a check can show), except the several-contexts null, where
every prompt has 3 (as an SDPO group shown different siblings or feedback has).

Outcome models, per prompt (independent prompts, as the gate's are distinct train prompts):
- null (teacher = student): student right w.p. q, the teacher's answer on each of its contexts right w.p. q,
  independently; q in 0.2 / 0.5 / 0.8 (base accuracies), with 1 and with 3 contexts a prompt;
- lift, `independent`: the student right w.p. q, the teacher w.p. q + lift, independently (many discordant
  prompts: teacher-only wins w.p. (q + lift)(1 − q), student-only wins w.p. q(1 − q − lift));
- lift, `nested`: the teacher right wherever the student is, and on a further share `lift` of prompts (teacher-only
  wins w.p. lift, no student-only win). The two ends of how the teacher's answers depend on the student's; with
  the 6 wins the test needs, the many discordant prompts of `independent` open it more often at small lifts.
Lifts 0.1 / 0.2 / 0.3 where q + lift <= 1. `prompts` in 8 .. 64 (the default 16; the grammar asks >= 6 under
`lower_bound`, and the default min_pairs 8 asks >= 8).

Two figures per setting: `simulated`, the share of REPS seeded simulated checks that opened, and `exact`, the
probability summed over every (teacher-only wins, student-only wins, ties) outcome of one-context prompts, each
weighted by its multinomial probability and decided by the same two functions on an outcome list with those counts
(the pick is immaterial with one context). The several-contexts null has no `exact` column: the pick makes its
outcome law the one-context law (lift.py's docstring), which `simulated` checks. `false_open_rate` is the largest
simulated rate over the null settings (a maximum over noisy estimates, so above the exact rates' 2.5 % bound by
chance alone; must be <= 0.05); `false_open_rate_exact` the largest exact one.

`previous_rule` measures the rule this one replaced on the same null draws (at 8 and 16 prompts): the lower end of
the paired percentile-bootstrap 95 % interval of the lift (`adaptercl.measure.paired_bootstrap_interval`, 10,000
resamples, the seed lift_summary gave it) above 0.

Rerun (a few minutes on one core; the figures are a function of the code and the seeds, not of the machine):
    python benchmarks/science/gate_simulation.py
writes benchmarks/science/gate_simulation.json.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/, for the shared provenance.py
from provenance import provenance  # noqa: E402

from adaptercl.measure import paired_bootstrap_interval  # noqa: E402
from adaptercl.recipe import LIFT_GATE_LEVEL, LiftGateConfig  # noqa: E402
from adaptercl.system.atomic import write_json  # noqa: E402
from adaptercl.train.lift import lift_evidence  # noqa: E402
from adaptercl.train.lift_gate import passes, smallest_opening_lift  # noqa: E402

PROMPTS = (8, 12, 16, 24, 32, 48, 64)
BASES = (0.2, 0.5, 0.8)
LIFTS = (0.1, 0.2, 0.3)
CONTEXTS = (1, 3)  # teacher contexts a prompt, in the null settings
PREVIOUS_RULE_PROMPTS = (8, 16)
REPS = 4000
SEED = 0
RULE = "lower_bound"
MIN_PAIRS = LiftGateConfig().min_pairs
OUT = HERE / "gate_simulation.json"


def outcomes(
    generator: torch.Generator, prompts: int, base: float, lift: float, model: str, contexts: int
) -> tuple[list[int], list[bool], list[bool]]:
    """One simulated check (see the module docstring's models): prompt_of [prompts x contexts], the teacher's answer
    on each context, the student's answer on each prompt."""
    u = torch.rand(prompts, generator=generator, dtype=torch.float64)  # [P]
    student = u < base  # [P]
    if model == "nested":
        teacher = (u < base + lift)[:, None]  # [P, 1]
    else:
        draws = torch.rand(prompts, contexts, generator=generator, dtype=torch.float64)  # [P, C]
        teacher = draws < base + lift  # [P, C]
    prompt_of = [p for p in range(prompts) for _ in range(teacher.shape[1])]
    return prompt_of, teacher.flatten().tolist(), student.tolist()


def simulate(prompts: int, base: float, lift: float, model: str, contexts: int, reps: int, seed: int) -> dict:
    """The share of `reps` simulated checks the gate opened, and of those the previous rule would have opened
    (null settings at PREVIOUS_RULE_PROMPTS only)."""
    generator = torch.Generator().manual_seed(seed)
    previous = lift == 0.0 and contexts == 1 and prompts in PREVIOUS_RULE_PROMPTS
    opened = opened_before = 0
    for rep in range(reps):
        prompt_of, teacher, student = outcomes(generator, prompts, base, lift, model, contexts)
        evidence = lift_evidence(prompt_of, teacher, student, seed=rep)
        opened += passes(evidence, RULE, MIN_PAIRS)
        if previous:  # one context a prompt: each prompt's lift is t - s
            lifts = [float(t) - float(s) for t, s in zip(teacher, student)]
            opened_before += paired_bootstrap_interval(lifts, seed=0)[0] > 0.0
    out = {"simulated": opened / reps}
    if previous:
        out["previous_rule"] = opened_before / reps
    return out


def decisions(prompts: int) -> dict[tuple[int, int], bool]:
    """The gate's decision on every (teacher-only wins, student-only wins) of `prompts` one-context prompts."""
    out = {}
    for wins in range(prompts + 1):
        for losses in range(prompts - wins + 1):
            ties = prompts - wins - losses
            teacher = [True] * wins + [False] * losses + [False] * ties
            student = [False] * wins + [True] * losses + [False] * ties
            out[wins, losses] = passes(lift_evidence(list(range(prompts)), teacher, student), RULE, MIN_PAIRS)
    return out


def exact_rate(opens: dict[tuple[int, int], bool], prompts: int, p_win: float, p_loss: float) -> float:
    """The probability that a check opens when each prompt is a teacher-only win w.p. p_win and a student-only win
    w.p. p_loss, independently: the multinomial sum over the outcomes that open it."""
    p_tie = 1.0 - p_win - p_loss
    total = 0.0
    for (wins, losses), opened in opens.items():
        if opened:
            ties = prompts - wins - losses
            ways = math.comb(prompts, wins) * math.comb(prompts - wins, losses)
            total += ways * p_win**wins * p_loss**losses * p_tie**ties
    return total


def discordance(base: float, lift: float, model: str) -> tuple[float, float]:
    """(P(teacher-only win), P(student-only win)) of one prompt under `model`."""
    if model == "nested":
        return lift, 0.0
    teacher = base + lift
    return teacher * (1.0 - base), base * (1.0 - teacher)


def run(reps: int = REPS, prompts_settings: tuple[int, ...] = PROMPTS) -> dict[str, Any]:
    """Every setting's simulated and exact opening rates (see the module docstring); JSON-ready."""
    null, power, before = [], [], []
    for prompts in prompts_settings:
        opens = decisions(prompts)
        for b, base in enumerate(BASES):
            for contexts in CONTEXTS:
                seed = SEED + 1000 * prompts + 10 * b + contexts
                row = {"prompts": prompts, "base": base, "contexts": contexts}
                result = simulate(prompts, base, 0.0, "independent", contexts, reps, seed)
                row["simulated"] = result["simulated"]
                if contexts == 1:
                    row["exact"] = exact_rate(opens, prompts, *discordance(base, 0.0, "independent"))
                null.append(row)
                if "previous_rule" in result:
                    before.append({"prompts": prompts, "base": base, "simulated": result["previous_rule"]})
            for k, lift in enumerate(LIFTS):
                if base + lift > 1.0 + 1e-9:
                    continue
                for m, model in enumerate(("independent", "nested")):
                    seed = SEED + 1000 * prompts + 10 * b + 100 + 10 * k + m
                    result = simulate(prompts, base, lift, model, 1, reps, seed)
                    exact = exact_rate(opens, prompts, *discordance(base, lift, model))
                    power.append(
                        {"prompts": prompts, "base": base, "lift": lift, "model": model, **result, "exact": exact}
                    )
    return {
        "false_open_rate": max(r["simulated"] for r in null),
        "false_open_rate_exact": max(r["exact"] for r in null if "exact" in r),
        "level": LIFT_GATE_LEVEL,
        "rule": RULE,
        "min_pairs": MIN_PAIRS,
        "reps": reps,
        "smallest_opening_lift": {str(p): smallest_opening_lift(p) for p in prompts_settings},
        "null": null,
        "power": power,
        "previous_rule": {
            "rule": "lower end of the paired percentile-bootstrap 95 % interval of the lift > 0 (before issue 43)",
            "false_open_rate": max((r["simulated"] for r in before), default=None),
            "null": before,
        },
    }


def main() -> None:
    result = run()
    write_json(OUT, {**result, "meta": provenance(packages=("torch",))})
    print(f"false_open_rate {result['false_open_rate']:.4f} (exact max {result['false_open_rate_exact']:.4f}); "
          f"the previous rule's {result['previous_rule']['false_open_rate']:.4f}")  # fmt: skip
    for row in result["power"]:
        if row["prompts"] == 16:
            print(f"16 prompts, base {row['base']}, lift {row['lift']}, {row['model']}: opens {row['exact']:.3f}")
    print(f"written: {OUT}")


if __name__ == "__main__":
    main()

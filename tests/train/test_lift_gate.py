"""The lift gate (`distill.gate`, train/lift_gate.py) on tiny-random: its exact rule by hand (the sign test on the
discordant prompts, one context a prompt), the smallest lift that can open it, opening and closing on a scripted
lift sequence, GRPO's update exactly while closed, the real measurement's evidence and early stop, a measurement
that leaves training untouched, its rollout seeds apart from training's, and kill-and-resume with the gate's state."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from adaptercl.measure.stats import sign_test_p
from adaptercl.recipe import LiftGateConfig
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.rollout.protocol import row_requests, row_seed
from adaptercl.train import lift_gate
from adaptercl.train.context import family_seed, prompts_for_step, step_seed
from adaptercl.train.lift import lift_evidence, lift_summary
from adaptercl.train.stage import run_stage
from tests.train.test_distill_stage import ToyDomain, metrics, recipe, stage_context, student_state

GATE = {"kind": "lift", "every": 1, "prompts": 6, "min_pairs": 2}


def summary(lift: float, p: float, n: int = 6) -> dict:
    """A lift measurement as `lift.lift_summary` returns it (the figures the rule and the log read): `p` the sign
    test's one-sided p-value."""
    return {"n": n, "lift": lift, "lift_ci95": [lift - 0.25, lift + 0.25], "teacher_accuracy": 0.5 + lift / 2,
            "student_accuracy": 0.5 - lift / 2, "teacher_wins": 3, "student_wins": 1, "sign_test_p": p,
            "by_context": {}}  # fmt: skip


def scripted(monkeypatch, by_step: dict[int, dict]) -> list[tuple[int, list[int], int]]:
    """Replace the measurement by a stand-in returning `by_step[step]` (tried = its n); records (step, the step's own
    prompt indices, how many own groups it was handed) of every check."""
    calls = []

    def measure(ctx, step, own_indices, own):
        calls.append((step, list(own_indices), len(own)))
        return by_step[step], by_step[step]["n"]

    monkeypatch.setattr(lift_gate, "measure_lift", measure)
    return calls


# ------------------------------------------------------------------------------------------------- the rule


def outcomes(wins: int, losses: int, ties: int) -> dict:
    """The gate's summary of one-context prompts: `wins` teacher-only right, `losses` student-only right, `ties`
    both wrong."""
    n = wins + losses + ties
    teacher = [True] * wins + [False] * (losses + ties)
    student = [False] * wins + [True] * losses + [False] * ties
    return lift_summary(list(range(n)), ["sibling"] * n, teacher, student)


def test_the_rule_by_hand():
    # 8 prompts, the teacher right where the student is wrong on 3 and tied on 5: lift 0.375, and the sign test's
    # p = P(X >= 3 | X ~ Bin(3, 1/2)) = 1/8, far above 0.025: closed (the bootstrap interval [0.125, 0.75] opened it)
    three = outcomes(3, 0, 5)
    assert (three["lift"], three["teacher_wins"], three["student_wins"], three["sign_test_p"]) == (0.375, 3, 0, 0.125)
    assert three["lift_ci95"][0] > 0  # the descriptive interval still lies above 0: it decides nothing
    assert not lift_gate.passes(three, "lower_bound", 8) and lift_gate.passes(three, "mean", 8)
    # 6 of 8 teacher-only, 2 ties: p = 2^-6 = 1/64 <= 0.025: open; not below min_pairs, whatever the p
    six = outcomes(6, 0, 2)
    assert (six["lift"], six["sign_test_p"]) == (0.75, 1 / 64)
    assert lift_gate.passes(six, "lower_bound", 8) and not lift_gate.passes(six, "lower_bound", 9)
    # 5 of 5 discordant: p = 1/32 = 0.03125 > 0.025, closed; one student-only win spoils 6: p = (1 + 7) / 128 = 1/16
    assert outcomes(5, 0, 3)["sign_test_p"] == 1 / 32 and not lift_gate.passes(outcomes(5, 0, 3), "lower_bound", 8)
    assert outcomes(6, 1, 1)["sign_test_p"] == 8 / 128 and not lift_gate.passes(outcomes(6, 1, 1), "lower_bound", 8)
    # 8 against 1 of 9: p = (1 + 9) / 512 = 0.0195: open; 7 against 1: (1 + 8) / 256 = 0.035: closed
    assert outcomes(8, 1, 0)["sign_test_p"] == 10 / 512 and lift_gate.passes(outcomes(8, 1, 0), "lower_bound", 8)
    assert outcomes(7, 1, 0)["sign_test_p"] == 9 / 256 and not lift_gate.passes(outcomes(7, 1, 0), "lower_bound", 8)
    # ties where both are right count as ties too; more student-only wins: p near 1
    both = lift_summary([0, 1], ["sibling"] * 2, [True, True], [True, True])
    assert (both["teacher_wins"], both["student_wins"], both["sign_test_p"]) == (0, 0, 1.0)
    assert outcomes(0, 3, 5)["sign_test_p"] == 1.0 and not lift_gate.passes(outcomes(0, 3, 5), "mean", 1)
    none = lift_summary([], [], [], [False, False])  # no prompt had a context
    assert (none["n"], none["lift"], none["sign_test_p"]) == (0, None, 1.0)
    assert not lift_gate.passes(none, "lower_bound", 1) and not lift_gate.passes(none, "mean", 1)


def test_the_test_reads_one_context_a_prompt_drawn_uniformly():
    # prompt 0: three contexts, the teacher right on one, the student wrong; prompt 1: two contexts, both right,
    # the student right (a tie whatever the pick). t_0 = 1/3 counts in the lift; the test reads one picked answer
    prompt_of, teacher, student = [0, 0, 0, 1, 1], [True, False, False, True, True], [False, True]
    draws = [lift_evidence(prompt_of, teacher, student, seed=s) for s in range(3000)]
    assert all(d["lift"] == pytest.approx((1 / 3 + 1 - 0 - 1) / 2) for d in draws)  # every context in the lift
    assert all(d["student_wins"] == 0 and d["teacher_wins"] in (0, 1) for d in draws)
    share = sum(d["teacher_wins"] for d in draws) / len(draws)
    # the pick is uniform over the 3 contexts: the win share is 1/3 within 5 binomial standard deviations of 3000
    assert abs(share - 1 / 3) < 5 * (1 / 3 * 2 / 3 / 3000) ** 0.5
    # the pick sees only how many contexts a prompt has, not their answers: with the one right answer rotated over
    # the three contexts, a seed's one pick finds it in exactly one of the three arrangements
    rotations = ([True, False, False], [False, True, False], [False, False, True])
    for seed in range(50):
        wins = [lift_evidence(prompt_of, [*r, True, True], student, seed=seed)["teacher_wins"] for r in rotations]
        assert sum(wins) == 1


def test_the_smallest_lift_that_opens_is_six_wins_over_prompts():
    # 2^-6 = 0.0156 <= 0.025 < 2^-5: six teacher-only wins and no student-only one are the least evidence that opens
    assert [lift_gate.smallest_opening_lift(p) for p in (5, 6, 8, 16, 32, 64)] == [None, 1.0, 0.75, 0.375, 0.1875,
                                                                                   6 / 64]  # fmt: skip
    for prompts in (6, 8, 16, 32):  # and that lift does open a check of `prompts` prompts, one below it does not
        assert lift_gate.passes(outcomes(6, 0, prompts - 6), "lower_bound", min(8, prompts))
        assert not lift_gate.passes(outcomes(5, 0, prompts - 5), "lower_bound", min(8, prompts))
    # the block's docstring gives it at each prompts value it names ("0.375 at 16"): the same figures
    named = re.findall(r"(\d\.\d+) at (\d+)", " ".join(LiftGateConfig.__doc__.split()))
    assert len(named) == 8
    assert all(float(v) == round(lift_gate.smallest_opening_lift(int(p)), len(v) - 2) for v, p in named)  # its digits
    assert LiftGateConfig(kind="lift", prompts=6, min_pairs=6).prompts == 6
    with pytest.raises(ValueError, match=r"prompts \(5\) is below 6.*raise prompts to 6 or more, or use rule: mean"):
        LiftGateConfig(kind="lift", prompts=5, min_pairs=5)
    assert LiftGateConfig(kind="lift", prompts=5, min_pairs=5, rule="mean").rule == "mean"  # mean can open at 5


def test_the_gate_is_a_distilling_methods_and_off_by_default():
    for method in ("sdpo", "sdft", "hybrid", "srpo"):
        stage = gated_recipe(method, {"kind": "lift"}).stages[0]
        gate = lift_gate.create_gate(stage)
        assert gate is not None and (gate.open, gate.checked_step) == (False, None)
        cfg = stage.distill.gate
        assert (cfg.every, cfg.prompts, cfg.min_pairs, cfg.rule) == (10, 16, 8, "lower_bound")
        assert cfg.max_new_tokens is None  # the rollout's
        assert lift_gate.create_gate(gated_recipe(method, {}).stages[0]) is None  # off unless asked for
    assert lift_gate.create_gate(gated_recipe("grpo", {"kind": "lift"}).stages[0]) is None  # grpo does not distil


def gated_recipe(method: str, gate: dict):
    return recipe(Path("unused"), method, distill={"gate": gate})


def timeless(rows: list[dict]) -> list[dict]:
    """Step metrics without the wall-clock ones (which no two runs share)."""
    return [{k: v for k, v in r.items() if "time" not in k and "seconds" not in k} for r in rows]


# ------------------------------------------------------------------------------------ opening and closing


def test_the_gate_opens_and_closes_on_a_scripted_lift_sequence(tmp_path, monkeypatch):
    # checks at every step: open (p 0.01 <= 0.025), closed (n 1 < min_pairs 2), closed (p 0.06), open again
    script = {0: summary(0.5, 0.01), 1: summary(0.5, 0.01, n=1), 2: summary(0.25, 0.06), 3: summary(0.75, 0.004)}
    calls = scripted(monkeypatch, script)
    ctx = stage_context(tmp_path, "sdpo", ToyDomain(), distill={"gate": GATE}, optim={"steps": 4})
    run_stage(ctx)
    rows = metrics(ctx)
    assert [r["lift_gate_open"] for r in rows] == [1.0, 0.0, 0.0, 1.0]
    assert all(r["lift_gate_check"] == 1.0 for r in rows)
    assert [(r["lift_gate_n"], r["lift_gate_lift"], r["lift_gate_p"]) for r in rows] == [
        (6.0, 0.5, 0.01), (1.0, 0.5, 0.01), (6.0, 0.25, 0.06), (6.0, 0.75, 0.004)
    ]  # fmt: skip
    assert all((r["lift_gate_teacher_wins"], r["lift_gate_student_wins"]) == (3.0, 1.0) for r in rows)
    for r in rows:  # an open step distils (SDPO has no policy term); a closed one is GRPO's (no teacher targets)
        assert ("teacher_target_frac" in r) == (r["lift_gate_open"] == 1.0)
        assert ("policy_loss" in r) == (r["lift_gate_open"] == 0.0)
    # each check was handed the step's own prompts and their groups (2 prompts a step, none replayed)
    n_train = len(ctx.domain.train)
    assert calls == [(s, prompts_for_step(n_train, 2, ctx.recipe.seed, 0, s), 2) for s in range(4)]


def test_checks_come_every_k_steps_and_the_decision_holds_between_them(tmp_path, monkeypatch):
    calls = scripted(monkeypatch, {0: summary(0.5, 0.01), 3: summary(-0.5, 0.9)})
    gate = {**GATE, "every": 3}
    ctx = stage_context(tmp_path, "hybrid", ToyDomain(), distill={"gate": gate}, optim={"steps": 5})
    run_stage(ctx)
    rows = metrics(ctx)
    assert [c[0] for c in calls] == [0, 3]
    assert [r["lift_gate_open"] for r in rows] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert [r.get("lift_gate_check") for r in rows] == [1.0, None, None, 1.0, None]


# ------------------------------------------------------------------------------------- closed is GRPO's


@pytest.mark.parametrize("method", ["sdpo", "hybrid", "srpo"])
def test_a_closed_gate_makes_grpos_update_on_the_same_rollouts(tmp_path, monkeypatch, method):
    # srpo's paper defaults set weight decay and warm-up: both stages get the same optimiser settings. `rare` success
    # leaves some groups without one, which the hybrid distils when open (`even` has a success in every group)
    optim = {"steps": 3, "weight_decay": 0.01, "warmup_steps": 0}
    grpo = stage_context(tmp_path / "grpo", "grpo", ToyDomain("rare"), optim=optim)
    grpo.teacher = None
    run_stage(grpo)
    scripted(monkeypatch, dict.fromkeys(range(3), summary(-0.25, 0.8)))
    gated = stage_context(tmp_path / "gated", method, ToyDomain("rare"), distill={"gate": GATE}, optim=optim)
    run_stage(gated)
    reference, same = student_state(grpo), student_state(gated)
    assert any(v.abs().max() > 0 for k, v in reference.items() if "lora_B" in k)  # GRPO moved the weights
    assert all(torch.equal(reference[k], same[k]) for k in reference)  # bit for bit
    for a, b in zip(metrics(grpo), metrics(gated)):
        assert (a["loss"], a["policy_loss"], a["grad_norm"]) == (b["loss"], b["policy_loss"], b["grad_norm"])
    scripted(monkeypatch, dict.fromkeys(range(3), summary(0.5, 0.01)))
    opened = stage_context(tmp_path / "open", method, ToyDomain("rare"), distill={"gate": GATE}, optim=optim)
    run_stage(opened)  # the same stage with the gate open distils: another update
    assert any(not torch.equal(reference[k], v) for k, v in student_state(opened).items())


def test_a_closed_sdft_gate_is_grpo_on_one_sample_per_prompt_which_learns_nothing(tmp_path, monkeypatch):
    # GRPO's advantages are rewards centred on their group's mean: 0 in sdft's groups of one, so no gradient
    scripted(monkeypatch, dict.fromkeys(range(2), summary(-0.25, 0.8)))
    ctx = stage_context(tmp_path, "sdft", ToyDomain(), distill={"gate": GATE})
    before = student_state(ctx)
    run_stage(ctx)
    assert all((r["lift_gate_open"], r["policy_loss"], r["grad_norm"]) == (0.0, 0.0, 0.0) for r in metrics(ctx))
    assert all(torch.equal(before[k], v) for k, v in student_state(ctx).items())


# ------------------------------------------------------------------------------------ the real measurement


def test_the_measurement_logs_its_evidence_and_leaves_training_untouched(tmp_path, monkeypatch):
    spied = []
    original = lift_gate.paired_answers

    def spy(ctx, examples, completions, results, params):
        spied.append([ex.id for ex in examples])
        return original(ctx, examples, completions, results, params)

    monkeypatch.setattr(lift_gate, "paired_answers", spy)
    monkeypatch.setattr(lift_gate, "passes", lambda summary, rule, min_pairs: True)  # measured for real, kept open
    gate = {"kind": "lift", "every": 2, "prompts": 6, "min_pairs": 1}
    ctx = stage_context(tmp_path / "gated", "sdpo", ToyDomain(feedback=True), distill={"gate": gate},
                        optim={"steps": 3})  # fmt: skip
    run_stage(ctx)
    rows = metrics(ctx)
    checks = [r for r in rows if r.get("lift_gate_check")]
    assert [r["step"] for r in checks] == [1, 3]
    for r in checks:  # feedback gives every failure a context: all 6 prompts tried and counted
        assert (r["lift_gate_prompts"], r["lift_gate_n"]) == (6.0, 6.0)
        assert r["lift_gate_lift"] == pytest.approx(r["lift_gate_teacher_accuracy"] - r["lift_gate_student_accuracy"])
        assert r["lift_gate_lift_lo"] <= r["lift_gate_lift"] <= r["lift_gate_lift_hi"] and r["lift_gate_seconds"] > 0
        wins, losses = int(r["lift_gate_teacher_wins"]), int(r["lift_gate_student_wins"])
        assert wins + losses <= 6 and r["lift_gate_p"] == sign_test_p(wins, losses)
    # each check: the step's own 2 prompts first (no new rollout), then 4 drawn train prompts, 2 at a time, none of
    # them the step's own
    own = [str(i) for i in prompts_for_step(len(ctx.domain.train), 2, ctx.recipe.seed, 0, 0)]
    assert len(spied) == 6 and spied[0] == own
    assert not set(own) & {i for chunk in spied[1:3] for i in chunk} and all(len(c) == 2 for c in spied)
    # measuring changed nothing the training reads: the same weights as the stage without a gate
    plain = stage_context(tmp_path / "plain", "sdpo", ToyDomain(feedback=True), optim={"steps": 3})
    run_stage(plain)
    a, b = student_state(ctx), student_state(plain)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in rows] == [r["loss"] for r in metrics(plain)]


def test_a_teacher_without_contexts_costs_a_few_chunks_not_the_budget(tmp_path):
    # nothing ever succeeds and no feedback: no SDPO context anywhere. With 8 prompts and min_pairs 4 the check stops
    # once the prompts left (2) could not bring n to 4: after the step's own 2 and two drawn chunks of 2
    gate = {"kind": "lift", "every": 10, "prompts": 8, "min_pairs": 4}
    ctx = stage_context(tmp_path, "sdpo", ToyDomain(succeed="never"), distill={"gate": gate}, optim={"steps": 1})
    run_stage(ctx)
    row = metrics(ctx)[0]
    assert (row["lift_gate_open"], row["lift_gate_prompts"], row["lift_gate_n"]) == (0.0, 6.0, 0.0)
    assert "lift_gate_lift" not in row  # no figure where nothing was measured
    assert "policy_loss" in row  # closed: GRPO's update (advantages all 0 here)


# -------------------------------------------------------------------------------------------------- seeds


def training_row_seeds(recipe_seed: int, stage: int, steps: int, rows: int) -> set[int]:
    """Every row seed of a stage's training rollouts: step_seed of the step, `rollout.row_seed` of the row."""
    return {row_seed(step_seed(recipe_seed, stage, g), r) for g in range(steps) for r in range(rows)}


def test_the_gates_rollout_seeds_are_no_training_rows_seeds():
    # 500 steps of up to 64 rows, two stages, two recipe seeds: the gate's rows (family "lift_gate.rollout") never
    # take a training row's seed of any step or stage
    for recipe_seed in (0, 17):
        training = set().union(*(training_row_seeds(recipe_seed, stage, 500, 64) for stage in (0, 1)))
        gate = {
            row_seed(family_seed(lift_gate.GATE_ROLLOUT, recipe_seed, stage, g), r)
            for stage in (0, 1)
            for g in range(500)
            for r in range(64)
        }
        assert len(gate) == 2 * 500 * 64 and not gate & training  # distinct among themselves, and apart
    # the offset it replaces, step_seed(..., 7_000_000 + g), gave the gate's row r at step g training step g - 21's
    # row r + 7: the check above fails on it
    old = {row_seed(step_seed(0, 0, 7_000_000 + g), r) for g in range(500) for r in range(64)}
    assert row_seed(step_seed(0, 0, 7_000_000 + 21), 0) == row_seed(step_seed(0, 0, 0), 7)
    assert old & training_row_seeds(0, 0, 500, 64)


def test_a_gated_stage_samples_its_checks_with_the_gate_family_seeds(tmp_path, monkeypatch):
    # the row seeds a real gated stage hands its engine: the training rollouts' and the gate's, apart, and each what
    # its seed function says
    gate = {"kind": "lift", "every": 1, "prompts": 6, "min_pairs": 1}
    ctx = stage_context(tmp_path, "sdpo", ToyDomain(feedback=True), distill={"gate": gate}, optim={"steps": 2})
    seen: dict[str, list[int]] = {"training": [], "gate": []}
    inside = []
    measure, generate = lift_gate.measure_lift, ctx.engine.generate

    def measuring(*args):
        inside.append(True)
        try:
            return measure(*args)
        finally:
            inside.pop()

    def spy(prompts, adapters, params):
        if not params.greedy:
            seen["gate" if inside else "training"] += [seed for _, seed in row_requests(prompts, params)]
        return generate(prompts, adapters, params)

    monkeypatch.setattr(lift_gate, "measure_lift", measuring)
    ctx.engine.generate = spy
    run_stage(ctx)
    group, s = ctx.stage.rollout.group_size, ctx.recipe.seed
    # each step: its 2 prompts x G rows; each check: 4 drawn prompts, 2 a chunk, rows numbered on across chunks
    assert seen["training"] == [row_seed(step_seed(s, 0, g), r) for g in range(2) for r in range(2 * group)]
    gate_seeds = [family_seed(lift_gate.GATE_ROLLOUT, s, 0, g) for g in range(2)]
    assert seen["gate"] == [row_seed(seed, r) for seed in gate_seeds for r in range(4 * group)]
    assert not set(seen["gate"]) & set(seen["training"])


# ------------------------------------------------------------------------------------------------- resume


class Killed(Exception):
    pass


@pytest.mark.parametrize("kill_after", [2, 4])
def test_a_stage_killed_and_resumed_with_the_gate_equals_an_uninterrupted_one(tmp_path, monkeypatch, kill_after):
    # checks at step indices 0 (open) and 2 (closed); a checkpoint after every step. Killed after the 2nd step (its
    # checkpoint not written: the resume starts at index 1, which must still distil, and measures at index 2 again)
    # or after the 4th (the resume runs index 3 alone, closed by the check at 2, measuring nothing)
    script = {0: summary(0.5, 0.01), 2: summary(-0.5, 0.95)}
    calls = scripted(monkeypatch, script)
    blocks = {"distill": {"gate": {**GATE, "every": 2}}, "optim": {"steps": 4}, "monitor": {"checkpoint_every": 1}}
    whole = stage_context(tmp_path / "whole", "sdpo", ToyDomain(), **blocks)
    run_stage(whole)
    assert [r["lift_gate_open"] for r in metrics(whole)] == [1.0, 1.0, 0.0, 0.0]

    def kill(step, last, kept):
        if step == kill_after:
            raise Killed

    killed = stage_context(tmp_path / "killed", "sdpo", ToyDomain(), **blocks)
    killed.on_step = kill
    with pytest.raises(Killed):
        run_stage(killed)
    calls.clear()
    resumed = stage_context(tmp_path / "killed", "sdpo", ToyDomain(), **blocks)  # a new process: fresh model
    run_stage(resumed)
    assert [c[0] for c in calls] == ([2] if kill_after == 2 else [])  # only the checks the resume reached again
    a, b = student_state(whole), student_state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert timeless(metrics(resumed)) == timeless(metrics(whole))
    # the gate's state is what the resume needed: without it, step index 1 would not distil
    if kill_after == 2:
        monkeypatch.setattr(lift_gate.LiftGate, "load_state", lambda self, state: None)
        lost = stage_context(tmp_path / "lost", "sdpo", ToyDomain(), **blocks)
        lost.on_step = kill
        with pytest.raises(Killed):
            run_stage(lost)
        lost = stage_context(tmp_path / "lost", "sdpo", ToyDomain(), **blocks)
        run_stage(lost)
        assert metrics(lost)[1]["lift_gate_open"] == 0.0
        assert any(not torch.equal(a[k], v) for k, v in student_state(lost).items())


def test_the_gate_is_in_the_recipe_grammar():
    stage = resolve_recipe(
        {
            "model": {"name": "tiny-random"},
            "output_dir": "unused",
            "domains": [{"name": "arith", "source": "builtin:arithmetic"}],
            "distill": {"gate": {"kind": "lift", "every": 4}},
            "stages": [{"name": "a", "domain": "arith", "method": "srpo", "distill": {"gate": {"rule": "mean"}}}],
        }
    ).stages[0]
    assert (stage.distill.gate.kind, stage.distill.gate.every, stage.distill.gate.rule) == ("lift", 4, "mean")

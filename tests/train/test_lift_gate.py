"""The lift gate (`distill.gate`, train/lift_gate.py) on tiny-random: its rule by hand, opening and closing on a
scripted lift sequence, GRPO's update exactly while closed, the real measurement's evidence and early stop, a
measurement that leaves training untouched, and kill-and-resume with the gate's state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.train import lift_gate
from adaptercl.train.context import prompts_for_step
from adaptercl.train.lift import lift_summary
from adaptercl.train.stage import run_stage
from tests.train.test_distill_stage import ToyDomain, metrics, recipe, stage_context, student_state

GATE = {"kind": "lift", "every": 1, "prompts": 4, "min_pairs": 2}


def summary(lift: float, lo: float, n: int = 4) -> dict:
    """A lift measurement as `lift.lift_summary` returns it (the figures the rule and the log read)."""
    return {"n": n, "lift": lift, "lift_ci95": [lo, lo + 0.5], "teacher_accuracy": 0.5 + lift / 2,
            "student_accuracy": 0.5 - lift / 2, "by_context": {}}  # fmt: skip


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


def test_the_rule_by_hand():
    # 8 prompts, the teacher right where the student is wrong on 3 and tied on 5: lift 0.375, interval [0.125, 0.75]
    three = lift_summary(list(range(8)), ["sibling"] * 8, [True] * 3 + [False] * 5, [False] * 8)
    assert three["lift"] == 0.375 and three["lift_ci95"][0] > 0
    assert lift_gate.passes(three, "lower_bound", 8) and lift_gate.passes(three, "mean", 8)
    assert not lift_gate.passes(three, "lower_bound", 9)  # n below min_pairs: closed, whatever the lift
    # on 2 of 8: lift 0.25 > 0, but the interval reaches 0 (8 draws without a +1 are likely enough)
    two = lift_summary(list(range(8)), ["sibling"] * 8, [True] * 2 + [False] * 6, [False] * 8)
    assert two["lift"] == 0.25 and two["lift_ci95"][0] == 0.0
    assert not lift_gate.passes(two, "lower_bound", 8) and lift_gate.passes(two, "mean", 8)
    none = lift_summary([], [], [], [False, False])  # no prompt had a context
    assert not lift_gate.passes(none, "lower_bound", 1) and not lift_gate.passes(none, "mean", 1)


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
    # checks at every step: open (lower end 0.1 > 0), closed (n 1 < min_pairs 2), closed (lower end 0), open again
    script = {0: summary(0.5, 0.1), 1: summary(0.5, 0.1, n=1), 2: summary(0.25, 0.0), 3: summary(0.75, 0.25)}
    calls = scripted(monkeypatch, script)
    ctx = stage_context(tmp_path, "sdpo", ToyDomain(), distill={"gate": GATE}, optim={"steps": 4})
    run_stage(ctx)
    rows = metrics(ctx)
    assert [r["lift_gate_open"] for r in rows] == [1.0, 0.0, 0.0, 1.0]
    assert all(r["lift_gate_check"] == 1.0 for r in rows)
    assert [(r["lift_gate_n"], r["lift_gate_lift"], r["lift_gate_lift_lo"]) for r in rows] == [
        (4.0, 0.5, 0.1), (1.0, 0.5, 0.1), (4.0, 0.25, 0.0), (4.0, 0.75, 0.25)
    ]  # fmt: skip
    for r in rows:  # an open step distils (SDPO has no policy term); a closed one is GRPO's (no teacher targets)
        assert ("teacher_target_frac" in r) == (r["lift_gate_open"] == 1.0)
        assert ("policy_loss" in r) == (r["lift_gate_open"] == 0.0)
    # each check was handed the step's own prompts and their groups (2 prompts a step, none replayed)
    n_train = len(ctx.domain.train)
    assert calls == [(s, prompts_for_step(n_train, 2, ctx.recipe.seed, 0, s), 2) for s in range(4)]


def test_checks_come_every_k_steps_and_the_decision_holds_between_them(tmp_path, monkeypatch):
    calls = scripted(monkeypatch, {0: summary(0.5, 0.1), 3: summary(-0.5, -0.9)})
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
    scripted(monkeypatch, dict.fromkeys(range(3), summary(-0.25, -0.5)))
    gated = stage_context(tmp_path / "gated", method, ToyDomain("rare"), distill={"gate": GATE}, optim=optim)
    run_stage(gated)
    reference, same = student_state(grpo), student_state(gated)
    assert any(v.abs().max() > 0 for k, v in reference.items() if "lora_B" in k)  # GRPO moved the weights
    assert all(torch.equal(reference[k], same[k]) for k in reference)  # bit for bit
    for a, b in zip(metrics(grpo), metrics(gated)):
        assert (a["loss"], a["policy_loss"], a["grad_norm"]) == (b["loss"], b["policy_loss"], b["grad_norm"])
    scripted(monkeypatch, dict.fromkeys(range(3), summary(0.5, 0.25)))
    opened = stage_context(tmp_path / "open", method, ToyDomain("rare"), distill={"gate": GATE}, optim=optim)
    run_stage(opened)  # the same stage with the gate open distils: another update
    assert any(not torch.equal(reference[k], v) for k, v in student_state(opened).items())


def test_a_closed_sdft_gate_is_grpo_on_one_sample_per_prompt_which_learns_nothing(tmp_path, monkeypatch):
    # GRPO's advantages are rewards centred on their group's mean: 0 in sdft's groups of one, so no gradient
    scripted(monkeypatch, dict.fromkeys(range(2), summary(-0.25, -0.5)))
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


# ------------------------------------------------------------------------------------------------- resume


class Killed(Exception):
    pass


@pytest.mark.parametrize("kill_after", [2, 4])
def test_a_stage_killed_and_resumed_with_the_gate_equals_an_uninterrupted_one(tmp_path, monkeypatch, kill_after):
    # checks at step indices 0 (open) and 2 (closed); a checkpoint after every step. Killed after the 2nd step (its
    # checkpoint not written: the resume starts at index 1, which must still distil, and measures at index 2 again)
    # or after the 4th (the resume runs index 3 alone, closed by the check at 2, measuring nothing)
    script = {0: summary(0.5, 0.25), 2: summary(-0.5, -0.75)}
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

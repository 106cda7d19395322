"""Per-stage diagnostics: the teacher lift (hand computations, an identity), the forward KL from the previous
stage's policy (0 for an unchanged policy, > 0 otherwise), a run that trains bit-identical adapters with both on and
off, and the statistics behind them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from adaptercl.adapters.live import attach_adapter, copy_adapter, lora_parameters, use_adapters
from adaptercl.measure.stats import linear_fit, paired_bootstrap_interval, t_interval, wilson_interval
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.rollout.hf import HFEngine
from adaptercl.run.diagnostics import LIFT_PROMPTS_SEED, lift_summary, seeded_sample, stage_kl, teacher_lift
from adaptercl.run.sequence import run_recipe
from adaptercl.train import step_seed
from tests.train.test_distill_stage import ToyDomain, stage_context

# ---------------------------------------------------------------------------------------------- statistics


def test_paired_bootstrap_interval_by_hand():
    # two pairs: resampled means are 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4, so the 2.5 % and 97.5 % are 0 and 1
    assert paired_bootstrap_interval([0.0, 1.0]) == (0.0, 1.0)
    assert paired_bootstrap_interval([0.25] * 7) == (0.25, 0.25)
    assert paired_bootstrap_interval([]) is None
    data = [0.0, 1.0, -1.0, 0.5, 1.0, 0.0, 1.0, 0.5]
    lo, hi = paired_bootstrap_interval(data, seed=3)
    assert (lo, hi) == paired_bootstrap_interval(data, seed=3)  # seeded
    assert lo < sum(data) / len(data) < hi and -1.0 <= lo and hi <= 1.0
    narrow = paired_bootstrap_interval(data, confidence=0.5, seed=3)
    assert lo <= narrow[0] <= narrow[1] <= hi
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap_interval(data, confidence=1.0)


def test_linear_fit_by_hand():
    perfect = linear_fit([0.0, 1.0, 2.0, 3.5], [1.0, 3.0, 5.0, 8.0])  # y = 1 + 2x
    assert perfect["slope"] == pytest.approx(2.0) and perfect["intercept"] == pytest.approx(1.0)
    assert perfect["r2"] == pytest.approx(1.0) and perfect["n"] == 4
    # x̄ = 1, ȳ = 1: slope = Σ(x−x̄)(y−ȳ) / Σ(x−x̄)² = 1 / 2; residuals −0.5, 1, −0.5: R² = 1 − 1.5 / 2
    fit = linear_fit([0.0, 1.0, 2.0], [0.0, 2.0, 1.0])
    assert (fit["slope"], fit["intercept"], fit["r2"]) == pytest.approx((0.5, 0.5, 0.25))
    assert linear_fit([0.0, 1.0], [3.0, 3.0])["r2"] is None  # constant y: R² undefined
    with pytest.raises(ValueError, match="same"):
        linear_fit([1.0, 1.0], [0.0, 1.0])
    with pytest.raises(ValueError, match="at least 2"):
        linear_fit([1.0], [0.0])


def test_wilson_and_t_intervals_by_hand():
    # 30 of 100: centre (0.3 + 1.96²/200) / (1 + 1.96²/100); the published 95 % interval is [0.219, 0.396]
    lo, hi = wilson_interval(30, 100)
    assert (round(lo, 3), round(hi, 3)) == (0.219, 0.396)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)  # not empty
    assert 0.0 < wilson_interval(0, 10)[1] < 0.3 and wilson_interval(0, 0) is None
    with pytest.raises(ValueError, match="11 successes of 10"):
        wilson_interval(11, 10)
    # mean 2, s = 1, n = 3: 2 ± 4.303 / sqrt(3)
    assert t_interval([1.0, 2.0, 3.0]) == pytest.approx((2 - 4.303 / 3**0.5, 2 + 4.303 / 3**0.5))
    assert t_interval([5.0, 5.0]) == (5.0, 5.0) and t_interval([1.0]) is None


def test_lift_summary_pairs_per_prompt_by_hand():
    # samples: prompt 0 twice (sibling), prompts 1 and 2 once (feedback); prompt 3 had no context (never listed)
    out = lift_summary(
        prompt_of=[0, 0, 1, 2],
        kinds=["sibling", "sibling", "feedback", "feedback"],
        teacher_correct=[True, False, True, True],
        student_correct=[True, False, False, True],
    )
    # t = [0.5, 1, 1], s = [1, 0, 0]: lift = (2.5 − 1) / 3
    assert out["n"] == 3
    assert out["teacher_accuracy"] == pytest.approx(2.5 / 3) and out["student_accuracy"] == pytest.approx(1 / 3)
    assert out["lift"] == pytest.approx(0.5)
    lo, hi = out["lift_ci95"]
    assert lo <= 0.5 <= hi
    # the exact test's outcomes, one context a prompt: prompts 1 and 2 teacher-only wins, prompt 0 a tie or a
    # student-only win as the seeded pick reads its right or its wrong context: p = P(X >= 2 | Bin(2 or 3, 1/2))
    assert out["teacher_wins"] == 2 and (out["student_wins"], out["sign_test_p"]) in ((0, 0.25), (1, 0.5))
    sibling, feedback = out["by_context"]["sibling"], out["by_context"]["feedback"]
    assert (sibling["n"], sibling["lift"], sibling["lift_ci95"]) == (1, -0.5, [-0.5, -0.5])
    assert (feedback["n"], feedback["lift"]) == (2, 1.0)
    assert (feedback["teacher_accuracy"], feedback["student_accuracy"]) == (1.0, 0.0)
    empty = lift_summary([], [], [], [True, False])
    assert empty == {
        "n": 0,
        "teacher_accuracy": None,
        "student_accuracy": None,
        "lift": None,
        "teacher_wins": 0,
        "student_wins": 0,
        "sign_test_p": 1.0,
        "lift_ci95": None,
        "by_context": {},
    }


# -------------------------------------------------------------------------------------------- teacher lift


def test_a_context_that_repeats_the_question_to_the_student_itself_has_zero_lift(tmp_path):
    # SDFT whose demonstration prompt is the plain question and whose teacher is the student at stage start: the
    # teacher answers exactly as the student does, on every prompt (each toy example has a demonstration).
    same = {"teacher": {"kind": "stage_start"}, "demonstration_template": "{question}"}
    ctx = stage_context(tmp_path, "sdft", ToyDomain(), distill=same)
    ctx.model.train()
    active = list(ctx.model.base_model.active_adapters)
    flags = {n: p.requires_grad for n, p in ctx.model.named_parameters()}
    rng = torch.random.get_rng_state()
    lift = teacher_lift(ctx, num_prompts=5, max_new_tokens=6)
    assert lift["prompts"] == 5 and lift["n"] == 5 and lift["context_frac"] == 1.0
    assert lift["teacher_accuracy"] == lift["student_accuracy"] and lift["lift"] == 0.0
    assert lift["lift_ci95"] == [0.0, 0.0] and list(lift["by_context"]) == ["demonstration"]
    # nothing the training reads was touched
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert ctx.model.training and list(ctx.model.base_model.active_adapters) == active
    assert {n: p.requires_grad for n, p in ctx.model.named_parameters()} == flags


def test_sdpo_lift_shows_siblings_or_feedback_and_only_counts_prompts_with_a_context(tmp_path):
    ctx = stage_context(tmp_path, "sdpo", ToyDomain(feedback=True))
    lift = teacher_lift(ctx, num_prompts=4, max_new_tokens=6)
    assert lift["n"] == 4  # feedback gives every failed sample a context, a success gives its siblings one
    assert set(lift["by_context"]) <= {"sibling", "feedback"}
    assert sum(v["n"] for v in lift["by_context"].values()) >= lift["n"]
    assert lift["lift"] == pytest.approx(lift["teacher_accuracy"] - lift["student_accuracy"])
    assert lift == teacher_lift(ctx, num_prompts=4, max_new_tokens=6)  # seeded: the same measurement again


def counting_generate(ctx) -> list[int]:
    """The prompts of each `generate` call of the stage's engine, as they happen."""
    calls, real = [], ctx.engine.generate
    ctx.engine.generate = lambda prompts, adapters, params: (
        calls.append(len(prompts)) or real(prompts, adapters, params)
    )
    return calls


def test_a_lift_whose_rollout_gives_no_context_stops_there(tmp_path):
    # SDPO whose reward never succeeds and gives no feedback: no sample gets a context, which the rollout alone shows;
    # no greedy answer is decoded after it (the student's once was, on every prompt, to report n = 0)
    ctx = stage_context(tmp_path, "sdpo", ToyDomain(succeed="never"))
    calls = counting_generate(ctx)
    lift = teacher_lift(ctx, num_prompts=4, max_new_tokens=6)
    assert calls == [4]  # the group rollout of the 4 prompts, nothing else
    assert (lift["n"], lift["prompts"], lift["prompts_tried"], lift["context_frac"]) == (0, 4, 4, 0.0)
    assert lift["lift"] is None and lift["by_context"] == {}
    from adaptercl.console import teacher_lift_line  # what the run prints

    assert teacher_lift_line(lift) == "teacher lift: no prompt got a teacher context (4 prompts tried, 4 rolled out)"
    from adaptercl.measure.report import _teacher_lift_section  # and what report.md shows

    assert "| s | sdpo | 0 | n/a | n/a | n/a | none of 4 prompts |" in _teacher_lift_section(
        [{"name": "s", "teacher_lift": lift}]
    )


def test_prompts_no_rollout_could_give_a_context_are_passed_over_unrolled(tmp_path):
    # SDFT shows the example's demonstration: an example without one can never get a context, so it is passed over
    # without a rollout, and the lift goes on in the seeded order to prompts that can; without any, nothing is generated
    import dataclasses

    domain = ToyDomain()
    with_demo = {ex.id for ex in domain.train if int(ex.id) % 3 == 0}  # 4 of 12
    domain.train = [ex if ex.id in with_demo else dataclasses.replace(ex, demonstration=None) for ex in domain.train]
    ctx = stage_context(tmp_path, "sdft", domain, distill={"teacher": {"kind": "stage_start"}})
    calls = counting_generate(ctx)
    lift = teacher_lift(ctx, num_prompts=3, max_new_tokens=6)
    assert calls[0] == 3 and (lift["prompts"], lift["n"], lift["context_frac"]) == (3, 3, 1.0)
    order = seeded_sample(domain.train, 12, step_seed(ctx.recipe.seed, 0, LIFT_PROMPTS_SEED))
    third = [i for i, ex in enumerate(order) if ex.id in with_demo][2]
    assert lift["prompts_tried"] == third + 1  # up to the third prompt with a demonstration in the seeded order
    domain.train = [dataclasses.replace(ex, demonstration=None) for ex in domain.train]
    calls.clear()
    lift = teacher_lift(ctx, num_prompts=3, max_new_tokens=6)
    assert calls == [] and (lift["prompts"], lift["prompts_tried"], lift["n"]) == (0, 12, 0)


# ------------------------------------------------------------------------------------ KL from the previous policy


def test_stage_kl_is_zero_for_an_unchanged_policy_and_positive_after_a_change(tmp_path):
    rec = resolve_recipe(two_stage_sdpo(tmp_path, 0, 0))
    base = load_base(rec.model, "none")
    torch.manual_seed(0)
    model = attach_adapter(base.model, "s1", rec.stages[0].lora)  # fresh: B = 0, the base policy exactly
    use_adapters(model, ["s1"], trainable="s1")
    engine, domain = HFEngine(model, base.tokenizer), ToyDomain()

    def kl(before, after):
        return stage_kl(model, base.tokenizer, engine, domain, before, after, num_prompts=3, max_new_tokens=6, seed=7)

    unchanged = kl([], ["s1"])
    assert unchanged["kl_token_mean"] == 0.0 and unchanged["kl_sequence_mean"] == 0.0
    assert unchanged["prompts"] == 3 and unchanged["response_tokens"] > 0
    with torch.no_grad():
        for name, p in lora_parameters(model, "s1").items():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    moved = kl([], ["s1"])
    assert moved["kl_token_mean"] > 1e-4
    assert moved["kl_sequence_mean"] == pytest.approx(moved["kl_token_mean"] * moved["response_tokens"] / 3)
    assert moved == kl([], ["s1"])  # seeded
    # `continue`: the stage's adapter starts as a copy of the previous one, so an untrained copy has KL 0
    model = attach_adapter(model, "s2", rec.stages[0].lora)
    copy_adapter(model, "s1", "s2")
    use_adapters(model, ["s2"], trainable="s2")
    rng = torch.random.get_rng_state()
    assert kl(["s1"], ["s2"])["kl_token_mean"] == 0.0
    assert torch.equal(torch.random.get_rng_state(), rng) and model.training


def two_stage_sdpo(out, lift_prompts: int, kl_prompts: int) -> dict:
    return {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "lora": {"r": 4, "alpha": 8},
        "optim": {"lr": 5e-3, "steps": 2, "prompts_per_step": 2},
        "rollout": {"group_size": 4, "max_new_tokens": 8},
        "distill": {"support": "full"},
        "eval": {
            "examples_per_domain": 2,
            "drift_probes": 0,
            "teacher_lift_prompts": lift_prompts,
            "stage_kl_prompts": kl_prompts,
        },
        "domains": [
            {"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:digit_fraction"},
            {"name": "mcq", "source": "builtin:mcq", "reward": "tiny_rewards:digit_fraction"},
        ],
        "stages": [
            {"name": "one", "domain": "arith", "method": "sdpo"},
            {"name": "two", "domain": "mcq", "method": "sdpo", "adapter": {"init": "new"}},
        ],
    }


def test_a_run_with_the_diagnostics_trains_bit_identical_adapters_to_one_without(tmp_path):
    events = []
    on = run_recipe(
        resolve_recipe(two_stage_sdpo(tmp_path / "on", 3, 3)), on_event=lambda k, **i: events.append((k, i))
    )
    off = run_recipe(resolve_recipe(two_stage_sdpo(tmp_path / "off", 0, 0)))
    assert on.accuracy == off.accuracy
    for stage in ("stage-01-one", "stage-02-two"):
        for folder in ("adapter", "teacher/adapter"):
            a = load_file(str(tmp_path / "on" / stage / folder / "adapter_model.safetensors"))
            b = load_file(str(tmp_path / "off" / stage / folder / "adapter_model.safetensors"))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (stage, folder)
        lift = json.loads((tmp_path / "on" / stage / "teacher_lift.json").read_text())
        assert lift["prompts"] == 3 and lift["method"] == "sdpo" and lift["teacher_kind"] == "ema"
        assert not (tmp_path / "off" / stage / "teacher_lift.json").exists()
        assert "stage_kl" not in json.loads((tmp_path / "off" / stage / "drift.json").read_text())
    kl = [
        json.loads((tmp_path / "on" / s / "drift.json").read_text())["stage_kl"]
        for s in ("stage-01-one", "stage-02-two")
    ]
    assert kl[0]["before"] == [] and kl[0]["after"] == ["stage-01-one"]  # stage 1 starts from the base
    assert kl[1]["before"] == ["stage-01-one"] and kl[1]["after"] == ["stage-01-one", "stage-02-two"]
    assert all(k["prompts"] == 3 and k["kl_token_mean"] > 0 for k in kl)  # both stages moved the policy
    kinds = [k for k, _ in events]
    assert [i["stage"] for k, i in events if k == "teacher_lift"] == ["stage-01-one", "stage-02-two"]
    assert kinds.index("teacher_lift") < kinds.index("step")  # logged at stage start, before the first step
    report = (tmp_path / "on" / "report.md").read_text()
    assert "## Teacher lift (stage start)" in report and "| stage-02-two | sdpo |" in report
    assert "| stage-02-two | " in report.split("## Forward KL from the previous stage's policy")[1]
    assert "Teacher lift" not in (tmp_path / "off" / "report.md").read_text()
    assert "Forward KL" not in (tmp_path / "off" / "report.md").read_text()


def test_the_engine_sleeps_before_every_diagnostic_forward(tmp_path, monkeypatch):
    """A colocated vLLM is awake after it generates (the evaluation, the diagnostics' own responses); every forward
    of the end-of-stage diagnostics on the training model (parameter drift, response drift, stage KL) must come after
    it slept, so those forwards have the card. The run's engine is an hf engine that records its generate and sleep
    calls; the diagnostics' forwards are recorded where the run calls them."""
    from adaptercl.measure import drift
    from adaptercl.rollout import engines as engines_module
    from adaptercl.run import diagnostics
    from adaptercl.run import live_run as run_module

    log: list[str] = []

    class Recording(HFEngine):
        def generate(self, *args, **kwargs):
            log.append("generate")
            return super().generate(*args, **kwargs)

        def sleep(self) -> None:
            log.append("sleep")

    def recorded(name, fn):
        return lambda *args, **kwargs: log.append(name) or fn(*args, **kwargs)

    monkeypatch.setattr(engines_module, "HFEngine", Recording)
    monkeypatch.setattr(run_module, "parameter_drift_report", recorded("forward", run_module.parameter_drift_report))
    monkeypatch.setattr(drift, "token_scores", recorded("forward", drift.token_scores))
    monkeypatch.setattr(diagnostics, "token_scores", recorded("forward", diagnostics.token_scores))
    raw = two_stage_sdpo(tmp_path / "run", 0, 2)
    raw["stages"] = [{"name": "one", "domain": "arith", "method": "grpo"}]
    raw["optim"]["steps"] = 1
    raw["eval"]["drift_probes"] = 2
    run_recipe(resolve_recipe(raw))
    forwards = [i for i, kind in enumerate(log) if kind == "forward"]
    # parameter drift 1, response drift 2 domains x 2 probes in one batch each x 2 policies, stage KL 2 policies
    assert len(forwards) == 1 + 2 * 2 + 2
    for i in forwards:  # the engine's last call before each forward put it to sleep
        assert [k for k in log[:i] if k != "forward"][-1] == "sleep", log
    assert log.index("generate") < forwards[0]  # the evaluation generated (woke the engine) before the diagnostics

"""The wall-time model of `adaptercl recipe plan` (`plan/wall_time.py`): its measured figures are the H100
measurement's, its fits solve their equations, and each part of the estimate equals a hand computation at the shipped
shapes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import adaptercl.plan.throughputs as tp
import adaptercl.plan.wall_time as wt
from adaptercl.cli import PLAN_CARDS
from adaptercl.model.shapes import GIB, NF4_BITS, SHAPES, base_bytes, lora_params
from adaptercl.plan import memory as mp
from adaptercl.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
from fit_memory_plan import RESULTS  # noqa: E402

SHAPE_7B = SHAPES["qwen/qwen2.5-7b"]
PARAMS_7B = (SHAPE_7B.linear_params() + SHAPE_7B.embedding_params()) / 1e9  # 7.62 B


def hybrid(*overrides: str):
    return mp.planned(load_recipe(REPO / "recipes" / "hybrid.yaml", list(overrides)))


def test_the_step_figures_are_the_h100_measurements():
    data = json.loads(RESULTS.read_text())
    median = {v["variant"]: v["step_time_s"]["median"] for v in data["variants"] if "step_time_s" in v}
    for method, (t1, t8) in wt.STEPS.items():  # <method>:<grad_accum>:<checkpointing>:<chunks>
        assert (t1, t8) == (median[f"{method}:8:true:auto"], median[f"{method}:1:true:auto"])
    workload = data["variants"][0]["workload"]
    assert workload["sequences"] == wt.MEASURED_SEQUENCES
    assert workload["prompt_len"] + workload["response_len"] == wt.MEASURED_TOKENS
    assert "H100" in data["machine"]["gpu"]


def test_the_prompt_lengths_are_the_padding_measurement():
    measured = json.loads((REPO / "benchmarks" / "perf" / "results" / "padding.json").read_text())["domains"]
    as_format = {"math": "gsm8k", "science": "sciknoweval", "tooluse": "tooluse"}  # the recipes' domains
    for name, fmt in as_format.items():
        prompts = measured[name]["prompt_tokens"]
        assert wt.PROMPT_TOKENS[fmt] == (round(prompts["mean"], 1), prompts["n"])
    assert {d.format for d in hybrid().domains if d.format in wt.PROMPT_TOKENS} == set(as_format.values())


def test_the_step_constants_solve_both_measurements():
    """hybrid by hand: C = (1.99744 - 5.84113 / 8) / (7 x 1024) = 1.7680e-4 s a token, A = 5.84113 / 8 - 1024 C =
    0.54910 s a micro-batch; they give back both steps, micro-batch 1 (8 of them) and 8 (one)."""
    for method, (t1, t8) in wt.STEPS.items():
        a, c = wt.step_constants(method)
        assert 8 * (a + 1024 * c) == pytest.approx(t1, rel=1e-12) and a + 8 * 1024 * c == pytest.approx(t8, rel=1e-12)
        assert a > 0 and c > 0
    a, c = wt.step_constants("hybrid")
    assert a == pytest.approx(0.54910, abs=1e-5) and c == pytest.approx(1.7680e-4, rel=1e-4)
    assert wt.step_constants("srpo") == wt.step_constants("sdpo")  # not measured: sdpo's, said in the figures
    assert wt.measured_as("a_new_method") == "sdpo"


def test_the_card_factors_are_the_spec_sheet_ratios():
    assert wt.card_factors(wt.CARDS["rtx4090"]) == pytest.approx((3350 / 1008, 989.4 / 165.2))  # 3.32, 5.99
    assert wt.card_factors(wt.CARDS["rtx3090"]) == pytest.approx((3350 / 936, 989.4 / 71))
    assert set(PLAN_CARDS) == set(wt.CARDS)  # the command's --card choices


def test_the_vllm_decode_step_is_the_least_squares_line_of_the_cited_sweep():
    batches = np.array([b for b, _ in wt.VLLM_SWEEP], dtype=float)
    slope, intercept = np.polyfit(batches, batches / np.array([t for _, t in wt.VLLM_SWEEP]), 1)
    for b in (1, 32, 48):
        assert wt.vllm_decode_step_s(b) == pytest.approx(intercept + slope * b, rel=1e-12)
    assert wt.vllm_decode_step_s(32) == pytest.approx(32 / 975, rel=0.01)  # the fit passes near its points
    assert wt.VLLM_LORA_RATIO == pytest.approx(0.664, abs=1e-3) and wt.VLLM_BNB_RATIO == pytest.approx(0.634, abs=1e-3)


def test_a_training_step_on_the_card_by_hand():
    """hybrid.yaml's tooluse stage at micro-batch 7: 4 groups of 8 rows in micro-batches of rows 0-6 (group 0),
    7-13 (groups 0, 1), 14-20 (1, 2), 21-27 (2, 3), 28-31 (3): 8 prompts of 809.1 tokens (ToolAlpaca's measured mean)
    computed + 32 responses of 384; ceil(32 / 7) = 5 micro-batches x A x 3350 / 1008 + (8 x 809.1 + 32 x 384) x C x
    989.4 / 165.2, x 7.62 / 7.6 B."""
    recipe = hybrid()
    timer = wt.Timer(recipe, SHAPE_7B, 24, wt.CARDS["rtx4090"])
    a, c = wt.step_constants("hybrid")
    assert wt.prefix_runs(32, 7, 8) == 8 and wt.prefix_runs(32, 8, 8) == 4 and wt.prefix_runs(32, 1, 8) == 32
    assert wt.prefix_runs(24, 24, 1) == 24  # one sample per prompt (SDFT): every prompt its own
    by_hand = (5 * a * 3350 / 1008 + (8 * 809.1 + 32 * 384) * c * 989.4 / 165.2) * PARAMS_7B / 7.6
    assert timer.train_step_s(recipe.stages[2], 7) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(29.0, abs=0.1)  # 49.7 s with every row's prompt computed
    twice = hybrid("grpo.iterations=2")
    assert wt.Timer(twice, SHAPE_7B, 24, wt.CARDS["rtx4090"]).train_step_s(twice.stages[2], 7) == pytest.approx(
        2 * by_hand, rel=1e-12
    )


def test_generation_by_hand_on_vllm_and_on_the_hf_engine():
    recipe = hybrid()
    timer = wt.Timer(recipe, SHAPE_7B, 24, wt.CARDS["rtx4090"])
    scale = PARAMS_7B / 7.25 / (wt.VLLM_LORA_RATIO * wt.VLLM_BNB_RATIO)
    # a step's rollouts: 32 sequences decoded together, 384 steps
    assert timer.generate_s(32, 300, 384, batch=32) == pytest.approx(384 * wt.vllm_decode_step_s(32) * scale)
    # evaluation: as many as vLLM's KV cache holds at once (its 0.42 share of 24 GiB less its NF4 weights with
    # float32 block scales, two rank-64 LoRA slots in bf16 and 1.5 GiB of runtime), at most the sweep's 48: 700
    # examples in waves of 48
    weights = base_bytes(SHAPE_7B, "nf4") + SHAPE_7B.linear_params() * (4.5 - NF4_BITS) / 8
    fixed = weights + 2 * lora_params(SHAPE_7B, recipe.stages[0], 64) * 2 + 1.5 * GIB
    holds = (0.42 * 24 * GIB - fixed) / (2 * 28 * 4 * 128 * 2) // (300 + 384)
    assert holds == 69
    assert timer.generate_s(700, 300, 384) == pytest.approx(
        384 * (14 * wt.vllm_decode_step_s(48) + wt.vllm_decode_step_s(700 - 14 * 48)) * scale  # the last wave: 28
    )
    assert timer.generate_s(96, 300, 384) == pytest.approx(2 * 384 * wt.vllm_decode_step_s(48) * scale)  # no rest
    # hf: calls of rollout.batch_size 16, each step the cited batch-1 step + dequantising every NF4 weight
    hf = wt.Timer(hybrid("rollout.engine=hf"), SHAPE_7B, 24, wt.CARDS["rtx4090"])
    dequant = SHAPE_7B.linear_params() * (4.127 / 8 + 4) / 1008e9
    assert dequant == pytest.approx(0.0292, abs=1e-4)  # 6.53 B linear parameters x 4.52 bytes
    assert hf.generate_s(32, 300, 384) == pytest.approx(2 * 384 * (1 / 12.2 + dequant))
    assert hf.generate_s(1, 300, 384) == pytest.approx(384 / 12.2)  # batch 1: no dequantising


def test_the_recipe_estimate_adds_its_parts_by_hand():
    """hybrid.yaml with only stage KL on: training and rollouts per stage, evaluation before and after each stage,
    and stage KL's 16 sampled responses + 2 policies x 4 forwards of 4 after each stage."""
    recipe = hybrid("eval.teacher_lift_prompts=0", "eval.drift_probes=0", "eval.parameter_drift=false",
                    "eval.stage_kl_prompts=16")  # fmt: skip
    rows = [7, 7, 7]
    wall = wt.estimate_wall_time(recipe, SHAPE_7B, rows)
    timer = wt.Timer(recipe, SHAPE_7B, 24, wt.CARDS["rtx4090"])
    # mean prompts: the three trained domains measured (gsm8k, SciKnowEval, ToolAlpaca), the four probes assumed
    prompts = [98.1, 309.6, 809.1]
    assert [timer.prompt(s.domain) for s in recipe.stages] == prompts
    assert [timer.prompt(d.name) for d in recipe.domains] == [*prompts, 300, 300, 300, 300]
    assert wall.phase_s("training") == pytest.approx(sum(150 * timer.train_step_s(s, 7) for s in recipe.stages))
    assert wall.phase_s("rollouts") == pytest.approx(
        sum(150 * timer.generate_s(32, p, 384, batch=32) for p in prompts)
    )
    # evaluation: before the first stage and after each, every domain's 100 examples in calls of their own
    per_evaluation = sum(timer.generate_s(100, p, 384) for p in [*prompts, 300, 300, 300, 300])
    assert wall.phase_s("evaluation") == pytest.approx(4 * per_evaluation)
    stage_kl = [timer.generate_s(16, p, 384) + 2 * 4 * timer.forward_s(4, p + 384) for p in prompts]
    assert wall.phase_s("diagnostics") == pytest.approx(sum(stage_kl))
    # the parts: seconds in all and how often each happens
    assert (wall.parts["train_step"].count, wall.parts["rollout_step"].count) == (450, 450)
    assert (wall.parts["evaluation"].count, wall.parts["evaluation"].each_s) == (4, pytest.approx(per_evaluation))
    assert wall.parts["stage_kl"].count == 3 and wall.parts["stage_kl"].each_s == pytest.approx(sum(stage_kl) / 3)
    assert wall.parts["teacher_lift"].count == wall.parts["response_drift"].count == 0
    a, c = wt.step_constants("grpo")  # a forward: a quarter of GRPO's step
    assert timer.forward_s(4, 684) == pytest.approx(
        (a * 3350 / 1008 + 4 * 684 * c * 989.4 / 165.2) / 4 * PARAMS_7B / 7.6
    )
    assert wall.total_s == pytest.approx(
        wall.phase_s("training") + wall.phase_s("rollouts") + wall.phase_s("evaluation") + wall.phase_s("diagnostics")
    )
    off = hybrid("eval.teacher_lift_prompts=0", "eval.drift_probes=0", "eval.parameter_drift=false",
                 "eval.stage_kl_prompts=0")  # fmt: skip
    assert wt.estimate_wall_time(off, SHAPE_7B, rows).phase_s("diagnostics") == 0.0


def test_every_figure_says_its_kind_and_source():
    text = mp.plan_recipe(load_recipe(REPO / "recipes" / "hybrid.yaml")).render()
    rows = text.split("time figures (adaptercl/plan/wall_time.py):\n")[1].splitlines()
    kinds = [row.split()[0] for row in rows]
    assert set(kinds) == {"measured", "cited", "derived", "assumed"}
    for row, kind in zip(rows, kinds):
        if kind == "cited":
            assert "https://" in row, row
        if kind == "measured":
            assert "benchmarks/perf/" in row, row
    assert any("pull/11267" in row for row in rows) and any("issues/9535" in row for row in rows)
    hf = mp.plan_recipe(load_recipe(REPO / "recipes" / "hybrid.yaml", ["rollout.engine=hf"])).render()
    assert "bitsandbytes/issues/696" in hf and "vLLM" not in hf.split("time figures")[1]
    srpo = mp.plan_recipe(load_recipe(REPO / "recipes" / "srpo.yaml")).render()
    assert "assumed  H100 step, srpo (not measured: sdpo's)" in srpo


def test_a_run_of_known_prompts_on_a_measured_card():
    """The 24 GB rehearsal's case: every prompt 1,024 tokens, the transformers engine, an H200: the training step at
    micro-batch 8 (2 groups of 8: U = 2) and a rollout's generate call by hand, on the H200's spec-sheet ratios."""
    recipe = hybrid("rollout.engine=hf", "optim.prompts_per_step=2", "optim.steps=2")
    wall = wt.estimate_wall_time(recipe, SHAPE_7B, [8, 8, 8], card=tp.H200, prompt_tokens=1024)
    a, c = wt.step_constants("hybrid")
    step = (2 * a * 3350 / 4800 + (2 * 1024 + 16 * 384) * c * 989.4 / 989.4) * PARAMS_7B / 7.6
    assert wall.parts["train_step"].each_s == pytest.approx(step, rel=1e-12) and wall.parts["train_step"].count == 6
    dequant = SHAPE_7B.linear_params() * (4.127 / 8 + 4) / 4800e9
    assert wall.parts["rollout_step"].each_s == pytest.approx(384 * (1 / 12.2 + dequant), rel=1e-12)
    assert wall.card == tp.H200.name


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(2.44, "2.4 s"), (47.2, "47 s"), (125.0, "2.1 min"), (1800.0, "30 min"), (5400.0, "1.5 h"), (27720.0, "7.7 h")],
)
def test_durations_keep_their_unit_so_a_short_figure_is_not_rounded_to_zero(seconds, text):
    from adaptercl.plan.rehearsal import duration

    assert duration(seconds) == text


def test_a_cpu_recipe_plan_prints_its_card_figure_in_seconds_or_minutes_not_zero_hours():
    """The quickstart (a CPU recipe, no rehearsal): its figure on the card is about two minutes, which '.1f h'
    printed as '~0.0 h'; the line also says how to get this machine's figure."""
    from adaptercl.plan.rehearsal import duration

    plan = mp.plan_recipe(load_recipe(REPO / "recipes" / "quickstart.yaml"), gpu_memory_gib=24)
    line = next(line for line in plan.render().splitlines() if line.startswith("wall time on an"))
    assert plan.wall_time.total_s < 180  # minutes, not hours: the case the issue met
    assert f"~{duration(plan.wall_time.total_s)} = training {duration(plan.wall_time.phase_s('training'))} + " in line
    assert "0.0 h" not in line and "`adaptercl recipe rehearse` measures it there" in line

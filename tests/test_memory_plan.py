"""`adaptercl recipe plan`: the memory model against the real H100 measurement, and every shipped recipe planned.

There are no traced figures of the 24 GB recipes; the measured 7B training steps (benchmarks/perf/results/
cuda_7b_memory.json, 14 variants, peak max_memory_reserved) replace them: the model must reproduce each within 15%.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import adaptercl.memory_plan as mp
from adaptercl.cli import main
from adaptercl.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
from fit_memory_plan import RESULTS, measured  # noqa: E402

RECIPE_FILES = sorted((REPO / "recipes").glob("*.yaml"))
GPU_RECIPES = ("grpo.yaml", "sdpo.yaml", "sdft.yaml", "hybrid.yaml", "srpo.yaml")
TOLERANCE = 0.15
SHAPE_7B = mp.SHAPES["qwen/qwen2.5-7b"]


@pytest.mark.parametrize("variant, workload, peak", measured(), ids=[row[0] for row in measured()])
def test_predictor_reproduces_the_measured_training_step(variant, workload, peak):
    predicted = sum(mp.train_terms(SHAPE_7B, "nf4", workload).values()) / mp.GIB
    assert abs(predicted / peak - 1) <= TOLERANCE, f"{variant}: predicted {predicted:.2f} GiB, measured {peak:.2f}"


def test_the_out_of_memory_variant_is_predicted_over_the_h100():
    data = json.loads(RESULTS.read_text())
    oom = [v for v in data["variants"] if "out_of_memory" in v]
    assert len(oom) == 1  # hybrid, micro-batch 8, neither checkpointing nor chunks
    fitted = next(w for name, w, _ in measured() if name == "hybrid:8:false:off")
    workload = type(fitted)(**{**fitted.__dict__, "rows": 8})
    assert sum(mp.train_terms(SHAPE_7B, "nf4", workload).values()) / mp.GIB > 79.18  # the card's capacity


def test_shape_table_reproduces_the_measured_lora_size_and_base():
    data = json.loads(RESULTS.read_text())
    recipe = load_recipe(REPO / "recipes" / "hybrid.yaml")
    assert mp.lora_params(SHAPE_7B, recipe.stages[0]) == data["variants"][0]["setup"]["trainable_parameters"]
    # the measured footprint counts 4 bits per NF4 weight (no absmax); the model adds 0.127 bits of scales
    assert mp.base_bytes(SHAPE_7B, "nf4") / mp.GIB == pytest.approx(data["load"]["model_footprint_gib"], rel=0.03)


@pytest.mark.parametrize("path", RECIPE_FILES, ids=[p.name for p in RECIPE_FILES])
def test_plan_answers_for_every_shipped_recipe(path, capsys):
    code = main(["recipe", "plan", str(path)])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert [line.split()[0] for line in out.splitlines()[2:5]] == ["train", "rollout", "eval"]
    assert "wall time" in out


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_the_24gb_recipes_fit_in_24_gib(name):
    plan = mp.plan_recipe(load_recipe(REPO / "recipes" / name), gpu_memory_gib=24)
    assert plan.fits, plan.render()
    assert all(phase.gib > 5.17 for phase in plan.phases)  # at least the NF4 base


def test_a_plan_that_does_not_fit_names_the_fields_and_exits_1(capsys):
    path = REPO / "recipes" / "sdft.yaml"
    recipe = load_recipe(path, ["optim.activation_checkpointing=false", "optim.grad_accum=4"])
    plan = mp.plan_recipe(recipe, gpu_memory_gib=16)
    train = plan.phases[0]
    assert not train.fits and not plan.fits
    text = "\n".join(train.suggestions)
    assert "optim.activation_checkpointing=true" in text and "optim.grad_accum=" in text
    capsys.readouterr()
    assert main(["recipe", "plan", str(path), "optim.grad_accum=1", "optim.activation_checkpointing=false"]) == 1
    assert "to fit train: stages.math.optim.grad_accum=" in capsys.readouterr().out


def test_unknown_hub_id_is_one_line_and_exit_2(capsys):
    path = REPO / "recipes" / "hybrid.yaml"
    assert main(["recipe", "plan", str(path), "model.name=someone/unknown-7b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "config.json" in err and "someone/unknown-7b" in err


def test_local_config_json_gives_the_shape(tmp_path):
    config = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
              "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert mp.shape_of(str(tmp_path)) == SHAPE_7B


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_recipe_headers_quote_the_plan_and_the_wall_time(name):
    path = REPO / "recipes" / name
    plan = mp.plan_recipe(load_recipe(path), gpu_memory_gib=24)
    header = " ".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))
    assert f"~{plan.wall_time.total_s / 3600:.0f} h on an RTX 4090-class card" in header
    assert f"training {plan.wall_time.train_s / 3600:.1f} h" in header
    assert f"predicted peak {plan.phases[0].gib:.1f} GiB" in header.replace("\n", " ")
    assert f"--method {name.removesuffix('.yaml')} " in header

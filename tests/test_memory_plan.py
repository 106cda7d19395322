"""`adaptercl recipe plan`: the memory model against the real H100 measurement, and every shipped recipe planned.

There are no traced figures of the 24 GB recipes; the measured 7B training steps (benchmarks/perf/results/
cuda_7b_memory.json, 14 variants, peak max_memory_reserved) replace them: the model must reproduce each within 15%.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

import adaptercl.memory_plan as mp
import adaptercl.model_shapes as ms
from adaptercl.cli import main
from adaptercl.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
from fit_memory_plan import RESULTS, measured  # noqa: E402

RECIPE_FILES = sorted((REPO / "recipes").glob("*.yaml"))
GPU_RECIPES = ("grpo.yaml", "sdpo.yaml", "sdft.yaml", "hybrid.yaml", "srpo.yaml")
TOLERANCE = 0.15
SHAPE_7B = ms.SHAPES["qwen/qwen2.5-7b"]


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
    assert ms.lora_params(SHAPE_7B, recipe.stages[0]) == data["variants"][0]["setup"]["trainable_parameters"]
    # the measured footprint counts 4 bits per NF4 weight (no absmax); the model adds 0.127 bits of scales
    assert ms.base_bytes(SHAPE_7B, "nf4") / mp.GIB == pytest.approx(data["load"]["model_footprint_gib"], rel=0.03)


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
    assert all(5.17 < phase.gib <= 22 for phase in plan.phases)  # at least the NF4 base; issue 26's 22 GiB a phase
    train = plan.phases[0].detail
    assert "vllm_asleep 1.50" in train  # vLLM sleeps in the step (auto is planned as vLLM, sleep mode on)
    assert "optim.micro_batch_size auto" in plan.render() and "vLLM claims 0.41 of the card" in plan.render()


def hybrid(*overrides: str):
    return mp.planned(load_recipe(REPO / "recipes" / "hybrid.yaml", list(overrides)))


def test_auto_micro_batch_is_the_largest_whose_planned_peak_fits_with_the_margin():
    """Hybrid's tooluse stage at 1024-token prompts: the step at micro-batch 8 is planned at 19.6 GiB + the 1.5 GiB
    a sleeping vLLM keeps = 21.1 GiB, x 1.1 = 23.2 <= 23.5 GiB (24 less the CUDA context); at 9, 22.6 x 1.1 > 23.5."""
    recipe, index = hybrid(), 2

    def peak(rows: int) -> float:
        workload = mp.train_workload(SHAPE_7B, recipe.stages[index], index, 1024, rows)
        return sum(mp.train_terms(SHAPE_7B, "nf4", workload).values()) / mp.GIB + mp.VLLM_ASLEEP_GIB

    chosen = mp.auto_micro_batch(SHAPE_7B, recipe, index, 1024, card_gib=24)
    assert chosen.rows == 8 and chosen.limit_gib == 23.5
    assert chosen.peak_gib == pytest.approx(peak(8)) and peak(8) * 1.1 <= 23.5 < peak(9) * 1.1
    assert peak(8) == pytest.approx(21.1, abs=0.05)
    assert mp.auto_micro_batch(SHAPE_7B, recipe, index, 1024, card_gib=80).rows == 32  # the whole step fits
    assert mp.auto_micro_batch(SHAPE_7B, recipe, index, 1024, card_gib=80, sequences=16).rows == 16  # a rank's rows
    small = mp.auto_micro_batch(SHAPE_7B, recipe, index, 1024, card_gib=10)
    assert small.rows == 1 and small.peak_gib * 1.1 > small.limit_gib  # nothing fits: 1, and the plan says so
    assert not mp.plan_recipe(load_recipe(REPO / "recipes" / "hybrid.yaml"), gpu_memory_gib=10).phases[0].fits
    # no card to plan for: the recipe's fixed split (grad_accum 16 of 32 sequences, 32 in the tooluse stage)
    assert [s.optim.split_rows(32) for s in recipe.stages] == [2, 2, 1]


def test_sleep_mode_gives_the_card_to_the_training_step():
    """What shares the card with the step: a sleeping vLLM keeps VLLM_ASLEEP_GIB, an awake one its whole claim;
    the hf engine nothing. Rollouts and evaluation both run on the recipe's engine."""
    terms = {}
    for case, overrides in {
        "asleep": [],
        "awake": ["rollout.enable_sleep_mode=false"],
        "hf": ["rollout.engine=hf"],
    }.items():
        plan = mp.plan_recipe(load_recipe(REPO / "recipes" / "hybrid.yaml", ["optim.micro_batch_size=2", *overrides]))
        terms[case] = [dict(t.split(" ") for t in p.detail.split(", ")) for p in plan.phases]
    claim = 0.41 * 24
    assert float(terms["asleep"][0]["vllm_asleep"]) == mp.VLLM_ASLEEP_GIB and "vllm_awake" not in terms["asleep"][0]
    assert float(terms["awake"][0]["vllm_awake"]) == pytest.approx(claim, abs=0.005)
    assert not {"vllm_asleep", "vllm_awake"} & set(terms["hf"][0])
    for phase in (1, 2):  # rollout, eval: the trainer's resident memory + vLLM's claim; hf: its own KV cache
        assert float(terms["asleep"][phase]["vllm_claim"]) == pytest.approx(claim, abs=0.005)
        assert "kv_cache" in terms["hf"][phase] and "vllm_claim" not in terms["hf"][phase]


def test_vllm_auto_share_holds_its_weights_slots_runtime_and_a_steps_kv_cache():
    """By hand at the 7B shape: KV 2 (K, V) x 28 layers x 4 heads x 128 x 2 bytes = 57,344 B a token, for 32 sequences
    of 1024 + 384 tokens = 2.41 GiB; the NF4 base 5.17 GiB, two rank-64 LoRA slots (48 = 3 stacked rank-16 adapters,
    rounded up to a rank vLLM accepts) in bf16, 1.5 GiB of runtime: 9.68 GiB, 0.41 of 24 GiB rounded up."""
    recipe = hybrid()
    kv = 2 * 28 * 4 * 128 * 2 * 32 * (1024 + 384) / mp.GIB
    slots = 2 * ms.lora_params(SHAPE_7B, recipe.stages[0], 64) * 2 / mp.GIB
    need = ms.base_bytes(SHAPE_7B, "nf4") / mp.GIB + slots + 1.5 + kv
    assert kv == pytest.approx(2.406, abs=1e-3) and need == pytest.approx(9.68, abs=0.01)
    assert mp.vllm_utilization(SHAPE_7B, recipe, 24) == 0.41 == math.ceil(100 * need / 24) / 100
    assert mp.vllm_utilization(SHAPE_7B, recipe, 48) == 0.21  # the same GiB on a larger card
    assert mp.vllm_utilization(SHAPE_7B, hybrid("rollout.gpu_memory_utilization=0.5"), 24) == 0.5


def test_a_plan_that_does_not_fit_names_the_fields_and_exits_1(capsys):
    path = REPO / "recipes" / "sdft.yaml"
    fixed = "optim.micro_batch_size=null"  # grad_accum's split (the recipe's auto would already be 1 sequence)
    recipe = load_recipe(path, ["optim.activation_checkpointing=false", "optim.grad_accum=4", fixed])
    plan = mp.plan_recipe(recipe, gpu_memory_gib=16)
    train = plan.phases[0]
    assert not train.fits and not plan.fits
    text = "\n".join(train.suggestions)
    assert "optim.activation_checkpointing=true" in text and "optim.grad_accum=" in text
    capsys.readouterr()
    assert (
        main(["recipe", "plan", str(path), "optim.grad_accum=1", "optim.activation_checkpointing=false", fixed]) == 1
    )
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
    assert ms.shape_of(str(tmp_path)) == SHAPE_7B


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_recipe_headers_quote_the_plan_and_the_wall_time(name):
    path = REPO / "recipes" / name
    plan = mp.plan_recipe(load_recipe(path), gpu_memory_gib=24)
    header = " ".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))
    assert f"~{plan.wall_time.total_s / 3600:.0f} h on an RTX 4090-class card" in header
    assert f"training {plan.wall_time.train_s / 3600:.1f} h" in header
    assert f"predicted peak {plan.phases[0].gib:.1f} GiB" in header.replace("\n", " ")
    assert f"--method {name.removesuffix('.yaml')} " in header

"""Continual machinery on tiny-random: adapter init policies (continue / new / merge) over three stages, frozen
earlier adapters, the merge-initialised adapter's ΔW, and the combined adapter written after each stage."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from adaptercl.adapters.factors import from_model, read_adapter_folder
from adaptercl.adapters.live import attach_adapter, load_adapter
from adaptercl.adapters.merge import init_adapter_from_merge
from adaptercl.adapters.merge_math import merge_module_deltas, refactorize
from adaptercl.adapters.stacking import AdapterPlan, plan_adapters
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import AdapterInitConfig, LoraConfig, ModelConfig, resolve_recipe
from adaptercl.run.sequence import run_recipe

TINY = ModelConfig(name="tiny-random")
IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 11]])
STAGES = ("stage-01-one", "stage-02-two", "stage-03-three")


def three_stage_recipe(out, inits: list[str], **stage3) -> dict:
    return {
        "model": {"name": "tiny-random"},
        "output_dir": str(out),
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
        "optim": {"lr": 2e-2, "steps": 1, "prompts_per_step": 2},
        "rollout": {"group_size": 2, "max_new_tokens": 8},
        "eval": {"examples_per_domain": 2},
        "domains": [
            {"name": "arith", "source": "builtin:arithmetic", "reward": "tiny_rewards:char_length"},
            {"name": "mcq", "source": "builtin:mcq", "reward": "tiny_rewards:char_length"},
        ],
        "stages": [
            {"name": "one", "domain": "arith", "adapter": {"init": inits[0]}},
            {"name": "two", "domain": "mcq", "adapter": {"init": inits[1]}},
            {"name": "three", "domain": "arith", "adapter": {"init": inits[2], **stage3}},
        ],
    }


def done(out, stage: str) -> dict:
    return json.loads((out / stage / "done.json").read_text())


def tensors(out, stage: str, folder: str = "adapter") -> dict[str, torch.Tensor]:
    return load_file(str(out / stage / folder / "adapter_model.safetensors"))


def logits_of_stack(out, stages: list[str]) -> torch.Tensor:
    model = load_base(TINY, "none").model
    for s in stages:
        model = load_adapter(model, out / s / "adapter", s)
    model.base_model.set_adapter(list(stages))
    with torch.no_grad():
        return model(input_ids=IDS).logits


def logits_of_combined(out, stage: str) -> torch.Tensor:
    model = PeftModel.from_pretrained(load_base(TINY, "none").model, str(out / stage / "combined_adapter"))
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.fixture(scope="module")
def new_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("new")
    run_recipe(resolve_recipe(three_stage_recipe(out, ["new", "new", "new"])))
    return out


def test_new_stacks_frozen_adapters_and_leaves_earlier_ones_bit_identical(new_run):
    out = new_run
    assert [done(out, s)["adapters"] for s in STAGES] == [list(STAGES[:1]), list(STAGES[:2]), list(STAGES)]
    # The combined adapter after stage 3 is built from the live model's adapters: its first rank blocks are
    # stage 1's and stage 2's adapters as they were saved right after their own stages (scale 8/4 = 2 is exact).
    combined = tensors(out, STAGES[2], "combined_adapter")
    for k, stage in enumerate(STAGES[:2]):
        own = tensors(out, stage)
        for key, value in own.items():
            block = combined[key][4 * k : 4 * k + 4] if "lora_A" in key else combined[key][:, 4 * k : 4 * k + 4]
            expected = value if "lora_A" in key else 2.0 * value
            assert torch.equal(block, expected), (stage, key)
    assert done(out, STAGES[2])["combined_adapter"]["rank"] == 12


def test_combined_adapter_reproduces_the_stacked_model(new_run):
    for k, stage in enumerate(STAGES):
        stacked, combined = logits_of_stack(new_run, list(STAGES[: k + 1])), logits_of_combined(new_run, stage)
        torch.testing.assert_close(combined, stacked, rtol=1e-5, atol=1e-5)


def test_continue_trains_one_adapter_through_all_stages(tmp_path):
    out = tmp_path / "run"
    run_recipe(resolve_recipe(three_stage_recipe(out, ["new", "continue", "continue"])))
    assert [done(out, s)["adapters"] for s in STAGES] == [[s] for s in STAGES]
    one, three = tensors(out, STAGES[0]), tensors(out, STAGES[2])
    assert any(not torch.equal(one[k], three[k]) for k in one)  # continued training moved it
    torch.testing.assert_close(logits_of_combined(out, STAGES[2]), logits_of_stack(out, [STAGES[2]]))


def test_merge_init_runs_and_logs_its_refactorisation_error(tmp_path):
    out = tmp_path / "run"
    recipe = three_stage_recipe(out, ["new", "new", "merge"], merge_method="ties", merge_density=0.5)
    run_recipe(resolve_recipe(recipe))
    info = done(out, STAGES[2])
    assert info["adapters"] == [STAGES[2]] and info["init"] == "merge"
    merge = info["init_merge"]
    assert merge["sources"] == list(STAGES[:2]) and merge["weights"] == [1.0, 1.0] and merge["method"] == "ties"
    assert 0.0 <= merge["rel_error_max"] < 1.0 and len(merge["rel_error"]) == 2 * 3  # 2 layers x 3 modules
    torch.testing.assert_close(logits_of_combined(out, STAGES[2]), logits_of_stack(out, [STAGES[2]]))


def merge_of_new_stages(sources: list[str], target: str, weights: list[float]):
    """Plans and adapter blocks of `new` stages training `sources`, then a task-arithmetic merge stage `target`."""
    plans = [AdapterPlan(s, "new", tuple(sources[:k]), tuple(sources[:k]), None, ()) for k, s in enumerate(sources)]
    plans.append(AdapterPlan(target, "merge", (), tuple(sources), None, tuple(sources)))
    inits = [AdapterInitConfig(init="new")] * len(sources)
    return plans, [*inits, AdapterInitConfig(init="merge", merge_method="task_arithmetic", merge_weights=weights)]


def test_merged_adapter_delta_equals_the_refactorised_merge():
    torch.manual_seed(0)
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    model = attach_adapter(load_base(TINY, "none").model, "x1", lora)
    model = attach_adapter(model, "x2", LoraConfig(r=2, alpha=2, target_modules=["q_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn_like(p))
    model = attach_adapter(model, "m", lora)
    report = init_adapter_from_merge(model, *merge_of_new_stages(["x1", "x2"], "m", [0.7, -0.4]), seed=0)
    merged = merge_module_deltas(
        [from_model(model, "x1").deltas(), from_model(model, "x2").deltas()], [0.7, -0.4], "task_arithmetic"
    )
    result = from_model(model, "m")
    assert result.scaling == 2.0  # the stage's own lora alpha / r is kept; its scale is folded into B
    for module, delta in merged.items():
        a, b, err = refactorize(delta, 4)
        torch.testing.assert_close(result.deltas()[module], b @ a, rtol=1e-5, atol=1e-6)
        assert report["rel_error"][module] == pytest.approx(err, abs=1e-7)
    for module in result.modules:
        if module.endswith("v_proj"):  # only `a` (rank 4) is there: exact, every rank direction used
            assert report["rel_error"][module] < 1e-6
        if module.endswith("q_proj"):  # rank <= 6 merged into 4: a real truncation
            assert report["rel_error"][module] > 0
    # rank directions the merge leaves empty keep the fresh random A row (B column 0), so they can still learn
    model = attach_adapter(model, "m8", LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    fresh_a = {m: a.clone() for m, (a, _) in from_model(model, "m8").modules.items()}
    init_adapter_from_merge(model, *merge_of_new_stages(["x1"], "m8", [1.0]), seed=0)
    for module, (a, b) in from_model(model, "m8").modules.items():
        assert torch.equal(a[4:], fresh_a[module][4:]) and float(b[:, 4:].abs().max()) == 0.0
        torch.testing.assert_close(from_model(model, "m8").deltas()[module], from_model(model, "x1").deltas()[module])


def test_merge_after_continue_merges_each_stage_task_vector_once(tmp_path):
    # Stage 2 continues stage 1's adapter (ΔW_2 = ΔW_1 + d_2), so the stage task vectors are ΔW_1 and ΔW_2 − ΔW_1:
    # task arithmetic with weights [1, 1] starts stage 3 at ΔW_2, not at ΔW_1 + ΔW_2 = 2ΔW_1 + d_2. Stage 3 trains
    # with lr 1e-12, so its saved adapter is its merge start (rank 4 = lora.r: the re-factorisation is exact).
    out = tmp_path / "run"
    recipe = three_stage_recipe(out, ["new", "continue", "merge"], merge_weights=[1.0, 1.0])
    recipe["stages"][2]["optim"] = {"lr": 1e-12}
    run_recipe(resolve_recipe(recipe))
    one, two, three = (read_adapter_folder(out / s / "adapter").deltas() for s in STAGES)
    assert min(float(d.abs().max()) for d in one.values()) > 1e-4  # stage 1 moved every module: a real check
    for module, delta in three.items():
        torch.testing.assert_close(delta, two[module], rtol=1e-4, atol=1e-6)
    assert done(out, STAGES[2])["init_merge"]["sources"] == list(STAGES[:2])


def test_merge_after_merge_measures_the_earlier_merge_stage_from_its_merge_start(tmp_path):
    # Stage 2 starts at 0.5·ΔW_1 (exact at rank 4), so its task vector is ΔW_2 − 0.5·ΔW_1; stage 3 merges
    # [0.5·ΔW_1, ΔW_2 − 0.5·ΔW_1] = ΔW_2. Whole adapters would give 0.5·ΔW_1 + ΔW_2; ΔW_2 − (the model before
    # stage 2) would give ΔW_2 − 0.5·ΔW_1.
    out = tmp_path / "run"
    recipe = three_stage_recipe(out, ["new", "merge", "merge"], merge_weights=[0.5, 1.0])
    recipe["stages"][1]["adapter"]["merge_weights"] = [0.5]
    recipe["stages"][2]["optim"] = {"lr": 1e-12}
    resolved = resolve_recipe(recipe)
    assert [p.start for p in plan_adapters(resolved)] == ["zero", "merge", "merge"]
    run_recipe(resolved)
    one, two, three = (read_adapter_folder(out / s / "adapter").deltas() for s in STAGES)
    assert min(float(d.abs().max()) for d in one.values()) > 1e-4
    for module, delta in three.items():
        torch.testing.assert_close(delta, two[module], rtol=1e-4, atol=1e-6)
    merge = done(out, STAGES[2])["init_merge"]
    assert merge["task_vectors"] == [STAGES[0], f"{STAGES[1]} - its merge start"] and merge["weights"] == [0.5, 1.0]


def test_task_vector_starts_of_the_plan(tmp_path):
    recipe = resolve_recipe(three_stage_recipe(tmp_path, ["continue", "continue", "new"]))
    starts = [(p.start, p.copy_from) for p in plan_adapters(recipe)]
    assert starts == [("zero", None), ("copy", STAGES[0]), ("zero", None)]  # the first stage has nothing to copy

"""`lora.target_modules` resolved against the model (`model/lora_targets.py`) and the bad inputs a family brings:
an architecture transformers does not know, a family whose projections `auto` does not know, a list that matches
nothing, `all-linear` on an MoE that keeps its experts as linear modules. Each is one line naming what was found and
what to change; from `adaptercl recipe run`, exit 2 with nothing written to output_dir. What `auto` adapts in each
shipped family is tests/model/test_model_family.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from tiny_families import FAMILIES, family_config, write_tiny_family
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

from adaptercl.cli import main
from adaptercl.model.base import build_byte_tokenizer
from adaptercl.model.lora_targets import resolve_lora_targets
from adaptercl.recipe.grammar import RecipeError


def skeleton(family: str) -> torch.nn.Module:
    """The tiny `family` model with every module and no weight (meta device), as the run's check builds it."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(family_config(family, build_byte_tokenizer()))


def unfused_moe() -> torch.nn.Module:
    """The tiny Qwen3.5-MoE with its routed experts as separate linear modules (`mlp.experts.<i>.gate_proj` ...), as
    MoE models with their own code keep them (transformers 5.x fuses them), beside its shared expert, whose
    projections have the experts' names."""
    model = skeleton("qwen3_5_moe")
    for layer in model.model.layers:
        layer.mlp.experts = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {n: torch.nn.Linear(64, 32, device="meta") for n in ("gate_proj", "up_proj", "down_proj")}
            )
            for _ in range(4)
        )
    return model


def tiny_qwen3_next() -> torch.nn.Module:
    """A tiny Qwen3-Next (Gated DeltaNet + attention, routed experts and a shared expert), on the meta device."""
    fields = {key: value for key, value in family_config("qwen3_5_moe", build_byte_tokenizer()).get_text_config()
              .to_dict().items() if key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim")}  # fmt: skip
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_next", **fields))


def test_a_list_that_misses_the_family_names_its_linear_layers():
    with pytest.raises(RecipeError) as err:
        resolve_lora_targets(skeleton("phi3"), ["q_proj", "v_proj", "o_proj"], None)
    assert str(err.value) == (
        "lora.target_modules: 'q_proj' matches no module of Phi3ForCausalLM; its linear layers are down_proj, "
        "gate_up_proj, o_proj, qkv_proj (or use auto)"
    )
    assert resolve_lora_targets(skeleton("phi3"), ["qkv_proj", "o_proj"], None) == ["qkv_proj", "o_proj"]


def test_a_list_outside_the_layers_kept_notes_the_hybrid_layer_types():
    """Qwen3.5's q_proj is in its full-attention layer (3) only; layers 0-2 are Gated DeltaNet."""
    with pytest.raises(RecipeError) as err:
        resolve_lora_targets(skeleton("qwen3_5"), ["q_proj"], [0, 1], "stages.one.lora")
    assert str(err.value) == (
        "stages.one.lora.target_modules: 'q_proj' is in no layer of Qwen3_5ForCausalLM (lora.layers [0, 1]; layer "
        "types: 0-2 linear_attention, 3 full_attention); its linear layers there are down_proj, gate_proj, "
        "in_proj_a, in_proj_b, in_proj_qkv, in_proj_z, out_proj, up_proj (or use auto)"
    )
    assert resolve_lora_targets(skeleton("qwen3_5"), ["q_proj"], [3]) == ["q_proj"]
    auto = resolve_lora_targets(skeleton("qwen3_5"), "auto", [0])  # a linear-attention layer: its own projections
    assert auto == ["down_proj", "gate_proj", "in_proj_qkv", "in_proj_z", "out_proj", "up_proj"]


def test_fused_experts_cannot_be_named():
    with pytest.raises(RecipeError, match=r"^lora.target_modules: 'experts' names Qwen3MoeExperts modules of "):
        resolve_lora_targets(skeleton("qwen3_moe"), ["experts"], None)
    assert resolve_lora_targets(skeleton("qwen3_moe"), "all-linear", None) == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_all_linear_on_experts_kept_as_modules_is_refused_and_auto_leaves_them_out():
    model = unfused_moe()
    with pytest.raises(RecipeError) as err:
        resolve_lora_targets(model, "all-linear", None)
    assert str(err.value).startswith(
        "lora.target_modules: all-linear would wrap every routed expert of Qwen3_5MoeForCausalLM (48 expert "
        "modules, e.g. model.layers.0.mlp.experts.0.down_proj); use auto"
    )
    auto = resolve_lora_targets(model, "auto", None)  # the suffix gate_proj would reach the experts: full names
    assert len(auto) == 3 * (3 + 3) + (4 + 3) and not [name for name in auto if ".experts." in name]
    assert {name for name in auto if name.endswith("gate_proj")} == {
        f"model.layers.{i}.mlp.shared_expert.gate_proj" for i in range(4)
    }
    wrapped = get_peft_model(model, PeftLoraConfig(r=2, target_modules=auto))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in wrapped.named_modules() if n.endswith(".lora_A")}
    assert {n.removeprefix("base_model.model.") for n in adapted} == set(auto)  # PEFT wraps exactly these


def test_names_peft_would_move_onto_fused_experts_are_left_out_or_refused():
    """Qwen3-Next is of transformers' qwen2_moe pattern: PEFT moves any gate_proj/up_proj/down_proj target onto the
    fused routed experts' parameters (its v4 -> v5 adapter conversion), so its shared expert cannot be named."""
    model = tiny_qwen3_next()
    assert resolve_lora_targets(model, "auto", None) == [
        "in_proj_qkvz",
        "k_proj",
        "o_proj",
        "out_proj",
        "q_proj",
        "v_proj",
    ]
    with pytest.raises(RecipeError) as err:
        resolve_lora_targets(model, ["q_proj", "gate_proj", "up_proj", "down_proj"], None)
    assert str(err.value) == (
        "lora.target_modules: PEFT moves down_proj, gate_proj, up_proj of a qwen3_next model onto its fused routed "
        "experts, which adaptercl does not train; leave them out (or use auto)"
    )


def test_auto_on_a_multimodal_model_stays_in_the_language_model():
    """Gemma 3's vision tower has q_proj/k_proj/v_proj too: auto names the decoder's modules in full."""
    text = family_config("gemma3", build_byte_tokenizer()).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}  # fmt: skip
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    auto = resolve_lora_targets(model, "auto", None)
    assert len(auto) == 4 * 7 and all(".language_model.layers." in name for name in auto)
    assert any(".vision_tower." in n and n.endswith("q_proj") for n, _ in model.named_modules())


def test_auto_refuses_a_family_whose_projections_it_does_not_know():
    """GPT-2's attention and MLP are Conv1D modules named c_attn, c_proj, c_fc: LoRA can wrap them when named."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(RecipeError) as err:
        resolve_lora_targets(model, "auto", None)
    assert str(err.value) == (
        "lora.target_modules: auto knows no attention or MLP projection of GPT2LMHeadModel; name its layers to "
        "train in lora.target_modules: c_attn, c_fc, c_proj"
    )
    assert resolve_lora_targets(model, ["c_attn", "c_fc"], None) == ["c_attn", "c_fc"]


@pytest.fixture(scope="module")
def bad_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-models")
    unknown = root / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "xyzformer", "num_hidden_layers": 2}))
    gpt2 = root / "gpt2"
    GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64).save_pretrained(gpt2)
    return {"unknown": unknown, "gpt2": gpt2, "phi3": write_tiny_family("phi3", root / "phi3")}


BAD_INPUTS = {  # model folder, lora block -> the error line's start and what it names
    "unknown architecture": (
        "unknown",
        {},
        "error: model.name: {folder}/config.json: model_type 'xyzformer' is an architecture transformers",
    ),
    "family auto cannot target": (
        "gpt2",
        {},
        "error: stages.one.lora.target_modules: auto knows no attention or MLP projection of GPT2LMHeadModel",
    ),
    "target_modules matching nothing": (
        "phi3",
        {"target_modules": ["q_proj"]},
        "error: stages.one.lora.target_modules: 'q_proj' matches no module",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_recipe_run_refuses_in_one_line_and_writes_nothing(case, bad_folders, tmp_path, capsys):
    name, lora, expected = BAD_INPUTS[case]
    folder, out = bad_folders[name], tmp_path / "out"
    recipe = {
        "model": {"name": str(folder)},
        "output_dir": str(out),
        "lora": lora,
        "domains": [{"name": "arith", "source": "builtin:arithmetic"}],
        "stages": [{"name": "one", "domain": "arith"}],
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["recipe", "run", str(tmp_path / "recipe.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected.format(folder=folder)) and err.count("\n") == 1
    assert not out.exists()


def test_every_shipped_family_is_a_known_causal_lm():
    """The families of the matrix, as their config.json says: the check passes them (and the matrix runs them)."""
    from adaptercl.model.architecture import check_architecture

    for family in FAMILIES:
        config = family_config(family, build_byte_tokenizer()).to_dict()
        check_architecture(config, family)

"""The plan's shapes of Qwen3 and Qwen3.5 (`adaptercl/model/shapes.py`) against transformers' own models, and the
24 GB plans of the models the SDPO and SRPO papers train (README "A 24 GB card").

Each known shape is checked against the model transformers 5.23 builds from a config of those numbers, on the meta
device (no memory, nothing downloaded): every projection's (in, out) and the parameter counts. The Gated DeltaNet
state and the KV cache are checked against what a tiny random Qwen3.5 really keeps after a forward.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5TextConfig, Qwen3Config

from adaptercl.cli import main
from adaptercl.model import shapes as ms
from adaptercl.plan import memory as mp
from adaptercl.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[2]
HYBRID = REPO / "recipes" / "hybrid.yaml"


def transformers_config(shape: ms.Shape):
    """A transformers text config with the shape's numbers (what config.json's text part says)."""
    common = dict(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
        tie_word_embeddings=shape.tie_embeddings, head_dim=shape.head_dim,
    )  # fmt: skip
    if shape.linear is None:
        return Qwen3Config(**common)
    la = shape.linear
    return Qwen3_5TextConfig(
        **common, layer_types=list(shape.layer_types), linear_num_key_heads=la.key_heads,
        linear_num_value_heads=la.value_heads, linear_key_head_dim=la.key_dim, linear_value_head_dim=la.value_dim,
        linear_conv_kernel_dim=la.conv_kernel,
    )  # fmt: skip


@pytest.mark.parametrize("key", ["qwen/qwen3-4b", "qwen/qwen3-8b", "qwen/qwen3.5-4b", "qwen/qwen3.5-9b"])
def test_each_projection_and_parameter_count_is_the_transformers_models(key):
    shape = ms.SHAPES[key]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(shape))
    for i in range(shape.layers):
        found = {name.rsplit(".", 1)[-1]: (m.in_features, m.out_features) for name, m in model.named_modules()
                 if name.startswith(f"model.layers.{i}.") and isinstance(m, torch.nn.Linear)}  # fmt: skip
        assert found == shape.layer_shapes(i), f"layer {i}"
    linear = sum(
        m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    )
    assert linear == shape.linear_params()
    embedding, head = model.get_input_embeddings().weight, model.lm_head.weight
    assert (head is embedding) == shape.tie_embeddings  # a tied head is the embedding's own tensor
    assert embedding.numel() + (0 if head is embedding else head.numel()) == shape.embedding_params()
    everything = sum(p.numel() for p in model.parameters())
    rest = everything - linear - shape.embedding_params()  # norms, q/k norms, conv1d, A_log, dt_bias
    # unquantized_params counts the RMSNorms and the conv1d; left out: per attention layer q_norm and k_norm
    # (2 x head_dim), per Gated DeltaNet layer A_log and dt_bias (2 x value heads) and its gated norm (value dim)
    gdn = shape.layers - shape.attention_layers
    small = shape.attention_layers * 2 * shape.head_dim
    small += gdn * (2 * shape.linear.value_heads + shape.linear.value_dim) if shape.linear else 0
    assert rest == shape.unquantized_params() + small


def test_the_qwen3_parameter_counts_are_the_model_cards():
    # Model cards of Qwen/Qwen3-4B and Qwen/Qwen3-8B: non-embedding parameters 3.6B and 6.95B, rounded to the digits
    # shown (so within half a unit of the last one)
    assert abs(ms.SHAPES["qwen/qwen3-4b"].linear_params() - 3.6e9) <= 0.05e9
    assert abs(ms.SHAPES["qwen/qwen3-8b"].linear_params() - 6.95e9) <= 0.005e9


def test_a_hub_qwen3_5_config_json_gives_the_table_shape(tmp_path):
    table = ms.SHAPES["qwen/qwen3.5-4b"]
    text = transformers_config(table).to_dict()
    full = Qwen3_5Config(text_config=text, tie_word_embeddings=table.tie_embeddings).to_dict()  # the hub layout
    assert full["model_type"] == "qwen3_5" and full["text_config"]["model_type"] == "qwen3_5_text"
    (tmp_path / "config.json").write_text(Qwen3_5Config(**full).to_json_string())
    assert ms.shape_of(str(tmp_path)) == table
    assert ms.model_type_of(str(tmp_path)) == "qwen3_5"
    # a loaded text model's own config (what a run reads) is the same network
    assert ms.shape_from_config(text, "text") == dataclasses.replace(table, model_type="qwen3_5_text")


def test_the_recurrent_state_and_kv_cache_are_what_a_qwen3_5_keeps():
    config = Qwen3_5TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
    )  # fmt: skip
    shape = ms.shape_from_config(config.to_dict(), "tiny")
    assert shape.attention_layers == 1 and shape.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    batch, tokens = 3, 7
    with torch.no_grad():
        cache = model(torch.randint(0, 320, (batch, tokens)), use_cache=True).past_key_values
    states = [t for layer in cache.layers if hasattr(layer, "recurrent_states")
              for t in (*layer.conv_states.values(), *layer.recurrent_states.values())]  # fmt: skip
    kv = [t for layer in cache.layers if hasattr(layer, "keys") for t in (layer.keys, layer.values)]
    assert sum(t.numel() * t.element_size() for t in states) == ms.recurrent_state_bytes(shape, batch)
    assert sum(t.numel() * t.element_size() for t in kv) == ms.kv_bytes(shape, batch * tokens)


def test_qwen3_5_all_linear_adapts_the_gated_deltanet_projections_too():
    shape, stage = ms.SHAPES["qwen/qwen3.5-4b"], load_recipe(HYBRID).stages[0]
    named = stage.lora.target_modules  # the seven attention and MLP names: the linear layers' MLP only
    everything = stage.model_copy(update={"lora": stage.lora.model_copy(update={"target_modules": "all-linear"})})
    gdn = sum(a + b for a, b in shape.layer_shapes(0).values()) - sum(
        a + b for n, (a, b) in shape.layer_shapes(0).items() if n in named
    )
    assert gdn > 0
    assert ms.lora_params(shape, everything) - ms.lora_params(shape, stage) == stage.lora.r * gdn * 24  # 24 of 32


# recipe plan recipes/hybrid.yaml model.name=<id>: the README's table of the flagship on the papers' models
PLANNED = [
    "Qwen/Qwen2.5-7B-Instruct",
    "Qwen/Qwen3-4B-Instruct-2507",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3.5-4B",
    "Qwen/Qwen3.5-9B",
]


def readme_row(model: str) -> str:
    plan = mp.plan_recipe(load_recipe(HYBRID, [f"model.name={model}"]), gpu_memory_gib=24)
    peaks = " | ".join(f"{p.gib:.1f}" for p in plan.phases)
    recipe = load_recipe(HYBRID, [f"model.name={model}"])
    rows = [mp.planned_rows(ms.shape_of(model), mp.planned(recipe), i, 1024, 24) for i in range(3)]
    engine = "transformers" if "planned as transformers" in plan.render() else "vLLM"
    wall = plan.wall_time
    hours = " + ".join(f"{wall.phase_s(p) / 3600:.1f}" for p in ("training", "rollouts", "evaluation", "diagnostics"))
    return f"| {model} | {peaks} | {'/'.join(map(str, rows))} | {engine} | ~{wall.total_s / 3600:.1f} h = {hours} |"


@pytest.mark.parametrize("model", PLANNED)
def test_the_readme_lists_each_models_plan(model):
    readme = (REPO / "README.md").read_text()
    assert readme_row(model) in readme


def test_each_planned_model_fits_24_gib_offline(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for model in PLANNED:
        assert main(["recipe", "plan", str(HYBRID), f"model.name={model}"]) == 0, model
    out = capsys.readouterr().out
    assert out.count("does not fit") == 0
    qwen3_5 = out.split("plan: Qwen/Qwen3.5-4B")[1].split("plan: ")[0]
    rollout = re.search(r"^rollout .*$", qwen3_5, re.M).group(0)
    assert "recurrent_state" in rollout and "vllm_claim" not in rollout  # transformers generate, not vLLM

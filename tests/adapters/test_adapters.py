"""Adapter primitives: layer-restricted LoRA, trainable flags, activation restores state."""

from __future__ import annotations

import pytest
import torch

from adaptercl.adapters.live import (
    active_adapters,
    attach_adapter,
    lora_parameters,
    peft_lora_config,
    set_trainable,
    use_adapters,
)
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import LoraConfig, ModelConfig, RecipeError


def test_lora_layers_counts_from_the_top_and_only_those_layers_learn():
    model = load_base(ModelConfig(name="tiny-random"), "none").model  # 2 decoder layers
    model = attach_adapter(model, "top", LoraConfig(r=2, target_modules=["q_proj"], layers=[-1]))
    names = list(lora_parameters(model, "top"))
    assert names and all(".layers.1." in n for n in names)
    set_trainable(model, "top")
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(names)


def test_lora_layers_out_of_range_are_refused_as_the_adapter_is_attached():
    """The last guard (a model whose config the run could not read beforehand): the loaded model's own count. A layer
    it lacks is one line naming the range, never wrapped (layer 2 of 2 was layer 0); in range, -2 and 0 are one."""
    model = load_base(ModelConfig(name="tiny-random"), "none").model  # 2 decoder layers
    with pytest.raises(RecipeError) as err:
        attach_adapter(model, "x", LoraConfig(r=2, target_modules=["q_proj"], layers=[0, 2]))
    assert str(err.value) == (
        "lora.layers: layer 2 does not exist; the model has 2 layers: 0..1 (or -2..-1 counting from the top)"
    )
    assert peft_lora_config(LoraConfig(layers=[-2, 0, 1]), model).layers_to_transform == [0, 1]


def test_active_adapters_restores_active_set_and_trainable_flags():
    model = load_base(ModelConfig(name="tiny-random"), "none").model
    model = attach_adapter(model, "a", LoraConfig(r=2))
    attach_adapter(model, "b", LoraConfig(r=2))
    use_adapters(model, ["a"], trainable="a")
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in lora_parameters(model, "b").values():
            p.normal_()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with active_adapters(model, ["b"]):
            assert model.base_model.active_adapters == ["b"]
            with_b = model(input_ids=ids).logits
        with active_adapters(model, None):
            base = model(input_ids=ids).logits
    assert not torch.allclose(plain, with_b) and torch.allclose(plain, base)  # "a" is still all-zero B
    assert model.base_model.active_adapters == ["a"]
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags

"""Base loading details that need no download."""

from __future__ import annotations

import json

import pytest
import torch

from adaptercl.model.base import drop_gguf_quantization_config, load_base
from adaptercl.recipe.grammar import ModelConfig


def test_a_dequantised_gguf_conversion_loses_its_gguf_quantization_config(tmp_path):
    config = {"model_type": "llama", "hidden_size": 576, "quantization_config": {"quant_method": "gguf"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    drop_gguf_quantization_config(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "llama", "hidden_size": 576}


def test_a_real_quantization_config_is_kept(tmp_path):
    config = {"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    drop_gguf_quantization_config(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == config


@pytest.mark.parametrize("source", ["tiny-random", "gguf"])
def test_loading_from_a_cold_or_a_warm_cache_leaves_the_global_rng_as_seeded(source, request, tmp_path):
    # A run seeds before loading its base: a draw made only while filling the cache (the random init of a model
    # built from a config) would shift the LoRA init of a first run against every later one.
    name = "tiny-random" if source == "tiny-random" else str(request.getfixturevalue("tiny_gguf"))
    model_cfg = ModelConfig(name=name, cache_dir=str(tmp_path / "cache"))
    torch.manual_seed(0)
    seeded = torch.random.get_rng_state()
    states, weights = [], []
    for _cache in ("cold", "warm"):
        torch.manual_seed(0)
        base = load_base(model_cfg, "none")
        states.append(torch.random.get_rng_state())
        weights.append(base.model.state_dict())
    assert torch.equal(states[0], seeded) and torch.equal(states[1], seeded)
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_hub_source_names_the_hub_id_an_export_can_ship(tmp_path):
    from adaptercl.model.base import SMOLLM2_CONVERTED, SMOLLM2_HUB_ID, HubSource, hub_source

    smollm2 = ModelConfig(name="smollm2-135m-instruct", cache_dir=str(tmp_path / "cache"))
    assert hub_source(smollm2) == HubSource(SMOLLM2_HUB_ID, None)
    (tmp_path / "cache" / SMOLLM2_CONVERTED).mkdir(parents=True)
    (tmp_path / "cache" / SMOLLM2_CONVERTED / "config.json").write_text("{}")  # the GGUF conversion loads: said so
    converted = hub_source(smollm2)
    assert converted.repo_id == SMOLLM2_HUB_ID and "dequantised" in converted.note
    assert hub_source(ModelConfig(name="org/model", revision="v2")) == HubSource("org/model", "v2")
    assert hub_source(ModelConfig(name="tiny-random")) is None  # built in code: on no hub
    (tmp_path / "org" / "local").mkdir(parents=True)  # spelled like a hub id, but a folder here: no hub id
    folder = tmp_path / "org" / "local"
    assert hub_source(ModelConfig(name=str(folder))) is None
    assert hub_source(ModelConfig(name=str(tmp_path / "model.gguf"))) is None

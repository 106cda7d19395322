"""Base loading details that need no download."""

from __future__ import annotations

import json

from adaptercl.model import drop_gguf_quantization_config


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

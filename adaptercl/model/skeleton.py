"""A base model's skeleton (every module, no weight), to resolve LoRA targets on before anything loads.

    model = base_skeleton(model_cfg)   # on the meta device, or None when its config is not known here

`base_config_file` finds the config.json of a built-in alias (built or converted into the cache once, as loading
does), a local folder, or a hub id from the local hub cache (with `download=True`, that file alone, as
`lora_layers.base_layer_count` fetches it); a GGUF file's config is known only once it is converted, at load. The
architecture is checked first (`architecture.check_architecture`): nothing here runs a model's own code.
"""

from __future__ import annotations

from pathlib import Path

import torch

from adaptercl.model.architecture import check_architecture
from adaptercl.model.base import is_hub_id, resolve_model_path
from adaptercl.model.lora_layers import hub_config_file
from adaptercl.model.shapes import read_model_config
from adaptercl.recipe import ModelConfig


def base_config_file(model_cfg: ModelConfig, download: bool = False) -> Path | None:
    """The config.json the base loads from, or None when it is not known here (a GGUF file, a hub id not in the local
    hub cache without `download`)."""
    local = Path(model_cfg.name).expanduser()
    if local.suffix == ".gguf":
        return None
    if not local.is_dir() and is_hub_id(model_cfg.name):
        found = hub_config_file(model_cfg.name, model_cfg.revision, download)
        return Path(found) if found else None
    path, _ = resolve_model_path(model_cfg)  # an alias: built or converted into the cache, as loading does
    config = Path(path) / "config.json"
    return config if config.is_file() else None


def base_skeleton(model_cfg: ModelConfig, download: bool = False) -> torch.nn.Module | None:
    """The base's causal LM with every module and no weight (meta device), from its config.json (checked by
    `check_architecture`), or None when that config is not known here (`base_config_file`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_file = base_config_file(model_cfg, download)
    if config_file is None:
        return None
    check_architecture(read_model_config(config_file), f"model.name: {config_file}")
    config = AutoConfig.from_pretrained(config_file.parent)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)

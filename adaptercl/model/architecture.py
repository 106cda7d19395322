"""What a base model is, known from its config.json alone: an architecture the installed transformers ships as a
causal LM, and its skeleton (every module, no weight) to resolve LoRA targets on before anything loads.

    check_architecture(config, "model.name: /models/x/config.json")   # RecipeError: unknown, or not a causal LM
    model = base_skeleton(model_cfg)                                  # on the meta device, or None when not known here

`base_config_file` finds the config.json of a built-in alias (built or converted into the cache once, as loading
does), a local folder, or a hub id from the local hub cache (with `download=True`, that file alone, as
`lora_layers.base_layer_count` fetches it); a GGUF file's config is known only once it is converted, at load. Nothing
here runs a model's own code: a config whose model_type transformers does not know is refused, `auto_map` or not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from adaptercl.model.shapes import read_model_config
from adaptercl.recipe import ModelConfig, RecipeError


def check_architecture(config: dict[str, Any], where: str) -> None:
    """A one-line RecipeError, naming `where`, unless `config` (a config.json) is of a model type the installed
    transformers knows and loads with AutoModelForCausalLM."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    version = f"transformers {transformers.__version__}"
    families = "e.g. llama, qwen3, qwen3_5, gemma3, mistral, olmo3, phi3"
    if not model_type:
        raise RecipeError(f"{where} has no model_type; point model.name at a Hugging Face causal LM ({families})")
    if model_type not in CONFIG_MAPPING_NAMES:
        custom = " (its auto_map names custom code, which adaptercl does not run)" if "auto_map" in config else ""
        raise RecipeError(
            f"{where}: model_type {model_type!r} is an architecture {version} does not know{custom}; use a model of "
            f"a family it ships ({families}) or a transformers that knows it"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise RecipeError(
            f"{where}: model_type {model_type!r} is not a causal language model in {version} (AutoModelForCausalLM "
            f"cannot load it); adaptercl trains decoder-only chat models ({families})"
        )


def base_config_file(model_cfg: ModelConfig, download: bool = False) -> Path | None:
    """The config.json the base loads from, or None when it is not known here (a GGUF file, a hub id not in the local
    hub cache without `download`)."""
    from adaptercl.model.base import is_hub_id, resolve_model_path
    from adaptercl.model.lora_layers import hub_config_file

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

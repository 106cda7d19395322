"""What a base model is, known from its config.json alone: an architecture the installed transformers ships as a
causal LM.

    check_architecture(config, "model.name: /models/x/config.json")   # RecipeError: unknown, or not a causal LM

Nothing here runs a model's own code: a config whose model_type transformers does not know is refused, `auto_map` or
not. Its skeleton (every module, no weight) is `skeleton.base_skeleton`'s.
"""

from __future__ import annotations

from typing import Any

from adaptercl.recipe import RecipeError


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

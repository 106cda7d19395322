"""The base model and its forwards: loading (built-in aliases, hub ids, local folders, GGUF; NF4 or plain: `base.py`),
its shape and what its parts weigh, read from its config (`shapes.py`; `read_model_config`, the one reader of a
config.json), whether transformers ships its architecture as a causal LM (`architecture.py`) and its skeleton, every
module and no weight (`skeleton.py`), which decoder layers `lora.layers` names
(`lora_layers.py`, without loading a weight), token batches and the logits or hidden states at their response
positions (`batching.py`: `TokenBatch`, `ResponseScores`), prompt prefixes computed once for rows that begin alike
(`prefix_sharing.py`) where the model's cache layers allow it, and which cache layers can repeat or drop batch rows
(`cache_layers.py`), the activation checkpointing of training forwards (`checkpointing.py`), and random weights of
a model's shape, to rehearse its loop without downloading it (`random_weights.py`).
"""

from importlib import import_module

# name other folders use -> the module of this folder that defines it; a name equal to its module's is the module
# itself. Imported on first use: importing the folder loads nothing.
_EXPORTS = {
    "ALIAS_SOURCES": "base",
    "activation_checkpointing": "checkpointing",
    "base_folder": "base",
    "card_gib": "base",
    "decoder_and_head": "base",
    "HubSource": "base",
    "hub_source": "base",
    "load_base": "base",
    "resolve_activation_checkpointing": "checkpointing",
    "resolve_model_path": "base",
    "servable_base_path": "base",
    "ResponseScores": "batching",
    "TokenBatch": "batching",
    "at_least_float32": "batching",
    "build_batch": "batching",
    "encode_chat": "batching",
    "prompt_lists": "batching",
    "response_hidden": "batching",
    "response_logits": "batching",
    "response_scores": "batching",
    "trim_padding": "batching",
    "FULL_ATTENTION": "cache_layers",
    "NO_SHARING": "cache_layers",
    "PrefixLimit": "cache_layers",
    "SELECTS": "cache_layers",
    "can_select_rows": "cache_layers",
    "select_keys": "cache_layers",
    "select_rows": "cache_layers",
    "shared_prefix_limit": "cache_layers",
    "check_lora_layers": "lora_layers",
    "check_lora_targets": "lora_targets",
    "decoder_layer_count": "lora_targets",
    "layer_types": "lora_targets",
    "resolve_lora_targets": "lora_targets",
    "AUTO_TARGETS": "shapes",
    "check_architecture": "architecture",
    "base_skeleton": "skeleton",
    "lora_layer_indices": "lora_layers",
    "CACHE": "prefix_sharing",
    "output_cache": "prefix_sharing",
    "prefill": "prefix_sharing",
    "prefix_layout": "prefix_sharing",
    "random_checkpoint": "random_weights",
    "ALL_LINEAR": "shapes",
    "GIB": "shapes",
    "Shape": "shapes",
    "base_bytes": "shapes",
    "gib": "shapes",
    "kv_bytes": "shapes",
    "lora_params": "shapes",
    "model_type_of": "shapes",
    "recurrent_state_bytes": "shapes",
    "read_model_config": "shapes",
    "shape_from_config": "shapes",
    "shape_of": "shapes",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module = import_module(f"{__name__}.{_EXPORTS[name]}")
        return module if _EXPORTS[name] == name else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

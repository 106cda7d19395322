"""`lora.layers` against the base model's decoder layers, known from its config without loading a weight.

`lora.layers` lists 0-based decoder layers, negative ones counting from the top (-1 = the last), as Python indexes
a list. A layer the model does not have is a one-line error naming the field and the valid range
(`check_lora_layers`), never wrapped around: layer 100 of a 30-layer model is not layer 10. For a hybrid model the
line also gives its layer types (`config_layer_types`: Qwen3.5's linear and full attention layers), since which
projections a layer has depends on them (`lora_targets.py`).

Where the number of layers comes from (`base_layer_count`), without torch and without a weight:
- built-in aliases: `BUILTIN_LAYERS` (tiny-random is built from it, `base.materialize_tiny_random`);
- a local Hugging Face folder: its config.json;
- a .gguf file: its `<architecture>.block_count` metadata (when the `gguf` package is installed);
- a hub id: config.json from the local hub cache; with `download=True` (the run, right before the base loads) it
  is fetched alone when the cache lacks it, the file `from_pretrained` would fetch first anyway.
A config without a layer count it can read (`config_layer_count`), a hub id not in the cache at `recipe validate`,
a GGUF file without the `gguf` package: unknown here; `adapters.live.peft_lora_config` checks against the loaded
model's config as the adapter is attached. No torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adaptercl.model.shapes import read_model_config
from adaptercl.recipe import ModelConfig, RecipeConfig, RecipeError

BUILTIN_LAYERS = {"tiny-random": 2, "smollm2-135m-instruct": 30}  # the built-in aliases' decoder layers
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")  # config.json names of the count


def check_lora_layers(recipe: RecipeConfig, download: bool = False) -> None:
    """Every stage's `lora.layers` names layers the base has (RecipeError naming the first that does not); nothing
    when no stage restricts its layers or the count is unknown here (see the module docstring)."""
    if all(stage.lora.layers is None for stage in recipe.stages):
        return
    count = base_layer_count(recipe.model, download)
    if count is None:
        return
    types = base_layer_types(recipe.model)
    for stage in recipe.stages:
        if stage.lora.layers is not None:
            field = f"stages.{stage.name}.lora.layers"
            lora_layer_indices(stage.lora.layers, count, field, recipe.model.name, types)


def lora_layer_indices(
    layers: list[int],
    count: int,
    field: str = "lora.layers",
    model: str = "the model",
    types: list[str] | None = None,
) -> list[int]:
    """The sorted distinct 0-based indices of `layers` (negative from the top) in a model of `count` decoder layers;
    RecipeError naming `field`, the valid range and a hybrid's layer `types` for an index out of it."""
    for index in layers:
        if not -count <= index < count:
            kinds = describe_layer_types(types)
            raise RecipeError(
                f"{field}: layer {index} does not exist; {model} has {count} layers: 0..{count - 1} "
                f"(or -{count}..-1 counting from the top){f'; layer types: {kinds}' if kinds else ''}"
            )
    return sorted({index % count for index in layers})  # in range, % maps only the negative: -k -> count - k


def describe_layer_types(types: list[str] | None) -> str:
    """'0-2 linear_attention, 3 full_attention': runs of equal layer types, for an error line ('' when unset or all
    one type)."""
    if not types or len(set(types)) == 1:
        return ""
    runs, start = [], 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            runs.append(f"{span} {types[start]}")
            start = i
    return ", ".join(runs)


def base_layer_count(model_cfg: ModelConfig, download: bool = False) -> int | None:
    """The base's number of decoder layers from its config alone, or None when it is not known here."""
    name = model_cfg.name
    if name in BUILTIN_LAYERS:
        return BUILTIN_LAYERS[name]
    local = Path(name).expanduser()
    if local.suffix == ".gguf":
        return gguf_layer_count(local) if local.is_file() else None
    if (local / "config.json").is_file():
        return config_layer_count(_read_config(local / "config.json"))
    if name.count("/") == 1 and not name.startswith((".", "/", "~")) and not local.exists():
        config_file = hub_config_file(name, model_cfg.revision, download)
        return config_layer_count(_read_config(Path(config_file))) if config_file else None
    return None


def _read_config(path: Path) -> dict[str, Any]:
    """A config.json as a dict; one that does not parse is a RecipeError naming it (`shapes.read_model_config`)."""
    return read_model_config(path)


def base_layer_types(model_cfg: ModelConfig) -> list[str] | None:
    """The base's decoder `layer_types` from a local folder's config.json (None elsewhere, or when unset)."""
    config_file = Path(model_cfg.name).expanduser() / "config.json"
    return config_layer_types(_read_config(config_file)) if config_file.is_file() else None


def config_layer_types(config: dict[str, Any]) -> list[str] | None:
    """The `layer_types` list of a config.json or of its `text_config` (a multimodal model's), or None."""
    text_config = config.get("text_config")
    for block in (config, text_config if isinstance(text_config, dict) else {}):
        if isinstance(block.get("layer_types"), list) and block["layer_types"]:
            return [str(t) for t in block["layer_types"]]
    return None


def config_layer_count(config: dict[str, Any]) -> int | None:
    """The decoder layers of a config.json (a multimodal model's are in its `text_config`), or None."""
    text_config = config.get("text_config")
    for block in (config, text_config if isinstance(text_config, dict) else {}):
        for key in LAYER_KEYS:
            if isinstance(block.get(key), int) and block[key] > 0:
                return block[key]
    return None


def gguf_layer_count(path: Path) -> int | None:
    """`<general.architecture>.block_count` of a GGUF file's metadata, or None (no `gguf` package, no such key, not
    a GGUF file: converting it then says what is wrong)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    try:
        fields = GGUFReader(str(path)).fields
    except Exception:  # noqa: BLE001 - gguf raises ValueError, OSError, struct errors on a file it cannot read
        return None
    arch = fields.get("general.architecture")
    count = fields.get(f"{arch.contents()}.block_count") if arch is not None else None
    return int(count.contents()) if count is not None else None


def hub_config_file(repo_id: str, revision: str | None, download: bool) -> str | None:
    """The local path of a hub model's config.json: from the cache, or (download) fetched; None when neither."""
    import huggingface_hub

    cached = huggingface_hub.try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if isinstance(cached, str):
        return cached
    if not download:
        return None
    try:
        return huggingface_hub.hf_hub_download(repo_id, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - offline, unknown id, no access: loading the base reports it in one line
        return None

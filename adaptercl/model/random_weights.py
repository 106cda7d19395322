"""A checkpoint of random weights with a model's exact shape, so its loop can be rehearsed without downloading it
(`adaptercl recipe rehearse --random-weights`; the 7B-scale benchmarks).

    folder, tokenizer = random_checkpoint("Qwen/Qwen2.5-7B-Instruct", "cuda")   # ~15 GB written once, then reused

The shape is `shapes.shape_of`'s (the table of known hub ids, or a local folder's config.json; never the hub), built
as a Qwen2 model (the Llama layout with q/k/v biases; RoPE theta 1e6, RMSNorm eps 1e-6, 32k positions). The
tokenizer is the model's own when it is in the local hub cache (never downloaded), else adaptercl's byte-level ChatML
one, one token a byte (prompts then have several times their real length in tokens: the rehearsal says which).
`write_random_checkpoint` writes bfloat16 safetensors shards (one ~2 GB shard in memory at a time, drawn on `device`)
under the cache (`base.cache_root`), keyed by the shape and tokenizer, and reuses a complete one.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from adaptercl.model.shapes import GIB, Shape, shape_of

QWEN2_DEFAULTS = {  # Qwen/Qwen2.5-7B-Instruct config.json's fields that are not the shape
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "use_sliding_window": False,
    "hidden_act": "silu",
}
BYTE_TOKENIZER = "adaptercl's byte-level ChatML tokenizer (one token a byte)"


def config_fields(shape: Shape, vocab: int | None = None) -> dict[str, Any]:
    """Qwen2Config fields of `shape` (`vocab`: at least the tokenizer's length)."""
    return {
        **QWEN2_DEFAULTS,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": max(shape.vocab, vocab or 0),
        "tie_word_embeddings": shape.tie_embeddings,
    }


def model_tokenizer(model_name: str) -> tuple[Any, str]:
    """(tokenizer, what it is): the model's own from the local hub cache or folder, else the byte-level one."""
    from transformers import AutoTokenizer

    from adaptercl.model.base import build_byte_tokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name, local_files_only=True)
        if tokenizer.chat_template:
            return tokenizer, f"{model_name}'s own (local cache)"
    except Exception:  # noqa: BLE001 - not cached, not a hub id, no tokenizer files: the byte-level one
        pass
    return build_byte_tokenizer(), BYTE_TOKENIZER


def random_checkpoint(model_name: str, device: str, cache: Path | None = None) -> tuple[Path, str]:
    """(folder, tokenizer description) of a random checkpoint of `model_name`'s shape under `cache` (default the
    model cache), written once."""
    from adaptercl.model.base import cache_root

    tokenizer, described = model_tokenizer(model_name)
    fields = config_fields(shape_of(model_name), len(tokenizer))
    key = hashlib.sha256(json.dumps([fields, described], sort_keys=True).encode()).hexdigest()[:12]
    slug = re.sub(r"[^a-z0-9.]+", "-", model_name.lower()).strip("-")[-60:]
    target = (cache or cache_root()) / "random-weights" / f"{slug}-{key}"
    return write_random_checkpoint(fields, target, device, tokenizer), described


def write_random_checkpoint(
    fields: dict[str, Any], target: Path, device: str, tokenizer: Any = None, shard_bytes: int = 2 * GIB
) -> Path:
    """A random bf16 Qwen2 checkpoint with config `fields` plus `tokenizer` (default byte-level) in `target`
    (reused when already complete)."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from adaptercl.model.base import build_byte_tokenizer
    from adaptercl.system import atomic_dir

    marker = target / "random_checkpoint.json"
    if marker.is_file() and json.loads(marker.read_text()) == fields:
        return target
    tokenizer = tokenizer if tokenizer is not None else build_byte_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config = Qwen2Config(**fields, bos_token_id=tokenizer.bos_token_id or pad, eos_token_id=eos, pad_token_id=pad)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        names = {name: tuple(t.shape) for name, t in Qwen2ForCausalLM(config).state_dict().items()}
    shards: list[list[str]] = [[]]
    size = 0
    for name, dims in names.items():
        nbytes = 2 * math.prod(dims)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    generator = torch.Generator(device=device).manual_seed(0)
    weight_map, total = {}, 0
    with atomic_dir(target) as tmp:
        for i, shard in enumerate(shards):
            tensors = {}
            for name in shard:
                if name.endswith("norm.weight"):
                    tensor = torch.ones(names[name], dtype=torch.bfloat16)
                elif name.endswith(".bias"):
                    tensor = torch.zeros(names[name], dtype=torch.bfloat16)
                else:
                    tensor = torch.empty(names[name], dtype=torch.bfloat16, device=device)
                    tensor = tensor.normal_(0.0, config.initializer_range, generator=generator).cpu()
                tensors[name] = tensor
                total += tensor.numel() * 2
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, file)
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config.save_pretrained(tmp)
        GenerationConfig(eos_token_id=eos, pad_token_id=pad).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "random_checkpoint.json").write_text(json.dumps(fields))
    return target

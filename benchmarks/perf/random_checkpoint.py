"""A checkpoint of random weights with the exact shape of Qwen2.5-7B-Instruct (or a tiny one of the same build), so the
7B-scale benchmarks (cuda_7b_memory, trace_7b_memory, rehearse_24gb, nf4_decode_gemm) download nothing.

`write_random_checkpoint` writes it once in bfloat16 safetensors shards (~15 GB at 7B, one ~2 GB shard in memory at a
time: Qwen2, hidden 3584, MLP 18944, 28 layers, 28 query / 4 key-value heads, head dim 128, vocab 152064, untied
embeddings, RoPE theta 1e6, RMSNorm eps 1e-6, q/k/v biases), with adaptercl's byte-level ChatML tokenizer, and
reuses a complete one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from adaptercl.model.shapes import GIB

QWEN25_7B = {  # Qwen/Qwen2.5-7B-Instruct config.json, shape fields
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "hidden_act": "silu",
}
TINY = {**QWEN25_7B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
TINY |= {"num_key_value_heads": 1, "vocab_size": 512, "max_position_embeddings": 2048}


def write_random_checkpoint(shape: dict[str, Any], target: Path, device: str, shard_bytes: int = 2 * GIB) -> Path:
    """A random bf16 Qwen2 checkpoint of `shape` plus tokenizer in `target` (reused when already complete)."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from adaptercl.model.base import build_byte_tokenizer
    from adaptercl.system.atomic import atomic_dir

    marker = target / "random_checkpoint.json"
    if marker.is_file() and json.loads(marker.read_text()) == shape:
        return target
    tokenizer = build_byte_tokenizer()
    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in (("bos", "<|endoftext|>"), ("eos", "<|im_end|>"))}
    config = Qwen2Config(**shape, bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["bos"])
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
        GenerationConfig(eos_token_id=ids["eos"], pad_token_id=ids["bos"]).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "random_checkpoint.json").write_text(json.dumps(shape))
    return target

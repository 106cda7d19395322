"""Tiny random-weight models of the families people fine-tune, each built from the family's own transformers config
class (nothing downloaded), written as a local Hugging Face folder with adaptercl's byte-level ChatML tokenizer.

    folder = write_tiny_family("qwen3_5", tmp_path / "qwen3_5")   # config.json, safetensors, tokenizer files

`FAMILIES` maps a family's transformers `model_type` (what test ids name it by) to the config fields of its tiny
model: 4 decoder layers (a hybrid needs room for both of its layer types), hidden size 64, 2 heads of 32 (1 key/value
head), vocabulary 320 (the byte tokenizer's 259 tokens and some spare rows). Where a family's text model has its own
`model_type` (`gemma3_text`, `gemma4_text`: Gemma 3 1B's config.json says `gemma3_text`), the text config is built,
since adaptercl trains the causal LM; Qwen3.5's config is the released checkpoints' top-level `qwen3_5` one, which
`AutoModelForCausalLM` loads as the text model (Qwen3.5-MoE's likewise). Each family keeps what makes it differ from Llama at a tiny size:
Qwen3.5's Gated DeltaNet layers (3 linear attention + 1 full), the MoE blocks (4 experts, 2 per token; Qwen3.5-MoE's
shared expert beside them), Gemma 3's
and OLMo 3's sliding window (16 positions, shorter than a chat prompt, so the window matters), Gemma 4's per-layer
inputs and key/value sharing, SmolLM3's layers without RoPE, Phi-3's fused qkv_proj and gate_up_proj.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
GATED_DELTANET = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
SLIDING = 16  # positions: a chat prompt is longer, so the window cuts what a layer sees

# model_type (the test id) -> (the config's model_type, its fields beyond COMMON)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_5": ("qwen3_5", GATED_DELTANET),  # text_config built from the same fields
    "qwen3_moe": ("qwen3_moe", MOE),
    "qwen3_5_moe": ("qwen3_5_moe", {**GATED_DELTANET, **MOE, "shared_expert_intermediate_size": 32}),
    "gemma3": (
        "gemma3_text",
        {"sliding_window": SLIDING, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
    ),
    "gemma4": (
        "gemma4_text",
        {
            "sliding_window": SLIDING,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "global_head_dim": 32,
            "vocab_size_per_layer_input": 320,
            "hidden_size_per_layer_input": 8,
            "num_kv_shared_layers": 2,  # the last 2 layers read the keys/values of the first 2 (Gemma 4 E2B/E4B)
            "final_logit_softcapping": 30.0,
        },
    ),
    "mistral": ("mistral", {}),
    "olmo3": ("olmo3", {"sliding_window": SLIDING}),
    "smollm3": ("smollm3", {}),
    "phi3": ("phi3", {}),
}


def family_config(family: str, tokenizer: Any):
    """The tiny config of `family` (a key of FAMILIES), its special token ids the tokenizer's."""
    from transformers import AutoConfig

    model_type, fields = FAMILIES[family]
    specials = {
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.pad_token_id,
    }
    if model_type in ("qwen3_5", "qwen3_5_moe"):  # the released checkpoints' layout: the decoder in text_config
        return AutoConfig.for_model(model_type, text_config={**COMMON, **fields, **specials}, **specials)
    return AutoConfig.for_model(model_type, **COMMON, **fields, **specials)


def write_tiny_family(family: str, target: Path, seed: int = 0) -> Path:
    """A tiny random `family` model (float32, seeded) with the byte-level tokenizer saved in `target`; returns it.
    The global torch RNG is left as it was."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from adaptercl.model.base import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    config = family_config(family, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    text = config.get_text_config()
    model.generation_config = GenerationConfig(eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id)
    model.save_pretrained(target)
    if config is not text:  # the released checkpoints' top-level config (qwen3_5), not the text model's own
        config.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target

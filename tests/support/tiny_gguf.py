"""A tiny GGUF checkpoint written in code, so the GGUF conversion path is tested without a download."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_tiny_gguf(path: Path) -> Path:
    """A 2-layer llama GGUF (float32, byte-level gpt2 tokenizer, ChatML template) of a few hundred KB."""
    import gguf
    from tokenizers import pre_tokenizers

    from adaptercl.model.base import CHATML_TEMPLATE

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    hidden, ffn, layers, heads, kv_heads, head_dim = 64, 128, 2, 2, 1, 32
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * 3)
    writer.add_token_scores([0.0] * len(tokens))  # no merges: transformers derives them (none) from these
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(258)
    writer.add_pad_token_id(256)
    writer.add_chat_template(CHATML_TEMPLATE)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(len(tokens), hidden))
    writer.add_tensor("output.weight", weight(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(hidden, heads * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

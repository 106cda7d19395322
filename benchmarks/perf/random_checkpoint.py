"""The shapes the 7B-scale benchmarks (cuda_7b_memory, trace_7b_memory) write random checkpoints of,
so they download nothing: Qwen2.5-7B-Instruct's config fields and a tiny one of the same build.

The writer is the package's (`adaptercl.model.random_weights.write_random_checkpoint`, what `adaptercl recipe
rehearse --random-weights` uses): bfloat16 safetensors shards (~15 GB at 7B, one ~2 GB shard in memory at a time) with
adaptercl's byte-level ChatML tokenizer, reusing a complete one.
"""

from __future__ import annotations

from adaptercl.model.random_weights import QWEN2_DEFAULTS, write_random_checkpoint

QWEN25_7B = {  # Qwen/Qwen2.5-7B-Instruct config.json, shape fields
    **QWEN2_DEFAULTS,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
TINY = {**QWEN25_7B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}
TINY |= {"num_key_value_heads": 1, "vocab_size": 512, "max_position_embeddings": 2048}

__all__ = ["QWEN25_7B", "TINY", "write_random_checkpoint"]

"""benchmarks/perf/shared_base_cpu.py on tiny-random with vLLM for CPU: the trainer's NF4 linears become views of the
colocated engine's fused NF4 weights, and nothing either side computes changes (the stretch of issue 26, its CPU
proof)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import shared_base_cpu  # noqa: E402


@pytest.mark.vllm
def test_the_trainer_reads_vllms_nf4_weights_and_computes_the_same(tmp_path):
    argv = ["--copy-dir", str(tmp_path / "bf16"), "--out", str(tmp_path)]
    assert shared_base_cpu.main(argv) == 0
    (path,) = tmp_path.glob("shared_base_cpu-tiny-random-vllm*.json")
    result = json.loads(path.read_text())
    # 2 decoder layers x 7 projections, each now a slice of vLLM's storage at its shard's byte offset
    assert result["weights_rebound"] == 14 and result["all_share_vllm_storage"]
    assert result["trainer_own_nf4_bytes_before"] == result["bytes_rebound"] > 0
    assert result["trainer_own_nf4_bytes_after"] == 0  # the trainer's own packed copy is gone
    # and the rest of the base: embeddings, lm_head, final norm, 2 x 2 layer norms, 2 x 3 q/k/v biases
    assert result["dense_tensors_rebound"] == 13 and result["trainer_own_base_bytes_after"] == 0
    # both quantised the same bf16 values: the same bytes, so the same logits and LoRA gradients, bit for bit
    assert result["same_bytes_before"] == 14
    assert result["trainer_logprob_change_max"] == 0.0 and result["lora_gradient_change_over_scale"] == 0.0
    assert result["vllm_completions_unchanged"]

"""benchmarks/perf/nf4_decode_gemm.py: the layer is Qwen2.5-7B's as vLLM fuses it, the NF4 path makes one 4-bit matmul
per checkpoint shard (vLLM's `_apply_4bit_weight`) and multiplies what it should, and the CPU run writes its JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import nf4_decode_gemm as gemm  # noqa: E402


def test_the_7b_layer_by_hand():
    """Qwen2.5-7B: hidden 3584, 28 heads of 128, 4 KV heads -> k, v 512 wide; intermediate 18944."""
    layer = gemm.shards(gemm.QWEN25_7B)
    assert layer["qkv_proj"] == [(3584, 3584), (512, 3584), (512, 3584)]
    assert layer["gate_up_proj"] == [(18944, 3584), (18944, 3584)] and layer["down_proj"] == [(3584, 18944)]
    assert sum(o * i for parts in layer.values() for o, i in parts) == 233_046_016  # 7B's 6.53e9 linear / 28 layers


def test_one_4bit_matmul_per_shard(monkeypatch):
    import bitsandbytes
    import torch

    dense, nf4 = gemm.build_layer(gemm.TINY, "cpu")
    seen = []
    real = bitsandbytes.matmul_4bit

    def counting(x, b, state, *args, **kwargs):
        seen.append(tuple(state.shape))
        return real(x, b, state, *args, **kwargs)

    monkeypatch.setattr(bitsandbytes, "matmul_4bit", counting)
    x = {name: torch.randn(3, w.shape[1]).to(torch.bfloat16) for name, w in dense.items()}
    gemm.layer_nf4(x, nf4)
    assert seen == [shape for parts in gemm.shards(gemm.TINY).values() for shape in parts]  # 7, in vLLM's order
    assert [tuple(w.shape) for w in dense.values()] == [
        (128, 64),
        (64, 64),
        (256, 64),
        (64, 128),
    ]  # fused: 64 + 2 x 32


def test_the_nf4_path_multiplies_the_dequantised_weight():
    """Each path rounds its float32 sums to bf16 once (relative error <= 2^-8 each; the sums' order changes them by
    float32 rounding only), so the two products differ by at most 2^-7 of the largest."""
    _, nf4 = gemm.build_layer(gemm.TINY, "cpu")
    assert gemm.check_outputs_agree(nf4, "cpu") <= 2**-7


def test_the_cpu_run_writes_every_row_count(tmp_path):
    assert gemm.main(["--tiny", "--repeats", "2", "--warmup", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "nf4_decode_gemm-tiny.json").read_text())
    rows = [str(m) for m in gemm.ROWS]
    assert list(result["bf16_over_nf4"]) == rows
    for m in rows:
        bf16, nf4 = result["per_layer_ms"]["bf16"][m], result["per_layer_ms"]["nf4"][m]
        assert result["bf16_over_nf4"][m] == pytest.approx(bf16 / nf4, rel=1e-12)
        assert result["decode_matmuls_ms"]["nf4"][m] == pytest.approx(nf4 * gemm.TINY["num_hidden_layers"], rel=1e-12)

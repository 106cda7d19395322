"""A decode step's weight matmuls at the 7B shape: bitsandbytes NF4 as vLLM calls it, against bf16 (issue 26).

The wall-time plan prices vLLM's NF4 + LoRA decoding from cited figures alone (`plan/throughputs.py`): bitsandbytes
4-bit at 0.634 of bf16's throughput comes from vLLM 0.6.3 with an older bitsandbytes, before bitsandbytes 0.50's
fused 4-bit GEMM (`matmul_4bit` -> `gemm_4bit`, chosen per GPU architecture). The lent GPUs have no vLLM and cannot
be given one (`benchmarks/perf/plan_bounds.py` shows the 5 h target turns on that figure), but they run
bitsandbytes. So this measures the kernels themselves, one decoder layer of Qwen2.5-7B at the rows a decode step
multiplies (1 to 48):

- NF4 as vLLM's bitsandbytes path runs it: each checkpoint shard (q, k, v, o, gate, up, down) quantised on its own,
  blocksize 64, its block scales in float32 (vLLM's loader undoes the double quantisation,
  `BitsAndBytesModelLoader._dequantize_dq`), and one `bitsandbytes.matmul_4bit(x, packed.t(), state)` per shard, as
  `vllm/model_executor/layers/quantization/bitsandbytes.py` `_apply_4bit_weight` loops over a fused layer's shards;
- bf16 as vLLM's unquantised path runs it: one `F.linear` per fused layer (qkv, o, gate_up, down).

Each is timed as the median of `--repeats` calls of the whole layer after `--warmup` (CUDA events on a GPU). The ratio
bf16 ms / NF4 ms is the measured counterpart of the cited 0.634 for the weight matmuls only: attention, LoRA, sampling
and the scheduler cost the same in both engines, so a whole decode step's ratio lies between this one and 1.

    python benchmarks/perf/nf4_decode_gemm.py                 # CUDA + bitsandbytes: results/nf4_decode_gemm.json
    python benchmarks/perf/nf4_decode_gemm.py --tiny --out DIR  # CPU, a small layer: the code path (the test runs it)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for the shared provenance.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

from perf_common import write_result  # noqa: E402
from provenance import command, machine, versions  # noqa: E402
from random_checkpoint import QWEN25_7B, TINY  # noqa: E402

BLOCKSIZE = 64  # bitsandbytes' and vLLM's NF4 block
ROWS = (1, 4, 8, 16, 32, 48)  # tokens a decode step multiplies: the cited sweep's concurrencies and 1
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers")


def shards(shape: dict[str, Any]) -> dict[str, list[tuple[int, int]]]:
    """Each fused layer of a decoder layer of `shape` (a Qwen2 config's fields): its shards' (out_features,
    in_features), as vLLM fuses them."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return {
        "qkv_proj": [(h, h), (kv, h), (kv, h)],
        "o_proj": [(h, h)],
        "gate_up_proj": [(i, h), (i, h)],
        "down_proj": [(h, i)],
    }


def build_layer(shape: dict[str, Any], device: str, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """(bf16 fused weights, NF4 shards as (packed, quant state) lists) of one decoder layer, from the same random
    bf16 values (std 0.02, as a checkpoint's init)."""
    import torch
    from bitsandbytes.functional import quantize_4bit

    gen = torch.Generator().manual_seed(seed)
    dense, nf4 = {}, {}
    for name, parts in shards(shape).items():
        weights = [(torch.randn(out, inp, generator=gen) * 0.02).to(torch.bfloat16).to(device) for out, inp in parts]
        dense[name] = torch.cat(weights, dim=0)  # [sum out, in]
        nf4[name] = [
            quantize_4bit(w, blocksize=BLOCKSIZE, quant_type="nf4", compress_statistics=False) for w in weights
        ]  # fmt: skip
    return dense, nf4


def layer_bf16(x, dense: dict[str, Any]) -> None:
    """x [rows, hidden] through every fused layer in bf16 (down_proj takes an [rows, intermediate] input)."""
    import torch.nn.functional as F

    for name, w in dense.items():
        F.linear(x[name], w)


def layer_nf4(x, nf4: dict[str, Any]) -> None:
    """x through every shard with bitsandbytes' 4-bit matmul, as vLLM's `_apply_4bit_weight` does."""
    from bitsandbytes import matmul_4bit

    for name, parts in nf4.items():
        for packed, state in parts:
            matmul_4bit(x[name], packed.t(), state)


def timed_ms(fn, repeats: int, warmup: int, cuda: bool) -> float:
    """Median milliseconds of `fn()` over `repeats` calls after `warmup`."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(layer: tuple[dict, dict], layers: int, rows: tuple[int, ...], repeats: int, warmup: int, device: str
            ) -> dict[str, Any]:  # fmt: skip
    """Per-layer milliseconds of each engine's matmuls (`build_layer`'s `layer`) at each row count, the `layers`
    of a decode step's, and bf16 / NF4."""
    import torch

    dense, nf4 = layer
    gen = torch.Generator().manual_seed(1)
    per_layer: dict[str, dict[str, float]] = {"bf16": {}, "nf4": {}}
    for m in rows:
        x = {
            name: torch.randn(m, w.shape[1], generator=gen).to(torch.bfloat16).to(device) for name, w in dense.items()
        }  # fmt: skip
        with torch.inference_mode():
            per_layer["bf16"][str(m)] = timed_ms(partial(layer_bf16, x, dense), repeats, warmup, device == "cuda")
            per_layer["nf4"][str(m)] = timed_ms(partial(layer_nf4, x, nf4), repeats, warmup, device == "cuda")
    ratio = {m: per_layer["bf16"][m] / per_layer["nf4"][m] for m in per_layer["bf16"]}
    return {
        "per_layer_ms": per_layer,
        "bf16_over_nf4": ratio,
        "decode_matmuls_ms": {k: {m: v * layers for m, v in d.items()} for k, d in per_layer.items()},
    }


def check_outputs_agree(nf4: dict[str, Any], device: str) -> float:
    """Max |NF4 - dequantised bf16| / max |bf16| of one shard's product (o_proj's, of `build_layer`'s NF4 shards):
    the NF4 path multiplies what it should (its result equals F.linear against the dequantised weight up to bf16
    rounding of the sums)."""
    import torch
    import torch.nn.functional as F
    from bitsandbytes import matmul_4bit
    from bitsandbytes.functional import dequantize_4bit

    packed, state = nf4["o_proj"][0]
    x = torch.randn(8, state.shape[1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(device)
    with torch.inference_mode():
        got = matmul_4bit(x, packed.t(), state).float()
        want = F.linear(x, dequantize_4bit(packed, state).to(torch.bfloat16)).float()
    return ((got - want).abs().max() / want.abs().max()).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small layer on the CPU: the code path")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="folder of the JSON (default benchmarks/perf/results)")
    args = parser.parse_args(argv)
    try:
        import bitsandbytes  # noqa: F401
        import torch
    except ImportError as err:
        print(f"nf4_decode_gemm: needs torch and bitsandbytes ({err}); pip install -e '.[cuda]' or the bnb wheel")
        return 2
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("nf4_decode_gemm: no CUDA device; --tiny runs the code path on the CPU")
        return 2
    shape = TINY if args.tiny else QWEN25_7B
    layer = build_layer(shape, device)  # once: quantising the 7B layer's 233M weights is not free
    result = {
        "shape": "tiny" if args.tiny else "Qwen2.5-7B",
        "layer": {k: shape[k] for k in SHAPE_FIELDS},
        "rows": list(ROWS),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "nf4_vs_dequantised_rel_err": check_outputs_agree(layer[1], device),
        **measure(layer, shape["num_hidden_layers"], ROWS, args.repeats, args.warmup, device),
        "command": command(),
        "machine": machine(),
        "versions": versions(),
    }
    path = write_result("nf4_decode_gemm-tiny" if args.tiny else "nf4_decode_gemm", result, args.out)
    for m in result["bf16_over_nf4"]:
        bf16, nf4 = result["per_layer_ms"]["bf16"][m], result["per_layer_ms"]["nf4"][m]
        print(f"rows {m:>2}: bf16 {bf16:.3f} ms, nf4 {nf4:.3f} ms a layer; bf16 / nf4 {bf16 / nf4:.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

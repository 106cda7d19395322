"""Pack the float32 linear weights for oneDNN on CPU while decoding.

A decode step multiplies a handful of rows by every weight of the model, so its time is the time to stream the
weights. PyTorch's float32 `F.linear` on CPU calls MKL's sgemm, which re-packs the weight panel on every call; with
8 rows that packing costs as much as the product. `packed_linears` packs each weight once per generation call into
oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's CPU weight prepacking uses) and
runs `torch.ops.mkldnn._linear_pointwise` on it for the length of the block. Measured on SmolLM2-135M, 8 rows x 100
prompt tokens, 2-core AMD EPYC (Zen 5): a decode step 53 -> 32 ms, the products themselves 44 -> 22 ms a step, the
prefill's too (a [800, 576] x [576, 1536] product 6.7 -> 3.0 ms); packing all 211 weights takes 0.15-0.2 s, once a
rollout (`benchmarks/perf/step_time.py --workload long`, README of benchmarks/perf).

Same products, other kernels: each output differs from `F.linear`'s by float32 rounding only (a different summation
order: ~1e-6 relative, `tests/rollout/test_packed_weights.py`), as a change of batch size already does, and greedy
decoding stays `generate`'s. The trainer's logprobs never come from here (its forwards run with gradients, which
the packed path refuses: the original `forward` runs whenever autograd is on).

Only exact `nn.Linear` layers with a float32 CPU weight are packed (the LoRA layers' bases after `folded_lora`, the
LM head): a 4-bit or half-precision base, a CUDA model, or a torch without the oneDNN ops keeps its own path. The
cost is one packed copy of those weights while the block runs (the model's float32 size at most), freed after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

PACK_ROWS = 8  # the batch size oneDNN's layout is chosen for; any row count runs on it (tested 1-800)


def packable(module: torch.nn.Module) -> bool:
    """Whether `packed_linears` would pack `module`: an exact `nn.Linear` with a float32 CPU weight."""
    if type(module) is not torch.nn.Linear:
        return False
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def onednn_available() -> bool:
    """Whether this torch has oneDNN and its packed-linear ops."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


@contextmanager
def packed_linears(model: torch.nn.Module) -> Iterator[int]:
    """Run the block with every packable linear layer of `model` on a oneDNN-packed copy of its weight (inference
    only: with autograd on, a layer runs its own `forward`); yields how many were packed. The weights must not change
    inside the block (the packed copies would not follow)."""
    patched: list[torch.nn.Module] = []
    try:
        if onednn_available():
            with torch.no_grad():
                for module in model.modules():
                    if packable(module):
                        module.forward = _packed_forward(module)
                        patched.append(module)
        yield len(patched)
    finally:
        for module in patched:
            del module.forward  # the instance attribute: the class's forward again


def _packed_forward(linear: torch.nn.Linear):
    packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)  # oneDNN blocked layout
    bias = None if linear.bias is None else linear.bias.detach()  # [out]
    plain = linear.forward  # the class's, bound

    def forward(x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if torch.is_grad_enabled() or x.dtype != torch.float32:
            return plain(x)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward

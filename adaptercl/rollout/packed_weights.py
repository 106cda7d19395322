"""Pack the linear weights for oneDNN on CPU while decoding, in float32 or (on CPUs with bf16 matrix units) bfloat16.

A decode step multiplies a handful of rows by every weight of the model, so its time is the time to stream the
weights. PyTorch's float32 `F.linear` on CPU calls MKL's sgemm, which re-packs the weight panel on every call; with
8 rows that packing costs as much as the product. `packed_linears` packs each weight once per generation call into
oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's CPU weight prepacking uses) and
runs `torch.ops.mkldnn._linear_pointwise` on it for the length of the block. Measured on SmolLM2-135M, 8 rows x 100
prompt tokens, 2-core AMD EPYC (Zen 5): a decode step 53 -> 32 ms, the products themselves 44 -> 22 ms a step, the
prefill's too (a [800, 576] x [576, 1536] product 6.7 -> 3.0 ms); packing all 211 weights takes 0.15-0.2 s, once a
rollout (`benchmarks/perf/step_time.py --workload long`, README of benchmarks/perf).

Same products, other kernels: in float32 each output differs from `F.linear`'s by float32 rounding only (a different
summation order: ~1e-6 relative, `tests/rollout/test_packed_weights.py`), as a change of batch size already does,
and greedy decoding stays `generate`'s. With `dtype=torch.bfloat16` the packed copy is the weight rounded to bf16 and
each input is rounded to bf16 on the way in (products accumulate in float32, the output is rounded to bf16 and
returned as float32): a different policy, by bf16's rounding (~0.4 % of a weight), which the rollout-mismatch weights
correct (`rollout.dtype`). The trainer's logprobs never come from here (its forwards run with gradients, which the
packed path refuses: the layer's own `forward` runs whenever autograd is on).

Only exact `nn.Linear` layers with a float32 CPU weight are packed (the LoRA layers' bases after `folded_lora`, the LM
head); `keep_float32` names layers that stay float32 in a bf16 block (an unfolded LoRA's own A and B: its update is a
small difference, kept exact beside the rounded base). A 4-bit or half-precision base and a CUDA model keep their own
path. The cost is one packed copy of those weights while the block runs (the model's float32 size at most), freed
after.

The ops are private to PyTorch and can change or vanish in a release, so they are probed once per dtype
(`onednn_refusal`: a small `nn.Linear` against `F.linear`, inside try/except); when they are missing, fail, change
signature or disagree, the block runs every layer's own forward and one line is logged, once per dtype, by the first
block asked for that dtype (the run's record of its CPU paths and `rollout.dtype: auto` probe bf16 silently: a CPU
without bf16 units is not a fault). `torch.backends.mkldnn.enabled = False` turns the packing off too. A layer's own
instance `forward` (an accelerate hook installs one) runs whenever the packed path does not and is put back
afterwards; a block inside another leaves the outer's layers to it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

PACK_ROWS = 8  # the batch size oneDNN's layout is chosen for; any row count runs on it (tested 1-800)
PACKED = "_adaptercl_packed"  # marks the forward this module installs, so a nested block leaves that layer alone
LOG = logging.getLogger(__name__)


def packable(module: torch.nn.Module) -> bool:
    """Whether `packed_linears` would pack `module`: an exact `nn.Linear` with a float32 CPU weight."""
    if type(module) is not torch.nn.Linear:
        return False
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def _onednn_ops():
    """torch's oneDNN op namespace (a function, so a test can hand in another)."""
    return getattr(torch.ops, "mkldnn", None)


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the packed path runs here for `dtype`: oneDNN enabled and its ops probed correct."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled and onednn_refusal(dtype) is None


@functools.cache
def onednn_refusal(dtype: torch.dtype = torch.float32) -> str | None:
    """Why the packed path cannot run in `dtype` with this torch (None: it can). Probed once per dtype and process:
    a seeded [3, 24] x [24, 16] product with bias through the packed ops against `F.linear` (for bf16, on the
    bf16-rounded inputs and weight), within the bound float32 summation in another order (and, in bf16, the output's
    rounding) allows. Silent: `packed_linears` says a refusal, when a block asks for that dtype."""
    return _probe(dtype)


@functools.cache
def _say_refusal(dtype: torch.dtype) -> None:
    """Log, once per dtype and process, why a block asked for `dtype` runs the plain path."""
    LOG.warning("packed %s linear weights are off, plain F.linear instead: %s", _name(dtype), onednn_refusal(dtype))


def _probe(dtype: torch.dtype) -> str | None:
    ops = _onednn_ops()
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    missing = [op for op in ("_reorder_linear_weight", "_linear_pointwise") if not hasattr(ops, op)]
    if missing:
        return f"torch {torch.__version__} has no torch.ops.mkldnn.{' or '.join(missing)}"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 24, generator=generator).to(dtype).float()  # [3, 24], representable in dtype
    weight = torch.randn(16, 24, generator=generator).to(dtype).float()  # [16, 24]
    bias = torch.randn(16, generator=generator).to(dtype).float()  # [16]
    try:
        packed = ops._reorder_linear_weight(weight.to(dtype), PACK_ROWS)
        out = ops._linear_pointwise(x.to(dtype), packed, bias.to(dtype), "none", [], "").float()  # [3, 16]
    except Exception as err:  # noqa: BLE001 - any failure (a changed signature, a missing kernel) is the reason
        return f"torch.ops.mkldnn failed on a probe ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
    exact = F.linear(x.double(), weight.double(), bias.double())  # [3, 16]
    if out.shape != exact.shape or not torch.isfinite(out).all():
        return f"torch.ops.mkldnn gave a {tuple(out.shape)} result for a {tuple(exact.shape)} product"
    # n terms (24 products and the bias) in float32, any order: within 2·n·u·Σ|terms| of the exact sum (Higham 3.1,
    # twice for two orders); bf16's output is rounded once more, by at most 2^-8 of its value
    u = torch.finfo(torch.float32).eps / 2
    terms = x.abs().double() @ weight.abs().double().T + bias.abs().double()  # [3, 16]
    bound = 2 * 25 * u * terms + (exact.abs() * 2.0**-8 if dtype == torch.bfloat16 else 0.0)
    if ((out.double() - exact).abs() > bound).any():
        worst = (out.double() - exact).abs().max().item()
        return f"torch.ops.mkldnn's product disagrees with F.linear (by {worst:.3g}, beyond rounding)"
    return None


@contextmanager
def packed_linears(
    model: torch.nn.Module, dtype: torch.dtype = torch.float32, keep_float32: frozenset[int] = frozenset()
) -> Iterator[int]:
    """Run the block with every packable linear layer of `model` on a oneDNN-packed copy of its weight in `dtype`
    (float32 or bfloat16; layers whose `id` is in `keep_float32` in float32), inference only: with autograd on, a
    layer runs its own `forward`. Yields how many layers this block packed (0 where the ops do not run here, and
    for layers an enclosing block packed already). The weights must not change inside the block."""
    patched: list[tuple[torch.nn.Module, object | None]] = []  # (layer, its own instance forward or None)
    try:
        refused = None  # the first dtype the block needs whose packed path does not run here
        if torch.backends.mkldnn.enabled:  # False: the user turned oneDNN off, nothing to say
            refused = next((d for d in (torch.float32, dtype) if onednn_refusal(d) is not None), None)
            if refused is not None:
                _say_refusal(refused)
        if torch.backends.mkldnn.enabled and refused is None:
            with torch.no_grad():
                for module in model.modules():
                    if packable(module) and not getattr(module.__dict__.get("forward"), PACKED, False):
                        own = module.__dict__.get("forward")
                        layer_dtype = torch.float32 if id(module) in keep_float32 else dtype
                        module.forward = _packed_forward(module, layer_dtype)
                        patched.append((module, own))
        yield len(patched)
    finally:
        for module, own in reversed(patched):
            if own is None:
                del module.forward  # the instance attribute: the class's forward again
            else:
                module.forward = own


def _packed_forward(linear: torch.nn.Linear, dtype: torch.dtype):
    ops = _onednn_ops()
    packed = ops._reorder_linear_weight(linear.weight.detach().to(dtype), PACK_ROWS)  # oneDNN blocked layout
    bias = None if linear.bias is None else linear.bias.detach().to(dtype)  # [out]
    plain = linear.forward  # the instance's own (a hook's) or the class's, bound

    def forward(x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if torch.is_grad_enabled() or x.dtype != torch.float32:
            return plain(x)
        return ops._linear_pointwise(x.to(dtype), packed, bias, "none", [], "").to(torch.float32)

    setattr(forward, PACKED, True)
    return forward


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

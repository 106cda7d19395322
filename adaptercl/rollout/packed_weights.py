"""Pack the linear weights for oneDNN on CPU: while decoding (float32, or bfloat16 on CPUs with bf16 matrix units),
for the evaluation's and diagnostics' scoring forwards, and for a whole training stage's frozen base.

A decode step multiplies a handful of rows by every weight of the model, so its time is the time to stream the
weights. PyTorch's float32 `F.linear` on CPU calls MKL's sgemm, which re-packs the weight panel on every call; with
8 rows that packing costs as much as the product. `packed_linears` packs each weight once into oneDNN's blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`, what Inductor's CPU weight prepacking uses) and runs
`torch.ops.mkldnn._linear_pointwise` on it for the length of the block. Measured on SmolLM2-135M, 8 rows x 100
prompt tokens, 2-core AMD EPYC (Zen 5): a decode step 53 -> 32 ms, the products themselves 44 -> 22 ms a step;
packing all 211 weights takes 0.15-0.2 s. Training-sized products gain as much on AMD, where MKL computes on its
AVX2 branch whatever the CPU has and oneDNN on AVX-512: one thread of a Zen 4 EPYC, [384, 576] x [576, 1536]
6.5 -> 2.7 ms, the LM head's [384, 576] x [576, 49152] 269 -> 124 ms (`benchmarks/perf/README.md`, issue 46).

Training. `run_stage` opens one block for the stage over the frozen base (`packed_base_linears`: every packable layer
but the LoRA factors). Under autograd, a layer whose weight and bias train nothing multiplies on its float32 pack
and gives its input the gradient grad @ W on a packed copy of W^T, made at the first backward (`_PackedProduct`);
a layer that trains runs its own forward. The cost: the packed copies of the base's linear weights, twice its
float32 size while the stage runs (SmolLM2-135M: 1.1 GB), freed after.

Same products, other kernels: in float32 each output differs from `F.linear`'s by float32 rounding only (a different
summation order: ~1e-6 relative, `tests/rollout/test_packed_weights.py`), as a change of batch size already does,
and greedy decoding stays `generate`'s. With `dtype=torch.bfloat16` the packed copy is the weight rounded to bf16 and
each input is rounded to bf16 on the way in (products accumulate in float32, the output is rounded to bf16 and
returned as float32): a different policy, by bf16's rounding (~0.4 % of a weight), which the rollout-mismatch weights
correct (`rollout.dtype`); a bf16 pack never runs under autograd.

Only exact `nn.Linear` layers with a float32 CPU weight are packed (the LoRA layers' bases, the LM head, an unfolded
LoRA's A and B in a rollout); `keep_float32` names layers that stay float32 in a bf16 block (an unfolded LoRA's own A
and B: its update is a small difference, kept exact beside the rounded base). A 4-bit or half-precision base and a
CUDA model keep their own path, and so does any call under CPU autocast. A pack serves while the layer's weight is
the tensor it was packed from, unwritten: a weight replaced (`folded_lora` swaps in a folded copy) or written in place
(an optimiser or EMA step moves its version) sends the layer to its own forward, and a block opened inside packs it
anew for its own length, while layers whose outer pack is current use it (the rollouts inside a stage pack only the
folded layers).

Where the packs pay is measured per CPU, not assumed (`packed_choice.py`): a block that names its `use` (the
decode's, or whole sequences' for the stage and the scoring forwards) packs only where this CPU's answer says so, and
otherwise runs every layer's own forward, an enclosing block's packs set aside for its length.

The ops are private to PyTorch and can change or vanish in a release, so they are probed once per dtype
(`onednn_refusal`: a small `nn.Linear` against `F.linear`, inside try/except); when they are missing, fail, change
signature or disagree, the block runs every layer's own forward and one line is logged, once per dtype, by the first
block asked for that dtype (the run's record of its CPU paths and `rollout.dtype: auto` probe bf16 silently: a CPU
without bf16 units is not a fault). `torch.backends.mkldnn.enabled = False` turns the packing off too. A layer's own
instance `forward` (an accelerate hook installs one) runs whenever the packed path does not and is put back
afterwards.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.nn.functional as F

from adaptercl.rollout.packed_choice import Use, decision

PACK_ROWS = 8  # the batch size oneDNN's layout is chosen for; any row count runs on it (tested 1-800)
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


class _Pack:
    """One layer's weight (and bias) packed in `dtype`, with what it was packed from: current while the layer's
    weight is still that tensor (same storage, no in-place write since: `_version`). The held weight keeps its storage
    alive, so no other tensor can take its address while the pack exists. The packed copy is made at the first
    product (a layer the block never calls, such as a folded LoRA's own A and B in a rollout, is never packed), from
    the held weight, which a current pack's layer still has."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype):
        self.ops = _onednn_ops()
        self.weight = linear.weight.detach()  # [out, in], the packed values' source
        self.version = linear.weight._version
        self.dtype = dtype
        self.packed: torch.Tensor | None = None  # oneDNN blocked layout, made at the first product
        self.bias = None if linear.bias is None else linear.bias.detach().to(dtype)  # [out]
        self.transposed: torch.Tensor | None = None  # W^T [in, out] packed, made at the first backward

    def current(self, linear: torch.nn.Linear) -> bool:
        weight = linear.weight
        return weight.data_ptr() == self.weight.data_ptr() and weight._version == self.version

    def product(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out], float32
        if self.packed is None:
            self.packed = self.ops._reorder_linear_weight(self.weight.to(self.dtype), PACK_ROWS)
        return self.ops._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "").float()

    def grad_input(self, grad: torch.Tensor) -> torch.Tensor:  # [..., out] -> [..., in]: grad @ W
        if self.transposed is None:
            self.transposed = self.ops._reorder_linear_weight(self.weight.t().contiguous(), PACK_ROWS)
        return self.ops._linear_pointwise(grad.contiguous(), self.transposed, None, "none", [], "")


class _Aside:
    """An entry of `_PackedForward.packs` that is never current: the layer runs its own forward while it is last."""

    dtype = None

    def current(self, linear: torch.nn.Linear) -> bool:
        return False


_ASIDE = _Aside()


class _PackedProduct(torch.autograd.Function):
    """y = x W^T + b on a float32 pack of a frozen layer; backward gives x its gradient, grad @ W, on the packed W^T
    (W and b train nothing: the caller checks that neither requires a gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pack: _Pack) -> torch.Tensor:  # [..., in] -> [..., out]
        ctx.pack = pack
        return pack.product(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # [..., out] -> ([..., in], None)
        return ctx.pack.grad_input(grad), None


class _PackedForward:
    """The forward a block installs on a layer: its innermost current pack's product, else the layer's own forward.
    Blocks push packs on `packs` and pop them; the last pop puts the layer's own forward back."""

    def __init__(self, linear: torch.nn.Linear, own):
        self.linear, self.own = linear, own  # own: the layer's instance forward (a hook's) or None (the class's)
        self.packs: list[_Pack] = []

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return (self.own or type(self.linear).forward.__get__(self.linear))(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        linear, pack = self.linear, self.packs[-1]
        if x.dtype != torch.float32 or not pack.current(linear) or torch.is_autocast_enabled("cpu"):
            return self.plain(x)
        if not torch.is_grad_enabled():
            return pack.product(x)
        trains = linear.weight.requires_grad or (linear.bias is not None and linear.bias.requires_grad)
        if trains or pack.dtype != torch.float32:
            return self.plain(x)
        return _PackedProduct.apply(x, pack)


@contextmanager
def packed_linears(
    model: torch.nn.Module,
    dtype: torch.dtype = torch.float32,
    keep_float32: frozenset[int] = frozenset(),
    exclude: frozenset[int] = frozenset(),
    use: Use | None = None,
) -> Iterator[int]:
    """Run the block with every packable linear layer of `model` (but those whose `id` is in `exclude`) on a
    oneDNN-packed copy of its weight in `dtype` (float32 or bfloat16; layers whose `id` is in `keep_float32` in
    float32). With autograd on, a float32 pack of a layer whose weight and bias train nothing runs forward and the
    input's gradient on oneDNN too; any other layer runs its own `forward`. A layer whose weight was replaced or
    written in place since it was packed runs its own `forward` as well. Inside another block, a layer whose outer
    pack is current and of `dtype` uses it; the others are packed for this block, each at its first product. `use`
    ("decode" or "sequences") asks this CPU's measured answer first (`packs_pay`; None: pack): where
    the packs do not pay for a float32 block, every layer runs its own forward for its length, an enclosing block's
    packs set aside. Yields how many layers this block gave a pack of its own (0 where the ops do not run here)."""
    pushed: list[_PackedForward] = []
    try:
        chosen = use is not None and dtype == torch.float32 and torch.backends.mkldnn.enabled
        if chosen and any(packable(module) for module in model.modules()) and not packs_pay(use):
            for module in model.modules():  # plain products: the enclosing blocks' packs step aside
                installed = module.__dict__.get("forward")
                if isinstance(installed, _PackedForward):
                    installed.packs.append(_ASIDE)
                    pushed.append(installed)
            yield 0
            return
        refused = None  # the first dtype the block needs whose packed path does not run here
        if torch.backends.mkldnn.enabled:  # False: the user turned oneDNN off, nothing to say
            refused = next((d for d in (torch.float32, dtype) if onednn_refusal(d) is not None), None)
            if refused is not None:
                _say_refusal(refused)
        if torch.backends.mkldnn.enabled and refused is None:
            with torch.no_grad():
                for module in model.modules():
                    if not packable(module) or id(module) in exclude:
                        continue
                    layer_dtype = torch.float32 if id(module) in keep_float32 else dtype
                    installed = module.__dict__.get("forward")
                    if not isinstance(installed, _PackedForward):
                        installed = _PackedForward(module, installed)
                        module.forward = installed
                    elif installed.packs[-1].current(module) and installed.packs[-1].dtype == layer_dtype:
                        continue  # an enclosing block's pack serves
                    installed.packs.append(_Pack(module, layer_dtype))
                    pushed.append(installed)
        yield len(pushed)
    finally:
        for installed in reversed(pushed):
            installed.packs.pop()
            if not installed.packs:
                module = installed.linear
                if installed.own is None:
                    del module.forward  # the instance attribute: the class's forward again
                else:
                    module.forward = installed.own


def packs_pay(use: Use) -> bool:
    """Whether `use`'s float32 products run on the packs in this process: this CPU's measured answer
    (`packed_choice.decision`, a measurement timing `packed_linears`)."""
    return decision(use, packed_linears)["packed"]


def packed_base_linears(model: torch.nn.Module) -> AbstractContextManager[int]:
    """`packed_linears` over the frozen base's linear layers (every packable layer but the LoRA factors, which train or
    follow the student), for a whole training stage, where the packs pay for whole sequences on this CPU
    (`packed_choice`): packed once, their forward products, the input gradients through them and every no-grad
    forward of the stage (the teacher's, the rollouts' unfolded layers) run on oneDNN."""
    from adaptercl.rollout.folded_lora import lora_factor_layers

    return packed_linears(model, exclude=lora_factor_layers(model), use="sequences")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

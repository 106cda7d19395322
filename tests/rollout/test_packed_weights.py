"""oneDNN-packed linear weights: the products equal `F.linear`'s up to float32 summation order (in bf16: of the
bf16-rounded operands, rounded once), and so do a frozen layer's forward and input gradient under autograd (a layer
that trains runs its own forward); layers come back as they were (also after an error; an instance's own forward, an
accelerate hook's, put back); a pack whose weight changed is not used, and a block inside another packs only such
layers; only float32 CPU `nn.Linear` layers are packed, the engine decodes on them; and the fallbacks: ops missing,
with another signature or disagreeing with `F.linear` (one logged line, the plain path), oneDNN disabled."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from packing_counts import counting

from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import ModelConfig
from adaptercl.rollout import SamplingParams
from adaptercl.rollout import hf as hf_engine
from adaptercl.rollout import packed_weights as pw
from adaptercl.rollout.packed_weights import onednn_available, packable, packed_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN packed-linear ops")


def summation_bound(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """A float32 dot product of n terms summed in any order is within n·u·Σ|x_i w_i| of the exact one (Higham,
    Accuracy and Stability, 3.1: γ_n ≤ n·u/(1 − n·u)); two orders differ by at most twice that. Bias: one more term."""
    n = x.shape[-1] + 1
    u = torch.finfo(torch.float32).eps / 2
    magnitude = x.abs() @ linear.weight.abs().T + (0 if linear.bias is None else linear.bias.abs())  # [rows, out]
    return 2 * n * u / (1 - n * u) * magnitude


@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_packed_product_equals_linear_up_to_summation_order(rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 80)
    x = torch.randn(rows, 96)
    with torch.no_grad():
        plain = F.linear(x, linear.weight, linear.bias)  # [rows, 80]
        with packed_linears(linear) as count:
            packed = linear(x)
            batched = linear(x.view(1, rows, 96))  # [1, rows, 80]: leading dimensions kept
    assert count == 1
    assert (packed - plain).abs().le(summation_bound(x, linear)).all()
    assert batched.shape == (1, rows, 80) and torch.equal(batched[0], packed)


def test_layers_are_restored_also_when_the_block_raises():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(2, 8)
    with torch.no_grad():
        before = model(x)
        with pytest.raises(RuntimeError, match="boom"), packed_linears(model) as count:
            assert count == 2 and all("forward" in model[i].__dict__ for i in (0, 2))
            raise RuntimeError("boom")
        after = model(x)
    assert all("forward" not in m.__dict__ for m in model)
    assert torch.equal(after, before)  # MKL's F.linear again, bit for bit


def test_a_layer_that_trains_runs_its_own_forward_under_autograd():
    linear = torch.nn.Linear(16, 4)
    x = torch.randn(3, 16)
    with packed_linears(linear):
        out = linear(x)  # grad enabled and the weight trains: the class's forward
    assert torch.equal(out, F.linear(x, linear.weight, linear.bias))
    out.sum().backward()
    assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0


def grad_input_bound(grad: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """grad @ W sums `out` products per input: `summation_bound`'s argument with the sum over the output dimension."""
    n = linear.weight.shape[0]
    u = torch.finfo(torch.float32).eps / 2
    return 2 * n * u / (1 - n * u) * (grad.abs() @ linear.weight.abs())  # [..., in]


@pytest.mark.parametrize("rows", [1, 8, 37])
def test_a_frozen_layer_trains_its_input_through_the_packed_product(rows):
    """A frozen layer (LoRA's base) under autograd: forward on the packed weight, and the input's gradient grad @ W on
    the packed transpose, each within float32's summation bound of the plain layer's; the weight gets no gradient."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 80).requires_grad_(False)
    x = torch.randn(2, rows, 96, requires_grad=True)
    upstream = torch.randn(2, rows, 80)  # d loss / d out
    plain = linear(x)
    (plain_grad,) = torch.autograd.grad(plain, x, upstream)
    with packed_linears(linear) as count:
        packed = linear(x)
        assert type(packed.grad_fn).__name__ == "_PackedProductBackward"
        (packed_grad,) = torch.autograd.grad(packed, x, upstream)
    assert count == 1 and linear.weight.grad is None
    assert (packed - plain).abs().le(summation_bound(x.detach(), linear)).all()
    assert (packed_grad - plain_grad).abs().le(grad_input_bound(upstream, linear)).all()


def test_a_pack_is_not_used_once_its_weight_changed():
    """Written in place (an optimiser step, an EMA update: the version moves) or replaced (`folded_lora` swaps the
    data): the layer's own forward; a block opened inside packs the changed layers anew for its own length, and a
    block inside that one reuses those packs."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).requires_grad_(False)
    x = torch.randn(3, 8)
    with torch.no_grad(), packed_linears(model) as outer:
        model[0].weight.mul_(2.0)  # in place
        model[1].weight.data = model[1].weight.data * 3.0  # replaced
        assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))
        assert torch.equal(model[1](x), F.linear(x, model[1].weight, model[1].bias))
        with packed_linears(model[0]) as inner:  # packed anew for this block
            assert (
                inner == 1
                and (model[0](x) - F.linear(x, model[0].weight, model[0].bias))
                .abs()
                .le(summation_bound(x, model[0]))
                .all()
            )
        assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))  # its pack went with the block
        with packed_linears(model) as inner:
            assert inner == 2
            with packed_linears(model) as innermost:
                assert innermost == 0  # both current now
    assert outer == 2 and all("forward" not in m.__dict__ for m in model)


def test_a_layer_is_packed_at_its_first_product_and_never_if_not_called(monkeypatch):
    """A block gives every packable layer a pack, but oneDNN's reorder runs at a layer's first product, once: a layer
    the block never calls (a folded LoRA's own A and B in a rollout) costs no packing."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8)
    real = torch.ops.mkldnn
    reordered = []
    assert pw.onednn_refusal(torch.float32) is None  # probed now if not yet: its own reorder is not the block's

    def reorder(weight, rows):
        reordered.append(tuple(weight.shape))
        return real._reorder_linear_weight(weight, rows)

    monkeypatch.setattr(pw, "_onednn_ops", lambda: SimpleNamespace(
        _reorder_linear_weight=reorder, _linear_pointwise=real._linear_pointwise))  # fmt: skip
    with torch.no_grad(), packed_linears(model) as count:
        assert count == 2 and reordered == []
        for _ in range(3):
            out = model[0](x)
        assert reordered == [(8, 8)]  # the first layer, once; the second never called
    assert (out - F.linear(x, model[0].weight, model[0].bias)).abs().le(summation_bound(x, model[0])).all()


def test_only_float32_cpu_linear_layers_are_packed():
    class Subclass(torch.nn.Linear):
        pass

    assert packable(torch.nn.Linear(4, 4))
    assert not packable(torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert not packable(Subclass(4, 4))  # a quantised or adapter layer keeps its own forward
    assert not packable(torch.nn.Embedding(4, 4))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16), Subclass(4, 4))
    with packed_linears(model) as count:
        assert count == 1 and "forward" in model[0].__dict__ and "forward" not in model[1].__dict__


def test_the_engine_decodes_on_packed_weights(monkeypatch):
    base = load_base(ModelConfig(name="tiny-random"), "none")
    counts: list[int] = []
    monkeypatch.setattr(hf_engine, "packed_linears", counting(hf_engine.packed_linears, counts))
    engine = hf_engine.HFEngine(base.model, base.tokenizer, batch_size=4)
    engine.generate([[1, 2, 3], [4, 5]], None, SamplingParams(4, greedy=True))
    linears = sum(type(m) is torch.nn.Linear for m in base.model.modules())
    assert counts == [linears] and linears > 0
    assert all("forward" not in m.__dict__ for m in base.model.modules())


# ------------------------------------------------------------------ the fallbacks: the private ops cannot take a rollout down


@pytest.fixture
def fresh_probe():
    """The probe is cached per process: cleared before and after, so a faked namespace is probed and forgotten."""
    pw.onednn_refusal.cache_clear()
    pw._say_refusal.cache_clear()
    yield
    pw.onednn_refusal.cache_clear()
    pw._say_refusal.cache_clear()


def check_plain_fallback(caplog, match: str) -> None:
    """The block packs nothing, the layer gives MKL's F.linear bit for bit, and one line said why, once."""
    check_plain_fallback_in(caplog, torch.float32, match)


def check_plain_fallback_in(caplog, dtype: torch.dtype, match: str) -> None:
    """`check_plain_fallback` for blocks asked for `dtype`."""
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=pw.__name__), torch.no_grad():
        for _ in range(2):  # a second block is not probed (nor said) again
            with packed_linears(linear, dtype) as count:
                assert count == 0 and "forward" not in linear.__dict__
                assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
    lines = [r.getMessage() for r in caplog.records if r.name == pw.__name__]
    assert len(lines) == 1 and re.search(match, lines[0]) and "plain F.linear instead" in lines[0], lines


def test_missing_ops_fall_back_to_the_plain_path_with_one_line(monkeypatch, caplog, fresh_probe):
    monkeypatch.setattr(pw, "_onednn_ops", lambda: SimpleNamespace(_reorder_linear_weight=lambda *a: None))
    check_plain_fallback(caplog, r"no torch\.ops\.mkldnn\._linear_pointwise")


def test_ops_with_a_changed_signature_fall_back(monkeypatch, caplog, fresh_probe):
    real = torch.ops.mkldnn

    def newer(x, packed, bias, attr, scalars):  # a release that dropped an argument
        return real._linear_pointwise(x, packed, bias, attr, scalars, "")

    monkeypatch.setattr(pw, "_onednn_ops", lambda: SimpleNamespace(
        _reorder_linear_weight=real._reorder_linear_weight, _linear_pointwise=newer))  # fmt: skip
    check_plain_fallback(caplog, r"failed on a probe \(TypeError")


def test_ops_that_disagree_with_linear_fall_back(monkeypatch, caplog, fresh_probe):
    real = torch.ops.mkldnn
    off = lambda *a: real._linear_pointwise(*a) * (1 + 1e-3)  # noqa: E731 - wrong by 1e-3 relative, far beyond rounding
    monkeypatch.setattr(pw, "_onednn_ops", lambda: SimpleNamespace(
        _reorder_linear_weight=real._reorder_linear_weight, _linear_pointwise=off))  # fmt: skip
    check_plain_fallback(caplog, r"disagrees with F\.linear")


def test_a_bf16_refusal_is_silent_until_a_block_asks_for_bf16(monkeypatch, caplog, fresh_probe):
    """As on a CPU without bf16 units (CI's AVX2 AMD): the float32 path packs, bf16's probe fails. The run's record of
    its CPU paths and `rollout.dtype: auto` probe bf16 without a word (a run prints no warning for its CPU); a block
    asked for bf16 says why it runs the plain path, once."""
    from adaptercl.rollout.precision import cpu_paths, rollout_dtype

    real = torch.ops.mkldnn

    def reorder(weight, rows):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")
        return real._reorder_linear_weight(weight, rows)

    monkeypatch.setattr(pw, "_onednn_ops", lambda: SimpleNamespace(
        _reorder_linear_weight=reorder, _linear_pointwise=real._linear_pointwise))  # fmt: skip
    linear = torch.nn.Linear(16, 8)
    with caplog.at_level(logging.DEBUG, logger=pw.__name__), torch.no_grad():
        record = cpu_paths(torch.float32)
        assert record["packed_weights"]["float32"] == "on"
        assert record["packed_weights"]["bfloat16"].startswith("off: torch.ops.mkldnn failed on a probe (RuntimeError")
        assert rollout_dtype("auto", linear) == torch.float32
        with packed_linears(linear) as count:  # float32, as a default run decodes
            assert count == 1
        assert not [r for r in caplog.records if r.name == pw.__name__]
    check_plain_fallback_in(caplog, torch.bfloat16, r"packed bfloat16 .* needs the cpu support avx512bw")


def test_mkldnn_disabled_is_honoured(monkeypatch):
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    with torch.no_grad(), packed_linears(linear) as count:
        assert count == 0 and torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", True)
    with torch.no_grad(), packed_linears(linear) as count:  # enabled again: packed
        assert count == 1


def test_an_instance_forward_an_accelerate_hook_installed_runs_and_comes_back():
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    linear = torch.nn.Linear(16, 8)
    add_hook_to_module(linear, Counting())
    hooked = linear.__dict__["forward"]
    x = torch.randn(3, 16)
    with packed_linears(linear) as count:
        assert count == 1 and linear.__dict__["forward"] is not hooked
        out = linear(x)  # autograd on: the layer's own forward, which is the hook's
        assert Counting.calls == 1 and torch.equal(out, F.linear(x, linear.weight, linear.bias))
    assert linear.__dict__["forward"] is hooked  # put back, not deleted
    linear(x)
    assert Counting.calls == 2


def test_a_block_inside_another_reuses_the_outer_current_packs():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    with torch.no_grad(), packed_linears(model) as outer:
        installed = [m.__dict__["forward"] for m in model]
        with packed_linears(model) as inner:
            assert inner == 0 and [m.__dict__["forward"] for m in model] == installed
        assert outer == 2 and [m.__dict__["forward"] for m in model] == installed  # still packed after the inner block
    assert all("forward" not in m.__dict__ for m in model)


@pytest.mark.parametrize("rows", [1, 8, 37])
def test_a_bf16_block_multiplies_the_bf16_rounded_input_and_weight(rows):
    """The product of bf16(x) and bf16(W) accumulated in float32 (within float32's summation bound of the exact one),
    rounded once to bf16 (half an ulp: 2^-9 of its value; 2^-8 allowed). Where oneDNN's bf16 product does not run
    (a CPU without AVX-512 BW/VL/DQ, or CI's AVX2 emulation) the block packs nothing: MKL's float32 product."""
    torch.manual_seed(rows)
    linear, kept = torch.nn.Linear(96, 80), torch.nn.Linear(96, 80)
    model = torch.nn.ModuleList([linear, kept])
    x = torch.randn(rows, 96)
    with torch.no_grad():
        with packed_linears(model, torch.bfloat16, keep_float32=frozenset({id(kept)})) as count:
            packed, fp32 = linear(x), kept(x)
    if not pw.onednn_available(torch.bfloat16):
        assert count == 0 and torch.equal(packed, F.linear(x, linear.weight, linear.bias))
        return
    with torch.no_grad():
        rounded = torch.nn.Linear(96, 80)
        rounded.weight.copy_(linear.weight.bfloat16().float())
        rounded.bias.copy_(linear.bias.bfloat16().float())
        exact = F.linear(x.bfloat16().double(), rounded.weight.double(), rounded.bias.double())  # [rows, 80]
    assert count == 2 and packed.dtype == torch.float32
    xr = x.bfloat16().float()
    assert ((packed.double() - exact).abs() <= summation_bound(xr, rounded) + exact.abs() * 2.0**-8).all()
    assert not torch.equal(packed, F.linear(x, linear.weight, linear.bias))  # not the float32 product
    assert (fp32 - F.linear(x, kept.weight, kept.bias)).abs().le(summation_bound(x, kept)).all()  # kept float32

"""oneDNN-packed linear weights while decoding: the products equal `F.linear`'s up to float32 summation order,
layers come back as they were (also after an error), autograd never runs on the packed path, only float32 CPU
`nn.Linear` layers are packed, and the engine decodes on them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import ModelConfig
from adaptercl.rollout import SamplingParams
from adaptercl.rollout import hf as hf_engine
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


def test_autograd_runs_the_layers_own_forward():
    linear = torch.nn.Linear(16, 4)
    x = torch.randn(3, 16)
    with packed_linears(linear):
        out = linear(x)  # grad enabled: the class's forward
    assert torch.equal(out, F.linear(x, linear.weight, linear.bias))
    out.sum().backward()
    assert linear.weight.grad is not None and linear.weight.grad.abs().sum() > 0


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
    counts = []
    original = hf_engine.packed_linears

    def recording(model):
        context = original(model)

        class Recorder:
            def __enter__(self):
                counts.append(context.__enter__())
                return counts[-1]

            def __exit__(self, *exc):
                return context.__exit__(*exc)

        return Recorder()

    monkeypatch.setattr(hf_engine, "packed_linears", recording)
    engine = hf_engine.HFEngine(base.model, base.tokenizer, batch_size=4)
    engine.generate([[1, 2, 3], [4, 5]], None, SamplingParams(4, greedy=True))
    linears = sum(type(m) is torch.nn.Linear for m in base.model.modules())
    assert counts == [linears] and linears > 0
    assert all("forward" not in m.__dict__ for m in base.model.modules())

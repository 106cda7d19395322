"""Parameter drift on a model: W0 is dequantised and decomposed once per run, and the cached spectrum gives the
same figures as decomposing it afresh."""

from __future__ import annotations

import pytest
import torch

from adaptercl.adapters.live import attach_adapter, lora_parameters
from adaptercl.measure import weight_drift
from adaptercl.measure.drift import BaseWeights, module_deltas, parameter_drift_report
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import LoraConfig, ModelConfig


def test_drift_report_decomposes_each_base_weight_once_and_matches_a_fresh_svd(monkeypatch):
    base = load_base(ModelConfig(name="tiny-random"), "none")
    model = attach_adapter(base.model, "student", LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        for p in lora_parameters(model, "student").values():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)).to(p.device))
    weights = BaseWeights()
    calls = []
    decompose = weight_drift.spectrum
    monkeypatch.setattr(weight_drift, "spectrum", lambda w, k: calls.append(tuple(w.shape)) or decompose(w, k))
    first = parameter_drift_report(model, ["student"], weights, k=4)
    n_modules = len(first["per_module"])
    assert n_modules > 0 and len(calls) == 2 * n_modules  # W0 and W0 + ΔW of every module
    second = parameter_drift_report(model, ["student"], weights, k=4)
    assert len(calls) == 3 * n_modules  # only W0 + ΔW again
    assert second == first
    for name, (layer, delta) in module_deltas(model, ["student"]).items():
        fresh = weight_drift.parameter_drift(layer.get_base_layer().weight, delta, k=4, dtype=torch.float32)
        assert first["per_module"][name] == pytest.approx(fresh, rel=1e-5, abs=1e-6)
        assert fresh["relative_delta_norm"] > 0


@pytest.mark.parametrize("shape", [(40, 12), (12, 40)])
def test_a_cached_spectrum_keeps_only_its_top_k_vectors(shape):
    """`BaseWeights` keeps a spectrum of every adapted W0 for the run; each holds its m singular values and top-k
    vectors, (out + in) x k + m floats (the memory plan's drift cache), not the whole [out, m] U of its SVD."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    k, (out, inn) = 3, shape
    spectrum = weight_drift.spectrum(w, k)
    held = sum(t.untyped_storage().nbytes() for t in (spectrum.s, spectrum.U, spectrum.Vh))
    assert held == ((out + inn) * k + min(out, inn)) * 4
    # the same values and vectors (up to sign) as a float64 SVD: float32's ~6e-8 relative, over the gaps between
    # these well-separated singular values, leaves ~1e-6 in the vectors' cosines; 1e-5 allows 10x that
    U, s, Vh = torch.linalg.svd(w.double(), full_matrices=False)
    torch.testing.assert_close(spectrum.s.double(), s, rtol=1e-5, atol=0)
    cosines = (spectrum.U.double() * U[:, :k]).sum(0).abs()
    torch.testing.assert_close(cosines, torch.ones(k, dtype=torch.float64), rtol=0, atol=1e-5)

"""The low-rank drift path (adaptercl/measure/lowrank_drift.py) against the exact one
(measure.weight_drift.parameter_drift, full SVDs) on small shapes, and the drift report's method choice and progress
callback on a model."""

from __future__ import annotations

import pytest
import torch

from adaptercl.adapters.live import attach_adapter, lora_parameters
from adaptercl.measure import lowrank_drift as lowrank_module
from adaptercl.measure import weight_drift
from adaptercl.measure.drift import (
    AUTO_EXACT_MAX_NUMEL,
    BaseWeights,
    module_factors,
    parameter_drift_report,
    resolve_drift_method,
)
from adaptercl.measure.lowrank_drift import LOWRANK_KEYS, base_spectrum, delta_frobenius, lowrank_drift
from adaptercl.model.base import load_base
from adaptercl.recipe.grammar import LoraConfig, ModelConfig

# Stated agreement of the low-rank path with the exact float64 path (float32 subspace iteration, k = 8).
SINGULAR_VALUE_RTOL = 1e-5
ANGLE_ATOL = 1e-4  # radians
DELTA_NORM_RTOL = 1e-6
SHIFT_RTOL = 1e-3  # a norm of differences of singular values, ~1e-3 of them


def decaying_weight(out_features: int, in_features: int, seed: int, alpha: float = 0.5) -> torch.Tensor:
    """W0 [out, in] = U diag(i^-alpha) Vᵀ with random orthonormal U, V: a decaying spectrum like a trained weight's."""
    g = torch.Generator().manual_seed(seed)
    m = min(out_features, in_features)
    U = torch.linalg.qr(torch.randn(out_features, m, generator=g, dtype=torch.float64)).Q  # [out, m]
    V = torch.linalg.qr(torch.randn(in_features, m, generator=g, dtype=torch.float64)).Q  # [in, m]
    s = torch.arange(1, m + 1, dtype=torch.float64) ** -alpha  # [m]
    return (U * s) @ V.T


def lora_factors(out_features: int, in_features: int, rank: int, seed: int, scale: float = 0.02):
    g = torch.Generator().manual_seed(seed)
    B = scale * torch.randn(out_features, rank, generator=g, dtype=torch.float64) / rank**0.5  # [out, R]
    A = torch.randn(rank, in_features, generator=g, dtype=torch.float64) / in_features**0.5  # [R, in]
    return B, A


@pytest.mark.parametrize("shape", [(300, 120), (120, 300), (200, 200)])  # tall (like up/gate), wide (down), square
@pytest.mark.parametrize("rank", [1, 4, 16, 48])
def test_lowrank_path_agrees_with_the_exact_path(shape, rank) -> None:
    k = 8
    w0, (B, A) = decaying_weight(*shape, seed=rank), lora_factors(*shape, rank, seed=100 + rank)
    exact = weight_drift.parameter_drift(w0, B @ A, k=k)  # float64, full SVDs
    s0, s1 = torch.linalg.svdvals(w0)[:k], torch.linalg.svdvals(w0 + B @ A)[:k]
    exact_shift_top_k = ((s1 - s0).norm() / s0.norm()).item()

    base = base_spectrum(w0.float(), k)
    torch.testing.assert_close(base.s[:k].double(), s0, rtol=SINGULAR_VALUE_RTOL, atol=0)
    low = lowrank_drift(w0.float(), B.float(), A.float(), base, k)
    assert set(low) == set(LOWRANK_KEYS)
    assert low["relative_delta_norm"] == pytest.approx(exact["relative_delta_norm"], rel=DELTA_NORM_RTOL)
    assert low["spectral_shift_top_k"] == pytest.approx(exact_shift_top_k, rel=SHIFT_RTOL)
    for key in ("principal_angle", "principal_angle_left", "principal_angle_right"):
        assert low[key] == pytest.approx(exact[key], abs=ANGLE_ATOL)
    assert exact["principal_angle"] > 10 * ANGLE_ATOL  # the angle measured is not lost in the tolerance


def test_top_triplets_reconstruct_the_top_k_part_and_leave_the_global_rng_alone() -> None:
    w0 = decaying_weight(150, 90, seed=3).float()
    state = torch.get_rng_state()
    base = base_spectrum(w0, 5)
    assert torch.equal(torch.get_rng_state(), state)
    assert base.U.shape == (150, 21) and base.Vh.shape == (21, 90)  # k + OVERSAMPLE columns
    U, s, Vh = torch.linalg.svd(w0.double(), full_matrices=False)
    top = (U[:, :5] * s[:5]) @ Vh[:5]
    torch.testing.assert_close((base.U[:, :5] * base.s[:5]) @ base.Vh[:5], top.float(), rtol=0, atol=1e-5)
    assert base.frobenius == pytest.approx(torch.linalg.matrix_norm(w0.double()).item(), rel=1e-6)


def test_delta_frobenius_of_concatenated_factors_is_the_norm_of_the_summed_delta() -> None:
    (B1, A1), (B2, A2) = lora_factors(40, 30, 4, seed=1, scale=1.0), lora_factors(40, 30, 8, seed=2, scale=1.0)
    B, A = torch.cat([0.5 * B1, 2.0 * B2], dim=1), torch.cat([A1, A2], dim=0)  # [40, 12], [12, 30]
    expected = torch.linalg.matrix_norm(0.5 * B1 @ A1 + 2.0 * B2 @ A2).item()
    assert delta_frobenius(B, A) == pytest.approx(expected, rel=1e-12)
    # two adapters that cancel: ΔW = 0 exactly, and so is every drift metric
    B0, A0 = torch.cat([B1, -B1], dim=1), torch.cat([A1, A1], dim=0)
    assert delta_frobenius(B0, A0) == 0.0
    w0 = decaying_weight(40, 30, seed=0)
    assert set(lowrank_drift(w0, B0, A0, base_spectrum(w0, 4), 4).values()) == {0.0}


def test_auto_is_exact_up_to_the_size_limit_and_lowrank_above() -> None:
    assert resolve_drift_method("auto", [(512, 3584), (2048, 2048)]) == "exact"
    assert resolve_drift_method("auto", [(512, 3584), (18944, 3584)]) == "lowrank"
    assert AUTO_EXACT_MAX_NUMEL < 3584 * 3584
    assert resolve_drift_method("exact", [(18944, 3584)]) == "exact"
    assert resolve_drift_method("lowrank", [(8, 8)]) == "lowrank"


@pytest.fixture(scope="module")
def trained_model():
    """tiny-random with an adapter moved off zero. Its random base weights have flat spectra (σ4 - σ5 is 1-3 % of σ1),
    so their top-4 singular subspaces are ill-conditioned and the float32 subspace iteration's angles move by ~1e-4
    with the kernels' rounding (an AVX2 CPU failed ANGLE_ATOL). Each adapted base weight is replaced by a
    decaying-spectrum one, as a trained weight has and as the tolerances above are stated for."""
    base = load_base(ModelConfig(name="tiny-random"), "none")
    model = attach_adapter(base.model, "student", LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        for i, (layer, _, _) in enumerate(module_factors(model, ["student"]).values()):
            weight = layer.base_layer.weight
            weight.copy_(decaying_weight(*weight.shape, seed=1000 + i).to(weight.dtype))
        for p in lora_parameters(model, "student").values():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)).to(p.device))
    return model


def test_report_methods_agree_on_a_model_and_progress_is_called_once_per_module(trained_model) -> None:
    calls: list[tuple[int, int]] = []
    exact = parameter_drift_report(
        trained_model, ["student"], BaseWeights(), k=4, on_module=lambda *a: calls.append(a)
    )
    n = len(module_factors(trained_model, ["student"]))
    assert exact["method"] == "exact" and exact["top_k"] == 4  # auto on a tiny model
    assert calls == [(i, n) for i in range(1, n + 1)]
    low = parameter_drift_report(trained_model, ["student"], BaseWeights(), k=4, method="lowrank")
    assert low["method"] == "lowrank" and low["per_module"].keys() == exact["per_module"].keys()
    for name, drift in low["per_module"].items():
        for key in ("relative_delta_norm", "principal_angle"):
            assert drift[key] == pytest.approx(exact["per_module"][name][key], rel=1e-4, abs=ANGLE_ATOL)
    assert "spectral_shift" not in low["aggregate"] and low["aggregate"]["spectral_shift_top_k_mean"] > 0


def test_lowrank_report_decomposes_each_base_weight_once(trained_model, monkeypatch) -> None:
    weights, calls = BaseWeights(), []
    decompose = lowrank_module.base_spectrum
    monkeypatch.setattr(lowrank_module, "base_spectrum", lambda w, k: calls.append(w.shape) or decompose(w, k))
    first = parameter_drift_report(trained_model, ["student"], weights, k=4, method="lowrank")
    second = parameter_drift_report(trained_model, ["student"], weights, k=4, method="lowrank")
    assert len(calls) == len(first["per_module"]) > 0 and second == first

"""Parameter drift of one module from its top-k singular triplets, with ΔW kept as low-rank factors.

What this module owns: the low-rank path of parameter drift (`weight_drift.parameter_drift` is the exact one, with full
SVDs). A LoRA module's weight is W = W0 + ΔW with ΔW = B A, B [out, R], A [R, in], R = Σ r_i over the model's
adapters (their scales folded into B), so R is small:

- relative_delta_norm = ‖BA‖_F / ‖W0‖_F, with ‖BA‖_F² = Σ_ij (BᵀB)_ij (AAᵀ)_ij from two R×R Grams (float64):
  exact, and no [out, in] product.
- The top-k singular triplets of W0 and of W0 + BA by randomized block subspace iteration (Halko, Martinsson &
  Tropp 2011, Alg. 4.4, with a QR after every product and a final Rayleigh-Ritz step), applying W0 + BA to thin
  blocks without forming it. W0's come from a seeded Gaussian block of k + OVERSAMPLE columns and
  BASE_ITERATIONS iterations, once per run (`drift.BaseWeights` keeps them). W0 + BA starts from W0's converged
  block plus the row space of A, where its top right-singular subspace lies but for the perturbation, and needs
  only UPDATE_ITERATIONS.
- principal_angle (and _left / _right): the largest principal angle between the top-k subspaces, as in `metrics`.
- spectral_shift_top_k = ‖σ_{1..k}(W0 + ΔW) − σ_{1..k}(W0)‖₂ / ‖σ_{1..k}(W0)‖₂. Where this departs from the exact
  path: its `spectral_shift` uses every singular value, which no top-k method gives (a rank-R update moves every
  σ_i by up to ‖ΔW‖₂), so this is a different metric with its own name, and a low-rank report has no
  `spectral_shift`.

Why not torch.svd_lowrank: it draws its start from the global RNG, and drift runs between training steps
(`monitor.drift_every`), so every later draw would depend on the drift settings; the start here comes from a
private generator. Everything runs in float32 on W0's device (the GPU when there is one);
tests/measure/test_lowrank_drift.py holds the agreement with the exact path on small shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from adaptercl.measure import weight_drift

OVERSAMPLE = 16  # block columns beyond k: the error of the top-k subspace falls like (σ_{k+p+1} / σ_k)^(2·iterations)
BASE_ITERATIONS = 12  # subspace iterations for W0, from a Gaussian block (once per run)
UPDATE_ITERATIONS = 4  # for W0 + BA, from W0's block and the row space of A
SEED = 0  # the Gaussian start block of W0 (a private generator: the global RNG is never touched)

LOWRANK_KEYS = (
    "relative_delta_norm",
    "spectral_shift_top_k",
    "principal_angle",
    "principal_angle_left",
    "principal_angle_right",
)


@dataclass(frozen=True)
class TopSpectrum:
    """The top singular triplets of one weight matrix (the whole block: k + OVERSAMPLE of them) and its ‖·‖_F."""

    s: Tensor  # [c] descending
    U: Tensor  # [out, c]
    Vh: Tensor  # [c, in]
    frobenius: float  # ‖W‖_F


def delta_frobenius(B: Tensor, A: Tensor) -> float:
    """‖B A‖_F for B [out, R], A [R, in]: ‖BA‖_F² = tr(AᵀBᵀBA) = Σ_ij (BᵀB)_ij (AAᵀ)_ij, Grams in float64."""
    B64, A64 = B.double(), A.double()
    return ((B64.T @ B64) * (A64 @ A64.T)).sum().clamp_min(0.0).sqrt().item()  # [R, R] ⊙ [R, R] -> scalar


def _orth(x: Tensor) -> Tensor:
    return torch.linalg.qr(x).Q  # [n, c] orthonormal columns spanning x's


def top_triplets(
    w0: Tensor, start: Tensor, iterations: int, B: Tensor | None = None, A: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Top singular triplets (s [c], U [out, c], Vh [c, in]) of W = w0 + B A [out, in], descending, by subspace
    iteration from `start` [in, c] (right side). W is applied to thin blocks only (W z = w0 z + B (A z))."""

    def apply(z: Tensor) -> Tensor:  # W z: [in, c] -> [out, c]
        return w0 @ z if B is None else w0 @ z + B @ (A @ z)

    def apply_t(y: Tensor) -> Tensor:  # Wᵀ y: [out, c] -> [in, c]
        return w0.T @ y if B is None else w0.T @ y + A.T @ (B.T @ y)

    z = _orth(start)  # [in, c]
    for _ in range(iterations):
        z = _orth(apply_t(_orth(apply(z))))  # [in, c]
    q, r = torch.linalg.qr(apply(z))  # W z = q r: [out, c], [c, c]
    u_r, s, vh_r = torch.linalg.svd(r)  # [c, c], [c], [c, c]
    return s, q @ u_r, vh_r @ z.T  # W z zᵀ = (q u_r) diag(s) (z vh_rᵀ)ᵀ


def base_spectrum(w0: Tensor, k: int) -> TopSpectrum:
    """`TopSpectrum` of W0 [out, in] with k + OVERSAMPLE columns (at most min(out, in)) and its ‖W0‖_F."""
    c = min(k + OVERSAMPLE, *w0.shape)
    g = torch.Generator().manual_seed(SEED)
    start = torch.randn(w0.shape[1], c, generator=g).to(device=w0.device, dtype=w0.dtype)  # [in, c]
    s, U, Vh = top_triplets(w0, start, BASE_ITERATIONS)
    return TopSpectrum(s, U, Vh, torch.linalg.vector_norm(w0, dtype=torch.float64).item())  # ‖W0‖_F


def lowrank_drift(w0: Tensor, B: Tensor, A: Tensor, base: TopSpectrum, k: int) -> dict[str, float]:
    """Drift metrics of one module (LOWRANK_KEYS) from W0 [out, in], ΔW = B A (B [out, R], A [R, in]) and W0's
    `base_spectrum`, all on one device. ΔW = 0 gives exactly 0."""
    norm = delta_frobenius(B, A)
    if norm == 0.0:
        return dict.fromkeys(LOWRANK_KEYS, 0.0)
    c = min(base.Vh.shape[0] + A.shape[0], *w0.shape)
    start = torch.cat([base.Vh.T, A.T], dim=1)[:, :c]  # [in, c]: W0's block, then the row space of A
    s1, U1, Vh1 = top_triplets(w0, start, UPDATE_ITERATIONS, B, A)
    k = min(k, base.s.shape[0])
    left, right = weight_drift.subspace_angles(base.U, base.Vh, U1, Vh1, k)
    s0, s1 = base.s[:k], s1[:k]  # [k]
    return {
        "relative_delta_norm": norm / base.frobenius,
        "spectral_shift_top_k": (torch.linalg.vector_norm(s1 - s0) / torch.linalg.vector_norm(s0)).item(),
        "principal_angle": max(left, right),
        "principal_angle_left": left,
        "principal_angle_right": right,
    }

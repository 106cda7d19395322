"""Parameter drift of one weight matrix against its base weight W0 (docs/design.md §5), pure tensor functions.

- `relative_delta_norm`, `spectral_shift`, `principal_angle`, all three via `parameter_drift` (one SVD each of W0 and
  W0 + ΔW; W0's `Spectrum` can be computed once and passed in), and `aggregate_drift` over modules. W0 is
  dequantised for a 4-bit base. This is the exact path; `lowrank_drift.py` is the top-k one for large weights, and
  `drift.py` runs either on a live model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

# --------------------------------------------------------------------------------------------------------------
# Parameter drift of one module: W0 [out, in] (base) and ΔW [out, in]
# --------------------------------------------------------------------------------------------------------------

PrincipalAngleSide = Literal["left", "right", "both"]


def _as_matrix(t: Tensor, dtype: torch.dtype, device: str | torch.device) -> Tensor:
    if t.dim() != 2:
        raise ValueError(f"expected a weight matrix [out, in], got shape {list(t.shape)}")
    return t.detach().to(device=device, dtype=dtype)


def _largest_angle(q1: Tensor, q2: Tensor) -> float:
    """Largest principal angle (radians) between the spans of two orthonormal bases [m, k].

    Same algorithm as scipy.linalg.subspace_angles: arccos of the smallest cosine is inaccurate for small angles,
    so below 45° the angle is arcsin of the largest sine, ‖q2 − q1 q1ᵀ q2‖_2.
    """
    overlap = q1.T @ q2  # [k, k]
    cos_min = torch.linalg.svdvals(overlap)[-1].clamp(0.0, 1.0).item()
    if cos_min**2 >= 0.5:
        sin_max = torch.linalg.svdvals(q2 - q1 @ overlap)[0].clamp(0.0, 1.0).item()  # svdvals of [m, k]
        return math.asin(sin_max)
    return math.acos(cos_min)


def subspace_angles(U0: Tensor, Vh0: Tensor, U1: Tensor, Vh1: Tensor, k: int) -> tuple[float, float]:
    """(left, right) largest angles between top-k subspaces; U [out, m], Vh [m, in]."""
    k = min(k, U0.shape[1])
    left = _largest_angle(U0[:, :k], U1[:, :k])  # output (column) space
    right = _largest_angle(Vh0[:k].T, Vh1[:k].T)  # input (row) space
    return left, right


def relative_delta_norm(w0: Tensor, delta: Tensor) -> float:
    """‖ΔW‖_F / ‖W0‖_F, in float64 on CPU."""
    w0_, delta_ = _as_matrix(w0, torch.float64, "cpu"), _as_matrix(delta, torch.float64, "cpu")
    if not delta_.any():
        return 0.0
    return (torch.linalg.matrix_norm(delta_) / torch.linalg.matrix_norm(w0_)).item()


def spectral_shift(w0: Tensor, delta: Tensor) -> float:
    """Normalised spectral shift ‖σ(W0 + ΔW) − σ(W0)‖_2 / ‖σ(W0)‖_2 (singular values sorted), float64 on CPU."""
    w0_, delta_ = _as_matrix(w0, torch.float64, "cpu"), _as_matrix(delta, torch.float64, "cpu")
    if not delta_.any():
        return 0.0
    s0 = torch.linalg.svdvals(w0_)  # [m]
    s1 = torch.linalg.svdvals(w0_ + delta_)  # [m]
    return (torch.linalg.vector_norm(s1 - s0) / torch.linalg.vector_norm(s0)).item()


def principal_angle(w0: Tensor, delta: Tensor, k: int = 8, side: PrincipalAngleSide = "both") -> float:
    """Largest principal angle (radians, in [0, π/2]) between the top-k singular subspaces of W0 and W0 + ΔW.

    side="left": left singular vectors (the output space, columns of W [out, in]); "right": right singular vectors
    (the input space); "both" (default): the larger of the two. k is clamped to min(out, in). The top-k subspace is
    ill-defined when σ_k = σ_{k+1}; with real weights that does not happen. float64 on CPU.
    """
    w0_, delta_ = _as_matrix(w0, torch.float64, "cpu"), _as_matrix(delta, torch.float64, "cpu")
    if not delta_.any():
        return 0.0
    U0, _, Vh0 = torch.linalg.svd(w0_, full_matrices=False)  # [out, m], [m], [m, in]
    U1, _, Vh1 = torch.linalg.svd(w0_ + delta_, full_matrices=False)
    left, right = subspace_angles(U0, Vh0, U1, Vh1, k)
    return {"left": left, "right": right, "both": max(left, right)}[side]


@dataclass(frozen=True)
class Spectrum:
    """Every singular value and the top-k singular vectors of one weight matrix: what drift needs of an SVD."""

    s: Tensor  # [m] descending, m = min(out, in)
    U: Tensor  # [out, k] left singular vectors
    Vh: Tensor  # [k, in] right singular vectors


def spectrum(w: Tensor, k: int) -> Spectrum:
    """SVD of w [out, in] keeping all singular values and the top-k vectors. A wide matrix is decomposed as its
    transpose (w = Vh_tᵀ S U_tᵀ), which LAPACK does about twice as fast on CPU. The top-k vectors are copies: a
    slice would keep the whole [out, m] U alive, and `drift.BaseWeights` keeps a spectrum of every adapted W0 for the
    run (on the GPU, ~25 GiB at the 7B shape)."""
    if w.shape[0] < w.shape[1]:
        U_t, s, Vh_t = torch.linalg.svd(w.T, full_matrices=False)  # [in, m], [m], [m, out]
        return Spectrum(s, Vh_t[:k].T.clone(), U_t[:, :k].T.clone())
    U, s, Vh = torch.linalg.svd(w, full_matrices=False)  # [out, m], [m], [m, in]
    return Spectrum(s, U[:, :k].clone(), Vh[:k].clone())


def parameter_drift(
    w0: Tensor,
    delta: Tensor,
    k: int = 8,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    base: Spectrum | None = None,
) -> dict[str, float]:
    """All drift metrics of one module from one SVD of W0 and one of W0 + ΔW.

    Returns relative_delta_norm, spectral_shift, principal_angle (max of both sides), principal_angle_left and
    principal_angle_right (see the single-metric functions). Computed in float64 on CPU by default; pass
    dtype=torch.float32 / device="cuda" to trade accuracy for speed on large models. ΔW = 0 gives exactly 0.
    `base` is `spectrum(W0, ≥ k)` in the same dtype and device, when the caller keeps it between calls (W0 does
    not change during a run, so only W0 + ΔW needs a new SVD).
    """
    w0_, delta_ = _as_matrix(w0, dtype, device), _as_matrix(delta, dtype, device)
    if not delta_.any():
        angles = ("principal_angle", "principal_angle_left", "principal_angle_right")
        return dict.fromkeys(("relative_delta_norm", "spectral_shift", *angles), 0.0)
    before = spectrum(w0_, k) if base is None else base
    after = spectrum(w0_ + delta_, k)
    left, right = subspace_angles(before.U, before.Vh, after.U, after.Vh, k)
    return {
        "relative_delta_norm": (torch.linalg.matrix_norm(delta_) / torch.linalg.matrix_norm(w0_)).item(),
        "spectral_shift": (torch.linalg.vector_norm(after.s - before.s) / torch.linalg.vector_norm(before.s)).item(),
        "principal_angle": max(left, right),
        "principal_angle_left": left,
        "principal_angle_right": right,
    }


def aggregate_drift(
    per_module: dict[str, dict[str, float]], weights: dict[str, int] | None = None
) -> dict[str, float]:
    """Mean and max of each drift metric over modules: {"<metric>_mean": ..., "<metric>_max": ...}.

    `weights` (e.g. parameter counts per module) makes the mean a weighted mean; every module needs a weight.
    Empty input gives {}.
    """
    if not per_module:
        return {}
    names = list(per_module)
    if weights is not None and (missing := [n for n in names if n not in weights]):
        raise ValueError(f"no weight for modules {missing}")
    w = [float(weights[n]) if weights is not None else 1.0 for n in names]
    metrics = list(dict.fromkeys(m for n in names for m in per_module[n]))
    out: dict[str, float] = {}
    for metric in metrics:
        pairs = [(per_module[n][metric], wi) for n, wi in zip(names, w) if metric in per_module[n]]
        out[f"{metric}_mean"] = sum(v * wi for v, wi in pairs) / sum(wi for _, wi in pairs)
        out[f"{metric}_max"] = max(v for v, _ in pairs)
    return out

"""How a self-teacher mixes what it is made of, as pure tensor functions (the teacher kinds are `kinds.py`):

- `ema_lora_factors`: the `ema` teacher's update, the EMA of the effective delta ΔW = scale·B·A (never of A and B
  separately), kept as rank-r_T factors re-factorised exactly in factored form (docs/design.md §3).
- `trust_region_teacher_logits`: the `trust_region` teacher, z_T = (1-c)·z_ref + c·z_student (lasgroup/SDPO
  `actor.yaml`), on logits or, the LM head being linear, on final hidden states.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ema_lora_factors(
    teacher_A: Tensor,
    teacher_B: Tensor,
    student_A: Tensor,
    student_B: Tensor,
    student_scaling: float,
    tau: float,
    rank: int,
) -> tuple[Tensor, Tensor, float, float]:
    """Best rank-`rank` factors (A [rank, in], B [out, rank], scaling 1) of M = (1-τ)·B_T A_T + τ·s·B_S A_S.

    Works on the factors only: with Bc = [B_T, B_S] [out, k] and Ac = [(1-τ)A_T; τ·s·A_S] [k, in] (k = r_T + r),
    Bc = Q_b R_b and Acᵀ = Q_a R_a, the sum is Q_b (R_b R_aᵀ) Q_aᵀ; the SVD U S Vᵀ of the small core gives
    B = Q_b U_r √S_r and A = √S_r V_rᵀ Q_aᵀ (the Eckart–Young optimum, as `adapters.merge_math.refactorize` on the
    dense matrix). Computed in float64. Also returns the Frobenius norms of the dropped part, sqrt(Σ_{i>rank} S_i²),
    and of M.
    """
    dtype = torch.float64
    b_cat = torch.cat([teacher_B.to(dtype), student_B.to(dtype)], dim=1)  # [out, k]
    a_cat = torch.cat([(1.0 - tau) * teacher_A.to(dtype), (tau * student_scaling) * student_A.to(dtype)])  # [k, in]
    q_b, r_b = torch.linalg.qr(b_cat)  # [out, m_b], [m_b, k]
    q_a, r_a = torch.linalg.qr(a_cat.T)  # [in, m_a], [m_a, k]
    u, s, vh = torch.linalg.svd(r_b @ r_a.T, full_matrices=False)  # core [m_b, m_a]
    kept = min(rank, s.numel())
    sqrt_s = s[:kept].sqrt()  # [kept]
    B = torch.zeros(b_cat.shape[0], rank, dtype=dtype, device=b_cat.device)  # [out, rank]
    A = torch.zeros(rank, a_cat.shape[1], dtype=dtype, device=a_cat.device)  # [rank, in]
    B[:, :kept] = (q_b @ u[:, :kept]) * sqrt_s  # [out, kept]
    A[:kept] = sqrt_s[:, None] * (q_a @ vh[:kept].T).T  # [kept, in]
    return A, B, s[kept:].square().sum().sqrt().item(), s.square().sum().sqrt().item()


def trust_region_teacher_logits(ref_logits: Tensor, student_logits: Tensor, coef: float) -> Tensor:
    """Trust-region teacher z_T = (1-c)·z_ref + c·z_student (student detached), both on the teacher prompt."""
    if not 0.0 <= coef <= 1.0:
        raise ValueError(f"coef must be in [0, 1], got {coef}")
    return (1.0 - coef) * ref_logits.detach() + coef * student_logits.detach()  # [N, T, V]

"""ΔW-space merges of LoRA adapters, and SVD re-factorisation of a merged ΔW back to rank-r LoRA factors.

What this module owns: pure tensor functions. They take the *effective* weight deltas ΔW = scaling · B · A of
several adapters (per module, or a dict of modules) and return merged deltas or LoRA factors. They never touch
models, files or configs: `live.py` extracts ΔW from a PEFT model and writes the result back.

Why ΔW and not A and B: PEFT's `add_weighted_adapter` with `linear` / `ties` / `dare_*` combines the A matrices
and the B matrices separately, and (Σ w_i B_i)(Σ w_i A_i) ≠ Σ w_i B_i A_i (docs/design.md §6). Every merge here
works on ΔW [out, in]; `refactorize` then returns the best rank-r factors (truncated SVD, Eckart–Young).

Usage:

    deltas = [lora_delta(A_i, B_i, alpha_i / r_i) for ...]                  # [out, in] each, any ranks
    merged = merge_deltas(deltas, weights=[0.5, 0.5], method="ties", density=0.2)
    A, B, rel_err = refactorize(merged, rank=16)                            # write with lora_alpha = 16

Methods (`MERGE_METHODS`):
- `task_arithmetic` (Ilharco et al. 2023): Σ_i w_i ΔW_i. `density` is ignored.
- `ties` (Yadav et al. 2023): trim each ΔW_i to its top-`density` fraction of entries by magnitude, weight them,
  elect a sign per entry = sign(Σ_i w_i · trim(ΔW_i)), and take the mean of the weighted entries that agree with
  the elected sign (the "disjoint mean").
- `dare_linear` (Yu et al. 2024): drop each entry of each ΔW_i with probability 1 − density, rescale survivors by
  1 / density (unbiased), then weighted sum.
- `dare_ties`: DARE drop-and-rescale, then TIES sign election and disjoint mean.

Departures from PEFT's `utils/merge_utils.py` (whose `magnitude_based_pruning` and `disjoint_merge` are reused):
- The sign is elected on the *weighted* trimmed deltas, so a negative weight negates a task exactly as in task
  arithmetic. PEFT elects on the unweighted deltas.
- An entry whose weighted sum is exactly 0 elects no sign and merges to 0 (PEFT breaks that tie towards +). So
  twins merged with weights [1, −1] cancel under `task_arithmetic` and `ties`.
- DARE masks come from an explicit `torch.Generator` and are drawn on the CPU, so a seed gives the same masks on
  any device. PEFT uses the global RNG.
- TIES/DARE weights multiply the deltas before the disjoint mean (as in PEFT). For the paper's λ · mean, pass
  weights of 1 and scale the result by λ.
- `density >= 1` means no trimming and no dropping (no warning).

Precision: merges and SVD run in float32 (float64 if an input is float64) and return that dtype; cast when writing
the adapter.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Literal

import torch
from peft.utils.merge_utils import disjoint_merge, magnitude_based_pruning
from torch import Tensor

MergeMethod = Literal["task_arithmetic", "ties", "dare_linear", "dare_ties"]


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (bf16/fp16 deltas are upcast for the arithmetic)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_deltas(deltas: list[Tensor], weights: list[float]) -> None:
    if not deltas:
        raise ValueError("need at least one delta to merge")
    if len(weights) != len(deltas):
        raise ValueError(f"got {len(deltas)} deltas but {len(weights)} weights; give one weight per delta")
    shapes = {tuple(d.shape) for d in deltas}
    if len(shapes) != 1:
        raise ValueError(f"all deltas of one module must have the same shape, got {sorted(shapes)}")


def _weighted_stack(deltas: list[Tensor], weights: list[float]) -> Tensor:
    """Stack deltas and multiply each by its weight."""
    dtype = _compute_dtype(*deltas)
    stacked = torch.stack([d.to(dtype) for d in deltas], dim=0)  # [n, out, in]
    w = torch.tensor(weights, dtype=dtype, device=stacked.device)  # [n]
    return stacked * w.view(-1, *([1] * (stacked.dim() - 1)))  # [n, out, in]


def _elected_sign_mask(weighted: Tensor) -> Tensor:
    """Entries whose sign agrees with sign(Σ_i weighted_i); an exactly-zero sum elects nothing."""
    elected = weighted.sum(dim=0).sign()  # [out, in], in {-1, 0, +1}
    return (weighted.sign() == elected) & (elected != 0)  # [n, out, in] bool


def lora_delta(lora_A: Tensor, lora_B: Tensor, scaling: float) -> Tensor:
    """Effective weight delta of one LoRA module: ΔW = scaling · B @ A.

    lora_A: [r, in]; lora_B: [out, r]; scaling: lora_alpha / r (or lora_alpha / sqrt(r) with rsLoRA).
    Returns ΔW [out, in] in float32 (float64 if an input is float64).
    """
    if lora_A.dim() != 2 or lora_B.dim() != 2 or lora_A.shape[0] != lora_B.shape[1]:
        raise ValueError(f"expected A [r, in] and B [out, r], got A {list(lora_A.shape)} and B {list(lora_B.shape)}")
    dtype = _compute_dtype(lora_A, lora_B)
    return scaling * (lora_B.to(dtype) @ lora_A.to(dtype))  # [out, in]


def merge_task_arithmetic(deltas: list[Tensor], weights: list[float]) -> Tensor:
    """Σ_i w_i ΔW_i. deltas: n × [out, in] -> [out, in]."""
    _check_deltas(deltas, weights)
    return _weighted_stack(deltas, weights).sum(dim=0)  # [out, in]


def merge_ties(deltas: list[Tensor], weights: list[float], density: float) -> Tensor:
    """TIES: trim to top-`density` magnitudes, elect sign on the weighted sum, disjoint mean of agreeing entries.

    Trimming keeps int(density · numel) entries per delta (PEFT's `magnitude_based_pruning`). deltas: n × [out, in].
    """
    _check_deltas(deltas, weights)
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"TIES density must be in [0, 1], got {density}")
    dtype = _compute_dtype(*deltas)
    trimmed = [d.to(dtype) if density >= 1.0 else magnitude_based_pruning(d.to(dtype), density) for d in deltas]
    weighted = _weighted_stack(trimmed, weights)  # [n, out, in]
    return disjoint_merge(weighted, _elected_sign_mask(weighted))  # [out, in]


def merge_dare(
    deltas: list[Tensor],
    weights: list[float],
    density: float,
    generator: torch.Generator,
    use_ties_sign: bool = False,
) -> Tensor:
    """DARE: keep each entry with probability `density` and rescale by 1 / density, then merge.

    With `use_ties_sign=False` (dare_linear) the rescaled deltas are summed with their weights; with True
    (dare_ties) they go through the TIES sign election and disjoint mean. Masks are drawn in delta order as
    `torch.rand(shape, generator=generator) < density` on the generator's device (use a CPU generator),
    then moved to the delta's device. deltas: n × [out, in] -> [out, in].
    """
    _check_deltas(deltas, weights)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"DARE density must be in (0, 1] (survivors are rescaled by 1 / density), got {density}")
    dtype = _compute_dtype(*deltas)
    dropped = []
    for d in deltas:
        if density >= 1.0:
            dropped.append(d.to(dtype))
            continue
        keep = torch.rand(d.shape, generator=generator, device=generator.device) < density  # [out, in] bool
        dropped.append(d.to(dtype) * keep.to(d.device) / density)
    weighted = _weighted_stack(dropped, weights)  # [n, out, in]
    if not use_ties_sign:
        return weighted.sum(dim=0)
    return disjoint_merge(weighted, _elected_sign_mask(weighted))  # [out, in]


MergeFn = Callable[[list[Tensor], list[float], float, torch.Generator], Tensor]

MERGE_METHODS: dict[MergeMethod, MergeFn] = {
    "task_arithmetic": lambda deltas, weights, density, generator: merge_task_arithmetic(deltas, weights),
    "ties": lambda deltas, weights, density, generator: merge_ties(deltas, weights, density),
    "dare_linear": lambda deltas, weights, density, generator: merge_dare(deltas, weights, density, generator),
    "dare_ties": lambda deltas, weights, density, generator: merge_dare(
        deltas, weights, density, generator, use_ties_sign=True
    ),
}


def merge_deltas(
    deltas: list[Tensor], weights: list[float], method: MergeMethod, density: float = 1.0, seed: int = 0
) -> Tensor:
    """Merge the deltas of one module with `method` (see `MERGE_METHODS`). deltas: n × [out, in] -> [out, in].

    `seed` seeds a fresh CPU generator for the DARE masks, so the same call gives the same result.
    """
    if method not in MERGE_METHODS:
        raise ValueError(f"unknown merge method {method!r}; choose one of {sorted(MERGE_METHODS)}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return MERGE_METHODS[method](deltas, weights, density, generator)


def _module_seed(seed: int, module_name: str) -> int:
    """Per-module seed: DARE masks of a module do not depend on which other modules are present."""
    return (seed * 0x9E3779B1 + zlib.crc32(module_name.encode("utf-8"))) % (2**63)


def merge_module_deltas(
    per_adapter: list[dict[str, Tensor]],
    weights: list[float],
    method: MergeMethod,
    density: float = 1.0,
    seed: int = 0,
) -> dict[str, Tensor]:
    """Merge several adapters given as {module name: ΔW [out, in]}; returns {module name: merged ΔW}.

    Modules are the union over adapters (in first-seen order); an adapter that lacks a module contributes zeros
    of that module's shape (it has no opinion there: zero is trimmed away by TIES and adds nothing elsewhere).
    DARE masks use a per-module seed derived from `seed` and the module name.
    """
    if len(weights) != len(per_adapter):
        raise ValueError(f"got {len(per_adapter)} adapters but {len(weights)} weights; give one weight per adapter")
    names: dict[str, None] = {}
    for adapter in per_adapter:
        names.update(dict.fromkeys(adapter))
    merged: dict[str, Tensor] = {}
    for name in names:
        present = [adapter[name] for adapter in per_adapter if name in adapter]
        shapes = {tuple(t.shape) for t in present}
        if len(shapes) != 1:
            raise ValueError(f"module {name!r} has different ΔW shapes across adapters: {sorted(shapes)}")
        template = present[0]
        deltas = [adapter[name] if name in adapter else torch.zeros_like(template) for adapter in per_adapter]
        merged[name] = merge_deltas(deltas, weights, method, density, seed=_module_seed(seed, name))
    return merged


def refactorize(delta: Tensor, rank: int) -> tuple[Tensor, Tensor, float]:
    """Best rank-`rank` LoRA factors of ΔW by truncated SVD: returns (A [rank, in], B [out, rank], relative error).

    ΔW = U diag(σ) Vᵀ; B = U_r diag(√σ_r), A = diag(√σ_r) V_rᵀ, so B @ A is the best rank-r approximation and both
    factors have the same scale (better conditioned for further training than putting σ in one of them).
    The factors carry no scaling: B @ A ≈ ΔW, so the caller must write the adapter with lora_alpha = rank
    (and use_rslora = False) so that PEFT's scaling alpha / r is 1.
    relative error = ‖ΔW − B A‖_F / ‖ΔW‖_F = sqrt(Σ_{i>r} σ_i²) / sqrt(Σ_i σ_i²) (0 for ΔW = 0).
    If rank exceeds min(out, in) the extra rows of A and columns of B are zero (exact).
    """
    if delta.dim() != 2:
        raise ValueError(f"expected ΔW [out, in], got shape {list(delta.shape)}")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    dtype = _compute_dtype(delta)
    out_features, in_features = delta.shape
    U, S, Vh = torch.linalg.svd(delta.to(dtype), full_matrices=False)  # [out, m], [m], [m, in]
    kept = min(rank, S.numel())
    sqrt_s = S[:kept].sqrt()  # [kept]
    B = torch.zeros(out_features, rank, dtype=dtype, device=delta.device)  # [out, rank]
    A = torch.zeros(rank, in_features, dtype=dtype, device=delta.device)  # [rank, in]
    B[:, :kept] = U[:, :kept] * sqrt_s  # [out, kept]
    A[:kept] = sqrt_s[:, None] * Vh[:kept]  # [kept, in]
    total = S.square().sum()
    rel_err = (S[kept:].square().sum() / total).sqrt().item() if total > 0 else 0.0
    return A, B, rel_err

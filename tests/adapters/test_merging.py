"""Tests for adaptercl.adapters.merge_math: ΔW-space merges and SVD re-factorisation."""

from typing import get_args

import pytest
import torch
from peft.utils.merge_utils import ties as peft_ties

from adaptercl.adapters.merge_math import (
    MERGE_METHODS,
    MergeMethod,
    lora_delta,
    merge_dare,
    merge_deltas,
    merge_module_deltas,
    merge_task_arithmetic,
    merge_ties,
    refactorize,
)

D1 = torch.tensor([[3.0, -1.0, 0.5], [-2.0, 4.0, 1.0]])  # [2, 3]
D2 = torch.tensor([[-5.0, 2.0, -0.2], [-3.0, -0.5, 6.0]])  # [2, 3]


def random_lora(out_features: int, in_features: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, in_features, generator=g), torch.randn(out_features, rank, generator=g)


def test_lora_delta_is_scaled_product() -> None:
    A, B = random_lora(5, 4, 2, seed=0)
    torch.testing.assert_close(lora_delta(A, B, 0.5), 0.5 * B @ A)
    assert lora_delta(A.bfloat16(), B.bfloat16(), 1.0).dtype == torch.float32
    with pytest.raises(ValueError, match="expected A"):
        lora_delta(B, A, 1.0)


def test_merge_methods_table_matches_literal() -> None:
    assert set(MERGE_METHODS) == set(get_args(MergeMethod))
    with pytest.raises(ValueError, match="unknown merge method"):
        merge_deltas([D1], [1.0], "linear")  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
@pytest.mark.parametrize("density", [1.0, 0.5, 0.2])
def test_twins_with_opposite_weights_cancel(method: MergeMethod, density: float) -> None:
    delta = lora_delta(*random_lora(6, 5, 3, seed=1), scaling=2.0)
    merged = merge_deltas([delta, delta.clone()], [1.0, -1.0], method, density=density)
    assert torch.equal(merged, torch.zeros_like(delta))


@pytest.mark.parametrize("method", list(get_args(MergeMethod)))
def test_single_weight_one_merge_is_identity(method: MergeMethod) -> None:
    delta = lora_delta(*random_lora(6, 5, 3, seed=2), scaling=1.0)
    torch.testing.assert_close(merge_deltas([delta], [1.0], method, density=1.0), delta)


def test_task_arithmetic_is_sum_of_weighted_products_across_ranks() -> None:
    (A1, B1), (A2, B2) = random_lora(7, 5, 2, seed=3), random_lora(7, 5, 4, seed=4)  # ranks 2 and 4
    d1, d2 = lora_delta(A1, B1, 16 / 2), lora_delta(A2, B2, 8 / 4)
    expected = 0.3 * (16 / 2) * B1 @ A1 - 1.5 * (8 / 4) * B2 @ A2
    torch.testing.assert_close(merge_task_arithmetic([d1, d2], [0.3, -1.5]), expected)
    torch.testing.assert_close(merge_deltas([d1, d2], [0.3, -1.5], "task_arithmetic"), expected)


def test_ties_matches_hand_computation() -> None:
    # density 0.5 keeps int(0.5 * 6) = 3 entries of each delta:
    #   trim(D1) = [[3, 0, 0], [-2, 4, 0]],   trim(D2) = [[-5, 0, 0], [-3, 0, 6]]
    # weights [1, 2]: weighted D2 = [[-10, 0, 0], [-6, 0, 12]]; sum = [[-7, 0, 0], [-8, 4, 12]]
    # elected signs [[-, none, none], [-, +, +]]; (0,0): only -10 agrees (3 is dropped); (1,0): mean(-2, -6) = -4
    expected = torch.tensor([[-10.0, 0.0, 0.0], [-4.0, 4.0, 12.0]])
    torch.testing.assert_close(merge_ties([D1, D2], [1.0, 2.0], density=0.5), expected)
    torch.testing.assert_close(merge_deltas([D1, D2], [1.0, 2.0], "ties", density=0.5), expected)


def test_ties_full_density_is_disjoint_mean() -> None:
    # no trimming: sum of weighted = [[-2, 1, 0.3], [-5, 3.5, 7]]
    expected = torch.tensor([[-5.0, 2.0, 0.5], [-2.5, 4.0, 3.5]])
    torch.testing.assert_close(merge_ties([D1, D2], [1.0, 1.0], density=1.0), expected)


def test_ties_equals_peft_when_weights_are_equal() -> None:
    # with equal positive weights, electing on weighted or unweighted deltas is the same, and ties never hit 0
    g = torch.Generator().manual_seed(5)
    deltas = [torch.randn(8, 6, generator=g) for _ in range(3)]
    ours = merge_ties(deltas, [0.7, 0.7, 0.7], density=0.4)
    theirs = peft_ties(deltas, torch.tensor([0.7, 0.7, 0.7]), density=0.4)
    torch.testing.assert_close(ours, theirs)


def _dare_masks(seed: int, n: int, shape: tuple[int, ...], density: float) -> list[torch.Tensor]:
    """The documented mask recipe: torch.rand(shape, generator) < density, drawn in delta order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=g) < density for _ in range(n)]


def test_dare_linear_matches_hand_computation() -> None:
    m1, m2 = _dare_masks(seed=11, n=2, shape=(2, 3), density=0.5)
    assert 0 < int(m1.sum()) < 6 and not torch.equal(m1, m2)  # the seed gives a non-trivial case
    expected = 1.0 * D1 * m1 / 0.5 + 2.0 * D2 * m2 / 0.5
    merged = merge_dare([D1, D2], [1.0, 2.0], 0.5, torch.Generator().manual_seed(11))
    torch.testing.assert_close(merged, expected)
    torch.testing.assert_close(merge_deltas([D1, D2], [1.0, 2.0], "dare_linear", density=0.5, seed=11), expected)


def test_dare_ties_matches_hand_computation() -> None:
    m1, m2 = _dare_masks(seed=11, n=2, shape=(2, 3), density=0.5)
    w1, w2 = 1.0 * D1 * m1 / 0.5, 2.0 * D2 * m2 / 0.5  # weighted, rescaled survivors
    expected = torch.zeros(2, 3)
    for i in range(2):
        for j in range(3):
            total = w1[i, j] + w2[i, j]
            agreeing = [v for v in (w1[i, j], w2[i, j]) if total != 0 and torch.sign(v) == torch.sign(total)]
            expected[i, j] = sum(agreeing) / len(agreeing) if agreeing else 0.0
    merged = merge_dare([D1, D2], [1.0, 2.0], 0.5, torch.Generator().manual_seed(11), use_ties_sign=True)
    torch.testing.assert_close(merged, expected)
    torch.testing.assert_close(merge_deltas([D1, D2], [1.0, 2.0], "dare_ties", density=0.5, seed=11), expected)


def test_dare_is_seeded_and_unbiased() -> None:
    delta = lora_delta(*random_lora(6, 5, 2, seed=6), scaling=1.0)
    first = merge_deltas([delta], [1.0], "dare_linear", density=0.3, seed=1)
    assert torch.equal(first, merge_deltas([delta], [1.0], "dare_linear", density=0.3, seed=1))
    assert not torch.equal(first, merge_deltas([delta], [1.0], "dare_linear", density=0.3, seed=2))
    mean = torch.stack([merge_deltas([delta], [1.0], "dare_linear", density=0.3, seed=s) for s in range(4000)]).mean(0)
    torch.testing.assert_close(mean, delta, atol=0.15 * delta.abs().max().item(), rtol=0.0)


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="one weight per delta"):
        merge_task_arithmetic([D1, D2], [1.0])
    with pytest.raises(ValueError, match="same shape"):
        merge_task_arithmetic([D1, D1.T], [1.0, 1.0])
    with pytest.raises(ValueError, match="at least one"):
        merge_task_arithmetic([], [])
    with pytest.raises(ValueError, match="density"):
        merge_dare([D1], [1.0], 0.0, torch.Generator())
    with pytest.raises(ValueError, match="density"):
        merge_ties([D1], [1.0], 1.5)


def test_merge_upcasts_low_precision() -> None:
    merged = merge_task_arithmetic([D1.bfloat16(), D2.bfloat16()], [1.0, 1.0])
    assert merged.dtype == torch.float32
    assert merge_task_arithmetic([D1.double()], [1.0]).dtype == torch.float64


def test_refactorize_full_rank_is_exact() -> None:
    delta = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))  # rank 4
    A, B, rel_err = refactorize(delta, rank=4)
    assert A.shape == (4, 4) and B.shape == (6, 4)
    torch.testing.assert_close(B @ A, delta, atol=1e-5, rtol=1e-5)
    assert rel_err < 1e-6


def test_refactorize_low_rank_error_is_discarded_spectrum() -> None:
    delta = torch.randn(8, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    sigma = torch.linalg.svdvals(delta)
    A, B, rel_err = refactorize(delta, rank=2)
    assert A.shape == (2, 5) and B.shape == (8, 2)
    expected = (sigma[2:].square().sum().sqrt() / torch.linalg.matrix_norm(delta)).item()
    assert rel_err == pytest.approx(expected, rel=1e-10)
    residual = (torch.linalg.matrix_norm(delta - B @ A) / torch.linalg.matrix_norm(delta)).item()
    assert residual == pytest.approx(expected, rel=1e-10)
    # the singular values are split evenly: column norms of B equal row norms of A equal sqrt(sigma)
    torch.testing.assert_close(B.norm(dim=0), sigma[:2].sqrt())
    torch.testing.assert_close(A.norm(dim=1), sigma[:2].sqrt())


def test_refactorize_recovers_low_rank_delta_and_round_trips_through_lora_alpha() -> None:
    A0, B0 = random_lora(9, 7, 3, seed=9)
    delta = lora_delta(A0, B0, scaling=2.0)  # rank 3
    A, B, rel_err = refactorize(delta, rank=3)
    assert rel_err < 1e-6
    # written with lora_alpha = rank, PEFT's scaling alpha / r is 1
    torch.testing.assert_close(lora_delta(A, B, scaling=3 / 3), delta, atol=1e-4, rtol=1e-4)


def test_refactorize_pads_when_rank_exceeds_dimensions_and_handles_zero() -> None:
    delta = torch.randn(3, 5, generator=torch.Generator().manual_seed(10))
    A, B, rel_err = refactorize(delta, rank=8)
    assert A.shape == (8, 5) and B.shape == (3, 8)
    assert torch.equal(A[3:], torch.zeros(5, 5)) and torch.equal(B[:, 3:], torch.zeros(3, 5))
    torch.testing.assert_close(B @ A, delta, atol=1e-5, rtol=1e-5)
    assert rel_err == pytest.approx(0.0, abs=1e-6)
    _, _, zero_err = refactorize(torch.zeros(4, 4), rank=2)
    assert zero_err == 0.0


def test_merge_module_deltas_union_and_missing_module() -> None:
    q = lora_delta(*random_lora(6, 5, 2, seed=11), scaling=1.0)
    v1 = lora_delta(*random_lora(4, 5, 4, seed=12), scaling=1.0)  # adapter 1 has a higher rank on v
    v2 = lora_delta(*random_lora(4, 5, 1, seed=13), scaling=1.0)
    o = lora_delta(*random_lora(5, 5, 2, seed=14), scaling=1.0)
    adapters = [{"q": q, "v": v1}, {"v": v2, "o": o}]
    merged = merge_module_deltas(adapters, [0.5, 2.0], "task_arithmetic")
    assert list(merged) == ["q", "v", "o"]
    torch.testing.assert_close(merged["q"], 0.5 * q)
    torch.testing.assert_close(merged["v"], 0.5 * v1 + 2.0 * v2)
    torch.testing.assert_close(merged["o"], 2.0 * o)
    # under TIES a missing module (zeros) casts no vote, so the present adapter's trimmed delta survives as is
    ties = merge_module_deltas(adapters, [1.0, 1.0], "ties", density=1.0)
    torch.testing.assert_close(ties["q"], q)


def test_merge_module_deltas_dare_masks_do_not_depend_on_other_modules() -> None:
    q, v = torch.randn(6, 5), torch.randn(4, 5)
    both = merge_module_deltas([{"q": q, "v": v}], [1.0], "dare_linear", density=0.5, seed=3)
    alone = merge_module_deltas([{"q": q}], [1.0], "dare_linear", density=0.5, seed=3)
    assert torch.equal(both["q"], alone["q"])
    assert not torch.equal(both["q"], merge_module_deltas([{"q": q}], [1.0], "dare_linear", 0.5, seed=4)["q"])


def test_merge_module_deltas_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="different ΔW shapes"):
        merge_module_deltas([{"q": torch.zeros(2, 3)}, {"q": torch.zeros(3, 2)}], [1.0, 1.0], "task_arithmetic")
    with pytest.raises(ValueError, match="one weight per adapter"):
        merge_module_deltas([{"q": torch.zeros(2, 3)}], [1.0, 1.0], "task_arithmetic")

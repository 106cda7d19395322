"""Statistics of the run's diagnostics, as pure functions of numbers (no model, file or config).

- `paired_bootstrap_interval`: the percentile bootstrap interval of the mean of paired differences (Efron &
  Tibshirani 1993, ch. 13), resampling the pairs with replacement; the teacher lift's 95 % interval
  (`run.diagnostics.teacher_lift`: one pair per prompt, teacher accuracy minus student accuracy).
- `linear_fit`: the least-squares line y = intercept + slope·x and its R², e.g. the forgetting each stage caused
  (`metrics.stage_forgetting`) against its forward KL from the previous stage's policy (drift.json `stage_kl`),
  over methods and seeds: RL's Razor (Shenfeld et al. 2025) reports R² ≈ 0.7 on LLMs.
- `wilson_interval`: the Wilson score interval of a proportion (Wilson 1927), e.g. one accuracy over n eval examples.
- `t_interval`: the Student-t interval of a mean over a few independent values (e.g. one figure per seed).
- `sign_test_p`: the exact one-sided sign (binomial) test on the discordant pairs of paired binary outcomes (the
  lift gate's rule, `train/lift_gate.py`): exact at any n, where a percentile bootstrap over fewer than ~20 pairs in
  {−1, 0, 1} opens far more often than its level (docs/design.md §5a).

Results are JSON-ready Python floats; None where a statistic is undefined.
"""

from __future__ import annotations

import math

import torch

# Two-sided 95 % quantiles t_{0.975, df} of Student's t for df = 1..30 (beyond: the normal 1.96 is within 2 %)
T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]
Z975 = 1.959964


def paired_bootstrap_interval(
    differences: list[float], confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float] | None:
    """Percentile bootstrap interval for the mean of `differences` (d_i = x_i − y_i of n pairs), or None for n = 0.

    Each of `resamples` draws picks n pairs with replacement and takes their mean; the interval is the
    (1 − confidence)/2 and (1 + confidence)/2 quantiles of those means (linear interpolation, as torch.quantile).
    Seeded by `seed` (its own generator: the global RNG is untouched). The paired form keeps each prompt's two
    accuracies together, so the prompt-to-prompt spread they share cancels.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = len(differences)
    if n == 0:
        return None
    d = torch.tensor(differences, dtype=torch.float64)  # [n]
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(n, (resamples, n), generator=generator)  # [B, n]
    means = d[picks].mean(dim=1)  # [B]
    tail = (1.0 - confidence) / 2.0
    lo, hi = torch.quantile(means, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return lo, hi


def linear_fit(x: list[float], y: list[float]) -> dict[str, float | None]:
    """Least-squares line through the points (x_i, y_i): slope = Σ(x−x̄)(y−ȳ) / Σ(x−x̄)², intercept = ȳ − slope·x̄,
    and R² = 1 − SS_res / SS_tot (SS_tot = Σ(y−ȳ)²; None when y is constant). Float64. Needs at least two points
    and x not constant (else a ValueError saying so)."""
    if len(x) != len(y):
        raise ValueError(f"linear_fit: {len(x)} x values but {len(y)} y values")
    if len(x) < 2:
        raise ValueError(f"linear_fit needs at least 2 points, got {len(x)}")
    xs, ys = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)  # [n], [n]
    dx, dy = xs - xs.mean(), ys - ys.mean()  # [n]
    sxx = (dx * dx).sum().item()
    if sxx == 0.0:
        raise ValueError("linear_fit: every x is the same, so no line is determined")
    slope = (dx * dy).sum().item() / sxx
    intercept = ys.mean().item() - slope * xs.mean().item()
    ss_res = (ys - intercept - slope * xs).square().sum().item()
    ss_tot = (dy * dy).sum().item()
    r2 = None if ss_tot == 0.0 else 1.0 - ss_res / ss_tot
    return {"n": len(x), "slope": slope, "intercept": intercept, "r2": r2}


def wilson_interval(successes: int, n: int, z: float = Z975) -> tuple[float, float] | None:
    """Wilson score interval of a proportion k/n (95 % at the default z), or None for n = 0:
    (p̂ + z²/2n ± z·sqrt(p̂(1−p̂)/n + z²/4n²)) / (1 + z²/n). Unlike p̂ ± z·sqrt(p̂(1−p̂)/n) it stays inside [0, 1]
    and is not empty at k = 0 or k = n."""
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: {successes} successes of {n} trials")
    if n == 0:
        return None
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def t_interval(values: list[float]) -> tuple[float, float] | None:
    """95 % Student-t interval of the mean of independent values: mean ± t_{0.975, n−1} · s / sqrt(n) (s the sample
    standard deviation); None for fewer than 2 values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = (T975[n - 2] if n - 1 <= len(T975) else Z975) * sd / math.sqrt(n)
    return mean - half, mean + half


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided exact sign test on paired binary outcomes, ties dropped: P(X >= wins) for X ~ Binomial(wins +
    losses, 1/2), the chance of at least `wins` first-side wins among the discordant pairs if either side were as
    likely to win each (1.0 with no discordant pair: no evidence).

    Exact for any number of pairs, so it keeps its level where a bootstrap interval cannot (3 wins and 5 ties of 8:
    p = 1/8, not below 0.025). Rejecting at level a is the same as the exact Clopper–Pearson lower bound (1 − 2a
    two-sided) of the first side's share of the discordant pairs lying above 1/2. Computed in integers: the sum of
    binomial coefficients over 2^n, one rounding at the division.
    """
    if wins < 0 or losses < 0:
        raise ValueError(f"sign_test_p: counts must be >= 0, got wins {wins}, losses {losses}")
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n

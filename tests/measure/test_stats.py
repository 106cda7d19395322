"""The exact sign test of `measure.stats` by hand: binomial tails of the discordant pairs, ties dropped."""

from __future__ import annotations

import pytest

from adaptercl.measure.stats import sign_test_p


def test_sign_test_p_by_hand():
    # P(X >= w), X ~ Bin(w + l, 1/2): 3 of 3 is 1/8; 6 of 6 is 1/64; 6 against 1 is (1 + 7) / 128; 8 against 1 is
    # (1 + 9) / 512; 1 against 1 is 3/4; no discordant pair is no evidence
    assert sign_test_p(3, 0) == 0.125
    assert sign_test_p(6, 0) == 1 / 64
    assert sign_test_p(6, 1) == 8 / 128
    assert sign_test_p(8, 1) == 10 / 512
    assert sign_test_p(1, 1) == 0.75
    assert sign_test_p(0, 0) == 1.0 and sign_test_p(0, 5) == 1.0
    # symmetric tails: P(X >= w) + P(X >= l + 1) = 1 for n = w + l (X and n − X have one law)
    for wins, losses in ((4, 7), (10, 3), (1, 0), (12, 12)):
        assert sign_test_p(wins, losses) + sign_test_p(losses + 1, wins - 1) == pytest.approx(1.0, abs=1e-15)
    # large n: scipy.stats.binomtest(120, 200, 0.5, alternative="greater").pvalue = 0.002842577998375153 (SciPy
    # 1.x, also an exact binomial tail); the two sum in different orders, so they agree to a few ulps
    assert sign_test_p(120, 80) == pytest.approx(0.002842577998375153, rel=1e-12)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        sign_test_p(-1, 3)

"""benchmarks/perf/step_time.py: a fixed-length workload whose lengths differ is refused (no ratio), the rollout's
time per generated token is each step's rollout time over its tokens, and a real run of the short workload on the
tiny model has every completion at the cap on both sides (the decode loop honours min_new_tokens)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import step_time as st  # noqa: E402


def test_equal_lengths_pass_and_any_other_length_is_refused_naming_both_sides():
    st.check_fixed_lengths(48, [48.0, 48.0], [[48] * 8, [48] * 8])
    with pytest.raises(st.LengthMismatch, match=r"adaptercl's mean per step \[48.0, 24.9\]"):
        st.check_fixed_lengths(48, [48.0, 24.9], [[48] * 8, [48] * 8])
    with pytest.raises(st.LengthMismatch, match=r"TRL's 17-48 \(1 of 16 not 48\)"):
        st.check_fixed_lengths(48, [48.0, 48.0], [[48] * 8, [48] * 7 + [17]])
    with pytest.raises(st.LengthMismatch, match="0 of 0"):  # TRL recorded nothing: nothing shows equal work
        st.check_fixed_lengths(48, [48.0], [])


def test_rollout_time_per_token_by_hand():
    """2.4 s for 8 x 48 = 384 tokens is 6.25 ms a token; 1 s for 200 tokens, 5 ms."""
    assert st.ms_per_token([2.4, 1.0], [384, 200]) == pytest.approx([6.25, 5.0], rel=1e-12)


def test_the_workloads():
    assert st.WORKLOADS["long-fixed"] == ("domain", 256, True)  # the long prompts, exactly 256 tokens
    assert st.WORKLOADS["long"][2] is False and st.WORKLOADS["short"] == ("arithmetic", 48, True)


@pytest.mark.slow
def test_the_short_workload_is_fixed_length_on_both_sides(tmp_path, monkeypatch):
    """The real script on the tiny model (1 timed step of 2 x 2 rows x 8 tokens): it writes a result, so neither
    side's lengths differed from the cap; the per-token figures are the rollout time over 4 x 8 tokens."""
    argv = ["step_time.py", "--model", "tiny-random", "--steps", "1", "--warmup", "0", "--max-new-tokens", "8"]
    monkeypatch.setattr(sys, "argv", [*argv, "--group-size", "2", "--out", str(tmp_path)])
    monkeypatch.setattr(st, "provenance", lambda: {})  # the command, git and machine: not what is tested
    assert st.main() == 0
    result = json.loads((tmp_path / "step_time-tiny-random.json").read_text())
    assert result["fixed_length_ok"] is True
    assert result["completion_len"]["adaptercl_mean"] == 8 and result["completion_len"]["trl_min"] == 8
    assert result["raw"]["adaptercl_rollout_tokens"] == [32] and result["raw"]["trl_rollout_tokens"] == [32]
    expected = 1000 * result["raw"]["adaptercl_rollout_s"][0] / 32
    assert result["rollout_ms_per_token"]["adaptercl"]["median"] == pytest.approx(expected, rel=1e-12)

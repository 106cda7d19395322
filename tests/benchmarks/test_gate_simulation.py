"""benchmarks/science/gate_simulation.py: the lift gate's false-open rate and power through its own decision
functions. The committed result keeps the gate's level; the script's exact rates match a hand computation and its
simulated ones agree with them within Monte Carlo error."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from adaptercl.train.lift_gate import smallest_opening_lift

SCIENCE = Path(__file__).resolve().parents[2] / "benchmarks" / "science"
spec = importlib.util.spec_from_file_location("gate_simulation", SCIENCE / "gate_simulation.py")
gate_simulation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gate_simulation)


def test_the_committed_simulation_keeps_the_gates_level_and_says_how_it_was_made():
    result = json.loads((SCIENCE / "gate_simulation.json").read_text())
    assert result["false_open_rate"] <= 0.05  # issue 43's bar, over the simulated null settings
    assert result["false_open_rate_exact"] <= result["level"] == 0.025  # the exact test's own bound
    assert (result["rule"], result["min_pairs"]) == ("lower_bound", 8)
    # every null and lift setting at the default 16 prompts and beyond
    assert {r["prompts"] for r in result["null"]} == set(gate_simulation.PROMPTS) and 16 in gate_simulation.PROMPTS
    assert {(r["base"], r["contexts"]) for r in result["null"] if r["prompts"] == 16} == {
        (b, c) for b in (0.2, 0.5, 0.8) for c in (1, 3)
    }
    assert {r["lift"] for r in result["power"]} == {0.1, 0.2, 0.3}
    assert result["smallest_opening_lift"] == {str(p): smallest_opening_lift(p) for p in gate_simulation.PROMPTS}
    # the rule it replaced opened without lift more often than its stated 2.5 %
    assert result["previous_rule"]["false_open_rate"] > result["level"]
    assert result["meta"]["versions"]["adaptercl_git"] and result["meta"]["machine"]["cpu"]


def test_the_exact_rates_by_hand():
    # nested, 8 prompts: every prompt a teacher-only win w.p. the lift, never a student-only one; the gate opens from
    # 6 wins on: P(Bin(8, 0.3) >= 6) = 28·0.3^6·0.7^2 + 8·0.3^7·0.7 + 0.3^8 = 0.01129221
    opens = gate_simulation.decisions(8)
    assert gate_simulation.exact_rate(opens, 8, *gate_simulation.discordance(0.5, 0.3, "nested")) == pytest.approx(
        0.01129221, rel=1e-12
    )
    # which outcomes of 8 open it: p = 1/64, 1/128, 1/256 for 6, 7, 8 wins alone; 6 or 7 wins against 1 loss give
    # 8/128 and 9/256, above 0.025
    assert sorted(k for k, opened in opens.items() if opened) == [(6, 0), (7, 0), (8, 0)]
    # independent, base 0.5, no lift: a win and a loss w.p. 1/4 each, a tie w.p. 1/2:
    # 28·(1/4)^6·(1/2)^2 + 8·(1/4)^7·(1/2) + (1/4)^8 = (28 + 4 + 1/4) / 4^7 = 0.0019683837890625
    assert gate_simulation.discordance(0.5, 0.0, "independent") == (0.25, 0.25)
    assert gate_simulation.exact_rate(opens, 8, 0.25, 0.25) == pytest.approx(32.25 / 4**7, rel=1e-12)


def test_the_simulated_rates_agree_with_the_exact_ones():
    result = gate_simulation.run(reps=300, prompts_settings=(8,))
    for row in result["null"] + result["power"]:
        if "exact" not in row:
            continue
        # the simulated share of 300 checks is Binomial(300, exact) / 300: within 5 of its standard deviations
        sd = math.sqrt(row["exact"] * (1 - row["exact"]) / 300)
        assert abs(row["simulated"] - row["exact"]) <= 5 * sd + 1 / 300, row
    assert result["false_open_rate_exact"] <= 0.025

"""benchmarks/perf/plan_bounds.py: the committed markdown comes out again from today's plan, the what-if speed-up acts
on the vLLM calls alone and exactly, and the speed-up it reports for 5 h is the one at which the plan is 5 h."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import plan_bounds as pb  # noqa: E402


def test_the_committed_markdown_comes_out_again(tmp_path):
    assert pb.main(["--out", str(tmp_path / "plan_bounds.md")]) == 0
    assert (tmp_path / "plan_bounds.md").read_text() == (REPO / "benchmarks/perf/results/plan_bounds.md").read_text()


def test_the_speed_up_divides_the_vllm_time_and_nothing_else():
    """generate_s is linear in 1 / (LoRA ratio x 4-bit ratio): a speed-up s divides rollouts by s exactly (float
    rounding of a few products: rel 1e-12), and leaves the training step as it is."""
    planned, faster = pb.hours("grpo"), pb.hours("grpo", 2.5)
    assert faster["rollouts"] == pytest.approx(planned["rollouts"] / 2.5, rel=1e-12)
    assert faster["evaluation"] == pytest.approx(planned["evaluation"] / 2.5, rel=1e-12)
    assert faster["training"] == planned["training"]
    assert pb.hours("grpo", train_ratio=1.5)["training"] == pytest.approx(1.5 * planned["training"], rel=1e-15)


def test_the_reported_speed_up_is_where_the_plan_is_the_target():
    s = pb.speedup_for("hybrid", pb.TARGET_H)
    assert s is not None and s > 1
    assert sum(pb.hours("hybrid", s).values()) <= pb.TARGET_H  # the bisection's upper end: at or under the target
    assert sum(pb.hours("hybrid", s / 1.002).values()) > pb.TARGET_H  # and 0.2 % slower is over it


def test_none_where_free_vllm_calls_leave_too_much():
    assert sum(pb.hours("sdft", pb.FREE).values()) > pb.TARGET_H
    assert pb.speedup_for("sdft", pb.TARGET_H) is None
    assert pb.speedup_for("grpo", 100.0) == 1.0  # a target the plan meets as it is

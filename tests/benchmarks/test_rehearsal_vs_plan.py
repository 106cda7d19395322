"""benchmarks/perf/rehearsal_vs_plan.py: the committed markdown comes out again from the committed rehearsal results,
the measured parts are read as documented, and a result whose recorded plan is not its rebuilt recipe's is refused."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import rehearsal_vs_plan as rvp  # noqa: E402

RESULTS = REPO / "benchmarks" / "perf" / "results"


def test_the_committed_markdown_comes_out_again(tmp_path):
    assert rvp.main(["--out", str(tmp_path / "rehearse_24gb.md")]) == 0
    assert (tmp_path / "rehearse_24gb.md").read_text() == (RESULTS / "rehearse_24gb.md").read_text()


def test_the_measured_parts_by_hand():
    result = {
        "step_times": {
            "math": [
                {"step": 1, "time_step_s": 10.0, "time_rollout_s": 4.0},
                {"step": 2, "time_step_s": 7.0, "time_rollout_s": 5.0},
                {"step": 3, "time_step_s": 9.0, "time_rollout_s": 6.0},
            ],
            "science": [{"step": 1, "time_step_s": 12.0, "time_rollout_s": 5.0}],
        },
        "calls": {"teacher_lift": {"n": 2, "seconds": 120.0}, "stage_kl": {"n": 0, "seconds": 0.0}},
    }
    parts = rvp.measured_parts(result)
    assert parts["train_step"] == [2.0, 3.0] and parts["rollout_step"] == [5.0, 6.0]  # after each stage's first
    assert parts["train_step (a stage's first)"] == [6.0, 7.0]
    assert parts["rollout_step (a stage's first)"] == [4.0, 5.0]
    assert parts["teacher_lift"] == [60.0, 60.0]  # the mean of its calls, n times
    assert "stage_kl" not in parts and "evaluation" not in parts  # not called / not recorded


def test_the_rehearsals_prompt_length_is_read_from_its_changes():
    result = json.loads((RESULTS / "rehearse_24gb.json").read_text())
    assert rvp.prompt_tokens(result) == 1024


def test_a_result_whose_plan_is_not_its_recipes_is_refused():
    result = json.loads((RESULTS / "rehearse_24gb-calls.json").read_text())
    tampered = copy.deepcopy(result)
    tampered["plan_as_run"]["phases"]["rollout"]["gib"] += 0.5
    with pytest.raises(SystemExit, match="rebuilt recipe's plan"):
        rvp.compare(tampered)
    assert rvp.compare(result)["card"].startswith("H200")


def test_the_plans_check_figures_are_the_rehearsals():
    """`plan.rehearsal_check` (printed by `recipe plan`) is what the committed rehearsals give: each time ratio from
    the first result that measured it, the memory of the first result, rounded as written there."""
    from adaptercl.plan import rehearsal_check

    ratios, memory = {}, None
    for name in rvp.RESULTS:
        comparison = rvp.compare(json.loads((RESULTS / name).read_text()))
        for part, _, _, _, ratio in comparison["time"]:
            ratios.setdefault(part, round(ratio, 2))
        memory = memory or {row[0]: (round(row[1], 2), round(row[5], 2)) for row in comparison["memory"] if row[5]}
    assert rehearsal_check.TIME_RATIO == {part: ratios[part] for part in rehearsal_check.TIME_RATIO}
    assert set(rehearsal_check.TIME_RATIO) == {part for part in ratios if "first" not in part}
    assert rehearsal_check.MEMORY_GIB == memory

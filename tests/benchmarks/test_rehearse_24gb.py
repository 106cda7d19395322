"""benchmarks/perf/rehearse_24gb.py at a tiny shape on CPU: the real run of recipes/hybrid.yaml goes through every
phase it measures, and its JSON holds each phase beside the plan's prediction for the very recipe that ran."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import adaptercl.run.sequence as run
import adaptercl.train.stage as stage
from adaptercl.plan.memory import plan_recipe
from adaptercl.recipe.grammar import resolve_recipe
from adaptercl.rollout.engine_choice import with_engine

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "perf"))
import rehearse_24gb  # noqa: E402


def test_tiny_rehearsal_measures_every_phase_beside_the_plan(tmp_path, monkeypatch):
    import adaptercl.model.batching as batching

    originals = (run.run_stage, stage.train_on_batch, run.evaluate_all, run.response_drift)
    replayable, prefill = [], batching.prefill
    monkeypatch.setattr(batching, "prefill", lambda *a, **k: replayable.append(k["replayable"]) or prefill(*a, **k))
    argv = ["--tiny", "--steps", "1", "--prompts-per-step", "1", "--prompt-tokens", "96", "--out", str(tmp_path)]
    progress = tmp_path / "progress.json"
    assert (
        rehearse_24gb.main([*argv, "--checkpoint-dir", str(tmp_path / "checkpoint"), "--progress", str(progress)]) == 0
    )
    assert True in replayable  # CUDA's path: the training forwards share the group's prompt under checkpointing
    result = json.loads((tmp_path / "rehearse_24gb-tiny.json").read_text())
    assert result["failed"] is None and result["stopped"] is None
    assert result["recipe"] == "recipes/hybrid.yaml"  # no path of the machine in a result, but the command's own
    assert str(tmp_path) not in json.dumps({k: v for k, v in result.items() if k != "command"})
    assert result["plan_as_run"]["text"].startswith(f"plan: {rehearse_24gb.CHECKPOINT_LABEL} on a 24 GiB GPU")
    assert list(result["phases"]) == list(rehearse_24gb.PHASES)
    # the progress file, rewritten as each phase closed, holds the figures up to the last phase's close
    so_far = json.loads(progress.read_text())
    assert set(so_far["seconds"]) == {name for name, p in result["phases"].items() if p["seconds"] > 0}
    assert so_far["decode_step_s"] == result["decode_step_s"]
    # seconds per instrumented function: each diagnostic once per stage, one training step per stage
    assert {name: result["calls"][name]["n"] for name in ("teacher_lift", "response_drift", "stage_kl")} == {
        "teacher_lift": 3,
        "response_drift": 3,
        "stage_kl": 3,
    }
    assert result["calls"]["train_on_batch"]["n"] == 3 and result["calls"]["train_on_batch"]["seconds"] > 0
    for name in ("load", "rollout", "train", "eval", "diagnostics"):  # each phase was entered and took time
        assert result["phases"][name]["seconds"] > 0, name
    # without vLLM (no CUDA here) auto runs the transformers engine, and the JSON says so
    assert result["engine"]["engine"] == "hf" and "transformers engine was measured" in result["engine"]["note"]
    # the plan's prediction is the plan of the recipe that ran (its engine), phase by phase
    raw, _ = rehearse_24gb.rehearsal_raw(
        argparse.Namespace(
            recipe=REPO / "recipes" / "hybrid.yaml",
            probes=False,
            prompt_tokens=96,
            steps=1,
            prompts_per_step=1,
            eval_examples=2,
            eval_new_tokens=8,
            tiny=True,
            tiny_new_tokens=8,
        ),
        tmp_path / "checkpoint",
        tmp_path / "again",
    )
    plan = plan_recipe(with_engine(resolve_recipe(raw), "hf"), gpu_memory_gib=24.0, prompt_tokens=96)
    assert plan.phases and {p.name for p in plan.phases} <= set(result["phases"])
    for phase in plan.phases:
        assert result["phases"][phase.name]["planned_gib"] == phase.gib
        assert result["plan_as_run"]["phases"][phase.name]["gib"] == phase.gib
    # every stage's step was timed, and the decode steps of the rollouts
    assert {name: len(steps) for name, steps in result["step_times"].items()} == {
        "math": 1,
        "science": 1,
        "tooluse": 1,
    }
    assert result["decode_step_s"]["rollout"]["n"] == 3
    assert (run.run_stage, stage.train_on_batch, run.evaluate_all, run.response_drift) == originals  # restored


def test_an_out_of_memory_error_is_reported_with_its_phase(tmp_path, monkeypatch):
    import torch

    def no_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(stage, "train_on_batch", no_memory)
    argv = ["--tiny", "--steps", "1", "--prompts-per-step", "1", "--prompt-tokens", "96", "--out", str(tmp_path)]
    assert rehearse_24gb.main([*argv, "--checkpoint-dir", str(tmp_path / "checkpoint")]) == 1
    result = json.loads((tmp_path / "rehearse_24gb-tiny.json").read_text())
    assert result["failed"] == {
        "phase": "train",
        "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    }
    assert result["phases"]["rollout"]["seconds"] > 0  # the first rollout ran, then its training step failed
    assert result["step_times"] == {"math": [], "science": [], "tooluse": []}  # no step finished
    assert stage.train_on_batch is no_memory  # the meter's patches are undone


def test_a_deadline_stops_the_rehearsal_before_the_next_phase_and_keeps_its_figures(tmp_path):
    argv = ["--tiny", "--steps", "1", "--prompts-per-step", "1", "--prompt-tokens", "96", "--out", str(tmp_path)]
    assert rehearse_24gb.main([*argv, "--checkpoint-dir", str(tmp_path / "checkpoint"), "--deadline-s", "0"]) == 0
    result = json.loads((tmp_path / "rehearse_24gb-tiny.json").read_text())
    assert result["failed"] is None
    assert result["stopped"].startswith("0 s passed before a ")  # the first phase after loading was not opened
    assert result["phases"]["load"]["seconds"] > 0
    assert all(result["phases"][name]["seconds"] == 0 for name in ("rollout", "train", "eval", "diagnostics"))
    assert result["step_times"] == {"math": [], "science": [], "tooluse": []}


def test_the_meter_raises_at_its_deadline_and_not_before(tmp_path):
    meter = rehearse_24gb.PhaseMeter(False, deadline=3600.0, progress=tmp_path / "progress.json")
    meter.enter("rollout")
    meter.leave()
    assert set(json.loads((tmp_path / "progress.json").read_text())["seconds"]) == {"load", "rollout"}
    meter.deadline = 0.0
    try:
        meter.enter("eval")
    except rehearse_24gb.DeadlineReached as err:
        assert str(err) == "0 s passed before a eval phase"
    else:
        raise AssertionError("no DeadlineReached past the deadline")
    assert meter.stack == ["load"]  # the phase was not opened
    meter.close()
